"""varlen_cli.runtime.series (issue 35): series kept in buckets of steps, summed window by window,
equal the buckets computed from the whole series at once, whatever the windows."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from varlen_cli.runtime.series import BucketMatrix, Buckets, bucket_edges

values_st = st.lists(st.one_of(st.floats(-1e6, 1e6, allow_nan=False), st.just(float("nan"))), min_size=1,
                     max_size=120)


@given(values_st, st.integers(1, 40), st.lists(st.integers(0, 120), max_size=8))
def test_buckets_in_any_windows_equal_the_whole_series(values, count, cuts):
    v = np.array(values)
    n = len(v)
    b = Buckets(n, count)
    bounds = sorted({c % (n + 1) for c in cuts} | {0, n})
    for lo, hi in zip(bounds, bounds[1:]):  # windows of consecutive steps, in order
        b.add(np.arange(lo, hi), v[lo:hi])
    edges = b.edges
    assert edges[0] == 0 and edges[-1] == n and len(edges) == min(count, n) + 1 and np.all(np.diff(edges) >= 1)
    out = b.to_json()
    for k in range(len(edges) - 1):
        part = v[edges[k]:edges[k + 1]]
        kept = part[np.isfinite(part)]
        if not len(kept):
            assert out["min"][k] is None and out["mean"][k] is None and out["max"][k] is None
            continue
        assert (out["min"][k], out["max"][k]) == (kept.min(), kept.max())  # the extremes, exactly
        assert np.isclose(out["mean"][k], kept.mean(), rtol=1e-9, atol=1e-6)
    summary = b.summary()
    kept = v[np.isfinite(v)]
    assert summary.get("non_finite", 0) == n - len(kept)
    if len(kept):
        assert (summary["min"], summary["max"]) == (kept.min(), kept.max())


@given(st.integers(0, 500), st.integers(1, 50))
def test_edges_cover_every_step_once(total, count):
    edges = bucket_edges(total, count)
    assert edges[0] == 0 and edges[-1] == total and len(edges) == min(count, total) + 1
    sizes = np.diff(edges)
    assert total == 0 or (sizes.min() >= 1 and sizes.max() - sizes.min() <= 1)  # nearly equal buckets


def test_bucket_matrix_sums_rows_and_grows():
    m = BucketMatrix(6, 3, rows=2)  # steps 0-1, 2-3, 4-5
    m.add([0, 1, 5], [0, 1, 1], [1.0, 2.0, 3.0])
    m.add([3], [3], [4.0])  # a row past the ones it was made for (a damaged plan's rank)
    assert m.sums.tolist() == [[1.0, 0.0, 0.0], [2.0, 0.0, 3.0], [0.0, 0.0, 0.0], [0.0, 4.0, 0.0]]
    assert m.steps().tolist() == [2.0, 2.0, 2.0]
