"""``SourceDataset``: item i is the source row with sample_id i, for every format, local and from
the S3-protocol server; plan-order read-ahead through ``dataloader_for_plan``; stale sources refused."""

from __future__ import annotations

import os
import re

import numpy as np
import pyarrow as pa
import pytest

from tests.analyze_helpers import (
    run,
    text_table,
    write_arrow_file,
    write_hf_save_to_disk,
    write_jsonl,
    write_parquet,
    write_text,
)
from tests.conftest import sample
from tests.loader_helpers import write_plan
from varlen_cli.errors import InputError, UsageError
from varlen_cli.loader import SourceDataset, dataloader_for_plan
from varlen_cli.loader.source_dataset import IndexTypeError

TOK = sample("tokenizer.json")


def _token_table(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, size=n)
    ids = [rng.integers(0, 1000, size=k).tolist() for k in lengths]
    return pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())), "text": [f"row {i}" for i in range(n)]})


def _write_format(fmt: str, folder, table: pa.Table) -> str:
    """``table`` as files of ``fmt`` in ``folder`` (several files, several blocks each); the SOURCE."""
    os.makedirs(folder, exist_ok=True)
    half = len(table) // 2
    parts = [table.slice(0, half), table.slice(half)]
    for k, part in enumerate(parts):
        path = os.path.join(folder, f"p{k}")
        if fmt == "parquet":
            write_parquet(part, path + ".parquet", row_group_size=23)
        elif fmt == "jsonl":
            write_jsonl(part, path + ".jsonl")
        elif fmt == "jsonl.gz":
            write_jsonl(part, path + ".jsonl.gz", gz=True)
        elif fmt == "arrow":
            write_arrow_file(part, path + ".arrow")
        elif fmt == "text":
            write_text(part.column("text").to_pylist(), path + ".txt")
    if fmt == "hf":
        write_hf_save_to_disk(table, os.path.join(folder, "ds"), num_shards=3)
        return os.path.join(folder, "ds")
    return str(folder)


def _expected(fmt: str, table: pa.Table) -> list[dict]:
    if fmt == "text":
        return [{"text": t} for t in table.column("text").to_pylist()]
    return table.to_pylist()


def _plain(item: dict) -> dict:
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in item.items()}


FORMATS = ["parquet", "jsonl", "jsonl.gz", "arrow", "text", "hf"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_items_equal_source_rows_local(tmp_path, fmt):
    table = text_table(150, seed=3) if fmt == "text" else _token_table(150)
    source = _write_format(fmt, tmp_path / "src", table)
    run(tmp_path / "m", source, chunk_bytes=512, length="chars:text" if fmt == "text" else "auto")
    ds = SourceDataset(tmp_path / "m", cache_bytes=2048)  # a small cache: blocks are evicted and read again
    expected = _expected(fmt, table)
    assert len(ds) == len(expected)
    order = np.random.default_rng(0).permutation(len(ds))
    got = ds.__getitems__(order.tolist())
    assert [_plain(g) for g in got] == [expected[i] for i in order]
    assert _plain(ds[7]) == expected[7]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "text", "arrow"])
def test_items_equal_source_rows_s3(tmp_path, s3, fmt):
    table = text_table(120, seed=4) if fmt == "text" else _token_table(120, seed=1)
    local = _write_format(fmt, tmp_path / "src", table)
    url = s3.upload_tree(local, s3.bucket(), "data")
    run(tmp_path / "m", url, chunk_bytes=512, length="chars:text" if fmt == "text" else "auto")
    ds = SourceDataset(tmp_path / "m", columns=["text"])
    expected = [{"text": row["text"]} for row in _expected(fmt, table)]
    order = np.random.default_rng(1).permutation(len(ds))
    assert [_plain(g) for g in ds.__getitems__(order.tolist())] == [expected[i] for i in order]


def test_tokenizer_gives_analyze_lengths(tmp_path):
    pytest.importorskip("tokenizers")
    table = text_table(80, seed=5)
    write_parquet(table, tmp_path / "a.parquet", row_group_size=16)
    _, metrics = run(tmp_path / "m", tmp_path / "a.parquet", length="tokens:text", tokenizer=TOK)
    ds = SourceDataset(tmp_path / "m", columns=["text"], tokenizer=TOK)
    items = ds.__getitems__(list(range(len(ds))))
    assert [len(it["input_ids"]) for it in items] == metrics.column("length").to_pylist()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(TOK)
    tok.no_truncation()
    tok.no_padding()
    assert items[3]["input_ids"].tolist() == tok.encode(table.column("text")[3].as_py()).ids


@pytest.mark.parametrize("num_workers,remote", [(0, False), (2, False), (2, True)])
def test_dataloader_for_plan_is_the_whole_data_path(tmp_path, request, num_workers, remote):
    table = _token_table(200, seed=2)
    write_parquet(table, tmp_path / "a.parquet", row_group_size=17)
    source = tmp_path / "a.parquet"
    if remote:  # DataLoader workers forked from a process whose s3 client already ran
        s3 = request.getfixturevalue("s3")
        source = s3.upload_tree(str(tmp_path), s3.bucket(), "d") + "/a.parquet"
    _, metrics = run(tmp_path / "m", source)
    lengths = metrics.column("length").to_numpy()
    write_plan(tmp_path / "plan.parquet", lengths, max_tokens=128, order="random", seed=3)
    ds = SourceDataset(tmp_path / "m", columns=["input_ids"])
    loader = dataloader_for_plan(ds, str(tmp_path / "plan.parquet"), rank=0, world_size=1, num_workers=num_workers,
                                 lr_scale="ignore")  # data only, no optimizer
    rows = table.column("input_ids").to_pylist()
    seen = []
    for batch in loader:
        for b, sid in enumerate(batch["sample_ids"].tolist()):
            if sid < 0:
                continue
            n = len(rows[sid])
            assert batch["input_ids"][b, :n].tolist() == rows[sid]
            seen.append(sid)
    assert sorted(seen) == list(range(len(rows)))


def test_read_ahead_hook_reaches_the_dataset(tmp_path):
    """The sampler tells ``prefetch`` the next microbatches of the same consumer, in plan order."""
    table = _token_table(120, seed=6)
    write_parquet(table, tmp_path / "a.parquet", row_group_size=10)
    _, metrics = run(tmp_path / "m", tmp_path / "a.parquet")
    write_plan(tmp_path / "plan.parquet", metrics.column("length").to_numpy(), max_tokens=96, order="random")

    class Recording(SourceDataset):
        def prefetch(self, sample_ids):
            self.asked.append(np.asarray(sample_ids).tolist())
            super().prefetch(sample_ids)

    ds = Recording(tmp_path / "m", columns=["input_ids"])
    ds.asked = []
    loader = dataloader_for_plan(ds, str(tmp_path / "plan.parquet"), rank=0, world_size=1, read_ahead=2,
                                 lr_scale="ignore")
    batches = [b["sample_ids"][b["sample_ids"] >= 0].tolist() for b in loader]
    assert len(ds.asked) == len(batches) - 1  # the last microbatch has nothing after it
    for k, asked in enumerate(ds.asked):
        assert asked == sum(batches[k + 1:k + 3], [])


def test_changed_source_is_refused(tmp_path):
    table = _token_table(50)
    path = write_parquet(table, tmp_path / "a.parquet")
    run(tmp_path / "m", path)
    write_parquet(table.slice(0, 40), path)
    with pytest.raises(InputError, match=r"is stale: source .*a\.parquet changed size"):
        SourceDataset(tmp_path / "m")
    assert len(SourceDataset(tmp_path / "m", allow_stale=True)) == 50


def _rewrite_same_size_and_mtime(path) -> None:
    st = os.stat(path)
    data = bytearray(open(path, "rb").read())
    data[4:len(data) // 2] = bytes(len(data) // 2 - 4)  # the first row groups' pages zeroed (footer kept)
    open(path, "wb").write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("change,message", [
    ("truncated", r"{m} is stale: source {p} changed size \(\d+ -> \d+ bytes\) since `varlen analyze` read it \(while "
                  r"SourceDataset reads it\); re-run `varlen analyze`"),
    ("deleted", r"{m} is stale: source {p} is missing since `varlen analyze` read it \(while SourceDataset reads it\); "
                r"re-run `varlen analyze`"),
    ("rewritten, size and mtime kept", r"cannot read {p}: .+ \(did it change since `varlen analyze`\?\)"),
])
def test_a_source_changed_while_reading_is_refused(tmp_path, monkeypatch, change, message):
    """A source changed after SourceDataset was made: a truncated or rewritten Parquet file gave a raw
    OSError ("File too short", "Couldn't deserialize thrift"); a JSONL file edited in place gave rows
    without their column. Each block read re-checks the file's size and mtime; what else goes wrong
    reading it is an InputError too."""
    from varlen_cli.loader import source_dataset

    monkeypatch.setattr(source_dataset, "RECHECK_S", 0.0)  # re-checked before every block, not once a second
    table = _token_table(60)
    path = write_parquet(table, tmp_path / "a.parquet", row_group_size=10)
    run(tmp_path / "m", path)
    ds = SourceDataset(tmp_path / "m", cache_bytes=0)
    assert _plain(ds[1]) == table.slice(1, 1).to_pylist()[0]
    if change == "truncated":
        open(path, "r+b").truncate(os.path.getsize(path) // 2)
    elif change == "deleted":
        os.remove(path)
    else:
        _rewrite_same_size_and_mtime(path)
    with pytest.raises(InputError, match="^" + message.format(m=re.escape(str(tmp_path / "m")),
                                                              p=re.escape(path)) + "$"):
        [ds[i] for i in range(len(ds))]


@pytest.mark.parametrize("option,value", [("cache_bytes", "x"), ("cache_bytes", -1), ("threads", 0), ("threads", 1.5)])
def test_bad_constructor_arguments_are_one_usage_error(tmp_path, option, value):
    write_parquet(_token_table(10), tmp_path / "a.parquet")
    run(tmp_path / "m", tmp_path / "a.parquet")
    least = 0 if option == "cache_bytes" else 1
    with pytest.raises(UsageError, match="^" + re.escape(f"SourceDataset({option}=...) must be an integer >= {least}, "
                                                         f"not {value!r}") + "$"):
        SourceDataset(tmp_path / "m", **{option: value})


def test_changed_object_is_refused(tmp_path, s3):
    bucket = s3.bucket()
    write_jsonl(_token_table(30), tmp_path / "a.jsonl")
    s3.client.upload_file(str(tmp_path / "a.jsonl"), bucket, "d/a.jsonl")
    run(tmp_path / "m", f"s3://{bucket}/d/")
    data = (tmp_path / "a.jsonl").read_bytes()
    s3.client.put_object(Bucket=bucket, Key="d/a.jsonl", Body=data.replace(b"row 1", b"row 9"))  # same size
    with pytest.raises(InputError, match=r"s3://.*/d/a\.jsonl was modified \(etag "):
        SourceDataset(tmp_path / "m")


def test_remote_metrics_dir(tmp_path, s3):
    """Metrics written to object storage are a SourceDataset's input too."""
    bucket = s3.bucket()
    table = _token_table(60)
    write_parquet(table, tmp_path / "a.parquet", row_group_size=16)
    s3.client.upload_file(str(tmp_path / "a.parquet"), bucket, "d/a.parquet")
    run_out = f"s3://{bucket}/metrics"
    from varlen_cli.analyze import AnalyzeConfig, analyze

    analyze(AnalyzeConfig(sources=(f"s3://{bucket}/d",), output=run_out, progress=False))
    ds = SourceDataset(run_out, columns=["input_ids"])
    assert [_plain(i)["input_ids"] for i in ds.__getitems__([59, 0, 31])] == [
        table.column("input_ids")[k].as_py() for k in (59, 0, 31)]


@pytest.mark.parametrize("depth,stride", [(0, 1), (1, 1), (3, 1), (2, 2), (3, 4)])
def test_read_ahead_follows_each_worker(depth, stride):
    """With ``stride`` DataLoader workers taking microbatches in turn, microbatch k carries the ids of
    k+stride, k+2*stride, ... (depth of them, fewer at the end): what the same worker fetches next."""
    from types import SimpleNamespace

    from varlen_cli.loader.sampler import _with_ahead

    items = [SimpleNamespace(sample_ids=np.array([k, 100 + k])) for k in range(11)]
    got = list(_with_ahead(iter(items), depth, stride))
    assert [item for item, _ in got] == items
    for k, (_, ahead) in enumerate(got):
        want = [[j, 100 + j] for j in range(k + stride, min(11, k + stride * depth + 1), stride)]
        assert (ahead is None and depth == 0) or [a.tolist() for a in ahead] == want


# -- the tokenizer is analyze's, whatever object is passed (issue 31) -----------------------------------
def test_a_tokenizer_object_counts_as_analyze_counted(tmp_path):
    """A tokenizers.Tokenizer kept its own truncation and padding (128 ids where analyze counted 213);
    a transformers tokenizer object gave AttributeError."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    table = text_table(60, seed=6)
    write_parquet(table, tmp_path / "a.parquet", row_group_size=16)
    _, metrics = run(tmp_path / "m", tmp_path / "a.parquet", length="tokens:text", tokenizer=TOK)
    want = metrics.column("length").to_pylist()
    assert max(want) > 12
    tok = Tokenizer.from_file(TOK)
    tok.enable_truncation(max_length=8)
    tok.enable_padding(length=12)
    hf = PreTrainedTokenizerFast(tokenizer_file=TOK)
    for given in (tok, hf):
        ds = SourceDataset(tmp_path / "m", tokenizer=given)
        assert [len(it["input_ids"]) for it in ds.__getitems__(list(range(len(ds))))] == want
    assert tok.truncation["max_length"] == 8 and tok.padding["length"] == 12  # the caller's object left as it was
    with pytest.raises(UsageError, match=r"^tokenizer must be a tokenizer.json path, a tokenizer directory, a "
                                         r"tokenizers.Tokenizer or a transformers tokenizer, not dict$"):
        SourceDataset(tmp_path / "m", tokenizer={"vocab": 1})
    with pytest.raises(UsageError, match=r"^tokenizer= tokenizes column 'text' \(what analyze measured\): add it to "
                                         r"columns=\['id'\]$"):
        SourceDataset(tmp_path / "m", columns=["id"], tokenizer=TOK)


def test_a_tokenizer_over_list_metrics_is_refused(tmp_path):
    """KeyError: 'text' before."""
    write_parquet(_token_table(30), tmp_path / "a.parquet")
    run(tmp_path / "m", tmp_path / "a.parquet", length="list:input_ids")
    with pytest.raises(UsageError, match="^" + re.escape(
            f"SourceDataset(tokenizer=...) tokenizes the text analyze measured, but {tmp_path / 'm'} was measured with "
            f"--length list:input_ids, which holds no text: drop tokenizer= (the items hold 'input_ids' as analyze "
            f"counted it)") + "$"):
        SourceDataset(tmp_path / "m", tokenizer=TOK)


def test_chat_items_are_the_chat_templates_tokens(tmp_path):
    """KeyError: 'text' before: chat metrics now give the template's token ids, analyze's count."""
    from transformers import AutoTokenizer

    from tests.formats_helpers import CHAT_TEMPLATE, chat_source, sentencepiece_dir

    tok_dir = sentencepiece_dir(tmp_path, "LlamaTokenizer", CHAT_TEMPLATE)
    src, convs = chat_source(tmp_path, as_json=True)
    _, metrics = run(tmp_path / "m", src, length="chat:messages", tokenizer=tok_dir)
    hf = AutoTokenizer.from_pretrained(tok_dir)
    for given in (tok_dir, hf):
        ds = SourceDataset(tmp_path / "m", tokenizer=given)
        items = ds.__getitems__(list(range(len(ds))))
        assert [len(it["input_ids"]) for it in items] == metrics.column("length").to_pylist()
        assert items[4]["input_ids"].tolist() == hf.apply_chat_template(convs[4], tokenize=True,
                                                                        return_dict=True)["input_ids"]
    with pytest.raises(UsageError, match="^" + re.escape(
            f"{tmp_path / 'm'} was measured with a chat template (--length chat:COLUMN): SourceDataset needs the same "
            f"tokenizer, a transformers tokenizer or its directory, not {TOK}") + "$"):
        SourceDataset(tmp_path / "m", tokenizer=TOK)


@pytest.mark.parametrize("index,shown", [(1.7, "float 1.7"), ("3", "str '3'"), (True, "bool True"),
                                         (None, "NoneType None")])
def test_indices_are_integers(tmp_path, index, shown):
    """ds[1.7] returned row 1, ds['3'] row 3, a 2-D index list was flattened."""
    write_parquet(_token_table(30), tmp_path / "a.parquet")
    run(tmp_path / "m", tmp_path / "a.parquet")
    ds = SourceDataset(tmp_path / "m")
    with pytest.raises(IndexTypeError, match="^" + re.escape(f"SourceDataset indices are sample ids (integers), "
                                                            f"not {shown}") + "$"):
        ds[index]
    with pytest.raises(TypeError, match=r"^SourceDataset indices are sample ids \(a flat list of integers\), not "
                                        r"\[\[1, 2\], \[3, 4\]\]$"):
        ds.__getitems__([[1, 2], [3, 4]])
    with pytest.raises(TypeError, match=r"^SourceDataset indices are sample ids \(a flat list of integers\), not "
                                        r"\[1\.5, 2\.0\]$"):
        ds.__getitems__([1.5, 2.0])
    assert _plain(ds[np.int32(3)]) == _plain(ds[3]) == _plain(ds.__getitems__(np.array([3], np.uint8))[0])


# -- planted fault 3 (issue 30): row groups larger than a slice --------------------------------------------
def test_row_groups_larger_than_a_slice(tmp_path, monkeypatch):
    """Row groups over 2^20 rows are read in slices of MAX_UNIT_ROWS rows; a one-row shift in a slice went
    unnoticed. With the slice patched down to 7 rows: every item of row groups of 50 and 30 rows (several
    boundaries each, a last slice shorter) is compared with its row, and analyze's lengths of them and of
    an Arrow file (cut in slices too) with the rows'."""
    from varlen_cli.analyze.formats import ranges

    monkeypatch.setattr(ranges, "MAX_UNIT_ROWS", 7)
    table = _token_table(230, seed=9)
    write_parquet(table.slice(0, 130), tmp_path / "a.parquet", row_group_size=50)
    write_arrow_file(table.slice(130), tmp_path / "b.arrow")
    _, metrics = run(tmp_path / "m", tmp_path / "a.parquet", tmp_path / "b.arrow")  # analyze slices both files
    assert metrics.column("length").to_pylist() == [len(x) for x in table.column("input_ids").to_pylist()]
    ds = SourceDataset(tmp_path / "m", cache_bytes=1)  # every block read again: no row served from a neighbour
    slices = [g + a for g, n in ((0, 50), (50, 50), (100, 30)) for a in range(0, n, 7)]
    assert ds._layout().tolist() == slices + [130, 230]  # the Parquet groups in slices of 7, the Arrow file whole
    order = np.random.default_rng(2).permutation(len(ds))
    assert [_plain(it) for it in ds.__getitems__(order.tolist())] == [table.slice(int(i), 1).to_pylist()[0]
                                                                       for i in order]
