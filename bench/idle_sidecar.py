"""Benchmark: what an idle sidecar with a large job costs, old code against new, side by side.

An idle sidecar still ingests its job's telemetry, folds it into rollups and runs the policy
pass every 5 s over the job's window; at 16 sidecars on 2 cores (issue #14's fleet bench) that
is most of the box. Each round starts two sidecars at once on loopback, one per arm, on their
defaults but ``tune = false`` (no trial: the idle cost alone), each with its own SIMULATED job
(``bench/_fleet_job.py``: 8 ranks x 500 module-group norms every 5 s, the real lease client and
instrumentation around a sleep):

- ``base``: the code at ``--base`` (a git worktree made for the run);
- ``new``: this tree.

After ``--warmup-s`` (the policy window fills), each sidecar's CPU (user + system seconds from
/proc) over ``--seconds`` is its share of a core. Both arms run at the same time, so the box's
drift hits them alike; rounds repeat it.

Target: new at most base (median of the rounds' new / base ratios).

Run: python bench/idle_sidecar.py [--base HEAD~1 --rounds 2 --seconds 180]
Results: bench/results/idle_sidecar.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._targets import Target, at_most, judged  # noqa: E402
from bench._worktree import worktree  # noqa: E402
from tests.servers import free_port  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "idle_sidecar.json"
TOKEN = "idle-bench-token"
ARMS = ("base", "new")


def targets(result: dict[str, Any]) -> list[Target]:
    """No regression: the new code's idle CPU at most the old's."""
    return [at_most("idle sidecar CPU, new / base (median of rounds)", 1.0,
                    result["summary"]["new_over_base"],
                    "bench docstring (issue #14: an idle sidecar's CPU is the fleet's box)")]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_arm(work: Path, arm: str, tree: Path) -> tuple[subprocess.Popen[bytes], ...]:
    """One sidecar running ``tree``'s code, and its simulated job."""
    folder = work / arm
    folder.mkdir()
    port, job = free_port(), f"idle-{arm}"
    (folder / "token").write_text(TOKEN + "\n")
    config = folder / "sidecar.toml"
    config.write_text("\n".join([
        f'job = "{job}"', f'listen = "127.0.0.1:{port}"', f'store = "{folder / "metrics.db"}"',
        f'state_db = "sqlite:///{folder / "state.db"}"', f'token_file = "{folder / "token"}"',
        'nvml = "off"', "", f'[jobs."{job}"]', "tune = false", ""]))
    with (folder / "sidecar.log").open("wb") as log:
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "seedancectl.sidecar", "--config", str(config)], cwd=folder,
            env={**os.environ, "PYTHONPATH": str(tree)}, stdout=log, stderr=subprocess.STDOUT)
    time.sleep(8)  # listening before its job attaches
    with (folder / "job.log").open("wb") as log:
        simulated = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "_fleet_job.py"), "--sidecar",
             f"http://127.0.0.1:{port}", "--token", TOKEN, "--job", job],
            cwd=folder, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
            stderr=subprocess.STDOUT)
    return sidecar, simulated


def stop_arms(procs: dict[str, tuple[subprocess.Popen[bytes], ...]]) -> None:
    """Stop every arm's job, then its sidecar."""
    for sidecar, simulated in procs.values():
        simulated.terminate()
        sidecar.terminate()
    for sidecar, simulated in procs.values():
        simulated.wait(30)
        sidecar.wait(60)


def one_round(trees: dict[str, Path], warmup_s: float, seconds: float) -> dict[str, float]:
    """Both arms side by side; each sidecar's share of a core over ``seconds``."""
    work = Path(tempfile.mkdtemp(prefix="seedance-idle-"))
    procs = {arm: start_arm(work, arm, trees[arm]) for arm in ARMS}
    try:
        time.sleep(warmup_s)
        before = {arm: cpu_s(p[0].pid) for arm, p in procs.items()}
        start = time.monotonic()
        time.sleep(seconds)
        after = {arm: cpu_s(p[0].pid) for arm, p in procs.items()}
        took = time.monotonic() - start
        for arm, (sidecar, _) in procs.items():
            if sidecar.poll() is not None:
                raise SystemExit(f"the {arm} sidecar exited: see {work / arm / 'sidecar.log'}")
        return {arm: (after[arm] - before[arm]) / took for arm in ARMS}
    finally:
        stop_arms(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="revision of the base arm")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    args = parser.parse_args()
    base = worktree(args.base, "seedance-idle-base-")
    try:
        rounds = [one_round({"base": base, "new": ROOT}, args.warmup_s, args.seconds)
                  for _ in range(args.rounds)]
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                       check=False, capture_output=True)
    ratios = [r["new"] / r["base"] for r in rounds]
    result: dict[str, Any] = {
        "bench": "idle_sidecar",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "base": args.base,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "protocol": __doc__,
        "rounds": [{"core_share": r, "new_over_base": q} for r, q in zip(rounds, ratios,
                                                                         strict=True)],
        "summary": {"base_core_share_median": statistics.median(r["base"] for r in rounds),
                    "new_core_share_median": statistics.median(r["new"] for r in rounds),
                    "new_over_base": statistics.median(ratios)},
    }
    result = judged(result, targets(result))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for i, r in enumerate(rounds):
        print(f"round {i}: base {r['base']:.4f} core, new {r['new']:.4f} core, "
              f"new / base {ratios[i]:.3f}")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
