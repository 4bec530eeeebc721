"""Snapshots, full and local rollback on real tiny models and optimizers on CPU.

The fp16 scenario (seed 3.3) runs the demo GPT with one group forced to fp16 under a shrinking
loss scale. What it shows about starvation: the attention branch's gradients flush to zero, and so
does ``ln_1`` (its only way to the loss is through attention), but the embeddings upstream keep
gradients through the fp32 residual stream; forcing the head (which every path crosses) to fp16
starves every group upstream of it, before the head's own weight gradient underflows.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tuner.checkpoint import CheckpointBudgetError, Checkpointer, CheckpointError
from tuner.precision import PatternMatchError, PrecisionPolicy, apply_precision
from workloads.gpt import GPT, GPTConfig

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Factory] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.1),
}


class _Net(nn.Module):
    """Two named groups plus a BatchNorm, so there are buffers (float and int64) to restore."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    """Every tensor and value a rollback must restore, cloned."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "opt": {names[id(p)]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                for p, s in opt.state.items()},
        "hyper": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    }


def _assert_equal(a: object, b: object, path: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            _assert_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{path}[{i}]")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, path


def _setup(name: str) -> tuple[_Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Net()
    return model, OPTIMIZERS[name](list(model.parameters()))


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_full_rollback_restores_everything_bit_for_bit_in_place(opt_name: str) -> None:
    model, opt = _setup(opt_name)
    ck = Checkpointer(model, opt, max_bytes=1 << 20)
    _train(model, opt, 3, seed=1)
    snap = ck.snapshot("step 3")
    saved = _state(model, opt)
    identity = [id(p) for p in model.parameters()]
    _train(model, opt, 4, seed=2)
    opt.param_groups[0]["lr"] = 0.5
    assert not torch.equal(next(model.parameters()), saved["params"]["body.0.weight"])
    ck.full_rollback(snap)
    _assert_equal(_state(model, opt), saved)
    assert [id(p) for p in model.parameters()] == identity
    assert [id(p) for p in opt.param_groups[0]["params"]] == identity
    # The restored job continues exactly as the original did from the snapshot.
    _train(model, opt, 2, seed=3)
    after_rollback = _state(model, opt)
    ck.full_rollback(snap)
    _train(model, opt, 2, seed=3)
    _assert_equal(_state(model, opt), after_rollback)


def test_full_rollback_to_before_the_first_step_empties_optimizer_state() -> None:
    model, opt = _setup("adam")
    ck = Checkpointer(model, opt, max_bytes=1 << 20)
    snap = ck.snapshot()
    saved = _state(model, opt)
    _train(model, opt, 2, seed=1)
    ck.full_rollback(snap)
    assert len(opt.state) == 0
    _assert_equal(_state(model, opt), saved)


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_local_rollback_touches_exactly_one_group(opt_name: str) -> None:
    model, opt = _setup(opt_name)
    ck = Checkpointer(model, opt, max_bytes=1 << 20)
    _train(model, opt, 3, seed=1)
    snap = ck.snapshot()
    at_snapshot = _state(model, opt)
    _train(model, opt, 3, seed=2)
    before = _state(model, opt)
    result = ck.local_rollback(snap, "head")
    after = _state(model, opt)
    head = {n for n, _ in model.named_parameters() if n.startswith("head.")}
    assert result.modules == ("head",) and result.parameters == len(head)
    assert result.optimizer_states_reset == len(head)
    for n in after["params"]:
        want = at_snapshot if n in head else before
        assert torch.equal(after["params"][n], want["params"][n]), n
    assert set(after["opt"]) == set(before["opt"]) - head
    _assert_equal({n: before["opt"][n] for n in after["opt"]}, after["opt"])
    _assert_equal(after["buffers"], before["buffers"])  # head has no buffers
    # The optimizer re-initialises the dropped state lazily, like at the start of training.
    _train(model, opt, 1, seed=4)
    for p in model.head.parameters():
        assert opt.state[p]
    if opt_name.startswith("adam"):
        assert float(opt.state[model.head.weight]["step"]) == 1.0
        assert float(opt.state[model.body[0].weight]["step"]) == 7.0
    # A full rollback afterwards rebuilds the dropped state and restores everything.
    ck.full_rollback(snap)
    _assert_equal(_state(model, opt), at_snapshot)


def test_local_rollback_by_parameters_and_its_buffers_by_pattern() -> None:
    model, opt = _setup("sgd_momentum")
    ck = Checkpointer(model, opt, max_bytes=1 << 20)
    _train(model, opt, 2, seed=1)
    snap = ck.snapshot()
    at_snapshot = _state(model, opt)
    _train(model, opt, 2, seed=2)
    ck.local_rollback(snap, [model.head.bias])
    assert torch.equal(model.head.bias, at_snapshot["params"]["head.bias"])
    assert not torch.equal(model.head.weight, at_snapshot["params"]["head.weight"])
    ck.local_rollback(snap, ["body.1"])  # the BatchNorm: its parameters and running stats
    for n in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(model.body[1], n), at_snapshot["buffers"][f"body.1.{n}"])
    with pytest.raises(PatternMatchError, match="'body.9'"):
        ck.local_rollback(snap, ["body.9"])
    with pytest.raises(CheckpointError, match="not the model's"):
        ck.local_rollback(snap, [nn.Parameter(torch.zeros(1))])


def test_max_bytes_evicts_the_oldest_and_reuses_its_buffers() -> None:
    model, opt = _setup("adam")
    _train(model, opt, 1, seed=1)
    one = Checkpointer(model, opt, max_bytes=1 << 20).snapshot().nbytes
    ck = Checkpointer(model, opt, max_bytes=2 * one + one // 2)
    first, second = ck.snapshot("a"), ck.snapshot("b")
    storage = {k: b.data_ptr() for k, b in first._buffers.items()}
    third = ck.snapshot("c")
    assert ck.snapshots == [second, third] and first.evicted
    assert ck.nbytes <= ck.max_bytes
    assert {k: b.data_ptr() for k, b in third._buffers.items()} == storage
    with pytest.raises(CheckpointError, match="evicted"):
        ck.full_rollback(first)
    with pytest.raises(CheckpointBudgetError, match="on its own"):
        Checkpointer(model, opt, max_bytes=one - 1).snapshot()


def test_max_bytes_refuse_mode_keeps_what_it_has() -> None:
    model, opt = _setup("adam")
    _train(model, opt, 1, seed=1)
    one = Checkpointer(model, opt, max_bytes=1 << 20).snapshot().nbytes
    ck = Checkpointer(model, opt, max_bytes=one + one // 2, on_full="refuse")
    kept = ck.snapshot("kept")
    with pytest.raises(CheckpointBudgetError, match="refused"):
        ck.snapshot("extra")
    assert ck.snapshots == [kept] and not kept.evicted


GPT_CFG = GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=32)
GROUPS = {
    "attention": ("h.*.attn",),
    "ffn": ("h.*.mlp",),
    "norm": ("h.*.ln_*", "ln_f"),
    "embedding": ("wte", "wpe"),
    "head": ("lm_head",),
}


class _GPTRun:
    """The demo GPT on one fixed batch with a manual loss scale (fp32 unscaling, then Adam)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = GPT(GPT_CFG)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=3e-3)
        self.handle = apply_precision(self.model, PrecisionPolicy.from_groups(GROUPS, {}))
        ids = torch.randint(0, GPT_CFG.vocab_size, (4, GPT_CFG.block_size + 1),
                            generator=torch.Generator().manual_seed(1))
        self.x, self.y = ids[:, :-1], ids[:, 1:]

    def grad_norm(self, module: str) -> float:
        grads = [p.grad for p in self.model.get_submodule(module).parameters()]
        return float(torch.stack([g.norm() for g in grads if g is not None]).norm())

    def step(self, scale: float = 1.0) -> float:
        self.opt.zero_grad()
        loss = self.model(self.x, self.y)
        (loss * scale).backward()
        for p in self.model.parameters():
            p.grad.div_(scale)
        self.opt.step()
        return float(loss.detach())


@pytest.mark.integration
def test_fp16_group_underflows_and_local_rollback_recovers() -> None:
    run = _GPTRun()
    for _ in range(3):
        run.step()
    ck = Checkpointer(run.model, run.opt, max_bytes=1 << 28)
    snap = ck.snapshot("before lowering attention to fp16")
    run.handle.set_group("attention", "fp16")
    scale, collapsed_at, loss_at_rollback = 1.0, None, 0.0
    for i in range(8):
        scale /= 16
        loss_at_rollback = run.step(scale)
        if all(run.grad_norm(m) == 0.0 for m in run.handle.groups["attention"]):
            collapsed_at = i
            break
    assert collapsed_at is not None, "attention gradients never flushed to zero"
    for m in ("h.0.mlp", "h.1.mlp", "lm_head", "wte", "wpe", "ln_f"):
        assert run.grad_norm(m) > 0.0, m  # fp32 groups, reached through the residual stream
    for i in range(GPT_CFG.n_layer):
        assert run.grad_norm(f"h.{i}.ln_1") == 0.0  # starved: its only path is attention
    result = ck.local_rollback(snap, "attention", run.handle)
    assert result.precision == "fp32" and run.handle.precision_of("h.0.attn.qkv") == "fp32"
    losses = [run.step() for _ in range(20)]
    assert all(run.grad_norm(m) > 0.0 for m in run.handle.groups["attention"])
    assert losses[-1] < loss_at_rollback
    assert sum(b < a for a, b in zip(losses, losses[1:], strict=False)) >= 15


@pytest.mark.integration
def test_fp16_head_starves_every_group_upstream() -> None:
    run = _GPTRun()
    run.step()
    run.handle.set_group("head", "fp16")
    scale, starved = 1.0, False
    for _ in range(8):
        scale /= 16
        run.step(scale)
        upstream = ("wte", "wpe", "h.0", "h.1", "ln_f")
        if all(run.grad_norm(m) == 0.0 for m in upstream):
            starved = True
            break
    assert starved
    assert run.grad_norm("lm_head") > 0.0  # the input gradient flushed before the weight's


def test_local_rollback_moves_precision_up_only() -> None:
    run = _GPTRun()
    ck = Checkpointer(run.model, run.opt, max_bytes=1 << 28)
    snap = ck.snapshot()
    run.handle.set_group("ffn", "fp16")
    with pytest.raises(CheckpointError, match="'fp32' or 'bf16'"):
        ck.local_rollback(snap, "ffn", run.handle, precision="fp16")
    assert run.handle.precision_of("h.0.mlp.fc") == "fp16"
    ck.local_rollback(snap, "ffn", run.handle, precision="bf16")
    assert {run.handle.precision_of(f"h.{i}.mlp.{leaf}")
            for i in range(GPT_CFG.n_layer) for leaf in ("fc", "proj")} == {"bf16"}
    assert run.handle.precision_of("h.0.attn.qkv") == "fp32"
    other = _GPTRun()
    with pytest.raises(CheckpointError, match="another model"):
        ck.local_rollback(snap, "ffn", other.handle)
