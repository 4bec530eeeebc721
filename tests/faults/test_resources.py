"""Bounded resources, visible: a cardinality flood is dropped and counted with memory flat; a
full disk under the store or the state DB is refused (503 with the reason and Retry-After),
makes /readyz say why, and heals when space comes back. Real sidecar processes on loopback;
the full disk is a real one (a 1-4 MiB tmpfs) where this machine lets root mount, else the
store's own size cap (SQLite's max_page_count), which fails the same way."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults._sidecar import PROTOBUF, ROOT, TOKEN, SidecarProcess, gauge_request, record

pytestmark = pytest.mark.integration


def test_a_cardinality_flood_is_dropped_counted_and_memory_stays_flat(tmp_path: Path) -> None:
    with SidecarProcess(tmp_path, max_series_per_metric=500) as sidecar:
        def flood(first: int) -> None:
            for start in range(first, first + 20_000, 5_000):
                r = sidecar.http.post("/v1/metrics", headers=PROTOBUF,
                                      content=gauge_request("flood.gauge", range(start,
                                                                                 start + 5_000)))
                assert r.status_code == 200, r.text

        flood(0)
        after_first = sidecar.rss_mib()
        for i in range(1, 4):  # 60,000 more distinct series
            flood(i * 20_000)
        grown = sidecar.rss_mib() - after_first
        dropped = sidecar.wait_for("the dropped-points counter", lambda: (
            sidecar.metric("seedance_ingest_dropped_points_total", limit="metric") or 0)
            >= 79_500 and sidecar.metric("seedance_ingest_dropped_points_total",
                                         limit="metric"))
        record("cardinality_flood", series_sent=80_000, series_admitted=500,
               points_dropped=dropped, rss_after_first_20000_mib=round(after_first, 1),
               rss_growth_over_next_60000_mib=round(grown, 1))
        assert dropped == 80_000 - 500
        assert grown < 20, f"RSS grew {grown:.1f} MiB over 60,000 refused series"
        # the admitted series are all there, in the store and on /metrics
        exposed = [line for line in sidecar.http.get("/metrics").text.splitlines()
                   if line.startswith("flood_gauge{")]
        assert len(exposed) == 500


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs: a real file system that fills up."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(folder: Path) -> Path:
    """Take every free byte of ``folder``'s file system; the filler file, to free it later."""
    filler = folder / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


def test_a_full_disk_under_the_store_is_refused_visible_and_heals(small_disk: Path,
                                                                  tmp_path: Path) -> None:
    with SidecarProcess(tmp_path, store=small_disk / "metrics.db",
                        policy_interval_s=1) as sidecar:
        body = gauge_request("disk.gauge", range(50), times=20)
        assert sidecar.http.post("/v1/metrics", headers=PROTOBUF, content=body).status_code \
            == 200
        filler = _fill(small_disk)
        # points keep coming (the store's writer only fails when it has something to commit)
        sidecar.wait_for("the store to fail", lambda: sidecar.http.post(
            "/v1/metrics", headers=PROTOBUF, content=gauge_request(
                "disk.gauge", range(50), times=1, t0_ns=10**17)).status_code in (200, 503)
            and sidecar.http.get("/readyz").status_code == 503)
        ready = sidecar.http.get("/readyz").json()
        assert ready["ready"] is False
        assert any("store not writable" in r and "full" in r for r in ready["reasons"]), ready
        sidecar.wait_for("seedance_store_writable 0", lambda: sidecar.metric(
            "seedance_store_writable") == 0)
        finding = sidecar.wait_for("a finding that says why", lambda: next(
            (f for f in sidecar.http.get("/v1/findings").json()
             if f["detector"] == "sidecar_unwritable"), None))
        assert finding["severity"] == "critical" and finding["resource"] == {"part": "store"}
        # ingest answers 503 with Retry-After once the bounded buffer is full, never 200
        # and buffering forever
        refused = None
        for i in range(1000):  # 1,000,000 points: five times the buffer
            r = sidecar.http.post("/v1/metrics", headers=PROTOBUF,
                                  content=gauge_request("disk.gauge", range(1000), times=1,
                                                        t0_ns=10**18 + i * 10**9))
            if r.status_code == 503:
                refused = r
                break
            assert r.status_code == 200
        assert refused is not None and refused.headers["Retry-After"]
        record("store_disk_full", requests_accepted_after_full=i,
               retry_after_s=int(refused.headers["Retry-After"]),
               readyz_reasons=ready["reasons"], finding=finding["evidence"]["summary"])
        assert sidecar.proc.poll() is None
        filler.unlink()
        sidecar.wait_for("the store to heal", lambda: sidecar.http.get(
            "/readyz").status_code == 200, timeout_s=60)
        sidecar.wait_for("seedance_store_writable 1", lambda: sidecar.metric(
            "seedance_store_writable") == 1)
        sidecar.wait_for("the finding to close", lambda: not any(
            f["detector"] == "sidecar_unwritable"
            for f in sidecar.http.get("/v1/findings").json()))


def test_a_full_disk_under_the_state_db_is_a_503_with_the_reason(small_disk: Path,
                                                                 tmp_path: Path) -> None:
    with SidecarProcess(tmp_path, state_db=f"sqlite:///{small_disk / 'state.db'}") as sidecar:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        job = {"knobs": [{"name": "precision.ffn", "default": "fp32",
                          "choices": ["fp32", "bf16"]}], "baseline": {}, "lease_ttl_s": 60}
        assert sidecar.http.post("/v1/jobs/gpt/attach", headers=headers,
                                 json=job).status_code == 200
        filler = _fill(small_disk)
        propose = {"values": {"precision.ffn": "bf16"}, "by": "alice",
                   "reason": "disk test " * 2000}
        r = sidecar.http.post("/v1/jobs/gpt/changes", headers=headers, json=propose)
        assert r.status_code == 503, r.text[:300]
        assert r.json()["detail"].startswith("state DB not writable:") and "full" in r.text
        assert any("state DB not writable" in reason
                   for reason in sidecar.http.get("/readyz").json()["reasons"])
        cli = subprocess.run(
            [sys.executable, "-m", "seedancectl.cli", "precision", "set", "--sidecar",
             sidecar.url, "--job", "gpt", "ffn=bf16"],
            capture_output=True, text=True, timeout=60, env={"SEEDANCE_TOKEN": TOKEN,
                                                             "PATH": "/usr/bin:/bin"})
        assert cli.returncode != 0 and "state DB not writable" in cli.stderr, cli.stderr
        assert "Traceback" not in cli.stderr
        record("state_db_disk_full", api_status=503, api_detail=r.json()["detail"],
               cli_stderr=cli.stderr.strip())
        filler.unlink()
        r = sidecar.http.post("/v1/jobs/gpt/changes", headers=headers, json=propose)
        assert r.status_code == 201, r.text[:300]  # space is back: the change is made


def test_a_store_on_a_read_only_file_system_is_refused_in_one_line(small_disk: Path,
                                                                    tmp_path: Path) -> None:
    """The disk went read-only while the sidecar was down (Linux refuses to remount a file
    system read-only under open writers, so this is how the case reaches a sidecar): it
    refuses to start, in one line that names the path, and leaves nothing behind."""
    with SidecarProcess(tmp_path, store=small_disk / "metrics.db") as sidecar:
        assert sidecar.http.post("/v1/metrics", headers=PROTOBUF, content=gauge_request(
            "ro.gauge", range(10))).status_code == 200
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "seedancectl.sidecar", "--config",
             str(tmp_path / "sidecar.toml")], capture_output=True, text=True, timeout=120,
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and str(small_disk) in lines[0], done.stderr
    assert "listening" not in done.stdout + done.stderr
    record("store_read_only_at_start", exit_code=done.returncode, error=lines[0])
