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
        "--quality-len", "16", "--train-steps", "2"]


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
        assert row["model_added_step_ms"] == pytest.approx(read_alone)
        # the eviction bound adds the stored bytes' difference, which is negative below 32 bits
        assert row["eviction_bound_added_step_ms"] < row["model_added_step_ms"]
        low, high = sorted((row["model_added_step_ms"], row["eviction_bound_added_step_ms"]))
        assert row["measured_between_bounds"] == (low <= row["measured_added_step_ms"] <= high)
    assert result["memory_read_gbps"] > 0
    assert [c["context"] for c in result["crossover"]] == [64, 128]
    for decision in result["decisions"]["rows"]:
        # crediting the copy an uncompressed cache makes can only help compression
        assert decision["fused_throughput_gain_copying_engine"] > \
            decision["fused_throughput_gain"]
    names = {t for t in result["targets"]}
    assert {f"{rows[b]['storage']} |cost-model error|" for b in rows if b != 32} <= names
