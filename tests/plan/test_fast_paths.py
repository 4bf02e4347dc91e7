"""The narrow-dtype fast paths of the planner (issue 13) give exactly what the plain int64 code gives."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from varlen_cli.plan.batching import bucket_sequence, greedy_offsets, segment_gather, stable_argsort_int
from varlen_cli.plan.shapes import Budget


def _bucket_reference(canon, padded, rng):
    perm = rng.permutation(len(canon))
    order = perm[stable_argsort_int(padded[perm].astype(np.int64))]
    return canon[order], padded[order]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), hi=st.sampled_from([3, 200, 16384, 70000]), seed=st.integers(0, 2**32 - 1),
       identity=st.booleans())
def test_bucket_sequence_matches_the_int64_reference(n, hi, seed, identity):
    data = np.random.default_rng(seed)
    padded = data.integers(1, hi + 1, n).astype(np.int32)
    canon = np.arange(n, dtype=np.int32) if identity else np.sort(data.choice(4 * n, n, replace=False))
    got_seq, got_pad = bucket_sequence(canon, padded, np.random.default_rng(seed))
    want_seq, want_pad = _bucket_reference(canon, padded, np.random.default_rng(seed))
    assert np.array_equal(got_seq, want_seq) and np.array_equal(got_pad, want_pad)


def _greedy_reference(cap: np.ndarray) -> list:
    """Each microbatch takes the next samples while its count stays <= the smallest cap of its members."""
    off, i, n = [0], 0, len(cap)
    while i < n:
        j, low = i, cap[i]
        while j < n and j - i + 1 <= min(low, cap[j]):
            low = min(low, cap[j])
            j += 1
        i = max(j, i + 1)
        off.append(i)
    return off


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=400), budget=st.integers(5000, 40000))
def test_greedy_cut_of_sorted_lengths_matches_a_plain_loop(lengths, budget):
    padded = np.sort(np.array(lengths, dtype=np.int32))
    cap = Budget(budget).cap(padded)
    assert greedy_offsets(padded, cap).tolist() == _greedy_reference(cap.astype(np.int64))


def test_int32_paths_keep_values():
    t = np.random.default_rng(0).integers(1, 20000, 10000).astype(np.int32)
    b = Budget(65536, max_samples=40)
    assert np.array_equal(b.cap(t), b._cap(t.astype(np.int64)))  # the table path (len > 4096)
    starts, counts = np.array([5, 0, 9]), np.array([2, 3, 1])
    new_off = np.concatenate([[0], np.cumsum(counts)])
    assert segment_gather(starts, counts, new_off).tolist() == [5, 6, 0, 1, 2, 9]


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(0, 70000), min_size=1, max_size=300), budget=st.integers(1, 66000),
       pad=st.sampled_from([1, 8, 64, 1000]), attention=st.sampled_from([0.0, 1e-4, 0.01]),
       max_samples=st.sampled_from([None, 1, 4]))
def test_too_long_threshold_matches_the_per_sample_test(lengths, budget, pad, attention, max_samples):
    from varlen_cli.plan.core import _longest_fitting
    from varlen_cli.plan.shapes import ShapeMap

    length = np.array(lengths, dtype=np.int64)
    b, shape = Budget(budget, max_samples, attention), ShapeMap(pad)
    want = ~b.fits(1, shape.pad(length))
    assert np.array_equal(length > _longest_fitting(length, b, shape), want)
