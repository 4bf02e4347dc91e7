"""The rank layout's own contract, read straight from its output (not from a written plan, whose rank
column is derived from the row position and so stays valid whatever the layout did): in every step,
every data-parallel rank gets exactly ``grad_accum`` microbatches, micro 0..grad_accum-1, and the
layout's rows are in (step, rank, micro) order. Padded and packed microbatches, LPT and serpentine
dealing (more than ``LPT_MAX_DP`` ranks), compile warm-up, same shape per step, static shapes and
rows already dealt over ranks (attention-balanced packing)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from varlen_cli.plan import layout
from varlen_cli.plan.batching import Microbatches

DP = st.one_of(st.integers(1, 9), st.integers(layout.LPT_MAX_DP - 2, layout.LPT_MAX_DP + 6))


def _per_rank(rank: np.ndarray, step: np.ndarray, steps: int, dp: int) -> np.ndarray:
    """Microbatches of each (step, rank)."""
    return np.bincount(step * dp + rank, minlength=steps * dp).reshape(steps, dp)


@settings(max_examples=120, deadline=None)
@given(dp=DP, grad_accum=st.integers(1, 4), steps=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_assign_ranks_gives_every_rank_grad_accum_a_step(dp, grad_accum, steps, seed):
    rng = np.random.default_rng(seed)
    slots = dp * grad_accum
    cost = rng.integers(1, 4, (steps, slots)).astype(np.float64)  # many ties
    rank = layout.assign_ranks(cost, dp, grad_accum)
    assert rank.shape == (steps, slots) and rank.min() >= 0 and rank.max() < dp
    step = np.repeat(np.arange(steps), slots)
    assert (_per_rank(rank.reshape(-1), step, steps, dp) == grad_accum).all()


def _microbatches(rng, m: int, packed: bool) -> Microbatches:
    if packed:  # R rows of T tokens each, some of their tokens used
        seqlen, batch = np.full(m, 512, np.int64), np.full(m, 2, np.int64)
    else:
        seqlen, batch = rng.choice([16, 64, 128, 512], m).astype(np.int64), rng.integers(1, 9, m)
    tokens = np.minimum(batch * seqlen, rng.integers(1, 1024, m))
    return Microbatches(np.arange(m), np.arange(m + 1), seqlen, batch, tokens)


@settings(max_examples=150, deadline=None)
@given(dp=DP, grad_accum=st.integers(1, 4), steps=st.integers(1, 5), packed=st.booleans(),
       warmup=st.booleans(), same_shape=st.booleans(), static=st.booleans(), ranked=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_layout_gives_every_rank_grad_accum_a_step(dp, grad_accum, steps, packed, warmup, same_shape, static,
                                                    ranked, seed):
    rng = np.random.default_rng(seed)
    slots = dp * grad_accum
    m = steps * slots
    mb = _microbatches(rng, m, packed)
    same_shape = same_shape or packed  # packed microbatches all have one shape
    if same_shape:
        layout.same_shape_steps(mb, slots)
    ranked = ranked and packed  # rows dealt over rank-steps already (balance.balance_rows)
    cost = rng.integers(1, 6, m).astype(np.float64)
    lay = layout.layout_epoch(mb, cost, dp, grad_accum, warmup=warmup, same_shape=same_shape, static=static,
                              ranked=ranked)
    assert sorted(lay.order.tolist()) == list(range(m))  # every microbatch once
    assert (_per_rank(lay.rank, lay.step, steps, dp) == grad_accum).all()
    position = np.arange(m)
    assert np.array_equal(lay.step, position // slots)  # (step, rank, micro) order: the rows the plan writes
    assert np.array_equal(lay.rank, (position % slots) // grad_accum)
    assert np.array_equal(lay.micro, position % grad_accum)
    if ranked and not warmup:  # dealt ranks are kept
        assert np.array_equal(lay.order, position)
