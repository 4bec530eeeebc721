"""Re-judge the committed results files against their targets, without rerunning any bench.

Most benches take minutes to hours, so a change to how a target is stated cannot wait for a
rerun. This recomputes the uniform ``targets``/``met`` block of every ``bench/results/*.json``
from the figures already recorded in it, with the same ``targets()`` function the bench calls
when it writes the file, so a refreshed file and a freshly written one agree. Nothing measured
is changed. An input file (a bench's measured grid) gets ``no_target`` instead.

    python bench/refresh_targets.py            # rewrite every results file's block
    python bench/refresh_targets.py --check    # exit 1 if any file's block is stale
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from fnmatch import fnmatch
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._targets import block, no_target  # noqa: E402

RESULTS = ROOT / "bench" / "results"
BENCHES = {  # a results file's name (a pattern) -> the bench module that writes it
    "api_latency*.json": "api_latency",
    "changes_page.json": "changes_page",
    "collective_hook.json": "collective_hook",
    "detection.json": "detection",
    "export_session.json": "export_session",
    "export_volume.json": "export_volume",
    "fleet.json": "fleet",
    "fleet_n*.json": "fleet",
    "fleet_priors*.json": "fleet_priors",
    "replays_fleet_priors*.json": "fleet_priors_replays",
    "generalisation.json": "generalisation",
    "gloo_exit.json": "gloo_exit",
    "healthy_training.json": "healthy_training",
    "hf_kv_cache.json": "hf_kv_cache",
    "idle_sidecar.json": "idle_sidecar",
    "kv.json": "kv",
    "kv_*.json": "kv",
    "live_session.json": "live_session",
    "loss_guard*.json": "loss_guard",
    "measurement.json": "measurement",
    "otlp_decode.json": "otlp_decode",
    "otlp_ingest*.json": "otlp_ingest",
    "overhead*.json": "overhead",
    "policy_pass*.json": "policy_pass",
    "study_ask*.json": "study_ask",
    "profile_overhead.json": "profile_overhead",
    "report.json": "report",
    "rollback.json": "rollback",
    "rollout_check.json": "rollout_check",
    "serving.json": "serving",
    "sidecar_cpu.json": "sidecar_cpu",
    "soak*.json": "soak",
    "stability*.json": "stability",
    "store.json": "store",
    "state_checkout*.json": "state_checkout",
    "store_flush.json": "store_flush",
    "store_fold*.json": "store_fold",
    "tuning.json": "tuning",
}
INPUTS = {"tuning_grid.json": ("tuning", "GRID_NO_TARGET")}
"""Input data, not results: the file -> (bench module, the constant that says why)."""


def _bench(name: str) -> ModuleType:
    return importlib.import_module(f"bench.{name}")


def bench_of(name: str) -> str | None:
    """The bench module that writes the results file called ``name``, if one is mapped."""
    return next((m for pattern, m in BENCHES.items() if fnmatch(name, pattern)), None)


def judgement(name: str, result: dict[str, Any]) -> dict[str, Any]:
    """The uniform block for the results file called ``name`` holding ``result``."""
    if name in INPUTS:
        module, because = INPUTS[name]
        return no_target(getattr(_bench(module), because))
    bench = bench_of(name)
    if bench is None:
        raise SystemExit(f"{name}: no bench is mapped to it in {Path(__file__).name}")
    return block(_bench(bench).targets(result))


def _indent(text: str) -> int:
    """The indent the bench wrote the file with, so a refresh does not reflow it."""
    second = text.split("\n", 2)[1] if text.count("\n") else ""
    return (len(second) - len(second.lstrip(" "))) or 2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    parser.add_argument("files", nargs="*", type=Path, help="default: bench/results/*.json")
    args = parser.parse_args(argv)
    stale = []
    for path in args.files or sorted(RESULTS.glob("*.json")):
        text = path.read_text(encoding="utf-8")
        result = json.loads(text)
        fresh = {**result, **judgement(path.name, result)}
        if fresh != result:
            stale.append(path.name)
            if not args.check:
                path.write_text(json.dumps(fresh, indent=_indent(text)) + "\n", encoding="utf-8")
        print(f"{path.name}: " + ("no target: input data" if "no_target_because" in fresh
                                  else f"met={fresh['met']}")
              + (" (refreshed)" if fresh != result and not args.check else ""))
    if args.check and stale:
        raise SystemExit(f"stale targets in: {', '.join(stale)}")


if __name__ == "__main__":
    main()
