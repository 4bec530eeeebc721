"""Benchmark: the tuner's sequential A/B test, replayed over step times recorded on this box.

The issue's target: for a true effect of +-10% the trial's decision is right in >= 95% of runs
and takes <= 60 s of job time, for steps of 0.05-1 s, with the sidecar and one other busy
process on the box. Two honest halves:

1. RECORDED: a real CPU workload in this process (an MLP forward+backward on 1 thread; a step
   is 11k identical units, k calibrated so the step takes about T s) runs two arms, A (11k
   units) and B (10k units: 1/1.1 of the work, the same tokens), alternating in windows
   exactly as the controller sizes them (``warmup_steps`` dropped, then >= ``min_steps`` and
   >= ``min_window_s``, ``min_steps`` from ``window_config`` over the windows so far), while
   ONE neighbour process spins a torch matmul loop on 1 thread. The neighbour stands in for
   the sidecar and one other busy process; the sidecar itself does not run. The true effect
   is the measured A/B step-time ratio over the whole recording, not the nominal 1.1.
2. SIMULATED: decisions are replayed over the recorded traces. From every window start of the
   right arm, consecutive recorded windows are streamed into ``Window`` objects (each cut at
   the step where the trial's own ``window_config`` would call it ready; a recorded window
   shorter than that is used whole and counted as short) and ``decide(compare(...))`` runs
   after each pair with the trial's job time so far, exactly as the controller does. +10%:
   candidate = B, baseline = A; -10%: the roles swapped; 0% (control): A windows only, one in
   two treated as the candidate (a B window lies between two of them, so drift between a
   pair's windows is twice a real trial's: a harsh control). A start counts only when the
   recording after it is long enough for the trial to reach its horizon (``max_pairs`` or
   ``trial_budget_s``), whatever it decides, so a late start is never kept just because it
   decided early. Starts overlap, so they are not independent trials. The old rule
   (Student's t, a fixed 3 pairs, keep iff the interval's low end > 0) runs on the same
   starts, and a few alternative settings show which parameter moves the result. Longer
   windows than recorded cannot be replayed; ``load_noise`` estimates from the recorded load
   how noisy a pair would be with them.

Job time excludes what a live switch adds (the job applies a config at its next step, and
``measure_window`` sees steps only at metric exports, every 1 s by default), so a live trial
spends somewhat more job time per window than the replay.

Run: python bench/measurement.py  [--minutes-per-size 3 --step-s 0.05 0.2 1.0]
     python bench/measurement.py --replay-from bench/results/measurement_traces.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._targets import Target, holds, judged  # noqa: E402
from tuner._change import Trip  # noqa: E402
from tuner._compare import compare  # noqa: E402
from tuner._measure import window_config  # noqa: E402
from tuner._verdict import RolloutConfig, decide  # noqa: E402
from tuner._windows import Comparison, MeasureConfig, Window  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "measurement.json"
TRACES = Path(__file__).resolve().parent / "results" / "measurement_traces.json.gz"
TOKENS_PER_STEP = 1000.0
NEIGHBOUR = ("import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\n"
             "while True:\n    a = torch.tanh(a @ a)\n")
NEIGHBOUR_NOTE = ("one neighbour process: a torch 512x512 matmul loop on 1 thread, standing in "
                  "for the sidecar and one other busy process (the sidecar itself did not run); "
                  "other engineers' jobs shared the box too (see the load averages)")
EFFECTS = ("+10%", "-10%", "0%")
OLD_RULE = "old: t, 3 pairs"
SEQUENTIAL = "sequential (defaults)"
ALTERNATIVES: Mapping[str, RolloutConfig] = {
    "min_pairs=2": RolloutConfig(min_pairs=2),
    "planned_pairs=4": RolloutConfig(measure=MeasureConfig(planned_pairs=4)),
    "planned_pairs=16": RolloutConfig(measure=MeasureConfig(planned_pairs=16)),
    "noise_floor=0.01": RolloutConfig(measure=MeasureConfig(noise_floor=0.01)),
    "trial_budget_s=60": RolloutConfig(trial_budget_s=60.0),
    "max_pairs=16": RolloutConfig(max_pairs=16),
    "min_window_s=1": RolloutConfig(measure=MeasureConfig(min_window_s=1.0)),
    "window_cv=0.03": RolloutConfig(measure=MeasureConfig(window_cv=0.03)),
    "max_window_s=4": RolloutConfig(measure=MeasureConfig(max_window_s=4.0)),
}
"""Settings replayed besides the defaults; a window can only be cut shorter than recorded, so
only settings that shorten windows are replayed for the window size (``load_noise`` says what
longer ones would do)."""
LOAD_NOISE_WINDOWS_S = (1.0, 2.0, 4.0, 8.0)


# ---- recording ------------------------------------------------------------------------------


class Workload:
    """An MLP forward+backward on 1 thread; a step runs ``units`` identical units, so B's 10k
    units are 1/1.1 of A's 11k in work while both count the same tokens."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                         torch.nn.Linear(1024, 256))
        self.x = torch.randn(16, 256)  # a unit of ~1 ms: 11 units fit a 0.05 s step

    def step(self, units: int) -> float:
        """One step's seconds."""
        start = time.perf_counter()
        for _ in range(units):
            self.model(self.x).square().mean().backward()
        self.model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def unit_s(self) -> float:
        """Median seconds of one unit, timed with the neighbour running (again before each
        step size: the shared box's load moves)."""
        for _ in range(20):
            self.step(1)
        return statistics.median(self.step(11) for _ in range(15)) / 11


def start_neighbour() -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    time.sleep(5)  # torch's import is busy too; let it reach the loop
    if proc.poll() is not None:
        raise SystemExit(f"the neighbour process exited ({proc.returncode})")
    return proc


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def step_window(version: int, arm: str, seconds: np.ndarray, start_s: float) -> Window:
    """A ``Window`` from one window's per-step seconds after warm-up (fixed tokens per step;
    the step CV is tuner._measure._step_cv's formula with one step per block)."""
    total = float(seconds.sum())
    cv = float(seconds.std(ddof=1) / seconds.mean()) if seconds.size > 1 else math.nan
    return Window(version=version, arm=arm, steps=int(seconds.size),
                  step_s=total / seconds.size, tokens_per_s=TOKENS_PER_STEP * seconds.size / total,
                  loss=math.nan, nonfinite_loss=False, start_ns=int(start_s * 1e9),
                  end_ns=int((start_s + total) * 1e9), step_cv=cv)


def ready_at(seconds: np.ndarray, config: MeasureConfig) -> int | None:
    """Steps (warm-up included) after which the window is ready, or None if never."""
    kept = np.cumsum(seconds[config.warmup_steps:])
    ok = np.flatnonzero((np.arange(1, kept.size + 1) >= config.min_steps)
                        & (kept >= config.min_window_s))
    return None if ok.size == 0 else config.warmup_steps + int(ok[0]) + 1


def record(workload: Workload, target_s: float, minutes: float,
           neighbour: subprocess.Popen[bytes], rollout: RolloutConfig) -> dict[str, Any]:
    """Alternate A and B windows sized as the controller sizes them for ``minutes``."""
    unit_s = workload.unit_s()
    k = max(1, round(target_s / (11 * unit_s)))
    units = {"A": 11 * k, "B": 10 * k}
    measure = rollout.measure
    steps: list[list[Any]] = []
    windows: list[Window] = []
    loads: list[float] = []
    clock, wall0, cpu0 = 0.0, time.perf_counter(), time.process_time()
    neighbour0 = cpu_seconds(neighbour.pid)
    index = 0
    while time.perf_counter() - wall0 < minutes * 60 or index % 2:
        arm = "AB"[index % 2]
        config = window_config(windows[-2 * rollout.max_pairs:], measure)
        seconds: list[float] = []
        while ready_at(np.array(seconds), config) is None:
            seconds.append(workload.step(units[arm]))
        steps.extend([arm, index, round(s, 7)] for s in seconds)
        windows.append(step_window(index, "baseline", np.array(seconds[measure.warmup_steps:]),
                                   clock))
        clock += sum(seconds)
        loads.append(os.getloadavg()[0])
        index += 1
    wall = time.perf_counter() - wall0
    return {"target_step_s": target_s, "unit_s": unit_s, "units": units, "recorded_s": wall,
            "own_cpu_share": (time.process_time() - cpu0) / wall,
            "neighbour_cpu_share": (cpu_seconds(neighbour.pid) - neighbour0) / wall,
            "load_average_1m": {"mean": statistics.fmean(loads), "max": max(loads)},
            "steps": steps}


# ---- replay ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recorded:
    """One recorded window: its arm, every step's seconds (warm-up first), its start."""

    arm: str
    seconds: np.ndarray
    start_s: float


@dataclass(frozen=True)
class Outcome:
    verdict: str
    pairs: int
    time_s: float
    gain: float
    width: float
    short: int


def recorded_windows(steps: Sequence[Sequence[Any]]) -> list[Recorded]:
    by_index: dict[int, list[float]] = {}
    arms: dict[int, str] = {}
    for arm, index, seconds in steps:
        by_index.setdefault(int(index), []).append(float(seconds))
        arms[int(index)] = arm
    out, clock = [], 0.0
    for index in sorted(by_index):
        out.append(Recorded(arms[index], np.array(by_index[index]), clock))
        clock += sum(by_index[index])
    return out


def sequences(windows: Sequence[Recorded], effect: str) -> list[list[Recorded]]:
    """Each start's stream of windows in trial order (candidate first)."""
    if effect == "0%":
        a_only = [w for w in windows if w.arm == "A"]
        return [a_only[i:] for i in range(len(a_only))]
    first = "B" if effect == "+10%" else "A"
    return [list(windows[i:]) for i, w in enumerate(windows) if w.arm == first]


def _category(verdict: str | Trip | None) -> str | None:
    """What ended the trial: kept, or the rollback's cause (from ``decide``'s reasons)."""
    if verdict is None or verdict == "keep":
        return None if verdict is None else "kept"
    assert isinstance(verdict, Trip)
    for prefix, name in (("measured regression", "regression"), ("no gain worth", "futility"),
                         ("no measured gain", "budget"), ("harms the job", "harm")):
        if verdict.reason.startswith(prefix):
            return name
    return "guardrail"


def old_verdict(comparison: Comparison) -> str:
    if comparison.improves:
        return "kept"
    return "regression" if comparison.regresses else "no gain"


def simulate(seq: Sequence[Recorded], rollout: RolloutConfig,
             fixed_pairs: int | None = None) -> Outcome | None:
    """The controller's trial over ``seq``: the sequential rule (``decide`` after each pair)
    or, with ``fixed_pairs``, the old rule judged once. None when the recording ends before
    the trial's horizon (``max_pairs`` or ``trial_budget_s``; ``fixed_pairs`` for the old
    rule), whatever the trial decided by then."""
    measure = replace(rollout.measure, interval="t") if fixed_pairs else rollout.measure
    windows: list[Window] = []
    outcome: Outcome | None = None
    elapsed, short = 0.0, 0
    for k, rec in enumerate(seq):
        n = ready_at(rec.seconds, window_config(windows, measure))
        if n is None:
            n, short = rec.seconds.size, short + 1
        elapsed += float(rec.seconds[:n].sum())
        windows.append(step_window(k, "candidate" if k % 2 == 0 else "baseline",
                                   rec.seconds[measure.warmup_steps:n], rec.start_s))
        if k % 2 == 0:
            continue
        pairs = (k + 1) // 2
        if outcome is None and (fixed_pairs is None or pairs == fixed_pairs):
            comparison = compare(windows, measure)
            verdict = (old_verdict(comparison) if fixed_pairs is not None
                       else _category(decide(comparison, rollout, elapsed)))
            if verdict is not None:
                outcome = Outcome(verdict, pairs, elapsed, comparison.gain,
                                  comparison.ci_high - comparison.ci_low, short)
        if fixed_pairs is not None and pairs >= fixed_pairs:
            return outcome
        if fixed_pairs is None and (pairs >= rollout.max_pairs
                                    or elapsed >= rollout.trial_budget_s):
            return outcome
    return None


def summarise(outcomes: Sequence[Outcome], effect: str, starts: int) -> dict[str, Any]:
    """Right-decision rate (+10%: kept; -10% and 0%: not kept), times, widths."""
    n = len(outcomes)
    if n == 0:
        return {"starts": starts, "decided": 0}
    kept = sum(o.verdict == "kept" for o in outcomes)
    right = kept if effect == "+10%" else n - kept
    low = float(stats.beta.ppf(0.025, right, n - right + 1)) if right else 0.0
    high = float(stats.beta.ppf(0.975, right + 1, n - right)) if right < n else 1.0
    times = np.array([o.time_s for o in outcomes])
    return {"starts": starts, "decided": n, "right": right, "right_rate": right / n,
            "right_rate_ci95_overlapping_starts": [low, high], "kept_rate": kept / n,
            "verdicts": dict(Counter(o.verdict for o in outcomes)),
            "median_time_s": float(np.median(times)),
            "p95_time_s": float(np.quantile(times, 0.95)),
            "median_pairs": float(np.median([o.pairs for o in outcomes])),
            "median_gain": float(np.median([o.gain for o in outcomes])),
            "median_width": float(np.median([o.width for o in outcomes])),
            "short_windows": sum(o.short for o in outcomes)}


def replay(windows: Sequence[Recorded], rules: Mapping[str, RolloutConfig]
           ) -> dict[str, dict[str, dict[str, Any]]]:
    """{effect: {rule: summary}}; the old rule runs on the defaults' counted starts."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for effect in EFFECTS:
        seqs = sequences(windows, effect)
        out[effect] = {}
        for name, rollout in rules.items():
            outcomes = [simulate(s, rollout) for s in seqs]
            counted = [o for o in outcomes if o is not None]
            out[effect][name] = summarise(counted, effect, len(seqs))
            if name == SEQUENTIAL:
                old = [simulate(s, rollout, fixed_pairs=3)
                       for s, o in zip(seqs, outcomes, strict=True) if o is not None]
                out[effect][OLD_RULE] = summarise([o for o in old if o is not None], effect,
                                                  len(seqs))
    return out


def recording_summary(size: Mapping[str, Any], windows: Sequence[Recorded],
                      warmup: int) -> dict[str, Any]:
    """The recording's numbers; the true effect is B's tokens/s over A's, all steps after
    warm-up."""
    after = {arm: np.concatenate([w.seconds[warmup:] for w in windows if w.arm == arm])
             for arm in "AB"}
    a, b = float(after["A"].mean()), float(after["B"].mean())
    return {**{k: v for k, v in size.items() if k != "steps"},
            "windows": len(windows), "steps": len(size["steps"]),
            "mean_step_s": {"A": a, "B": b},
            "step_cv": {arm: float(v.std(ddof=1) / v.mean()) for arm, v in after.items()},
            "median_window_steps": float(np.median([w.seconds.size for w in windows])),
            "median_window_s": float(np.median([w.seconds.sum() for w in windows])),
            "window_mean_step_s_range": [min(float(w.seconds[warmup:].mean()) for w in windows),
                                         max(float(w.seconds[warmup:].mean()) for w in windows)],
            "true_effect": {"+10%": a / b - 1, "-10%": b / a - 1},
            "pair_log_gain_sd_from_load_by_window_s": load_noise(windows, warmup, a / b)}


def load_noise(windows: Sequence[Recorded], warmup: int, ratio: float) -> dict[str, Any]:
    """SD of one pair's log gain from the box's load alone, had windows lasted L s: the
    recorded steps after warm-up in time order, B's scaled by the measured A/B ratio, cut
    into consecutive L-s windows, each odd one against the mean of its neighbours. The replay
    can only cut recorded windows shorter; this says whether longer ones would help."""
    steps = np.concatenate([w.seconds[warmup:] * (ratio if w.arm == "B" else 1.0)
                            for w in windows])
    out: dict[str, Any] = {}
    for length in LOAD_NOISE_WINDOWS_S:
        edges = np.searchsorted(np.cumsum(steps), np.arange(length, steps.sum(), length))
        means = [float(c.mean()) for c in np.split(steps, edges) if c.size][:-1]  # drop the tail
        gains = [math.log((means[i - 1] + means[i + 1]) / 2 / means[i])
                 for i in range(1, len(means) - 1, 2)]
        out[f"{length:g}"] = {"pairs": len(gains), "sd": float(np.std(gains, ddof=1))
                              if len(gains) > 1 else None}
    return out


def targets(result: Mapping[str, Any]) -> list[Target]:
    """Issue #11's targets over the defaults at +-10%, in every cell (step size x effect)."""
    results = result["sizes"]
    cells = [(r["target_step_s"], effect, r["replay"][effect][SEQUENTIAL])
             for r in results for effect in ("+10%", "-10%")]
    right = {f"{s:g}s {e}": c.get("right_rate") for s, e, c in cells}
    median = {f"{s:g}s {e}": c.get("median_time_s") for s, e, c in cells}
    note = ("met is on point estimates over overlapping starts of one recording; the target "
            "assumes the sidecar and one busy process beside the job (about 2 runnable on 2 "
            "cores); the mean 1-min load average while recording was "
            + ", ".join(f"{r['load_average_1m']['mean']:.1f} ({r['target_step_s']:g} s)"
                        for r in results))
    return [holds("right >= 95% at ±10%", "right-decision rate >= 0.95 in every cell", right,
                  all(v is not None and v >= 0.95 for v in right.values()), "issue #11", note),
            holds("median time <= 60 s", "median job time <= 60 s in every cell", median,
                  all(v is not None and v <= 60 for v in median.values()), "issue #11", note)]


def table(results: Sequence[Mapping[str, Any]]) -> str:
    """One row per step size and rule: right rate and job time at +10% and -10% (with how
    many regressions were measured rather than rolled back by budget or futility), and the
    false keeps of the 0% control."""
    lines = [f"{'step':>5} {'rule':<22} | {'+10%: n':>7} {'right':>5} {'med s':>5} {'p95 s':>5} "
             f"{'width':>5} | {'-10%: n':>7} {'right':>5} {'regr':>4} {'med s':>5} "
             f"{'p95 s':>5} | {'0%: n':>5} {'kept':>4}"]
    for r in results:
        for name in r["replay"]["+10%"]:
            up, down, null = (r["replay"][e][name] for e in EFFECTS)
            row = f"{r['target_step_s']:>5g} {name:<22} |"
            if up.get("decided"):
                row += (f" {up['decided']:>7} {up['right_rate']:>5.0%} "
                        f"{up['median_time_s']:>5.0f} {up['p95_time_s']:>5.0f} "
                        f"{up['median_width']:>5.3f} |")
            else:
                row += f" {0:>7} {'':>23} |"
            if down.get("decided"):
                row += (f" {down['decided']:>7} {down['right_rate']:>5.0%} "
                        f"{down['verdicts'].get('regression', 0):>4} "
                        f"{down['median_time_s']:>5.0f} {down['p95_time_s']:>5.0f} |")
            else:
                row += f" {0:>7} {'':>23} |"
            row += (f" {null['decided']:>5} {null['kept_rate']:>4.0%}" if null.get("decided")
                    else f" {0:>5}")
            lines.append(row)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes-per-size", type=float, default=3.0)
    p.add_argument("--step-s", type=float, nargs="+", default=[0.05, 0.2, 1.0])
    p.add_argument("--replay-from", type=Path, default=None,
                   help="replay recorded traces instead of recording")
    p.add_argument("--traces", type=Path, default=TRACES)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    defaults = RolloutConfig()
    if args.replay_from is not None:
        recorded = json.loads(gzip.decompress(args.replay_from.read_bytes()))
    else:
        neighbour = start_neighbour()
        try:
            workload = Workload()
            sizes = []
            for target_s in args.step_s:
                sizes.append(record(workload, target_s, args.minutes_per_size, neighbour,
                                    defaults))
                print(f"recorded {target_s:g} s steps: {len(sizes[-1]['steps'])} steps of "
                      f"{sizes[-1]['units']} units of {sizes[-1]['unit_s'] * 1e3:.2f} ms",
                      flush=True)
        finally:
            neighbour.kill()
            neighbour.wait(10)
        recorded = {
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "neighbour": NEIGHBOUR_NOTE,
                        "note": "shared 2-core box; the workload ran on 1 thread"},
            "minutes_per_size": args.minutes_per_size, "sizes": sizes}
        args.traces.parent.mkdir(parents=True, exist_ok=True)
        args.traces.write_bytes(gzip.compress(json.dumps(recorded).encode()))
    rules = {SEQUENTIAL: defaults, **ALTERNATIVES}
    results = []
    for size in recorded["sizes"]:
        windows = recorded_windows(size["steps"])
        results.append({**recording_summary(size, windows, defaults.measure.warmup_steps),
                        "replay": replay(windows, rules)})
    result = {
        "benchmark": "sequential A/B test of tuner measurement: right decisions and job time",
        "labels": {
            "recorded": "per-step times RECORDED on this box: a real MLP workload, arms A and "
                        "B (1/1.1 of A's work) alternating in controller-sized windows",
            "simulated": "decisions SIMULATED over RECORDED step traces: compare() and "
                         "decide() replayed from every window start; starts overlap",
            "time": "job time: recorded step seconds of the windows the trial used, warm-up "
                    "included; a live switch's apply and export latency are not included"},
        "machine": recorded["machine"],
        "config": {"minutes_per_size": recorded["minutes_per_size"],
                   "tokens_per_step": TOKENS_PER_STEP,
                   "measure": defaults.measure.__dict__,
                   "rollout": {k: v for k, v in defaults.__dict__.items()
                               if k not in ("measure", "auto_bounds")},
                   "old_rule": "MeasureConfig(interval='t'), a fixed 3 pairs, keep iff "
                               "ci_low > 0",
                   "traces": os.path.relpath(args.replay_from or args.traces, ROOT)},
        "sizes": results,
    }
    result = judged(result, targets(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(table(results))
    for r in results:
        print(f"{r['target_step_s']:g} s (A {r['mean_step_s']['A']:.3f} s, "
              f"B {r['mean_step_s']['B']:.3f} s): true effect "
              f"{r['true_effect']['+10%']:+.1%}, load {r['load_average_1m']['mean']:.1f}, "
              f"neighbour {r['neighbour_cpu_share']:.0%} of a core, "
              f"own {r['own_cpu_share']:.0%}")
    met = {k: v["met"] for k, v in result["targets"].items()}
    print(json.dumps(met, ensure_ascii=False), f"-> {args.out}")


if __name__ == "__main__":
    main()
