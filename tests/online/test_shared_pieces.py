"""The planner pieces the online planner added or sped up (varlen_cli/plan/): pack_into (a step's rows
dealt), greedy_weighted_offsets (whole groups) and assign_ranks' heap for a few steps (the same ranks
as the vectorised LPT)."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from varlen_cli.plan import batching, layout
from varlen_cli.plan.packing import pack, pack_into

SETTINGS = settings(max_examples=int(os.environ.get("ONLINE_EXAMPLES", "80")), deadline=None)


@SETTINGS
@given(st.lists(st.integers(0, 1000), max_size=400), st.integers(1000, 4000), st.floats(0.9, 1.2), st.booleans())
def test_pack_into_is_a_packing(lengths, seq_len, slack, split):
    lengths = np.array(lengths, np.int64) * (3 if split else 1)
    bound = max(-(-int(lengths.sum()) // seq_len), 1)
    rows = max(1, int(bound * slack))
    p = pack_into(lengths, seq_len, rows, split_long=split)
    # every token of every sample once, in rows of at most seq_len, rows numbered densely, none empty
    assert np.bincount(p.item_row, weights=p.item_length, minlength=p.num_rows).max(initial=0) <= seq_len
    assert p.num_rows == len(np.unique(p.item_row)) and (np.diff(p.item_row) >= 0).all()
    got = np.bincount(p.item_sample, weights=p.item_length, minlength=len(lengths))
    assert np.array_equal(got, lengths) and sorted(set(p.item_sample.tolist())) == list(range(len(lengths)))
    if len(lengths) and rows >= pack(lengths, seq_len, order="none", split_long=split).num_rows + 2:
        assert p.num_rows <= rows  # room for BFD and two rows more: the deal fits


def test_pack_into_same_arguments_same_packing():
    lengths = np.random.default_rng(1).integers(1, 3000, 2000)
    a, b = pack_into(lengths, 8192, 300), pack_into(lengths, 8192, 300)
    assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("item_sample", "item_row", "item_start"))


@SETTINGS
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 200)), max_size=60), st.integers(200, 3000))
def test_greedy_weighted_offsets_is_the_greedy(units, budget):
    units = sorted((t, w) for w, t in units if w * t <= budget)  # by padded length, each unit fits alone
    t = np.array([u[0] for u in units], np.int64)
    w = np.array([u[1] for u in units], np.int64)
    cap = budget // np.maximum(t, 1)
    off = batching.greedy_weighted_offsets(cap, w)
    ref, i = [0], 0
    while i < len(units):  # take the next units while the samples fit the last (longest) one's cap
        j = i + 1
        while j < len(units) and w[i:j + 1].sum() <= cap[j]:
            j += 1
        ref.append(j)
        i = j
    assert off.tolist() == (ref if units else [0])


@SETTINGS
@given(st.integers(1, 6), st.integers(1, 9), st.integers(1, 5), st.integers(0, 99))
def test_assign_ranks_heap_is_the_vectorised_lpt(dp, grad_accum, steps, seed):
    rng = np.random.default_rng(seed)
    cost = np.round(rng.random((steps, dp * grad_accum)) * 4) / 4  # many ties
    heap = layout.assign_ranks(cost, dp, grad_accum)
    old, layout.LPT_HEAP_MAX_STEPS = layout.LPT_HEAP_MAX_STEPS, -1
    try:
        assert np.array_equal(heap, layout.assign_ranks(cost, dp, grad_accum))
    finally:
        layout.LPT_HEAP_MAX_STEPS = old
