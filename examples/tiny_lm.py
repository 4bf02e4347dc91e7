"""A tiny GPT-style language model and a token dataset, for the loader examples and benchmarks.

Nothing here is specific to varlen: it is the kind of model and dataset a user already has.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import torch.nn as nn
import torch.nn.functional as F


class TokenDataset(torch.utils.data.Dataset):
    """Map-style dataset over a Parquet list column of token ids (sample i = row i)."""

    def __init__(self, path: str, column: str = "input_ids"):
        col = pq.read_table(path, columns=[column]).column(column).combine_chunks()
        self.offsets = col.offsets.to_numpy().astype(np.int64)
        self.offsets -= self.offsets[0]
        self.values = pc.list_flatten(col).to_numpy().astype(np.int64)
        self.vocab_size = int(self.values.max()) + 1 if len(self.values) else 1

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Embeddings, ``n_layers`` pre-norm transformer blocks with causal + padding attention, LM head."""

    def __init__(self, vocab_size: int, max_len: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids=None,
                attention_mask_3d=None) -> torch.Tensor:
        """Padded batches: ``attention_mask`` (B x T, True on real tokens) gives causal + padding
        attention. Packed rows: pass ``position_ids`` (restarting per sample) and
        ``attention_mask_3d`` (B x T x T block-diagonal causal) so samples never see each other."""
        b, t = input_ids.shape
        pos = torch.arange(t, device=input_ids.device)
        x = self.tok(input_ids) + (self.pos(position_ids) if position_ids is not None else self.pos(pos)[None])
        if attention_mask_3d is not None:
            mask = attention_mask_3d[:, None]
        else:
            # causal, keys limited to real tokens, and every position may see itself (no all -inf rows)
            causal = pos[None, :] <= pos[:, None]
            mask = (causal[None] & attention_mask[:, None, :]) | torch.eye(t, dtype=torch.bool, device=x.device)[None]
            mask = mask[:, None]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the targets (labels != -100)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")


def warmup_cosine(warmup_steps: int, total_steps: int, floor: float = 0.1):
    """LambdaLR factor: linear warm-up, then cosine decay to ``floor``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor
