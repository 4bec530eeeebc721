"""Job fingerprints of real torch models (the five families of ``workloads.families``, built
small): what they count, how they travel, and that the fleet distance tells the families
apart and keeps two sizes of one family near."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

from collectors import FingerprintError, JobFingerprint
from collectors.torch_fingerprint import job_fingerprint, module_histogram
from collectors.torch_profile import device_model
from tuner import NEAR_DISTANCE, fingerprint_distance
from workloads.families import FAMILIES, ConvNet, family

SLOW = {"fp32": 1.0, "bf16": 0.1, "fp16": 0.05}
"""A device without fast reduced precision (bf16, fp16 many times slower), given rather than
measured: the tests run no benchmark, and their fingerprints do not depend on this machine's
CPU (some run bf16 fast)."""


def fingerprints(size: str) -> dict[str, JobFingerprint]:
    return {name: job_fingerprint(f.build(small=size == "small", tiny=size == "tiny").model,
                                  speedups=SLOW)
            for name, f in FAMILIES.items()}


def test_counts_leaf_module_classes_and_parameters_of_a_real_model() -> None:
    model = ConvNet(widths=(4, 8))
    fp = job_fingerprint(model, speedups=SLOW, world_size=4)
    # (Conv2d, BatchNorm2d, ReLU) x 2 per stage and a max-pool, then pool and classifier;
    # containers (Sequential, the ConvNet itself) are not leaves
    assert fp.modules == {"Conv2d": 4, "BatchNorm2d": 4, "ReLU": 5, "MaxPool2d": 2,
                          "AdaptiveAvgPool2d": 1, "Flatten": 1, "Linear": 2}
    assert fp.params == sum(p.numel() for p in model.parameters())
    assert fp.device == device_model("cpu") and fp.world_size == 4
    assert fp.fast_dtypes == ()
    assert fp.param_bucket == int(2 * torch.tensor(float(fp.params)).log10())


def test_a_wrapped_model_has_the_fingerprint_of_the_model_inside() -> None:
    model = family("mlp").build(tiny=True).model
    assert module_histogram(nn.DataParallel(model)) == module_histogram(model)


def test_shared_parameters_are_counted_once() -> None:
    lin = nn.Linear(8, 8)
    assert job_fingerprint(nn.Sequential(lin, nn.ReLU(), lin), speedups=SLOW).params == 72


def test_fast_precisions_are_those_measured_at_least_the_search_bar_faster() -> None:
    fp = job_fingerprint(nn.Linear(4, 4), speedups={"fp32": 1.0, "bf16": 2.3, "fp16": 1.05})
    assert fp.fast_dtypes == ("bf16",)  # fp16 at 1.05x is under the 1.1x bar


def test_families_differ_and_two_sizes_of_a_family_are_near() -> None:
    base, small = fingerprints("base"), fingerprints("small")
    for name in FAMILIES:
        assert fingerprint_distance(base[name], small[name]) < NEAR_DISTANCE, name
        assert fingerprint_distance(base[name], base[name]) == 0.0
    for a, b in itertools.permutations(FAMILIES, 2):
        assert fingerprint_distance(base[a], small[b]) >= NEAR_DISTANCE, (a, b)


def test_another_device_world_size_or_fast_precision_moves_a_job_away() -> None:
    fp = job_fingerprint(family("vit").build(tiny=True).model, speedups=SLOW)
    same = fingerprint_distance(fp, fp)
    for changed in (JobFingerprint(**{**_fields(fp), "device": "NVIDIA H100 80GB HBM3"}),
                    JobFingerprint(**{**_fields(fp), "world_size": 8}),
                    JobFingerprint(**{**_fields(fp), "fast_dtypes": ("bf16",)}),
                    JobFingerprint(**{**_fields(fp), "params": fp.params * 10})):
        assert fingerprint_distance(fp, changed) > same
        assert fingerprint_distance(fp, changed) == fingerprint_distance(changed, fp)


def _fields(fp: JobFingerprint) -> dict[str, Any]:
    return {"modules": fp.modules, "params": fp.params, "device": fp.device,
            "world_size": fp.world_size, "fast_dtypes": fp.fast_dtypes}


def test_json_round_trip() -> None:
    fp = job_fingerprint(family("rnn").build(tiny=True).model, speedups=SLOW, world_size=2)
    assert JobFingerprint.from_json(fp.to_json()) == fp


GOOD = {"modules": {"Linear": 3}, "params": 100, "device": "cpu", "world_size": 1,
        "fast_dtypes": []}


@pytest.mark.parametrize(("change", "says"), [
    ({"modules": {f"M{i}": 1 for i in range(257)}}, "at most 256 module classes"),
    ({"modules": {"Linear": 0}}, "fingerprint.modules['Linear'] must be an integer from 1"),
    ({"modules": {"Linear": True}}, "must be an integer"),
    ({"modules": {"x" * 201: 1}}, "a class name must be 1 to 200 characters"),
    ({"params": -1}, "fingerprint.params must be an integer from 0"),
    ({"params": "many"}, "fingerprint.params"),
    ({"device": ""}, "fingerprint.device"),
    ({"device": "d" * 201}, "fingerprint.device"),
    ({"world_size": 0}, "fingerprint.world_size"),
    ({"fast_dtypes": ["int4"]}, "fingerprint.fast_dtypes"),
    ({"secret": 1}, "unknown field(s) secret"),
])
def test_a_fingerprint_from_the_network_is_bounded(change: dict[str, Any], says: str) -> None:
    with pytest.raises(FingerprintError, match=None) as caught:
        JobFingerprint.from_json({**GOOD, **change})
    assert says in str(caught.value) and "\n" not in str(caught.value)
    assert JobFingerprint.from_json(GOOD).modules == {"Linear": 3}
