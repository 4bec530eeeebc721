"""The KIVI cache under transformers' ``generate()``: random-init Llama- and GPT-2-like models
on CPU decode over it, its widths switch between two decode steps (by hand and under a real
lease server's serving lease), and its token agreement with the unquantised model is measured
and guarded."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    PreTrainedModel,
)

from tests.servers import free_port
from tests.tuner.test_client import LeaseServer
from tuner._lease import JobRegistry
from tuner.integrations.hf_kv_cache import (
    AgreementGuard,
    DecodeBoundary,
    KiviCache,
    KVAgreementError,
    LiveKVBits,
)
from tuner.job import KV_BITS_KNOBS, ServeSession, attach_serving
from tuner.kv_cache import KVCacheError

LAYOUT = {"group_size": 8, "residual_tokens": 8}
NEW_TOKENS = 40


def tiny(kind: str) -> PreTrainedModel:
    """A random-init model; GPT-2's init is widened so that its logits depend on the cache
    enough to be hurt by 2-bit keys (at the default 0.02 every width picks the same tokens)."""
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)).eval()
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                      n_positions=256, initializer_range=0.2)).eval()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return tiny(request.param)


@pytest.fixture(scope="module")
def prompts() -> torch.Tensor:
    return torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def generate(model: PreTrainedModel, prompts: torch.Tensor, **kwargs: object) -> torch.Tensor:
    return model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                          max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
                          **kwargs)


@pytest.mark.parametrize("keyword", ["past_key_values", "cache"])
def test_generate_decodes_over_packed_keys_and_values(model: PreTrainedModel,
                                                      prompts: torch.Tensor,
                                                      keyword: str) -> None:
    cache = KiviCache(model.config, key_bits=4, value_bits=4, **LAYOUT)
    out = generate(model, prompts, **{keyword: cache})
    assert out.shape == (2, 16 + NEW_TOKENS)
    held = 16 + NEW_TOKENS - 1  # the last token is picked, never fed back
    assert cache.get_seq_length() == held
    stored = cache.tokens_by_bits()
    assert stored["k4v4"] + stored["residual"] == held * len(cache)
    assert stored["k4v4"] >= stored["residual"]
    unquantised = KiviCache(model.config, key_bits=32, value_bits=32, **LAYOUT)
    generate(model, prompts, past_key_values=unquantised)
    assert cache.nbytes() < unquantised.nbytes() / 2


def test_an_unquantised_kivi_cache_reproduces_the_dynamic_cache(model: PreTrainedModel,
                                                                prompts: torch.Tensor) -> None:
    reference = generate(model, prompts, past_key_values=DynamicCache(config=model.config))
    ours = generate(model, prompts,
                    past_key_values=KiviCache(model.config, key_bits=32, value_bits=32, **LAYOUT))
    assert torch.equal(ours, reference)


class SwitchAt:
    """Stands for a session: at decode step ``at`` the widths change; what each step stored."""

    def __init__(self, kv: LiveKVBits, at: int, bits: int) -> None:
        self.kv, self.at, self.bits = kv, at, bits
        self.steps = 0
        self.seen: list[dict[str, int]] = []
        self.cache: KiviCache | None = None

    def boundary(self) -> bool:
        assert self.cache is not None
        self.seen.append(self.cache.tokens_by_bits())
        self.steps += 1
        if self.steps == self.at:
            self.kv.apply({"kv.key_bits": self.bits, "kv.value_bits": self.bits})
            return True
        return False


def test_a_width_switched_mid_generate_changes_what_the_next_steps_store(
        model: PreTrainedModel, prompts: torch.Tensor) -> None:
    kv = LiveKVBits(model.config, key_bits=8, value_bits=8, **LAYOUT)
    session = SwitchAt(kv, at=12, bits=4)
    session.cache = cache = kv.cache()
    hook = DecodeBoundary(session)
    generate(model, prompts, cache=cache, logits_processor=[hook])
    assert hook.steps == NEW_TOKENS
    before, at_switch, after = session.seen[0], session.seen[11], cache.tokens_by_bits()
    assert "k4v4" not in at_switch and at_switch["k8v8"] > before.get("k8v8", 0)
    assert after["k4v4"] > 0 and after["k8v8"] == at_switch["k8v8"]  # old tokens keep theirs
    assert cache.bits() == (4, 4) and kv.defaults() == {"kv.key_bits": 4, "kv.value_bits": 4}
    assert kv.cache().bits() == (4, 4)


def test_agreement_is_high_at_8_bits_and_measured_lower_at_2_bits(
        model: PreTrainedModel, prompts: torch.Tensor) -> None:
    guard = AgreementGuard(model, prompts, new_tokens=NEW_TOKENS, cache_kwargs=LAYOUT)
    exact, eight, two = (guard.measure(b, b) for b in (32, 8, 2))
    assert exact.share == 1.0 and exact.checked == 2 * NEW_TOKENS
    assert eight.share > two.share
    assert 1 - eight.share < (1 - two.share) / 4  # 8-bit loses a quarter of 2-bit's misses


def test_the_guard_refuses_a_width_below_its_bound_and_nothing_changes(
        model: PreTrainedModel, prompts: torch.Tensor) -> None:
    probe = AgreementGuard(model, prompts, new_tokens=NEW_TOKENS, cache_kwargs=LAYOUT)
    bound = (probe.measure(8, 8).share + probe.measure(2, 2).share) / 2
    guard = AgreementGuard(model, prompts, new_tokens=NEW_TOKENS, min_agreement=bound,
                           cache_kwargs=LAYOUT)
    kv = LiveKVBits(model.config, key_bits=32, value_bits=32, guard=guard, **LAYOUT)
    live = kv.cache()
    kv.apply({"kv.key_bits": 8, "kv.value_bits": 8})
    assert live.bits() == (8, 8)
    with pytest.raises(KVAgreementError, match="k2v2 agree on"):
        kv.apply({"kv.key_bits": 2, "kv.value_bits": 2})
    assert live.bits() == (8, 8) and kv.defaults()["kv.key_bits"] == 8


def test_bad_widths_and_layouts_are_refused_with_one_line() -> None:
    config = tiny("llama").config
    with pytest.raises(KVCacheError, match="key_bits must be one of"):
        KiviCache(config, key_bits=3)
    with pytest.raises(KVCacheError, match="group_size 12 must divide head_dim 16"):
        KiviCache(config, group_size=12)
    kv = LiveKVBits(config, **LAYOUT)
    with pytest.raises(KVCacheError, match="kv.value_bits must be one of"):
        kv.apply({"kv.value_bits": 5})
    assert kv.defaults() == {"kv.key_bits": 32, "kv.value_bits": 32}
    with pytest.raises(KVCacheError, match="beam search"):
        model = tiny("gpt2")
        ids = torch.ones(1, 4, dtype=torch.long)
        model.generate(ids, attention_mask=ids, num_beams=2, max_new_tokens=4,
                       cache=KiviCache(model.config), pad_token_id=0)


# -- under a real lease server ------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[LeaseServer]:
    registry = JobRegistry(lease_ttl_s=5.0)
    registry.start()
    srv = LeaseServer(registry, free_port())
    srv.start()
    yield srv
    srv.stop()
    registry.shutdown()


class WaitForVersion(LogitsProcessor):
    """At decode step ``at`` the sidecar gets a new config; the steps after wait (bounded) until
    the session has it, so the switch lands inside this generate() whatever the poll's delay."""

    def __init__(self, session: ServeSession, server: LeaseServer, bits: int, at: int) -> None:
        self.session, self.server, self.bits, self.at = session, server, bits, at
        self.steps = 0
        self.version = -1

    def __call__(self, input_ids: torch.LongTensor,
                 scores: torch.FloatTensor) -> torch.FloatTensor:
        self.steps += 1
        if self.steps == self.at:
            self.version = self.server.registry.set_desired(
                "gen", {"kv.key_bits": self.bits, "kv.value_bits": self.bits}).version
        deadline = time.monotonic() + 20
        while self.steps >= self.at and self.session.version != self.version \
                and not any(a.version == self.version for a in self.server.registry.acks("gen")):
            assert time.monotonic() < deadline, "the config never reached the job"
            self.session.boundary()
            time.sleep(0.01)
        return scores


@pytest.mark.integration
def test_widths_switch_live_mid_generate_under_the_serving_lease(server: LeaseServer) -> None:
    model = tiny("llama")
    prompts = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    probe = AgreementGuard(model, prompts, new_tokens=NEW_TOKENS, cache_kwargs=LAYOUT)
    bound = (probe.measure(4, 4).share + probe.measure(2, 2).share) / 2
    guard = AgreementGuard(model, prompts, new_tokens=NEW_TOKENS, min_agreement=bound,
                           cache_kwargs=LAYOUT)
    kv = LiveKVBits(model.config, key_bits=8, value_bits=8, guard=guard, **LAYOUT)
    session = attach_serving(job="gen", sidecar=server.url, apply=kv.apply,
                             knobs=KV_BITS_KNOBS, defaults=kv.defaults())
    registry = server.registry
    try:
        deadline = time.monotonic() + 20
        while not any(s.job == "gen" for s in registry.jobs()):
            assert time.monotonic() < deadline, "the job never attached"
            session.boundary()
            time.sleep(0.01)
        assert registry.status("gen").baseline.values["kv.key_bits"] == 8
        for bits, status in ((4, "applied"), (2, "failed")):
            cache = kv.cache()
            wait = WaitForVersion(session, server, bits, at=10)
            hook = DecodeBoundary(session)
            generate(model, prompts, cache=cache, logits_processor=[wait, hook])
            (ack,) = [a for a in registry.acks("gen") if a.version == wait.version]
            assert ack.status == status
            stored = cache.tokens_by_bits()
            if status == "applied":
                assert session.version == wait.version
                assert stored["k8v8"] > 0 and stored["k4v4"] > 0
                assert 0 < session.switches[-1][0] - (session.batches_done - hook.steps) \
                    < NEW_TOKENS
            else:
                assert "agree on" in (ack.error or "")
                assert "k2v2" not in stored and cache.bits() == (4, 4)
    finally:
        session.close()
