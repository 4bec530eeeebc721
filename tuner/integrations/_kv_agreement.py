"""Token agreement of a quantised KV cache with the unquantised model, and a guard on it.

Agreement is the project's one definition (``tuner.serving_guardrails``): the share of greedy
tokens the server produced that a cache-free, full-precision forward over the same text also
picks (teacher-forced, so one early miss does not count against every later token). The guard
measures it on a fixed sample of prompts before a width is used and refuses a width below its
bound; on live traffic the sidecar's ``ServingSLOGuardrail`` judges the job's counted tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tuner.integrations._kivi import KiviCache
from tuner.kv_cache import KVCacheError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class KVAgreementError(KVCacheError):
    """A KV width agrees with the unquantised model less than the guard's bound."""


@dataclass(frozen=True, slots=True)
class Agreement:
    """Checked tokens and how many of them the unquantised forward also picks."""

    agreeing: int
    checked: int

    @property
    def share(self) -> float:
        """agreeing / checked (NaN when nothing was checked)."""
        return self.agreeing / self.checked if self.checked else math.nan


@torch.no_grad()
def token_agreement(model: PreTrainedModel, sequences: torch.Tensor,
                    prompt_len: int) -> Agreement:
    """Teacher-forced: of the tokens after ``prompt_len`` in ``sequences`` [batch, seq] (what
    ``generate`` returned), how many a cache-free forward of the model picks too."""
    if not 0 < prompt_len < sequences.shape[1]:
        raise KVCacheError(f"prompt_len must be in (0, {sequences.shape[1]}), got {prompt_len}")
    logits = model(sequences[:, :-1], use_cache=False).logits[:, prompt_len - 1:]
    agrees = logits.argmax(-1) == sequences[:, prompt_len:]
    return Agreement(agreeing=int(agrees.sum()), checked=int(agrees.numel()))


class AgreementGuard:
    """Refuses KV widths whose token agreement on a fixed sample is below ``min_agreement``.

    ``measure`` generates ``new_tokens`` greedy tokens from ``prompts`` [batch, prompt] on a
    ``KiviCache`` at the widths asked (built with ``cache_kwargs``) and checks them with
    :func:`token_agreement`. The model and sample are fixed, so each pair of widths is
    measured once. A gate before use on a sample chosen by the job, so the estimate itself is
    the verdict (the sidecar's guardrail, on live traffic, asks for a confidence bound).
    """

    def __init__(self, model: PreTrainedModel, prompts: torch.Tensor, *, new_tokens: int = 64,
                 min_agreement: float = 0.9,
                 cache_kwargs: Mapping[str, Any] | None = None) -> None:
        if prompts.dim() != 2 or prompts.shape[1] < 1:
            raise KVCacheError(f"prompts must be [batch, tokens], got {tuple(prompts.shape)}")
        if new_tokens < 1:
            raise KVCacheError(f"new_tokens must be >= 1, got {new_tokens}")
        if not 0.0 <= min_agreement <= 1.0:
            raise KVCacheError(f"min_agreement must be in [0, 1], got {min_agreement}")
        self.model, self.prompts = model, prompts
        self.new_tokens, self.min_agreement = new_tokens, min_agreement
        self.cache_kwargs = dict(cache_kwargs or {})
        self.measured: dict[tuple[int, int], Agreement] = {}

    def measure(self, key_bits: int, value_bits: int) -> Agreement:
        """The sample's agreement at these widths (measured once per pair)."""
        widths = (key_bits, value_bits)
        if widths not in self.measured:
            cache = KiviCache(self.model.config, key_bits=key_bits, value_bits=value_bits,
                              **self.cache_kwargs)
            out = self.model.generate(  # type: ignore[operator]
                self.prompts, attention_mask=torch.ones_like(self.prompts), cache=cache,
                max_new_tokens=self.new_tokens, do_sample=False, eos_token_id=None,
                pad_token_id=0)
            self.measured[widths] = token_agreement(self.model, out, self.prompts.shape[1])
        return self.measured[widths]

    def check(self, key_bits: int, value_bits: int) -> Agreement:
        """The agreement at these widths; KVAgreementError when it is below the bound."""
        found = self.measure(key_bits, value_bits)
        if found.share < self.min_agreement:
            raise KVAgreementError(
                f"kv widths k{key_bits}v{value_bits} agree on {found.share:.3f} of "
                f"{found.checked} sampled tokens, below the bound {self.min_agreement:.3f}")
        return found
