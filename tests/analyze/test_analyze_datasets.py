"""``sample_id`` is the index of a map-style Hugging Face ``datasets`` dataset over the same files.

``datasets`` is in the ``dev`` extra, so CI runs these; a plain install of varlen does not need it.
"""

from __future__ import annotations

import datasets
import pytest

from tests.analyze_helpers import run, text_table, write_arrow_stream, write_jsonl, write_parquet, write_text


def _load(builder: str, files, cache):
    return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", cache_dir=str(cache))


def _check(ds, got):
    assert len(ds) == got.num_rows
    # Row i of the datasets dataset is sample_id i.
    assert got.column("sample_id").to_pylist() == list(range(len(ds)))
    if "id" in ds.column_names:
        assert got.column("difficulty").to_pylist() == [float(i) for i in ds["id"]]
    assert got.column("length").to_pylist() == [len(t) for t in ds["text"]]


@pytest.mark.parametrize("fmt", ["parquet", "json", "arrow"])
def test_sample_id_is_the_datasets_index(tmp_path, fmt):
    data = tmp_path / "data"
    data.mkdir()
    files = []
    for k, name in enumerate(["b", "a", "c"]):  # written out of order; both sort by path
        table = text_table(120 + 10 * k, seed=k, first_id=1000 * k)
        if fmt == "parquet":
            files.append(write_parquet(table, data / f"{name}.parquet", row_group_size=25))
        elif fmt == "json":
            files.append(write_jsonl(table, data / f"{name}.jsonl"))
        else:
            files.append(write_arrow_stream(table, data / f"{name}.arrow"))
    ds = _load(fmt, sorted(files), tmp_path / "cache")
    _, got = run(tmp_path / "out", data, length="chars:text", difficulty="value:id", chunk_bytes=1000)
    _check(ds, got)


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
def test_sample_id_is_the_datasets_index_text(tmp_path, newline):
    lines = ["one", "", "three  words here", "ünïcödé", "", "last"] * 20
    a = write_text(lines, tmp_path / "a.txt", newline=newline)
    b = write_text(lines[:7], tmp_path / "b.txt", newline=newline, trailing=False)
    ds = _load("text", [a, b], tmp_path / "cache")
    _, got = run(tmp_path / "out", b, a, length="chars:text", chunk_bytes=64)
    _check(ds, got)


def test_sample_id_is_the_datasets_index_text_mixed_line_ends(tmp_path):
    """One file with all three line ends, a "\\r\\n" across a chunk edge, and a last "\\r"."""
    raw = "a\nbb\r\n\rccc\r\r\ndddd\n\n" * 30 + "é\r"
    (tmp_path / "m.txt").write_bytes(raw.encode())
    ds = _load("text", [tmp_path / "m.txt"], tmp_path / "cache")
    for chunk in (5, 7, 64):
        _, got = run(tmp_path / f"out{chunk}", tmp_path / "m.txt", length="chars:text", chunk_bytes=chunk)
        _check(ds, got)


def test_sample_id_on_a_save_to_disk_directory(tmp_path):
    table = text_table(500, seed=9)
    ds = datasets.Dataset.from_dict({"id": table.column("id").to_pylist(), "text": table.column("text").to_pylist()})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    loaded = datasets.load_from_disk(str(tmp_path / "saved"))
    res, got = run(tmp_path / "out", tmp_path / "saved", length="chars:text", difficulty="value:id")
    _check(loaded, got)
    assert res.num_files == 3
