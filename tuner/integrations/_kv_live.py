"""The KV widths of a ``generate()`` job as live knobs under the serving lease.

``ServeSession`` calls :meth:`LiveKVBits.apply` with the sidecar's config at a boundary, and
:class:`DecodeBoundary` makes every decode step of ``generate()`` a boundary: transformers
runs its logits processors once per generated token, after that step's forward and before the
next one, so a new width is in force from the very next token.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from transformers import LogitsProcessor, PreTrainedConfig

from tuner._knobs import KnobValue
from tuner._kv_codec import check_bits
from tuner.integrations._kivi import KiviCache
from tuner.integrations._kv_agreement import AgreementGuard

KEY_BITS, VALUE_BITS = "kv.key_bits", "kv.value_bits"


class Boundary(Protocol):
    """What a decode step calls: ``tuner.job.ServeSession`` has this shape."""

    def boundary(self) -> bool:
        """Put the newest config in force; True when one took effect."""
        ...


class DecodeBoundary(LogitsProcessor):
    """A logits processor that leaves the scores alone and calls ``session.boundary()`` once
    per decode step; ``steps`` counts the calls. Pass it in ``logits_processor=``."""

    def __init__(self, session: Boundary) -> None:
        self.session = session
        self.steps = 0

    def __call__(self, input_ids: torch.LongTensor,
                 scores: torch.FloatTensor) -> torch.FloatTensor:
        """The scores, unchanged, after the boundary."""
        self.session.boundary()
        self.steps += 1
        return scores


class LiveKVBits:
    """``kv.key_bits`` / ``kv.value_bits`` for caches made here: the session's ``apply``.

    ``cache()`` makes a :class:`KiviCache` at the widths in force and remembers it (weakly),
    so a switch reaches caches in the middle of a ``generate()``. With a ``guard``, a width
    whose sampled agreement is below the guard's bound is refused (``apply`` raises, the
    session re-applies the previous config and acks the version failed). Not thread-safe:
    call from the decode loop's thread, as ``ServeSession.boundary``.
    """

    def __init__(self, config: PreTrainedConfig, *, key_bits: int = 32, value_bits: int = 32,
                 guard: AgreementGuard | None = None, **cache_kwargs: Any) -> None:
        self._make = lambda k, v: KiviCache(config, key_bits=k, value_bits=v, **cache_kwargs)
        self._make(key_bits, value_bits)  # refuse a bad width or layout now
        self.key_bits, self.value_bits = key_bits, value_bits
        self.guard = guard
        self._caches: weakref.WeakSet[KiviCache] = weakref.WeakSet()

    def defaults(self) -> dict[str, KnobValue]:
        """The widths in force as knob values (``attach_serving(defaults=...)``)."""
        return {KEY_BITS: self.key_bits, VALUE_BITS: self.value_bits}

    def cache(self) -> KiviCache:
        """A new cache at the widths in force, kept in step with later switches."""
        made = self._make(self.key_bits, self.value_bits)
        self._caches.add(made)
        return made

    def apply(self, values: Mapping[str, KnobValue]) -> None:
        """Set the widths named in ``values`` (others stay), for new and live caches."""
        key_bits = int(values.get(KEY_BITS, self.key_bits))
        value_bits = int(values.get(VALUE_BITS, self.value_bits))
        if (key_bits, value_bits) == (self.key_bits, self.value_bits):
            return
        check_bits(KEY_BITS, key_bits)
        check_bits(VALUE_BITS, value_bits)
        if self.guard is not None:
            self.guard.check(key_bits, value_bits)
        for live in self._caches:
            live.set_bits(key_bits=key_bits, value_bits=value_bits)
        self.key_bits, self.value_bits = key_bits, value_bits
