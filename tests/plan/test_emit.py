"""Phase 3's readers and lookups (issue 25): a row group's items read from the chunk files by runs are
the rows' item ranges in row order, whatever the rows, chunks and run gap; the spill's item dtype holds
every value (uint16 up to 65,535 exactly), and a chunked plan holding a 65,536-token sample validates;
the shape ids looked up in a table are the binary search's; the seqlens the plan's check counts are the
distinct values it was fed, split among checkers and merged in any order."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from varlen_cli.checks import DENSE_SEQLEN, Shapes
from varlen_cli.plan.chunked import emit
from varlen_cli.plan.chunked.finish import Finished
from varlen_cli.plan.chunked.spill import ItemReader, job_name, stored_dtype


def _chunk_files(directory, k: int, ids: np.ndarray, lengths: np.ndarray, base: int) -> ItemReader:
    """One chunk's item files as phase 1 writes them (ids as uint32 offsets from ``base``, lengths as
    uint16 where they fit), and its reader."""
    name = directory / job_name(0, k)
    (ids - base).astype(np.uint32).tofile(f"{name}.ids.bin")
    stored = stored_dtype(lengths)
    lengths.astype(stored).tofile(f"{name}.sample_length.bin")
    header = {"epoch": 0, "chunk": k, "ids_base": base, "ids_dtype": "uint32", "item_arrays": ["ids", "sample_length"],
              "item_dtypes": {"sample_length": np.dtype(stored).name}}
    return ItemReader(str(directory), SimpleNamespace(header=header))


@st.composite
def _groups(draw):
    sizes = draw(st.lists(st.integers(1, 300), min_size=1, max_size=4))
    rows = []
    for _ in range(draw(st.integers(0, 40))):
        k = draw(st.integers(0, len(sizes) - 1))
        lo = draw(st.integers(0, sizes[k]))
        rows.append((k, lo, draw(st.integers(0, sizes[k] - lo))))
    return sizes, rows, draw(st.sampled_from([0, 1, 5, 1 << 16])), draw(st.integers(0, 2**40))


@settings(max_examples=60, deadline=None)
@given(_groups())
def test_group_items_are_the_rows_item_ranges_in_row_order(tmp_path_factory, case):
    sizes, rows, gap, base = case
    directory = tmp_path_factory.mktemp("items")
    rng = np.random.default_rng(len(rows))
    ids = [base + k * 1000 + rng.permutation(n).astype(np.int64) for k, n in enumerate(sizes)]
    lengths = [rng.integers(0, 1 << (16 if k % 2 else 20), n).astype(np.int64) for k, n in enumerate(sizes)]
    readers = [_chunk_files(directory, k, ids[k], lengths[k], base) for k in range(len(sizes))]
    chunk = np.array([r[0] for r in rows], np.int32)
    item_lo = np.array([r[1] for r in rows], np.uint32)
    count = np.array([r[2] for r in rows], np.int32)
    was, emit.GAP = emit.GAP, gap
    try:
        got, offsets = emit.GroupItems(readers, ("ids", "sample_length")).read(chunk, item_lo, count)
    finally:
        emit.GAP = was
        for r in readers:
            r.close()
    want_ids = [ids[k][lo:lo + n] for k, lo, n in rows]
    want_len = [lengths[k][lo:lo + n] for k, lo, n in rows]
    assert offsets.tolist() == np.concatenate([[0], np.cumsum(count)]).tolist()
    assert got["ids"].dtype == np.int64 and got["sample_length"].dtype == np.int32
    assert got["ids"].tolist() == (np.concatenate(want_ids).tolist() if rows else [])
    assert got["sample_length"].tolist() == (np.concatenate(want_len).tolist() if rows else [])


@pytest.mark.parametrize("top, dtype", [(0, np.uint16), (65_535, np.uint16), (65_536, np.int32), (65_537, np.int32),
                                        (-1, np.int32)])
def test_spill_item_dtype_holds_every_value(tmp_path, top, dtype):
    """The spill's rule, called: uint16 exactly while every value is in 0..65,535; the values read back."""
    values = np.array([5, top, 0], np.int64)
    assert stored_dtype(values) == np.dtype(dtype)
    reader = _chunk_files(tmp_path, 0, np.arange(3, dtype=np.int64), values, 0)
    try:
        assert reader.read("sample_length", 0, 3).tolist() == values.tolist()
    finally:
        reader.close()


def test_a_chunked_plan_of_a_65536_token_sample_validates(tmp_path):
    """Samples of 65,535, 65,536 and 65,537 tokens among short ones, in a packed plan of three chunks: the
    plan's lengths are the samples' (none stored as 0 by a uint16 spill) and it passes validate."""
    from tests.plan_helpers import write_metrics
    from varlen_cli.plan import PlanConfig, plan
    from varlen_cli.validate import ValidateConfig, validate

    lengths = np.random.default_rng(0).integers(1, 3000, 60)
    lengths[[7, 29, 50]] = [65_535, 65_536, 65_537]
    metrics = write_metrics(tmp_path / "m", lengths)
    out = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=metrics, output=out, packing=True, seq_len=70_000, chunk_samples=20, dp=2,
                    progress=False))
    t = pq.read_table(out, columns=["sample_ids", "sample_lengths"]).to_pydict()
    got = {i: n for ids, ns in zip(t["sample_ids"], t["sample_lengths"]) for i, n in zip(ids, ns)}
    assert got == {i: int(n) for i, n in enumerate(lengths)}
    assert validate(ValidateConfig(plan=out, metrics=metrics)).ok


def _finished(keys: np.ndarray, fixed_b: bool) -> Finished:
    return Finished([0], np.zeros(1), np.zeros(1), np.zeros(1), np.zeros(1), keys, fixed_b, {}, {}, np.zeros(0))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 1 << 15), min_size=1, max_size=30, unique=True), st.booleans(),
       st.lists(st.integers(0, 1 << 10), min_size=0, max_size=50))
def test_shape_ids_looked_up_are_the_binary_searchs(seqlens, fixed_b, picks):
    bs = np.arange(1, len(seqlens) + 1, dtype=np.int64)
    keys = np.sort((bs if fixed_b else np.zeros(len(bs), np.int64)) << 32 | np.array(seqlens, np.int64))
    fin = _finished(keys, fixed_b)
    rows = keys[np.array(picks, np.int64) % len(keys)]
    batch, seqlen = rows >> 32, rows & 0xFFFFFFFF
    want = np.searchsorted(keys, (batch if fixed_b else 0) << 32 | seqlen)
    assert fin.shape_id(batch, seqlen).tolist() == want.tolist()
    assert fin.shape_id(batch, np.array([int(keys[-1] & 0xFFFFFFFF) + 5] * len(batch), np.int64)).dtype == np.int32
    assert (fin._by_seqlen is None) == fixed_b
    assert pickle.loads(pickle.dumps(fin)).shape_id(batch, seqlen).tolist() == want.tolist()  # the workers' copy


_SEQLEN = st.one_of(st.integers(0, 5000), st.sampled_from([-7, -1, DENSE_SEQLEN - 1, DENSE_SEQLEN, 1 << 40]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(_SEQLEN, max_size=30), min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_distinct_seqlens_of_merged_checkers_are_the_distinct_values(windows, rnd):
    def checker(parts):
        shapes = Shapes({"shapes": [[0, 1]], "config": {}})
        for t in parts:
            t = np.array(t, np.int64)
            shapes.update(SimpleNamespace(cols={"seqlen": t, "shape_id": np.zeros(len(t), np.int32),
                                                "batch_size": np.ones(len(t), np.int32)}))
        return shapes

    checkers = [checker([w]) for w in windows]
    rnd.shuffle(checkers)
    merged = checkers[0]
    for other in checkers[1:]:
        merged.merge(pickle.loads(pickle.dumps(other)))
    assert merged.distinct_seqlens() == len({t for w in windows for t in w})
    assert merged.distinct_seqlens() == checker(windows).distinct_seqlens()
