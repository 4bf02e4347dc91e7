"""Helpers for the packing tests: an invariant checker and a textbook (per-item) best-fit decreasing."""

from __future__ import annotations

import numpy as np


def check_packing(p, lengths, seq_len, max_per_row=None, split_long=False, drop_long=False):
    """Assert every invariant of a :class:`varlen_cli.plan.packing.Packing` against its input."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    assert p.seq_len == seq_len and p.num_samples == n
    for name in ("item_sample", "item_start", "item_length", "item_row", "dropped"):
        assert getattr(p, name).dtype == np.int64, name
    m = p.num_items
    assert len(p.item_start) == len(p.item_length) == len(p.item_row) == m
    # rows: numbered 0..num_rows-1, items sorted by row, no empty row, none over T, cap respected
    assert np.all(np.diff(p.item_row) >= 0)
    if m:
        assert p.item_row.min() == 0 and p.item_row.max() == p.num_rows - 1
    spr = np.bincount(p.item_row, minlength=p.num_rows)
    assert len(spr) == p.num_rows and np.all(spr >= 1)
    assert np.array_equal(spr, p.samples_per_row())
    assert np.all(p.row_tokens() <= seq_len)
    if max_per_row is not None:
        assert spr.max(initial=0) <= max_per_row
    assert np.all(p.item_length <= seq_len) and np.all(p.item_length >= 0)
    # dropped: exactly the too-long samples with drop_long, nothing otherwise
    long_ids = np.flatnonzero(lengths > seq_len)
    if drop_long:
        assert np.array_equal(np.sort(p.dropped), long_ids)
    else:
        assert len(p.dropped) == 0
    kept = np.ones(n, dtype=bool)
    kept[p.dropped] = False
    # every token of every kept sample exactly once: the items of a sample tile [0, length)
    o = np.lexsort((p.item_start, p.item_sample))
    s, st, ln = p.item_sample[o], p.item_start[o], p.item_length[o]
    assert np.array_equal(np.unique(s), np.flatnonzero(kept))
    first = np.r_[True, s[1:] != s[:-1]] if m else np.zeros(0, dtype=bool)
    assert np.all(st[first] == 0)
    assert np.all(st[1:][~first[1:]] == (st + ln)[:-1][~first[1:]])  # chunks are contiguous
    cover = np.bincount(s, weights=ln, minlength=n).astype(np.int64)
    assert np.array_equal(cover[kept], lengths[kept])
    chunks = np.bincount(s, minlength=n)
    if split_long:
        assert np.array_equal(chunks[kept], np.maximum(1, -(-lengths[kept] // seq_len)))
        # two chunks of a sample never share a row
        pairs = np.unique(np.stack([p.item_sample, p.item_row]), axis=1)
        assert pairs.shape[1] == m
    else:
        assert np.all(chunks[kept] == 1)
    # statistics
    assert p.tokens == int(lengths[kept].sum())
    if p.num_rows:
        assert abs(p.efficiency - p.tokens / (p.num_rows * seq_len)) < 1e-12
        assert p.num_rows >= p.min_rows
        assert p.efficiency <= p.efficiency_bound + 1e-12
    # item offsets: the items of a row are laid out left to right without gaps
    off = p.item_offset()
    if m:
        assert np.all(off + p.item_length <= seq_len)
        firsts = p.row_offsets()[:-1]
        assert np.all(off[firsts] == 0)


def reference_bfd(lengths, seq_len, max_per_row=None):
    """Textbook best-fit decreasing, one item at a time: the number of rows it opens."""
    cap = max_per_row or 1 << 62
    space, count = [], []
    for L in sorted((int(x) for x in lengths if x > 0), reverse=True):
        best = -1
        for i, r in enumerate(space):
            if L <= r and count[i] < cap and (best < 0 or r < space[best]):
                best = i
        if best < 0:
            space.append(seq_len - L)
            count.append(1)
        else:
            space[best] -= L
            count[best] += 1
    return len(space)


def heavy_tailed_lengths(n, seq_len, seed=0):
    """A heavy-tailed corpus with many tiny samples (synthetic, numpy only): 60% tiny samples under
    1% of ``seq_len`` (chat turns, glosses: lognormal around T/400), 22% fortune-like short texts
    (lognormal, median ~75 tokens) and 18% manual-page-paragraph-like ones (lognormal, median ~110,
    a tail of thousands of tokens), clipped to [1, seq_len]."""
    rng = np.random.default_rng(seed)
    kind = rng.random(n)
    tiny_hi = max(2, seq_len // 100)
    tiny = np.minimum(rng.lognormal(np.log(tiny_hi / 4), 0.8, n).astype(np.int64) + 1, tiny_hi - 1)
    fortune = rng.lognormal(np.log(75), 0.8, n).astype(np.int64)
    paragraph = rng.lognormal(np.log(110), 1.0, n).astype(np.int64)
    out = np.where(kind < 0.6, tiny, np.where(kind < 0.82, fortune, paragraph))
    return np.clip(out, 1, seq_len).astype(np.int64)
