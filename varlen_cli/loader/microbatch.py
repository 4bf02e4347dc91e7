"""``Microbatch``: one row of a plan, as the reader, the sampler and the collate functions pass it on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Microbatch:
    """One row of a plan: the samples one data-parallel rank runs in one forward/backward."""

    epoch: int
    step: int
    rank: int
    micro: int
    sample_ids: np.ndarray  # int64, in the order the loader yields them
    num_samples: int
    seqlen: int  # padded sequence length T (packed: the row length)
    batch_size: int  # padded batch size B >= num_samples (packed: rows per microbatch)
    tokens: int  # real tokens in this microbatch
    lr_scale: float
    shape_id: int
    step_samples: int  # real samples in the whole step (all ranks, all micros)
    step_tokens: int  # real tokens in the whole step
    sample_lengths: np.ndarray | None = None  # packed plans
    sample_rows: np.ndarray | None = None
    sample_starts: np.ndarray | None = None
    source: np.ndarray | None = None  # mixture plans: index of each sample's source (plan.meta["mixture"])
    step_loss_tokens: int | None = None  # loss targets of the whole step (plans written since the column exists)
    target_seqlen: int | None = None  # two-budget plans: the padded target length T_target (decoder side)
    target_tokens: int | None = None  # two-budget plans: real target tokens (the samples' target_length summed)
    # the step's figures over all ranks (loader/step_figures.py: StepFigures), for the trackers
    figures: Any = field(default=None, compare=False, repr=False)

    @property
    def step_targets(self) -> int:
        """Loss targets of the whole step: the plan's exact ``step_loss_tokens`` (empty samples count 0,
        a non-final split chunk all its tokens), or ``step_tokens - step_samples`` for older plans."""
        if self.step_loss_tokens is not None:
            return self.step_loss_tokens
        return self.step_tokens - self.step_samples

    @property
    def position(self) -> tuple[int, int, int]:
        """``(epoch, step, micro)``: where this microbatch sits in the plan."""
        return (self.epoch, self.step, self.micro)

    @property
    def shape(self) -> tuple[int, int]:
        """The padded ``(B, T)`` of this microbatch."""
        return (self.batch_size, self.seqlen)
