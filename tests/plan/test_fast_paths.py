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
    from varlen_cli.plan.cost_model import longest_fitting
    from varlen_cli.plan.shapes import ShapeMap

    length = np.array(lengths, dtype=np.int64)
    b, shape = Budget(budget, max_samples, attention), ShapeMap(pad)
    want = ~b.fits(1, shape.pad(length))
    assert np.array_equal(length > longest_fitting(length, b, shape), want)


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(1, 6), min_size=1, max_size=40), seed=st.integers(0, 2**32 - 1))
def test_a_deferred_reorder_then_take_equals_two_takes(counts, seed):
    from varlen_cli.plan.batching import Microbatches

    rng = np.random.default_rng(seed)
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    m = len(counts)
    mb = Microbatches(rng.permutation(int(off[-1])).astype(np.int32), off, rng.integers(1, 99, m),
                      rng.integers(1, 9, m), rng.integers(1, 999, m))
    first, second, third = rng.permutation(m), rng.permutation(m), rng.permutation(m)[: max(1, m // 2)]
    lazy = mb.reordered(first).reordered(second)
    lazy.seqlen = lazy.seqlen + 1  # changed in between (same shape per step does this): kept by the take
    want = mb.take(first).take(second)
    want.seqlen = want.seqlen + 1
    want, got = want.take(third), lazy.take(third)
    assert lazy.samples is None and lazy.count == m
    for name in ("samples", "offsets", "seqlen", "batch_size", "tokens"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name


def test_arrow_conversions_keep_values_and_import_no_pandas():
    import subprocess
    import sys

    code = """
import sys, numpy as np, pyarrow as pa
from varlen_cli.plan.arrow_io import list_array, to_arrow, to_numpy
v = np.array([5, -1, 2**40], np.int64)
a = to_arrow(v, pa.int64())
assert a.to_pylist() == [5, -1, 2**40]
assert to_arrow(np.array([1, 2], np.int64), pa.int32()).type == pa.int32()
lst = list_array(np.array([0, 2, 3], np.int32), np.array([7, 8, 9], np.int32), pa.list_(pa.int64()))
assert lst.to_pylist() == [[7, 8], [9]] and lst.type == pa.list_(pa.int64())
assert to_numpy(a.slice(1, 2)).tolist() == [-1, 2**40]
assert "pandas" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_missing_length_is_an_input_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest

    from tests.plan_helpers import write_metrics
    from varlen_cli.errors import InputError
    from varlen_cli.plan.chunked.chunks import InputRows
    from varlen_cli.runtime import artifacts

    d = write_metrics(tmp_path / "m", [3, 4, 5])
    part = str(tmp_path / "m" / artifacts.part_name(0))
    pq.write_table(pa.table({"sample_id": pa.array([0, 1, 2], pa.int64()), "length": pa.array([3, None, 5], pa.int64()),
                             "difficulty": pa.array([3.0, 4.0, 5.0])}), part)
    with pytest.raises(InputError, match=r"has missing values in column 'length'$"):
        InputRows(d, artifacts.read_manifest(d)).read(0, 3)


def test_freed_memory_reuse_is_scoped():
    from varlen_cli.plan.heap import reuse_freed_memory

    with reuse_freed_memory():
        a = np.ones(8 << 20, np.int64)  # 64 MB: from the heap while inside
        del a
        b = np.zeros(8 << 20, np.int64)
        assert int(b.sum()) == 0
    c = np.ones(8 << 20, np.int64)
    assert int(c.sum()) == 8 << 20
