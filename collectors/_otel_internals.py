"""The two OpenTelemetry internals the collectors need, in one place.

- ``SyncGauge``: the SDK's synchronous gauge class. A reader's preferred temporality is keyed
  by instrument class and the SDK exports that class only as ``opentelemetry.sdk.metrics._Gauge``
  (the API's ``Gauge`` is not the key the reader matches); ``_changed_points`` sets it to DELTA.
- The OTel-to-Prometheus name translation of ``opentelemetry-exporter-prometheus``
  (``_mapping``): the exposition must name series exactly as that exporter does, and spelling
  the translation again here would drift from it.

``tests/collectors/test_otel_internals.py`` fails first when a release moves either.
"""

from __future__ import annotations

from opentelemetry.exporter.prometheus._mapping import (
    map_unit,
    sanitize_attribute,
    sanitize_full_name,
)
from opentelemetry.sdk.metrics import _Gauge as SyncGauge

__all__ = ["SyncGauge", "map_unit", "sanitize_attribute", "sanitize_full_name"]
