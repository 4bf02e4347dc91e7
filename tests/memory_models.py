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


def lm_4k() -> nn.Module:
    """A tiny LM whose step is mostly its logits (4,096-token vocabulary), as language models' steps are:
    their large tensors are mappings of their own, so the process peak follows the shape smoothly."""
    return TinyLM(vocab=4096, dim=32, heads=2, layers=2)


BALLAST_BYTES = 48 << 20


class Ballast(nn.Module):
    """A negligible model whose forward also fills a 48 MiB buffer, freed before backward: the
    step's peak is then that buffer plus almost nothing (checks the CPU peak reading)."""

    def __init__(self, ballast: bool = True):
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.ballast = ballast

    def forward(self, input_ids):
        loss = self.embed(input_ids).square().mean()
        if self.ballast:
            buffer = torch.ones(BALLAST_BYTES // 4)
            loss = loss + buffer[0] * 0
        return loss  # a scalar: varlen uses it as the loss


def ballast() -> nn.Module:
    return Ballast(True)


def no_ballast() -> nn.Module:
    return Ballast(False)


def raising() -> nn.Module:
    """A model factory with a bug of the user's: calibrate must say so (exit 3), not fail as a worker."""
    raise ValueError("hidden size 63 is not divisible by 4 heads")


class _ForwardRaises(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 4)

    def forward(self, input_ids):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x4 and 5x4)")


def forward_raises() -> nn.Module:
    return _ForwardRaises()
