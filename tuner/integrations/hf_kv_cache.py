"""The quantised KV cache (``tuner.kv_cache``, KIVI layout) as a transformers ``Cache``.

``model.generate(ids, cache=KiviCache(model.config, key_bits=4, value_bits=4))`` (or the older
``past_key_values=``) decodes any full-attention transformers model (Llama-, GPT-2-like) over
packed 2/4/6/8-bit keys and values. Each layer is one :class:`tuner.kv_cache.QuantizedKVCache`:
keys per channel, values per token, the newest ``residual_tokens`` exact, and a width change
(:meth:`KiviCache.set_bits`) applies to tokens quantised from then on, so it can happen between
two decode steps. Under the serving lease the widths are live knobs::

    kv = LiveKVBits(model.config, key_bits=8, value_bits=8,
                    guard=AgreementGuard(model, sample_prompts, min_agreement=0.9))
    session = tuner.job.attach_serving(job="gen", sidecar=url, apply=kv.apply,
                                       knobs=tuner.job.KV_BITS_KNOBS, defaults=kv.defaults())
    serving = ServingInstrumentation(meter, config_version=lambda: session.version)
    check = ShadowCheck(model, serving, every=8)
    version = session.version
    out = model.generate(ids, cache=kv.cache(), logits_processor=[DecodeBoundary(session)])
    check(out, ids.shape[1], version=version)

``ShadowCheck`` counts live traffic's token agreement (every 8th output, teacher-forced against
the unquantised model) through the job's ``collectors.torch_serving.ServingInstrumentation``,
as the demo serving engine does, so the sidecar's ``ServingSLOGuardrail`` rolls a width back
on the job's own requests.

Imported by the serving job only (torch and transformers), never by the sidecar.
"""

from __future__ import annotations

from tuner.integrations._kivi import KiviCache, KiviLayer
from tuner.integrations._kv_agreement import (
    Agreement,
    AgreementGuard,
    KVAgreementError,
    token_agreement,
)
from tuner.integrations._kv_live import DecodeBoundary, LiveKVBits
from tuner.integrations._kv_shadow import CheckedTokens, ShadowCheck

__all__ = ["Agreement", "AgreementGuard", "CheckedTokens", "DecodeBoundary", "KVAgreementError",
           "KiviCache", "KiviLayer", "LiveKVBits", "ShadowCheck", "token_agreement"]
