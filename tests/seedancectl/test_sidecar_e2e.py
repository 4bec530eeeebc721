"""The sidecar as a user runs it: a real process, a job using the stock OTel SDK, the CLI."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from seedancectl._config import SidecarConfig
from tests.servers import free_port, start_prometheus, wait_for

SENDER = textwrap.dedent("""
    import sys
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    reader = PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=sys.argv[1]), export_interval_millis=3_600_000)
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create(
        {"service.name": "llm-train", "seedance.rank": 1}))
    meter = provider.get_meter("e2e")
    version = {"seedance.config.version": "7"}
    meter.create_gauge("seedance.train.tokens_per_second").set(1234.5, version)
    meter.create_counter("seedance.comm.allreduce.calls").add(12, version)
    steps = meter.create_histogram("seedance.train.step.duration", unit="s")
    for seconds in (0.25, 0.5, 2.0):
        steps.record(seconds, version)
    provider.shutdown()
""")


class Sidecar:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, store: Path) -> None:
        self.proc, self.url, self.store = proc, url, store


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    port = free_port()
    store = tmp_path / "metrics.db"
    log = (tmp_path / "sidecar.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "seedancectl.sidecar", "--job", "e2e", "--listen", f"127.0.0.1:{port}",
         "--store", str(store), "--nvml", "replay:h100_gpu_burn"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (tmp_path / "sidecar.log").read_text()
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "sidecar never became ready"
        time.sleep(0.2)
    yield Sidecar(proc, url, store)
    proc.terminate()
    proc.wait(15)
    log.close()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "seedancectl.cli", *args], capture_output=True,
                          text=True, timeout=60)


def query_until(store: Path, name: str, *extra: str) -> list[dict[str, object]]:
    """The store flushes on an interval: poll the CLI (a second process) for a bounded time.
    Until the first flush the store does not hold the metric, which the CLI calls unknown
    (exit 2); that is the only failure polled past."""
    deadline = time.monotonic() + 20
    while True:
        result = cli("metrics", "query", name, "--store", str(store), "--since", "10m",
                     "--json", *extra)
        not_yet = result.returncode == 2 and "unknown metric" in result.stderr
        assert result.returncode == 0 or not_yet, result.stderr
        points = [] if not_yet else json.loads(result.stdout)["points"]
        if points or time.monotonic() > deadline:
            return points
        time.sleep(0.5)


@pytest.mark.integration
def test_an_idle_keep_alive_connection_outlives_a_clients_pool_expiry(sidecar: Sidecar) -> None:
    """A client pool (httpx, 5 s) closes its idle connections itself; the sidecar must not
    close one first, or a request sent as it does is reset (a fleet reader saw that)."""
    host, port = sidecar.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        first = None
        for wait_s in (0.0, 6.0):  # past httpx's 5 s expiry, and uvicorn's default
            time.sleep(wait_s)
            conn.request("GET", "/healthz")  # on a connection the server closed: an error
            response = conn.getresponse()
            assert response.status == 200
            response.read()
            first = first or conn.sock
        assert conn.sock is first  # the same connection, not a new one
    finally:
        conn.close()


def _niceness(stat: Path) -> int:
    return int(stat.read_text().rsplit(")", 1)[1].split()[16])


def _threads(pid: int) -> dict[str, list[int]]:
    """Each thread name of ``pid``: the niceness of every thread so named."""
    found: dict[str, list[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.setdefault((task / "comm").read_text().strip(), []).append(
            _niceness(task / "stat"))
    return found


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_sidecar_yields_the_cpu_to_the_job_by_default(sidecar: Sidecar) -> None:
    """It shares cores with the job it measures: by default its bulk work (policy passes,
    store flushes, decoding) runs ``nice`` (5) niceness steps below the priority it was
    started with, while the thread that answers the API and the job's leases keeps that
    priority."""
    base = _niceness(Path(f"/proc/{os.getpid()}/stat"))
    sent = subprocess.run([sys.executable, "-c", SENDER, f"{sidecar.url}/v1/metrics"],
                          capture_output=True, text=True, timeout=60)
    assert sent.returncode == 0, sent.stderr  # an export, so the ingest pool has started
    threads = _threads(sidecar.proc.pid)
    assert _niceness(Path(f"/proc/{sidecar.proc.pid}/stat")) == base  # the event loop's
    lowered = min(base + SidecarConfig.model_fields["nice"].default, 19)
    assert lowered > base
    for name in ("policy-engine", "store-flush:met", "otlp-ingest_0"):
        assert threads.get(name) == [lowered], (name, threads)


@pytest.mark.integration
def test_stock_sdk_job_metrics_reach_the_cli_with_their_attributes(sidecar: Sidecar) -> None:
    sent = subprocess.run([sys.executable, "-c", SENDER, f"{sidecar.url}/v1/metrics"],
                          capture_output=True, text=True, timeout=60)
    assert sent.returncode == 0, sent.stderr

    (gauge,) = query_until(sidecar.store, "seedance.train.tokens_per_second")
    assert gauge["value"] == 1234.5
    assert gauge["service.name"] == "llm-train"
    assert gauge["seedance.rank"] == "1"
    assert gauge["seedance.config.version"] == "7"

    (counter,) = query_until(sidecar.store, "seedance.comm.allreduce.calls")
    assert counter["value"] == 12

    (count,) = query_until(sidecar.store, "seedance.train.step.duration.count")
    (total,) = query_until(sidecar.store, "seedance.train.step.duration.sum")
    assert (count["value"], total["value"]) == (3, 2.75)
    buckets = query_until(sidecar.store, "seedance.train.step.duration.bucket",
                          "--where", "le=+Inf")
    assert [b["value"] for b in buckets] == [3]

    # Filtering by a value the metric never had is a typo, not a quiet metric: one line that
    # names the values it holds, exit 2.
    wrong = cli("metrics", "query", "seedance.train.tokens_per_second", "--store",
                str(sidecar.store), "--since", "10m", "--where", "seedance.rank=0")
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr.strip().splitlines() == [wrong.stderr.strip()]
    assert "unknown seedance.rank '0'" in wrong.stderr and "known: 1" in wrong.stderr

    listing = cli("metrics", "list", "--store", str(sidecar.store), "--json")
    names = {row["name"] for row in json.loads(listing.stdout)}
    assert {"seedance.train.tokens_per_second", "hw.power", "hw.gpu.up"} <= names

    # Replayed GPU counters are labelled as such.
    power = query_until(sidecar.store, "hw.power")
    assert power and all(p["seedance.replayed"] == "true" for p in power)


@pytest.mark.integration
def test_bad_requests_do_not_stop_the_sidecar(sidecar: Sidecar) -> None:
    bad = httpx.post(f"{sidecar.url}/v1/metrics", content=b"\x0a\xff\xff",
                     headers={"Content-Type": "application/x-protobuf"})
    assert bad.status_code == 400
    good = subprocess.run([sys.executable, "-c", SENDER, f"{sidecar.url}/v1/metrics"],
                          capture_output=True, timeout=60)
    assert good.returncode == 0
    assert query_until(sidecar.store, "seedance.train.tokens_per_second")


@pytest.mark.integration
def test_real_prometheus_scrapes_a_training_metric_from_the_sidecar(
        sidecar: Sidecar, prometheus_binary: str, prometheus_dir: Path) -> None:
    sent = subprocess.run([sys.executable, "-c", SENDER, f"{sidecar.url}/v1/metrics"],
                          capture_output=True, timeout=60)
    assert sent.returncode == 0
    target = sidecar.url.removeprefix("http://")
    proc, api = start_prometheus(prometheus_binary, prometheus_dir, target)
    try:
        result = wait_for(api, 'seedance_train_tokens_per_second{service_name="llm-train"}',
                          proc, time.monotonic() + 30, prometheus_dir / "prometheus.log")
        assert float(result[0]["value"][1]) == 1234.5  # type: ignore[index]
        assert result[0]["metric"]["seedance_config_version"] == "7"  # type: ignore[index]
    finally:
        proc.terminate()
        proc.wait(15)


def test_cli_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    missing = cli("metrics", "query", "x", "--store", str(tmp_path / "none.db"))
    assert missing.returncode == 2
    assert "no store here" in missing.stderr and "Traceback" not in missing.stderr
    bad_where = cli("metrics", "query", "x", "--where", "nokey", "--store", "x.db")
    assert bad_where.returncode == 2 and "KEY=VALUE" in bad_where.stderr
    bad_trace = subprocess.run(
        [sys.executable, "-m", "seedancectl.sidecar", "--nvml", "replay:nonexistent",
         "--store", str(tmp_path / "m.db")],
        capture_output=True, text=True, timeout=60, env={**os.environ})
    assert bad_trace.returncode == 2
    assert "no NVML trace" in bad_trace.stderr and "Traceback" not in bad_trace.stderr


@pytest.mark.integration
def test_the_sidecar_serves_tls_and_the_job_attaches_over_it(tmp_path: Path) -> None:
    """A real self-signed certificate (openssl), a real sidecar process serving TLS, and the
    in-job lease client trusting that certificate through SSL_CERT_FILE."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                   timeout=60)
    (tmp_path / "token").write_text("tls-token\n")
    config = tmp_path / "sidecar.toml"
    config.write_text(
        f'[sidecar]\nlisten = "127.0.0.1:{free_port()}"\nstore = "{tmp_path / "m.db"}"\n'
        f'state_db = "sqlite:///{tmp_path / "state.db"}"\nnvml = "off"\n'
        f'token_file = "{tmp_path / "token"}"\n'
        f'tls_cert_file = "{cert}"\ntls_key_file = "{key}"\n')
    port = config.read_text().split("127.0.0.1:")[1].split('"')[0]
    log = (tmp_path / "sidecar.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "seedancectl.sidecar", "--config",
                             str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"https://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "sidecar.log").read_text()
            try:
                if httpx.get(f"{url}/readyz", timeout=1, verify=str(cert)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "sidecar never became ready"
            time.sleep(0.2)
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
        job = subprocess.run(
            [sys.executable, "-c", ATTACH_OVER_TLS, url], capture_output=True, text=True,
            timeout=120, env={**os.environ, "SSL_CERT_FILE": str(cert),
                              "SEEDANCE_TOKEN": "tls-token"})
        assert job.returncode == 0, job.stderr
        jobs = httpx.get(f"{url}/v1/jobs", verify=str(cert)).json()
        assert [j["job"] for j in jobs] == ["tls-job"]
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


ATTACH_OVER_TLS = """
import sys, time
from tuner.job import attach_serving
session = attach_serving(job="tls-job", sidecar=sys.argv[1], apply=lambda values: None)
deadline = time.monotonic() + 60
while session.version == 0:
    session.boundary()
    assert time.monotonic() < deadline, "never attached"
    time.sleep(0.1)
session.close()
"""


def test_startup_failures_are_one_line_before_the_banner(tmp_path: Path) -> None:
    config = tmp_path / "sidecar.toml"
    config.write_text(f'[sidecar]\nlisten = "127.0.0.1:{free_port()}"\nnvml = "off"\n'
                      f'store = "{tmp_path / "m.db"}"\ntoken_file = "{tmp_path / "missing"}"\n')
    for args in (["seedancectl.sidecar", "--config", str(config)],
                 ["seedancectl.cli", "config", "check", str(config)]):
        done = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2, done.stderr
        assert "token_file" in done.stderr and str(tmp_path / "missing") in done.stderr
        assert "Traceback" not in done.stderr and "listening on" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def _duration_counts(text: str) -> dict[tuple[str, str], float]:
    """(route, status) -> how many answers ``/metrics`` counted, from the duration histogram."""
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("http_server_request_duration") \
                    and sample.name.endswith("_count"):
                key = (sample.labels["http_route"], sample.labels["http_response_status_code"])
                counts[key] = sample.value
    return counts


@pytest.mark.integration
def test_the_sidecar_times_its_own_answers_per_route_template(sidecar: Sidecar) -> None:
    """An operator reading a slow client latency must be able to tell the sidecar's part from
    the rest: each answer's duration, by route template (never the raw path: a change id per
    series would grow without bound) and status."""
    with httpx.Client(base_url=sidecar.url, timeout=10) as http:
        for _ in range(5):
            assert http.get("/v1/status").status_code == 200
        assert http.get("/v1/changes/no-such-change").status_code == 404
        # OTLP ingest is served before the framework's routing (`_direct_routes`): still timed
        assert http.post("/v1/metrics", content=b"",
                         headers={"Content-Type": "application/x-protobuf"}).status_code == 200
        assert http.post("/v1/metrics", content=b"{}",
                         headers={"Content-Type": "text/plain"}).status_code == 415
        deadline = time.monotonic() + 20
        while True:  # the sidecar's own telemetry exports every second
            counts = _duration_counts(http.get("/metrics").text)
            if (counts.get(("/v1/status", "200"), 0) >= 5
                    and counts.get(("/v1/changes/{change_id}", "404"), 0) >= 1
                    and counts.get(("/v1/metrics", "415"), 0) >= 1) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    assert counts.get(("/v1/status", "200")) == 5, counts
    assert counts.get(("/v1/changes/{change_id}", "404")) == 1, counts
    assert counts.get(("/v1/metrics", "415")) == 1, counts
    assert counts.get(("/v1/metrics", "200")) == 1, counts
    assert not any("no-such-change" in route for route, _ in counts), counts
