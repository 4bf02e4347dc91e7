"""Readers of LitData ``optimize()`` output, Lance datasets and in-memory ``datasets.Dataset`` objects
(issue 36): each source written by its own library, lengths equal to what the library reads back,
``SourceDataset`` items equal to the library's rows, damaged input refused in one line, and any
worker count giving the same metrics."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from tests.analyze_helpers import read_metrics, run
from varlen_cli.cli import app
from varlen_cli.errors import InputError, UsageError
from varlen_cli.loader import SourceDataset
from varlen_cli.runtime import artifacts, freshness


def _cli_error(*args) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["analyze", *map(str, args), "--no-progress"])
    return result.exit_code, result.stderr.strip()


# -- LitData ------------------------------------------------------------------------------------------------
def _litdata_write(folder, items, **options):
    """``litdata``'s own writer (what ``optimize()`` runs in each worker), in this process."""
    writer_module = pytest.importorskip("litdata.streaming.writer")
    writer = writer_module.BinaryWriter(cache_dir=str(folder), chunk_bytes=options.pop("chunk_bytes", 500), **options)
    for i, item in enumerate(items):
        writer[i] = item
    writer.done()
    writer.merge()
    return str(folder)


def _items(n: int = 40) -> list[dict]:
    import torch

    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, 1000, int(rng.integers(0, 30))).astype(np.int32), "text": "w " * i, "n": i,
             "meta": {"len": i * 3, "score": i / 7}, "img": rng.integers(0, 5, (2, i % 3 + 1)).astype(np.uint8),
             "t": torch.arange(i % 5 + 1, dtype=torch.int64), "pair": (i, "x" * (i % 4))} for i in range(n)]


def _same_item(ours: dict, theirs: dict) -> bool:
    """A SourceDataset item against litdata's: arrays flattened, tuples as structs named by position."""
    def norm(v):
        if hasattr(v, "numpy"):
            v = v.numpy()
        if isinstance(v, np.ndarray):
            return v.reshape(-1).tolist()
        if isinstance(v, tuple):
            return {str(i): norm(x) for i, x in enumerate(v)}
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v
    return norm(ours) == norm(theirs)


def test_litdata_lengths_and_items_equal_the_library(tmp_path):
    from litdata import StreamingDataset

    items = _items()
    folder = _litdata_write(tmp_path / "opt", items)
    assert len(json.loads((tmp_path / "opt" / "index.json").read_text())["chunks"]) > 3
    _, got = run(tmp_path / "m", folder, length="list:tokens", target_length="bytes:text",
                 difficulty="value:meta.len", chunk_bytes=200)
    theirs = StreamingDataset(folder)
    assert len(theirs) == got.num_rows
    rows = [theirs[i] for i in range(len(theirs))]
    assert got.column("length").to_pylist() == [len(r["tokens"]) for r in rows]
    assert got.column("target_length").to_pylist() == [len(r["text"].encode()) for r in rows]
    assert got.column("difficulty").to_pylist() == [float(r["meta"]["len"]) for r in rows]
    _, got = run(tmp_path / "m2", folder, length="list:img", target_length="list:t")
    assert got.column("length").to_pylist() == [r["img"].size for r in rows]
    assert got.column("target_length").to_pylist() == [len(r["t"]) for r in rows]
    ours = SourceDataset(tmp_path / "m")
    assert all(_same_item(ours[i], rows[i]) for i in range(len(rows)))
    chunk = tmp_path / "opt" / json.loads((tmp_path / "opt" / "index.json").read_text())["chunks"][1]["filename"]
    os.utime(chunk, ns=(chunk.stat().st_atime_ns, chunk.stat().st_mtime_ns + 10**9))  # a chunk rewritten
    assert freshness.stale_source(artifacts.read_manifest(str(tmp_path / "m"))) == (str(chunk), "was modified")


def test_litdata_arrow_footer_and_whole_chunk_zstd(tmp_path):
    """Flat records of strings (LitData stores them in an Arrow footer) and zstd over whole chunks."""
    pytest.importorskip("zstd")
    from litdata import StreamingDataset

    records = [{"text": "a" * i, "label": str(i)} for i in range(30)]
    footer = _litdata_write(tmp_path / "footer", records, chunk_bytes=200)
    assert (tmp_path / "footer" / "chunk-0-0.bin").read_bytes()[-8:] == b"LDARW01\0"
    _, got = run(tmp_path / "m", footer, length="chars:text")
    assert got.column("length").to_pylist() == [len(StreamingDataset(footer)[i]["text"]) for i in range(30)]
    assert SourceDataset(tmp_path / "m")[7] == records[7]
    zipped = _litdata_write(tmp_path / "zstd", _items(12), compression="zstd", compression_level="chunk")
    _, got = run(tmp_path / "m2", zipped, length="list:tokens")
    theirs = StreamingDataset(zipped)
    assert got.column("length").to_pylist() == [len(theirs[i]["tokens"]) for i in range(12)]


def _damage(kind: str, folder) -> tuple[str, str]:
    index = json.loads((folder / "index.json").read_text())
    chunk = folder / index["chunks"][0]["filename"]
    data = bytearray(chunk.read_bytes())
    if kind == "truncated chunk":
        chunk.write_bytes(bytes(data[:-5]))
        return (f"LitData chunk {chunk} has {len(data) - 5} bytes where {folder / 'index.json'} records {len(data)} "
                "(truncated or changed)", "3")
    if kind == "item count changed":
        data[0] += 1
        chunk.write_bytes(bytes(data))
        n = index["chunks"][0]["chunk_size"]
        return f"LitData chunk {chunk} holds {n + 1} items where the index records {n}", "3"
    if kind == "offsets scrambled":
        data[8:12], data[12:16] = data[12:16], data[8:12]
        chunk.write_bytes(bytes(data))
        return f"LitData chunk {chunk} is corrupt or truncated (item offsets 0-{index['chunks'][0]['chunk_size']})", "3"
    index["config"]["item_loader"] = "TokensLoader"
    (folder / "index.json").write_text(json.dumps(index))
    return (f"{folder / 'index.json'}: LitData chunks written with the TokensLoader item loader cannot be read as "
            "samples (a stream of tokens with no sample boundaries: there are no samples to measure); varlen reads "
            "PyTreeLoader chunks (optimize()'s default)", "3")


@pytest.mark.parametrize("kind", ["truncated chunk", "item count changed", "offsets scrambled", "tokens loader"])
def test_litdata_damaged_input_is_refused_in_one_line(tmp_path, kind):
    folder = tmp_path / "opt"
    _litdata_write(folder, [{"tokens": np.arange(i % 9, dtype=np.int64), "n": i} for i in range(20)], chunk_bytes=300)
    message, code = _damage(kind, folder)
    assert _cli_error(folder, "-o", tmp_path / "m", "--length", "list:tokens") == (int(code),
                                                                                    f"varlen: error: {message}")
    assert not (tmp_path / "m").exists()


def test_litdata_indexes_of_several_sources_are_read_once_each(tmp_path, monkeypatch):
    """Each LitData index (and the stat of each of its chunks) is read once per run, however many
    LitData sources the run has: one source's index does not evict another's."""
    from varlen_cli.analyze.formats import litdata

    parsed = []
    parse = litdata._parse_index
    monkeypatch.setattr(litdata, "_parse_index", lambda path: (parsed.append(path), parse(path))[1])
    sources = [_litdata_write(tmp_path / name, [{"tokens": np.arange(i % 9, dtype=np.int64)} for i in range(20)],
                              chunk_bytes=300) + "/index.json" for name in ("a", "b", "c")]
    _, got = run(tmp_path / "m", *sources, length="list:tokens")
    assert got.column("length").to_pylist() == [i % 9 for i in range(20)] * 3
    assert sorted(parsed) == sorted(sources)


# -- Lance --------------------------------------------------------------------------------------------------
def _lance_dataset(folder):
    lance = pytest.importorskip("lance")
    rng = np.random.default_rng(1)
    n = 60
    table = pa.table({"id": np.arange(n), "text": [" ".join(["w"] * int(k)) for k in rng.integers(0, 20, n)],
                      "meta": [{"len": int(k), "ids": list(range(int(k) % 5))} for k in rng.integers(0, 99, n)]})
    lance.write_dataset(table, str(folder), max_rows_per_file=17)
    ds = lance.write_dataset(table.slice(0, 9), str(folder), mode="append")
    ds.delete("id % 7 = 3")  # version 3: deletions inside fragments
    return lance.dataset(str(folder))


def test_lance_lengths_and_items_equal_the_library(tmp_path):
    ds = _lance_dataset(tmp_path / "d.lance")
    rows = ds.take(list(range(ds.count_rows()))).to_pylist()  # Lance's own index order
    res, got = run(tmp_path / "m", tmp_path / "d.lance", length="words:text", target_length="list:meta.ids",
                   difficulty="value:meta.len", chunk_bytes=300)
    assert got.column("length").to_pylist() == [len(r["text"].split()) for r in rows]
    assert got.column("target_length").to_pylist() == [len(r["meta"]["ids"]) for r in rows]
    assert got.column("difficulty").to_pylist() == [float(r["meta"]["len"]) for r in rows]
    items = SourceDataset(tmp_path / "m")
    assert [items[i] for i in range(len(rows))] == rows
    # an older version, named by its manifest: read as it was (before the append and the deletions)
    first = [v for v in os.listdir(tmp_path / "d.lance" / "_versions") if v.endswith(".manifest")]
    from varlen_cli.analyze.formats.lance import version_of

    v1 = tmp_path / "d.lance" / "_versions" / min(first, key=version_of)
    _, got = run(tmp_path / "m1", v1, length="words:text")
    assert got.num_rows == 60 and res.manifest["dataset"]["files"][0]["rows"] == len(rows)


def test_lance_damaged_or_missing_library_is_one_line(tmp_path, monkeypatch):
    ds = _lance_dataset(tmp_path / "d.lance")
    data = tmp_path / "d.lance" / "data" / ds.get_fragments()[0].data_files()[0].path
    size = data.stat().st_size
    with open(data, "r+b") as fh:
        fh.truncate(size - 10)
    assert _cli_error(tmp_path / "d.lance", "-o", tmp_path / "m", "--length", "chars:text") == (
        3, f"varlen: error: Lance data file {data} has {size - 10} bytes where the manifest records {size} "
           "(truncated or replaced)")
    monkeypatch.setitem(__import__("sys").modules, "lance", None)
    from varlen_cli.analyze.formats import _VERSIONS

    _VERSIONS.clear()
    with pytest.raises(UsageError, match=r"^reading a Lance dataset needs the 'pylance' package: pip install "
                                         r"'varlen-cli\[lance\]'$"):
        run(tmp_path / "m2", tmp_path / "d.lance", length="chars:text")


# -- an in-memory datasets.Dataset --------------------------------------------------------------------------
def _memory_dataset():
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(2)
    n = 90
    ds = datasets.Dataset.from_dict({"text": ["x" * int(k) for k in rng.integers(0, 50, n)],
                                     "segs": [[{"t": "ab" * int(k)}] for k in rng.integers(0, 9, n)]})
    return ds.shuffle(seed=3).select(range(0, n, 2))  # an indices mapping: dataset[i] is not table row i


def test_analyze_dataset_lengths_and_items_equal_the_dataset(tmp_path):
    from varlen_cli.analyze import analyze_dataset

    ds = _memory_dataset()
    res = analyze_dataset(ds, tmp_path / "m", length="chars:text", target_length="chars:segs[0].t", chunk_bytes=300,
                          progress=False)
    got = read_metrics(tmp_path / "m")
    assert got.column("length").to_pylist() == [len(t) for t in ds["text"]]
    assert got.column("target_length").to_pylist() == [len(s[0]["t"]) for s in ds["segs"]]
    assert res.manifest["config"]["sources"] == [f"datasets.Dataset:{ds._fingerprint} ({len(ds)} rows)"]
    items = SourceDataset(tmp_path / "m", dataset=ds)
    assert [items[i] for i in range(len(ds))] == [ds[i] for i in range(len(ds))]
    other = ds.select(range(3))
    with pytest.raises(InputError) as info:
        SourceDataset(tmp_path / "m", dataset=other)
    assert info.value.message == (f"{tmp_path / 'm'} measured the datasets.Dataset datasets.Dataset:{ds._fingerprint} "
                                  f"({len(ds)} rows), not datasets.Dataset:{other._fingerprint} (3 rows): pass the "
                                  "dataset analyze_dataset was given")


# -- any worker count ---------------------------------------------------------------------------------------
def _source(fmt: str, folder) -> tuple[object, dict, list]:
    """A source in a few work units, its analyze options and its lengths."""
    if fmt == "litdata":
        items = [{"tokens": np.arange(i % 11, dtype=np.int64)} for i in range(30)]
        return _litdata_write(folder, items, chunk_bytes=200), {"length": "list:tokens"}, [i % 11 for i in range(30)]
    if fmt == "lance":
        ds = _lance_dataset(folder)
        return str(folder), {"length": "chars:text"}, [len(t) for t in ds.to_table().column("text").to_pylist()]
    assert fmt == "dataset"  # (a NeMo range: tests/test_local_group.py's worker-count property)
    ds = _memory_dataset()
    return ds, {"length": "chars:text"}, [len(t) for t in ds["text"]]


@pytest.mark.slow
@pytest.mark.parametrize("fmt,workers", [("litdata", 2), ("lance", 6), ("dataset", 4)])
def test_any_worker_count_gives_the_same_metrics(tmp_path, monkeypatch, fmt, workers):
    """1 worker, 2, and more workers than work units (workers without a unit write an empty part); the
    other formats (a NeMo range too) are in tests/test_local_group.py's worker-count property."""
    from varlen_cli.analyze import AnalyzeConfig, run_in_group
    from varlen_cli.analyze.memory import DatasetSource
    from varlen_cli.analyze.sources import discover, make_units
    from varlen_cli.runtime.executor import execute

    monkeypatch.setenv("VARLEN_START_METHOD", "fork")
    source, options, lengths = _source(fmt, tmp_path / "src")
    sources = (DatasetSource(source),) if fmt == "dataset" else (source,)
    chunk = 300 if fmt == "litdata" else 1 << 20  # litdata: several units a chunk; else a fragment, a file
    units = len(make_units(discover(sources), chunk))
    assert (workers < units) if fmt == "litdata" else (workers > units)  # some workers with no unit
    for n in (1, workers):
        out = tmp_path / f"m{n}"
        res = execute(run_in_group, AnalyzeConfig(sources=sources, output=str(out), nproc=n, chunk_bytes=chunk,
                                                  progress=False, **options))
        got = read_metrics(out)
        assert got.column("length").to_pylist() == lengths and res.num_parts == n
        assert got.column("sample_id").to_pylist() == list(range(len(lengths)))
