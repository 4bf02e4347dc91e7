"""The invariants of a plan, checked on its arrays: ``varlen validate`` (:mod:`varlen_cli.validate`,
which reads a plan file) and the planner's own last step before writing (so the planner cannot
write a plan that ``varlen validate`` rejects) run these same checks.

Everything is recomputed from the columns and the metadata, vectorised over segments (CSR offsets
of the list columns, no per-entry parent array): a 10M-sample plan checks in a fraction of a second.
Imports numpy and the plan format only (no planner, no pyarrow).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import format
from .budget import Budget

MAX_EXAMPLES = 5


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    skipped: bool = False


@dataclass
class PlanArrays:
    """A plan as arrays: per-microbatch columns (``cols``: epoch, step, rank, micro, num_samples, seqlen,
    batch_size, tokens, lr_scale, shape_id, step_samples, step_tokens and, when present,
    step_loss_tokens), the list columns flattened (``ids``; packed plans ``lengths``, ``rows``,
    ``starts``; mixtures ``source``) with their CSR ``offsets``, and, when known (``--metrics``, the
    planner), ``sample_length``: each entry's whole sample length, and ``sample_target``: each
    entry's loss tokens as the metrics counted them (their ``target_length``; plans whose metadata
    says ``loss_tokens: target_length``)."""

    cols: dict
    offsets: np.ndarray
    ids: np.ndarray
    lengths: np.ndarray | None = None
    rows: np.ndarray | None = None
    starts: np.ndarray | None = None
    source: np.ndarray | None = None
    sample_length: np.ndarray | None = None
    sample_target: np.ndarray | None = None
    _final: np.ndarray | None = field(default=None, repr=False)
    _split: bool | None = field(default=None, repr=False)

    @property
    def count(self) -> int:
        return len(self.offsets) - 1

    @property
    def split(self) -> bool:
        """Whether some entry is a chunk past a sample's start (``--split-long``)."""
        if self._split is None:
            self._split = self.starts is not None and len(self.starts) > 0 and bool(self.starts.any())
        return self._split

    def entry_epoch(self) -> np.ndarray:
        return np.repeat(self.cols["epoch"].astype(np.int64), np.diff(self.offsets))


# -- segments ----------------------------------------------------------------------------------------
def segment_reduce(ufunc, values: np.ndarray, offsets: np.ndarray, empty=0, dtype=None) -> np.ndarray:
    """``ufunc.reduceat`` over the CSR segments, ``empty`` for empty ones (any offsets)."""
    counts = np.diff(offsets)
    out = np.full(len(counts), empty, dtype=dtype or (np.float64 if values.dtype.kind == "f" else np.int64))
    nz = np.flatnonzero(counts > 0)
    if len(nz):
        out[nz] = ufunc.reduceat(values, offsets[nz], dtype=out.dtype if ufunc is np.add else None)
    return out


def _examples(mask: np.ndarray, values: np.ndarray) -> str:
    where = np.flatnonzero(mask)[:MAX_EXAMPLES]
    return ", ".join(str(int(v)) for v in values[where])


def _epoch_bounds(epoch: np.ndarray, epochs: int) -> np.ndarray | None:
    """Row bounds of each epoch (rows sorted by epoch), or None when the column is out of order."""
    if len(epoch) and bool((np.diff(epoch) < 0).any()):
        return None
    return np.searchsorted(epoch, np.arange(epochs + 1), side="left")


# -- the checks -------------------------------------------------------------------------------------
def check_layout(a: PlanArrays, meta: dict) -> Check:
    c = a.cols
    dp, accum = int(meta["dp"]), int(meta["grad_accum"])
    n = len(c["step"])
    if n % (dp * accum):
        return Check("layout", False, f"{n} microbatches is not a multiple of dp x grad_accum = {dp * accum}")
    slots = dp * accum
    steps = n // slots
    position = np.arange(n)
    problems = []
    for name, want in (("step", position // slots), ("rank", position % slots // accum), ("micro", position % accum)):
        bad = c[name] != want
        if bad.any():
            problems.append(f"{name} out of (step, rank, micro) order at rows {_examples(bad, position)}")
    if int(meta.get("num_steps", steps)) != steps:
        problems.append(f"metadata says {meta.get('num_steps')} steps, the plan has {steps}")
    if "num_microbatches" in meta and int(meta["num_microbatches"]) != n:
        problems.append(f"metadata says {meta['num_microbatches']} microbatches, the plan has {n}")
    epoch = c["epoch"].astype(np.int64)
    spe = [int(s) for s in meta.get("steps_per_epoch", [])]
    epochs = int(meta.get("epochs", len(spe)))
    if n and (np.diff(epoch) < 0).any():
        problems.append("epochs decrease")
    elif n and (int(epoch.min()) < 0 or int(epoch.max()) >= epochs):
        problems.append(f"epochs outside 0..{epochs - 1}")
    elif len(spe) != epochs:
        problems.append(f"metadata lists steps for {len(spe)} epochs, the plan has {epochs}")
    else:
        have = np.bincount(epoch, minlength=epochs) // slots if n else np.zeros(epochs, np.int64)
        if have.tolist() != spe:
            bad = np.flatnonzero(have != np.asarray(spe))
            problems.append(f"steps_per_epoch says {spe[bad[0]]} steps in epoch {bad[0]}, the epoch column "
                            f"{int(have[bad[0]])}")
        elif steps and (epoch[::slots] != epoch[slots - 1::slots]).any():
            problems.append("a step spans two epochs")
    if problems:
        return Check("layout", False, "; ".join(problems))
    return Check("layout", True, f"{steps} steps x {dp} ranks x {accum} microbatches, {epochs} epoch(s)")


def check_counts(a: PlanArrays, packed: bool) -> Check:
    c = a.cols
    bad = c["num_samples"] != np.diff(a.offsets)
    problems = []
    if bad.any():
        problems.append(f"num_samples != len(sample_ids) in {int(bad.sum())} rows")
    for name, values in (("sample_lengths", a.lengths), ("sample_rows", a.rows), ("sample_starts", a.starts),
                         ("source", a.source)):
        if values is not None and len(values) != len(a.ids):
            problems.append(f"{name} has {len(values)} entries, sample_ids {len(a.ids)}")
    if not packed:  # packed plans: batch_size is the number of rows R, each holding several samples
        under = c["batch_size"] < c["num_samples"]
        if under.any():
            problems.append(f"batch_size < num_samples in {int(under.sum())} rows")
    if len(a.ids) and int(a.ids.min()) < 0:
        problems.append(f"{int((a.ids < 0).sum())} negative sample ids")
    if problems:
        return Check("counts", False, "; ".join(problems))
    return Check("counts", True, "num_samples and batch_size consistent")


# -- coverage -----------------------------------------------------------------------------------------
@dataclass
class _Keys:
    """Entries as keys into one space over every source: ``offset[source] + id``; ``expected``: the
    copies of each key an epoch holds (None: one each; a mixture: floor/ceil of its weight)."""

    key: np.ndarray
    size: int
    expected: np.ndarray | None
    offset: np.ndarray
    names: list

    def want(self, keys: np.ndarray) -> np.ndarray:
        return np.ones(len(keys), np.int64) if self.expected is None else self.expected[keys]


def _keys(a: PlanArrays, meta: dict) -> tuple[_Keys | None, str | None]:
    mix = meta.get("mixture")
    if not mix:
        n = int((meta.get("input") or {}).get("num_rows") or 0)
        if len(a.ids) and (int(a.ids.min()) < 0 or int(a.ids.max()) >= max(n, 1)):
            return None, f"sample ids outside 0..{n - 1}"
        return _Keys(a.ids, n, None, np.zeros(2, np.int64), ["input"]), None
    sources = mix["sources"]
    sizes = np.array([int(s["num_rows"]) for s in sources], np.int64)
    offset = np.concatenate([[0], np.cumsum(sizes)])
    src = a.source if a.source is not None else np.zeros(len(a.ids), np.int64)
    if len(src) and (int(src.min()) < 0 or int(src.max()) >= len(sources)):
        return None, f"source outside 0..{len(sources) - 1}"
    bad = (a.ids < 0) | (a.ids >= sizes[src]) if len(src) else np.zeros(0, bool)
    if bad.any():
        k = int(src[np.flatnonzero(bad)[0]])
        return None, f"source {sources[k]['name']!r} has sample ids outside 0..{int(sizes[k]) - 1}"
    expected = np.concatenate([mixture_copies(int(s["num_rows"]), float(s["weight"]), int(mix.get("seed", 0)), k)
                               for k, s in enumerate(sources)]) if len(sources) else np.zeros(0, np.int64)
    return _Keys(offset[src] + a.ids, int(offset[-1]), expected, offset, [s["name"] for s in sources]), None


MIX_SEED = 0x6D6978  # seed stream of a mixture's fractional subsets ("mix")


def mixture_extra(n: int, weight: float, seed: int, index: int) -> np.ndarray:
    """The seeded subset of a mixture source's ``n`` samples that get one copy more than ``floor(w)``:
    ``round(frac(w) x n)`` of them, sorted, the same in every epoch. The one definition, for the
    planner (``varlen plan --mix``) and for ``varlen validate``."""
    whole = int(np.floor(weight))
    extra_n = int(round((weight - whole) * n))
    return np.sort(np.random.default_rng([seed, MIX_SEED, index]).choice(n, extra_n, replace=False))


def mixture_copies(n: int, weight: float, seed: int, index: int) -> np.ndarray:
    """Copies of each of a source's ``n`` samples in every epoch of a mixture (``floor(w)``, one more for
    :func:`mixture_extra`)."""
    copies = np.full(n, int(np.floor(weight)), np.int64)
    copies[mixture_extra(n, weight, seed, index)] += 1
    return copies


def _dropped_keys(meta: dict, keys: _Keys, epochs: int) -> tuple[np.ndarray, list]:
    """Keys dropped in every epoch (too long; one per dropped copy) and per epoch (``--tail drop``)."""
    info = meta.get("dropped") or {}

    def as_keys(ids, sources) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        src = np.asarray(sources if sources is not None else np.zeros(len(ids)), np.int64)
        if len(src) != len(ids) or (len(src) and (src.min() < 0 or src.max() >= len(keys.offset) - 1)):
            src = np.zeros(len(ids), np.int64)
        k = keys.offset[src] + ids
        return k[(ids >= 0) & (k < keys.size)]

    if "too_long_ids" not in info:  # older plans: the union, every epoch
        return as_keys(info.get("sample_ids", []), None), [np.zeros(0, np.int64)] * epochs
    long_keys = as_keys(info.get("too_long_ids", []), info.get("too_long_sources"))
    tail = [np.zeros(0, np.int64) for _ in range(epochs)]
    for entry in info.get("tail", []):
        e = int(entry["epoch"])
        if 0 <= e < epochs:
            tail[e] = np.concatenate([tail[e], as_keys(entry["sample_ids"], entry.get("sources"))])
    return long_keys, tail


def check_coverage(a: PlanArrays, meta: dict) -> Check:
    """Every sample (every copy of a mixture's) once per epoch, or listed as dropped; a replan's first
    epoch lacks exactly the samples its lineage says were consumed. An occurrence is an entry that
    starts its sample (``--split-long`` chunks: the first one); the chunks of a split sample tile it.
    One count per key and epoch; only the keys that differ from one copy, or are dropped, are looked at."""
    keys, problem = _keys(a, meta)
    if problem:
        return Check("coverage", False, problem)
    epochs = int(meta.get("epochs", 1))
    bounds = _epoch_bounds(a.cols["epoch"].astype(np.int64), epochs)
    if bounds is None or len(bounds) != epochs + 1:
        return Check("coverage", False, "rows are not in epoch order")
    long_keys, tail_keys = _dropped_keys(meta, keys, epochs)
    lineage = meta.get("lineage") or {}
    consumed = int(lineage.get("consumed_samples") or 0)
    partial_first = "consumed_samples" in lineage  # a replan's first epoch (also once extended)
    problems = []
    for e in range(epochs):
        lo, hi = int(a.offsets[bounds[e]]), int(a.offsets[bounds[e + 1]])
        k = keys.key[lo:hi]
        start = a.starts[lo:hi] if a.starts is not None else None
        occurrences = k[start == 0] if start is not None and a.split else k
        dropped = np.concatenate([long_keys, tail_keys[e]])
        partial = e == 0 and partial_first
        if not (keys.expected is None and not partial and _each_once(occurrences, dropped, keys.size)):
            problems += _count_problems(keys, occurrences, dropped, e, consumed if partial else None)
        if start is not None and a.split:
            problems += _tiling_problems(a, k, start, lo, hi, e, partial=partial)
    if problems:
        return Check("coverage", False, "; ".join(problems[:4]) + (f" (+{len(problems) - 4} more)"
                                                                  if len(problems) > 4 else ""))
    dropped = len(np.unique(long_keys)) if len(long_keys) else 0
    return Check("coverage", True, f"every sample{' (copy)' if meta.get('mixture') else ''} exactly once in each of "
                 f"{epochs} epochs" + (f", {dropped} listed as dropped" if dropped else ""))


def _each_once(occurrences: np.ndarray, dropped: np.ndarray, size: int) -> bool:
    """Whether every key but the dropped ones occurs exactly once: a flag per key, then counts (the
    distinct keys equal the occurrences: no repeat; and the keys left: none missing)."""
    seen = np.zeros(size, bool)
    seen[occurrences] = True
    distinct = int(np.count_nonzero(seen))
    gone = np.unique(dropped)
    return distinct == len(occurrences) == size - len(gone) and not seen[gone].any()


def _count_problems(keys: _Keys, occurrences: np.ndarray, dropped: np.ndarray, e: int,
                    consumed: int | None) -> list[str]:
    """Each key's occurrences in epoch ``e`` against its copies less its dropped ones; ``consumed``: a
    replan's first epoch, which lacks exactly that many."""
    occ = np.bincount(occurrences, minlength=keys.size)
    odd = np.flatnonzero(occ != 1) if keys.expected is None else np.flatnonzero(occ != keys.expected)
    cand, where = np.unique(np.concatenate([odd, dropped]), return_inverse=True)
    want = keys.want(cand) - np.bincount(where[len(odd):], minlength=len(cand))
    have = occ[cand]
    if (want < 0).any():
        return [f"epoch {e}: more copies listed as dropped than it has"]
    dup, miss = have > want, have < want
    missing = int((want - have)[miss].sum())
    problems = []
    if dup.any():
        problems.append(f"epoch {e}: {int(dup.sum())} samples appear more than once in an epoch or more often than "
                        f"their weight (e.g. {_key_names(keys, cand[dup])})")
    if miss.any() and missing != consumed:
        problems.append(f"epoch {e}: {int(miss.sum())} samples are missing from an epoch and not listed as dropped "
                        f"(e.g. {_key_names(keys, cand[miss])})"
                        + (f"; {missing} missing, the lineage says {consumed} were consumed" if consumed is not None
                           else ""))
    return problems


def _key_names(keys: _Keys, where: np.ndarray) -> str:
    where = where[:MAX_EXAMPLES]
    if len(keys.names) == 1:
        return "ids " + ", ".join(str(int(w)) for w in where)
    src = np.searchsorted(keys.offset, where, side="right") - 1
    return ", ".join(f"{keys.names[s]}:{int(w - keys.offset[s])}" for s, w in zip(src, where))


def _tiling_problems(a: PlanArrays, key: np.ndarray, start: np.ndarray, lo: int, hi: int, e: int,
                     partial: bool) -> list[str]:
    """The chunks of every split sample of one epoch: each distinct chunk (start, length) as often as
    the sample's first one (its copies), distinct chunks back to back from 0 (a replan's first epoch:
    no overlap only), and, with the samples' lengths, ending at the sample's length."""
    length = a.lengths[lo:hi]
    split = np.zeros(int(key.max()) + 1 if len(key) else 0, bool)
    split[key[start > 0]] = True
    sel = np.flatnonzero(split[key]) if len(key) else np.zeros(0, np.int64)
    if not len(sel):
        return []
    k, s, ln = key[sel], start[sel], length[sel]
    order = np.lexsort((ln, s, k))
    k, s, ln = k[order], s[order], ln[order]
    new_key = np.r_[True, k[1:] != k[:-1]]
    same_chunk = ~new_key & np.r_[False, s[1:] == s[:-1]]
    problems = []
    if (same_chunk & np.r_[False, ln[1:] != ln[:-1]]).any():
        problems.append(f"epoch {e}: copies of a chunk differ in length")
    chunk_start = np.flatnonzero(~same_chunk)  # first entry of each distinct (key, start)
    ck, cs, cl = k[chunk_start], s[chunk_start], ln[chunk_start]
    copies = np.diff(np.append(chunk_start, len(k)))
    first = np.r_[True, ck[1:] != ck[:-1]]
    prev_end = np.r_[0, (cs + cl)[:-1]]
    if partial:
        if (~first & (cs < prev_end)).any():
            problems.append(f"epoch {e}: split chunks overlap")
    else:
        gaps = (first & (cs != 0)) | (~first & (cs != prev_end))
        group = np.cumsum(first) - 1
        head_copies = copies[first][group]
        if gaps.any() or (copies != head_copies).any():
            problems.append(f"epoch {e}: split chunks overlap or leave gaps (e.g. sample keys "
                            f"{_examples(gaps | (copies != head_copies), ck)})")
    if a.sample_length is not None:
        full = a.sample_length[lo:hi][sel][order][chunk_start]
        last = np.r_[ck[1:] != ck[:-1], True]
        over = cs + cl > full
        short = last & (cs + cl != full) & (not partial)
        if over.any() or short.any():
            problems.append(f"epoch {e}: {int(over.sum() + short.sum())} split chunks do not end within, or at the "
                            "end of, their sample")
    return problems


# -- budget and shapes ----------------------------------------------------------------------------------
def check_budget(a: PlanArrays, meta: dict, budget: Budget) -> Check:
    c = a.cols
    packing = meta.get("packing")
    problems = []
    b, t = c["batch_size"].astype(np.int64), c["seqlen"].astype(np.int64)
    if budget.max_tokens is not None or budget.max_samples is not None:
        over = ~budget.fits(b, t)
        if not packing and budget.max_samples is not None:
            over |= c["num_samples"] > budget.max_samples
        if over.any():
            problems.append(f"{int(over.sum())} microbatches over the budget {budget.describe()} (e.g. rows "
                            f"{_examples(over, np.arange(len(over)))})")
    if packing:
        seq = int(packing["seq_len"])
        if (t != seq).any():
            problems.append(f"{int((t != seq).sum())} microbatches whose seqlen is not seq_len {seq}")
        if a.rows is not None and a.lengths is not None:
            problems += _packed_row_problems(a, b, seq, packing.get("max_per_row"))
        detail = f"every packed row <= {seq} tokens"
    else:
        detail = f"B x T{' + A x B x T^2' if budget.attention_cost else ''} <= {budget.max_tokens} in every microbatch"
    if a.sample_length is not None:
        problems += _length_problems(a, packing)
    if problems:
        return Check("budget", False, "; ".join(problems))
    return Check("budget", True, detail)


def _packed_row_problems(a: PlanArrays, b: np.ndarray, seq: int, cap) -> list[str]:
    """Packed rows: every entry in a row ``< batch_size``, in row order, no row over ``seq`` tokens or
    ``cap`` samples, ``tokens`` the sum of the entries. One pass over the entries: rows are segments."""
    counts = np.diff(a.offsets)
    rows, lengths = a.rows, a.lengths
    limit = int(b[0]) if len(b) and int(b.min()) == int(b.max()) else np.repeat(b, counts)
    if len(rows) and ((rows < 0) | (rows >= limit)).any():
        return [f"{int(((rows < 0) | (rows >= limit)).sum())} entries in a row outside 0..batch_size-1"]
    problems = []
    if len(lengths) and int(lengths.min()) < 0:
        problems.append("negative sample_lengths")
    first = np.zeros(len(rows), bool)  # first entry of each microbatch
    first[a.offsets[:-1][counts > 0]] = True
    step = np.diff(rows.astype(np.int32, copy=False))  # rows < batch_size: int32
    if len(step) and (step[~first[1:]] < 0).any():
        return problems + ["entries not in row order"]
    new_row = first.copy()
    new_row[1:] |= step != 0
    row_start = np.flatnonzero(new_row)
    if len(row_start):
        fill = np.add.reduceat(lengths.astype(np.int64), row_start)
        if (fill > seq).any():
            problems.append(f"{int((fill > seq).sum())} packed rows hold more than seq_len {seq} tokens")
        per_row = np.diff(np.append(row_start, len(rows)))
        if cap and (per_row > int(cap)).any():
            problems.append(f"{int((per_row > int(cap)).sum())} rows hold more than {cap} samples")
    tokens = segment_reduce(np.add, lengths.astype(np.int64), a.offsets)
    if (tokens != a.cols["tokens"]).any():
        problems.append("tokens column differs from the sum of sample_lengths")
    return problems


def _length_problems(a: PlanArrays, packing) -> list[str]:
    """With each entry's sample length (``--metrics``, the planner): padded microbatches hold their
    longest sample and count its tokens; packed entries lie within their sample."""
    c = a.cols
    full = a.sample_length
    if packing:
        start = a.starts if a.starts is not None else np.zeros(len(full), np.int64)
        bad = (start < 0) | (start + a.lengths > full) if a.lengths is not None else np.zeros(0, bool)
        return [f"{int(bad.sum())} packed entries reach past their sample's length"] if bad.any() else []
    problems = []
    longest = segment_reduce(np.maximum, full, a.offsets)
    short = longest > c["seqlen"]
    if short.any():
        problems.append(f"{int(short.sum())} microbatches have a sample longer than their seqlen")
    if (segment_reduce(np.add, full, a.offsets) != c["tokens"]).any():
        problems.append("tokens column differs from the sum of the samples' lengths")
    return problems


def check_shapes(a: PlanArrays, meta: dict) -> Check:
    c = a.cols
    pcfg = meta.get("config") or {}
    problems = []
    t = c["seqlen"].astype(np.int64)
    k = pcfg.get("num_shapes")
    distinct_t = len(np.unique(t))
    if k and distinct_t > int(k):
        problems.append(f"{distinct_t} distinct seqlens, more than --num-shapes {k}")
    shapes = meta.get("shapes") or []
    sid = c["shape_id"].astype(np.int64)
    if len(sid) and (not shapes or sid.min() < 0 or sid.max() >= len(shapes)):
        problems.append("shape_id outside the metadata's shapes")
    elif len(sid):
        shape_arr = np.asarray(shapes, dtype=np.int64).reshape(-1, 2)
        want_b, want_t = shape_arr[sid, 0], shape_arr[sid, 1]
        if (want_t != t).any():
            problems.append(f"{int((want_t != t).sum())} rows whose seqlen differs from their shape")
        if ((want_b > 0) & (want_b != c["batch_size"])).any():
            problems.append("rows whose batch_size differs from their static shape")
    key = c["batch_size"].astype(np.int64) * (1 << 32) + t
    if pcfg.get("static_shapes"):
        pairs = len(np.unique(key))
        if k and pairs != int(k) and distinct_t == int(k):
            problems.append(f"static shapes: {pairs} (B, T) pairs for {k} buckets")
    if pcfg.get("same_shape_per_step") or meta.get("packing"):
        step = c["step"].astype(np.int64)
        order = np.lexsort((key, step))
        s, kk = step[order], key[order]
        if ((s[1:] == s[:-1]) & (kk[1:] != kk[:-1])).any():
            problems.append("a step mixes shapes" + (" (--same-shape-per-step)" if not meta.get("packing") else ""))
    if problems:
        return Check("shapes", False, "; ".join(problems))
    return Check("shapes", True, f"{distinct_t} distinct seqlens, {len(shapes)} shapes")


# -- per-step totals -----------------------------------------------------------------------------------
def final_entries(a: PlanArrays) -> np.ndarray | None:
    """Per entry: whether it ends its sample (a whole sample, or a split sample's last chunk); None
    when every entry does. Exact with the samples' lengths; without them, the chunk with the
    largest start of its sample in its epoch (its copies alike)."""
    if a._final is not None or not a.split:
        return a._final
    if a.sample_length is not None:
        a._final = a.starts + a.lengths == a.sample_length
        return a._final
    epoch = a.entry_epoch()
    key = epoch * (int(a.ids.max()) + 1) + a.ids
    if a.source is not None:
        key = key * (int(a.source.max()) + 1) + a.source
    order = np.lexsort((a.starts, key))
    ks, ss = key[order], a.starts[order]
    last = np.r_[ks[1:] != ks[:-1], True]
    top = np.repeat(ss[last], np.diff(np.r_[0, np.flatnonzero(last) + 1]))  # each group's largest start
    final = np.empty(len(key), bool)
    final[order] = ss == top
    a._final = final
    return final


def completed(a: PlanArrays) -> np.ndarray:
    """Samples each microbatch completes: its entries, except non-final chunks of split samples."""
    final = final_entries(a)
    if final is None:
        return a.cols["num_samples"].astype(np.int64)
    return segment_reduce(np.add, final.astype(np.int64), a.offsets)


def _first_epoch_unknowable(a: PlanArrays, meta: dict) -> bool:
    """A replan's first epoch of a split plan, without the samples' lengths: which chunk ends a sample
    whose last chunk was consumed before the replan is unknown."""
    return a.split and a.sample_length is None and "consumed_samples" in (meta.get("lineage") or {})


def _step_sums(step: np.ndarray, values: np.ndarray) -> np.ndarray:
    return np.bincount(step, weights=values)[step] if len(step) else np.zeros(0)


def check_step_totals(a: PlanArrays, meta: dict) -> Check:
    c = a.cols
    step = c["step"].astype(np.int64)
    tokens = _step_sums(step, c["tokens"])
    bad_tokens = tokens != c["step_tokens"]
    if _first_epoch_unknowable(a, meta):
        bad = bad_tokens
        note = " (step_samples of the first epoch need --metrics)"
    else:
        bad = bad_tokens | (_step_sums(step, completed(a)) != c["step_samples"])
        note = ""
    if bad.any():
        return Check("step totals", False, f"step_samples/step_tokens wrong in {int(bad.sum())} rows")
    return Check("step totals", True, "step_samples and step_tokens match their steps" + note)


def check_lr(a: PlanArrays, meta: dict) -> Check:
    c = a.cols
    mode = meta.get("lr_scaling", (meta.get("config") or {}).get("lr_scaling", "none"))
    by = meta.get("lr_scale_by", (meta.get("config") or {}).get("lr_scale_by", "samples"))
    base = meta.get("base_batch_size")
    lr = c["lr_scale"].astype(np.float64)
    if not np.all(np.isfinite(lr)):
        return Check("lr_scale", False, f"{int((~np.isfinite(lr)).sum())} rows whose lr_scale is not finite")
    step = c["step"].astype(np.int64)
    if mode == "none" or base == 0:  # base 0: only empty samples, nothing to scale by (plan/lr.py)
        want = np.ones(len(step))
    elif by == "samples" and _first_epoch_unknowable(a, meta):
        return Check("lr_scale", True, "needs --metrics for the first epoch of a replanned --split-long plan",
                     skipped=True)
    else:
        if not isinstance(base, (int, float)) or isinstance(base, bool) or not base > 0:
            return Check("lr_scale", False, f"metadata has no base_batch_size > 0 (got {base!r})")
        if by == "tokens" and meta.get("loss_tokens") == format.TARGET_LENGTH_COLUMN:  # tokens that carry loss
            per_step = c["step_loss_tokens"].astype(np.float64)
        else:
            per_step = _step_sums(step, c["tokens"] if by == "tokens" else completed(a))
        ratio = per_step / float(base)
        want = ratio if mode == "linear" else np.sqrt(ratio)
    bad = ~np.isclose(lr, want, rtol=1e-9, atol=1e-12)
    if bad.any():
        return Check("lr_scale", False, f"{int(bad.sum())} rows whose lr_scale is not {mode}({by} / {base})")
    return Check("lr_scale", True, f"{mode} in step {by}" + (f" / {base:g}" if base and mode != "none" else ""))


def check_straggler(a: PlanArrays, meta: dict, budget: Budget) -> Check:
    """The straggler in the plan's own cost model (:meth:`varlen_cli.budget.Budget.microbatch_cost`),
    recomputed from the columns; fails when the plan's recorded statistics say otherwise."""
    c = a.cols
    if not len(c["step"]):
        return Check("straggler", True, "no steps")
    sum_squares = None
    if budget.needs_segment_lengths:
        if a.lengths is None:
            return Check("straggler", False, "a packed attention cost needs sample_lengths")
        from .budget import segment_sum_squares

        sum_squares = segment_sum_squares(a.lengths, a.offsets)
    cost = budget.microbatch_cost(c["tokens"], c["batch_size"], c["seqlen"], sum_squares)
    step, rank, dp = c["step"].astype(np.int64), c["rank"].astype(np.int64), int(meta["dp"])
    per_step = format.straggler(step, rank, cost, dp)
    overhead = format.straggler_overhead(step, rank, cost, dp)
    what = ", ".join(f"{k}={v}" for k, v in budget.straggler_spec().items())
    stats = meta.get("stats") or {}
    for key, value in (("straggler_mean", per_step.mean()), ("straggler_max", per_step.max())):
        recorded = stats.get(key)
        if isinstance(recorded, (int, float)) and not np.isclose(float(recorded), float(value), rtol=1e-9, atol=1e-12):
            return Check("straggler", False, f"metadata says {key} {recorded:.6g}, the plan has {value:.6g} "
                         f"(cost {what})")
    return Check("straggler", True, f"mean {per_step.mean():.3f}, max {per_step.max():.3f}, overhead "
                 f"{100 * overhead:.2f}% in cost {what}")


def check_loss_tokens(a: PlanArrays, meta: dict) -> Check:
    """``step_loss_tokens`` (when the plan has it) against the targets counted from the lengths, or
    from the metrics' ``target_length`` for plans that count it (:func:`varlen_cli.format.loss_targets`)."""
    c = a.cols
    if "step_loss_tokens" not in c:
        return Check("loss tokens", True, "plan has no step_loss_tokens column (older plan)", skipped=True)
    if meta.get("loss_tokens") == format.TARGET_LENGTH_COLUMN:  # analyze --target-length: not derived from the lengths
        if a.sample_target is None:
            return Check("loss tokens", True, "needs --metrics: the plan counts the metrics' target_length "
                         "(assistant tokens)", skipped=True)
        return _loss_token_sums(a, format.loss_targets(None, target=a.sample_target), "the metrics' target_length")
    if a.lengths is not None:
        entry_len = a.lengths
    elif a.sample_length is not None:
        entry_len = a.sample_length
    else:
        return Check("loss tokens", True, "needs --metrics for a padded plan", skipped=True)
    if _first_epoch_unknowable(a, meta):
        return Check("loss tokens", True, "needs --metrics for the first epoch of a replanned --split-long plan",
                     skipped=True)
    final = final_entries(a)
    if final is None and (not len(entry_len) or int(entry_len.min()) > 0):  # l - 1 per entry, in one pass
        targets = segment_reduce(np.add, entry_len, a.offsets) - np.diff(a.offsets)
        return _loss_token_sums(a, None, "the samples' lengths", targets)
    return _loss_token_sums(a, format.loss_targets(entry_len, final), "the samples' lengths")


def _loss_token_sums(a: PlanArrays, entry_targets: np.ndarray | None, what: str,
                     targets: np.ndarray | None = None) -> Check:
    """``step_loss_tokens`` against the step sums of the entries' targets (or of ``targets`` per row)."""
    c = a.cols
    if targets is None:
        targets = segment_reduce(np.add, entry_targets, a.offsets)
    step = c["step"].astype(np.int64)
    bad = _step_sums(step, targets).astype(np.int64) != c["step_loss_tokens"]
    if bad.any():
        return Check("loss tokens", False, f"step_loss_tokens wrong in {int(bad.sum())} rows (e.g. steps "
                     f"{_examples(bad, step)})")
    return Check("loss tokens", True, f"step_loss_tokens = targets counted from {what}")


def check_memory(a: PlanArrays, budget: Budget, max_memory=None, profile_path: str | None = None) -> Check:
    """Predicted peaks against the limit given, or else the one the plan recorded (``--max-memory``)."""
    from .memory.budget import memory_check

    ok, detail = memory_check(a.cols["batch_size"], a.cols["seqlen"], budget, max_memory, profile_path)
    return Check("memory", ok, detail)


def run_checks(a: PlanArrays, meta: dict, *, max_memory=None, profile_path: str | None = None) -> list[Check]:
    """Every check of a plan's arrays (the file's columns and fingerprint are :mod:`varlen_cli.validate`'s)."""
    try:
        budget = Budget.from_metadata(meta)
    except ValueError as exc:
        return [Check("budget", False, f"malformed metadata: {exc}")]
    packed = bool(meta.get("packing"))
    checks = [check_layout(a, meta), check_counts(a, packed)]
    if any(v is not None and len(v) != len(a.ids) for v in (a.lengths, a.rows, a.starts, a.source)) or \
            (len(a.ids) and int(a.ids.min()) < 0):
        return checks  # list columns of different lengths, negative ids: the checks below would index out of them
    checks += [check_coverage(a, meta), check_budget(a, meta, budget), check_shapes(a, meta),
               check_step_totals(a, meta), check_lr(a, meta)]
    if max_memory is not None or profile_path is not None or budget.memory:
        checks.append(check_memory(a, budget, max_memory, profile_path))
    checks += [check_straggler(a, meta, budget), check_loss_tokens(a, meta)]
    return checks
