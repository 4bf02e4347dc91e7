"""Every source format ``varlen analyze`` reads, file order, directories, globs and byte-range chunks."""

from __future__ import annotations

import io
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.analyze_helpers import (
    ipc_bytes,
    run,
    text_table,
    write_arrow_file,
    write_arrow_stream,
    write_hf_save_to_disk,
    write_jsonl,
    write_parquet,
    write_text,
)
from varlen_cli.analyze.sources import SourceFile, _read_text, discover, make_units

N = 300


def _check_rows(table: pa.Table, texts: list[str], ids: list[int]) -> None:
    """sample_id 0..n-1, chars lengths of ``texts``, and difficulty = the id column (so row order)."""
    assert table.column("sample_id").to_pylist() == list(range(len(texts)))
    assert table.column("length").to_pylist() == [len(t) for t in texts]
    assert table.column("difficulty").to_pylist() == [float(i) for i in ids]
    assert table.schema.field("sample_id").type == pa.int64()
    assert table.schema.field("length").type == pa.int64()
    assert table.schema.field("difficulty").type == pa.float64()


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "jsonl.gz", "arrow-file", "arrow-stream", "hf-save-to-disk"])
def test_each_format_gives_rows_in_order(tmp_path, fmt):
    table = text_table(N, seed=1)
    if fmt == "parquet":
        src = write_parquet(table, tmp_path / "d.parquet", row_group_size=37)
        assert pq.ParquetFile(src).num_row_groups == 9
    elif fmt == "jsonl":
        src = write_jsonl(table, tmp_path / "d.jsonl", blank_lines=True)  # blank lines are skipped
    elif fmt == "jsonl.gz":
        src = write_jsonl(table, tmp_path / "d.jsonl.gz", gz=True)
    elif fmt == "arrow-file":
        src = write_arrow_file(table, tmp_path / "d.arrow")
    elif fmt == "arrow-stream":
        src = write_arrow_stream(table, tmp_path / "d.arrow")
    else:
        src = write_hf_save_to_disk(table, tmp_path / "hf", num_shards=3)
    res, got = run(tmp_path / "out", src, length="chars:text", difficulty="value:id")
    _check_rows(got, table.column("text").to_pylist(), table.column("id").to_pylist())
    assert res.num_samples == N
    ds = res.manifest["dataset"]
    assert ds["num_rows"] == N and sum(f["rows"] for f in ds["files"]) == N
    assert ds["num_files"] == (3 if fmt == "hf-save-to-disk" else 1)


def test_plain_text_lines(tmp_path):
    # CRLF, empty lines, non-ASCII, and a last line without a newline.
    lines = ["first line", "", "  indented\tand tabbed", "ünïcödé 日本語", "", "last"]
    lf = write_text(lines, tmp_path / "a.txt", trailing=False)
    crlf = write_text(lines, tmp_path / "b.txt", newline="\r\n", trailing=True)
    _, got = run(tmp_path / "out1", lf, length="chars:text")
    assert got.column("length").to_pylist() == [len(s) for s in lines]
    _, got2 = run(tmp_path / "out2", crlf, length="bytes:text")
    assert got2.column("length").to_pylist() == [len(s.encode()) for s in lines]
    # Both files together: a.txt's rows first (sorted path order), ids continue across files.
    res, both = run(tmp_path / "out3", crlf, lf, length="chars:text")
    assert both.column("sample_id").to_pylist() == list(range(2 * len(lines)))
    assert both.column("length").to_pylist() == [len(s) for s in lines] * 2
    assert [f["path"] for f in res.manifest["dataset"]["files"]] == ["a.txt", "b.txt"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.lists(st.sampled_from(["a", "é", "\n", "\r\n", "\r", " ", "xyz"]), max_size=40).map("".join),
       chunk=st.integers(1, 12))
def test_text_reader_matches_python_lines(tmp_path, data, chunk):
    """Lines split at "\\n", "\\r\\n" and a lone "\\r", in any byte-range chunking, match Python's reading."""
    raw = data.encode()
    path = tmp_path / "h.txt"
    path.write_bytes(raw)
    f = discover([str(path)])[0] if raw else SourceFile(str(path), "text", 0)
    lines = []
    for unit in make_units([f], chunk_bytes=chunk):
        lines.extend(_read_text(f, unit).column("text").to_pylist())
    # Python's universal-newline reading, as the datasets text loader does it.
    text = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8", newline=None).read()
    expected = [line.rstrip("\n") for line in io.StringIO(text).readlines()]
    assert lines == expected


def test_sorted_path_order_directories_and_globs(tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "_skipped").mkdir()
    (data / ".hidden").mkdir()
    t = [text_table(40, seed=s, first_id=100 * s) for s in range(5)]
    write_parquet(t[1], data / "b.parquet")
    write_parquet(t[0], data / "a.parquet")
    write_parquet(t[2], data / "c.parquet")
    write_parquet(t[3], data / "sub" / "d.parquet")
    write_parquet(t[4], data / "_skipped" / "x.parquet")
    write_parquet(t[4], data / ".hidden" / "x.parquet")
    write_parquet(t[4], data / "_metadata.parquet")
    (data / "README.md").write_text("not data")
    expected_ids = [i for k in range(4) for i in t[k].column("id").to_pylist()]
    expected_len = [len(s) for k in range(4) for s in t[k].column("text").to_pylist()]

    res, got = run(tmp_path / "o1", data, length="chars:text", difficulty="value:id")
    assert got.column("difficulty").to_pylist() == [float(i) for i in expected_ids]
    assert got.column("length").to_pylist() == expected_len
    assert [f["path"] for f in res.manifest["dataset"]["files"]] == ["a.parquet", "b.parquet", "c.parquet",
                                                                     "sub/d.parquet"]
    # Files given in any order, globs (recursive too), duplicates: the same sorted file list.
    _, got2 = run(tmp_path / "o2", data / "sub" / "d.parquet", str(data / "*.parquet"), data / "c.parquet",
                  data / "a.parquet", length="chars:text", difficulty="value:id")
    assert ipc_bytes(got2) == ipc_bytes(got)
    _, got3 = run(tmp_path / "o3", str(data / "**" / "[abcd].*"), length="chars:text", difficulty="value:id")
    assert ipc_bytes(got3) == ipc_bytes(got)


@pytest.mark.parametrize("fmt", ["jsonl", "text"])
def test_byte_range_chunks_give_identical_output(tmp_path, fmt):
    table = text_table(500, seed=3)
    texts = table.column("text").to_pylist()
    if fmt == "jsonl":
        src = write_jsonl(table, tmp_path / "big.jsonl", blank_lines=True)
    else:
        src = write_text(texts, tmp_path / "big.txt", newline="\r\n")
    many = make_units(discover([src]), chunk_bytes=512)
    assert len(many) > 20
    _, whole = run(tmp_path / "whole", src, length="words:text")
    res, chunked = run(tmp_path / "chunked", src, length="words:text", chunk_bytes=512)
    assert ipc_bytes(chunked) == ipc_bytes(whole)
    assert whole.column("length").to_pylist() == [len(s.split()) for s in texts]
    assert res.manifest["dataset"]["num_rows"] == len(texts)
    # A chunk size of one byte still cuts only at line ends.
    _, tiny = run(tmp_path / "tiny", src, length="words:text", chunk_bytes=1)
    assert ipc_bytes(tiny) == ipc_bytes(whole)


def test_big_parquet_row_group_cut_into_units(tmp_path, monkeypatch):
    from varlen_cli.analyze.formats import ranges

    monkeypatch.setattr(ranges, "MAX_UNIT_ROWS", 64)
    table = pa.table({"n": pa.array(np.arange(1000) % 17, pa.int32())})
    src = write_parquet(table, tmp_path / "one.parquet", row_group_size=1000)
    units = make_units(discover([src]))
    assert [(u.part, u.start, u.stop) for u in units][:2] == [(0, 0, 64), (0, 64, 128)] and len(units) == 16
    _, got = run(tmp_path / "out", src, length="value:n")
    assert got.column("length").to_pylist() == (np.arange(1000) % 17).tolist()


def test_empty_files_among_others(tmp_path):
    t = text_table(30, seed=5)
    write_parquet(t.slice(0, 0), tmp_path / "a.parquet")
    write_parquet(t, tmp_path / "b.parquet")
    (tmp_path / "c.jsonl").write_bytes(b"")
    res, got = run(tmp_path / "out", tmp_path / "a.parquet", tmp_path / "b.parquet", tmp_path / "c.jsonl",
                   length="chars:text")
    assert got.column("length").to_pylist() == [len(s) for s in t.column("text").to_pylist()]
    assert [f["rows"] for f in res.manifest["dataset"]["files"]] == [0, 30, 0]


def test_sample_data_sources_agree(sample_dir, tmp_path):
    """text.jsonl and text.parquet hold the same rows: same chars lengths, same ids."""
    _, a = run(tmp_path / "a", os.path.join(sample_dir, "text.jsonl"), length="chars:text", difficulty="value:id")
    _, b = run(tmp_path / "b", os.path.join(sample_dir, "text.parquet"), length="chars:text", difficulty="value:id")
    assert ipc_bytes(a) == ipc_bytes(b)
    shutil.rmtree(tmp_path / "a")


@given(rows=st.integers(0, 5000), step=st.integers(-1, 700), part=st.integers(0, 9))
def test_row_ranges_tile_the_container(rows, step, part):
    """The one unit rule (formats/ranges.py): units tile rows [0, rows) in order, each at most max(step, 1)
    rows and only the last shorter; an empty container is one empty unit."""
    from varlen_cli.analyze.formats import ranges

    units = ranges.row_ranges(part, rows, step)
    assert [u[0] for u in units] == [part] * len(units)
    assert units[0][1] == 0 and units[-1][2] == rows
    assert all(a[2] == b[1] for a, b in zip(units, units[1:]))
    assert all(u[3] == u[4] == u[2] - u[1] <= max(step, 1) for u in units)
    assert all(u[3] == max(step, 1) for u in units[:-1]) and (rows > 0) == (units[-1][3] > 0)


def test_unit_rows_is_about_chunk_bytes_within_bounds(monkeypatch):
    from varlen_cli.analyze.formats import ranges

    assert ranges.unit_rows(1000, 10_000, 100) == 10  # 100 bytes of 10-byte rows
    assert ranges.unit_rows(1000, 10_000, 1) == 1 and ranges.unit_rows(0, 0, 1 << 30) == 1
    assert ranges.unit_rows(10**12, 10**12, 1 << 40) == ranges.MAX_UNIT_ROWS
    monkeypatch.setattr(ranges, "MAX_UNIT_ROWS", 7)
    assert ranges.unit_rows(1000, 1000, 1000) == 7
