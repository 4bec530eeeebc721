"""bench/kv.py at a tiny size: what it writes is internally consistent, whatever the timings.

The figures themselves are the bench's to measure; this holds the arithmetic that turns them
into the cost model's predictions and the detector's decisions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.kv import main

TINY = ["--context", "64", "--steps", "2", "--rounds", "1", "--calibration-rounds", "1",
        "--repeats", "2", "--crossover-contexts", "64,128", "--quality-seqs", "1",
        "--quality-len", "16", "--train-steps", "2", "--model-contexts", "96"]


@pytest.fixture
def torch_state() -> Iterator[None]:
    """The bench sets torch's threads and seed for its process; this worker's other tests
    get theirs back."""
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    yield
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)


@pytest.mark.usefixtures("torch_state")
def test_the_model_is_each_width_read_less_float32s_and_copying_engines_gain_more(
        tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    main([*TINY, "--out", str(out)])
    result = json.loads(out.read_text())
    rows = {r["bits"]: r for r in result["rows"]}
    float32_read = rows[32]["read_in_step_ms"]
    for bits, row in rows.items():
        if bits == 32:
            continue
        read_alone = row["read_in_step_ms"] - float32_read
        assert row["read_model_added_step_ms"] == pytest.approx(read_alone)
        # the eviction bound adds the stored bytes' difference, which is negative below 32 bits
        assert row["eviction_bound_added_step_ms"] < row["read_model_added_step_ms"]
        low, high = sorted((row["read_model_added_step_ms"], row["eviction_bound_added_step_ms"]))
        assert row["measured_between_bounds"] == (low <= row["measured_added_step_ms"] <= high)
        ci_low, ci_high = row["measured_added_step_ci_ms"]
        assert ci_low <= row["measured_added_step_ms"] <= ci_high
    sweep = {m["bits"]: m for m in result["model_sweep"]}
    assert sorted(sweep) == [2, 4, 6, 8, 16] and {m["context"] for m in sweep.values()} == {96}
    assert result["memory_read_gbps"] > 0
    assert [c["context"] for c in result["crossover"]] == [64, 128]
    for decision in result["decisions"]["rows"]:
        # crediting the copy an uncompressed cache makes can only help compression
        assert decision["fused_throughput_gain_copying_engine"] > \
            decision["fused_throughput_gain"]
    names = {t for t in result["targets"]}
    assert {f"{rows[b]['storage']} |cost-model error|" for b in rows if b != 32} <= names


def test_the_judged_model_is_fitted_on_the_other_widths_and_only_resolved_widths_count() -> None:
    """Three widths against float32 whose savings are read + 0.5 x stored-bytes refetch: the
    model fitted on the other two predicts the third exactly; a width measured too noisily to
    resolve 20% fits nothing, and its own target is not met, saying why."""
    from bench.kv import _cost_models, targets

    bandwidth = 10e9  # bytes/s
    float32 = {"read_s": 2e-3, "compressed_bytes_per_step": 40e6}
    layouts = {8: (1.5e-3, 10e6), 4: (1.2e-3, 5e6), 2: (1.4e-3, 2.5e6)}
    calibration = {(32, "fused"): float32}
    steps = {(32, "fused"): {"round_step_s": [0.010] * 5}}
    for bits, (read_s, stored) in layouts.items():
        calibration[(bits, "fused")] = {"read_s": read_s, "compressed_bytes_per_step": stored}
        added = read_s - 2e-3 + 0.5 * (stored - 40e6) / bandwidth
        jitter = [0.0] * 5 if bits != 2 else [-3e-3, 3e-3, -3e-3, 3e-3, 0.0]
        steps[(bits, "fused")] = {"round_step_s": [0.010 + added + j for j in jitter]}
    models = _cost_models(calibration, steps, bandwidth)
    for bits in (8, 4):
        assert models[(bits, "fused")]["measurement_resolves_target"]
        assert models[(bits, "fused")]["refetch_factor_fitted"] == pytest.approx(0.5)
        assert models[(bits, "fused")]["model_error"] == pytest.approx(0.0, abs=1e-9)
        assert abs(models[(bits, "fused")]["read_model_error"]) > 0.2
    noisy = models[(2, "fused")]
    assert not noisy["measurement_resolves_target"] and noisy["refetch_factor_fitted"] is None
    assert noisy["refetch_factor_of_others"] == pytest.approx(0.5)

    result = {"rows": [{"bits": 32, "storage": "float32"},
                       *({"bits": b, "storage": f"int{b} packed", **models[(b, "fused")]}
                         for b in (8, 4, 2))],
              "crossover": [], "model_sweep": []}
    judged = {t.name: t for t in targets(result)}
    assert judged["int8 packed |cost-model error|"].met
    unresolved = judged["int2 packed |cost-model error|"]
    assert not unresolved.met and unresolved.measured is None
    assert "no measurement resolves" in (unresolved.note or "")
