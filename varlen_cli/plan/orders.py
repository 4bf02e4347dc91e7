"""One microbatch-forming strategy per order, behind one interface.

A :class:`Former` turns one epoch's samples into microbatches whose count is a multiple of
dp x grad_accum (``form(inputs, mode, rng) -> Formed``). The planner picks one per epoch with
:meth:`Formers.for_epoch` and then lays every epoch out the same way (``layout.layout_epoch``), so the
strategies only decide *which samples go together and in which order*:

- ``curriculum`` / ``reverse``: greedy consecutive microbatches over the sorted input (or its reverse);
- ``bucket-shuffle``: shuffle within length buckets, greedy microbatches, cost-balanced shuffle of them;
- ``random``: random microbatches (``batching.form_random``);
- same shape per step (``--same-shape-per-step``, any order but random): whole steps of one shape;
- packing (``--packing``): rows of ``--seq-len`` tokens (``packing.pack``), spread over microbatches.

Formers may keep state across epochs (the bucket-shuffle padded lengths, the random fixed batch
size); the draws from ``rng`` are part of the plan's reproducibility contract: changing their order
changes the plan for a given seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..budget import Budget
from ..errors import InputError
from . import balance, batching, layout, tail
from .batching import Microbatches, Targets
from .config import PlanConfig
from .shapes import ShapeMap

CURRICULAR = ("curriculum", "reverse")


def epoch_mode(c: PlanConfig, epoch: int) -> str:
    """The order epoch ``epoch`` (of the job: a continued plan's are numbered after its parent's) is
    planned in: the plan's order, bucket-shuffle after ``--curriculum-epochs``."""
    if c.curriculum_epochs is not None and epoch >= c.curriculum_epochs:
        return "bucket-shuffle"
    return c.order


@dataclass
class EpochInputs:
    """What every epoch is formed from (fixed for the whole plan)."""

    config: PlanConfig
    length: np.ndarray  # int64 per input row
    shape: ShapeMap
    budget: Budget
    slots: int  # dp x grad_accum microbatches per step
    ordered: np.ndarray | None  # curriculum/reverse: input positions in (reversed) sorted order, long ones removed
    canon: np.ndarray  # input positions in increasing sample_id, long ones removed
    rows_per_mb: int | None = None  # packing only
    remedies: layout.Remedies = layout.PLAN_REMEDIES  # what refusals suggest (plan or replan)
    targets: Targets | None = None  # two budgets (--max-target-tokens): the target side


@dataclass
class Formed:
    """One epoch's microbatches (count a multiple of ``slots``) and the input positions its tail dropped."""

    mb: Microbatches  # possibly reordered lazily (Microbatches.reordered): the planner's take moves the samples
    dropped: np.ndarray
    packing_stats: dict | None = None
    ranked: bool = False  # microbatches already in (step, rank, micro) order: the layout keeps the ranks


class Former(Protocol):
    def form(self, inputs: EpochInputs, mode: str, rng: np.random.Generator) -> Formed: ...


def _start(inputs: EpochInputs, mode: str) -> np.ndarray:
    return inputs.ordered if mode in CURRICULAR else inputs.canon


def _finish_padded(inputs: EpochInputs, mb: Microbatches, mode: str, rng: np.random.Generator,
                   fixed_batch: int | None = None, lens: np.ndarray | None = None,
                   padded: np.ndarray | None = None) -> Formed:
    """Tail fix (split the fullest or drop the smallest microbatches), then the per-order touches.
    ``lens``/``padded``: the (padded) lengths of ``mb.samples``, reused when a split keeps the samples."""
    c, length, shape, budget = inputs.config, inputs.length, inputs.shape, inputs.budget
    formed_samples = mb.samples

    def refinalize(samples, offsets):
        same = samples is formed_samples
        return batching.finalize_padded(samples, offsets, length, shape, budget, c.static_shapes, fixed_batch,
                                        lens=lens if same else None, padded=padded if same else None,
                                        targets=inputs.targets)

    mb, dropped = tail.fix_padded(mb, inputs.slots, c.dp, c.grad_accum, c.tail, refinalize, inputs.remedies)
    if mode == "bucket-shuffle":
        cost = budget.microbatch_cost(mb.tokens, mb.batch_size, mb.seqlen, target_seqlen=mb.target_seqlen)
        # the samples move once, with the layout's order (plan_epochs takes the final order)
        mb = mb.reordered(layout.balanced_shuffle(cost, inputs.slots, rng))
    if c.same_shape_per_step:
        layout.same_shape_steps(mb, inputs.slots)
    return Formed(mb, dropped)


class SequenceFormer:
    """curriculum / reverse: greedy consecutive microbatches in the input's (reversed) sorted order."""

    def form(self, inputs: EpochInputs, mode: str, rng: np.random.Generator) -> Formed:
        c = inputs.config
        lens = inputs.length[inputs.ordered]
        padded = inputs.shape(lens)
        mb = batching.form_sequence(inputs.ordered, inputs.length, inputs.shape, inputs.budget, c.static_shapes,
                                    padded, lens, inputs.targets)
        return _finish_padded(inputs, mb, mode, rng, lens=lens, padded=padded)


@dataclass
class BucketShuffleFormer:
    """bucket-shuffle: shuffle inside length buckets, greedy microbatches, cost-balanced shuffle."""

    canon_padded: np.ndarray | None = None  # shape(length[canon]), computed once for all epochs
    lens_are_padded: bool = False  # lengths >= 1 and no padding to a multiple or to edges: shape(l) == l

    def form(self, inputs: EpochInputs, mode: str, rng: np.random.Generator) -> Formed:
        c = inputs.config
        if self.canon_padded is None:
            self.canon_padded = padded_lengths(inputs.length, inputs.canon, inputs.shape)  # 2 or 4 bytes a sample
            plain = inputs.shape.pad_multiple == 1 and inputs.shape.edges is None
            self.lens_are_padded = plain and bool(len(inputs.length)) and int(inputs.length.min()) >= 1
        target_padded = inputs.targets.padded(inputs.canon) if inputs.targets is not None else None
        seq, seq_padded = batching.bucket_sequence(inputs.canon, self.canon_padded, rng, target_padded)
        # the lengths in sequence order: the padded ones themselves where equal (no random gather)
        lens = seq_padded if self.lens_are_padded else inputs.length[seq]
        mb = batching.form_sequence(seq, inputs.length, inputs.shape, inputs.budget, c.static_shapes, seq_padded,
                                    lens, inputs.targets)
        return _finish_padded(inputs, mb, mode, rng, lens=lens, padded=seq_padded)


CHUNK = 1 << 20  # samples per chunk of the chunked passes (no N-sized int64 temporaries)


def padded_lengths(length: np.ndarray, canon: np.ndarray, shape: ShapeMap) -> np.ndarray:
    """``shape(length[canon])`` as uint16 or int32 where it fits (kept for every epoch), chunk by chunk."""
    n = len(canon)
    longest = max((int(length[canon[a:a + CHUNK]].max()) for a in range(0, n, CHUNK)), default=0)
    top = int(shape(np.array([longest]))[0])  # the largest padded length: the shape map is non-decreasing
    out = np.empty(n, np.uint16 if top < 1 << 16 else np.int32 if top < 1 << 31 else np.int64)
    for a in range(0, n, CHUNK):
        out[a:a + CHUNK] = shape(length[canon[a:a + CHUNK]])
    return out


@dataclass
class RandomFormer:
    """random: random microbatches; with static shapes one batch size for all (``fixed_batch``)."""

    fixed_batch: int | None = None

    def form(self, inputs: EpochInputs, mode: str, rng: np.random.Generator) -> Formed:
        c = inputs.config
        mb, self.fixed_batch = batching.form_random(inputs.canon, inputs.length, inputs.shape, inputs.budget,
                                                    c.static_shapes, rng, inputs.targets)
        return _finish_padded(inputs, mb, mode, rng, self.fixed_batch)


class SameShapeFormer:
    """--same-shape-per-step: whole steps of one (B, T) shape; steps keep curriculum order or shuffle."""

    def form(self, inputs: EpochInputs, mode: str, rng: np.random.Generator) -> Formed:
        c = inputs.config
        seq = inputs.ordered if mode in CURRICULAR else inputs.canon[rng.permutation(len(inputs.canon))]
        return Formed(*same_shape_steps(seq, inputs.length, inputs.shape, inputs.budget, c.static_shapes,
                                        inputs.slots, (c.dp, c.grad_accum, c.tail), inputs.remedies, mode, rng))


def same_shape_steps(seq: np.ndarray, length: np.ndarray, shape: ShapeMap, budget: Budget, static: bool,
                     slots: int, layout_of: tuple[int, int, str], remedies, mode: str,
                     rng: np.random.Generator) -> tuple[Microbatches, np.ndarray]:
    """Whole steps of one (B, T) shape from the samples ``seq`` (in order), the steps kept in curriculum
    order (by their samples' mean position) or shuffled; and the ids left over (``tail``: drop, or refused).
    The one definition for an epoch formed whole and a chunk's steps."""
    dp, grad_accum, tail_mode = layout_of
    mb, dropped = batching.form_same_shape(seq, length, shape, budget, static, slots)
    if len(dropped) and tail_mode != "drop":
        raise InputError(layout.tail_message(len(seq), mb.count + slots, dp, grad_accum, remedies=remedies))
    if mb.count == 0:
        raise InputError(f"{len(seq):,} samples are fewer than the {slots:,} microbatches of one step "
                         "(dp x grad-accum); lower --dp/--grad-accum")
    nsteps = mb.count // slots
    if mode in CURRICULAR:
        where = np.empty(len(length), np.int64)
        where[seq] = np.arange(len(seq))
        step_off = mb.offsets[::slots]
        key = batching.segment_sum(where[mb.samples], step_off) / np.diff(step_off)
        step_order = np.argsort(key, kind="stable")
    else:
        step_order = rng.permutation(nsteps)
    return mb.take((step_order[:, None] * slots + np.arange(slots)[None, :]).reshape(-1)), dropped


class PackingFormer:
    """--packing: rows of --seq-len tokens (curriculum keeps order, other orders shuffle)."""

    def form(self, inputs: EpochInputs, mode: str, rng: np.random.Generator) -> Formed:
        from .packing import pack

        c = inputs.config
        seq = _start(inputs, mode)
        p = pack(inputs.length[seq], c.seq_len, max_per_row=c.max_per_row,
                 order="curriculum" if mode in CURRICULAR else "shuffle",
                 seed=int(rng.integers(1 << 62)), split_long=c.split_long)
        mb, dropped = tail.fix_packed(seq[p.item_sample], p.item_start, p.item_length, p.item_row, p.num_rows,
                                      inputs.rows_per_mb, c.seq_len, inputs.slots, c.dp, c.grad_accum, c.tail,
                                      inputs.remedies)
        if inputs.budget.attention_cost > 0:  # rows dealt so microbatches of a step cost alike (balance.py)
            mb = balance.balance_rows(mb, inputs.budget, c.dp, c.grad_accum,
                                      keep_order=mode in CURRICULAR, rng=rng)
            return Formed(mb, dropped, p.stats(), ranked=True)
        return Formed(mb, dropped, p.stats())


@dataclass
class Formers:
    """The formers of one plan (one instance each, so per-plan state carries across epochs)."""

    sequence: SequenceFormer = field(default_factory=SequenceFormer)
    bucket_shuffle: BucketShuffleFormer = field(default_factory=BucketShuffleFormer)
    random: RandomFormer = field(default_factory=RandomFormer)
    same_shape: SameShapeFormer = field(default_factory=SameShapeFormer)
    packing: PackingFormer = field(default_factory=PackingFormer)

    def for_epoch(self, config: PlanConfig, mode: str) -> Former:
        """The strategy for an epoch planned in ``mode`` (the order, or bucket-shuffle after the curriculum)."""
        if config.packing:
            return self.packing
        if config.same_shape_per_step and mode != "random":
            return self.same_shape
        if mode == "random":
            return self.random
        if mode == "bucket-shuffle":
            return self.bucket_shuffle
        return self.sequence
