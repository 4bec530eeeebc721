"""EnvironmentOnceSession resolves what plain requests resolves, once per URL."""

from __future__ import annotations

import pytest
import requests

from collectors._export_session import EnvironmentOnceSession

URL = "http://collector.example:4318/v1/metrics"


def _settings(session: requests.Session, url: str = URL, proxies: dict | None = None) -> dict:
    return session.merge_environment_settings(url, proxies or {}, None, None, None)


@pytest.mark.parametrize("env", [
    {},
    {"HTTP_PROXY": "http://proxy.example:3128"},
    {"HTTP_PROXY": "http://proxy.example:3128", "NO_PROXY": "collector.example"},
    {"REQUESTS_CA_BUNDLE": "/etc/ssl/certs/ca-certificates.crt"},
])
def test_it_resolves_what_requests_resolves(monkeypatch: pytest.MonkeyPatch,
                                            env: dict[str, str]) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy", "REQUESTS_CA_BUNDLE",
                 "CURL_CA_BUNDLE", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    once = EnvironmentOnceSession()
    assert _settings(once) == _settings(requests.Session())
    assert _settings(once) == _settings(requests.Session())  # from the cache this time


def test_the_environment_is_read_once_per_url_and_explicit_proxies_still_win(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.setenv("HTTP_PROXY", "http://first.example:3128")
    once = EnvironmentOnceSession()
    first = _settings(once)
    monkeypatch.setenv("HTTP_PROXY", "http://second.example:3128")
    assert _settings(once) == first  # resolved once: a job's environment does not move
    assert _settings(once, "http://other.example/v1/metrics")["proxies"]["http"] == (
        "http://second.example:3128")
    explicit = {"http": "http://explicit.example:8080"}
    assert _settings(once, proxies=explicit)["proxies"]["http"] == "http://explicit.example:8080"
    _settings(once)["proxies"]["http"] = "mutated by a caller"
    assert _settings(once) == first
