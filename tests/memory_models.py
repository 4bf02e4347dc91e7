"""Models for the memory tests: built in code, no download (``varlen calibrate --model tests.memory_models:NAME``)."""

from __future__ import annotations

import math

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block with materialised (eager) causal attention: B x heads x T x T scores."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # logits: varlen computes the cross-entropy


def tiny_lm() -> nn.Module:
    return TinyLM()


def small_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**LLAMA_SMALL))


def medium_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**LLAMA_MEDIUM))


_LLAMA_COMMON = {"attn_implementation": "eager", "tie_word_embeddings": False, "attention_dropout": 0.0}
LLAMA_SMALL = dict(_LLAMA_COMMON, vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024)
LLAMA_MEDIUM = dict(_LLAMA_COMMON, vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
