"""A change as the API answers it: what json's round trip answered, whatever the change holds
(mappings of any kind, tuples, non-finite floats, huge ints)."""

from __future__ import annotations

import json
import math
from types import MappingProxyType
from typing import Any

import pytest
from pydantic import TypeAdapter

from seedancectl._api import change_json
from tuner import Change, Window


def _rendered(value: dict[str, Any]) -> Any:
    """What the API sends for ``value``: FastAPI renders an answer through pydantic."""
    return json.loads(TypeAdapter(dict[str, Any]).dump_json(value))


def _change(comparison: dict[str, Any]) -> Change:
    window = Window(version=3, arm="candidate", steps=10, step_s=0.05, tokens_per_s=8000.0,
                    loss=math.nan, nonfinite_loss=True, start_ns=1, end_ns=2, step_cv=0.02)
    return Change(
        id="c1", job="j", state="kept", source="trial", reason="r", risk="low", scope="live",
        values={"sim.fuse": "on"}, baseline=MappingProxyType({"sim.batch": 8}),
        created_at_s=1.0, expires_at_s=2.0,
        meta={"arms": ("baseline", "candidate"), "nested": MappingProxyType(
            {"inf": math.inf})},
        windows=(window,), comparison=comparison)


@pytest.mark.parametrize("comparison", [
    {"gain": 0.08, "ci": (0.05, 0.11), "pairs": 3},
    {"gain": -math.inf, "seed": 2**70},  # past 64 bits: orjson refuses, json's path answers
], ids=["plain", "huge-int"])
def test_a_change_is_answered_with_the_values_of_its_json(comparison: dict[str, Any]) -> None:
    change = _change(comparison)
    before = json.loads(change.to_json())  # what the API answered before orjson
    assert _rendered(change_json(change)) == _rendered(before)
