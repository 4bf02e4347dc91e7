"""The budget check (every microbatch within the token/sample budget, and the target budget of a
two-budget plan; packed rows within ``seq_len``, entries within their samples) and the shapes check
(seqlens and shapes as configured)."""

from __future__ import annotations

import numpy as np

from .. import format
from ..budget import Budget
from .arrays import Check, Examples, PlanArrays, segment_reduce


class BudgetCheck:
    def __init__(self, meta: dict, budget: Budget):
        self.packing, self.budget = meta.get("packing"), budget
        self.trained_only = meta.get("loss_tokens") == format.TARGET_LENGTH_COLUMN  # step_loss_tokens: target_length
        self.over, self.over_rows = 0, Examples()
        self.problems: dict = {}  # message -> count (summed over windows)
        self.met: dict = {}  # message -> (first row, order in its window): the order met

    def _count(self, message: str, n: int = 1, where: tuple = (0, 0)) -> None:
        self.problems[message] = self.problems.get(message, 0) + n
        self.met[message] = min(self.met.get(message, where), where)

    def merge(self, other: BudgetCheck) -> None:
        self.over += other.over
        self.over_rows.merge(other.over_rows)
        for message, n in other.problems.items():
            self._count(message, n, other.met[message])

    def update(self, a: PlanArrays) -> None:
        c, budget = a.cols, self.budget
        b, t = c["batch_size"].astype(np.int64), c["seqlen"].astype(np.int64)
        target = c.get(format.TARGET_SEQLEN_COLUMN)
        target = target.astype(np.int64) if target is not None else None
        for name in (format.TARGET_SEQLEN_COLUMN, format.TARGET_TOKENS_COLUMN):
            if budget.two_sided and name not in c:
                self._count(f"microbatches without {name}, which a plan with two budgets has", a.count,
                            (a.first_row, -1))
        if budget.max_tokens is not None or budget.max_samples is not None:
            over = ~budget.fits(b, t, target)
            if not self.packing and budget.max_samples is not None:
                over |= c["num_samples"] > budget.max_samples
            self.over += int(over.sum())
            self.over_rows.add(over, a.first_row + np.arange(len(over)), a.first_row)
        found = []
        if self.packing:
            seq = int(self.packing["seq_len"])
            if (t != seq).any():
                found.append((f"microbatches whose seqlen is not seq_len {seq}", int((t != seq).sum())))
            if a.rows is not None and a.lengths is not None:
                found += _packed_row_problems(a, b, seq, self.packing.get("max_per_row"))
        if a.sample_length is not None:
            found += _length_problems(a, self.packing)
        if target is not None and a.sample_target is not None:
            longest = segment_reduce(np.maximum, a.sample_target, a.offsets)
            if (longest > target).any():
                found.append(("microbatches have a sample whose target is longer than their target_seqlen",
                              int((longest > target).sum())))
        if target is not None and format.TARGET_TOKENS_COLUMN in c:
            found += _target_token_problems(a, b, target, self.trained_only)
        for i, (message, n) in enumerate(found):
            self._count(message, n, (a.first_row, i))

    def result(self) -> Check:
        problems = []
        if self.over:
            problems.append(f"{self.over} microbatches over the budget {self.budget.describe()} (e.g. rows "
                            f"{self.over_rows})")
        for message in sorted(self.problems, key=self.met.__getitem__):
            n = self.problems[message]
            problems.append(message if n is None or message.startswith(("entries not", "tokens column", "negative"))
                            else f"{n} {message}")
        if problems:
            return Check("budget", False, "; ".join(problems))
        if self.packing:
            return Check("budget", True, f"every packed row <= {int(self.packing['seq_len'])} tokens")
        quadratic = " + A x B x T^2" if self.budget.attention_cost else ""
        if self.budget.two_sided:
            return Check("budget", True, f"B x T{quadratic} <= {self.budget.max_tokens} and B x T_target"
                         f"{quadratic.replace('T^2', 'T_target^2')} <= {self.budget.max_target_tokens} in every "
                         "microbatch")
        return Check("budget", True, f"B x T{quadratic} <= {self.budget.max_tokens} in every microbatch")


def _target_token_problems(a: PlanArrays, b: np.ndarray, target: np.ndarray, trained_only: bool) -> list:
    """Two budgets: each microbatch's ``target_tokens`` within ``0..batch_size x target_seqlen``, the sum of
    its samples' ``target_length`` (when known), and a step's sum its ``step_loss_tokens`` (when the plan
    counts the metrics' ``target_length`` as its loss tokens)."""
    c = a.cols
    tokens = c[format.TARGET_TOKENS_COLUMN].astype(np.int64)
    problems = []
    outside = (tokens < 0) | (tokens > b * target)
    if outside.any():
        problems.append(("microbatches whose target_tokens is not within 0..batch_size x target_seqlen",
                         int(outside.sum())))
    if a.sample_target is not None:
        differs = segment_reduce(np.add, a.sample_target, a.offsets) != tokens
        if differs.any():
            problems.append(("microbatches whose target_tokens differs from the sum of their samples' "
                             "target_length", int(differs.sum())))
    if trained_only and "step_loss_tokens" in c and len(tokens):
        step = c["step"].astype(np.int64)
        steps, local = np.unique(step, return_inverse=True)
        sums = np.bincount(local, weights=tokens, minlength=len(steps))[local].astype(np.int64)  # whole steps
        bad = sums != c["step_loss_tokens"].astype(np.int64)
        if bad.any():
            problems.append(("steps whose target_tokens do not sum to their step_loss_tokens",
                             len(np.unique(step[bad]))))
    return problems


def _packed_row_problems(a: PlanArrays, b: np.ndarray, seq: int, cap) -> list[tuple[str, int]]:
    """Packed rows: every entry in a row ``< batch_size``, in row order, no row over ``seq`` tokens or
    ``cap`` samples, ``tokens`` the sum of the entries. One pass over the entries: rows are segments."""
    counts = np.diff(a.offsets)
    rows, lengths = a.rows, a.lengths
    limit = int(b[0]) if len(b) and int(b.min()) == int(b.max()) else np.repeat(b, counts)
    outside = (rows < 0) | (rows >= limit) if len(rows) else np.zeros(0, bool)
    if outside.any():
        return [("entries in a row outside 0..batch_size-1", int(outside.sum()))]
    problems = []
    if len(lengths) and int(lengths.min()) < 0:
        problems.append(("negative sample_lengths", 1))
    first = np.zeros(len(rows), bool)  # first entry of each microbatch
    first[a.offsets[:-1][counts > 0]] = True
    step = np.diff(rows.astype(np.int32, copy=False))  # rows < batch_size: int32
    if len(step) and (step[~first[1:]] < 0).any():
        return problems + [("entries not in row order", 1)]
    new_row = first.copy()
    new_row[1:] |= step != 0
    row_start = np.flatnonzero(new_row)
    if len(row_start):
        fill = np.add.reduceat(lengths.astype(np.int64), row_start)
        if (fill > seq).any():
            problems.append((f"packed rows hold more than seq_len {seq} tokens", int((fill > seq).sum())))
        per_row = np.diff(np.append(row_start, len(rows)))
        if cap and (per_row > int(cap)).any():
            problems.append((f"rows hold more than {cap} samples", int((per_row > int(cap)).sum())))
    tokens = segment_reduce(np.add, lengths.astype(np.int64), a.offsets)
    if (tokens != a.cols["tokens"]).any():
        problems.append(("tokens column differs from the sum of sample_lengths", 1))
    return problems


def _length_problems(a: PlanArrays, packing) -> list[tuple[str, int]]:
    """With each entry's sample length (``--metrics``, the planner): padded microbatches hold their
    longest sample and count its tokens; packed entries lie within their sample."""
    c = a.cols
    full = a.sample_length
    if packing:
        start = a.starts if a.starts is not None else np.zeros(len(full), np.int64)
        bad = (start < 0) | (start + a.lengths > full) if a.lengths is not None else np.zeros(0, bool)
        return [("packed entries reach past their sample's length", int(bad.sum()))] if bad.any() else []
    problems = []
    longest = segment_reduce(np.maximum, full, a.offsets)
    short = longest > c["seqlen"]
    if short.any():
        problems.append(("microbatches have a sample longer than their seqlen", int(short.sum())))
    if (segment_reduce(np.add, full, a.offsets) != c["tokens"]).any():
        problems.append(("tokens column differs from the sum of the samples' lengths", 1))
    return problems


DENSE_SEQLEN = 1 << 24  # seqlens below this are noted in a boolean array (one byte each), others in a set


class Shapes:
    def __init__(self, meta: dict):
        self.meta = meta
        self.pcfg = meta.get("config") or {}
        self.shapes = meta.get("shapes") or []
        self.arr = np.asarray(self.shapes, dtype=np.int64).reshape(-1, 2)
        self.seqlens = np.zeros(0, bool)  # seqlen t met: seqlens[t] (0 <= t < DENSE_SEQLEN)
        self.odd_seqlens: set = set()  # the others (a tampered plan)
        self.pairs: set = set()
        self.outside = self.bad_b = self.mixed = False
        self.bad_t = 0
        self.target_seqlens: set = set()  # two budgets: the distinct target_seqlen

    def update(self, a: PlanArrays) -> None:
        c = a.cols
        t = c["seqlen"].astype(np.int64)
        self._note_seqlens(t)
        if format.TARGET_SEQLEN_COLUMN in c:
            self.target_seqlens.update(np.unique(c[format.TARGET_SEQLEN_COLUMN]).tolist())
        sid = c["shape_id"].astype(np.int64)
        if len(sid) and (not self.shapes or sid.min() < 0 or sid.max() >= len(self.shapes)):
            self.outside = True
        elif len(sid) and not self.outside:
            want_b, want_t = self.arr[sid, 0], self.arr[sid, 1]
            self.bad_t += int((want_t != t).sum())
            self.bad_b |= bool(((want_b > 0) & (want_b != c["batch_size"])).any())
        key = c["batch_size"].astype(np.int64) * (1 << 32) + t
        if self.pcfg.get("static_shapes"):
            self.pairs.update(np.unique(key).tolist())
        if self.pcfg.get("same_shape_per_step") or self.meta.get("packing"):
            step = c["step"].astype(np.int64)
            order = np.lexsort((key, step))
            s, kk = step[order], key[order]
            self.mixed |= bool(((s[1:] == s[:-1]) & (kk[1:] != kk[:-1])).any())

    def _note_seqlens(self, t: np.ndarray) -> None:
        if not len(t):
            return
        if int(t.min()) < 0 or int(t.max()) >= DENSE_SEQLEN:
            inside = (t >= 0) & (t < DENSE_SEQLEN)
            self.odd_seqlens.update(np.unique(t[~inside]).tolist())
            t = t[inside]
            if not len(t):
                return
        top = int(t.max())
        if top >= len(self.seqlens):
            grown = np.zeros(max(top + 1, 2 * len(self.seqlens)), bool)
            grown[:len(self.seqlens)] = self.seqlens
            self.seqlens = grown
        self.seqlens[t] = True

    def distinct_seqlens(self) -> int:
        return int(np.count_nonzero(self.seqlens)) + len(self.odd_seqlens)

    def merge(self, other: Shapes) -> None:
        if len(other.seqlens) > len(self.seqlens):
            grown = other.seqlens.copy()
            grown[:len(self.seqlens)] |= self.seqlens
            self.seqlens = grown
        else:
            self.seqlens[:len(other.seqlens)] |= other.seqlens
        self.odd_seqlens |= other.odd_seqlens
        self.target_seqlens |= other.target_seqlens
        self.pairs |= other.pairs
        self.outside |= other.outside
        self.bad_b |= other.bad_b
        self.mixed |= other.mixed
        self.bad_t += other.bad_t

    def result(self) -> Check:
        problems = []
        k = self.pcfg.get("num_shapes")
        distinct_t = self.distinct_seqlens()
        if k and distinct_t > int(k):
            problems.append(f"{distinct_t} distinct seqlens, more than --num-shapes {k}")
        if k and len(self.target_seqlens) > int(k):
            problems.append(f"{len(self.target_seqlens)} distinct target_seqlens, more than --num-shapes {k}")
        if self.outside:
            problems.append("shape_id outside the metadata's shapes")
        else:
            if self.bad_t:
                problems.append(f"{self.bad_t} rows whose seqlen differs from their shape")
            if self.bad_b:
                problems.append("rows whose batch_size differs from their static shape")
        if self.pcfg.get("static_shapes") and k and len(self.pairs) != int(k) and distinct_t == int(k):
            problems.append(f"static shapes: {len(self.pairs)} (B, T) pairs for {k} buckets")
        if self.mixed:
            which = "" if self.meta.get("packing") else " (--same-shape-per-step)"
            problems.append("a step mixes shapes" + which)
        if problems:
            return Check("shapes", False, "; ".join(problems))
        targets = f", {len(self.target_seqlens)} distinct target_seqlens" if self.target_seqlens else ""
        return Check("shapes", True, f"{distinct_t} distinct seqlens{targets}, {len(self.shapes)} shapes")
