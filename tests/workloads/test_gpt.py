"""The demo GPT, its generated corpus and the training loop, on CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from collectors.torch_training import NullTrainingInstrumentation
from workloads.corpus import Corpus, CorpusConfig, generate_text
from workloads.gpt import GPT, GPTConfig, count_parameters
from workloads.train import TrainConfig, Trainer

TINY = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


def test_corpus_is_deterministic_and_split() -> None:
    assert generate_text(n_bytes=5000, seed=1) == generate_text(n_bytes=5000, seed=1)
    assert generate_text(n_bytes=5000, seed=1) != generate_text(n_bytes=5000, seed=2)
    corpus = Corpus.generate(CorpusConfig(n_bytes=20_000, held_out_fraction=0.1))
    total = len(corpus.train) + len(corpus.held_out)
    assert total >= 20_000
    assert len(corpus.held_out) == pytest.approx(0.1 * total, abs=2)
    assert int(corpus.train.max()) < 128  # ASCII bytes


def test_default_gpt_has_about_five_million_parameters() -> None:
    model = GPT(GPTConfig())
    assert 4.5e6 <= count_parameters(model) <= 5.5e6
    names = {n for n, _ in model.named_modules()}
    for required in ("wte", "wpe", "lm_head", "h.0.ln_1", "h.0.ln_2", "h.0.attn.qkv",
                     "h.0.attn.proj", "h.0.mlp.fc", "h.0.mlp.proj"):
        assert required in names


def test_accumulation_keeps_global_batch_and_gradient() -> None:
    def grads(micro_batch: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        config = TrainConfig(global_batch=8, micro_batch=micro_batch, seq_len=32,
                             corpus_bytes=20_000, seed=3)
        trainer = Trainer(config, model_config=TINY)
        micro = trainer.next_batch()
        assert len(micro) == config.accumulation == 8 // micro_batch
        loss = trainer.forward_backward(micro)
        x = torch.cat([m[0] for m in micro])
        return [p.grad.clone() for p in trainer.model.parameters()], loss, x

    big_grads, big_loss, big_x = grads(8)
    acc_grads, acc_loss, acc_x = grads(2)
    assert torch.equal(big_x, acc_x)  # the same global batch
    assert acc_loss.item() == pytest.approx(big_loss.item(), rel=1e-5)
    for g_big, g_acc in zip(big_grads, acc_grads, strict=True):
        torch.testing.assert_close(g_acc, g_big, rtol=1e-4, atol=1e-6)


def test_config_rejects_uneven_accumulation() -> None:
    with pytest.raises(Exception, match="global_batch"):
        TrainConfig(global_batch=8, micro_batch=3)


@pytest.mark.integration
def test_loss_falls_over_thirty_steps() -> None:
    config = TrainConfig(global_batch=4, micro_batch=4, seq_len=64, corpus_bytes=200_000)
    trainer = Trainer(config)
    assert 4.5e6 <= count_parameters(trainer.model) <= 5.5e6
    held_out_before = trainer.evaluate(batches=2)
    losses = [trainer.step(NullTrainingInstrumentation()).item() for _ in range(30)]
    assert sum(losses[-5:]) / 5 < 0.75 * losses[0]
    assert trainer.evaluate(batches=2) < held_out_before - 1.0


@pytest.mark.integration
def test_bf16_grad_scaler_ddp_two_ranks_run() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "workloads.train", "--steps", "2", "--ddp", "2", "--threads", "1",
         "--precision", "bf16", "--grad-scaler", "--global-batch", "4", "--micro-batch", "1",
         "--seq-len", "32"],
        capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "accumulation 2, world size 2" in out.stdout
    assert "done: 2 steps" in out.stdout
