"""Tiny language models built in code (no download), torch only: ``varlen calibrate --model
benchmarks.tiny_models:NAME`` in ``benchmarks/bench_calibrate.py``; the memory tests use them too
(``tests.memory_models``)."""

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


def lm_4k() -> nn.Module:
    """A tiny LM whose step is mostly its logits (4,096-token vocabulary), as language models' steps are:
    their large tensors are mappings of their own, so the process peak follows the shape smoothly."""
    return TinyLM(vocab=4096, dim=32, heads=2, layers=2)
