"""Every actuator a session registers keeps the ``tuner.job.Actuator`` contract, on a real small
model on CPU: a value applied and then reverted to what ``read`` gave leaves the job exactly as
it was (threads, forward output, hooks, parameter dtypes, handles, the serving engine's
config), and a value outside its knob's domain is refused with an error and changes nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from collectors import SeedanceError
from tuner import PREFIX_CACHE_KNOBS, Knob, KnobSpace, KnobValue
from tuner.job import KV_BITS_KNOBS, Actuator, ActuatorRegistry, attach, attach_serving
from workloads.gpt import GPTConfig
from workloads.serve import build_model
from workloads.serve_engine import Engine, ReplicaConfig, quantized_cache_factory

GLOBAL_BATCH = 8
SERVING_MODEL = GPTConfig(n_layer=1, n_head=2, n_embd=32)
CASES = ("train:precision", "train:threads", "train:micro_batch", "train:", "serve:")
"""(session kind):(actuator prefix) of every actuator the sessions below register."""


@dataclass
class Job:
    """A session on a real model, and what a person could observe of the job."""

    actuators: ActuatorRegistry
    knobs: KnobSpace
    observe: Callable[[], dict[str, Any]]


def _training_job() -> Iterator[Job]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    session = attach(model, torch.optim.SGD(model.parameters(), lr=0.1), job="conformance",
                     sidecar=None, global_batch=GLOBAL_BATCH)
    handle = session.knob("lr_scale", 1.0, low=0.5, high=4.0)
    inputs = torch.randn(4, 8)

    def observe() -> dict[str, Any]:
        with torch.no_grad():
            output = model(inputs)
        return {
            "threads": torch.get_num_threads(),
            "output": (output.dtype, output.tolist()),
            "hooks": {name: (len(m._forward_pre_hooks), len(m._forward_hooks))
                      for name, m in model.named_modules()},
            "dtypes": {name: p.dtype for name, p in model.named_parameters()},
            "lr_scale": handle.value,
            "micro_batches": session.micro_batches(GLOBAL_BATCH),
        }

    yield Job(session.actuators, session.knobs, observe)
    session.close()


def _serving_job() -> Iterator[Job]:
    kv = quantized_cache_factory(SERVING_MODEL, key_bits=32, value_bits=32, group_size=16,
                                 residual_tokens=4)
    engine = Engine(build_model(SERVING_MODEL, 0), kv, ReplicaConfig())
    cache = engine.prefix_cache.config
    session = attach_serving(
        job="conformance", sidecar=None, apply=engine.apply_knobs,
        knobs=(*KV_BITS_KNOBS, *PREFIX_CACHE_KNOBS),
        defaults={"prefix_cache.policy": cache.policy,
                  "prefix_cache.capacity_entries": cache.capacity_entries,
                  "prefix_cache.capacity_mib": cache.capacity_bytes / 2**20,
                  "prefix_cache.pin_top_k": cache.pin_top_k,
                  "prefix_cache.prewarm_top_k": cache.prewarm_top_k})

    def observe() -> dict[str, Any]:
        return {"replica": engine.config, "prefix_cache": engine.prefix_cache.config}

    yield Job(session.actuators, session.knobs, observe)
    session.close()


@pytest.fixture
def jobs() -> Iterator[dict[str, Job]]:
    """A training and a serving job, closed after the test, the process's threads put back."""
    threads = torch.get_num_threads()
    training, serving = _training_job(), _serving_job()
    try:
        yield {"train": next(training), "serve": next(serving)}
    finally:
        for job in (training, serving):
            next(job, None)
        torch.set_num_threads(threads)


def _actuator(jobs: dict[str, Job], case: str) -> tuple[Job, Actuator]:
    kind, prefix = case.split(":")
    job = jobs[kind]
    actuator = next((a for a in job.actuators if a.prefix == prefix), None)
    if actuator is None:
        assert case == "train:threads", f"{case} is not registered"
        pytest.skip("one usable CPU: the session declares no threads knob")
    return job, actuator


def _other_value(knob: Knob, value: KnobValue) -> KnobValue:
    """A legal value of ``knob`` other than ``value``."""
    if knob.choices is not None:
        return next(c for c in knob.choices if c != value)
    assert knob.low is not None and knob.high is not None
    if knob.integer:
        return int(value) + 1 if int(value) + 1 <= knob.high else int(value) - 1
    return (knob.low + knob.high) / 2 if value != (knob.low + knob.high) / 2 else knob.low


def _invalid_value(knob: Knob) -> object:
    """A value outside ``knob``'s domain."""
    if knob.choices is not None:
        return "not one of the choices"
    assert knob.high is not None
    return knob.high * 2 + 1


def test_every_actuator_is_covered(jobs: dict[str, Job]) -> None:
    """A new actuator a session registers must be added to CASES (and so to this suite)."""
    registered = {f"{kind}:{a.prefix}" for kind, job in jobs.items() for a in job.actuators}
    assert registered <= set(CASES)
    assert set(CASES) - registered <= {"train:threads"}  # a one-CPU machine declares none


@pytest.mark.parametrize("case", CASES)
def test_applied_then_reverted_leaves_the_job_as_it_was(jobs: dict[str, Job], case: str
                                                        ) -> None:
    job, actuator = _actuator(jobs, case)
    before, observed = actuator.read(), job.observe()
    assert before, "an actuator owns at least one knob"
    changed = {name: _other_value(job.knobs.knobs[name], v) for name, v in before.items()}
    actuator.apply(changed)
    assert actuator.read() == changed
    assert job.observe() != observed, "the new values changed nothing a person could see"
    actuator.apply(before)
    assert actuator.read() == before
    assert job.observe() == observed


@pytest.mark.parametrize("case", CASES)
def test_an_invalid_value_is_refused_and_changes_nothing(jobs: dict[str, Job], case: str
                                                         ) -> None:
    job, actuator = _actuator(jobs, case)
    before, observed = actuator.read(), job.observe()
    values = {name: _other_value(job.knobs.knobs[name], v) for name, v in before.items()}
    last = list(values)[-1]  # the others are valid: an actuator checks all before it applies
    values[last] = _invalid_value(job.knobs.knobs[last])  # type: ignore[assignment]
    with pytest.raises(SeedanceError):
        actuator.apply(values)
    assert actuator.read() == before
    assert job.observe() == observed
