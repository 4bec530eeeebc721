"""The generalisation benchmark's model families, their loop and the grid of their knobs."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seedancectl._session import _PROGRESS
from tuner.job import PRECISION_CHOICES
from workloads.families import FAMILIES, FamilyError, family
from workloads.train_family import (
    config_label,
    default_config,
    knob_grid,
    live_knobs,
    null_session,
    run_steps,
    spread,
    train_step,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_builds_at_full_size_with_recognised_groups(name: str) -> None:
    built = family(name).build(seed=0)
    params = sum(p.numel() for p in built.model.parameters())
    assert 1e5 < params < 5e7
    groups = null_session(built).precision_groups
    assert len(groups) >= 2  # the default grouping finds more than one group by name
    assert groups.keys() == null_session(family(name).build(tiny=True)).precision_groups.keys()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_trains_three_steps_with_finite_loss(name: str) -> None:
    built = family(name).build(seed=0, tiny=True)
    assert "gpt" not in type(built.model).__name__.lower()  # none of them is the demo GPT
    session = null_session(built)
    before = [p.detach().clone() for p in built.model.parameters()]
    losses = [float(train_step(built, session)) for _ in range(3)]
    session.close()
    assert all(math.isfinite(v) for v in losses), losses
    assert any(not torch.equal(a, b) for a, b in zip(before, built.model.parameters(),
                                                     strict=True))
    assert built.tokens_per_batch == built.global_batch * built.family.tokens_per_sample


def test_batches_are_deterministic_per_seed() -> None:
    a, b, c = (family("rnn").build(seed=s, tiny=True).batches for s in (0, 0, 1))
    xa, ya = next(a)
    xb, yb = next(b)
    xc, _ = next(c)
    assert torch.equal(xa, xb) and torch.equal(ya, yb) and not torch.equal(xa, xc)
    assert len(xa) == family("rnn").global_batch


def test_unknown_family_names_the_known_ones() -> None:
    with pytest.raises(FamilyError, match="cnn_bn"):
        family("resnet9000")


def test_run_steps_returns_tokens_and_seconds_per_step() -> None:
    built = family("mlp").build(tiny=True)
    config = {**default_config(built), "micro_batch": 64, "threads": 1}
    warm: list[tuple[int, float]] = []
    losses: list[float] = []
    steps = run_steps(built, config, 2, warmup=1, losses=losses, warmup_out=warm)
    assert len(steps) == 2 and len(warm) == 1 and len(losses) == 3
    assert all(t == built.tokens_per_batch and s > 0 for t, s in steps)
    assert torch.get_num_threads() == default_config(built)["threads"]  # restored


def test_run_steps_applies_low_precision_to_batchnorm_groups() -> None:
    built = family("cnn_bn").build(tiny=True)
    config = {k: ("bf16" if k.startswith("precision.") else v)
              for k, v in default_config(built).items()}
    losses: list[float] = []
    assert len(run_steps(built, config, 1, losses=losses)) == 1
    assert math.isfinite(losses[0])
    x, _ = next(built.batches)
    assert built.model(x).dtype == torch.float32  # hooks removed afterwards


def test_run_steps_budget_measures_nothing_when_warmup_overruns() -> None:
    built = family("mlp").build(tiny=True)
    warm: list[tuple[int, float]] = []
    assert run_steps(built, default_config(built), 5, warmup=1, max_seconds=1e-9,
                     warmup_out=warm) == []
    assert len(warm) == 1
    assert len(run_steps(built, default_config(built), 5, max_seconds=1e-9)) == 1


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_grid_covers_every_declared_live_knob(name: str) -> None:
    built = family(name).build(tiny=True)
    knobs = live_knobs(built)
    grid = knob_grid(built)
    assert default_config(built) in grid
    assert {"micro_batch", *(k for k in knobs if k.startswith("precision."))} <= set(knobs)
    for knob, domain in knobs.items():
        seen = {c[knob] for c in grid}
        if knob.startswith("precision."):
            assert seen == set(PRECISION_CHOICES)
        elif knob == "threads":
            assert seen == {min(domain), max(domain)}
        else:
            assert knob == "micro_batch"
            launch = default_config(built)["micro_batch"]
            assert built.global_batch in seen and launch in seen
            assert 1 < len(seen - {launch}) <= 4  # 4 log-spread sizes, and the launch one
            assert all(built.global_batch % m == 0 for m in seen)
    for config in grid:  # uniform precision over the groups
        assert len({v for k, v in config.items() if k.startswith("precision.")}) == 1
    assert len({config_label(c) for c in grid}) == len(grid)


def test_spread_keeps_the_ends_and_spaces_by_ratio() -> None:
    assert spread([1, 2, 4, 8, 16, 32, 64, 128, 256], 4) in ([1, 4, 32, 256], [1, 8, 32, 256],
                                                             [1, 4, 64, 256], [1, 8, 64, 256])
    assert spread([1, 2, 4], 4) == [1, 2, 4]
    assert spread([1, 2, 4], 1) == [4]


def test_cli_prints_progress_and_stops_cleanly_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "workloads.train_family", "--family", "cnn_bn", "--seconds",
         "120", "--log-every", "1"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if _PROGRESS.match(line):
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, "".join(lines) + rest
    assert "done (signal 15)" in rest


def test_bench_interleaves_the_reference_around_every_block(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("generalisation",
                                                  ROOT / "bench" / "generalisation.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "generalisation", bench)  # its dataclasses look it up
    spec.loader.exec_module(bench)
    built = family("mlp").build(tiny=True)
    default = default_config(built)
    configs = {"default": default, "mb64": {**default, "micro_batch": 64},
               "t1": {**default, "threads": 1}}
    arms = bench.interleave(built, configs, "default", rounds=2, steps=2, visit_s=60.0,
                            reference_every=1, prune_below=None, seed=0,
                            restorer=bench.Restorer(built))
    assert len(arms["default"].visits) == 1 + 2 * 2  # before the first, after every config
    for name in ("mb64", "t1"):
        assert arms[name].rounds == 2 and len(arms[name].relatives) == 2
        point, low, high = bench.ratio_ci(arms[name], arms["default"], boots=200)
        assert 0 < low <= point <= high
    assert bench.ratio_ci(arms["default"], arms["default"], boots=50)[0] == 1.0
