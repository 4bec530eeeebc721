"""Layer-wise precision on real tiny models on CPU: dtypes seen inside modules, removal, errors."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from tuner.precision import (
    PatternMatchError,
    PrecisionError,
    PrecisionPolicy,
    PrecisionUnsupportedError,
    apply_precision,
)
from workloads.gpt import GPT, GPTConfig

CFG = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)
GROUPS = {
    "attention": ("h.*.attn",),
    "ffn": ("h.*.mlp",),
    "norm": ("h.*.ln_*", "ln_f"),
    "embedding": ("wte", "wpe"),
    "head": ("lm_head",),
}


@pytest.fixture
def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


@pytest.fixture
def idx() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, CFG.block_size),
                         generator=torch.Generator().manual_seed(1))


class _Seen:
    """Records the dtype of the input and of the weight each Linear/LayerNorm computes with."""

    def __init__(self, model: nn.Module) -> None:
        self.dtypes: dict[str, tuple[torch.dtype, torch.dtype]] = {}
        self._hooks = [
            m.register_forward_hook(self._hook(name))
            for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.LayerNorm))
        ]

    def _hook(self, name: str):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            self.dtypes[name] = (args[0].dtype, module.weight.dtype)
        return hook

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


@pytest.fixture
def seen(gpt: GPT) -> Iterator[_Seen]:
    s = _Seen(gpt)
    yield s
    s.remove()


def test_matched_modules_compute_in_their_dtype_and_masters_stay_fp32(
        gpt: GPT, idx: torch.Tensor, seen: _Seen) -> None:
    policy = PrecisionPolicy.from_groups(GROUPS, {"attention": "fp16", "norm": "bf16"})
    handle = apply_precision(gpt, policy)
    # The seen-hooks were registered first, so they run after the precision pre-hooks.
    loss = gpt(idx, idx)
    loss.backward()
    for name, (x_dtype, w_dtype) in seen.dtypes.items():
        # the norm group's LayerNorms compute in fp32 like under AMP, though the rule says bf16
        want = torch.float16 if ".attn." in name else torch.float32
        assert (x_dtype, w_dtype) == (want, want), name
    assert loss.dtype == torch.float32
    for name, p in gpt.named_parameters():
        assert type(p) is nn.Parameter and p.dtype == torch.float32, name
        assert p.grad is not None and p.grad.dtype == torch.float32, name
    assert handle.precision_of("h.1.attn.qkv") == "fp16"
    assert handle.precision_of("h.1.mlp.fc") == "fp32"
    assert handle.precision_of("h.1.ln_1") == "fp32"
    assert "norm layers kept in fp32: h.0.ln_1," in handle.report()


def test_remove_restores_forward_outputs_exactly(gpt: GPT, idx: torch.Tensor) -> None:
    before = gpt(idx)
    handle = apply_precision(gpt, PrecisionPolicy(rules={"h.*": "fp16", "lm_head": "bf16"}))
    during = gpt(idx)
    assert during.dtype == torch.float32
    assert not torch.equal(during, before)  # the casts did change the math
    handle.remove()
    handle.remove()  # idempotent
    assert torch.equal(gpt(idx), before)
    assert not gpt._forward_pre_hooks and not any(m._forward_hooks for m in gpt.modules())


def test_first_matching_rule_wins_and_unmatched_modules_inherit(gpt: GPT) -> None:
    handle = apply_precision(gpt, PrecisionPolicy(rules={"h.0.mlp": "fp32", "h.0": "fp16"}))
    assert handle.precision_of("h.0.attn.qkv") == "fp16"  # inherited from h.0
    assert handle.precision_of("h.0.mlp.fc") == "fp32"  # h.0.mlp's own rule
    assert handle.precision_of("h.1.attn.qkv") == "fp32"
    assert handle.matches["h.0"] == ("h.0",)
    report = handle.report()
    assert "'h.0' (fp16): h.0" in report and "h.0.attn.qkv: fp16 (inherited)" in report


def test_matches_report_which_modules_each_pattern_hit(gpt: GPT) -> None:
    handle = apply_precision(gpt, PrecisionPolicy.from_groups(GROUPS, {}))
    layers = range(CFG.n_layer)
    assert handle.groups["attention"] == tuple(f"h.{i}.attn" for i in layers)
    assert handle.groups["norm"] == (
        *(f"h.{i}.{ln}" for i in layers for ln in ("ln_1", "ln_2")), "ln_f")
    assert handle.matches["h.*.ln_*"] == tuple(f"h.{i}.{ln}" for i in layers
                                               for ln in ("ln_1", "ln_2"))
    assert "group 'head': lm_head" in handle.report()


def test_set_group_switches_live_including_submodules_with_their_own_rules(
        gpt: GPT, idx: torch.Tensor, seen: _Seen) -> None:
    handle = apply_precision(gpt, PrecisionPolicy(
        rules={"h.*.attn.qkv": "fp16"}, groups={"attention": ("h.*.attn",)}))
    gpt(idx)
    assert seen.dtypes["h.0.attn.qkv"] == (torch.float16, torch.float16)
    handle.set_group("attention", "bf16")
    gpt(idx)
    for i in range(CFG.n_layer):
        for leaf in ("qkv", "proj"):
            assert seen.dtypes[f"h.{i}.attn.{leaf}"] == (torch.bfloat16, torch.bfloat16)
    handle.set_group("attention", "fp32")
    out = gpt(idx)
    handle.remove()
    assert torch.equal(out, gpt(idx))  # all-fp32 assignment computes exactly like no hooks


@pytest.mark.parametrize("rules,groups,bad", [
    ({"h.*.atn.qkv": "fp16"}, {}, "h.*.atn.qkv"),
    ({"h.*.attn.qkv": "fp16"}, {"ffn": ("h.*.mlp", "h.*.feed_forward")}, "h.*.feed_forward"),
])
def test_pattern_matching_nothing_is_a_clear_error(
        gpt: GPT, rules: dict, groups: dict, bad: str) -> None:
    with pytest.raises(PatternMatchError, match=re.escape(f"pattern {bad!r} matches no module")):
        apply_precision(gpt, PrecisionPolicy(rules=rules, groups=groups))
    assert not any(m._forward_pre_hooks for m in gpt.modules())


def test_invalid_policy_names_the_field() -> None:
    with pytest.raises(PrecisionError, match=r"rules\['x'\]"):
        PrecisionPolicy(rules={"x": "fp12"})  # type: ignore[dict-item]
    with pytest.raises(PrecisionError, match=r"groups\['g'\]"):
        PrecisionPolicy(rules={}, groups={"g": ()})
    with pytest.raises(PrecisionError, match="unknown groups"):
        PrecisionPolicy.from_groups(GROUPS, {"attn": "fp16"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_fp8_reports_unsupported_on_this_device(gpt: GPT) -> None:
    with pytest.raises(PrecisionUnsupportedError, match="unsupported on this device"):
        apply_precision(gpt, PrecisionPolicy(rules={"h.*.mlp": "fp8"}))
    handle = apply_precision(gpt, PrecisionPolicy(rules={}, groups=GROUPS))
    with pytest.raises(PrecisionUnsupportedError, match="unsupported on this device"):
        handle.set_group("ffn", "fp8")


def test_any_module_and_an_exception_inside_forward_leaves_parameters_intact() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    before = model(x)
    params = list(model.parameters())
    handle = apply_precision(model, PrecisionPolicy(rules={"0": "bf16"}))
    assert model(x).dtype == torch.float32
    with pytest.raises(RuntimeError):
        model(torch.randn(3, 5))  # shape error inside the bf16 module
    assert list(model.parameters()) == params
    assert all(type(p) is nn.Parameter for p in model.parameters())
    handle.remove()
    assert torch.equal(model(x), before)


def test_changing_precision_during_a_forward_is_refused(gpt: GPT, idx: torch.Tensor) -> None:
    handle = apply_precision(gpt, PrecisionPolicy(rules={"h.0": "fp16"}, groups=GROUPS))
    errors: list[Exception] = []

    def meddle(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        try:
            handle.set_group("ffn", "bf16")
        except PrecisionError as e:
            errors.append(e)

    hook = gpt.h[0].mlp.register_forward_pre_hook(meddle)
    gpt(idx)
    hook.remove()
    assert len(errors) == 1 and "between steps" in str(errors[0])
