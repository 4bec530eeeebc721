"""The Prometheus reader's names, settings and errors; what it reads from a real Prometheus is
held to the store readers' contract in tests/conformance/test_store_readers.py and, in a fleet,
in tests/seedancectl/test_prometheus_fleet.py."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from collectors import (
    ConfigError,
    PrometheusError,
    PrometheusNameError,
    PrometheusSource,
    SeedanceError,
    prom_metric,
)
from collectors._prometheus_source import prometheus_duration_s
from tests.servers import free_port, start_prometheus

NS = 1_000_000_000


def test_a_name_the_catalogue_lacks_or_the_wrong_kind_is_refused() -> None:
    with pytest.raises(PrometheusNameError, match="not in the metric catalogue"):
        prom_metric("seedance.train.step.seconds")
    with pytest.raises(PrometheusNameError, match="not a sum"):
        _ = prom_metric("hw.power").total
    with pytest.raises(PrometheusNameError, match="no attribute 'reason'"):
        prom_metric("hw.power").label("reason")
    assert issubclass(PrometheusNameError, SeedanceError)


def test_an_attribute_the_catalogue_does_not_list_is_sanitised_as_the_exporter_does() -> None:
    tokens = prom_metric("seedance.train.tokens")
    assert tokens.label_of("seedance.config.version") == "seedance_config_version"
    assert tokens.label_of("k8s.pod.name") == "k8s_pod_name"


def test_names_and_resolutions_are_refused_before_any_request() -> None:
    with PrometheusSource(f"http://127.0.0.1:{free_port()}") as reader:
        for name in ("seedance.train.step.seconds", "seedance.train.loss.bucket",
                     "seedance.train.step.duration.p99"):
            with pytest.raises(PrometheusNameError):
                reader.query(name, since_ns=0, until_ns=NS)
        with pytest.raises(PrometheusError, match="resolution"):
            reader.query("seedance.train.loss", resolution="5m")  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "seconds"), [("1s", 1.0), ("15s", 15.0), ("1m30s", 90.0),
                                               ("500ms", 0.5), ("2h", 7200.0), ("1d", 86400.0)])
def test_prometheus_durations(text: str, seconds: float) -> None:
    assert prometheus_duration_s(text) == seconds


@pytest.mark.parametrize("text", ["", "1", "1x", "s", "1s ", "-1s"])
def test_what_is_not_a_prometheus_duration(text: str) -> None:
    with pytest.raises(PrometheusError, match="not a Prometheus duration"):
        prometheus_duration_s(text)


@pytest.mark.parametrize(("url", "kwargs", "field"), [
    ("127.0.0.1:9090", {}, "http:// or https://"),
    ("http://127.0.0.1:9090", {"timeout_s": 0}, "timeout_s"),
    ("http://127.0.0.1:9090", {"lookback_s": -1}, "lookback_s"),
    ("http://127.0.0.1:9090", {"settle_s": -0.5}, "settle_s")])
def test_settings_out_of_their_domain(url: str, kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        PrometheusSource(url, **kwargs)


def test_a_prometheus_nobody_listens_for_is_one_line() -> None:
    with PrometheusSource(f"http://127.0.0.1:{free_port()}", timeout_s=5) as reader:
        for call in (reader.scrape_interval_s,
                     lambda: reader.query("seedance.train.loss", since_ns=0, until_ns=NS)):
            with pytest.raises(PrometheusError, match="^Prometheus at http://127.0.0.1") as e:
                call()
            assert "\n" not in str(e.value)


class _Refusing(http.server.BaseHTTPRequestHandler):
    """A proxy in front of Prometheus that refuses every request with a two-line reason."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b'{"status": "error", "error": "upstream down\\nretry later"}'
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_error_reply_is_one_line_with_the_status(refusing: str) -> None:
    with PrometheusSource(refusing) as reader:
        with pytest.raises(PrometheusError, match="answered 503: upstream down retry later$"):
            reader.query("seedance.train.loss", since_ns=0, until_ns=NS)


@pytest.mark.integration
def test_a_prometheus_that_scrapes_nothing_has_no_scrape_interval(
        prometheus_binary: str, prometheus_dir: Path) -> None:
    proc, api = start_prometheus(prometheus_binary, prometheus_dir)
    try:
        with PrometheusSource(api, timeout_s=5) as reader:
            deadline = time.monotonic() + 30
            while True:  # until it answers at all
                try:
                    interval_s = reader.scrape_interval_s()
                except PrometheusError as e:
                    if "scrapes no targets" in str(e):
                        break
                else:
                    pytest.fail(f"no targets, yet a scrape interval of {interval_s} s")
                assert time.monotonic() < deadline, "Prometheus never answered"
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(10)
