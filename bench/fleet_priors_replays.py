"""Benchmark: a change to the fleet priors, judged on every recorded run's measurements.

``bench/fleet_priors.py`` measures its truth tables anew each run, on whatever box it runs:
two runs of one code differ by the box's state and its CPU (with fast bf16 or not), and a
change to the search cannot be told from that noise by comparing a new run with an old one.
This replays the searches of each recorded run (``--truth-from``: the run's truth tables and
fingerprints, nothing measured) twice: through this tree's code, and through the code at
``--base`` (a git worktree, running this tree's ``bench/fleet_priors.py`` over its own
``tuner``), so both meet the very same measurements. Per run and family: the cold and warm
trials to the cold kept config, as ``fleet_priors.py`` counts them, for both arms.

A search that asks for a config its run never measured (another code's search took another
path) stops there: ``unmeasured``, counted as not reached, and named in the JSON.

Target (issue #14, as in ``fleet_priors.py``): warm trials <= cold trials / 2 wherever the cold
search needs 2 or more; reported as how many of those family-runs meet it, per arm.

Run: python bench/fleet_priors_replays.py --base REV  (a few minutes: searches only)
Results: bench/results/replays_fleet_priors.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._default_session import code_revision  # noqa: E402
from bench._targets import Target, holds, judged  # noqa: E402
from bench._worktree import base_and_new  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "replays_fleet_priors.json"
RUNS = ("fleet_priors_run_a.json", "fleet_priors_run_b.json", "fleet_priors_run_c.json",
        "fleet_priors_run_d.json", "fleet_priors.json", "fleet_priors_run_f.json",
        "fleet_priors_run_g.json")
"""The recorded runs of ``bench/fleet_priors.py``, oldest first (``fleet_priors.json`` is run
e)."""


def targets(result: dict[str, Any]) -> list[Target]:
    counts = result["met_where_applies"]
    return [holds(f"{arm}: family-runs meeting warm <= cold / 2", "all of them",
                  f"{counts[arm]['met']} of {counts[arm]['applies']}",
                  counts[arm]["met"] == counts[arm]["applies"],
                  "issue #14 (judged where the cold search needs 2 or more trials)")
            for arm in ("base", "new")]


def _replay(tree: Path, recorded: Path, out: Path) -> dict[str, Any]:
    """``fleet_priors.py --truth-from recorded`` run in ``tree``; its families."""
    subprocess.run([sys.executable, str(tree / "bench" / "fleet_priors.py"), "--truth-from",
                    str(recorded), "--out", str(out)], cwd=tree, check=True,
                   capture_output=True, text=True)
    return json.loads(out.read_text(encoding="utf-8"))["families"]


def _counts(family: dict[str, Any]) -> dict[str, Any]:
    unmeasured = {k: family[k]["unmeasured"] for k in ("A", "B_cold", "B_warm")
                  if family[k].get("unmeasured")}
    return {"cold": family["cold_trials_to_kept"], "warm": family["warm_trials_to_kept"],
            "applies": family["target_applies"], "met": family["target_met"],
            "warm_trials": [f"{t['config']} ({t['state']}: {t['origin']})"
                            for t in family["B_warm"]["trials"]],
            **({"unmeasured": unmeasured} if unmeasured else {})}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the code to compare with (a git revision)")
    p.add_argument("--runs", default=",".join(RUNS),
                   help="recorded results files (a bare name: under bench/results), "
                        "comma-separated")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    runs = [ROOT / "bench" / "results" / name.strip() if "/" not in name else Path(name)
            for name in args.runs.split(",") if name.strip()]
    missing = [str(r) for r in runs if not r.is_file()]
    if missing:
        p.error(f"no recorded run at {', '.join(missing)}")
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fleet-replays-") as tmp:
        work = Path(tmp)
        recorded = [Path(shutil.copy(r, work / r.name)) for r in runs]  # outside both trees

        def replay_all(_: int, arm: str, tree: Path) -> dict[str, Any]:
            if tree != ROOT:  # the base tree runs this tree's bench over its own tuner
                shutil.copy(ROOT / "bench" / "fleet_priors.py", tree / "bench")
            return {r.name: _replay(tree, r, work / f"{arm}-{r.name}") for r in recorded}

        base, arms = base_and_new(args.base, "fleet-replays-", 1, replay_all)
    result: dict[str, Any] = {
        "bench": "fleet_priors_replays", "code_revision": code_revision(), "base": base,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "measurement": "replayed measurement: each recorded run's truth tables, measured "
                       "when it ran (on its box), nothing measured by this run",
        "runs": {}, "met_where_applies": {}, "warm_trials_both_reached": {},
        "wall_s": None,
    }
    for arm in ("base", "new"):
        for name, families in arms[arm][0].items():
            for family_name, family in families.items():
                result["runs"].setdefault(name, {}).setdefault(family_name, {})[arm] = \
                    _counts(family)
    pairs = [f for families in result["runs"].values() for f in families.values()]
    for arm in ("base", "new"):
        result["met_where_applies"][arm] = {"met": sum(bool(f[arm]["met"]) for f in pairs),
                                            "applies": sum(bool(f[arm]["applies"])
                                                           for f in pairs)}
        result["warm_trials_both_reached"][arm] = sum(
            f[arm]["warm"] for f in pairs
            if f["base"]["warm"] is not None and f["new"]["warm"] is not None)
    result["wall_s"] = round(time.monotonic() - began, 1)
    result = judged(result, targets(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for name, families in result["runs"].items():
        print(name + ": " + "; ".join(
            f"{f} {c['base']['cold']}->{c['base']['warm']} | {c['new']['cold']}->"
            f"{c['new']['warm']}{' (unmeasured)' if 'unmeasured' in c['new'] else ''}"
            for f, c in families.items()))
    print(f"met where the target applies: base {result['met_where_applies']['base']}, "
          f"new {result['met_where_applies']['new']}; warm trials where both reached K: "
          f"{result['warm_trials_both_reached']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
