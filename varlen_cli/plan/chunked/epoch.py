"""Phase 2: one epoch's steps and ranks, from its chunks' unit tables (rank 0; no sample is read).

:func:`lay_out` puts the chunks' units in one sequence (:class:`Units`, chunk after chunk), fixes
the tail (the rule of :mod:`varlen_cli.plan.tail`), groups packed rows into microbatches, orders the
units across chunks (:func:`cross_chunk_order`) and hands the microbatches, a block of whole steps at a
time, to the layout (``layout.layout_epoch``: ranks by LPT; compile warm-up and ``--schedule`` on the
whole epoch). The result, :class:`EpochRows`, is the unit of every plan row in (step, rank,
micro) order: 4-8 bytes a row besides the units' own columns (12-16 bytes a unit in the dtypes
their values need, :class:`Units`), so 100M+ microbatches fit in a few GB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ...budget import segment_sum_squares
from .. import batching, layout, tail
from ..batching import Microbatches
from ..orders import CURRICULAR
from .form import PlanContext

WINDOW_STEPS = 64  # bucket-shuffle: microbatches sorted by cost inside windows of this many steps
BLOCK_ROWS = 1 << 20  # plan rows laid out together (whole steps)


def _index_dtype(n: int):
    return np.int32 if n < 1 << 31 else np.int64


# tokens without a loss target: below 0 where a microbatch's targets outnumber its tokens (a seq2seq
# target_length, the decoder's tokens, counted apart from the source's length)
SIGNED_COLUMNS = ("lost",)


def _storage_dtype(top) -> np.dtype:
    """The smallest dtype that holds a non-negative column whose largest value is ``top``."""
    if isinstance(top, float):
        return np.dtype(np.float64)
    for dtype in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


def _logical_dtype(name: str, top) -> np.dtype:
    """The dtype a column is handed out in (what the layout and the writer compute with): int32, tokens
    int64 past int32, sumsq float64."""
    if name == "sumsq" or isinstance(top, float):
        return np.dtype(np.float64)
    return np.dtype(np.int64 if top >= 1 << 31 else np.int32)


class Units:
    """An epoch's units: the chunks' columns one after another, pieces of split units appended, and
    the sequence of unit ids (chunk after chunk, a split unit's pieces in its place).

    Columns are stored in the smallest dtype that holds them and handed out (``take``) in their
    logical dtype (``logical``; int32 where absent); a unit's chunk is found from ``unit_start``
    unless ``chunk`` is a column. Pieces (``extra``) are few and kept in the logical dtypes."""

    def __init__(self, cols: dict, per_chunk: np.ndarray, const: dict | None = None,
                 unit_start: np.ndarray | None = None, logical: dict | None = None):
        self.cols = cols
        self.m = len(cols["count"])
        self.per_chunk = per_chunk.astype(np.int64)  # units of each chunk in the sequence
        self.unit_start = unit_start  # first unit id of each chunk (when "chunk" is not a column)
        self.logical = logical or {}
        self.extra: dict | None = None
        self.seq: np.ndarray | None = None  # None: unit i is the i-th of the sequence
        self.const = const or {}  # columns with one value (packed rows: seqlen, batch)
        self.alias: dict = {}  # a column that is another one (padded: completed is count)

    def __len__(self) -> int:
        return self.m if self.seq is None else len(self.seq)

    def ids(self, positions: np.ndarray) -> np.ndarray:
        return positions if self.seq is None else self.seq[positions]

    def _stored(self) -> list:
        return list(self.cols) + (["chunk"] if "chunk" not in self.cols else [])

    def _main(self, name: str, idx: np.ndarray) -> np.ndarray:
        """Column ``name`` of unit ids ``idx`` (all < m), in its logical dtype."""
        if name == "chunk" and "chunk" not in self.cols:
            return np.searchsorted(self.unit_start, idx, side="right") - 1
        values = self.cols[name][idx]
        return values.astype(self._logical_of(name)) if values.dtype.kind == "u" else values

    def take(self, name: str, idx: np.ndarray) -> np.ndarray:
        """Column ``name`` of unit ids ``idx``."""
        name = self.alias.get(name, name)
        if name in self.const:
            return np.full(len(idx), self.const[name], np.int64)
        if self.extra is None:
            return self._main(name, idx)
        main = idx < self.m
        first = self._main(name, idx[main])
        rest = self.extra[name][idx[~main] - self.m]
        out = np.empty(len(idx), np.result_type(first.dtype, rest.dtype))
        out[main] = first
        out[~main] = rest
        return out

    def put(self, name: str, ids: np.ndarray, values: np.ndarray) -> None:
        """Set column ``name`` of unit ids ``ids`` (< m) to ``values`` (the column widened if they need it)."""
        col = self.cols[name]
        if len(values) and col.dtype.kind == "u" and int(values.max()) > np.iinfo(col.dtype).max:
            col = self.cols[name] = col.astype(self.logical.get(name, np.dtype(np.int32)))
        col[ids] = values

    def apply(self, t: tail.Tail) -> None:
        """Replace units by their pieces (appended; the sequence takes them in place) or drop units."""
        seq = self.seq if self.seq is not None else np.arange(self.m, dtype=_index_dtype(self.m + (1 << 20)))
        chunk_of_pos = self.take("chunk", seq[t.positions]) if len(t.positions) else None
        if len(t.dropped):
            chunks = self.take("chunk", seq[t.dropped])
            keep = np.ones(len(seq), bool)
            keep[t.dropped] = False
            self.seq = seq[keep]
            self.per_chunk -= np.bincount(chunks, minlength=len(self.per_chunk))
            return
        if not len(t.positions):
            return
        units = seq[t.positions]
        pieces = dict(t.pieces)
        owner = np.repeat(np.arange(len(units)), t.piece_counts)
        pieces["chunk"] = self.take("chunk", units)[owner]
        pieces["item_lo"] = self.take("item_lo", units)[owner] + pieces.pop("item_offset")
        first_new = self.m + (len(self.extra["count"]) if self.extra is not None else 0)
        new_ids = first_new + np.arange(len(owner))
        add = {name: np.asarray(pieces[name]).astype(self._logical_of(name)) for name in self._stored()}
        self.extra = add if self.extra is None else {n: np.concatenate([self.extra[n], add[n]]) for n in add}
        self.seq = _spliced(seq, t.positions, t.piece_counts, new_ids)
        self.per_chunk += np.bincount(chunk_of_pos, weights=t.piece_counts - 1,
                                      minlength=len(self.per_chunk)).astype(np.int64)

    def _logical_of(self, name: str) -> np.dtype:
        if name == "chunk":
            return np.dtype(np.int64)
        if name in self.logical:
            return self.logical[name]
        col = self.cols[name]
        return col.dtype if col.dtype.kind != "u" else np.dtype(np.int32)


def _spliced(seq: np.ndarray, positions: np.ndarray, counts: np.ndarray, new_ids: np.ndarray) -> np.ndarray:
    """``seq`` with the unit at each of ``positions`` (ascending) replaced by its ``counts`` pieces, whose ids
    are ``new_ids`` in order: copied a run at a time (few positions; no N-sized temporary)."""
    out = np.empty(len(seq) + int(np.sum(counts - 1)), _index_dtype(max(len(seq), int(new_ids.max()) + 1)))
    src = dst = used = 0
    for p, c in zip(positions.tolist(), counts.tolist()):
        out[dst:dst + p - src] = seq[src:p]
        dst += p - src
        out[dst:dst + c] = new_ids[used:used + c]
        dst, used, src = dst + c, used + c, p + 1
    out[dst:] = seq[src:]
    return out


@dataclass
class EpochRows:
    """An epoch's plan rows in (step, rank, micro) order: ``order[i]`` is the unit of row ``i``
    (columns through ``units.take``); packed microbatches formed here from chunk rows keep those rows
    (``rows``) to give each item its row inside the microbatch."""

    mode: str
    units: Units
    order: np.ndarray
    warmup_steps: int = 0
    warmup_missing: int = 0
    schedule_order: dict | None = None
    tail_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    dropped_units: dict | None = None  # --tail drop in phase 2: chunk, item_lo, count of each dropped unit
    item_rows: bool = False  # the chunk files hold each item's row inside its microbatch
    rows: Units | None = None  # packed microbatches of R > 1 chunk rows: the rows (row_lo/rows index them)
    row_seq_start: np.ndarray | None = None  # first sequence position of each chunk's rows
    budget: object = None
    parts: list | None = None  # each rank's positions [lo, hi) of a shared layout (lay_out's ``share``)

    @property
    def count(self) -> int:
        return len(self.order)

    def column(self, name: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Column ``name`` of plan rows ``[lo, hi)`` (``cost``: the microbatch's cost)."""
        idx = self.order[lo:hi]
        if name == "cost":
            return _cost_of(self.units, idx, self.budget)
        return self.units.take(name, idx)


def _cost_of(units: Units, idx: np.ndarray, budget) -> np.ndarray:
    """The cost ranks are balanced on (``Budget.microbatch_cost``), of the units ``idx``."""
    if budget.two_sided:
        return budget.microbatch_cost(None, units.take("batch", idx), units.take("seqlen", idx),
                                      target_seqlen=units.take("tseqlen", idx))
    if not budget.packed:
        return np.asarray(budget.cost(units.take("batch", idx), units.take("seqlen", idx)), dtype=np.float64)
    sumsq = units.take("sumsq", idx) if budget.needs_segment_lengths else None
    return budget.microbatch_cost(units.take("tokens", idx), None, None, sumsq)


def _column_max(t, name: str):
    """The largest value of a chunk's unit column (its header's, else read)."""
    header = getattr(t, "header", None) or {}
    if name in header.get("max", {}):
        return header["max"][name]
    values = np.asarray(t.units[name])
    if not len(values):
        return 0
    return float(values.max()) if values.dtype.kind == "f" else int(values.max())


def _concat(tables: list, columns, const: dict | None = None) -> tuple[Units, np.ndarray]:
    """Units of all chunks in chunk order, and each chunk's first unit. The columns are allocated once,
    in the smallest dtype their values need, and filled a chunk's column at a time (a chunk table
    reads its columns from its file when asked)."""
    counts = np.array([t.count for t in tables], np.int64)
    unit_start = np.concatenate([[0], np.cumsum(counts)])
    m = int(unit_start[-1])
    cols, logical = {}, {}
    for name in columns:
        top = max((_column_max(t, name) for t in tables if t.count), default=0)
        logical[name] = _logical_dtype(name, top)
        narrow = logical[name].kind != "f" and name not in SIGNED_COLUMNS
        cols[name] = np.empty(m, _storage_dtype(top) if narrow else logical[name])
    last_lo = max((int(t.header["items"]) if hasattr(t, "header") else int(t.offsets[-1]) for t in tables), default=0)
    cols["item_lo"] = np.empty(m, _index_dtype(last_lo + 1))
    for k, t in enumerate(tables):
        a, b = int(unit_start[k]), int(unit_start[k + 1])
        if a == b:
            continue
        units = t.units
        for name in columns:
            cols[name][a:b] = units[name]
        cols["item_lo"][a:b] = t.offsets[:-1]
        # the tail reads its candidates' counts only
        t.candidates["count"] = cols["count"][a + np.asarray(t.candidates.get("index", []), np.int64)]
    return Units(cols, counts, const, unit_start=unit_start, logical=logical), unit_start


# -- the order across chunks -----------------------------------------------------------------------
def interleave(per_chunk: np.ndarray, rng: np.random.Generator, lo: int = 0, hi: int | None = None):
    """A uniformly random interleaving of the chunks' sequences, drawn a block of :data:`BLOCK_ROWS`
    positions at a time; yields, for positions ``lo`` to ``hi`` (default: all), ``(first position,
    label, rank of the unit inside its chunk)`` a block at a time.

    The units each block takes from each chunk are drawn first, block after block (a multivariate
    hypergeometric draw from what the chunks have left: cheap, the same on every rank), then the
    labels of each block are shuffled by a stream of its own, so a rank draws the labels of its own
    blocks only and nothing N-sized; together, a uniformly random order of the multiset of labels.
    Any range gives its positions what the whole interleaving gives them."""
    per_chunk = np.asarray(per_chunk, np.int64)
    k, total = len(per_chunk), int(per_chunk.sum())
    hi = total if hi is None else hi
    starts = list(range(0, total, BLOCK_ROWS))
    counts = np.zeros((len(starts), k), np.int64)
    if k == 1:  # one chunk: its sequence (no draws: the order of the epoch formed whole)
        counts[:, 0] = [min(BLOCK_ROWS, total - a) for a in starts]
        seeds = np.zeros(len(starts), np.int64)
    else:
        left = per_chunk.copy()
        for b, a in enumerate(starts):
            counts[b] = rng.multivariate_hypergeometric(left, min(BLOCK_ROWS, total - a))
            left -= counts[b]
        seeds = rng.integers(0, np.iinfo(np.int64).max, len(starts))
    before = np.cumsum(counts, axis=0) - counts  # each chunk's units in the blocks before
    dtype = np.int16 if k < 1 << 15 else np.int32
    blocks = range(lo // BLOCK_ROWS, -(-hi // BLOCK_ROWS)) if hi > lo else range(0)
    for b in blocks:
        first = starts[b]
        labels = np.repeat(np.arange(k, dtype=dtype), counts[b])
        if k > 1:
            np.random.default_rng(int(seeds[b])).shuffle(labels)
        a, z = max(lo, first) - first, min(hi, first + len(labels)) - first
        seen = before[b] + np.bincount(labels[:a], minlength=k)
        block = labels[a:z].astype(np.int64)
        order = np.argsort(block, kind="stable")
        sb = block[order]
        at = np.searchsorted(sb, np.arange(k), side="left")
        rank = np.empty(len(block), np.int64)
        rank[order] = seen[sb] + (np.arange(len(sb)) - at[sb])
        yield first + a, block, rank


def windowed_steps(seq: np.ndarray, cost: np.ndarray, slots: int, draws: np.ndarray) -> np.ndarray:
    """Bucket-shuffle balance of a block of whole windows: sorted by cost inside windows of WINDOW_STEPS
    steps, cut into steps, the steps shuffled inside their window by ``draws`` (one uniform draw a step;
    the ranks of a step finish together)."""
    m = len(seq)
    window = np.arange(m) // (WINDOW_STEPS * slots)
    key = np.lexsort((cost, window))
    seq = seq[key]
    steps = m // slots
    step_order = np.lexsort((draws[:steps], np.arange(steps) // WINDOW_STEPS))
    return seq.reshape(steps, slots)[step_order].reshape(-1)


def window_block(slots: int) -> int:
    """Plan rows that bucket-shuffle's windows are sorted in together (whole windows)."""
    return WINDOW_STEPS * slots * max(1, BLOCK_ROWS // (WINDOW_STEPS * slots))


def cross_chunk_order(mode: str, units: Units, slots: int, rng, whole_steps: bool, cost_of, lo: int = 0,
                      hi: int | None = None) -> np.ndarray:
    """Unit ids of the epoch in step order: curriculum keeps the chunks one after another; other orders
    take a random interleaving (of whole steps for step-level chunks); bucket-shuffle then its windows.
    Only positions ``[lo, hi)`` (whole blocks of :func:`split_block`) are filled: every rank of a shared
    layout draws the whole epoch's random numbers and uses those of its positions."""
    n = len(units)
    hi = n if hi is None else hi
    if mode in CURRICULAR:
        return units.ids(np.arange(n, dtype=_index_dtype(n)))
    seq_start = np.concatenate([[0], np.cumsum(units.per_chunk)])
    seq = np.zeros(n, _index_dtype(units.m + (len(units.extra["count"]) if units.extra else 0) + 1))
    if whole_steps:
        for a, label, rank in interleave(units.per_chunk // slots, rng, lo // slots, hi // slots):
            step_first = seq_start[label] + rank * slots
            seq[a * slots:(a + len(label)) * slots] = units.ids(
                (step_first[:, None] + np.arange(slots)[None, :]).reshape(-1))
        return seq
    for a, label, rank in interleave(units.per_chunk, rng, lo, hi):
        seq[a:a + len(label)] = units.ids(seq_start[label] + rank)
    if mode == "bucket-shuffle":
        block = window_block(slots)
        step_at = np.concatenate([[0], np.cumsum([min(block, n - a) // slots for a in range(0, n, block)])])
        draws = rng.random(int(step_at[-1]))  # each block's draws, in block order (one stream)
        for a in range(lo, hi, block):
            part = seq[a:a + block]
            first = int(step_at[a // block])
            seq[a:a + block] = windowed_steps(part, cost_of(part), slots, draws[first:])
    return seq


def rank_block(slots: int, n: int, whole_epoch: bool) -> int:
    """Plan rows laid out together by ``layout.layout_epoch`` (whole steps; the whole epoch with a
    compile warm-up or a schedule, which look across steps)."""
    return max(n if whole_epoch else slots * max(1, BLOCK_ROWS // slots), 1)


def split_block(slots: int, n: int, whole_epoch: bool, windows: bool) -> int:
    """The unit in which an epoch's layout is shared out among ranks: whole blocks of the rank layout
    and, for bucket-shuffle windows, whole window blocks (the epoch when they do not fit together)."""
    block = rank_block(slots, n, whole_epoch)
    if windows:
        block = math.lcm(block, window_block(slots))
    return block


def shares(n: int, block: int, world: int) -> list[tuple[int, int]]:
    """Each rank's contiguous positions ``[lo, hi)`` of an epoch: whole blocks, as even as they split (the
    later ranks take the odd blocks: rank 0 finishes the epochs after); one block is rank 0's (a compile
    warm-up or a schedule: the layout's report comes from the block at position 0)."""
    blocks = -(-n // block)
    if blocks <= 1:
        return [(0, n)] + [(n, n)] * (world - 1)
    return [(min(n, blocks * r // world * block), min(n, blocks * (r + 1) // world * block)) for r in range(world)]


# -- building the microbatch table -------------------------------------------------------------------
def _padded_refinalize(ctx: PlanContext):
    def refinalize(lengths, offsets, extras):
        targets = batching.Targets(extras["target"], ctx.target_shape) if ctx.two_sided else None
        mb = batching.finalize_padded(np.arange(len(lengths)), offsets, lengths, ctx.shape, ctx.budget, ctx.static,
                                      ctx.fixed_batch, targets=targets)
        if "target" in extras:  # target_length: the tokens that carry loss
            lost = mb.tokens - batching.segment_sum(extras["target"], offsets)
        else:
            lost = batching.segment_sum((lengths > 0).astype(np.int32), offsets)
        out = {"count": np.diff(offsets).astype(np.int32), "seqlen": mb.seqlen.astype(np.int32),
               "batch": mb.batch_size.astype(np.int32), "tokens": mb.tokens, "lost": lost.astype(np.int32)}
        if targets is not None:
            out["tseqlen"] = mb.target_seqlen.astype(np.int32)
        return out
    return refinalize


def _row_refinalize(lengths, offsets, extras):
    final = extras["final"]
    tokens = batching.segment_sum(lengths, offsets).astype(np.int64)
    lost = (tokens - batching.segment_sum(extras["target"], offsets) if "target" in extras
            else batching.segment_sum(((lengths > 0) & final).astype(np.int32), offsets))
    return {"count": np.diff(offsets).astype(np.int32), "tokens": tokens,
            "completed": batching.segment_sum(final.astype(np.int32), offsets).astype(np.int32),
            "lost": lost.astype(np.int32),
            "sumsq": segment_sum_squares(lengths, offsets)}


def _sumsq(ctx: PlanContext) -> tuple:
    """("sumsq",) when the plan needs packed units' sums of squared segment lengths (an attention cost, or
    a memory budget's prediction), else nothing: the column is not kept."""
    return ("sumsq",) if ctx.budget.needs_segment_lengths or ctx.budget.memory is not None else ()


def _padded_units(tables: list, ctx: PlanContext, unit_level: bool) -> tuple[Units, dict | None]:
    """The padded units of all chunks (their tail fixed) and the units ``--tail drop`` dropped."""
    units, start = _concat(tables, ctx.unit_columns)  # lost: tokens without a target
    dropped = None
    if unit_level:
        counts = units.cols["count"]
        fix = tail.fix(counts, tables, start, ctx.slots, ctx.dp, ctx.grad_accum, ctx.tail, _padded_refinalize(ctx),
                       remedies=ctx.remedies)
        if len(fix.dropped):
            dropped = {name: units.take(name, fix.dropped) for name in ("chunk", "item_lo", "count")}
        units.apply(fix)
    units.alias["completed"] = "count"  # padded samples are whole: each entry completes one
    return units, dropped


def _packed_rows_to_microbatches(tables: list, ctx: PlanContext) -> tuple[Units, Units | None, np.ndarray | None]:
    """Chunk-level packed rows grouped into microbatches of at most R consecutive rows of one chunk:
    each chunk spreads its rows evenly over ceil(rows / R) microbatches, plus the epoch's extra
    microbatches (to a multiple of dp x grad_accum) given to the last chunks with rows to spare, then
    by splitting the fullest rows (:mod:`.tail`). With R = 1 the rows are the microbatches."""
    rows, start = _concat(tables, ("count", "tokens", "completed", "lost") + _sumsq(ctx))
    r = int(ctx.rows_per_mb)
    n_rows = rows.per_chunk.copy()
    mbs = -(-n_rows // r)
    total = int(mbs.sum())
    extra = ctx.slots * -(-total // ctx.slots) - total
    give = np.zeros(len(n_rows), np.int64)
    left = extra
    for k in range(len(n_rows) - 1, -1, -1):  # one step per chunk
        give[k] = min(int(n_rows[k] - mbs[k]), left)
        left -= int(give[k])
    mbs += give
    if left:  # fewer rows than microbatches: split the fullest rows
        before = rows.per_chunk.copy()
        rows.apply(tail.fix(rows.cols["count"], tables, start, ctx.slots, ctx.dp, ctx.grad_accum, ctx.tail,
                            _row_refinalize, "packed samples", extra=left, remedies=ctx.remedies))
        mbs += rows.per_chunk - before
    rows.const.update(seqlen=int(ctx.seq_len), batch=r)
    if r == 1:  # a microbatch is a row
        rows.const["rows"] = 1
        return rows, None, None
    return _group_rows(rows, mbs, r, ctx), rows, np.concatenate([[0], np.cumsum(rows.per_chunk)])


def _group_rows(rows: Units, mbs: np.ndarray, r: int, ctx: PlanContext) -> Units:
    """Microbatches of consecutive rows of each chunk: row i of a chunk's n goes to (i x m) // n."""
    summed = ("count", "tokens", "completed", "lost") + (("sumsq",) if "sumsq" in rows.cols else ())
    parts: dict = {name: [] for name in ("chunk", "item_lo", "row_lo", "rows") + summed}
    seq_start = np.concatenate([[0], np.cumsum(rows.per_chunk)])
    for k in range(len(mbs)):  # one step per chunk
        n, m = int(rows.per_chunk[k]), int(mbs[k])
        ids = rows.ids(np.arange(seq_start[k], seq_start[k + 1]))
        first = np.searchsorted((np.arange(n) * m) // max(n, 1), np.arange(m), side="left")
        parts["chunk"].append(np.full(m, k, np.int32))
        parts["item_lo"].append(rows.take("item_lo", ids[first]))
        parts["row_lo"].append(first.astype(np.int32))
        parts["rows"].append(np.diff(np.append(first, n)).astype(np.int32))
        for name in summed:
            v = rows.take(name, ids)
            v = v if name == "sumsq" else v.astype(np.int64)
            parts[name].append(np.add.reduceat(v, first) if m and n else np.zeros(m, v.dtype))
    cols = {name: np.concatenate(v) for name, v in parts.items()}
    for name in ("count", "completed", "lost"):
        cols[name] = cols[name].astype(np.int32)
    return Units(cols, mbs, {"seqlen": int(ctx.seq_len), "batch": r})


def _same_shape_steps(units: Units, seq: np.ndarray, slots: int) -> None:
    """All microbatches of a step get the step's largest T and B (``layout.same_shape_steps``): the
    units are rewritten in place (each appears once in ``seq``)."""
    for name in ("seqlen", "batch"):
        v = units.take(name, seq).reshape(-1, slots).max(axis=1)
        main = seq < units.m
        units.put(name, seq[main], np.repeat(v, slots)[main])
        if units.extra is not None:
            units.extra[name][seq[~main] - units.m] = np.repeat(v, slots)[~main]


# -- the layout --------------------------------------------------------------------------------------
def lay_out(tables: list, ctx: PlanContext, mode: str, rng: np.random.Generator, *, warmup: bool,
            schedule: str | None = None, stages: int | None = None, share: tuple[int, int] = (0, 1)) -> EpochRows:
    """The epoch's plan rows from its chunks' tables (chunk order), see the module docstring.

    ``share = (rank, world)``: the epoch's layout shared out among ``world`` ranks, each computing the
    same units and random draws and the order of its own positions only (``EpochRows.parts``: every
    rank's); the other positions of ``order`` are left to be filled with the other ranks' parts."""
    level = tables[0].header["level"]
    rows = row_seq_start = dropped = None
    if ctx.packing and level == "unit":
        units, rows, row_seq_start = _packed_rows_to_microbatches(tables, ctx)
    elif ctx.packing:
        units, _ = _concat(tables, ("count", "seqlen", "batch", "tokens", "completed", "lost", "rows") + _sumsq(ctx))
    else:
        units, dropped = _padded_units(tables, ctx, level == "unit")
    def cost_of(idx):
        return _cost_of(units, idx, ctx.budget)

    n = len(units)
    whole_epoch = warmup or schedule is not None
    in_place = ctx.same_shape and not ctx.packing and level == "unit"  # random + --same-shape-per-step
    rank, world = share
    if in_place:  # rewrites units across the whole sequence: one rank lays the epoch out
        parts = [(0, n)] + [(n, n)] * (world - 1)
    else:
        windows = mode == "bucket-shuffle" and level == "unit"
        parts = shares(n, split_block(ctx.slots, n, whole_epoch, windows), world)
    lo, hi = parts[rank]
    if level == "epoch":
        seq = units.ids(np.arange(n, dtype=_index_dtype(n)))
    else:
        seq = cross_chunk_order(mode, units, ctx.slots, rng, level == "step", cost_of, lo, hi)
        if in_place:
            _same_shape_steps(units, seq, ctx.slots)
    ranked = bool(tables[0].header.get("ranked"))
    order, lay_info = _ranks(units, seq, cost_of, ctx, ranked, warmup, schedule, stages, lo, hi)
    units.seq = None  # the order holds unit ids: the sequence (the tail's pieces in place) is not needed again
    tail_ids = np.concatenate([np.asarray(t.tail_ids, np.int64) for t in tables])
    return EpochRows(mode, units, order, *lay_info, tail_ids=tail_ids, dropped_units=dropped,
                     item_rows=ctx.packing and level != "unit", rows=rows, row_seq_start=row_seq_start,
                     budget=ctx.budget, parts=parts)


def _ranks(units: Units, seq: np.ndarray, cost_of, ctx: PlanContext, ranked: bool, warmup: bool, schedule,
           stages, lo: int = 0, hi: int | None = None) -> tuple[np.ndarray, tuple]:
    """``layout.layout_epoch`` (and ``--schedule``) on the sequence's positions ``[lo, hi)`` (default:
    all), a block of whole steps at a time (:func:`rank_block`). The sequence (the caller's, not needed
    after) becomes the order in place."""
    n = len(seq)
    hi = n if hi is None else hi
    block = rank_block(ctx.slots, n, warmup or schedule is not None)
    order = seq
    info = (0, 0, None)
    for a in range(lo, hi, block):
        part = seq[a:a + block]
        cost = cost_of(part)
        mb = Microbatches(None, None, units.take("seqlen", part).astype(np.int64),
                          units.take("batch", part).astype(np.int64), units.take("tokens", part).astype(np.int64))
        lay = layout.layout_epoch(mb, cost, ctx.dp, ctx.grad_accum, warmup=warmup and a == 0,
                                  same_shape=ctx.same_shape or ctx.packing, static=ctx.static, ranked=ranked)
        ordered = None
        if schedule is not None:
            from ...schedule.order import reorder_layout

            padded = units.take("batch", part).astype(np.float64) * units.take("seqlen", part)
            if ctx.two_sided:  # the activations of both sides
                padded += units.take("batch", part).astype(np.float64) * units.take("tseqlen", part)
            lay, ordered = reorder_layout(lay, cost, padded, dp=ctx.dp, grad_accum=ctx.grad_accum, schedule=schedule,
                                          stages=stages)
        order[a:a + len(part)] = part[lay.order]
        if a == 0:
            info = (lay.warmup_steps, lay.warmup_missing, ordered)
    return order, info
