"""Benchmark: does the tuner generalise beyond the demo GPT? Five model families, each judged
against its own measured truth.

For each family of ``workloads.families`` (none is the demo GPT), in one run:

1. TRUTH, the exhaustive grid of the job's live knobs: threads {1, usable CPUs} x one
   precision for every module group at once {fp32, bf16, fp16} x up to 4 micro-batch sizes
   (log-spread divisors of the global batch), measured in this process through
   ``workloads.train_family.run_steps`` (the job's own step, fixed config, no sidecar). The
   grid is interleaved: each round visits every config once in a new shuffled order, a
   warm-up step then up to ``--grid-steps`` measured steps, and the default config (the
   reference) before the first and after every ``--reference-every`` configs. A visit's
   figure is its median tokens/s / the mean of the two reference visits around it (the box
   is shared: its load changes within minutes); a config's is the median over its visits. A
   config is pruned (not visited again) when its first step alone overran the visit budget,
   or when after a round it ran at under ``--prune-below`` of the default: both are far
   from the best, so more steps would not change the truth.
2. LIVE: ``seedancectl sidecar --config FILE`` whose job section says only ``mode = "auto"``
   and ``tune = true`` (plus the listen address, store, state database and token file it
   needs to run: every other setting is the default), and ``python -m
   workloads.train_family`` attached to it as the README's loop. At ``--minutes``/2 and
   ``--minutes`` after the job attached, the job's baseline (the config it keeps) and the
   trials are read over the sidecar's HTTP API (``seedancectl._session``); then both stop.
3. A/B: the default, the grid's best two, and the config kept at each checkpoint, interleaved in
   this process with ``run_steps`` (``--ab-rounds`` rounds, shuffled order, the default
   visited between every two arms, a warm-up step and ``--ab-steps`` measured steps per
   visit). Ratio = median tokens/s of the arm / median of the default, pooled over rounds;
   95% interval from a paired bootstrap over rounds.

Reported per family: step_s (the default's median step), the grid (config -> tokens/s and
relative to the default), available gain (the best config known / default, by the A/B: the
grid's best re-measured so the max over a noisy grid does not inflate it, or a kept config
that measured better still), kept config and ratio with interval at both checkpoints,
captured = (kept ratio - 1) / (available - 1) when available > 1.02 (else 1, or 0 if a
regression was kept), trial counts, and whether a regression was kept (the kept ratio's
interval lies wholly below 1). The summary states each of the issue's targets and whether
it was met. Serving is not benchmarked here yet (the JSON says so): the live serving session
test (tests/seedancectl/test_serving_session.py) is where the serving defaults are exercised.

Run: python bench/generalisation.py [--families cnn_bn,vit --minutes 10]   (about 15-20 min a
family on 2 cores), or ``--quick`` for a smoke run (2 minutes live, a one-round grid).
Results: bench/results/generalisation.json (rewritten after every family).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench._default_session import DefaultSettingsSession, code_revision  # noqa: E402
from bench._serving_family import bench_serving  # noqa: E402
from bench._targets import Target, block, holds, judged  # noqa: E402
from seedancectl._api_client import SidecarError  # noqa: E402
from seedancectl._session import TrainingSession  # noqa: E402
from seedancectl._session_config import TuningSessionError  # noqa: E402
from seedancectl._session_result import Trial  # noqa: E402
from workloads.families import FAMILIES, Built, family  # noqa: E402
from workloads.train_family import (  # noqa: E402
    Config,
    config_label,
    default_config,
    knob_grid,
    run_steps,
)

RESULTS = ROOT / "bench" / "results" / "generalisation.json"
LIVE_KEYS = ("threads", "micro_batch")
CAPTURE_TARGET = 0.8
FLAT_GAIN = 1.02
SERVING = "serving"
"""The serving family (``bench/_serving_family.py``)."""

Steps = list[tuple[int, float]]


def live_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """The knobs a running job acts on (restart-scope ones wait for a restart)."""
    return {k: v for k, v in sorted(config.items())
            if k in LIVE_KEYS or k.startswith("precision.")}


def tokens_per_s(steps: Steps) -> list[float]:
    return [tokens / seconds for tokens, seconds in steps]


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def _r(value: float, digits: int = 3) -> float | None:
    return round(value, digits) if math.isfinite(value) else None


class CpuMeter:
    """CPU time that processes outside this benchmark (itself and the sidecar and job it
    started) used during a phase, as a share of the machine: the box is shared, and on 2
    cores another process's load turns 2 threads from the fastest config into the slowest.
    Linux only (``/proc/stat``); NaN elsewhere."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        except (OSError, ValueError):
            return time.monotonic(), own, math.nan
        ticks = os.sysconf("SC_CLK_TCK")
        # user nice system (idle iowait) irq softirq steal; guest time is inside user already
        busy = sum(fields[:3]) + sum(fields[5:8])
        return time.monotonic(), own, busy / ticks

    def foreign_share(self) -> float:
        """Since the meter started: (busy CPU s - ours) / (wall s x CPUs), in [0, 1]."""
        (t0, own0, busy0), (t1, own1, busy1) = self._start, self._read()
        wall = (t1 - t0) * (os.cpu_count() or 1)
        return min(1.0, max(0.0, ((busy1 - busy0) - (own1 - own0)) / wall)) if wall else math.nan


CONTENDED = 0.25
"""A phase during which other processes used more than this share of the CPUs is flagged: its
figures describe a loaded box, not the job."""


# ---- interleaved in-process measurement ---------------------------------------------------------


@dataclass
class Arm:
    """One config under measurement: its visits' measured steps, by round, and each visit's
    tokens/s relative to the reference visits on either side of it."""

    config: Config
    visits: list[tuple[int, Steps]] = field(default_factory=list)
    relatives: list[float] = field(default_factory=list)
    warmup: Steps = field(default_factory=list)
    pruned: str | None = None
    losses: list[float] = field(default_factory=list)

    @property
    def steps(self) -> Steps:
        return [s for _, steps in self.visits for s in steps]

    def round_steps(self, r: int) -> Steps:
        return [s for i, steps in self.visits if i == r for s in steps]

    @property
    def rounds(self) -> int:
        return len({i for i, steps in self.visits if steps})

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in self.losses)


class Restorer:
    """The model and optimizer as built; put back when a config made them non-finite, so one
    config cannot spoil the rest of the measurement."""

    def __init__(self, built: Built) -> None:
        self.built = built
        self.model = {k: v.clone() for k, v in built.model.state_dict().items()}
        self.optimizer = _clone(built.optimizer.state_dict())

    def check(self, losses: Sequence[float]) -> bool:
        """True (and the state restored) when a loss was non-finite."""
        if all(math.isfinite(v) for v in losses):
            return False
        self.built.model.load_state_dict(self.model)
        self.built.optimizer.load_state_dict(_clone(self.optimizer))
        return True


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


def interleave(built: Built, configs: Mapping[str, Config], reference: str, *, rounds: int,
               steps: int, visit_s: float, reference_every: int, prune_below: float | None,
               seed: int, restorer: Restorer, echo: str = "") -> dict[str, Arm]:
    """Each round visits every unpruned config once in a new shuffled order, with the
    ``reference`` visited before the first and after every ``reference_every`` of them: a
    visit is a warm-up step and up to ``steps`` measured ones within ``visit_s``. A visit's
    relative figure divides by the mean of the reference visits on either side of it, so a
    machine whose load changes mid-round (a shared box) shifts both alike."""
    arms = {name: Arm(config=dict(c)) for name, c in configs.items()}
    ref = arms[reference]
    rng = np.random.default_rng(seed)
    others = [n for n in arms if n != reference]

    def visit(name: str, r: int) -> float:
        arm = arms[name]
        losses: list[float] = []
        warm: Steps = []
        got = run_steps(built, arm.config, steps, warmup=1, max_seconds=visit_s,
                        losses=losses, warmup_out=warm)
        arm.visits.append((r, got))
        arm.warmup += warm
        arm.losses += losses
        if restorer.check(losses):
            arm.pruned = "non-finite loss"
        elif not got and name != reference:
            arm.pruned = f"its first step alone overran the {visit_s:.1f} s visit budget"
        return _median(tokens_per_s(got or warm))

    last_ref = math.nan
    for r in range(rounds):
        todo = [others[int(i)] for i in rng.permutation(len(others))
                if arms[others[int(i)]].pruned is None]
        if r == 0 or not math.isfinite(last_ref):
            last_ref = visit(reference, r)
        for start in range(0, len(todo), max(1, reference_every)):
            block = todo[start:start + max(1, reference_every)]
            figures = {name: visit(name, r) for name in block}
            next_ref = visit(reference, r)
            scale = statistics.fmean([last_ref, next_ref])
            ref.relatives.append(next_ref / scale)
            for name, tps in figures.items():
                arms[name].relatives.append(tps / scale)
                print(f"{echo}round {r + 1}/{rounds} {name}: {tps:.1f} tokens/s "
                      f"({tps / scale:.2f}x default)"
                      f"{'  pruned: ' + str(arms[name].pruned) if arms[name].pruned else ''}",
                      flush=True)
            last_ref = next_ref
        if prune_below is not None:
            for name in others:
                arm = arms[name]
                rel = relative(arm)
                if arm.pruned is None and math.isfinite(rel) and rel < prune_below:
                    arm.pruned = f"under {prune_below:g}x the default after round {r + 1}"
    return arms


def relative(arm: Arm) -> float:
    """Median over the arm's visits of its tokens/s / the bracketing reference visits'."""
    return _median(arm.relatives)


def ratio_ci(arm: Arm, reference: Arm, *, boots: int = 2000, seed: int = 0
             ) -> tuple[float, float, float]:
    """Ratio of pooled medians (arm / reference) and a 95% paired bootstrap over rounds."""
    rounds = sorted({r for r, s in arm.visits if s} & {r for r, s in reference.visits if s})
    pairs = [(tokens_per_s(arm.round_steps(r)), tokens_per_s(reference.round_steps(r)))
             for r in rounds]
    if not pairs:  # pruned at its first step: that step is all there is
        rel = relative(arm)
        return rel, rel, rel

    def ratio(chosen: Sequence[int]) -> float:
        mine = [v for i in chosen for v in pairs[i][0]]
        ref = [v for i in chosen for v in pairs[i][1]]
        return statistics.median(mine) / statistics.median(ref)

    point = ratio(range(len(pairs)))
    rng = np.random.default_rng(seed)
    samples = [ratio(rng.integers(0, len(pairs), len(pairs))) for _ in range(boots)]
    low, high = np.percentile(samples, [2.5, 97.5])
    return point, float(low), float(high)


# ---- the live session -----------------------------------------------------------------------


def family_session(name: str, seed: int) -> Callable[[Path], DefaultSettingsSession]:
    """The live session of a training family: ``workloads.train_family`` attached to a sidecar
    on its default settings, as the README's loop."""
    def make(out: Path) -> DefaultSettingsSession:
        return DefaultSettingsSession(out, job=name, job_args=lambda url: [
            "-m", "workloads.train_family", "--family", name, "--sidecar", url,
            "--job", name, "--seconds", "86400", "--seed", str(seed)])
    return make


def _trial_json(t: Trial, label: Callable[[Mapping[str, Any]], str]) -> dict[str, Any]:
    return {"trial": t.trial, "config": label(t.values), "state": t.state,
            "gain": _r(t.gain, 4), "ci": [_r(t.ci_low, 4), _r(t.ci_high, 4)],
            "ended_because": t.ended_because}


def live_session(name: str, minutes: float, checkpoints: Sequence[float], *,
                 logs: Path | None, make_session: Callable[[Path], TrainingSession],
                 kept: Callable[[TrainingSession], dict[str, Any]],
                 label: Callable[[Mapping[str, Any]], str]) -> dict[str, Any]:
    """Runs the session ``make_session(out dir)``; the kept config (``kept``, named by
    ``label``) and the trials at each checkpoint (minutes)."""
    out = Path(tempfile.mkdtemp(prefix=f"generalisation-{name}-"))
    result: dict[str, Any] = {"checkpoints": [], "error": None}
    try:
        with make_session(out) as session:
            attached = time.monotonic()
            result["default_as_sent"] = kept(session)
            for at in checkpoints:
                session.wait(lambda at=at: True if time.monotonic() - attached >= at * 60
                             else None, at * 60 + 60, f"{at:g} minutes",
                             watch=(session.sidecar, session.train), poll_s=2.0)
                trials = session.trials()
                values = kept(session)
                steps = session.steps()
                result["checkpoints"].append({
                    "minutes": at, "kept": label(values), "kept_values": values,
                    "trials": len(trials), "trials_measured": sum(t.measured for t in trials),
                    "trials_kept": sum(t.state == "kept" for t in trials),
                    "job_steps": steps[-1][0] if steps else 0})
                print(f"[{name}] live {at:g} min: kept {label(values)}, "
                      f"{len(trials)} trials", flush=True)
            result["trials"] = [_trial_json(t, label) for t in session.trials()]
            result["changes_by_state"] = _count(c["state"] for c in session.changes())
            result["wall_s"] = round(time.monotonic() - attached, 1)
    except (TuningSessionError, SidecarError, OSError) as exc:  # the other families go on
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{name}] live session failed: {exc}", flush=True)
    finally:
        if logs is not None:
            shutil.copytree(out, logs / name, dirs_exist_ok=True)
        if result["error"] is None:
            shutil.rmtree(out, ignore_errors=True)
        else:
            result["logs"] = str(logs / name if logs is not None else out)
    return result


def _count(items: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


# ---- one family -----------------------------------------------------------------------------


def bench_family(name: str, args: argparse.Namespace) -> dict[str, Any]:
    fam = family(name)
    built = fam.build(args.seed)
    restorer = Restorer(built)
    default = default_config(built)
    default_label = config_label(default)
    grid = {config_label(c): c for c in knob_grid(built, max_micro_batches=args.max_micro)}
    load_start = os.getloadavg()

    # 1. truth
    meter = CpuMeter()
    probe = run_steps(built, default, 3, warmup=1)
    step_s = _median([s for _, s in probe])
    visit_s = max(2.0, step_s * (args.grid_steps + 1) * 3)
    print(f"[{name}] grid: {len(grid)} configs, default {default_label} ~{step_s:.3f} s/step, "
          f"visit budget {visit_s:.1f} s", flush=True)
    began = time.monotonic()
    arms = interleave(built, grid, default_label, rounds=args.grid_rounds, steps=args.grid_steps,
                      visit_s=visit_s, reference_every=args.reference_every,
                      prune_below=args.prune_below, seed=args.seed, restorer=restorer,
                      echo=f"[{name}] grid ")
    grid_s = time.monotonic() - began
    load_grid = os.getloadavg()
    foreign = {"grid": meter.foreign_share()}
    rel = {label: relative(arm) for label, arm in arms.items()}
    valid = {label: v for label, v in rel.items() if arms[label].finite and math.isfinite(v)}
    best = max(valid, key=lambda label: valid[label])
    grid_json = {label: {
        "tokens_per_s": _r(_median(tokens_per_s(arm.steps or arm.warmup)), 1),
        "relative_to_default": _r(rel[label]), "measured_steps": len(arm.steps),
        "rounds": arm.rounds, "visits": len(arm.visits), "pruned": arm.pruned,
        "loss_finite": arm.finite} for label, arm in arms.items()}

    # 2. live
    minutes = args.minutes
    checkpoints = (minutes / 2, minutes)
    meter = CpuMeter()
    live = live_session(name, minutes, checkpoints, logs=args.logs,
                        make_session=family_session(name, args.seed),
                        kept=lambda session: live_values(session.baseline()),
                        label=config_label)
    load_live = os.getloadavg()
    foreign["live"] = meter.foreign_share()

    # 3. A/B: default, the grid's best few (the max of a noisy grid is optimistic, and its
    # runner-up may be the real best), kept at each checkpoint
    ranked = sorted((label for label in valid if label != default_label),
                    key=lambda label: -valid[label])[:args.ab_grid_top]
    configs = {default_label: default, **{label: grid[label] for label in ranked}}
    for cp in live["checkpoints"]:
        kept = {**default, **cp["kept_values"]}
        configs.setdefault(config_label(kept), kept)
    print(f"[{name}] A/B of {list(configs)}", flush=True)
    meter = CpuMeter()
    ab_arms = interleave(built, configs, default_label, rounds=args.ab_rounds,
                         steps=args.ab_steps, visit_s=max(visit_s, step_s * 30),
                         reference_every=1, prune_below=None, seed=args.seed + 1,
                         restorer=restorer, echo=f"[{name}] A/B ")
    foreign["ab"] = meter.foreign_share()
    ab = {}
    for label, arm in ab_arms.items():
        point, low, high = ratio_ci(arm, ab_arms[default_label], seed=args.seed)
        if label == default_label:
            point, low, high = 1.0, 1.0, 1.0
        ab[label] = {"ratio": point, "ci95": [low, high],
                     "relative_bracketed": _r(relative(arm)), "rounds": arm.rounds,
                     "measured_steps": len(arm.steps), "pruned": arm.pruned}
    measured = [v["ratio"] for v in ab.values() if math.isfinite(v["ratio"])]
    available = max([1.0, *measured])

    def at(cp: Mapping[str, Any]) -> dict[str, Any]:
        label = cp["kept"]
        point, (low, high) = ab[label]["ratio"], ab[label]["ci95"]
        # slower with confidence, or a config under which the loss went non-finite
        regression = (math.isfinite(high) and high < 1.0) or not ab_arms[label].finite
        if available > FLAT_GAIN:
            captured = (point - 1) / (available - 1)
        else:
            captured = 0.0 if regression else 1.0
        return {"minutes": cp["minutes"], "kept": label, "kept_values": cp["kept_values"],
                "kept_in_grid": label in grid, "ratio": _r(point), "ci95": [_r(low), _r(high)],
                "captured": _r(captured), "regression_kept": regression,
                "trials": cp["trials"], "trials_measured": cp["trials_measured"],
                "trials_kept": cp["trials_kept"], "job_steps": cp["job_steps"]}

    checks = [at(cp) for cp in live["checkpoints"]]
    final = checks[-1] if len(checks) == len(checkpoints) else None
    return {
        "description": fam.description, "token_unit": fam.token_unit,
        "global_batch": fam.global_batch, "tokens_per_step": built.tokens_per_batch,
        "step_s": _r(step_s, 4), "default_config": default_label,
        "default_values": live_values(default), "grid": grid_json, "grid_s": round(grid_s, 1),
        "grid_best": best, "grid_best_relative": _r(valid[best]),
        "available_gain": _r(available), "available_from": max(
            ab, key=lambda k: ab[k]["ratio"] if math.isfinite(ab[k]["ratio"]) else 0.0),
        "ab": {k: {**v, "ratio": _r(v["ratio"]), "ci95": [_r(x) for x in v["ci95"]]}
               for k, v in ab.items()},
        "live": live, "checkpoints": checks,
        "captured_at_end": final["captured"] if final else None,
        "trials": final["trials"] if final else None,
        "regression_kept": bool(final and final["regression_kept"]),
        "complete": final is not None and live["error"] is None,
        "foreign_cpu_share": {k: _r(v) for k, v in foreign.items()},
        "contended_phases": sorted(k for k, v in foreign.items() if v > CONTENDED),
        "load_average_1_5_15min": {
            phase: [round(x, 2) for x in load] for phase, load in (
                ("start", load_start), ("after_grid", load_grid), ("after_live", load_live),
                ("after_ab", os.getloadavg()))},
    }


# ---- the report ---------------------------------------------------------------------------


def _incomplete(families: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Families not measured to the end, or not at all: no target is met while one is missing."""
    return (sorted(n for n, f in families.items() if not f.get("complete"))
            + sorted(set([*FAMILIES, SERVING]) - set(families)))


def family_targets(families: Mapping[str, Mapping[str, Any]], minutes: float) -> list[Target]:
    """Issue #11's targets: median captured/available gain, no regression kept, serving held."""
    captured = [f["captured_at_end"] for f in families.values()
                if f.get("captured_at_end") is not None]
    median = statistics.median(captured) if captured else None
    regressions = sorted(n for n, f in families.items() if f.get("regression_kept"))
    incomplete = _incomplete(families)
    serving = families.get(SERVING, {})
    return [Target(f"median_captured_at_{minutes:g}min >= {CAPTURE_TARGET}", CAPTURE_TARGET,
                   _r(median) if median is not None else None,
                   median is not None and median >= CAPTURE_TARGET and not incomplete,
                   "issue #11", ">=", f"not met while a family is incomplete: {incomplete}"
                   if incomplete else None),
            holds("no regression kept", "no family keeps a config slower than its default",
                  regressions, not regressions and not incomplete, "issue #11"),
            holds("serving: kept config within the quality bound, tokens/s not below the "
                  "default", "the serving family completes with no regression kept",
                  {"complete": serving.get("complete"),
                   "regression_kept": serving.get("regression_kept")},
                  bool(serving.get("complete")) and not serving.get("regression_kept"),
                  "issue #11 item 7")]


def targets(result: dict[str, Any]) -> list[Target]:
    """The families' targets at the protocol's session length."""
    return family_targets(result["families"], result["protocol"]["minutes"])


def summary(families: Mapping[str, Mapping[str, Any]], minutes: float) -> dict[str, Any]:
    captured = [f["captured_at_end"] for f in families.values()
                if f.get("captured_at_end") is not None]
    median = statistics.median(captured) if captured else None
    regressions = sorted(n for n, f in families.items() if f.get("regression_kept"))
    incomplete = _incomplete(families)
    contended = sorted(n for n, f in families.items() if f.get("contended_phases"))
    training = [f["captured_at_end"] for n, f in families.items()
                if n != SERVING and f.get("captured_at_end") is not None]
    return {
        f"median_captured_at_{minutes:g}min": _r(median) if median is not None else None,
        f"median_captured_at_{minutes:g}min_training_only": (
            _r(statistics.median(training)) if training else None),
        "families_with_regression_kept": regressions,
        "families_incomplete": incomplete,
        "families_measured_on_a_contended_box": contended,
        "targets": block(family_targets(families, minutes))["targets"],
    }


WHAT_IS_MEASURED = {
    "tokens_per_s": "tokens of one global batch (the family's token_unit) / wall seconds of "
                    "one optimizer step, measured in the benchmark process through "
                    "workloads.train_family.run_steps with the config fixed (no sidecar)",
    "step_s": "median wall seconds of a default-config step before the grid",
    "grid.relative_to_default": "median over the config's grid visits of its median "
                                "tokens/s / the mean of the default's visits just before "
                                "and after it",
    "ab.relative_bracketed": "the same bracketed figure in the A/B (a cross-check of ratio)",
    "available_gain": "largest A/B ratio over the default of the grid's best configs "
                      "(ab_grid_top) and the kept configs (1 if none beats the default): the "
                      "best config known, re-measured so a noisy grid maximum cannot inflate it",
    "checkpoints[].ratio": "A/B: kept config / default, ratio of medians pooled over "
                           "interleaved rounds; ci95 a paired bootstrap over rounds",
    "checkpoints[].captured": "(ratio - 1) / (available_gain - 1) when available_gain > "
                              f"{FLAT_GAIN}; else 1, or 0 if a regression was kept",
    "checkpoints[].regression_kept": "the kept config's ci95 lies wholly below 1",
    "checkpoints[].trials": "the search's changes that reached a verdict by then (sidecar API)",
    "foreign_cpu_share": "per phase, CPU time used by processes this benchmark did not "
                         "start / (wall time x CPUs); a phase above "
                         f"{CONTENDED} is listed in contended_phases: its figures describe "
                         "a loaded box (on 2 cores, 2 threads then lose to 1 many times over)",
    "live": "a real sidecar process with default settings (job section: mode auto, tune true) "
            "and the family's job as a separate process; checkpoints count from its attach",
}


def run_family(name: str, args: argparse.Namespace) -> dict[str, Any]:
    if name != SERVING:
        return bench_family(name, args)
    checkpoints = (args.minutes / 2, args.minutes)
    return bench_serving(
        args, live_session=functools.partial(live_session, name, args.minutes, checkpoints,
                                             logs=args.logs),
        meter=CpuMeter, flat_gain=FLAT_GAIN, contended=CONTENDED)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join([*FAMILIES, SERVING]),
                   help=f"comma-separated, of {', '.join([*FAMILIES, SERVING])}")
    p.add_argument("--merge", action="store_true",
                   help="keep the other families' results already in --out (same protocol)")
    p.add_argument("--minutes", type=float, default=10.0, help="live session length")
    p.add_argument("--grid-rounds", type=int, default=3)
    p.add_argument("--grid-steps", type=int, default=5, help="measured steps per grid visit")
    p.add_argument("--max-micro", type=int, default=4, help="micro-batch sizes in the grid")
    p.add_argument("--prune-below", type=float, default=0.5)
    p.add_argument("--reference-every", type=int, default=4,
                   help="grid: visit the default again after this many configs")
    p.add_argument("--ab-rounds", type=int, default=10)
    p.add_argument("--ab-steps", type=int, default=6)
    p.add_argument("--ab-grid-top", type=int, default=2,
                   help="the grid's best N configs join the A/B (available gain)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", type=Path, default=None,
                   help="copy each live session's logs and databases here")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 minutes live, one grid round of 2 steps, 4 A/B rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.minutes, args.grid_rounds, args.grid_steps = min(args.minutes, 2.0), 1, 2
        args.ab_rounds, args.ab_steps = 4, 3
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    for n in names:
        if n != SERVING:
            family(n)  # unknown names fail before anything runs
    report: dict[str, Any] = {
        "bench": "generalisation",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads()},
        "protocol": {"quick": args.quick, "minutes": args.minutes,
                     "checkpoints_min": [args.minutes / 2, args.minutes],
                     "grid_rounds": args.grid_rounds, "grid_steps": args.grid_steps,
                     "max_micro_batches": args.max_micro, "prune_below": args.prune_below,
                     "reference_every": args.reference_every,
                     "ab_rounds": args.ab_rounds, "ab_steps": args.ab_steps,
                     "ab_grid_top": args.ab_grid_top,
                     "seed": args.seed,
                     "sidecar_settings": "defaults; job section: mode = auto, tune = true"},
        "what_is_measured": WHAT_IS_MEASURED,
        "families": {},
    }
    if args.quick:
        report["protocol"]["note"] = ("quick smoke run: shorter than the issue's protocol "
                                      "(10 minutes live, full grid); not a verdict")
    if args.merge and args.out.exists():
        before = json.loads(args.out.read_text(encoding="utf-8"))
        if before.get("protocol") != report["protocol"]:
            p.error(f"--merge: {args.out} was measured under another protocol")
        report["families"] = {k: v for k, v in before["families"].items() if k not in names}
    for n in names:
        print(f"=== {n} ===", flush=True)
        report["families"][n] = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                              time.gmtime()),
                                 "code_revision": code_revision(), **run_family(n, args)}
        report["summary"] = summary(report["families"], args.minutes)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        print(json.dumps({k: report["families"][n].get(k) for k in (
            "step_s", "default_config", "grid_best", "available_gain", "checkpoints",
            "regression_kept")}, indent=1), flush=True)
    report["summary"] = summary(report["families"], args.minutes)
    report = judged(report, targets(report))
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(report.get("summary"), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
