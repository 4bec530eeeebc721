"""ModuleGroupProfiler and dtype_speedups on real small torch models on CPU.

Shares are compared with each other, never with absolute times. Where a test needs known
proportions, modules sleep (time.sleep) for set lengths, which the box's load can stretch but
not reorder; where it needs real compute, one group is made many times wider than the rest.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from torch import nn

from collectors import _matmul_speedups, torch_profile
from collectors._catalogue import BY_NAME, PROFILE_METRICS
from collectors._points import CONFIG_VERSION_ATTR
from collectors.torch_profile import (
    ForwardProfile,
    ModuleGroupProfiler,
    ProfileError,
    ProfilerConfig,
    dtype_speedups,
    repeated_blocks,
)
from tests.collectors._otel_points import metric_points

SPEEDUPS = {"fp32": 1.0, "bf16": 2.5, "fp16": 0.5}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test writes to the user's ~/.cache."""
    monkeypatch.setenv(torch_profile.CACHE_ENV, str(tmp_path / "cache"))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: on the shared 2-core box a second thread's waits swamp tiny ops."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def reader() -> Iterator[InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    reader.meter = provider.get_meter("test")  # type: ignore[attr-defined]
    yield reader
    provider.shutdown()


def owner_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The groups tuner.job's default precision knobs use: parameter owners by group."""
    from tuner.job import default_precision_groups

    return default_precision_groups(model, None)


class Sleep(nn.Module):
    """Sleeps ``ms`` then runs its named children in order; one parameter, so it is an owner."""

    def __init__(self, ms: float, **children: nn.Module) -> None:
        super().__init__()
        self.ms = ms
        self.scale = nn.Parameter(torch.ones(()))
        for name, child in children.items():
            self.add_module(name, child)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.ms / 1e3)
        for child in self.children():
            x = child(x)
        return x * self.scale


class Block(nn.Module):
    """A transformer-ish block: norm, then attention-like and MLP Linears."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        return x + self.attn(h) + self.mlp(h)


class Stack(nn.Module):
    """``head`` is registered first but runs last: registration order is not forward order."""

    def __init__(self, d: int = 32, hidden: int = 1024, depth: int = 3) -> None:
        super().__init__()
        self.head = nn.Linear(d, 4)
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def profile_steps(profiler: ModuleGroupProfiler, model: nn.Module, x: torch.Tensor,
                  steps: int) -> list[ForwardProfile]:
    out = []
    for i in range(steps):
        with profiler.step(i):
            model(x).sum().backward()
        assert profiler.last_profile is not None
        out.append(profiler.last_profile)
    return out


def median_shares(profiles: list[ForwardProfile]) -> dict[str, float]:
    return {g: statistics.median(p.group_shares[g] for p in profiles)
            for g in profiles[0].group_shares}


def hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


# ---- shares ---------------------------------------------------------------------------------

def test_nested_groups_are_timed_exclusively_and_shares_sum_to_the_forward(
        reader: InMemoryMetricReader) -> None:
    # outer a (30 ms) holds b and c (15 ms each) of another group; d (30 ms) is alone.
    model = nn.Sequential(Sleep(30, b=Sleep(15), c=Sleep(15)), Sleep(30))
    groups = {"outer": ("0",), "inner": ("0.b", "0.c"), "solo": ("1",)}
    profiler = ModuleGroupProfiler(model, groups, reader.meter, config=ProfilerConfig(
        every_n_steps=1), speedups=SPEEDUPS)
    profiles = profile_steps(profiler, model, torch.ones(2), 3)
    shares = median_shares(profiles)
    assert shares == pytest.approx({"outer": 1 / 3, "inner": 1 / 3, "solo": 1 / 3}, abs=0.08)
    # each step's shares sum to at most 1; medians over steps need not (regression test: a
    # check of the medians' sum failed at 1.001 in a fresh-clone run)
    for profile in profiles:
        assert 0.95 < sum(profile.group_shares.values()) <= 1.0 + 1e-9


def test_a_nested_module_of_the_same_group_is_not_counted_twice(
        reader: InMemoryMetricReader) -> None:
    model = nn.Sequential(Sleep(30, b=Sleep(30)), Sleep(30))
    groups = {"big": ("0", "0.b"), "solo": ("1",)}  # 0.b inside 0, both "big"
    profiler = ModuleGroupProfiler(model, groups, reader.meter, speedups=SPEEDUPS)
    (profile,) = profile_steps(profiler, model, torch.ones(2), 1)
    assert profile.group_shares == pytest.approx({"big": 2 / 3, "solo": 1 / 3}, abs=0.08)


def test_the_group_holding_most_compute_gets_the_biggest_share(
        reader: InMemoryMetricReader, one_thread: None) -> None:
    torch.manual_seed(0)
    model = Stack(d=64, hidden=2048)  # each ffn Linear does 32x an attention Linear's work
    groups = owner_groups(model)
    assert set(groups) == {"head", "embedding", "norm", "attention", "ffn"}
    profiler = ModuleGroupProfiler(model, groups, reader.meter, config=ProfilerConfig(
        every_n_steps=1), speedups=SPEEDUPS)
    x = torch.randn(256, 8)  # the median of 5 sampled steps: one can catch a stall
    profiles = profile_steps(profiler, model, x, 5)
    shares = median_shares(profiles)
    assert shares["ffn"] > 0.4
    assert all(shares["ffn"] > 5 * share for g, share in shares.items() if g != "ffn")
    for p in profiles:
        # parameter owners only: the ReLU between the ffn Linears and the residual adds belong
        # to no group (a precision.ffn knob over these owners would not change them either)
        assert all(s >= 0 for s in p.group_shares.values())
        assert sum(p.group_shares.values()) <= 1.0 + 1e-9
        # the depth view: blocks in model order, each inclusive, together within the forward
        assert list(p.block_shares) == ["blocks.0", "blocks.1", "blocks.2"]
        assert sum(p.block_shares.values()) <= 1.0 + 1e-9
    # Groups that cover every module leave only the root's own code outside them.
    covering = ModuleGroupProfiler(model, {"embed": ("embed",), "blocks": ("blocks.*",),
                                           "head": ("head",)}, reader.meter,
                                   config=ProfilerConfig(every_n_steps=1), speedups=SPEEDUPS)
    sums = [sum(p.group_shares.values()) for p in profile_steps(covering, model, x, 5)]
    assert 0.9 < statistics.median(sums) and max(sums) <= 1.0 + 1e-9


def test_a_cnn_with_batchnorm_by_explicit_patterns(reader: InMemoryMetricReader,
                                                   one_thread: None) -> None:
    model = cnn()
    groups = {"conv": ("0", "3"), "bn": ("[14]",), "classifier": ("8",)}
    profiler = ModuleGroupProfiler(model, groups, reader.meter, config=ProfilerConfig(
        every_n_steps=1), speedups=SPEEDUPS)
    profiles = profile_steps(profiler, model, torch.randn(4, 3, 32, 32), 3)
    shares = median_shares(profiles)
    assert shares["conv"] > shares["classifier"]
    assert sum(shares.values()) < 1.0  # ReLU and pooling belong to no group
    profile = profiles[-1]
    assert profile.forward_order == ("conv", "bn", "classifier")
    assert list(profile.block_shares) == [str(i) for i in range(9)]
    assert profile.param_dtypes == {g: ("float32",) for g in groups}


def test_several_forwards_in_one_step_count_together(reader: InMemoryMetricReader) -> None:
    model = nn.Sequential(Sleep(20), Sleep(20))
    profiler = ModuleGroupProfiler(model, {"a": ("0",), "b": ("1",)}, reader.meter,
                                   speedups=SPEEDUPS)
    with profiler.step(0):
        for _ in range(3):  # micro-batches
            model(torch.ones(2))
    profile = profiler.last_profile
    assert profile is not None
    assert profile.forward_s > 0
    assert profile.group_shares == pytest.approx({"a": 0.5, "b": 0.5}, abs=0.08)


# ---- structure: order, blocks, dtypes -------------------------------------------------------

def test_forward_order_is_first_call_order_not_registration_order(
        reader: InMemoryMetricReader) -> None:
    model = Stack(hidden=64)
    assert list(owner_groups(model)) == ["head", "embedding", "norm", "attention", "ffn"]
    profiler = ModuleGroupProfiler(model, owner_groups(model), reader.meter, speedups=SPEEDUPS)
    (profile,) = profile_steps(profiler, model, torch.randn(2, 8), 1)
    assert profile.forward_order == ("embedding", "norm", "attention", "ffn", "head")


def test_repeated_blocks_are_the_outermost_numbered_children() -> None:
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.ModuleList(Layer() for _ in range(12))

    class Bert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Encoder()
            self.pooler = nn.Sequential(nn.Linear(2, 2))  # one child: not repeated

    assert repeated_blocks(Bert()) == [f"encoder.layer.{i}" for i in range(12)]
    assert repeated_blocks(Stack(depth=4)) == [f"blocks.{i}" for i in range(4)]
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == ["0", "1"]


def test_block_shares_tell_blocks_apart(reader: InMemoryMetricReader) -> None:
    """Blocks of 50, 100 and 200 ms: long enough that a wake-up late by a loaded box's few
    milliseconds (the first block once took 0.23 of a step of 10, 20 and 40 ms blocks) moves
    no share past the tolerance."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Sleep(ms) for ms in (50, 100, 200))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    model = Net()
    profiler = ModuleGroupProfiler(model, {"all": ("layers.*",)}, reader.meter,
                                   speedups=SPEEDUPS)
    (profile,) = profile_steps(profiler, model, torch.ones(2), 1)
    assert list(profile.block_shares) == ["layers.0", "layers.1", "layers.2"]
    assert profile.block_shares == pytest.approx(
        {"layers.0": 1 / 7, "layers.1": 2 / 7, "layers.2": 4 / 7}, abs=0.08)


def test_param_dtypes_are_what_the_module_computes_with(reader: InMemoryMetricReader) -> None:
    model = Stack(hidden=64)
    swapped: list[dict[str, torch.Tensor]] = []

    def to_bf16(module: nn.Module, args: tuple[object, ...]) -> tuple[object, ...]:
        # what tuner.precision does: a bf16 copy of the weights for the length of the forward
        swapped.append(dict(module._parameters))  # type: ignore[arg-type]
        for k, p in list(module._parameters.items()):
            module._parameters[k] = p.to(torch.bfloat16)  # type: ignore[union-attr]
        return tuple(a.to(torch.bfloat16) for a in args)  # type: ignore[union-attr]

    def back(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        module._parameters.update(swapped.pop())
        return output.float()

    for block in model.blocks:  # registered before the profiler's hooks, as at a step boundary
        for linear in (block.mlp[0], block.mlp[2]):
            linear.register_forward_pre_hook(to_bf16)
            linear.register_forward_hook(back)
    profiler = ModuleGroupProfiler(model, owner_groups(model), reader.meter, speedups=SPEEDUPS)
    (profile,) = profile_steps(profiler, model, torch.randn(2, 8), 1)
    assert profile.param_dtypes["ffn"] == ("bfloat16",)
    assert profile.param_dtypes["attention"] == ("float32",)
    assert next(model.blocks[0].mlp[0].parameters()).dtype == torch.float32
    assert profile.autocast_dtypes == {}
    with profiler.step(50):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 8))
    assert profiler.last_profile is not None
    assert profiler.last_profile.autocast_dtypes["attention"] == ("bfloat16",)


# ---- sampling -------------------------------------------------------------------------------

def test_unsampled_steps_install_no_hooks(reader: InMemoryMetricReader) -> None:
    model = Stack(hidden=64)
    profiler = ModuleGroupProfiler(model, owner_groups(model), reader.meter,
                                   config=ProfilerConfig(every_n_steps=3), speedups=SPEEDUPS)
    x = torch.randn(2, 8)
    sampled = []
    for i in range(7):
        profiler.before_step(i)
        sampled.append(hooks(model) > 0)
        model(x)
        profiler.after_step()
        assert hooks(model) == 0
    assert sampled == [True, False, False, True, False, False, True]
    assert profiler.last_profile is not None and profiler.last_profile.step == 6


def test_a_step_that_raises_exports_nothing_and_removes_its_hooks(
        reader: InMemoryMetricReader) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    profiler = ModuleGroupProfiler(model, {"a": ("0",), "b": ("1",)}, reader.meter,
                                   speedups=SPEEDUPS)
    with pytest.raises(RuntimeError), profiler.step(0):
        model(torch.ones(3, 3))  # wrong shape: the forward raises inside a hooked module
    assert hooks(model) == 0
    assert profiler.last_profile is None
    assert metric_points(reader) == {}
    (profile,) = profile_steps(profiler, model, torch.ones(3, 2), 1)  # and it recovers
    assert profile.forward_order == ("a", "b")


# ---- export ---------------------------------------------------------------------------------

def test_exports_the_catalogue_metrics(reader: InMemoryMetricReader) -> None:
    model = Stack(hidden=64, depth=2)
    version = {"v": 7}
    profiler = ModuleGroupProfiler(model, owner_groups(model), reader.meter,
                                   config_version=lambda: version["v"], speedups=SPEEDUPS,
                                   attributes={"seedance.rank": 0})
    profile_steps(profiler, model, torch.randn(2, 8), 1)
    points = metric_points(reader)
    assert set(points) == {spec.name for spec in PROFILE_METRICS}
    for name, rows in points.items():
        for row in rows:
            assert set(row["attributes"]) <= set(BY_NAME[name].attributes), name
            assert row["attributes"][CONFIG_VERSION_ATTR] == 7
            assert row["attributes"]["seedance.rank"] == 0

    def by(name: str, attribute: str) -> dict[str, float]:
        return {r["attributes"][attribute]: r["value"] for r in points[name]}

    shares = by("seedance.train.group.time_share", "seedance.module_group")
    assert shares == pytest.approx(dict(profiler.last_profile.group_shares))  # type: ignore[union-attr]
    assert by("seedance.train.group.forward_rank", "seedance.module_group") == {
        "embedding": 0, "norm": 1, "attention": 2, "ffn": 3, "head": 4}
    dtypes = points["seedance.train.group.param_dtype"]
    assert {(r["attributes"]["seedance.module_group"], r["attributes"]["seedance.dtype"],
             r["attributes"]["seedance.dtype.source"], r["value"]) for r in dtypes} == {
        (g, "float32", "parameters", 1) for g in shares}
    assert list(by("seedance.train.block.time_share", "seedance.block")) == [
        "blocks.0", "blocks.1"]
    speedups = points["seedance.device.matmul_speedup"]
    assert {r["attributes"]["seedance.dtype"]: r["value"] for r in speedups} == {
        "float32": 1.0, "bfloat16": 2.5, "float16": 0.5}
    assert {r["attributes"]["hw.model"] for r in speedups} == {profiler.device_model}


def test_configuration_errors_name_the_field(reader: InMemoryMetricReader) -> None:
    model = Stack(hidden=8)
    with pytest.raises(ProfileError, match="every_n_steps"):
        ProfilerConfig(every_n_steps=0)
    with pytest.raises(ProfileError, match=r"groups\['ffn'\].*'nope\*'"):
        ModuleGroupProfiler(model, {"ffn": ("nope*",)}, reader.meter, speedups=SPEEDUPS)
    with pytest.raises(ProfileError, match=r"groups\['ffn'\]"):
        ModuleGroupProfiler(model, {"ffn": "blocks.0.mlp"}, reader.meter, speedups=SPEEDUPS)
    with pytest.raises(ProfileError, match="speedups"):
        ModuleGroupProfiler(model, {"ffn": ("blocks.*",)}, reader.meter, speedups={"int3": 9})


# ---- dtype speedups -------------------------------------------------------------------------

def test_dtype_speedups_are_measured_once_per_device_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake(device: torch.device) -> tuple[dict[str, float], int]:
        calls.append(device)
        return {"fp32": 1.0, "bf16": 3.0}, 512

    monkeypatch.setattr(_matmul_speedups, "_benchmark", fake)
    assert dtype_speedups("cpu") == {"fp32": 1.0, "bf16": 3.0}
    cache = tmp_path / "cache" / "matmul_speedups.json"  # from SEEDANCE_CACHE_DIR
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["speedups"] == {"fp32": 1.0, "bf16": 3.0} and entry["size"] == 512
    assert dtype_speedups(torch.device("cpu")) == {"fp32": 1.0, "bf16": 3.0}
    assert len(calls) == 1  # read back, not measured again
    assert sorted(p.name for p in cache.parent.iterdir()) == ["matmul_speedups.json"]
    other = tmp_path / "elsewhere"
    dtype_speedups("cpu", cache_dir=other)
    assert len(calls) == 2 and (other / "matmul_speedups.json").exists()
    cache.write_text("{not json")  # a damaged cache is measured again and rewritten
    dtype_speedups("cpu")
    assert len(calls) == 3 and json.loads(cache.read_text())


def test_dtype_speedups_measures_this_cpu(one_thread: None) -> None:
    torch.set_num_threads(2)
    state = torch.random.get_rng_state()
    speedups = dtype_speedups("cpu")
    assert set(speedups) == {"fp32", "bf16", "fp16"}  # no fp8 matmul on a CPU
    assert speedups["fp32"] == 1.0
    assert all(math.isfinite(v) and v > 0 for v in speedups.values())
    assert torch.get_num_threads() == 2  # the one-thread measurement restored it
    assert torch.equal(torch.random.get_rng_state(), state)  # the job's random stream untouched
