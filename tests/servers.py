"""Real servers the tests start on loopback: free ports, a Prometheus server, and the job token
in the environment."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tuner._token import TOKEN_ENV

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
QUERY_WAIT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_prometheus(binary: str, workdir: Path, *targets: str, scrape_extra: str = ""
                     ) -> tuple[subprocess.Popen[bytes], str]:
    """Prometheus scraping ``targets`` (HOST:PORT) every second; ``scrape_extra`` is YAML
    added to the scrape job (e.g. ``metric_relabel_configs``), indented by four spaces."""
    config = workdir / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: seedance-sidecar\n"
        f"    static_configs:\n      - targets: [{', '.join(repr(t) for t in targets)}]\n"
        + scrape_extra)
    port = free_port()
    log = (workdir / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    log.close()
    return proc, f"http://127.0.0.1:{port}"


def query(api: str, promql: str) -> list[dict[str, object]]:
    url = f"{api}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = json.load(reply)
    except OSError:  # not listening yet
        return []
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(api: str, promql: str, proc: subprocess.Popen[bytes], deadline: float,
             log: Path) -> list[dict[str, object]]:
    """Poll ``promql`` until it returns finite values (bounded by ``deadline``, monotonic s)."""
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"prometheus exited: {log.read_text()[-2000:]}"
        result = query(api, promql)
        if result and all(math.isfinite(float(r["value"][1])) for r in result):  # type: ignore[index]
            return result
        time.sleep(0.5)
    pytest.fail(f"no data for {promql!r} within {QUERY_WAIT_S} s; "
                f"prometheus log: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def job_token_in_env(token: str) -> Iterator[None]:
    """Jobs attached inside the block (threads, or processes started in it) find ``token``
    where a job does, in $SEEDANCE_TOKEN; the variable is put back after."""
    before = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = token
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = before
