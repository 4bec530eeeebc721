"""Token agreement on live ``generate()`` traffic, counted as the serving engine counts it.

The in-job ``AgreementGuard`` gates a width on a fixed sample before it is used; what the
width does to real requests only shows on them. Every ``every``-th output is checked
teacher-forced against a cache-free forward of the unquantised model (``token_agreement``) and
counted through the job's ``ServingInstrumentation`` (``tokens_checked``: the checked and
agreeing token counters, per config version), so the sidecar's ``ServingSLOGuardrail`` rolls
back a width on the job's own traffic, as it does for the demo engine. A request during which
the version changed ran under neither config alone and is not counted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from tuner.integrations._kv_agreement import Agreement, token_agreement
from tuner.kv_cache import KVCacheError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class CheckedTokens(Protocol):
    """Where the counts go: ``collectors.torch_serving.ServingInstrumentation`` has this
    shape (its ``config_version`` is the serving session's version in force)."""

    @property
    def config_version(self) -> int:
        """The config version in force now."""
        ...

    def tokens_checked(self, checked: int, agreeing: int, *, version: int | None = None) -> None:
        """Count ``checked`` generated tokens, ``agreeing`` of them picked by the forward."""
        ...


class ShadowCheck:
    """Checks every ``every``-th greedy ``generate()`` output of the job and counts the result.

    Call it after each ``generate()`` with what it returned (unpadded prompts of one length,
    greedy, no row stopped early) and the version read just before the call. The cost is one
    cache-free forward over the sampled output. Not thread-safe: call from the decode loop.
    """

    def __init__(self, model: PreTrainedModel, counts: CheckedTokens, *,
                 every: int = 8) -> None:
        if every < 1:
            raise KVCacheError(f"ShadowCheck every must be >= 1, got {every}")
        self.model, self.counts, self.every = model, counts, every
        self.outputs = 0
        """generate() outputs seen, sampled or not."""

    def __call__(self, sequences: torch.Tensor, prompt_len: int, *,
                 version: int) -> Agreement | None:
        """The sampled output's agreement, now counted for ``version``; None when this output
        is not sampled or the version changed during its request."""
        self.outputs += 1
        if self.outputs % self.every or self.counts.config_version != version:
            return None
        found = token_agreement(self.model, sequences, prompt_len)
        self.counts.tokens_checked(found.checked, found.agreeing, version=version)
        return found
