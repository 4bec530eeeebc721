"""Benchmark: the rollout's loss guardrail on real training from its first steps, with the
window's loss read from the loss gauge (one step's loss per export) against the loss of
every step of the window.

A trial alternates candidate and baseline windows on the live job (candidate first), and
from ``RolloutConfig.min_pairs`` on, after each pair, ``compare`` judges the candidate
windows' mean loss against the baseline windows' trajectory: over
``MeasureConfig.loss_tolerance`` (5%) ends the trial. A window's loss was the mean of the
``seedance.train.loss`` gauge's readings in it: the LAST step's loss at each export (one a
second), so two or three single steps for a 2-s window, and one step's loss is as noisy as
its mini-batch. Trials of harmless changes were ended on it (the demo's ffn bf16, +52%
tokens/s, at "loss +5.80% above the baseline's trajectory", kept two trials later).

RECORDED: each family of ``workloads.families`` (small size, this CPU) trains from its first
step through a trial's windows, sized as the controller sizes them (``warmup_steps`` dropped
after each switch, then at least ``min_steps`` steps and ``min_window_s`` seconds), every
step's loss and end time kept, for ``--pairs`` pairs, in three scenarios:

- ``same``: the candidate is the baseline config (an A/A): any trip is false;
- ``bf16``: every module group computes in bf16, a harmless change the search tries first;
- ``noisy``: SIMULATED harm: the candidate windows' model outputs get Gaussian noise of
  ``--harm-noise`` times their own standard deviation (a forward hook), as a precision too
  coarse for the output layer would; the loss rises while it runs. A trip is right.

REPLAYED: each run's windows go through the loss verdict after every pair from
``min_pairs`` on, two rules and two readings of a window's loss:

- ``old``: the gauge's readings (the mean of the last step's loss at each ``--export-s``
  boundary of the window: every export sees one), every candidate window judged against
  the least-squares line through the baseline windows (the rule before 2026-12-07, restated
  here);
- ``new``: every step's loss (the ``seedance.train.step_loss`` histogram's sum over its
  count), through the rollout's own ``compare``: each candidate the baseline windows
  bracket, against the line between the baseline windows either side of it;
- ``readings_new_rule`` and ``steps_old_rule``: each change alone, for the record.

Reported: each window, each pair's excess and verdict every way, and the rates: false trips
(``same`` and ``bf16``) at the first judgement and by the last pair, and harm caught
(``noisy``) at the first judgement and by the last pair.

Targets (the loss guardrail's job; no issue states numbers): new false trips at most old's;
new catches at least as many harmed runs as old, at the first judgement and by the last
pair.

Run: python bench/loss_guard.py [--families cnn_bn,vit --seeds 2 --pairs 5]
Results: bench/results/loss_guard.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._targets import Target, at_least, at_most, judged  # noqa: E402
from tuner._compare import compare  # noqa: E402
from tuner._verdict import RolloutConfig  # noqa: E402
from tuner._windows import MeasureConfig, Window  # noqa: E402
from workloads.families import FAMILIES, Built, family  # noqa: E402
from workloads.train_family import default_config, fixed_config, train_step  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "loss_guard.json"
SOURCE = "bench docstring (the loss guardrail's job)"
SCENARIOS = ("same", "bf16", "noisy")
WAYS = {"old": ("readings", "old"), "new": ("steps", "new"),
        "readings_new_rule": ("readings", "new"), "steps_old_rule": ("steps", "old")}
"""Each way a window's loss is read and judged: (reading, rule)."""


def record(built: Built, scenario: str, pairs: int, measure: MeasureConfig,
           harm_noise: float) -> list[dict[str, Any]]:
    """A trial's windows (candidate first) on ``built``, trained from where it is: each
    window's arm, start and every step's (end time in s, loss)."""
    baseline = default_config(built)
    candidate = dict(baseline)
    if scenario == "bf16":
        candidate.update({k: "bf16" for k in baseline if k.startswith("precision.")})

    def noisy(_: torch.nn.Module, __: Any, out: torch.Tensor) -> torch.Tensor:
        return out + torch.randn_like(out) * harm_noise * out.detach().std()

    clock0 = time.perf_counter()
    windows = []
    for index in range(2 * pairs):
        arm = "candidate" if index % 2 == 0 else "baseline"
        hook = (built.model.register_forward_hook(noisy)
                if arm == "candidate" and scenario == "noisy" else None)
        steps: list[tuple[float, float]] = []
        with fixed_config(built, candidate if arm == "candidate" else baseline) as session:
            for _ in range(measure.warmup_steps):
                train_step(built, session)
            start = time.perf_counter() - clock0
            while len(steps) < measure.min_steps or \
                    steps[-1][0] - start < measure.min_window_s:
                loss = float(train_step(built, session))
                steps.append((time.perf_counter() - clock0, loss))
        if hook is not None:
            hook.remove()
        windows.append({"arm": arm, "start_s": start, "steps": steps})
    return windows


def window_loss(steps: list[tuple[float, float]], read: str, export_s: float) -> list[float]:
    """The losses a window's mean is taken over: every step's, or the gauge's readings (the
    last step before each export boundary; at least the window's last step)."""
    if read == "steps":
        return [loss for _, loss in steps]
    readings: dict[int, float] = {}
    for at, loss in steps:
        readings[math.floor(at / export_s)] = loss  # the last step before each export
    return list(readings.values())


def as_window(index: int, recorded: dict[str, Any], read: str, export_s: float) -> Window:
    steps = recorded["steps"]
    losses = window_loss(steps, read, export_s)
    finite = [x for x in losses if math.isfinite(x)]
    seconds = steps[-1][0] - recorded["start_s"]
    return Window(version=index + 1, arm=recorded["arm"], steps=len(steps),
                  step_s=seconds / len(steps), tokens_per_s=len(steps) / seconds,
                  loss=statistics.fmean(finite) if finite else math.nan,
                  nonfinite_loss=len(finite) < len(losses),
                  start_ns=int(recorded["start_s"] * 1e9), end_ns=int(steps[-1][0] * 1e9))


def old_rule_excess(windows: list[Window]) -> float:
    """The rule before 2026-12-07: every candidate window against the least-squares line
    through the baseline windows' (mid-time, mean loss), the mean relative excess."""
    mid = [(w.start_ns + w.end_ns) / 2e9 for w in windows]
    base = [(t, w.loss) for t, w in zip(mid, windows, strict=True) if w.arm == "baseline"]
    t0 = statistics.fmean(t for t, _ in base)
    slope, intercept = np.polyfit([t - t0 for t, _ in base], [x for _, x in base], 1)
    excess = [(w.loss - (intercept + slope * (t - t0))) / abs(intercept + slope * (t - t0))
              for t, w in zip(mid, windows, strict=True) if w.arm == "candidate"]
    return float(np.mean(excess))


def judge(recorded: list[dict[str, Any]], measure: MeasureConfig, min_pairs: int,
          export_s: float) -> list[dict[str, Any]]:
    """Each pair's loss verdict from ``min_pairs`` on, every way of :data:`WAYS`."""
    out = []
    for pairs in range(min_pairs, len(recorded) // 2 + 1):
        verdict: dict[str, Any] = {"pairs": pairs}
        for way, (read, rule) in WAYS.items():
            windows = [as_window(i, r, read, export_s) for i, r in enumerate(recorded[:2 * pairs])]
            if rule == "new":
                comparison = compare(windows, measure)
                excess, trip = comparison.loss_excess, not comparison.loss_ok
            else:
                excess = old_rule_excess(windows)
                trip = not excess <= measure.loss_tolerance
            verdict[f"{way}_excess"], verdict[f"{way}_trip"] = excess, trip
        out.append(verdict)
    return out


def _rate(runs: list[dict[str, Any]], way: str, first_only: bool) -> float | None:
    if not runs:
        return None
    hit = [any(p[f"{way}_trip"] for p in (r["verdicts"][:1] if first_only else r["verdicts"]))
           for r in runs]
    return sum(hit) / len(hit)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    harmless = [r for r in runs if r["scenario"] in ("same", "bf16")]
    harmed = [r for r in runs if r["scenario"] == "noisy"]
    return {way: {"false_trips_first_judgement": _rate(harmless, way, True),
                  "false_trips_by_last_pair": _rate(harmless, way, False),
                  "harm_caught_first_judgement": _rate(harmed, way, True),
                  "harm_caught_by_last_pair": _rate(harmed, way, False),
                  "harmless_runs": len(harmless), "harmed_runs": len(harmed)}
            for way in WAYS}


def targets(result: dict[str, Any]) -> list[Target]:
    """The new way trips no more often on harmless changes than the old, and catches harm at
    least as often."""
    old, new = result["summary"]["old"], result["summary"]["new"]
    note = "the old way's rate as the bound"
    return [
        *(at_most(f"false trips {when}, new", old[key], new[key], SOURCE, note)
          for when, key in (("at the first judgement", "false_trips_first_judgement"),
                            ("by the last pair", "false_trips_by_last_pair"))),
        *(at_least(f"harmed runs caught {when}, new", old[key], new[key], SOURCE, note)
          for when, key in (("at the first judgement", "harm_caught_first_judgement"),
                            ("by the last pair", "harm_caught_by_last_pair"))),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--harm-noise", type=float, default=1.0)
    parser.add_argument("--export-s", type=float, default=1.0,
                        help="the job's metric export interval (the client's default)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    measure, rollout = MeasureConfig(), RolloutConfig()
    runs = []
    for name in args.families.split(","):
        for scenario in SCENARIOS:
            for seed in range(args.seeds):
                recorded = record(family(name).build(seed, small=True), scenario, args.pairs,
                                  measure, args.harm_noise)
                run = {"family": name, "scenario": scenario, "seed": seed,
                       "windows": recorded,
                       "verdicts": judge(recorded, measure, rollout.min_pairs, args.export_s)}
                runs.append(run)
                print(json.dumps({k: run[k] for k in ("family", "scenario", "seed")} | {
                    "excess": [(p["pairs"], *(round(p[f"{w}_excess"], 4) for w in WAYS))
                               for p in run["verdicts"]]}), flush=True)
    result = {"bench": "loss_guard",
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"platform": platform.platform(), "torch": torch.__version__,
                          "cpus": os.cpu_count()},
              "protocol": {"families": args.families.split(","), "seeds": args.seeds,
                           "pairs": args.pairs, "export_s": args.export_s, "size": "small",
                           "harm_noise": args.harm_noise, "ways": WAYS,
                           "measure": {"warmup_steps": measure.warmup_steps,
                                       "min_steps": measure.min_steps,
                                       "min_window_s": measure.min_window_s,
                                       "loss_tolerance": measure.loss_tolerance},
                           "min_pairs": rollout.min_pairs,
                           "measurement": "recorded training steps, verdicts replayed; the "
                                          "noisy scenario is a SIMULATED harm"},
              "runs": runs}
    result["summary"] = summarise(runs)
    result = judged(result, targets(result))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
