"""``varlen validate`` with bounded memory: the plan read in windows of whole steps, exactly-once
checked with a bitmap of one bit per sample (issue 25).

Each of validate's checks is an accumulator (``update(window)``, ``result() -> Check``) with the same
name and message as :mod:`varlen_cli.validate`. Memory: one window, one bitmap per epoch (n / 8
bytes), per-step arrays, and with ``--metrics`` the lengths of at most :data:`LENGTHS_PER_PASS`
samples at a time (larger inputs take one more scan of the plan per such range of sample ids).

Split samples (``--split-long``) count once per epoch through their first chunk (start 0); their
chunks' tiling is checked from the chunks with start > 0 (collected in a first scan, with the first
chunk of each such sample), and their last chunk completes the sample.
"""

from __future__ import annotations

import numpy as np

from . import format, plan_scan
from .validate import MAX_EXAMPLES, Check

LENGTHS_PER_PASS = 1 << 27  # sample lengths (int32) held at once: 512 MB


def _examples(values) -> str:
    return ", ".join(str(int(v)) for v in list(values)[:MAX_EXAMPLES])


class Bitmap:
    """One bit per sample id in ``[0, n)``."""

    def __init__(self, n: int):
        self.n = n
        self.bits = np.zeros((n + 7) // 8, np.uint8)

    def test(self, ids: np.ndarray) -> np.ndarray:
        return (self.bits[ids >> 3] >> (ids & 7).astype(np.uint8)) & 1 == 1

    def set(self, ids: np.ndarray) -> None:
        """Set the bits of ``ids`` (repeated ids allowed): a scatter, repeated for bits a collision lost."""
        while len(ids):
            byte, mask = ids >> 3, np.left_shift(1, ids & 7).astype(np.uint8)
            self.bits[byte] |= mask
            lost = (self.bits[byte] & mask) == 0
            ids = ids[lost]

    def count(self) -> int:
        return int(np.bitwise_count(self.bits).sum())

    def first_clear(self, other: Bitmap | None, k: int) -> np.ndarray:
        """Up to ``k`` ids set in neither this bitmap nor ``other``."""
        full = self.bits if other is None else self.bits | other.bits
        bad = np.flatnonzero(full != 0xFF)[: k + 1]
        ids = (bad[:, None] * 8 + np.arange(8)[None, :]).reshape(-1)
        ids = ids[(ids < self.n)]
        hit = ((full[ids >> 3] >> (ids & 7).astype(np.uint8)) & 1) == 1
        return ids[~hit][:k]


# -- the checks ------------------------------------------------------------------------------------
class Layout:
    name = "layout"

    def __init__(self, dp: int, accum: int, meta: dict):
        self.dp, self.accum, self.meta = dp, accum, meta
        self.slots = dp * accum
        self.n = 0
        self.bad = {"step": [], "rank": [], "micro": []}
        self.last_epoch = None
        self.decrease = False

    def update(self, w) -> None:
        i = w.first_row + np.arange(w.n, dtype=np.int64)
        want = {"step": i // self.slots, "rank": (i % self.slots) // self.accum, "micro": i % self.accum}
        for name, values in want.items():
            if len(self.bad[name]) < MAX_EXAMPLES:
                self.bad[name] += i[w.cols[name] != values][:MAX_EXAMPLES].tolist()
        e = w.cols["epoch"]
        if w.n:
            if (np.diff(e) < 0).any() or (self.last_epoch is not None and int(e[0]) < self.last_epoch):
                self.decrease = True
            self.last_epoch = int(e[-1])
        self.n += w.n

    def result(self) -> Check:
        if self.n % self.slots:
            return Check("layout", False, f"{self.n} microbatches is not a multiple of dp x grad_accum = {self.slots}")
        steps = self.n // self.slots
        problems = [f"{name} out of (step, rank, micro) order at rows {_examples(rows)}"
                    for name, rows in self.bad.items() if rows]
        if int(self.meta.get("num_steps", steps)) != steps:
            problems.append(f"metadata says {self.meta.get('num_steps')} steps, the plan has {steps}")
        if self.decrease:
            problems.append("epochs decrease")
        if problems:
            return Check("layout", False, "; ".join(problems))
        return Check("layout", True, f"{steps} steps x {self.dp} ranks x {self.accum} microbatches")


class Counts:
    name = "counts"

    def __init__(self, packed: bool):
        self.packed = packed
        self.bad = self.bad_b = 0

    def update(self, w) -> None:
        self.bad += int(np.count_nonzero(w.cols["num_samples"] != np.diff(w.offsets())))
        if not self.packed:
            self.bad_b += int(np.count_nonzero(w.cols["batch_size"] < w.cols["num_samples"]))

    def result(self) -> Check:
        if self.bad or self.bad_b:
            return Check("counts", False, f"num_samples != len(sample_ids) in {self.bad} rows; batch_size < "
                         f"num_samples in {self.bad_b} rows")
        return Check("counts", True, "num_samples and batch_size consistent")


class Coverage:
    """Every sample once per epoch (its first chunk for split samples), or listed as dropped."""

    name = "coverage"

    def __init__(self, meta: dict, n: int, split: bool):
        self.meta, self.n, self.split = meta, n, split
        self.epochs = int(meta.get("epochs", 1))
        info = meta.get("dropped") or {}
        self.listed = info.get("too_long_listed", True)
        self.long_ids = np.asarray(info.get("too_long_ids", info.get("sample_ids", [])), np.int64)
        self.long_count = int(info.get("too_long_count", len(self.long_ids)))
        self.tail = {int(t["epoch"]): np.asarray(t["sample_ids"], np.int64) for t in info.get("tail", [])}
        if "too_long_ids" not in info:  # older plans: the union for every epoch
            self.tail = {}
        self.consumed = int((meta.get("lineage") or {}).get("consumed_samples") or 0)
        self.outside = False
        self.current: int | None = None
        self.bitmap: Bitmap | None = None
        self.entries = 0
        self.dup = self.miss = 0
        self.dup_ids: list = []
        self.miss_ids: list = []
        self.finished: set = set()
        self.long_bitmap: Bitmap | None = None  # with --metrics when the too-long ids are not listed

    def update(self, w) -> None:
        ids = w.values("sample_ids").astype(np.int64, copy=False)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= max(self.n, 1)):
            self.outside = True
        if self.outside:
            return
        row_epoch = w.cols["epoch"]
        one = not w.n or int(row_epoch.min()) == int(row_epoch.max())  # the usual window: one epoch
        epoch = None if one else row_epoch.astype(np.int64)[w.parent()]
        if self.split:
            first = w.values("sample_starts") == 0
            ids, epoch = ids[first], (None if one else epoch[first])
        groups = [(int(row_epoch[0]), ids)] if one and w.n else \
            [(int(e), ids[epoch == e]) for e in (np.unique(epoch).tolist() if epoch is not None else [])]
        for e, mine in groups:
            self._epoch(int(e))
            if len(self.dup_ids) < MAX_EXAMPLES:
                self.dup_ids += mine[self.bitmap.test(mine)][:MAX_EXAMPLES].tolist()
            self.bitmap.set(mine)
            self.entries += len(mine)

    def _epoch(self, e: int) -> None:
        if self.current == e:
            return
        self._close()
        if e in self.finished:  # an epoch seen again after another: the layout check reports the order
            self.dup += 1
        self.current, self.bitmap, self.entries = e, Bitmap(self.n), 0

    def _dropped(self, e: int) -> Bitmap:
        d = Bitmap(self.n)
        ids = self.long_ids if self.listed else np.zeros(0, np.int64)
        ids = np.concatenate([ids, self.tail.get(e, np.zeros(0, np.int64))])
        d.set(ids[(ids >= 0) & (ids < self.n)])
        if not self.listed and self.long_bitmap is not None:
            d.bits |= self.long_bitmap.bits
        return d

    def _close(self) -> None:
        if self.current is None or self.bitmap is None:
            return
        e, present = self.current, self.bitmap
        dropped = self._dropped(e)
        both = int(np.bitwise_count(present.bits & dropped.bits).sum())
        distinct = present.count()
        dup = self.entries - distinct + both
        expected = self.n - dropped.count()
        if not self.listed and self.long_bitmap is None:  # only their number is known
            expected = self.n - self.long_count - len(self.tail.get(e, ()))
        miss = max(expected - (distinct - both), 0)
        if e == 0 and self.consumed and miss == self.consumed:
            miss = 0
        self.dup += dup
        self.miss += miss
        if miss and len(self.miss_ids) < MAX_EXAMPLES and (self.listed or self.long_bitmap is not None):
            self.miss_ids += present.first_clear(dropped, MAX_EXAMPLES).tolist()
        self.finished.add(e)
        self.bitmap = None

    def result(self) -> Check:
        if self.outside:
            return Check("coverage", False, f"sample ids outside 0..{self.n - 1}")
        self._close()
        self.current = None
        problems = []
        if self.dup:
            problems.append(f"{self.dup} samples appear more than once in an epoch"
                            + (f" (e.g. ids {_examples(self.dup_ids)})" if self.dup_ids else ""))
        if self.miss:
            problems.append(f"{self.miss} samples are missing from an epoch and not listed as dropped"
                            + (f" (e.g. ids {_examples(self.miss_ids)})" if self.miss_ids else ""))
        if problems:
            return Check("coverage", False, "; ".join(problems))
        dropped = len(np.unique(np.concatenate([self.long_ids] + list(self.tail.values())))) if self.listed else \
            self.long_count
        return Check("coverage", True, f"{self.n - dropped} samples exactly once in each of {self.epochs} epochs"
                     + (f", {dropped} listed as dropped" if dropped else "") + " (bitmap)")


class Budget:
    name = "budget"

    def __init__(self, cfg: dict, packing):
        self.cfg, self.packing = cfg, packing
        self.over = self.beyond = self.full = self.crowded = self.over_samples = 0
        self.over_rows: list = []

    def update(self, w) -> None:
        c = w.cols
        if self.packing:
            if "sample_rows" not in w.lists:
                return
            T = int(self.packing["seq_len"])
            parent = w.parent("sample_rows")
            rows = w.values("sample_rows").astype(np.int64)
            self.beyond += int(np.count_nonzero(rows >= c["batch_size"][parent]))
            key = parent * int(c["batch_size"].max() or 1) + rows
            fill = np.bincount(key, weights=w.values("sample_lengths")) if len(key) else np.zeros(0)
            self.full += int(np.count_nonzero(fill > T))
            cap = self.packing.get("max_per_row")
            if cap and len(key):
                self.crowded += int(np.count_nonzero(np.bincount(key) > int(cap)))
            return
        max_tokens = self.cfg.get("max_tokens")
        attn = float(self.cfg.get("attention_cost") or 0.0)
        b, t = c["batch_size"].astype(np.float64), c["seqlen"].astype(np.float64)
        cost = b * t + attn * b * t * t
        if max_tokens is not None:
            over = cost > float(max_tokens) + 1e-9
            self.over += int(np.count_nonzero(over))
            if len(self.over_rows) < MAX_EXAMPLES:
                self.over_rows += (w.first_row + np.flatnonzero(over))[:MAX_EXAMPLES].tolist()
        ms = self.cfg.get("max_samples")
        if ms:
            self.over_samples += int(np.count_nonzero(c["num_samples"] > int(ms)))

    def result(self, lengths_problems=()) -> Check:
        problems = []
        if self.packing:
            T = int(self.packing["seq_len"])
            if self.beyond:
                problems.append(f"{self.beyond} entries in a row beyond batch_size")
            if self.full:
                problems.append(f"{self.full} packed rows hold more than seq_len {T} tokens")
            if self.crowded:
                problems.append(f"{self.crowded} rows hold more than {self.packing.get('max_per_row')} samples")
            detail = f"every packed row <= {T} tokens"
        else:
            max_tokens = self.cfg.get("max_tokens")
            attn = float(self.cfg.get("attention_cost") or 0.0)
            if self.over:
                problems.append(f"{self.over} microbatches over the budget {max_tokens} (e.g. rows "
                                f"{_examples(self.over_rows)})")
            if self.over_samples:
                problems.append(f"microbatches with more than --max-samples {self.cfg.get('max_samples')} samples")
            detail = f"B x T{' + A x B x T^2' if attn else ''} <= {max_tokens} in every microbatch"
        problems += list(lengths_problems)
        if problems:
            return Check("budget", False, "; ".join(problems))
        return Check("budget", True, detail)


class Shapes:
    name = "shapes"

    def __init__(self, meta: dict, cfg: dict, slots: int):
        self.meta, self.cfg, self.slots = meta, cfg, slots
        self.shapes = meta.get("shapes") or []
        self.arr = np.asarray(self.shapes, np.int64).reshape(-1, 2)
        self.seqlens: set = set()
        self.pairs: set = set()
        self.outside = False
        self.bad_t = 0
        self.bad_b = False
        self.mixed = False

    def update(self, w) -> None:
        c = w.cols
        T = c["seqlen"].astype(np.int64)
        self.seqlens.update(np.unique(T).tolist())
        if len(self.shapes) and w.n:
            sid = c["shape_id"]
            if sid.min() < 0 or sid.max() >= len(self.shapes):
                self.outside = True
            else:
                want_b, want_t = self.arr[sid, 0], self.arr[sid, 1]
                self.bad_t += int(np.count_nonzero(want_t != T))
                self.bad_b |= bool(((want_b > 0) & (want_b != c["batch_size"])).any())
        key = c["batch_size"].astype(np.int64) * (1 << 32) + T
        if self.cfg.get("static_shapes"):
            self.pairs.update(np.unique(key).tolist())
        if self.cfg.get("same_shape_per_step") and w.n:
            step = c["step"]
            order = np.lexsort((key, step))
            s, kk = step[order], key[order]
            self.mixed |= bool(((s[1:] == s[:-1]) & (kk[1:] != kk[:-1])).any())

    def result(self) -> Check:
        problems = []
        k = self.cfg.get("num_shapes")
        distinct_t = len(self.seqlens)
        if k and distinct_t > int(k):
            problems.append(f"{distinct_t} distinct seqlens, more than --num-shapes {k}")
        if self.outside:
            problems.append("shape_id outside the metadata's shapes")
        if self.bad_t:
            problems.append(f"{self.bad_t} rows whose seqlen differs from their shape")
        if self.bad_b:
            problems.append("rows whose batch_size differs from their static shape")
        if self.cfg.get("static_shapes") and k and len(self.pairs) != int(k) and distinct_t == int(k):
            problems.append(f"static shapes: {len(self.pairs)} (B, T) pairs for {k} buckets")
        if self.mixed:
            problems.append("a step mixes shapes (--same-shape-per-step)")
        if problems:
            return Check("shapes", False, "; ".join(problems))
        return Check("shapes", True, f"{distinct_t} distinct seqlens, {len(self.shapes)} shapes")


def _local_steps(step: np.ndarray) -> tuple[np.ndarray, int]:
    lo = int(step.min()) if len(step) else 0
    return step.astype(np.int64) - lo, lo


class StepTotals:
    name = "step totals"

    def __init__(self):
        self.bad = 0

    def update(self, w, completed: np.ndarray) -> None:
        s, _ = _local_steps(w.cols["step"])
        samples = np.bincount(s, weights=completed)
        tokens = np.bincount(s, weights=w.cols["tokens"])
        bad = (samples[s] != w.cols["step_samples"]) | (tokens[s] != w.cols["step_tokens"])
        self.bad += int(np.count_nonzero(bad))

    def result(self) -> Check:
        if self.bad:
            return Check("step totals", False, f"step_samples/step_tokens wrong in {self.bad} rows")
        return Check("step totals", True, "step_samples and step_tokens match their steps")


class Lr:
    name = "lr_scale"

    def __init__(self, meta: dict):
        self.trained_only = meta.get("loss_tokens") == "target_length"  # tokens: those that carry loss
        self.mode = meta.get("lr_scaling", meta.get("config", {}).get("lr_scaling", "none"))
        self.by = meta.get("lr_scale_by", meta.get("config", {}).get("lr_scale_by", "samples"))
        self.base = meta.get("base_batch_size")
        self.nonfinite = self.bad = 0

    def update(self, w, completed: np.ndarray) -> None:
        s, _ = _local_steps(w.cols["step"])
        if self.by == "tokens" and self.trained_only:
            per_step = w.cols["step_loss_tokens"].astype(np.float64)
        else:
            per_step = np.bincount(s, weights=w.cols["tokens"] if self.by == "tokens" else completed)[s]
        lr = w.cols["lr_scale"]
        self.nonfinite += int(np.count_nonzero(~np.isfinite(lr)))
        if self.mode == "none":
            want = np.ones(len(s))
        elif not self.base:
            return
        else:
            ratio = per_step / float(self.base)
            want = ratio if self.mode == "linear" else np.sqrt(ratio)
        self.bad += int(np.count_nonzero(~np.isclose(lr, want, rtol=1e-9, atol=1e-12)))

    def result(self) -> Check:
        if self.mode != "none" and not self.base:
            return Check("lr_scale", False, "metadata has no base_batch_size")
        if self.nonfinite:
            return Check("lr_scale", False, f"{self.nonfinite} rows whose lr_scale is not finite")
        if self.bad:
            return Check("lr_scale", False,
                         f"{self.bad} rows whose lr_scale is not {self.mode}({self.by} / {self.base})")
        base = self.base
        shown = f" / {base:g}" if base and self.mode != "none" else ""
        return Check("lr_scale", True, f"{self.mode} in step {self.by}{shown}")


class Straggler:
    name = "straggler"

    def __init__(self, meta: dict):
        self.meta = meta
        self.spec = format.plan_straggler_cost(meta)
        self.dp = int(meta["dp"])
        self.per_step: list = []
        self.top = self.mean = 0.0
        self.rows = 0

    def update(self, w) -> None:
        c = w.cols
        sum_squares = None
        if format.needs_segment_lengths(self.spec):
            sum_squares = format.segment_sum_squares(w.values("sample_lengths"), w.parent("sample_lengths"), w.n)
        cost = format.microbatch_cost(self.spec, c["tokens"], c["batch_size"], c["seqlen"], sum_squares)
        s, _ = _local_steps(c["step"])
        rank = c["rank"].astype(np.int64)
        if w.n:
            self.per_step.append(format.straggler(s, rank, cost, self.dp))
            load = format.step_loads(s, rank, cost, self.dp)
            self.top += float(load.max(axis=1).sum())
            self.mean += float(load.mean(axis=1).sum())
        self.rows += w.n

    def result(self) -> Check:
        if not self.rows:
            return Check("straggler", True, "no steps")
        per_step = np.concatenate(self.per_step)
        overhead = self.top / self.mean - 1.0 if self.mean > 0 else 0.0
        what = ", ".join(f"{k}={v}" for k, v in self.spec.items())
        detail = (f"mean {per_step.mean():.3f}, max {per_step.max():.3f}, overhead {100 * overhead:.2f}% "
                  f"in cost {what}")
        stats = self.meta.get("stats") or {}
        for key, value in (("straggler_mean", per_step.mean()), ("straggler_max", per_step.max())):
            if key in stats and not np.isclose(float(stats[key]), float(value), rtol=1e-9, atol=1e-12):
                return Check("straggler", False, f"metadata says {key} {stats[key]:.6g}, the plan has {value:.6g} "
                             f"(cost {what})")
        return Check("straggler", True, detail)


class LossTokens:
    name = "loss tokens"

    def __init__(self):
        self.bad = 0
        self.bad_steps: list = []

    def update(self, w, targets_per_row: np.ndarray) -> None:
        s, _ = _local_steps(w.cols["step"])
        want = np.bincount(s, weights=targets_per_row)[s] if w.n else np.zeros(0)
        bad = want.astype(np.int64) != w.cols["step_loss_tokens"]
        self.bad += int(np.count_nonzero(bad))
        if len(self.bad_steps) < MAX_EXAMPLES:
            self.bad_steps += w.cols["step"][bad][:MAX_EXAMPLES].tolist()

    def result(self) -> Check:
        if self.bad:
            return Check("loss tokens", False, f"step_loss_tokens wrong in {self.bad} rows (e.g. steps "
                         f"{_examples(self.bad_steps)})")
        return Check("loss tokens", True, "step_loss_tokens = targets counted from the samples' lengths")


# -- split samples --------------------------------------------------------------------------------
class SplitChunks:
    """Chunks of split samples: the first scan keeps every chunk with start > 0 (key = epoch x n + id);
    the main scan adds each such sample's first chunk; the last chunk (largest start) completes it."""

    def __init__(self, n: int):
        self.n = max(n, 1)
        self.keys, self.starts, self.lengths = [], [], []
        self.first_keys, self.first_lengths = [], []

    def collect(self, w) -> None:
        starts = w.values("sample_starts")
        later = starts > 0
        if later.any():
            key = w.cols["epoch"].astype(np.int64)[w.parent()][later] * self.n + w.values("sample_ids")[later]
            self.keys.append(key)
            self.starts.append(starts[later].astype(np.int64))
            self.lengths.append(w.values("sample_lengths")[later].astype(np.int64))

    def freeze(self) -> None:
        key = np.concatenate(self.keys) if self.keys else np.zeros(0, np.int64)
        start = np.concatenate(self.starts) if self.starts else np.zeros(0, np.int64)
        length = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        order = np.lexsort((start, key))
        self.key, self.start, self.length = key[order], start[order], length[order]
        last = np.ones(len(self.key), bool)
        last[:-1] = self.key[1:] != self.key[:-1]
        self.split_keys, self.max_start = self.key[last], self.start[last]

    def final(self, w) -> np.ndarray:
        """Per entry of the window: whether it is its sample's last (or only) chunk in its epoch."""
        key = w.cols["epoch"].astype(np.int64)[w.parent()] * self.n + w.values("sample_ids")
        starts = w.values("sample_starts").astype(np.int64)
        at = np.searchsorted(self.split_keys, key)
        at_c = np.minimum(at, max(len(self.split_keys) - 1, 0))
        split = (at < len(self.split_keys)) & (self.split_keys[at_c] == key) if len(self.split_keys) else \
            np.zeros(len(key), bool)
        first = split & (starts == 0)
        if first.any():
            self.first_keys.append(key[first])
            self.first_lengths.append(w.values("sample_lengths")[first].astype(np.int64))
        return ~split | (starts == self.max_start[at_c] if len(self.split_keys) else True)

    def tiling(self) -> tuple[bool, np.ndarray, np.ndarray]:
        """(chunks tile [0, total) per split sample, the split keys, their total tokens)."""
        fk = np.concatenate(self.first_keys) if self.first_keys else np.zeros(0, np.int64)
        fl = np.concatenate(self.first_lengths) if self.first_lengths else np.zeros(0, np.int64)
        key = np.concatenate([fk, self.key])
        start = np.concatenate([np.zeros(len(fk), np.int64), self.start])
        length = np.concatenate([fl, self.length])
        order = np.lexsort((start, key))
        k, s, ln = key[order], start[order], length[order]
        if not len(k):
            return True, k, ln
        first = np.concatenate([[True], k[1:] != k[:-1]])
        expect = np.where(first, 0, np.concatenate([[0], (s + ln)[:-1]]))
        ok = bool((s == expect).all())
        heads = np.flatnonzero(first)
        return ok, k[heads], np.add.reduceat(ln, heads)


# -- metrics lengths, a range of sample ids at a time ---------------------------------------------
class MetricsLengths:
    """Lengths of sample ids ``[a, b)`` from a metrics or sorted directory (rows read piece by piece)."""

    PIECE = 1 << 22

    def __init__(self, path: str, manifest: dict):
        self.path, self.manifest = path, manifest
        self.n = int(manifest["num_rows"])

    def _pieces(self):
        from .runtime import artifacts

        for lo in range(0, self.n, self.PIECE):
            t = artifacts.read_row_range(self.path, self.manifest, lo, min(self.n, lo + self.PIECE),
                                         ["sample_id", "length"])
            yield lo, t.column("sample_id").to_numpy(), t.column("length").to_numpy()

    def range(self, a: int, b: int) -> np.ndarray:
        out = np.zeros(b - a, np.int64)
        for lo, ids, length in self._pieces():
            if len(ids) and int(ids[0]) == lo and int(ids[-1]) == lo + len(ids) - 1 and lo + len(ids) <= a:
                continue  # an identity piece below the range
            mine = (ids >= a) & (ids < b)
            out[ids[mine] - a] = length[mine]
        return out

    def longer_than(self, limit: int) -> Bitmap:
        bits = Bitmap(self.n)
        for _, ids, length in self._pieces():
            bits.set(ids[(length > limit) & (ids >= 0) & (ids < self.n)])
        return bits


def _completed(w, split: SplitChunks | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Per row: samples it completes; per entry: whether it is the sample's final chunk (None: all)."""
    if split is None:
        return w.cols["num_samples"].astype(np.int64), None
    final = split.final(w)
    return np.bincount(w.parent(), weights=final, minlength=w.n).astype(np.int64), final


def _row_targets(w, entry_len: np.ndarray, final: np.ndarray | None) -> np.ndarray:
    t = np.maximum(entry_len - 1, 0) if final is None else np.where(final, np.maximum(entry_len - 1, 0), entry_len)
    return np.bincount(w.parent(), weights=t, minlength=w.n)


def scan(config, meta: dict, pf, lengths: MetricsLengths | None) -> list[Check]:
    """Every check of ``varlen validate`` but the fingerprint, in windows (see the module docstring)."""
    dp, accum = int(meta["dp"]), int(meta["grad_accum"])
    slots = dp * accum
    packing = meta.get("packing")
    split = bool(packing and packing.get("split_long"))
    n = int(meta.get("input", {}).get("num_rows") or 0)
    pcfg = meta.get("config", {})
    names = pf.schema_arrow.names
    scalars = [c for c in names if c not in format.PLAN_LIST_COLUMNS]
    lists = [c for c in names if c in format.PLAN_LIST_COLUMNS]
    layout, counts = Layout(dp, accum, meta), Counts(bool(packing))
    coverage = Coverage(meta, n, split)
    budget = Budget({**pcfg, "attention_cost": (meta.get("budget") or {}).get("attention_cost", 0.0)}, packing)
    shapes, steps, lr = Shapes(meta, pcfg, slots), StepTotals(), Lr(meta)
    strag, loss = Straggler(meta), LossTokens()
    has_loss = "step_loss_tokens" in names
    chunks = None
    if split:
        chunks = SplitChunks(n)
        for w in plan_scan.windows(pf, ["epoch"], ["sample_ids", "sample_starts", "sample_lengths"], slots):
            chunks.collect(w)
        chunks.freeze()
    if lengths is not None and not coverage.listed:
        coverage.long_bitmap = lengths.longer_than(int((meta.get("dropped") or {}).get("too_long_over", 0)))
    memory_bt = [] if (config.max_memory is not None or config.memory_profile is not None) else None
    step_loss: list = []
    for w in plan_scan.windows(pf, scalars, lists, slots):
        completed, final = _completed(w, chunks)
        for check in (layout, counts, coverage, budget, shapes, strag):
            check.update(w)
        steps.update(w, completed)
        lr.update(w, completed)
        if has_loss and packing and "sample_lengths" in w.lists:
            loss.update(w, _row_targets(w, w.values("sample_lengths").astype(np.int64), final))
        elif has_loss and lengths is not None:
            step_loss.append(w.cols["step_loss_tokens"])
        if memory_bt is not None:
            memory_bt.append((w.cols["batch_size"], w.cols["seqlen"]))
    length_problems, tiling = [], []
    if split and chunks is not None:
        ok, keys, totals = chunks.tiling()
        if not ok:
            tiling.append("split chunks overlap or leave gaps")
    if lengths is not None and not coverage.outside:
        length_problems, padded_targets = _length_checks(pf, slots, lengths, packing, chunks, n)
        if split and chunks is not None and packing:
            ok, keys, totals = chunks.tiling()
            ids = keys % max(n, 1)
            want = np.concatenate([lengths.range(a, min(n, a + LENGTHS_PER_PASS))
                                   for a in range(0, max(n, 1), LENGTHS_PER_PASS)])[ids] if len(ids) else ids
            bad = int(np.count_nonzero(totals != want))
            if bad:
                tiling.append(f"{bad} (epoch, sample) pairs do not have all their tokens exactly once")
        if has_loss and not packing and padded_targets is not None:
            rows_loss = np.concatenate(step_loss) if step_loss else np.zeros(0, np.int64)
            _padded_loss(loss, padded_targets, rows_loss, slots)
    cov = coverage.result()
    if tiling:
        cov = Check("coverage", False, "; ".join(([cov.detail] if not cov.ok else []) + tiling))
    out = [layout.result(), counts.result(), cov, budget.result(length_problems), shapes.result(),
           steps.result(), lr.result()]
    if memory_bt is not None:
        from .memory.budget import memory_check

        b = np.concatenate([x[0] for x in memory_bt]) if memory_bt else np.zeros(0, np.int64)
        t = np.concatenate([x[1] for x in memory_bt]) if memory_bt else np.zeros(0, np.int64)
        out.append(Check("memory", *memory_check(b, t, meta, config.max_memory, config.memory_profile)))
    out.append(strag.result())
    if meta.get("loss_tokens") == "target_length":  # analyze --target-length: not derived from the lengths
        out.append(Check("loss tokens", True, "the plan counts the metrics' target_length (assistant tokens), not "
                         "lengths", skipped=True))
    elif not has_loss:
        out.append(Check("loss tokens", True, "plan has no step_loss_tokens column (older plan)", skipped=True))
    elif not packing and lengths is None:
        out.append(Check("loss tokens", True, "needs --metrics for a padded plan", skipped=True))
    else:
        out.append(loss.result())
    return out


def _length_checks(pf, slots: int, lengths: MetricsLengths, packing, chunks, n: int):
    """With --metrics: the longest sample of a padded microbatch fits its seqlen and its tokens column
    is the sum of its samples' lengths; the padded loss targets per row. One scan of the plan per
    :data:`LENGTHS_PER_PASS` sample ids."""
    if packing:
        return [], None
    rows = pf.metadata.num_rows
    tok = np.zeros(rows, np.int64)
    targets = np.zeros(rows, np.int64)
    short = np.zeros(rows, bool)
    tokens_col = np.zeros(rows, np.int64)
    for a in range(0, max(n, 1), LENGTHS_PER_PASS):
        b = min(n, a + LENGTHS_PER_PASS)
        part = lengths.range(a, b)
        for w in plan_scan.windows(pf, ["seqlen", "tokens"], ["sample_ids"], slots):
            ids = w.values("sample_ids").astype(np.int64)
            mine = (ids >= a) & (ids < b)
            parent = w.parent()[mine]
            ln = part[ids[mine] - a]
            _add(tok, w.first_row, parent, ln, w.n)
            _add(targets, w.first_row, parent, np.maximum(ln - 1, 0), w.n)
            longest = np.zeros(w.n, np.int64)
            np.maximum.at(longest, parent, ln)
            rows_w = slice(w.first_row, w.first_row + w.n)
            short[rows_w] |= longest > w.cols["seqlen"]
            if a == 0:
                tokens_col[rows_w] = w.cols["tokens"]
    problems = []
    if short.any():
        problems.append(f"{int(short.sum())} microbatches have a sample longer than their seqlen")
    if (tok != tokens_col).any():
        problems.append("tokens column differs from the sum of the samples' lengths")
    return problems, targets


def _add(acc: np.ndarray, first: int, parent: np.ndarray, values: np.ndarray, count: int) -> None:
    acc[first:first + count] += np.bincount(parent, weights=values, minlength=count).astype(np.int64)


def _padded_loss(loss: LossTokens, targets: np.ndarray, step_loss: np.ndarray, slots: int) -> None:
    if not len(targets) or len(targets) % slots:
        return
    per_step = targets.reshape(-1, slots).sum(axis=1)
    want = np.repeat(per_step, slots)
    bad = want != step_loss
    loss.bad += int(np.count_nonzero(bad))
    loss.bad_steps += (np.flatnonzero(bad) // slots)[:MAX_EXAMPLES].tolist()
