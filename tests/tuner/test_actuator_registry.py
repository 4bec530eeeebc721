"""The actuator registry: a knob belongs to the longest prefix over it, and a config reaches
only the actuators whose knobs changed, in the order they were registered."""

from __future__ import annotations

import pytest

from tuner import Knob, KnobError, KnobSpace, KnobValue
from tuner.job import ActuatorRegistry, CallbackActuator, HandleActuator, KnobHandle
from tuner.job._torch_actuators import precision_knobs

KV = (Knob(name="kv.key_bits", default=8, choices=(4, 8)),
      Knob(name="kv.value_bits", default=8, choices=(4, 8)))
WARMUP = Knob(name="warmup", default=10, low=0, high=100, integer=True)


def _registry(calls: list[dict[str, KnobValue]]) -> ActuatorRegistry:
    """KV knobs through handles, the rest through a job callback that records its calls."""
    handles = {knob.name: KnobHandle(knob) for knob in KV}
    return ActuatorRegistry([HandleActuator("kv", handles),
                             CallbackActuator(KnobSpace.of([WARMUP]), calls.append)])


def test_a_knob_belongs_to_the_longest_prefix_over_it() -> None:
    registry = _registry([])
    kv, rest = list(registry)
    assert registry.owner("kv.key_bits") is kv
    assert registry.owner("kvx") is rest  # a prefix names whole parts of the name
    assert registry.owner("warmup") is rest
    assert ActuatorRegistry([kv]).owner("warmup") is None


def test_only_the_actuators_whose_knobs_changed_are_called() -> None:
    calls: list[dict[str, KnobValue]] = []
    registry = _registry(calls)
    kv = list(registry)[0]
    defaults = {"kv.key_bits": 8, "kv.value_bits": 8, "warmup": 10}
    registry.apply({**defaults, "kv.value_bits": 4}, previous=defaults)
    assert calls == []
    assert kv.read() == {"kv.key_bits": 8, "kv.value_bits": 4}
    registry.apply({**defaults, "warmup": 20}, previous=defaults)
    assert calls == [{"warmup": 20}]


def test_without_previous_values_every_actuator_is_called() -> None:
    calls: list[dict[str, KnobValue]] = []
    _registry(calls).apply({"kv.key_bits": 4, "kv.value_bits": 4})
    assert calls == [{"warmup": 10}]  # a callback gets the whole config, defaults filled in


def test_a_refusal_stops_the_actuators_after_it() -> None:
    calls: list[dict[str, KnobValue]] = []
    registry = _registry(calls)
    with pytest.raises(KnobError):
        registry.apply({"kv.key_bits": 3, "kv.value_bits": 4, "warmup": 20}, previous={})
    assert list(registry)[0].read() == {"kv.key_bits": 8, "kv.value_bits": 8}
    assert calls == []


def test_a_prefix_is_registered_once_and_a_knob_needs_an_owner() -> None:
    registry = _registry([])
    with pytest.raises(KnobError, match="registered already"):
        registry.register(HandleActuator("", {}))
    with pytest.raises(KnobError, match="no actuator"):
        ActuatorRegistry(list(registry)[:1]).apply({"warmup": 1})


def test_a_precision_within_noise_of_fp32_is_not_searched() -> None:
    # a Xeon with AMX-BF16 and AVX512-FP16: bf16 matmuls 6.6x fp32's, fp16's at parity
    (knob,) = precision_knobs(["ffn"], {"fp32": 1.0, "bf16": 6.6, "fp16": 1.01},
                              grad_scaler=True)
    assert "fp16" in knob.search_excludes and "bf16" not in knob.search_excludes
    (unmeasured,) = precision_knobs(["ffn"], {}, grad_scaler=True)
    assert unmeasured.search_excludes == ()
