"""Megatron ``.idx``, MosaicML MDS and WebDataset shards (and Parquet) analysed from the moto S3 server
give the metrics of the same files analysed locally, and ``SourceDataset`` items of the remote metrics
equal the local ones. Requests are counted (every call s3fs sends, :mod:`benchmarks.s3_requests`): an
``.idx`` analysis never reads the ``.bin``, Parquet is read by column-chunk ranges (never a whole
object), and a Parquet footer is read once per file."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from benchmarks.s3_requests import gets, s3_requests
from tests.analyze_helpers import ipc_bytes, run
from tests.formats_helpers import MDS_FIXTURES, random_docs, wds_samples, write_megatron, write_webdataset
from varlen_cli.loader import SourceDataset


def _megatron(folder) -> tuple[str, dict]:
    write_megatron(os.path.join(folder, "a"), random_docs(120, seed=11))
    write_megatron(os.path.join(folder, "b"), random_docs(80, seed=12))
    return "*.idx", {"chunk_bytes": 200}  # 50 sequences a unit


def _mds(folder, kind: str) -> tuple[str, dict]:
    shutil.copytree(os.path.join(MDS_FIXTURES, kind), os.path.join(folder, "ds"))
    return "ds", {"length": "list:tokens", "difficulty": "value:score", "chunk_bytes": 300}


def _webdataset(folder) -> tuple[str, dict]:
    for k, n in enumerate((40, 25)):
        write_webdataset(os.path.join(folder, f"shard-{k}.tar"), wds_samples(n, seed=k, first=40 * k))
    return "*.tar", {"length": "value:json.num_tokens", "chunk_bytes": 4096}


def _parquet(folder) -> tuple[str, dict]:
    rng = np.random.default_rng(3)
    ids = [rng.integers(0, 500, int(k)).tolist() for k in rng.integers(1, 60, 3000)]  # 0.3 MB: bigger than a tail read
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())), "text": [f"t{i}" for i in range(3000)]}),
                   os.path.join(folder, "a.parquet"), row_group_size=500)
    return "a.parquet", {"length": "list:input_ids"}


FORMATS = {"megatron": _megatron, "mds-raw": lambda f: _mds(f, "raw"), "mds-zstd": lambda f: _mds(f, "zstd"),
           "webdataset": _webdataset, "parquet": _parquet}


def _items(metrics: str) -> list:
    ds = SourceDataset(metrics)
    order = np.random.default_rng(0).permutation(len(ds)).tolist()
    return [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in item.items()}
            for item in ds.__getitems__(order)]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_formats_from_s3_equal_local(tmp_path, s3, fmt):
    folder = tmp_path / "src"
    folder.mkdir()
    source, opts = FORMATS[fmt](str(folder))
    url = s3.upload_tree(str(folder), s3.bucket(), "data")
    local, want = run(tmp_path / "local", str(folder / source), **opts)
    remote, got = run(tmp_path / "remote", f"{url}/{source}", **opts)
    assert ipc_bytes(got) == ipc_bytes(want) and got.num_rows > 0
    assert remote.manifest["stats"] == local.manifest["stats"]
    assert _items(str(tmp_path / "remote")) == _items(str(tmp_path / "local"))  # SourceDataset from the store


def test_idx_analysis_never_reads_the_bin(tmp_path, s3):
    folder = tmp_path / "src"
    folder.mkdir()
    _megatron(str(folder))
    url = s3.upload_tree(str(folder), s3.bucket(), "data")
    with s3_requests() as log:
        _, got = run(tmp_path / "m", f"{url}/*.idx", chunk_bytes=200)
    assert got.num_rows == 120 * 0 + len(got) and gets(log, ".idx")
    assert gets(log, ".bin") == [] and all(r.range is not None for r in gets(log))  # index ranges only
    with s3_requests() as log:  # the tokens are in the .bin: SourceDataset reads them there, by range
        item = SourceDataset(str(tmp_path / "m"))[7]
    assert len(item["input_ids"]) == item["length"] and gets(log, ".bin")
    assert all(r.range is not None for r in gets(log, ".bin"))


def test_parquet_is_read_by_row_group_ranges_and_its_footer_once(tmp_path, s3):
    folder = tmp_path / "src"
    folder.mkdir()
    _parquet(str(folder))
    size = os.path.getsize(folder / "a.parquet")
    md = pq.ParquetFile(folder / "a.parquet").metadata
    wanted = [md.row_group(g).column(0) for g in range(md.num_row_groups)]  # the input_ids chunks
    url = s3.upload_tree(str(folder), s3.bucket(), "data")
    with s3_requests() as log:
        run(tmp_path / "m", f"{url}/a.parquet", length="list:input_ids")
    reads = gets(log, "a.parquet")
    assert all(r.range is not None and r.size < size for r in reads), (size, reads)  # never the whole object
    footer = [r for r in reads if r.range[1] == size]
    assert len(footer) == 1, reads  # the footer (and its hash) from one tail read, then cached
    chunks = sorted(r.range for r in reads if r.range[1] != size)
    assert chunks == sorted((c.data_page_offset if c.dictionary_page_offset is None else c.dictionary_page_offset,
                             (c.dictionary_page_offset or c.data_page_offset) + c.total_compressed_size)
                            for c in wanted)  # one range per row group: the length column's chunk only
