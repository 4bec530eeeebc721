"""TrainingInstrumentation on real tiny models on CPU, read back through an in-memory reader."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from torch import nn

from collectors._catalogue import TRAINING_METRICS
from collectors._errors import SeedanceError
from collectors._points import CONFIG_VERSION_ATTR
from collectors.torch_training import (
    MODULE_GROUP_ATTR,
    TrainingInstrumentation,
    assign_groups,
)
from workloads.gpt import GPT, GPTConfig

TINY = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture
def reader() -> Iterator[InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    reader.meter = provider.get_meter("test")  # type: ignore[attr-defined]
    yield reader
    provider.shutdown()


def _points(reader: InMemoryMetricReader) -> dict[str, list]:
    data = reader.get_metrics_data()
    out: dict[str, list] = {}
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out.setdefault(metric.name, []).extend(metric.data.data_points)
    return out


def _gpt_backward(seed: int = 0) -> tuple[GPT, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(seed)
    model = GPT(TINY)
    idx = torch.randint(0, TINY.vocab_size, (4, TINY.block_size))
    loss = model(idx, idx.roll(-1, dims=1))
    loss.backward()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), loss


def test_default_groups_follow_common_names() -> None:
    model = GPT(TINY)
    names = [n for n, _ in model.named_parameters()]
    assigned = dict(zip(names, assign_groups(names), strict=True))
    assert assigned["h.0.attn.qkv.weight"] == "attention"
    assert assigned["h.1.attn.proj.bias"] == "attention"
    assert assigned["h.0.mlp.fc.weight"] == "ffn"
    assert assigned["h.0.mlp.proj.weight"] == "ffn"
    assert assigned["h.0.ln_1.weight"] == "norm"
    assert assigned["ln_f.bias"] == "norm"
    assert assigned["wte.weight"] == assigned["wpe.weight"] == "embedding"
    assert assigned["lm_head.weight"] == "head"


def test_unknown_names_fall_back_to_top_level_children() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Conv2d(2, 2, 3))
    names = [n for n, _ in model.named_parameters()]
    assert assign_groups(names) == ["0", "0", "2", "2"]
    assert assign_groups(names, {"first": ["0.*"]}) == ["first", "first", "other", "other"]


def test_group_norms_combine_to_reference_global_norm(reader: InMemoryMetricReader) -> None:
    model, opt, loss = _gpt_backward()
    instr = TrainingInstrumentation(model, opt, reader.meter)
    with instr.step(tokens=64, samples=4):
        instr.after_backward()
        instr.record_loss(loss)
    stats = instr.last_stats
    grads = [p.grad for p in model.parameters()]
    reference = float(torch.nn.utils.get_total_norm(grads, norm_type=2.0))
    combined = math.sqrt(sum(g["norm"] ** 2 for g in stats["groups"].values()))
    assert set(stats["groups"]) == {"embedding", "norm", "attention", "ffn", "head"}
    assert stats["grad_norm"] == pytest.approx(reference, rel=1e-5)
    assert combined == pytest.approx(reference, rel=1e-5)
    for name, group in stats["groups"].items():
        members = [p.grad for n, p in model.named_parameters()
                   if instr.group_of_parameter[n] == name]
        assert group["norm"] == pytest.approx(
            float(torch.nn.utils.get_total_norm(members)), rel=1e-5)
    points = _points(reader)
    exported = {p.attributes[MODULE_GROUP_ATTR]: p.value
                for p in points["seedance.train.grad.group_norm"]}
    assert exported == pytest.approx({g: v["norm"] for g, v in stats["groups"].items()})
    assert points["seedance.train.loss"][0].value == pytest.approx(loss.item())


def test_zero_fraction_and_nonfinite_on_crafted_gradients(reader: InMemoryMetricReader) -> None:
    model = nn.ModuleDict({"a": nn.Linear(10, 10), "b": nn.Linear(10, 10)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    instr = TrainingInstrumentation(model, opt, reader.meter,
                                    module_groups={"a": ["a.*"], "b": ["b.*"]})
    wa, ba, wb, bb = (p for _, p in model.named_parameters())
    wa.grad = torch.ones(10, 10)
    wa.grad[:3] = 0.0  # 30 zeros
    ba.grad = torch.zeros(10)  # 10 zeros -> a: 40 of 110
    wb.grad = torch.ones(10, 10)
    wb.grad[0, 0], wb.grad[0, 1], wb.grad[0, 2] = math.nan, math.inf, -math.inf
    wb.grad[1, :5] = 0.0
    bb.grad = torch.full((10,), 2.0)
    with instr.step():
        instr.after_backward()
    groups = instr.last_stats["groups"]
    assert groups["a"]["zero_fraction"] == pytest.approx(40 / 110)
    assert groups["a"]["nonfinite"] == 0
    assert groups["b"]["zero_fraction"] == pytest.approx(5 / 110)
    assert groups["b"]["nonfinite"] == 3
    assert math.isfinite(groups["a"]["norm"]) and not math.isfinite(groups["b"]["norm"])
    nonfinite = {p.attributes[MODULE_GROUP_ATTR]: p.value
                 for p in _points(reader)["seedance.train.grad.nonfinite"]}
    assert nonfinite == {"a": 0, "b": 3}


class _HalfFFN(nn.Module):
    """A float16 layer feeding a float32 one, as layer-wise precision would leave them.

    The float16 layer sits first so the float32 layer's gradient never passes through float16.
    """

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(64, 64).half()
        self.attn = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.mlp(x.half()).float())


def test_fp16_underflow_raises_zero_fraction(reader: InMemoryMetricReader) -> None:
    def zero_fractions(loss_scale: float) -> dict[str, float]:
        torch.manual_seed(0)
        model = _HalfFFN()
        instr = TrainingInstrumentation(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                        reader.meter)
        with instr.step():
            (model(torch.randn(32, 64)).square().mean() * loss_scale).backward()
            instr.after_backward()
        return {g: s["zero_fraction"] for g, s in instr.last_stats["groups"].items()}

    normal, tiny = zero_fractions(1.0), zero_fractions(2.0**-20)
    assert normal["ffn"] < 0.01
    assert tiny["ffn"] > normal["ffn"] + 0.5  # fp16 gradients flush to zero
    assert tiny["attention"] < 0.01  # the float32 group keeps its small gradients


def test_every_point_carries_the_config_version(reader: InMemoryMetricReader) -> None:
    model, opt, _ = _gpt_backward()
    version = {"now": 3}
    instr = TrainingInstrumentation(model, opt, reader.meter,
                                    config_version=lambda: version["now"],
                                    attributes={"seedance.rank": 0}, stats_every=1)
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.block_size))
    seen_versions = set()
    for v in (3, 4):
        version["now"] = v
        for _ in range(2):
            with instr.data_wait():
                batch = idx
            with instr.step(tokens=batch.numel(), samples=batch.shape[0]):
                loss = model(batch, batch)
                loss.backward()
                instr.after_backward()
                opt.step()
                opt.zero_grad()
                instr.record_loss(loss)
        points = _points(reader)
        names = {spec.name for spec in TRAINING_METRICS} - {"seedance.train.grad_scaler.scale"}
        assert names <= set(points)
        for name, pts in points.items():
            for p in pts:
                assert CONFIG_VERSION_ATTR in p.attributes, name
                seen_versions.add(p.attributes[CONFIG_VERSION_ATTR])
                assert p.attributes["seedance.rank"] == 0
        assert instr.last_stats["config_version"] == v
    assert seen_versions == {3, 4}
    instr.config_version = 9
    assert instr.config_version == 9


def test_grad_scaler_norms_are_unscaled(reader: InMemoryMetricReader) -> None:
    model, opt, _ = _gpt_backward()
    reference = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    for explicit_unscale in (False, True):
        model, opt, _ = _gpt_backward()
        opt.zero_grad()
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        instr = TrainingInstrumentation(model, opt, reader.meter, grad_scaler=scaler)
        torch.manual_seed(0)
        GPT(TINY)  # same random stream as _gpt_backward
        idx = torch.randint(0, TINY.vocab_size, (4, TINY.block_size))
        with instr.step():
            scaler.scale(model(idx, idx.roll(-1, dims=1))).backward()
            if explicit_unscale:
                scaler.unscale_(opt)
            instr.after_backward()
            scaler.step(opt)
            scaler.update()
        assert instr.last_stats["grad_norm"] == pytest.approx(reference, rel=1e-4)
        assert instr.last_stats["grad_scaler_scale"] == 1024.0


def _scaled_steps(reader: InMemoryMetricReader, steps: int, **settings: float) -> list[dict]:
    """``steps`` GradScaler steps of a tiny GPT; what ``last_stats`` said after each."""
    model, opt, _ = _gpt_backward()
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    instr = TrainingInstrumentation(model, opt, reader.meter, grad_scaler=scaler,
                                    **settings)  # type: ignore[arg-type]
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.block_size),
                        generator=torch.Generator().manual_seed(1))
    seen = []
    for _ in range(steps):
        with instr.step():
            loss = model(idx, idx)
            scaler.scale(loss).backward()
            instr.after_backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            instr.record_loss(loss)
        seen.append(instr.last_stats)
    return seen


def test_gradients_are_read_once_per_interval_loss_and_scale_every_step(
        reader: InMemoryMetricReader) -> None:
    seen = _scaled_steps(reader, 3, grad_interval_s=3600.0)
    assert "grad_norm" in seen[0] and "zero_fraction" in seen[0]["groups"]["attention"]
    for later in seen[1:]:
        assert "grad_norm" not in later and "groups" not in later
        assert math.isfinite(later["loss"]) and later["grad_scaler_scale"] > 0
    counted = _points(reader)["seedance.train.nonfinite_steps"]
    by_what = {p.attributes["seedance.nonfinite.what"]: p.value for p in counted}
    assert by_what == {"loss": 0, "grad_norm": 0}


def test_zero_interval_reads_every_step_with_stats_on_every_nth_reading(
        reader: InMemoryMetricReader) -> None:
    seen = _scaled_steps(reader, 4, grad_interval_s=0.0, stats_every=2)
    assert all("grad_norm" in s for s in seen)
    with_stats = ["zero_fraction" in s["groups"]["attention"] for s in seen]
    assert with_stats == [True, False, True, False]


def _paced_steps(reader: InMemoryMetricReader, steps: int, *, step_s: float, pause_s: float,
                 grad_interval_s: float) -> list[bool]:
    """Whether each of ``steps`` steps (``step_s`` of sleep inside, ``pause_s`` outside) read
    the gradients."""
    model, opt, loss = _gpt_backward()
    instr = TrainingInstrumentation(model, opt, reader.meter, grad_interval_s=grad_interval_s)
    read = []
    for _ in range(steps):
        with instr.step():
            time.sleep(step_s)
            instr.after_backward()
            instr.record_loss(loss)
        read.append("grad_norm" in instr.last_stats)
        time.sleep(pause_s)
    return read


def test_readings_are_never_further_apart_than_the_interval_of_step_time(
        reader: InMemoryMetricReader) -> None:
    # 30 ms steps, 100 ms interval: the step completing the interval reads, so at most every
    # third step (the first step past the interval would be every fourth, 120 ms apart);
    # a loaded box only lengthens steps, which brings readings closer.
    read = _paced_steps(reader, 13, step_s=0.03, pause_s=0.0, grad_interval_s=0.1)
    at = [i for i, r in enumerate(read) if r]
    assert at[0] == 0 and at[-1] >= 10
    assert max(b - a for a, b in zip(at, at[1:], strict=False)) <= 3


def test_time_outside_the_steps_does_not_bring_a_reading_forward(
        reader: InMemoryMetricReader) -> None:
    # 250 ms pauses between 5 ms steps: by wall time every step would be due, by the job's own
    # step time six steps come nowhere near the 200 ms interval.
    read = _paced_steps(reader, 6, step_s=0.005, pause_s=0.25, grad_interval_s=0.2)
    assert read == [True] + [False] * 5


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_a_bad_gradient_interval_is_refused_with_its_value(bad: float) -> None:
    model, opt, _ = _gpt_backward()
    with pytest.raises(SeedanceError, match=r"grad_interval_s must be a finite number >= 0, got"):
        TrainingInstrumentation(model, opt, MeterProvider().get_meter("t"), grad_interval_s=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_values_are_deferred_then_match_cpu(reader: InMemoryMetricReader) -> None:
    model, opt, loss = _gpt_backward()
    cpu = TrainingInstrumentation(model, opt, reader.meter, stats_every=1)
    with cpu.step():
        cpu.after_backward()
        cpu.record_loss(loss)
    model.cuda()  # .cuda() moves the gradients along with the parameters
    gpu = TrainingInstrumentation(model, opt, reader.meter, stats_every=1)
    with gpu.step():
        gpu.after_backward()
        gpu.record_loss(loss.cuda())
    gpu.flush()
    expected, got = cpu.last_stats, gpu.last_stats
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    for name, group in expected["groups"].items():
        assert got["groups"][name] == pytest.approx(group, rel=1e-4)


def _sum_of(points: dict[str, list], name: str, field: str = "value") -> float:
    return sum(getattr(p, field) for p in points.get(name, []))


def test_the_sdk_records_on_the_collecting_thread_not_the_training_thread(
        reader: InMemoryMetricReader) -> None:
    model, opt, loss = _gpt_backward()
    instr = TrainingInstrumentation(model, opt, reader.meter, grad_interval_s=0)
    recording_threads: set[int] = set()
    record = instr._h_step.record

    def spy(*args: object, **kwargs: object) -> None:
        recording_threads.add(threading.get_ident())
        record(*args, **kwargs)  # type: ignore[arg-type]

    instr._h_step.record = spy  # type: ignore[method-assign]
    for _ in range(5):
        with instr.data_wait():
            pass
        with instr.step(tokens=64, samples=4):
            instr.after_backward()
            instr.record_loss(loss)
    assert not recording_threads  # queued: nothing recorded while the job trains
    collected: dict[str, list] = {}
    collector = threading.Thread(target=lambda: collected.update(_points(reader)))
    collector.start()
    collector.join()
    assert recording_threads == {collector.ident}
    durations = collected["seedance.train.step.duration"]
    assert sum(p.count for p in durations) == 5  # every queued step, in this very collect
    assert _sum_of(collected, "seedance.train.tokens") == 5 * 64
    assert "seedance.train.publish" not in collected  # the hook observes nothing


def test_steps_collected_while_training_are_each_recorded_once(
        reader: InMemoryMetricReader) -> None:
    """A reader thread collecting every millisecond, against the training thread appending."""
    model, opt, loss = _gpt_backward()
    instr = TrainingInstrumentation(model, opt, reader.meter, grad_interval_s=0)
    stop = threading.Event()
    counted = {"steps": 0, "tokens": 0.0, "waits": 0}
    collects_while_training = 0

    def collect() -> None:  # the in-memory reader is cumulative: keep the last totals
        nonlocal collects_while_training
        while True:
            done = stop.is_set()
            collects_while_training += not done
            points = _points(reader)
            counted["steps"] = sum(p.count for p in points.get("seedance.train.step.duration", []))
            counted["waits"] = sum(
                p.count for p in points.get("seedance.train.data_wait.duration", []))
            counted["tokens"] = _sum_of(points, "seedance.train.tokens")
            if done:
                return
            time.sleep(0.001)  # flat out, it takes the GIL from the steps it races

    collector = threading.Thread(target=collect)
    collector.start()
    steps = 200
    for i in range(steps):
        with instr.data_wait():
            pass
        with instr.step(tokens=i + 1, samples=1):
            instr.after_backward()
            instr.record_loss(loss)
    stop.set()
    collector.join()
    assert collects_while_training > 1
    assert counted == {"steps": steps, "tokens": steps * (steps + 1) / 2, "waits": steps}
    assert instr.last_stats["step"] == steps - 1


def test_a_meter_nobody_collects_keeps_a_bounded_queue() -> None:
    model, opt, loss = _gpt_backward()
    instr = TrainingInstrumentation(model, opt, MeterProvider().get_meter("no reader"))
    for _ in range(1000):
        with instr.data_wait():
            pass
        with instr.step(tokens=1):
            instr.record_loss(loss)
    assert len(instr._pending) <= 257
    assert instr.last_stats["step"] == 999  # reading it publishes the rest


def test_a_cpu_loss_is_read_when_its_step_ends(reader: InMemoryMetricReader) -> None:
    """The queue holds a step until the next collect; a loss tensor the job then changes in
    place (a running total, say) must still export the step's own value."""
    model, opt, _ = _gpt_backward()
    instr = TrainingInstrumentation(model, opt, reader.meter)
    running = torch.zeros(())
    for value in (2.0, 3.0):
        with instr.step():
            running += value
            instr.record_loss(running)
    running += 100.0
    losses = [p.value for p in _points(reader)["seedance.train.loss"]]
    assert losses == [5.0]


def test_every_finite_step_loss_travels_as_a_sum_and_a_count(
        reader: InMemoryMetricReader) -> None:
    """The gauge holds the last step's loss at each export; the step_loss histogram keeps
    every step's, so a window's mean loss covers all its steps. A NaN step is left out of
    it (it would end every later window's mean) and still shows on the gauge."""
    model, opt, _ = _gpt_backward()
    instr = TrainingInstrumentation(model, opt, reader.meter)
    for value in (2.0, 3.0, float("nan"), 7.0):
        with instr.step():
            instr.record_loss(torch.tensor(value))
    [point] = _points(reader)["seedance.train.step_loss"]
    assert (point.count, point.sum) == (3, 12.0)
    assert tuple(point.explicit_bounds) == ()  # no buckets travel
    assert [p.value for p in _points(reader)["seedance.train.loss"]] == [7.0]


def test_every_instrumentation_on_one_meter_is_recorded_at_each_collect(
        reader: InMemoryMetricReader) -> None:
    """A job may instrument again on the same meter (a new optimizer, a second model); the SDK
    keeps one callback per instrument name, so one hook must publish them all."""
    model, opt, loss = _gpt_backward()
    first = TrainingInstrumentation(model, opt, reader.meter, config_version=1)
    second = TrainingInstrumentation(model, opt, reader.meter, config_version=2)
    for instr in (first, second, second):
        with instr.step(tokens=10):
            instr.record_loss(loss)
    tokens = {p.attributes[CONFIG_VERSION_ATTR]: p.value
              for p in _points(reader)["seedance.train.tokens"]}
    assert tokens == {1: 10, 2: 20}
