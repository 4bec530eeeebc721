"""What kind of job this is, in numbers another sidecar can compare: the job's fingerprint.

A job measures it at attach (``collectors.torch_fingerprint``) and sends it in the lease's
attach body; the sidecar keeps it in the fleet's table, where the fleet priors look for the
past jobs nearest to a new one. Torch-free, so the sidecar can read it. It arrives from the
network, so ``from_json`` bounds every part of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from collectors._errors import SeedanceError

FAST_DTYPES = ("bf16", "fp16", "fp8")
"""The lower precisions a fingerprint may name as fast on its device."""
MAX_MODULE_TYPES = 256
"""Distinct module classes a fingerprint may list (a real model has a few dozen at most)."""
MAX_NAME_CHARS = 200
MAX_COUNT = 10**9
MAX_PARAMS = 10**15
MAX_WORLD_SIZE = 10**6
BUCKETS_PER_DECADE = 2
"""Parameter-count buckets are half a decade wide: 1M and 3M parameters are one bucket apart."""


class FingerprintError(SeedanceError):
    """A fingerprint sent by a job is malformed or out of bounds (the message names the part)."""


@dataclass(frozen=True, kw_only=True)
class JobFingerprint:
    """One job: its leaf module classes and how many of each (what family of model it is),
    its parameter count, the device model it runs on, its world size, and which lower
    precisions that device runs faster than fp32 (``fast_dtypes``)."""

    modules: Mapping[str, int]
    params: int
    device: str
    world_size: int = 1
    fast_dtypes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", dict(sorted(self.modules.items())))
        object.__setattr__(self, "fast_dtypes", tuple(sorted(set(self.fast_dtypes))))

    @property
    def param_bucket(self) -> int:
        """The parameter count's bucket on a log scale (``BUCKETS_PER_DECADE`` a decade)."""
        return math.floor(BUCKETS_PER_DECADE * math.log10(self.params)) if self.params > 0 else 0

    def to_json(self) -> dict[str, Any]:
        return {"modules": dict(self.modules), "params": self.params,
                "param_bucket": self.param_bucket, "device": self.device,
                "world_size": self.world_size, "fast_dtypes": list(self.fast_dtypes)}

    @classmethod
    def from_json(cls, data: Any) -> JobFingerprint:
        """A fingerprint from its JSON; ``FingerprintError`` names the first part out of
        bounds. ``param_bucket`` is derived, so it is ignored."""
        if not isinstance(data, Mapping):
            raise FingerprintError(f"fingerprint must be an object, got {type(data).__name__}")
        extra = sorted(set(data) - {"modules", "params", "param_bucket", "device", "world_size",
                                    "fast_dtypes"})
        if extra:
            raise FingerprintError(f"fingerprint has unknown field(s) {', '.join(extra)}")
        modules = data.get("modules")
        if not isinstance(modules, Mapping) or len(modules) > MAX_MODULE_TYPES:
            raise FingerprintError(f"fingerprint.modules must be an object of at most "
                                   f"{MAX_MODULE_TYPES} module classes")
        for name, count in modules.items():
            if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
                raise FingerprintError(f"fingerprint.modules: a class name must be 1 to "
                                       f"{MAX_NAME_CHARS} characters, got {str(name)[:40]!r}")
            _bounded_int(count, f"fingerprint.modules[{name!r}]", 1, MAX_COUNT)
        device = data.get("device")
        if not isinstance(device, str) or not 0 < len(device) <= MAX_NAME_CHARS:
            raise FingerprintError(f"fingerprint.device must be a string of 1 to "
                                   f"{MAX_NAME_CHARS} characters")
        fast = data.get("fast_dtypes", [])
        if not isinstance(fast, list) or any(d not in FAST_DTYPES for d in fast):
            raise FingerprintError(f"fingerprint.fast_dtypes must be a list of {FAST_DTYPES}, "
                                   f"got {str(fast)[:80]}")
        return cls(modules=dict(modules),
                   params=_bounded_int(data.get("params"), "fingerprint.params", 0, MAX_PARAMS),
                   device=device, fast_dtypes=tuple(fast),
                   world_size=_bounded_int(data.get("world_size", 1), "fingerprint.world_size",
                                           1, MAX_WORLD_SIZE))


def _bounded_int(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise FingerprintError(f"{where} must be an integer from {low} to {high}, "
                               f"got {str(value)[:40]}")
    return value
