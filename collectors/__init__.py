"""Getting numbers in: OpenTelemetry set-up, NVML, torch instrumentation, receiver, store.

Importing this package never imports torch; the torch instrumentation lives in modules the
job imports explicitly.
"""

from collectors._catalogue import BY_NAME, CATALOGUE, MetricSpec
from collectors._points import CONFIG_VERSION_ATTR, REPLAYED_ATTR, MetricKind, Point

__all__ = [
    "BY_NAME",
    "CATALOGUE",
    "CONFIG_VERSION_ATTR",
    "REPLAYED_ATTR",
    "MetricKind",
    "MetricSpec",
    "Point",
]
