"""Models for the memory tests: built in code, no download (``varlen calibrate --model tests.memory_models:NAME``;
the language models are ``benchmarks/tiny_models.py``'s)."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.tiny_models import TinyLM, lm_4k, tiny_lm  # noqa: F401 (--model tests.memory_models:lm_4k)

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
