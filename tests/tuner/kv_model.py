"""A small demo GPT trained briefly on the generated corpus, cached on disk between runs.

Shared by the KV-cache quality tests and ``bench/kv.py``: quality loss needs a model whose
next-token distributions are not uniform. Weights are cached under the temp dir keyed by the
training settings, so only the first run pays for the training.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import torch

from collectors.torch_training import NullTrainingInstrumentation
from workloads.corpus import Corpus
from workloads.gpt import GPT, GPTConfig
from workloads.train import TrainConfig, Trainer

SMALL_GPT = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128)


def trained_gpt(*, steps: int = 150, model_config: GPTConfig = SMALL_GPT,
                cache_dir: Path | None = None) -> tuple[GPT, torch.Tensor]:
    """(model in eval mode, held-out tokens) after ``steps`` AdamW steps (seq 64, batch 16)."""
    train = TrainConfig(steps=steps, seq_len=64, global_batch=16, micro_batch=16, lr=3e-3,
                        corpus_bytes=200_000, seed=0)
    key = hashlib.sha256(json.dumps([repr(train), repr(model_config)]).encode()).hexdigest()[:16]
    path = (cache_dir or Path(tempfile.gettempdir())) / f"seedance-kv-gpt-{key}.pt"
    trainer = Trainer(train, model_config=model_config)
    if path.exists():
        trainer.model.load_state_dict(torch.load(path, weights_only=True))
    else:
        instr = NullTrainingInstrumentation()
        for _ in range(steps):
            trainer.step(instr)
        tmp = path.with_suffix(".tmp")
        torch.save(trainer.model.state_dict(), tmp)
        tmp.replace(path)
    return trainer.model.eval(), trainer.corpus.held_out


def held_out_windows(held_out: torch.Tensor, *, n: int, seq_len: int, seed: int = 1234
                     ) -> torch.Tensor:
    """``n`` fixed held-out windows [n, seq_len] (seeded, so runs compare)."""
    g = torch.Generator().manual_seed(seed)
    return Corpus.batch(held_out, batch_size=n, seq_len=seq_len, generator=g)[0]
