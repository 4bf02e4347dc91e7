"""Phase 1: one chunk's units (microbatches, or packed rows) formed by the planner's own formers.

:func:`form_chunk` turns a :class:`~.chunks.ChunkData` into :class:`ChunkUnits`: a table of units in
the chunk's sequence order, their items (sample ids and, packed, the per-sample columns) in the same
order, and the tail candidates (the fullest units with their halves' statistics). It uses the
planner's formers (``orders``, ``batching``, ``packing.pack``, ``balance``) and leaves to phase 2 what
spans chunks: the tail, the order of the units, the ranks. A mixture's items also name each entry's
source; a replan's pieces (:class:`~.chunks.ChunkData`) start inside their samples.

Unit levels:

* ``epoch``: the chunk is the whole epoch (one chunk): the formers of :mod:`varlen_cli.plan.orders`
  form it whole (its tail, its shuffle), the plan varlen made before chunks existed; phase 2 only
  lays it out;
* ``unit``: padded microbatches (curriculum, reverse, bucket-shuffle, random) and packed rows;
  phase 2 splits the tail, orders them across chunks and cuts steps;
* ``step``: whole steps formed inside the chunk (``--same-shape-per-step``; packed plans with an
  attention cost, whose rows are dealt over rank-steps): the chunk's count is a multiple of
  dp x grad_accum (its own tail) and phase 2 only orders the steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ... import format
from ...budget import Budget, segment_sum_squares
from ...errors import UsageError
from .. import balance, batching, tail
from ..batching import Microbatches, Targets
from ..layout import PLAN_REMEDIES, Remedies
from ..orders import CURRICULAR, padded_lengths, same_shape_steps
from ..shapes import ShapeMap
from .chunks import ChunkData

PADDED_UNIT_COLUMNS = ("count", "seqlen", "batch", "tokens", "lost")
PACKED_ROW_COLUMNS = ("count", "tokens", "completed", "lost", "sumsq")
LIST_LIMIT = 10_000  # too-long ids listed per plan (more: counted, and the rule recorded)


@dataclass
class PlanContext:
    """What every chunk of a plan is formed with (the same on every worker)."""

    order: str  # the plan's --order (an epoch's mode may differ: --curriculum-epochs)
    shape: ShapeMap
    budget: Budget
    dp: int
    grad_accum: int
    static: bool
    same_shape: bool
    packing: bool
    seq_len: int | None
    max_per_row: int | None
    split_long: bool
    rows_per_mb: int | None
    tail: str
    longest_fitting: int  # samples longer than this fit no microbatch (packing: seq_len; split-long: no limit)
    fixed_batch: int | None = None  # random order: B of every microbatch (from the longest kept sample)
    remedies: Remedies = PLAN_REMEDIES  # what refusals suggest
    num_sources: int = 0  # a mixture's sources (0: one input): the items name each entry's source
    target_shape: ShapeMap | None = None  # two budgets (--max-target-tokens): the target side's shape map
    longest_target_fitting: int = 1 << 62  # two budgets: samples whose target is longer fit no microbatch

    @property
    def slots(self) -> int:
        return self.dp * self.grad_accum

    @property
    def two_sided(self) -> bool:
        return self.target_shape is not None

    def targets(self, chunk: ChunkData) -> Targets | None:
        """The chunk's target side (two budgets), else None."""
        return Targets(chunk.target, self.target_shape) if self.two_sided else None

    def too_long(self, chunk: ChunkData) -> np.ndarray:
        """Mask of the chunk's samples that fit no microbatch (too long a source, or a target, under two budgets)."""
        out = chunk.length > self.longest_fitting
        if self.two_sided:
            out |= chunk.target > self.longest_target_fitting
        return out

    @property
    def unit_columns(self) -> tuple:
        """The columns of a padded unit (two budgets: ``tseqlen``, the padded T_target, too)."""
        return PADDED_UNIT_COLUMNS + (("tseqlen",) if self.two_sided else ())

    @property
    def ranked(self) -> bool:
        """Packed rows dealt over rank-steps inside the chunk (attention-balanced packing)."""
        return self.packing and self.budget.attention_cost > 0

    def level(self, mode: str) -> str:
        if self.ranked or (self.same_shape and mode != "random" and not self.packing):
            return "step"
        return "unit"


@dataclass
class ChunkUnits:
    """One chunk's units in sequence order (see the module docstring)."""

    epoch: int
    chunk: int
    level: str
    units: dict  # column -> per-unit array
    offsets: np.ndarray  # int64, units + 1: items of unit u are items[offsets[u]:offsets[u + 1]]
    items: dict  # "ids" (+ packed: "item_length", "item_start", "item_row")
    id_base: int | None = None  # items["ids"] are positions: the sample id is id_base + position
    candidates: dict = field(default_factory=dict)
    long_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    long_sources: np.ndarray | None = None  # a mixture: the source of each listed long id
    num_long: int = 0
    longest: int = 0
    shortest: int = 0
    longest_target: int = 0
    tail_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    tail_sources: np.ndarray | None = None  # a mixture: the source of each tail id
    source_tokens: list | None = None  # a mixture: the tokens of each source's entries in the chunk's units
    packing: dict | None = None
    ranked: bool = False  # (step, rank, micro) order already: the layout keeps the ranks
    fixed_batch: int | None = None  # random order: the batch size the former chose

    @property
    def count(self) -> int:
        return len(self.offsets) - 1


def _kept(chunk: ChunkData, ctx: PlanContext, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Local positions the epoch starts from (canonical or (reversed) sorted order), long ones out,
    and the mask of the long ones."""
    too_long = ctx.too_long(chunk)
    if mode in CURRICULAR or chunk.first_id is not None or chunk.in_order:
        seq = np.arange(chunk.n, dtype=np.int64)  # rows already in the epoch's order (chunks.ChunkSource, sources)
    else:
        from ..reader import canonical_order

        seq = canonical_order(chunk.ids).astype(np.int64)
    if too_long.any():
        seq = seq[~too_long[seq]]
    return seq, too_long


def form_chunk(chunk: ChunkData, ctx: PlanContext, mode: str, epoch: int, rng: np.random.Generator,
               whole: bool, config=None) -> ChunkUnits:
    """The chunk's units for an epoch planned in ``mode`` (see the module docstring); ``whole``: the
    chunk is the whole epoch (``config``: the plan's PlanConfig, for the formers of an epoch formed whole)."""
    seq, too_long = _kept(chunk, ctx, mode)
    if whole:  # the whole input: its too-long samples are the plan's (the error before any forming)
        from ..cost_model import too_long_error

        error = too_long_error(config, ctx.budget, ctx.remedies, len(chunk.length) - len(seq), chunk.n,
                               int(chunk.length.max()), int(chunk.length.min()), _longest_target(chunk))
        if error is not None:
            raise error
    if not len(seq):
        out = _empty(ctx, mode)
    elif whole:
        out = _whole_epoch(chunk, ctx, mode, seq, rng, config)
    elif ctx.packing:
        out = _packed(chunk, ctx, mode, seq, rng)
    elif ctx.level(mode) == "step":
        out = _same_shape(chunk, ctx, mode, seq, rng)
    else:
        out = _padded(chunk, ctx, mode, seq, rng)
    out.epoch, out.chunk = epoch, chunk.index
    out.num_long = int(np.count_nonzero(too_long))
    out.longest = int(chunk.length.max()) if chunk.n else 0
    out.shortest = int(chunk.length.min()) if chunk.n else 0
    out.longest_target = _longest_target(chunk)
    if out.num_long:  # listed up to LIST_LIMIT; a mixture's all (the check of its copies counts each)
        limit = None if ctx.num_sources else LIST_LIMIT
        out.long_ids = chunk.ids[np.flatnonzero(too_long)][:limit]
        if chunk.source is not None:
            out.long_sources = chunk.source[np.flatnonzero(too_long)][:limit]
    if ctx.num_sources:
        _source_totals(out, chunk, ctx)
    return out


def _longest_target(chunk: ChunkData) -> int:
    return int(chunk.target.max()) if chunk.target is not None and chunk.n else 0


def _source_totals(out: ChunkUnits, chunk: ChunkData, ctx: PlanContext) -> None:
    """A mixture chunk's tokens per source (its units' entries)."""
    items = out.items
    tokens = items["item_length"] if ctx.packing else items["sample_length"]
    per_source = np.bincount(items["source"], weights=tokens, minlength=ctx.num_sources)
    out.source_tokens = per_source.astype(np.int64).tolist()


def _empty(ctx: PlanContext, mode: str) -> ChunkUnits:
    """A chunk whose samples are all too long (phase 2 reports them, or they are dropped)."""
    if ctx.packing and ctx.level(mode) == "unit":
        cols = PACKED_ROW_COLUMNS
        items = {"ids": np.zeros(0, np.int64), "sample_length": np.zeros(0, np.int32),
                 "item_length": np.zeros(0, np.int32), "item_start": np.zeros(0, np.int32)}
    else:
        cols = ctx.unit_columns if not ctx.packing else ("count", "seqlen", "batch", "tokens", "completed", "lost",
                                                             "rows", "sumsq")
        items = {"ids": np.zeros(0, np.int64), "sample_length": np.zeros(0, np.int32)}
        if ctx.packing:
            items.update(item_length=np.zeros(0, np.int32), item_start=np.zeros(0, np.int32),
                         item_row=np.zeros(0, np.int32))
    if ctx.num_sources:
        items["source"] = np.zeros(0, np.int32)
    units = {name: np.zeros(0, np.float64 if name == "sumsq" else np.int64) for name in cols}
    out = ChunkUnits(0, 0, ctx.level(mode), units, np.zeros(1, np.int64), items,
                     candidates={"index": np.zeros(0, np.int64), "complete": True})
    out.ranked = ctx.ranked
    if ctx.packing:
        out.packing = {"rows": 0, "items": 0, "tokens": 0, "split_samples": 0, "samples_per_row_max": 0}
    return out


# -- one chunk: the epoch formed whole -----------------------------------------------------------------
def _whole_epoch(chunk: ChunkData, ctx: PlanContext, mode: str, seq: np.ndarray, rng, config) -> ChunkUnits:
    """The epoch formed whole by ``orders.Formers`` (tail and shuffle included)."""
    from ..orders import EpochInputs, Formers

    ordered = seq if mode in CURRICULAR else None
    inputs = EpochInputs(config, chunk.length, ctx.shape, ctx.budget, ctx.slots, ordered, seq, ctx.rows_per_mb,
                         ctx.remedies, ctx.targets(chunk))
    formers = Formers()
    formed = formers.for_epoch(config, mode).form(inputs, mode, rng)
    mb = formed.mb
    if mb.samples is None:  # a deferred reorder (bucket-shuffle): gather the samples once
        mb = mb.take(np.arange(mb.count))
    items, id_base = _ids(chunk, mb.samples)
    if ctx.packing:
        units = _packed_mb_units(mb, chunk)
        items.update(item_length=mb.item_length.astype(np.int32),
                     item_start=chunk.starts(mb.samples, mb.item_start).astype(np.int32),
                     item_row=mb.item_row.astype(np.int32))
        info = dict(formed.packing_stats or {})
    else:
        units = _padded_units(mb, chunk.length, chunk.n > 0 and int(chunk.length.min()) > 0, chunk.target)
        info = None
    out = ChunkUnits(0, 0, "epoch", units, mb.offsets, items, id_base, packing=info)
    _tail(out, chunk, formed.dropped)
    out.ranked = bool(formed.ranked)
    out.fixed_batch = formers.random.fixed_batch
    return out


def _tail(out: ChunkUnits, chunk: ChunkData, dropped: np.ndarray) -> None:
    """The ids (and a mixture's sources) of the positions the chunk's own tail dropped."""
    out.tail_ids = chunk.ids[dropped] if len(dropped) else np.zeros(0, np.int64)
    if chunk.source is not None:
        out.tail_sources = chunk.source[dropped] if len(dropped) else np.zeros(0, np.int32)


def _packed_mb_units(mb: Microbatches, chunk: ChunkData) -> dict:
    """Per packed microbatch: samples, shape, tokens, completed samples, loss-less tokens, rows, sum of l^2."""
    target = chunk.target
    final = chunk.starts(mb.samples, mb.item_start) + mb.item_length == chunk.whole_length(mb.samples)
    empty = not len(mb.samples)
    return {"count": np.diff(mb.offsets).astype(np.int32), "seqlen": mb.seqlen.astype(np.int32),
            "batch": mb.batch_size.astype(np.int32), "tokens": mb.tokens.astype(np.int64),
            "completed": batching.segment_sum(final.astype(np.int32), mb.offsets).astype(np.int32),
            "lost": (batching.segment_sum(((mb.item_length > 0) & final).astype(np.int32), mb.offsets) if target is None
                     else mb.tokens - batching.segment_sum(target[mb.samples], mb.offsets)).astype(np.int32),
            "rows": np.zeros(mb.count, np.int32) if empty else
            (batching.segment_max(mb.item_row, mb.offsets) + 1).astype(np.int32),
            "sumsq": segment_sum_squares(mb.item_length, mb.offsets)}


# -- padded ----------------------------------------------------------------------------------------
def _padded(chunk: ChunkData, ctx: PlanContext, mode: str, seq: np.ndarray, rng) -> ChunkUnits:
    length, shape, budget, targets = chunk.length, ctx.shape, ctx.budget, ctx.targets(chunk)
    if mode == "random":
        mb = _random(seq, length, ctx, rng, targets)
    elif mode == "bucket-shuffle":
        bseq, bpadded = batching.bucket_sequence(seq, padded_lengths(length, seq, shape), rng,
                                                 targets.padded(seq) if targets is not None else None)
        plain = shape.pad_multiple == 1 and shape.edges is None and len(seq) and int(length[seq].min()) >= 1
        lens = bpadded if plain else length[bseq]  # the padded lengths are the lengths: no random gather
        mb = batching.form_sequence(bseq, length, shape, budget, ctx.static, bpadded, lens, targets)
        mb = mb.take(rng.permutation(mb.count))  # the chunk's microbatches shuffled (phase 2 interleaves)
    else:
        lens = length[seq]
        mb = batching.form_sequence(seq, length, shape, budget, ctx.static, shape(lens), lens, targets)
    units = _padded_units(mb, length, chunk.n > 0 and int(length.min()) > 0, chunk.target)
    cands = _padded_candidates(mb, length, ctx, chunk.target)
    return ChunkUnits(0, 0, "unit", units, mb.offsets, *_ids(chunk, mb.samples), candidates=cands)


def _ids(chunk: ChunkData, positions: np.ndarray) -> tuple[dict, int | None]:
    """The items' sample ids (the positions themselves, and the chunk's first id, when the chunk's ids
    are a range: no gather), whole sample lengths and target lengths (for the plan's own check)."""
    items = {"sample_length": chunk.whole_length(positions).astype(np.int32)}
    if chunk.target is not None:  # analyze --target-length: the loss tokens, for the plan's own check
        items["sample_target"] = chunk.target[positions].astype(np.int32)
    if chunk.source is not None:  # a mixture: each entry's source
        items["source"] = chunk.source[positions].astype(np.int32)
    if chunk.first_id is not None:
        return {"ids": positions, **items}, chunk.first_id
    return {"ids": chunk.ids[positions], **items}, None


def _random(seq: np.ndarray, length: np.ndarray, ctx: PlanContext, rng, targets: Targets | None = None) -> Microbatches:
    """The random baseline inside a chunk: a random permutation cut into batches of the plan's fixed B."""
    perm = seq[rng.permutation(len(seq))]
    b = int(ctx.fixed_batch)
    off = np.append(np.arange(0, len(perm), b, dtype=np.int64), len(perm)).astype(np.int64)
    return batching.finalize_padded(perm, off, length, ctx.shape, ctx.budget, ctx.static, fixed_batch=b,
                                    targets=targets)


def _padded_units(mb: Microbatches, length: np.ndarray, all_nonempty: bool = False,
                  target: np.ndarray | None = None) -> dict:
    """Per padded microbatch: samples, shape, tokens and the tokens without a loss target (``lost``:
    one per non-empty sample, or the tokens beyond the samples' ``target_length``)."""
    counts = np.diff(mb.offsets)
    if mb.count and int(mb.seqlen.max()) > format.INT32_MAX:  # a padded T over int32 (e.g. a huge --pad-multiple)
        raise UsageError(f"a microbatch would have seqlen {int(mb.seqlen.max()):,}, more than plans store "
                         f"({format.INT32_MAX:,}, int32); lower --pad-multiple or --max-tokens")
    if target is not None:
        lost = mb.tokens - batching.segment_sum(target[mb.samples], mb.offsets) if len(mb.samples) else \
            np.zeros(mb.count, np.int64)
    elif all_nonempty:  # no empty sample: every entry has a loss target to lose (no gather)
        lost = counts
    elif len(mb.samples):
        lost = batching.segment_sum((length[mb.samples] > 0).astype(np.int32), mb.offsets)
    else:
        lost = np.zeros(mb.count, np.int64)
    out = {"count": counts.astype(np.int32), "seqlen": mb.seqlen.astype(np.int32),
           "batch": mb.batch_size.astype(np.int32), "tokens": mb.tokens.astype(np.int64),
           "lost": np.asarray(lost).astype(np.int32)}
    if mb.target_seqlen is not None:  # two budgets: the padded T_target
        if mb.count and int(mb.target_seqlen.max()) > format.INT32_MAX:
            raise UsageError(f"a microbatch would have target_seqlen {int(mb.target_seqlen.max()):,}, more than plans "
                             f"store ({format.INT32_MAX:,}, int32); lower --pad-multiple or --max-target-tokens")
        out["tseqlen"] = mb.target_seqlen.astype(np.int32)
    return out


def _padded_candidates(mb: Microbatches, length: np.ndarray, ctx: PlanContext,
                       target: np.ndarray | None = None) -> dict:
    """The chunk's tail candidates with the statistics of their halves (what a split makes)."""
    counts = np.diff(mb.offsets)
    pick, complete = tail.top_candidates(counts, ctx.slots)
    out = {"index": pick, "complete": complete}
    if not len(pick):
        return out
    sub = mb.take(pick)
    sc = np.diff(sub.offsets)
    mids = sub.offsets[:-1] + sc // 2
    halves_off = np.empty(2 * len(pick) + 1, np.int64)
    halves_off[0:-1:2] = sub.offsets[:-1]
    halves_off[1::2] = mids
    halves_off[-1] = sub.offsets[-1]
    halves = batching.finalize_padded(sub.samples, halves_off, length, ctx.shape, ctx.budget, ctx.static,
                                      ctx.fixed_batch, targets=Targets(target, ctx.target_shape) if ctx.two_sided
                                      else None)
    for name, values in _padded_units(halves, length, target=target).items():
        out["half_" + name] = values
    if complete:  # the rare multi-round tail needs every splittable unit's lengths (phase 2)
        out["lengths"] = length[sub.samples].astype(np.int64)
        out["offsets"] = sub.offsets
        if target is not None:
            out["target"] = target[sub.samples].astype(np.int64)
    return out


# -- same shape per step -----------------------------------------------------------------------------
def _same_shape(chunk: ChunkData, ctx: PlanContext, mode: str, seq: np.ndarray, rng) -> ChunkUnits:
    length = chunk.length
    start = seq if mode in CURRICULAR else seq[rng.permutation(len(seq))]
    mb, dropped = same_shape_steps(start, length, ctx.shape, ctx.budget, ctx.static, ctx.slots,
                                   (ctx.dp, ctx.grad_accum, ctx.tail), ctx.remedies, mode, rng)
    out = ChunkUnits(0, 0, "step", _padded_units(mb, length, target=chunk.target), mb.offsets,
                     *_ids(chunk, mb.samples))
    _tail(out, chunk, dropped)
    return out


# -- packed ----------------------------------------------------------------------------------------
def _packed(chunk: ChunkData, ctx: PlanContext, mode: str, seq: np.ndarray, rng) -> ChunkUnits:
    from ..packing import pack

    p = pack(chunk.length[seq], ctx.seq_len, max_per_row=ctx.max_per_row,
             order="curriculum" if mode in CURRICULAR else "shuffle", seed=int(rng.integers(1 << 62)),
             split_long=ctx.split_long)
    samples = seq[p.item_sample]
    info = {"rows": int(p.num_rows), "items": int(p.num_items), "tokens": int(p.tokens),
            "split_samples": int(p.num_split),
            "samples_per_row_max": int(p.samples_per_row().max()) if p.num_rows else 0}
    if ctx.ranked:
        return _packed_ranked(chunk, ctx, mode, p, samples, rng, info)
    row_off = p.row_offsets()
    item_start = chunk.starts(samples, p.item_start)
    final = item_start + p.item_length == chunk.whole_length(samples)
    tokens = p.row_tokens().astype(np.int64)
    lost = (batching.segment_sum(((p.item_length > 0) & final).astype(np.int32), row_off) if chunk.target is None
            else tokens - batching.segment_sum(chunk.target[samples], row_off))
    units = {"count": np.diff(row_off).astype(np.int32), "tokens": tokens,
             "completed": batching.segment_sum(final.astype(np.int32), row_off).astype(np.int32),
             "lost": lost.astype(np.int32),
             "sumsq": segment_sum_squares(p.item_length, row_off)}
    items, id_base = _ids(chunk, samples)
    items.update(item_length=p.item_length.astype(np.int32), item_start=item_start.astype(np.int32), final=final)
    if chunk.target is not None:
        items["target"] = chunk.target[samples]
    out = ChunkUnits(0, 0, "unit", units, row_off, items, id_base, packing=info)
    out.candidates = _packed_candidates(units, row_off, items, ctx)
    items.pop("final")
    items.pop("target", None)
    return out


def _packed_candidates(units: dict, row_off: np.ndarray, items: dict, ctx: PlanContext) -> dict:
    """The fullest rows with their halves' tokens, completed samples and loss targets."""
    counts = units["count"].astype(np.int64)
    pick, complete = tail.top_candidates(counts, ctx.slots)
    out = {"index": pick, "complete": complete}
    if not len(pick):
        return out
    starts, cnt = row_off[pick], counts[pick]
    idx = batching.segment_gather(starts, cnt, np.concatenate([[0], np.cumsum(cnt)]))
    local = np.concatenate([[0], np.cumsum(cnt)])
    # halves inside the gathered items: [local[i], local[i] + cnt[i] // 2), [.., local[i + 1])
    h_off = np.empty(2 * len(pick) + 1, np.int64)
    h_off[0:-1:2] = local[:-1]
    h_off[1::2] = local[:-1] + cnt // 2
    h_off[-1] = local[-1]
    length, final = items["item_length"][idx], items["final"][idx]
    target = items["target"][idx] if "target" in items else None
    out["half_count"] = np.diff(h_off).astype(np.int32)
    out["half_tokens"] = batching.segment_sum(length, h_off).astype(np.int64)
    out["half_completed"] = batching.segment_sum(final.astype(np.int32), h_off).astype(np.int32)
    out["half_lost"] = (batching.segment_sum(((length > 0) & final).astype(np.int32), h_off) if target is None
                        else out["half_tokens"] - batching.segment_sum(target, h_off)).astype(np.int32)
    out["half_sumsq"] = segment_sum_squares(length, h_off)
    if complete:  # the rare multi-round tail needs every splittable row's items (phase 2)
        out.update(lengths=length.astype(np.int64), final=final, offsets=local.astype(np.int64))
        if target is not None:
            out["target"] = target.astype(np.int64)
    return out


def _packed_ranked(chunk: ChunkData, ctx: PlanContext, mode: str, p, samples: np.ndarray, rng,
                   info: dict) -> ChunkUnits:
    """Attention-balanced packing: the chunk's rows spread over whole steps and dealt over rank-steps."""
    mb, dropped = tail.fix_packed(samples, p.item_start, p.item_length, p.item_row, p.num_rows, ctx.rows_per_mb,
                                  ctx.seq_len, ctx.slots, ctx.dp, ctx.grad_accum, ctx.tail, ctx.remedies)
    mb = balance.balance_rows(mb, ctx.budget, ctx.dp, ctx.grad_accum, keep_order=mode in CURRICULAR, rng=rng)
    units = _packed_mb_units(mb, chunk)
    items, id_base = _ids(chunk, mb.samples)
    items.update(item_length=mb.item_length.astype(np.int32),
                 item_start=chunk.starts(mb.samples, mb.item_start).astype(np.int32),
                 item_row=mb.item_row.astype(np.int32))
    out = ChunkUnits(0, 0, "step", units, mb.offsets, items, id_base, packing=info, ranked=True)
    _tail(out, chunk, dropped)
    return out
