"""Benchmark: a fleet of sidecars on one PostgreSQL. Does it keep up, and does it lose anything?

For each N in ``--sidecars`` (default 1, 4, 16), in one run, against one real PostgreSQL 15
(``tests/postgres.py``: initdb + pg_ctl on loopback, a fresh database per N):

- N ``seedancectl sidecar`` processes on loopback, default settings but for what a fleet must
  set (listen port, store, the shared ``state_db``, token, ``nvml = "off"``, approval mode
  ``auto`` and ``tune = true`` for its one job);
- N SIMULATED training jobs (``bench/_fleet_job.py``: the real lease client and training
  instrumentation around a sleep whose length depends on the config), one per sidecar, each
  with ``--ranks`` ranks x ``--series`` live series (8 x 500 by default);
- 4 API readers (threads of a process of their own) calling ``/v1/status``, ``/v1/changes``
  and ``/v1/findings`` of the sidecars in turn, every call timed;
- a study prober: 2 threads (of another process), each running the project's own ``tuner.SearchDriver`` as a
  sidecar's search does (``next_move``: choose a move, enqueue and ask, under the study's lock;
  then ``tell``; each call timed) every 0.5 s on the simulated job's knobs, in the same
  database: the latency a sidecar's search sees from the shared PostgreSQL under the fleet's
  load;
- every second, PostgreSQL's lock waits (``pg_locks`` not granted), deadlocks and client
  connections (against its ``max_connections``; a refused connection is logged by a sidecar);
- every 10 s, each sidecar's RSS (``/proc/PID/status``).

The measured ``--minutes`` start once every job holds its lease (``jobs_attached_after_s``),
so they time a running fleet, not N jobs importing torch at once. Latencies are also given
by phase: before the outage, in the first 60 s after it, and later.

With ``--kill-postgres`` (on for the largest N): at half time PostgreSQL is stopped
(``immediate``: every connection dropped, as in a crash) for ``--outage-s`` (30) seconds, then
started again. During the outage every sidecar is probed every 2 s: its job must keep its lease
(the job's acked config is what the sidecar last gave it; nothing lapses), ``/readyz`` must say
why it is not ready, and a proposed change must be refused with a reason. After it: every
sidecar must be ready again by itself, and new changes must be proposed.

At the end the jobs and then the sidecars stop (SIGTERM), and the database is audited:
duplicate trials (two changes for one study trial, or two running trials of one config),
lost changes (an event whose change is missing, a change without its ``proposed`` event),
orphaned ones (a change left in flight, a trial left running, a finished change whose trial is
still open). Proposals/s is the changes proposed per second of the run.

Targets (the issue's, at N = 16): zero duplicate, lost and orphaned trials and changes; study
ask/tell p99 <= 200 ms; API p99 <= 100 ms; each sidecar's RSS <= 300 MiB. The JSON states each
and whether it was met.

Run: python bench/fleet.py [--sidecars 1,4,16 --minutes 4 --kill-postgres-at 16]
Results: bench/results/fleet.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._fleet_knobs import KNOBS, timed_step  # noqa: E402
from bench._targets import Target, at_most, block, holds, judged  # noqa: E402
from seedancectl._sidecar import settle_heap  # noqa: E402
from tests.postgres import MAX_CONNECTIONS as POSTGRES_MAX_CONNECTIONS  # noqa: E402
from tests.postgres import PostgresServer  # noqa: E402
from tests.servers import free_port  # noqa: E402
from tuner import KnobSpace, SearchConfig, SearchDriver  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "fleet.json"
TOKEN = "fleet-bench-token"
IN_FLIGHT = ("proposed", "approved", "applying", "observing")
PROBE_STUDY = "fleet-bench-probe-"
PATHS = ("/v1/status", "/v1/changes", "/v1/findings")
RECOVERY_S = 60.0  # after PostgreSQL is back: the sidecars reconnect and catch up
TARGETS = {"ask_tell_p99_ms": 200.0, "api_p99_ms": 100.0, "sidecar_rss_mib": 300.0}


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def latency(samples: list[tuple[float, float]], outage: dict[str, Any] | None
            ) -> dict[str, Any]:
    """Calls, p50 and p99 of (wall clock, ms) samples over the run (what the targets judge),
    and, in a run with an outage, the same before it, in the first ``RECOVERY_S`` after
    PostgreSQL is back, and after that: where the tail comes from."""
    ms = [m for _, m in samples]
    out: dict[str, Any] = {"calls": len(ms), "p50_ms": percentile(ms, 50),
                           "p99_ms": percentile(ms, 99)}
    if outage is not None:
        up_s = outage["up_at_ns"] / 1e9
        phases = {"before_outage": [m for t, m in samples if t < up_s - outage["down_s"]],
                  f"first_{RECOVERY_S:.0f}s_after": [
                      m for t, m in samples if up_s <= t < up_s + RECOVERY_S],
                  "later": [m for t, m in samples if t >= up_s + RECOVERY_S]}
        out["by_phase"] = {name: {"calls": len(v), "p50_ms": percentile(v, 50),
                                  "p99_ms": percentile(v, 99)} for name, v in phases.items()}
    return out


def slow_calls(api_ms: list[tuple[float, float, str, int]]) -> dict[str, Any]:
    """The calls over 100 ms (each with its time, path and sidecar), and how many of them
    have another sidecar's slow call ending within 50 ms: when slow calls come together
    across sidecars, the cause is the box (its run queue, the reading process), not one
    sidecar."""
    slow = sorted((t, ms, path, k) for t, ms, path, k in api_ms if ms > 100)
    together = sum(any(abs(t - u) < 0.05 and k != j for u, _, _, j in slow)
                   for t, _, _, k in slow)
    return {"calls": len(slow), "with_another_sidecars_slow_call_within_50_ms": together,
            "each": [{"at": round(t, 3), "ms": round(ms, 1), "path": path, "sidecar": k}
                     for t, ms, path, k in slow]}


def served(http: httpx.Client, sidecars: list[Sidecar]) -> dict[str, Any]:
    """The readers' calls as the sidecars themselves timed them (``http.server.request.duration``
    from each one's ``/metrics``, answers 200 on ``PATHS``, summed; the whole run, outage
    included): what share of the API's latency is spent inside the sidecars, in all and by
    path. Its p99 is a bucket's upper bound, not a sample."""
    buckets: dict[str, dict[float, float]] = {path: {} for path in PATHS}
    calls = dict.fromkeys(PATHS, 0.0)
    for s in sidecars:
        for family in text_string_to_metric_families(http.get(f"{s.url}/metrics").text):
            for sample in family.samples:
                route = sample.labels.get("http_route")
                if (not sample.name.startswith("http_server_request_duration")
                        or route not in PATHS
                        or sample.labels.get("http_response_status_code") != "200"):
                    continue
                if sample.name.endswith("_bucket"):
                    bound = float(sample.labels["le"])
                    buckets[route][bound] = buckets[route].get(bound, 0.0) + sample.value
                elif sample.name.endswith("_count"):
                    calls[route] += sample.value

    def summary(counts: dict[float, float], n: float) -> dict[str, Any]:
        p99 = next((b for b in sorted(counts) if counts[b] >= 0.99 * n), None)
        return {"calls": n, "p99_at_most_ms": None if p99 is None else p99 * 1e3,
                "share_over_100_ms": (n - counts.get(0.1, 0.0)) / n if n else None}

    total: dict[float, float] = {}
    for counts in buckets.values():
        for bound, n in counts.items():
            total[bound] = total.get(bound, 0.0) + n
    return {**summary(total, sum(calls.values())),
            "by_path": {path: summary(buckets[path], calls[path]) for path in PATHS}}


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds the process has used (``/proc/PID/stat``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def box_cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all the box's cores so far (``/proc/stat``)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def table_bytes(state_db: str) -> dict[str, int]:
    """Each table's size on disk with its indexes and TOAST: what the fleet's state costs."""
    engine = create_engine(state_db)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT relname, pg_total_relation_size(relid) AS bytes "
                                 "FROM pg_stat_user_tables ORDER BY bytes DESC"))
        sizes = {row.relname: int(row.bytes) for row in rows}
    engine.dispose()
    return sizes


def revision() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()


class Sidecar:
    """One sidecar process of the fleet and its simulated job."""

    def __init__(self, work: Path, index: int, n: int, state_db: str) -> None:
        self.job = f"fleet{n}-{index}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        folder = work / f"sidecar{index}"
        folder.mkdir(parents=True)
        (folder / "token").write_text(TOKEN + "\n")
        self.config = folder / "sidecar.toml"
        self.config.write_text("\n".join([
            f'job = "{self.job}"', f'listen = "127.0.0.1:{self.port}"',
            f'store = "{folder / "metrics.db"}"', f'state_db = "{state_db}"',
            f'token_file = "{folder / "token"}"', 'nvml = "off"', "", "[approval]",
            'mode = "auto"', "", f'[jobs."{self.job}"]', "tune = true", ""]))
        self.folder = folder
        self.proc: subprocess.Popen[bytes] | None = None
        self.job_proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str]) -> None:
        with (self.folder / "sidecar.log").open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "seedancectl.sidecar", "--config", str(self.config)],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.folder)

    def start_job(self, env: dict[str, str], ranks: int, series: int, seed: int) -> None:
        with (self.folder / "job.log").open("wb") as log:
            self.job_proc = subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / "_fleet_job.py"), "--sidecar", self.url,
                 "--token", TOKEN, "--job", self.job, "--ranks", str(ranks), "--series",
                 str(series), "--seed", str(seed)],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.folder)

    def stop(self, proc: subprocess.Popen[bytes] | None, timeout_s: float = 30.0) -> int | None:
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def wait_ready(http: httpx.Client, sidecars: list[Sidecar], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(sidecars)
    while pending:
        for s in list(pending):
            try:
                if http.get(f"{s.url}/readyz").status_code == 200:
                    pending.remove(s)
            except httpx.HTTPError:
                pass
            if s.proc is not None and s.proc.poll() is not None:
                raise SystemExit(f"sidecar {s.job} exited; see {s.folder / 'sidecar.log'}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{len(pending)} sidecar(s) not ready in {timeout_s:.0f} s")
        time.sleep(0.5)


def wait_attached(http: httpx.Client, sidecars: list[Sidecar], timeout_s: float) -> None:
    """Until every simulated job holds a lease: the measurement starts on a running fleet,
    not on N jobs importing torch at once on the same cores (that start-up was most of the
    API's p99 in an N = 16 run)."""
    deadline = time.monotonic() + timeout_s
    pending = list(sidecars)
    while pending:
        pending = [s for s in pending if job_lease(http, s).get("state") is None]
        for s in pending:
            if s.job_proc is not None and s.job_proc.poll() is not None:
                raise SystemExit(f"job {s.job} exited; see {s.folder / 'job.log'}")
        if pending and time.monotonic() > deadline:
            raise SystemExit(f"{len(pending)} job(s) not attached in {timeout_s:.0f} s")
        time.sleep(0.5)


class Loop:
    """A background thread that calls ``body`` every ``every_s`` until stopped."""

    def __init__(self, stop: Any, every_s: float, body: Callable[[], None]) -> None:
        def run() -> None:
            while not stop.wait(every_s):
                try:
                    body()
                except Exception as exc:  # a probe must never end the bench
                    errors.append(f"{body.__qualname__}: {exc}")
        errors: list[str] = []
        self.errors = errors
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()


def study_prober(state_db: str, name: str, stop: Any,
                 latencies: dict[str, list[tuple[float, float]]], outage: Any) -> None:
    """A sidecar's search, minus the job: ``next_move`` (choose a single move, enqueue it and
    ask for it, under the study's lock) and ``tell``, every 0.5 s, on the simulated job's
    knobs; a kept move (one in three) becomes the baseline, and a search that tried every move
    starts a new study. A call made while PostgreSQL is down is not timed (it fails) and is
    tried again after it."""
    space = KnobSpace.of(KNOBS)
    rng = np.random.default_rng()
    search, studies = None, 0
    baseline: dict[str, Any] = {}
    while not stop.is_set():
        if outage.is_set():
            time.sleep(0.5)
            continue
        try:
            if search is None:
                studies += 1
                search = SearchDriver(space, storage_url=state_db, config=SearchConfig(
                    study_name=f"{PROBE_STUDY}{name}-{studies}"))
                baseline = {k.name: k.default for k in KNOBS}
            after, ask_ms, tell_ms = timed_step(search, baseline, space, rng)
            if after is None:
                search = None
                continue
            baseline = after
            if not outage.is_set():
                latencies["ask"].append((time.time(), ask_ms))
                latencies["tell"].append((time.time(), tell_ms))
        except Exception:  # the outage: the next call after it tries again
            time.sleep(0.5)
        stop.wait(0.5)


def api_readers(urls: list[str], stop: Any, outage: Any, results: Any) -> None:
    """A process of its own (the probers' Optuna work must not hold this one's GIL): 4 reader
    threads call ``PATHS`` of the sidecars in turn every 0.25 s, each call timed; calls made
    during the outage are not counted (they may wait on the database). Its start-up heap is
    frozen, as a sidecar's is, so collections of it add no pause to the calls it times."""
    settle_heap()
    api_ms: list[tuple[float, float, str, int]] = []  # (wall clock at the end, ms, path, sidecar)
    errors = Counter[str]()

    def run(k: int) -> None:
        client = httpx.Client(timeout=30.0, headers={"Authorization": f"Bearer {TOKEN}"})
        i = k
        while not stop.wait(0.25):
            i += 1
            sidecar = i % len(urls)
            url, path = urls[sidecar], PATHS[i % len(PATHS)]
            t0 = time.perf_counter()
            try:
                r = client.get(f"{url}{path}")
            except httpx.HTTPError as exc:
                errors[f"{path} {type(exc).__name__}"] += 1
                continue
            ms = (time.perf_counter() - t0) * 1000
            if outage.is_set():
                continue
            if r.status_code == 200:
                api_ms.append((time.time(), ms, path, sidecar))
            else:
                errors[f"{path} {r.status_code}"] += 1

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put({"api_ms": api_ms, "api_errors": dict(errors)})


def study_probers(state_db: str, stop: Any, outage: Any, results: Any) -> None:
    """A process of its own: 2 ``study_prober`` threads, its start-up heap frozen as a
    sidecar's is (``seedancectl._sidecar.settle_heap``)."""
    settle_heap()
    study_ms: dict[str, list[tuple[float, float]]] = {"ask": [], "tell": []}
    threads = [threading.Thread(target=study_prober, args=(state_db, str(k), stop, study_ms,
                                                           outage), daemon=True)
               for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put({"study_ms": study_ms})


def audit(state_db: str) -> dict[str, Any]:
    """Duplicate, lost and orphaned trials and changes, read from the shared database."""
    engine = create_engine(state_db)
    with engine.connect() as conn:
        changes = [(row.id, row.job, row.state, json.loads(row.body)) for row in conn.execute(
            text("SELECT id, job, state, body FROM changes"))]
        events = list(conn.execute(text("SELECT change_id, kind FROM change_events "
                                        "WHERE change_id IS NOT NULL")))
        trials = list(conn.execute(text(
            "SELECT s.study_name, t.number, t.state FROM trials t "
            "JOIN studies s ON s.study_id = t.study_id")))
    engine.dispose()
    ids = {c[0] for c in changes}
    proposed = {e.change_id for e in events if e.kind == "proposed"}
    trial_state = {(t.study_name, t.number): t.state for t in trials}
    per_trial = Counter((c[3]["meta"].get("study"), c[3]["meta"].get("trial"))
                        for c in changes if c[3].get("source") == "trial")
    finished_open = [c[0] for c in changes
                     if c[2] not in IN_FLIGHT and c[3].get("source") == "trial"
                     and trial_state.get((c[3]["meta"]["study"], c[3]["meta"]["trial"]))
                     == "RUNNING"]
    study_trials = {k for k in trial_state if not k[0].startswith(PROBE_STUDY)}
    return {
        "changes": len(changes),
        "changes_by_state": dict(Counter(c[2] for c in changes)),
        "trials": len(study_trials),
        "duplicate_changes_per_trial": sum(n - 1 for n in per_trial.values() if n > 1),
        "lost_events_without_change": len({e.change_id for e in events} - ids),
        "lost_changes_without_proposed_event": len(ids - proposed),
        "orphaned_changes_in_flight": [c[0] for c in changes if c[2] in IN_FLIGHT],
        "orphaned_trials_running": sorted(
            f"{s}#{n}" for (s, n), state in trial_state.items()
            if state == "RUNNING" and not s.startswith(PROBE_STUDY)),
        "orphaned_finished_change_open_trial": finished_open,
    }


def outage_probe(http: httpx.Client, sidecars: list[Sidecar],
                 before: dict[str, Any]) -> dict[str, Any]:
    """What each sidecar does while PostgreSQL is down: readiness, the job's lease, a
    proposal's refusal."""
    ready, kept_lease, refusals = [], [], []
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for s in sidecars:
        try:
            r = http.get(f"{s.url}/readyz")
            ready.append({"job": s.job, "status": r.status_code, "body": r.text[:300]})
        except httpx.HTTPError as exc:
            ready.append({"job": s.job, "status": None, "body": str(exc)})
        lease = job_lease(http, s)
        kept_lease.append({"job": s.job, **lease, "acked_before": before.get(s.job)})
        try:
            r = http.post(f"{s.url}/v1/jobs/{s.job}/changes", headers=auth,
                          json={"values": {"sim.fuse": "on"}, "reason": "outage probe",
                                "by": "bench"})
            refusals.append({"job": s.job, "status": r.status_code, "detail": r.text[:300]})
        except httpx.HTTPError as exc:
            refusals.append({"job": s.job, "status": None, "detail": str(exc)[:300]})
    return {"readyz": ready, "leases": kept_lease, "proposals": refusals}


def job_lease(http: httpx.Client, sidecar: Sidecar) -> dict[str, Any]:
    """The job's lease as the sidecar's lease registry holds it (in memory: no database)."""
    try:
        jobs = http.get(f"{sidecar.url}/v1/jobs",
                        headers={"Authorization": f"Bearer {TOKEN}"}).json()
        job = next(j for j in jobs if j["job"] == sidecar.job)
        return {"state": job["state"], "acked_version": job["acked_version"]}
    except (httpx.HTTPError, StopIteration, KeyError, TypeError, ValueError) as exc:
        return {"state": None, "error": str(exc)[:200]}


def acked_versions(http: httpx.Client, sidecars: list[Sidecar]) -> dict[str, Any]:
    return {s.job: job_lease(http, s).get("acked_version") for s in sidecars}


def run_fleet(server: PostgresServer, n: int, args: argparse.Namespace,
              kill_postgres: bool) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"seedance-fleet{n}-"))
    state_db = server.create_database(f"fleet_{n}_{int(time.time())}")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SEEDANCE_TOKEN": TOKEN}
    sidecars = [Sidecar(work, i, n, state_db) for i in range(n)]
    http = httpx.Client(timeout=30.0)
    for s in sidecars:
        s.start(env)
    wait_ready(http, sidecars, timeout_s=60 + 10 * n)
    launched = time.time()
    for i, s in enumerate(sidecars):
        s.start_job(env, args.ranks, args.series, seed=i)
    wait_attached(http, sidecars, timeout_s=120 + 10 * n)
    attached_after_s = time.time() - launched
    started = time.time()
    cpu_at_start = {s.job: cpu_seconds(s.proc.pid) for s in sidecars if s.proc is not None}
    job_cpu_at_start = {s.job: cpu_seconds(s.job_proc.pid) for s in sidecars
                        if s.job_proc is not None}
    box_at_start = box_cpu_ticks()
    spawn = multiprocessing.get_context("spawn")
    stop, outage, results = spawn.Event(), spawn.Event(), spawn.Queue()
    locks = {"waiting_max": 0, "waiting_samples": 0, "deadlocks": 0}
    connections: list[int] = []  # client connections PostgreSQL holds, every second
    rss: dict[str, list[float]] = {s.job: [] for s in sidecars}
    lock_engine = create_engine(state_db, pool_pre_ping=True)

    def sample_locks() -> None:
        if outage.is_set():
            return
        with lock_engine.connect() as conn:
            waiting = conn.execute(text("SELECT count(*) FROM pg_locks WHERE NOT granted")
                                   ).scalar() or 0
            deadlocks = conn.execute(text(
                "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
            ).scalar() or 0
            connections.append(int(conn.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'")
            ).scalar() or 0))
        locks["waiting_max"] = max(locks["waiting_max"], int(waiting))
        locks["waiting_samples"] += int(waiting > 0)
        locks["deadlocks"] = int(deadlocks)

    def sample_rss() -> None:
        for s in sidecars:
            if s.proc is not None and (value := rss_mib(s.proc.pid)) is not None:
                rss[s.job].append(value)

    loops = [Loop(stop, 1.0, sample_locks), Loop(stop, 10.0, sample_rss)]
    probes_procs = [spawn.Process(target=api_readers, args=([s.url for s in sidecars], stop,
                                                            outage, results)),
                    spawn.Process(target=study_probers, args=(state_db, stop, outage, results))]
    for proc in probes_procs:
        proc.start()
    duration_s = args.minutes * 60
    outage_report: dict[str, Any] | None = None
    if kill_postgres:
        time.sleep(duration_s / 2)
        before = acked_versions(http, sidecars)
        outage.set()
        server.stop("immediate")
        down_at = time.time()
        probes = []
        while time.time() - down_at < args.outage_s:
            time.sleep(2.0)
            probes.append(outage_probe(http, sidecars, before))
        server.start()
        up_at = time.time()
        up_at_ns = time.time_ns()
        outage.clear()
        ready_again: dict[str, float | None] = {s.job: None for s in sidecars}
        while time.time() - up_at < 120 and any(v is None for v in ready_again.values()):
            for s in sidecars:
                if ready_again[s.job] is None:
                    try:
                        if http.get(f"{s.url}/readyz").status_code == 200:
                            ready_again[s.job] = time.time() - up_at
                    except httpx.HTTPError:
                        pass
            time.sleep(1.0)
        outage_report = {"down_s": up_at - down_at, "up_at_ns": up_at_ns, "probes": probes,
                         "ready_again_after_s": ready_again}
        time.sleep(max(0.0, started + duration_s - time.time()))
    else:
        time.sleep(duration_s)
    stop.set()
    measured: dict[str, Any] = {}
    for _ in probes_procs:
        measured.update(results.get(timeout=120))
    for proc in probes_procs:
        proc.join(30)
    api_ms, study_ms = measured["api_ms"], measured["study_ms"]
    sample_rss()
    in_sidecars = served(http, sidecars)
    ended = time.time()
    cpu_share = [(end - begin) / (ended - started) for s in sidecars if s.proc is not None
                 and (begin := cpu_at_start.get(s.job)) is not None
                 and (end := cpu_seconds(s.proc.pid)) is not None]
    job_cores = sum(end - begin for s in sidecars if s.job_proc is not None
                    and (begin := job_cpu_at_start.get(s.job)) is not None
                    and (end := cpu_seconds(s.job_proc.pid)) is not None) / (ended - started)
    box_busy, box_total = (b - a for a, b in zip(box_at_start, box_cpu_ticks(), strict=True))
    job_exits = [s.stop(s.job_proc) for s in sidecars]
    sidecar_exits = [s.stop(s.proc, timeout_s=60) for s in sidecars]
    lock_engine.dispose()
    found = audit(state_db)
    sizes = table_bytes(state_db)
    if outage_report is not None:
        engine = create_engine(state_db)
        with engine.connect() as conn:
            found_after = conn.execute(text(
                "SELECT count(*) FROM changes WHERE created_at_ns > :t"),
                {"t": outage_report["up_at_ns"]}).scalar()
        engine.dispose()
        outage_report["changes_proposed_after_restart"] = found_after
    logs = " ".join((s.folder / "sidecar.log").read_text(errors="replace") for s in sidecars)
    return {
        "sidecars": n, "ranks": args.ranks, "series_per_rank": args.series,
        "jobs_attached_after_s": attached_after_s, "seconds": ended - started,
        "proposals_per_s": found["changes"] / (ended - started),
        "api": {**latency([(t, m) for t, m, _, _ in api_ms], outage_report),
                "errors": measured["api_errors"],
                "share_over_100_ms": sum(m > 100 for _, m, _, _ in api_ms) / max(len(api_ms), 1),
                "by_path": {path: latency([(t, m) for t, m, p, _ in api_ms if p == path], None)
                            for path in PATHS},
                "slow_calls": slow_calls(api_ms),
                "in_sidecars": in_sidecars},
        "study": {op: latency(v, outage_report) for op, v in study_ms.items()},
        "locks": {**locks, "journal_conflicts_logged": logs.count("moved under us")},
        "postgres_connections": {
            "max": max(connections, default=0),
            "median": statistics.median(connections) if connections else 0,
            "max_connections": POSTGRES_MAX_CONNECTIONS,
            "refused_logged": logs.count("too many clients")},
        "rss_mib": {"max": max((max(v) for v in rss.values() if v), default=None),
                    "median_of_max": statistics.median(max(v) for v in rss.values() if v)
                    if any(rss.values()) else None},
        "sidecar_cpu_share": {"median": statistics.median(cpu_share) if cpu_share else None,
                              "max": max(cpu_share, default=None)},
        "box_cpu": {"cores": os.cpu_count(), "busy_fraction": box_busy / max(box_total, 1),
                    "sidecars_cores": sum(cpu_share), "jobs_cores": job_cores,
                    "note": "busy_fraction: all cores, the whole run (PostgreSQL, probers, "
                            "readers and the bench itself included)"},
        "points_per_s_per_sidecar_sent": args.ranks * args.series / 5.0,
        "state_db_bytes": {"total": sum(sizes.values()), "tables": sizes},
        "audit": found,
        "outage": outage_report,
        "exit_codes": {"jobs": job_exits, "sidecars": sidecar_exits},
        "probe_errors": [e for loop in loops for e in loop.errors][:20],
        "work": str(work),
    }


def run_targets(run: dict[str, Any]) -> list[Target]:
    """Issue #14's targets, judged on one run of N sidecars."""
    audit_ = run["audit"]
    counts = {k: audit_[k] if isinstance(audit_[k], int) else len(audit_[k])
              for k in ("duplicate_changes_per_trial", "lost_events_without_change",
                        "lost_changes_without_proposed_event", "orphaned_changes_in_flight",
                        "orphaned_trials_running", "orphaned_finished_change_open_trial")}
    ask_tell = max((run["study"][op]["p99_ms"] or 0.0) for op in ("ask", "tell"))
    return [holds("zero_duplicate_lost_orphaned", "0 duplicate, lost or orphaned trials and "
                  "changes", counts, not any(counts.values()), "issue #14"),
            at_most("ask_tell_p99_ms", TARGETS["ask_tell_p99_ms"], ask_tell, "issue #14"),
            at_most("api_p99_ms", TARGETS["api_p99_ms"], run["api"]["p99_ms"], "issue #14"),
            at_most("sidecar_rss_mib", TARGETS["sidecar_rss_mib"], run["rss_mib"]["max"],
                    "issue #14 (8 ranks x 500 series)")]


def targets(result: dict[str, Any]) -> list[Target]:
    """Issue #14 states its targets at N = 16: judged on the run with the most sidecars."""
    return run_targets(max(result["runs"], key=lambda run: run["sidecars"]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sidecars", default="1,4,16")
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--series", type=int, default=500)
    p.add_argument("--kill-postgres-at", type=int, default=16,
                   help="the N whose run kills PostgreSQL at half time (0: none)")
    p.add_argument("--outage-s", type=float, default=30.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    counts = [int(x) for x in args.sidecars.split(",")]
    runs = []
    with PostgresServer() as server:
        for n in counts:
            print(f"fleet: N = {n} ...", flush=True)
            result = run_fleet(server, n, args, kill_postgres=n == args.kill_postgres_at)
            result["targets"] = block(run_targets(result))["targets"]
            runs.append(result)
            print(json.dumps({k: result[k] for k in ("sidecars", "proposals_per_s", "api",
                                                     "study", "rss_mib", "targets")}),
                  flush=True)
    out = {
        "bench": "fleet", "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "revision": revision(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "protocol": __doc__,
        "runs": runs,
        "targets_at_largest_n": runs[-1]["targets"] if runs else None,
    }
    out = judged(out, targets(out))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
