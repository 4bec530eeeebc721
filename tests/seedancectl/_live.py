"""A real sidecar (uvicorn on 127.0.0.1, free port) in a thread, a SIMULATED job that holds a
real lease over HTTP, and a real HTTP server that records webhook posts."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from seedancectl._config import SidecarConfig
from seedancectl._sidecar import Sidecar
from tests.servers import free_port, job_token_in_env

TOKEN = "test-token-0123456789"
KNOBS = [
    {"name": "threads", "default": 2, "low": 1, "high": 8, "integer": True},
    {"name": "precision.ffn", "default": "fp32", "choices": ["fp32", "bf16"], "risk": "high"},
    {"name": "kv.key_bits", "default": 16, "choices": [2, 4, 8, 16]},
    {"name": "kv.value_bits", "default": 16, "choices": [2, 4, 8, 16]},
    {"name": "scheduler.policy", "default": "static", "choices": ["static", "dynamic-topo"],
     "scope": "restart", "risk": "high"},
    {"name": "scheduler.rdma", "default": False, "choices": [False, True], "scope": "restart",
     "risk": "high"},
    {"name": "scheduler.numa_aware", "default": False, "choices": [False, True],
     "scope": "restart", "risk": "high"},
]


class Live:
    def __init__(self, sidecar: Sidecar, url: str, token_file: Path) -> None:
        self.sidecar, self.url, self.token_file = sidecar, url, token_file
        self.http = httpx.Client(base_url=url, timeout=10)

    def post(self, path: str, body: dict[str, Any], token: str | None = TOKEN) -> httpx.Response:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        return self.http.post(path, json=body, headers=headers)

    def get(self, path: str, **params: Any) -> Any:
        reply = self.http.get(path, params=params)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def wait_state(self, change_id: str, *states: str, timeout_s: float = 20) -> dict[str, Any]:
        """Poll until the change is in one of ``states`` (bounded, not a timing assertion)."""
        deadline = time.monotonic() + timeout_s
        while True:
            change = self.get(f"/v1/changes/{change_id}")
            if change["state"] in states:
                return change  # type: ignore[no-any-return]
            assert time.monotonic() < deadline, f"still {change['state']}, wanted {states}"
            time.sleep(0.05)


class SimulatedJob:
    """SIMULATED job: attaches with KNOBS and acks configs over the real lease protocol."""

    def __init__(self, live: Live, job: str = "gpt") -> None:
        self.live, self.job = live, job
        self.http = httpx.Client(base_url=live.url, timeout=10,
                                 headers={"Authorization": f"Bearer {TOKEN}"})
        reply = self.http.post(f"/v1/jobs/{job}/attach", json={
            "knobs": KNOBS, "baseline": {}, "lease_ttl_s": 60})
        assert reply.status_code == 200, reply.text
        self.session = reply.json()["session"]
        self.version = reply.json()["config"]["version"]

    def lease(self) -> dict[str, Any]:
        reply = self.http.get(f"/v1/jobs/{self.job}/lease",
                              params={"session": self.session, "version": -1, "wait_s": 0})
        assert reply.status_code == 200, reply.text
        return reply.json()  # type: ignore[no-any-return]

    def ack_latest(self, step: int = 1) -> dict[str, Any]:
        lease = self.lease()
        self.version = lease["config"]["version"]
        reply = self.http.post(f"/v1/jobs/{self.job}/ack", json={
            "session": self.session, "version": self.version, "step": step,
            "status": "applied", "actions": [{**a, "status": "done"} for a in lease["actions"]]})
        assert reply.status_code == 200, reply.text
        return lease


class Webhook:
    """A real HTTP server on 127.0.0.1 that records the JSON bodies posted to it."""

    def __init__(self) -> None:
        received: list[dict[str, Any]] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers["Content-Length"])
                received.append(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, predicate: Callable[[dict[str, Any]], bool],
             timeout_s: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [m for m in self.received if predicate(m)]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no matching webhook post; got {self.received}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def live_sidecar(tmp_path: Path, **overrides: Any) -> Iterator[Live]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    config = SidecarConfig.model_validate({
        "job": "test", "listen": f"127.0.0.1:{free_port()}", "store": tmp_path / "metrics.db",
        "state_db": f"sqlite:///{tmp_path / 'state.db'}", "nvml": "off",
        "token_file": token_file, "policy_interval_s": 60, "tuning_interval_s": 0.05,
        **overrides})
    port = config.port
    sidecar = Sidecar(config, environ={})
    server = uvicorn.Server(uvicorn.Config(sidecar.app(), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (server.started and sidecar.started):
        assert thread.is_alive() and time.monotonic() < deadline, "sidecar did not start"
        time.sleep(0.02)
    live = Live(sidecar, f"http://127.0.0.1:{port}", token_file)
    try:
        with job_token_in_env(TOKEN):
            yield live
    finally:
        live.http.close()
        server.should_exit = True
        thread.join(30)
