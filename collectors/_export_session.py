"""An HTTP session for the OTLP exporters that reads the environment once per URL.

``requests`` re-resolves proxies and the CA bundle from ``os.environ`` on every request: about
0.3 ms of the 1.7 ms an export of a training job's 26 points costs the job's export thread on a
2-core CPU, one fifth of it (``bench/export_session.py``). A job's environment does not change
under it, so the settings resolved for the first export of a URL hold for every later one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import requests


class EnvironmentOnceSession(requests.Session):
    """``requests.Session`` whose environment settings (proxies, ``REQUESTS_CA_BUNDLE``) are
    resolved once per URL and per-request arguments, then reused, as ``requests`` would have
    resolved them each time."""

    def __init__(self) -> None:
        super().__init__()
        self._settings: dict[tuple[str, Any, Any, Any, Any], dict[str, Any]] = {}

    def merge_environment_settings(self, url: str, proxies: dict[str, str] | None,
                                   stream: Any, verify: Any, cert: Any) -> dict[str, Any]:
        key = (url, _frozen(proxies), stream, verify, _frozen(cert))
        settings = self._settings.get(key)
        if settings is None:
            settings = super().merge_environment_settings(url, proxies, stream, verify, cert)
            self._settings[key] = settings
        return {**settings, "proxies": dict(settings["proxies"])}


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted(value.items()))
    if isinstance(value, list):
        return tuple(value)
    return value
