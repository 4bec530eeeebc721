"""The seed's cost models: formulas checked against the seed's worked numbers and first principles."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies import (
    ARTICLE_FP16_TO_INT4_RATIO,
    ARTICLE_HBM2E_ROW_ACCESS_S,
    ARTICLE_PCIE5_X16_MEASURED_BYTES_PER_S,
    allreduce_calls,
    allreduce_time_s,
    bandwidth_saturation,
    critical_saturation,
    dequantize,
    equivalent_scale_out_nodes,
    gpu_spec,
    hbm_row_accesses,
    kv_compression_tradeoff,
    kv_decompression_cost_s,
    kv_read_added_s,
    kv_refetch_factor,
    measure_dequantize_throughput,
    microbatches_for_bubble,
    pack_uint,
    payback_months,
    pcie_lane_bandwidth_bytes_per_s,
    peak_memory_bandwidth_bytes_per_s,
    peak_pcie_bandwidth_bytes_per_s,
    pressure_for_marginal_cost_ratio,
    ring_allreduce_bytes_per_rank,
    roi_delta,
    roi_matrix,
    saturation_marginal_cost_ratio,
    split_communication,
    unpack_uint,
)

SAMPLES = Path(__file__).resolve().parents[1] / "data"

# ---- 2.1 bandwidth saturation -------------------------------------------------------------


def test_saturation_seed_example_is_44_3_percent_not_the_printed_52_7() -> None:
    f = bandwidth_saturation(1500, 2048, k=0.8)
    assert f == pytest.approx(0.443, abs=5e-4)
    assert abs(f - 0.527) > 0.05


def test_saturation_bounds_and_monotonicity() -> None:
    pressures = np.linspace(0, 2, 41)
    values = [bandwidth_saturation(p * 100, 100) for p in pressures]
    assert values[0] == 0.0
    assert all(0 <= v < 1 for v in values)
    assert all(b > a for a, b in zip(values, values[1:], strict=False))


def test_marginal_cost_of_a_5_percent_step_is_4_percent_not_2_3x() -> None:
    # cost of effective compute = inverse slope of f; measure it numerically
    def inverse_slope(r: float, h: float = 1e-7) -> float:
        return h / (bandwidth_saturation(r + h, 1) - bandwidth_saturation(r, 1))

    numeric = inverse_slope(0.75) / inverse_slope(0.70)
    assert saturation_marginal_cost_ratio(0.70, 0.75) == pytest.approx(numeric, rel=1e-5)
    assert numeric == pytest.approx(1.041, abs=1e-3)
    # the step costs the same everywhere: the curve has no knee at 0.7
    assert inverse_slope(0.15) / inverse_slope(0.10) == pytest.approx(numeric, rel=1e-5)
    # 2.3x the zero-pressure cost is reached only past x/B = 1
    r = pressure_for_marginal_cost_ratio(2.3)
    assert r > 1.0
    assert inverse_slope(r) / inverse_slope(0.0) == pytest.approx(2.3, rel=1e-4)


# ---- hardware ------------------------------------------------------------------------------


def test_critical_saturation_known_only_where_the_seed_measured() -> None:
    assert critical_saturation("Tesla V100-SXM2-16GB") == 0.68
    assert critical_saturation("NVIDIA A100-SXM4-80GB") == 0.72
    for unknown in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA L40S", "Tesla T4",
                    "NVIDIA GeForce RTX 4090"):
        assert critical_saturation(unknown) is None


@pytest.mark.parametrize(("name", "gb_s"), [
    ("Tesla V100-SXM2-32GB", 900), ("NVIDIA A100-SXM4-40GB", 1555),
    ("NVIDIA A100-SXM4-80GB", 2039), ("NVIDIA A100 80GB PCIe", 1935),
    ("NVIDIA H100 80GB HBM3", 3350), ("NVIDIA H100 PCIe", 2000), ("NVIDIA H200", 4800),
    ("NVIDIA L40S", 864), ("Tesla T4", 320),
])
def test_spec_table_matches_datasheets(name: str, gb_s: float) -> None:
    spec = gpu_spec(name)
    assert spec is not None
    assert spec.memory_bandwidth_bytes_per_s == gb_s * 1e9
    assert "datasheet" in spec.source


def test_unknown_gpu_has_no_spec() -> None:
    assert gpu_spec("NVIDIA H100 NVL") is None
    assert gpu_spec("Some Accelerator") is None


def _max_memory_clock_mhz(path: Path) -> float:
    text = path.read_text(errors="replace")
    if path.suffix == ".xml":
        block = text[text.index("<max_clocks>"):]
        return float(re.search(r"<mem_clock>(\d+) MHz", block).group(1))  # type: ignore[union-attr]
    block = text[text.index("Max Clocks"):]
    return float(re.search(r"Memory\s+:\s+(\d+) MHz", block).group(1))  # type: ignore[union-attr]


@pytest.mark.parametrize(("sample", "bus_width_bits", "name"), [
    ("nvidia-smi_q-x_a100-sxm4_telegraf-testdata.xml", 5120, "NVIDIA A100-SXM4-80GB"),
    ("nvidia-smi_capture_linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt", 5120,
     "NVIDIA H100 80GB HBM3"),
    ("nvidia-smi_capture_linux-x86_64__nvidia-l40s__595.80.txt", 384, "NVIDIA L40S"),
])
def test_peak_memory_bandwidth_from_real_clocks_matches_datasheet(
        sample: str, bus_width_bits: int, name: str) -> None:
    path = SAMPLES / sample
    if not path.exists():
        pytest.skip(f"{path} not present")
    peak = peak_memory_bandwidth_bytes_per_s(bus_width_bits, _max_memory_clock_mhz(path))
    spec = gpu_spec(name)
    assert spec is not None
    assert peak == pytest.approx(spec.memory_bandwidth_bytes_per_s, rel=0.005)


def test_pcie_per_lane_rates_after_encoding() -> None:
    expected_mb_s = {1: 250, 2: 500, 3: 985, 4: 1969, 5: 3938, 6: 7563}
    for gen, mb_s in expected_mb_s.items():
        assert pcie_lane_bandwidth_bytes_per_s(gen) / 1e6 == pytest.approx(mb_s, abs=1)
    x16 = peak_pcie_bandwidth_bytes_per_s(5, 16)
    assert x16 == 16 * pcie_lane_bandwidth_bytes_per_s(5)
    assert ARTICLE_PCIE5_X16_MEASURED_BYTES_PER_S < x16
    with pytest.raises(ValueError, match="generation"):
        pcie_lane_bandwidth_bytes_per_s(9)


# ---- 4.4 KV decompression --------------------------------------------------------------------


def test_kv_cost_gpu_path_with_seed_reference_values() -> None:
    kv_fp16 = 1 << 30
    compressed = kv_fp16 / ARTICLE_FP16_TO_INT4_RATIO
    t = kv_decompression_cost_s(compressed, pcie_bytes_per_s=ARTICLE_PCIE5_X16_MEASURED_BYTES_PER_S)
    rows = math.ceil(compressed / 1024)
    assert t == pytest.approx(compressed / 28.3e9 + rows * 12.8e-9)
    assert hbm_row_accesses(compressed) == rows
    explicit = kv_decompression_cost_s(compressed, pcie_bytes_per_s=28.3e9, n_hbm_accesses=0)
    assert explicit == pytest.approx(compressed / 28.3e9)
    assert t - explicit == pytest.approx(rows * ARTICLE_HBM2E_ROW_ACCESS_S)


def test_kv_cost_cpu_path_and_argument_errors() -> None:
    assert kv_decompression_cost_s(1e6, dequantize_bytes_per_s=2e9) == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="not both"):
        kv_decompression_cost_s(1e6, dequantize_bytes_per_s=2e9, pcie_bytes_per_s=1e9)
    with pytest.raises(ValueError, match="pcie_bytes_per_s"):
        kv_decompression_cost_s(1e6)


@given(bits=st.integers(1, 8), data=st.data())
def test_pack_unpack_round_trip(bits: int, data: st.DataObject) -> None:
    values = np.array(data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=200)),
                      dtype=np.int64)
    unpacked = unpack_uint(pack_uint(values, bits), bits)
    assert unpacked[: values.size].tolist() == values.tolist()
    assert not unpacked[values.size:].any()  # only zero padding after the values


def test_unpack_is_least_significant_bits_first() -> None:
    assert unpack_uint(np.array([0xB4], dtype=np.uint8), 4).tolist() == [0x4, 0xB]
    assert unpack_uint(np.array([0b11100100], dtype=np.uint8), 2).tolist() == [0, 1, 2, 3]


def test_dequantize_is_symmetric_around_zero() -> None:
    codes = np.array([0, 8, 15], dtype=np.int64)
    x = dequantize(pack_uint(codes, 4), 4, 0.5)[: codes.size]
    assert x.tolist() == [(0 - 8) * 0.5, 0.0, (15 - 8) * 0.5]


def test_measured_dequantize_throughput_is_positive_and_finite() -> None:
    bps = measure_dequantize_throughput(4, 1 << 16, 3)
    assert math.isfinite(bps) and bps > 0


def _tradeoff(**overrides: float) -> object:
    params: dict[str, float] = dict(
        kv_budget_bytes=8e9, kv_bytes_per_token=160e3, context_tokens=4096,
        compression_ratio=4.0, step_base_s=0.010, step_per_sequence_s=0.0005,
        decompress_s_per_sequence=0.0001)
    params.update(overrides)
    return kv_compression_tradeoff(**params)  # type: ignore[arg-type]


def test_compression_worth_it_when_freed_memory_outweighs_decode_cost() -> None:
    v = _tradeoff()
    seq = 160e3 * 4096
    assert v.batch_before == int(8e9 // seq) and v.batch_after == int(8e9 // (seq / 4))
    assert v.step_s_after == pytest.approx(0.010 + v.batch_after * 0.0006)
    assert v.tokens_per_s_after > v.tokens_per_s_before
    assert v.worth_it
    assert v.max_context_tokens_after == 4 * v.max_context_tokens_before


def test_compression_not_worth_it_when_decompression_eats_the_gain() -> None:
    v = _tradeoff(decompress_s_per_sequence=0.01)
    assert not v.worth_it and v.throughput_gain < 0
    capped = _tradeoff(max_batch=12)  # no more requests to admit: memory is worth nothing
    assert capped.batch_before == capped.batch_after == 12 and not capped.worth_it
    slo = _tradeoff(tpot_slo_s=0.02)
    assert not slo.worth_it and "SLO" in slo.reason


def test_compression_credits_the_uncompressed_read_it_replaces() -> None:
    """An engine that copies its uncompressed cache each step pays that copy too; where no
    extra sequence fits, compression pays exactly when dequantising is the cheaper read."""
    capped = {"max_batch": 12, "decompress_s_per_sequence": 0.0002}
    in_place = _tradeoff(**capped)
    assert in_place.batch_before == in_place.batch_after and not in_place.worth_it
    copying = _tradeoff(**capped, replaced_read_s_per_sequence=0.0003)
    assert copying.step_s_before == pytest.approx(0.010 + 12 * 0.0008)
    assert copying.step_s_after == pytest.approx(0.010 + 12 * 0.0007)
    assert copying.worth_it and "faster than the uncompressed copy" in copying.reason
    dearer = _tradeoff(**capped, replaced_read_s_per_sequence=0.0001)
    assert not dearer.worth_it and dearer.throughput_gain < 0
    with pytest.raises(ValueError, match="replaced_read_s_per_sequence"):
        _tradeoff(replaced_read_s_per_sequence=-1e-3)


def test_kv_read_added_time_has_the_read_alone_and_the_eviction_bound() -> None:
    """4-bit against float32 on a copying engine: the quantised read takes 1 ms, the copy it
    replaces 3 ms; 12 MB fewer stored bytes at 40 GB/s spare a further 0.3 ms when every
    streamed byte evicts one."""
    args = dict(read_s=1e-3, stored_bytes=4e6, replaced_read_s=3e-3, replaced_stored_bytes=16e6)
    assert kv_read_added_s(**args) == pytest.approx(-2e-3)
    assert kv_read_added_s(**args, memory_read_bytes_per_s=40e9) == pytest.approx(-2.3e-3)
    in_place = dict(args, replaced_read_s=0.0)
    assert kv_read_added_s(**in_place) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="memory_read_bytes_per_s"):
        kv_read_added_s(**args, memory_read_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="read_s"):
        kv_read_added_s(**dict(args, read_s=-1.0))
    halfway = kv_read_added_s(**args, memory_read_bytes_per_s=40e9, refetch_factor=0.5)
    assert halfway == pytest.approx(-2.15e-3)


def test_the_refetch_factor_a_measured_width_implies_predicts_it_back() -> None:
    """A trial measured 2.15 ms saved where the reads explain 2 ms and the 12 MB fewer stored
    bytes at 40 GB/s could explain 0.3 ms more: half of them were refetched."""
    args = dict(read_s=1e-3, stored_bytes=4e6, replaced_read_s=3e-3, replaced_stored_bytes=16e6)
    factor = kv_refetch_factor(-2.15e-3, **args, memory_read_bytes_per_s=40e9)
    assert factor == pytest.approx(0.5)
    assert kv_read_added_s(**args, memory_read_bytes_per_s=40e9, refetch_factor=factor) \
        == pytest.approx(-2.15e-3)
    # a width slower than its reads explain does not make refetching negative
    assert kv_refetch_factor(-1e-3, **args, memory_read_bytes_per_s=40e9) == 0.0
    # the same stored bytes say nothing about refetching
    assert kv_refetch_factor(-1e-3, **dict(args, stored_bytes=16e6),
                             memory_read_bytes_per_s=40e9) is None


# ---- truth 3 communication volume -------------------------------------------------------------


def test_ring_allreduce_volume_and_buckets() -> None:
    assert ring_allreduce_bytes_per_rank(100.0, 4) == pytest.approx(150.0)
    assert ring_allreduce_bytes_per_rank(100.0, 1) == 0.0
    assert allreduce_calls(100e6, 25e6) == 4 and allreduce_calls(101e6, 25e6) == 5
    small = allreduce_time_s(1e9, 8, bucket_bytes=1e6, alpha_s=1e-4, beta_s_per_byte=1e-10)
    large = allreduce_time_s(1e9, 8, bucket_bytes=1e8, alpha_s=1e-4, beta_s_per_byte=1e-10)
    assert small - large == pytest.approx((1000 - 10) * 1e-4)


def test_truth3_3_7x_does_not_follow_from_volume_model() -> None:
    common = dict(params_bytes=14e9, dp_ranks=4, activation_bytes=64e6, bucket_bytes=25e6)
    fixed_m = [split_communication(segments=s, microbatches=16, **common) for s in (8, 16)]
    assert fixed_m[1].allreduce_bytes == pytest.approx(fixed_m[0].allreduce_bytes)
    # calls: with segments larger than a bucket the split hardly changes them ...
    assert fixed_m[1].allreduce_calls - fixed_m[0].allreduce_calls <= 16
    # ... with buckets larger than a segment, one call per segment: twice as many
    big = dict(common, bucket_bytes=4e9)
    calls = [split_communication(segments=s, microbatches=16, **big).allreduce_calls
             for s in (8, 16)]
    assert calls == [8, 16]
    boundary_linear = fixed_m[1].boundary_bytes / fixed_m[0].boundary_bytes
    assert boundary_linear == pytest.approx(15 / 7)
    scaled = [split_communication(segments=s, microbatches=microbatches_for_bubble(s, 0.2),
                                  **common) for s in (8, 16)]
    boundary_quadratic = scaled[1].boundary_bytes / scaled[0].boundary_bytes
    assert boundary_quadratic == pytest.approx((15 / 7) ** 2, rel=0.02)
    # the seed's 3.7x sits between the two bounds, so no single volume term explains it
    assert boundary_linear < 3.7 < boundary_quadratic
    total = scaled[1].total_bytes / scaled[0].total_bytes
    assert total < boundary_quadratic


def test_microbatches_hold_the_bubble_fraction() -> None:
    def bubble(p: int, m: int) -> float:
        return (p - 1) / (m + p - 1)

    for p in (2, 8, 16):
        m = microbatches_for_bubble(p, 0.1)
        assert bubble(p, m) <= 0.1 + 1e-12
        assert m == 1 or bubble(p, m - 1) > 0.1  # the smallest such m


# ---- 2.5 ROI ------------------------------------------------------------------------------------


def test_equivalent_nodes_reproduce_both_seed_examples_with_one_cluster() -> None:
    n = 1.7 / equivalent_scale_out_nodes(1.0, 0.18)  # the cluster size example 1 implies
    assert round(equivalent_scale_out_nodes(n, 0.32), 1) == 3.1
    # a model without the gamma exponent's convexity cannot: nodes removed n(1 - 1/(1+g))
    n_lin = 1.7 / (1 - 1 / 1.18)
    assert round(n_lin * (1 - 1 / 1.32), 1) != 3.1


def test_payback_round_trip_and_monotonicity() -> None:
    implied_fix_cost = 4.2 * 1.7  # node-months; the seed does not state it
    assert payback_months(implied_fix_cost, 1.7, 1.0) == pytest.approx(4.2)
    assert payback_months(10, 3.1, 1.0) < payback_months(10, 1.7, 1.0)
    assert payback_months(10, 0.0, 1.0) == math.inf


def test_roi_matrix_shape_and_monotonicity() -> None:
    m = roi_matrix(n_nodes=10, target_utilisation=0.9, node_cost_per_month=1.0, fix_cost=10.0,
                   horizon_months=12)
    assert m.shape == (5, 6)
    assert m.index.tolist() == pytest.approx([1.0, 1.375, 1.75, 2.125, 2.5])
    assert m.columns.tolist() == pytest.approx([0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    values = m.to_numpy()
    assert (np.diff(values, axis=0) >= 0).all()  # more planned scale-out -> more to avoid
    assert (np.diff(values, axis=1) <= 0).all()  # less headroom -> less to gain
    assert values[:, -1] == pytest.approx(-1.0)  # already at target: the fix is wasted


def test_roi_falls_as_gamma_rises() -> None:
    kwargs = dict(n_nodes=10, target_utilisation=0.9, node_cost_per_month=1.0, fix_cost=10.0,
                  horizon_months=12)
    assert roi_delta(0.5, 2.0, gamma=0.6, **kwargs) > roi_delta(0.5, 2.0, gamma=0.9, **kwargs)
