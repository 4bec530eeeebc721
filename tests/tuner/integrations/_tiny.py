"""Tiny random-init transformers built from configs (nothing loads from a hub) and random token
data, for the framework integrations' tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

VOCAB = 100
SEQ = 16


def tiny_model(family: str) -> nn.Module:
    """A 2-layer, 32-wide GPT-2-, Llama- or BERT-like model, seeded."""
    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32,
                                          n_layer=2, n_head=2))
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ))
    if family == "bert":
        return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, intermediate_size=64,
                                          max_position_embeddings=SEQ))
    raise ValueError(family)


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """``n`` random sequences whose labels are their own ids (causal or masked LM loss)."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
