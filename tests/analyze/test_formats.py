"""Shard formats (Megatron ``.idx``, MosaicML MDS, WebDataset ``.tar``), tokenizer directories and chat
lengths, against files written by each format's own library and against ``AutoTokenizer`` itself."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import tarfile

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.analyze_helpers import ipc_bytes, leftovers, run
from tests.conftest import assert_user_error
from tests.formats_helpers import (
    CHAT_TEMPLATE,
    MDS_FIXTURES,
    TEXTS,
    chat_source,
    make_mds_fixtures,
    mds_samples,
    mds_writer,
    megatron_builder,
    random_docs,
    sentencepiece_dir,
    wds_samples,
    write_megatron,
    write_webdataset,
)
from varlen_cli.analyze.formats import megatron
from varlen_cli.cli import app
from varlen_cli.errors import InputError
from varlen_cli.loader import SourceDataset


# -- Megatron --------------------------------------------------------------------------------------
def _megatron_expected(docs):
    lengths = [len(s) for d in docs for s in d]
    document = [k for k, d in enumerate(docs) for _ in d]
    return lengths, document


def test_megatron_index_lengths_documents_and_prefix(tmp_path):
    docs = random_docs(60, seed=1)
    write_megatron(str(tmp_path / "corpus"), docs)
    lengths, document = _megatron_expected(docs)
    # PREFIX (no extension) and PREFIX.idx give the same (the .bin is checked against the index, not read)
    shutil.copy(tmp_path / "corpus.idx", tmp_path / "copy.idx")
    shutil.copy(tmp_path / "corpus.bin", tmp_path / "copy.bin")
    res, got = run(tmp_path / "out", str(tmp_path / "copy"))
    assert res.length == "value:length"
    assert got.column("length").to_pylist() == lengths
    assert got.column("document").to_pylist() == document
    assert got.column("sample_id").to_pylist() == list(range(len(lengths)))
    assert res.manifest["columns"]["document"] == "int64"
    _, again = run(tmp_path / "out2", str(tmp_path / "corpus.idx"))
    assert ipc_bytes(again) == ipc_bytes(got)


@pytest.mark.skipif(megatron_builder() is None, reason="megatron-core is not importable")
def test_megatron_matches_megatron_core_reader(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    docs = random_docs(40, seed=2)
    write_megatron(str(tmp_path / "c"), docs, dtype=np.int32)
    ds = IndexedDataset(str(tmp_path / "c"))
    _, got = run(tmp_path / "out", str(tmp_path / "c.idx"), length="list:input_ids")
    assert got.column("length").to_pylist() == ds.sequence_lengths.tolist()
    bounds = ds.document_indices
    assert got.column("document").to_pylist() == (np.searchsorted(bounds, np.arange(len(ds)), "right") - 1).tolist()
    items = SourceDataset(str(tmp_path / "out"))  # item i: the tokens of sequence i, from the .bin
    for i in (5, 0, 17):
        assert items[i]["input_ids"].tolist() == ds[i].tolist() and items[i]["length"] == len(ds[i])


@pytest.mark.slow
def test_megatron_two_files_two_workers_equal_one(tmp_path):
    write_megatron(str(tmp_path / "a"), random_docs(300, seed=3))
    write_megatron(str(tmp_path / "b"), random_docs(200, seed=4))
    la, da = _megatron_expected(random_docs(300, seed=3))
    lb, db = _megatron_expected(random_docs(200, seed=4))
    opts = dict(chunk_bytes=400)  # 100 sequences per unit: files split across workers
    _, one = run(tmp_path / "one", str(tmp_path / "a.idx"), str(tmp_path / "b.idx"), **opts)
    _, two = run(tmp_path / "two", str(tmp_path / "a.idx"), str(tmp_path / "b.idx"), nproc=2, **opts)
    assert ipc_bytes(one) == ipc_bytes(two)
    assert one.column("length").to_pylist() == la + lb
    assert one.column("document").to_pylist() == da + [300 + d for d in db]  # numbered over both files


def _idx_bytes(tmp_path) -> bytes:
    write_megatron(str(tmp_path / "good"), random_docs(5, seed=5))
    return (tmp_path / "good.idx").read_bytes()


def _corrupt(tmp_path, mutate) -> str:
    data = bytearray(_idx_bytes(tmp_path))
    data = mutate(data)
    (tmp_path / "bad.idx").write_bytes(bytes(data))
    return str(tmp_path / "bad.idx")


def _set(data, at, fmt_bytes):
    data[at: at + len(fmt_bytes)] = fmt_bytes
    return data


CORRUPT = {
    "bad magic": (lambda d: _set(d, 0, b"NOTANIDX\x00"), r"corrupt Megatron index .*bad\.idx: bad magic .*"),
    "bad version": (lambda d: _set(d, 9, (2).to_bytes(8, "little")),
                    r"corrupt Megatron index .*: version 2 \(only version 1 is known\)"),
    "bad dtype": (lambda d: _set(d, 17, b"\x63"), r"corrupt Megatron index .*: unknown token dtype code 99"),
    "truncated": (lambda d: d[:-5], r"corrupt Megatron index .*: \d+ bytes, but \d+ sequences and \d+ document "
                                    r"entries need \d+ \(or \d+ with modes\)"),
    "header only": (lambda d: d[:20], r"corrupt Megatron index .*: 20 bytes, shorter than the 34-byte header"),
    "counts": (lambda d: _set(d, 18, (10**6).to_bytes(8, "little")), r"corrupt Megatron index .*: \d+ bytes, but "
                                                                      r"1000000 sequences .*"),
    "boundaries": (lambda d: _set(d, len(d) - 8, (999).to_bytes(8, "little")),
                   r"corrupt Megatron index .*: document boundaries must run from 0 to \d+ \(the sequence count\)"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_megatron_index_is_one_line(tmp_path, case):
    mutate, message = CORRUPT[case]
    src = _corrupt(tmp_path, mutate)
    result = CliRunner().invoke(app, ["analyze", src, "-o", str(tmp_path / "out"), "--no-progress"])
    assert_user_error(result, 3, re.compile(message))
    assert not os.path.exists(tmp_path / "out")


def test_megatron_index_reader_inverse():
    """write_index (benchmarks build big indexes with it) is read back exactly, modes included."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.idx")
        megatron.write_index(path, [3, 0, 5, 2], [0, 2, 2, 4], np.uint16, modes=[0, 1, 0, 1])
        idx = megatron.read_index(path, os.path.getsize(path))
        assert idx.multimodal and idx.sequences == 4 and idx.num_documents == 3
        assert megatron.lengths(idx, 0, 4).tolist() == [3, 0, 5, 2]
        assert megatron.documents(idx, 0, 4).tolist() == [0, 0, 2, 2]  # document 1 is empty
        assert megatron.documents(idx, 1, 3).tolist() == [0, 2]


@settings(max_examples=60, deadline=None)
@given(docs=st.lists(st.integers(0, 4), min_size=1, max_size=60), cut=st.data(), crowded=st.booleans())
def test_megatron_documents_equal_a_search_of_the_boundaries(tmp_path_factory, docs, cut, crowded):
    """The document of every sequence of any unit is the last boundary at or below it: documents of
    0 to 4 sequences (empty ones included), one-sequence documents (the arange path), and boundaries
    crowded at one end (the interpolated read misses: the binary search path)."""
    sizes = ([1] * 50 + docs) if crowded else docs
    n = sum(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    path = str(tmp_path_factory.mktemp("idx") / "x.idx")
    megatron.write_index(path, np.ones(n, np.int32), starts)
    idx = megatron.read_index(path, os.path.getsize(path))
    a = cut.draw(st.integers(0, n))
    b = cut.draw(st.integers(a, n))
    want = np.searchsorted(starts, np.arange(a, b), "right") - 1
    assert megatron.documents(idx, a, b).tolist() == want.tolist()


def test_megatron_documents_far_from_an_even_spread(tmp_path):
    """20,000 one-sequence documents, then one of 20,000 sequences: the interpolated guess of a unit's
    boundaries misses (binary search instead), the same documents either way."""
    starts = np.concatenate([np.arange(20_001), [40_000]])
    path = str(tmp_path / "x.idx")
    megatron.write_index(path, np.ones(40_000, np.int32), starts)
    idx = megatron.read_index(path, os.path.getsize(path))
    for a, b in ((30_000, 30_010), (19_990, 20_010), (0, 40_000), (5, 9)):
        want = np.searchsorted(starts, np.arange(a, b), "right") - 1
        assert megatron.documents(idx, a, b).tolist() == want.tolist()


# -- MDS -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["raw", "zstd", "gz"])
def test_mds_columns_and_lengths(tmp_path, kind):
    samples = mds_samples()
    src = os.path.join(MDS_FIXTURES, kind)
    cases = {
        "list:tokens": [len(s["tokens"]) for s in samples],
        "value:n": [int(s["n"]) for s in samples],
        "chars:text": [len(s["text"]) for s in samples],
        "bytes:blob": [len(s["blob"]) for s in samples],
        "list:dyn": [s["dyn"].size for s in samples],
        "list:patch": [4] * len(samples),
        "value:sint": [s["sint"] for s in samples],
    }
    for i, (spec, want) in enumerate(cases.items()):
        res, got = run(tmp_path / f"o{i}", src, length=spec, chunk_bytes=300)
        assert got.column("length").to_pylist() == want, spec
        assert got.column("sample_id").to_pylist() == list(range(len(samples)))
    assert res.manifest["dataset"]["files"][0]["path"] == "index.json"
    items = SourceDataset(str(tmp_path / "o0"), columns=["messages", "tokens"])
    for i in (7, 2, 39):
        assert items[i]["messages"] == samples[i]["messages"]
        assert items[i]["tokens"].tolist() == samples[i]["tokens"].tolist()


@pytest.mark.skipif(mds_writer() is None, reason="mosaicml-streaming is not importable")
def test_mds_fixtures_are_mdswriter_output(tmp_path):
    make_mds_fixtures(str(tmp_path))
    for kind in ("raw", "zstd", "gz"):
        names = sorted(os.listdir(tmp_path / kind))
        assert names == sorted(os.listdir(os.path.join(MDS_FIXTURES, kind)))
        for name in names:
            if name == "index.json":  # its hashes and sizes are the shards'
                continue
            new, old = (tmp_path / kind / name).read_bytes(), open(os.path.join(MDS_FIXTURES, kind, name), "rb").read()
            if name.endswith(".gz"):  # a gzip header holds the time it was written
                new, old = gzip.decompress(new), gzip.decompress(old)
            assert new == old


@pytest.mark.slow
def test_mds_two_workers_equal_one(tmp_path):
    src = os.path.join(MDS_FIXTURES, "raw")
    _, one = run(tmp_path / "one", src, length="list:tokens", chunk_bytes=300)
    _, two = run(tmp_path / "two", src, length="list:tokens", chunk_bytes=300, nproc=2)
    assert ipc_bytes(one) == ipc_bytes(two)


def test_mds_unknown_column_and_bad_index(tmp_path):
    src = os.path.join(MDS_FIXTURES, "raw")
    result = CliRunner().invoke(app, ["analyze", src, "-o", str(tmp_path / "o"), "--length", "list:nope",
                                      "--no-progress"])
    assert_user_error(result, 3, re.compile(r"column 'nope' not found in MDS shard .*shard\.00000\.mds \(columns: "
                                            r"blob, dyn, messages, n, patch, score, sint, text, tokens\)"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "index.json").write_text('{"version": 2}')
    result = CliRunner().invoke(app, ["analyze", str(tmp_path / "bad"), "-o", str(tmp_path / "out"), "--no-progress"])
    assert_user_error(result, 3, re.compile(r".*index\.json is not an MDS index: 'shards'"))
    assert leftovers(tmp_path) == []


# -- WebDataset ------------------------------------------------------------------------------------
def _shards(tmp_path, sizes=(30, 25, 1)):
    folder = tmp_path / "wds"
    folder.mkdir()
    samples, first = [], 0
    for k, n in enumerate(sizes):
        part = wds_samples(n, seed=k, first=first)
        write_webdataset(str(folder / f"shard-{k:03d}.tar"), part)
        samples += part
        first += n
    return folder, samples


def test_webdataset_members_as_columns(tmp_path):
    folder, samples = _shards(tmp_path)
    cases = {
        "value:json.num_tokens": [s["json"]["num_tokens"] for s in samples],
        "value:json.meta.frames": [s["json"]["meta"]["frames"] for s in samples],
        "list:npy": [s["npy"].size for s in samples],
        "chars:txt": [len(s["txt"]) for s in samples],
        "bytes:txt": [len(s["txt"].encode()) for s in samples],
        "words:json.text": [len(s["json"]["text"].split()) for s in samples],
    }
    for i, (spec, want) in enumerate(cases.items()):
        # a folder, a glob and the files: the same samples in shard order
        src = [str(folder)] if i % 3 == 0 else [str(folder / "*.tar")] if i % 3 == 1 else sorted(
            str(p) for p in folder.iterdir())
        res, got = run(tmp_path / f"o{i}", *src, length=spec, chunk_bytes=2048)
        assert got.column("length").to_pylist() == want, spec
    assert res.manifest["dataset"]["num_rows"] == len(samples)
    items = SourceDataset(str(tmp_path / "o0"), columns=["__key__", "json.num_tokens"])
    for i in (33, 30, 0, len(samples) - 1):
        assert items[i] == {"__key__": samples[i]["__key__"], "json.num_tokens": samples[i]["json"]["num_tokens"]}
    everything = SourceDataset(str(tmp_path / "o0"))  # every member, typed as its named column: txt was bytes
    for i in (33, 0):
        item = everything[i]
        assert item["txt"] == samples[i]["txt"] and item["npy"].tolist() == samples[i]["npy"].reshape(-1).tolist()
        assert json.loads(item["json"]) == samples[i]["json"]


@pytest.mark.slow
def test_webdataset_two_workers_split_shards(tmp_path):
    folder, samples = _shards(tmp_path, sizes=(60, 45))
    opts = dict(length="list:npy", difficulty="value:json.num_tokens", chunk_bytes=3000)  # ~10 units a shard
    _, one = run(tmp_path / "one", str(folder), **opts)
    _, two = run(tmp_path / "two", str(folder), nproc=2, **opts)
    assert ipc_bytes(one) == ipc_bytes(two)
    assert one.column("length").to_pylist() == [s["npy"].size for s in samples]


def test_webdataset_missing_member_is_one_line(tmp_path):
    folder = tmp_path / "w"
    folder.mkdir()
    samples = wds_samples(5)
    del samples[3]["npy"]
    write_webdataset(str(folder / "a.tar"), samples)
    result = CliRunner().invoke(app, ["analyze", str(folder), "-o", str(tmp_path / "out"), "--length", "list:npy",
                                      "--no-progress"])
    assert_user_error(result, 3, f"tar member missing: key group 's000003' in {folder / 'a.tar'} has no .npy "
                                 "member (it has: json, txt)")
    assert leftovers(tmp_path) == []


# -- tokenizer directories and chat ----------------------------------------------------------------
@pytest.mark.parametrize("cls", ["LlamaTokenizer", "T5Tokenizer"])
def test_sentencepiece_directory_gives_autotokenizer_lengths(tmp_path, cls):
    from transformers import AutoTokenizer

    tok_dir = sentencepiece_dir(tmp_path, cls)
    assert not os.path.exists(os.path.join(tok_dir, "tokenizer.json"))
    texts = [t * (i % 4) for i, t in enumerate(TEXTS)]
    src = tmp_path / "t.parquet"
    pa.parquet.write_table(pa.table({"text": texts}), src)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    for special in (True, False):
        _, got = run(tmp_path / f"o{special}", str(src), length="tokens:text", tokenizer=tok_dir,
                     special_tokens=special)
        want = [len(ids) for ids in tok(texts, add_special_tokens=special)["input_ids"]]
        assert got.column("length").to_pylist() == want


@pytest.mark.parametrize("as_json", [False, True])
def test_chat_lengths_and_assistant_targets_equal_apply_chat_template(tmp_path, as_json):
    from transformers import AutoTokenizer

    tok_dir = sentencepiece_dir(tmp_path, "LlamaTokenizer", CHAT_TEMPLATE)
    src, convs = chat_source(tmp_path, as_json)
    res, got = run(tmp_path / "o", src, length="chat:messages", tokenizer=tok_dir, target_length="assistant")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    one = [tok.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
           for c in convs]  # one conversation at a time: the reference
    assert got.column("length").to_pylist() == [len(o["input_ids"]) for o in one]
    assert got.column("target_length").to_pylist() == [sum(o["assistant_masks"]) for o in one]
    # the assistant tokens are exactly those of the assistant turns' content plus EOS (this template)
    rendered = [tok(m["content"] + tok.eos_token, add_special_tokens=False)["input_ids"] for m in convs[3][2::2]]
    assert got.column("target_length")[3].as_py() <= sum(map(len, rendered)) + 2
    assert res.manifest["columns"]["target_length"] == "int64" and "target_length" in res.manifest["stats"]


CHAT_ERRORS = {
    "target without chat": (["--length", "chars:text", "--target-length", "assistant"],
                            "--target-length assistant needs --length chat:COLUMN (the loss mask comes from the chat "
                            "template)",
                            2),
    "bad target": (["--length", "chat:messages", "--target-length", "all"],
                   "--target-length must be KIND:PATH with KIND one of list, tokens, chars, bytes, words, value, or "
                   "assistant (with --length chat:COLUMN); got 'all'", 2),
    "no generation markers": (["--length", "chat:messages", "--target-length", "assistant", "--tokenizer", "{plain}"],
                              "--target-length assistant needs a chat template with {% generation %} markers around "
                              "the assistant turns; the template of {plain} has none", 2),
    "no template": (["--length", "chat:messages", "--tokenizer", "{notemplate}"],
                    "--length chat:COLUMN needs a tokenizer with a chat template; {notemplate} has none", 2),
    "chat without tokenizer": (["--length", "chat:messages"],
                               "--length chat:messages needs --tokenizer DIR (a tokenizer directory with a chat "
                               "template)", 2),
    "no special tokens": (["--length", "chat:messages", "--no-special-tokens"],  # silently did nothing
                          "--no-special-tokens does not apply to --length chat:messages: the chat template writes the "
                          "special tokens (BOS, turn markers), so the lengths are the template's; edit the template "
                          "to change them", 2),
}


@pytest.mark.parametrize("case", sorted(CHAT_ERRORS))
def test_chat_errors(tmp_path, case):
    args, message, code = CHAT_ERRORS[case]
    src, _ = chat_source(tmp_path)
    dirs = {}
    if "{plain}" in message:
        dirs["plain"] = sentencepiece_dir(tmp_path, "LlamaTokenizer", CHAT_TEMPLATE.replace("{% generation %}", "")
                                           .replace("{% endgeneration %}", ""))
    if "{notemplate}" in message:
        dirs["notemplate"] = sentencepiece_dir(tmp_path, "LlamaTokenizer")
    for name, folder in dirs.items():
        args = [a.replace("{" + name + "}", folder) for a in args]
        message = message.replace("{" + name + "}", folder)
    result = CliRunner().invoke(app, ["analyze", src, "-o", str(tmp_path / "out"), "--no-progress", *args])
    assert_user_error(result, code, message)
    assert leftovers(tmp_path) == []


def test_empty_conversations_and_plans_without_loss_targets(tmp_path):
    """An empty conversation was measured as 1 token (transformers refuses it); a plan whose steps all
    have step_loss_tokens 0 (no assistant turn anywhere) was written without a word."""
    tok_dir = sentencepiece_dir(tmp_path, "LlamaTokenizer", CHAT_TEMPLATE)
    turns = [[{"role": "user", "content": "hello world " * (i % 4 + 1)}] for i in range(12)]
    empty = str(tmp_path / "empty.parquet")
    pa.parquet.write_table(pa.table({"messages": [json.dumps(c) for c in turns[:5] + [[]] + turns[5:]]}), empty)
    result = CliRunner().invoke(app, ["analyze", empty, "-o", str(tmp_path / "e"), "--length", "chat:messages",
                                      "--tokenizer", tok_dir, "--no-progress"])
    assert_user_error(result, 3, f"chat column 'messages' holds 1 empty conversation(s) (no messages) in {empty}: "
                                 f"transformers' apply_chat_template refuses one; drop those rows")
    users = str(tmp_path / "users.parquet")  # conversations without an assistant turn: no loss target anywhere
    pa.parquet.write_table(pa.table({"messages": turns}), users)
    run(tmp_path / "m", users, length="chat:messages", tokenizer=tok_dir, target_length="assistant")
    result = CliRunner().invoke(app, ["plan", str(tmp_path / "m"), "-o", str(tmp_path / "p.parquet"),
                                      "--max-tokens", "64", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert result.stderr == ("varlen: warning: every step has step_loss_tokens 0 (no sample in them carries a loss "
                             "target: target_length 0, or samples of 1 token): a loss averaged over a step's targets "
                             "is 0/0 there\n")


def test_plan_counts_assistant_targets(tmp_path):
    """A plan over chat metrics with target_length: step_loss_tokens and --lr-scale-by tokens count the
    assistant tokens; the plan validates."""
    import pyarrow.parquet as pq

    from varlen_cli.plan import PlanConfig, plan
    from varlen_cli.validate import ValidateConfig, validate

    tok_dir = sentencepiece_dir(tmp_path, "LlamaTokenizer", CHAT_TEMPLATE)
    src, _ = chat_source(tmp_path)
    _, metrics = run(tmp_path / "m", src, length="chat:messages", tokenizer=tok_dir, target_length="assistant")
    target = dict(zip(metrics.column("sample_id").to_pylist(), metrics.column("target_length").to_pylist()))
    out = str(tmp_path / "plan.parquet")
    plan(PlanConfig(input=str(tmp_path / "m"), output=out, max_tokens=2000, dp=2, order="random", tail="drop",
                    lr_scaling="linear", lr_scale_by="tokens", progress=False))
    rows = pq.read_table(out).to_pylist()
    per_step: dict = {}
    for r in rows:
        per_step[r["step"]] = per_step.get(r["step"], 0) + sum(target[i] for i in r["sample_ids"])
    assert all(r["step_loss_tokens"] == per_step[r["step"]] for r in rows)
    report = validate(ValidateConfig(plan=out, metrics=str(tmp_path / "m")))
    assert report.ok, [c for c in report.checks if not c.ok]
    loss = next(c for c in report.checks if c.name == "loss tokens")  # checked against the metrics' column
    assert loss.ok and not loss.skipped and "target_length" in loss.detail
    with pytest.raises(Exception, match="--split-long cannot tell"):
        plan(PlanConfig(input=str(tmp_path / "m"), output=str(tmp_path / "p2.parquet"), packing=True, seq_len=64,
                        split_long=True, progress=False))


# -- damaged shards (issue 31): refused in one line, never read in part -----------------------------------
def _tar_layout(path) -> tuple[bytes, list]:
    """A TarWriter shard's bytes and its members (header offset, data offset, size), from tarfile."""
    import tarfile

    with tarfile.open(path) as tar:
        members = [(m.offset, m.offset_data, m.size) for m in tar.getmembers()]
    return open(path, "rb").read(), members


def _flip_checksum(data, members, k):
    header = members[k][0]
    return data[:header + 148] + bytes([data[header + 148] ^ 1]) + data[header + 149:], header


def _zero_header(data, members, k):
    header = members[k][0]
    return data[:header] + bytes(512) + data[header + 512:], header


# damage at member k (of 120: 40 key groups of json, npy, txt), the expected message from the damage's byte
TAR_DAMAGE = {
    "flipped header checksum byte": (_flip_checksum, "{path} is damaged: invalid tar header at byte {at:,} (bad "
                                                     "checksum); the members after it cannot be read"),
    "zeroed header": (_zero_header, "{path} is damaged: an empty (zeroed) tar header at byte {at:,} is followed by "
                                    "data at byte {next:,}"),
    "cut inside a header": (lambda d, m, k: (d[:m[k][0] + 100], m[k][0] + 100),
                            "{path} is truncated: it ends at byte {at:,}, inside a tar header"),
    "cut at a member boundary": (lambda d, m, k: (d[:m[k][0]], m[k][0]),
                                 "{path} is truncated: it ends at byte {at:,}, right after a tar member, without the "
                                 "end-of-archive blocks"),
    "cut inside a key group": (lambda d, m, k: (d[:m[k + 1][0] + 512 + 3], m[k + 1][0] + 512 + 3),
                               "{path} is truncated: it ends at byte {at:,}, inside a tar member"),
}


@pytest.mark.parametrize("case", sorted(TAR_DAMAGE))
def test_damaged_webdataset_shard_is_refused(tmp_path, case):
    """A TarWriter shard of 40 samples damaged at its 21st sample (where tarfile alone would stop, 20
    samples read and exit 0): exit 3, one line naming the byte, no output. The intact shard gives all 40."""
    damage, message = TAR_DAMAGE[case]
    folder, samples = _shards(tmp_path, sizes=(40,))
    path = folder / "shard-000.tar"
    data, members = _tar_layout(path)
    k = 3 * 20  # the first member of the 21st key group
    damaged, at = damage(data, members, k)
    path.write_bytes(damaged)
    result = CliRunner().invoke(app, ["analyze", str(folder), "-o", str(tmp_path / "out"), "--length",
                                      "value:json.num_tokens", "--no-progress"])
    assert_user_error(result, 3, message.format(path=path, at=at, next=members[k][1]))
    assert leftovers(tmp_path) == []
    path.write_bytes(data)  # nothing lost when intact: every sample, also read in many units by 2 workers
    _, got = run(tmp_path / "out", str(folder), length="value:json.num_tokens", chunk_bytes=4096)
    assert got.column("length").to_pylist() == [s["json"]["num_tokens"] for s in samples]


def test_a_sparse_member_is_refused(tmp_path):
    """A member GNU tar stored sparse (-S) keeps only its data blocks: read at its offset for its size, it
    ran into the next members (wrong bytes) or past the end ("truncated")."""
    import subprocess

    if shutil.which("tar") is None:
        pytest.skip("GNU tar is needed to write a sparse member")
    src = tmp_path / "files"
    src.mkdir()
    (src / "a.json").write_text('{"n": 1}')
    with open(src / "a.txt", "wb") as fh:  # 128 KiB: a hole between two bytes
        fh.write(b"x")
        fh.seek(131071)
        fh.write(b"y")
    (src / "b.json").write_text('{"n": 2}')
    (src / "b.txt").write_text("zz")
    shard = tmp_path / "s.tar"
    subprocess.run(["tar", "--format=gnu", "-S", "-cf", str(shard), "-C", str(src), "a.json", "a.txt", "b.json",
                    "b.txt"], check=True)
    with tarfile.open(shard) as tar:
        if not tar.getmember("a.txt").issparse():
            pytest.skip("this file system keeps no holes: tar -S stored the member whole")
    result = CliRunner().invoke(app, ["analyze", str(shard), "-o", str(tmp_path / "out"), "--length", "bytes:txt",
                                      "--no-progress"])
    assert_user_error(result, 3, f"{shard}: member a.txt is a sparse file (packed with GNU tar -S), which varlen does "
                                 "not read; pack the shard without -S (webdataset's TarWriter never writes one)")


@pytest.mark.slow
def test_damage_in_any_unit_is_refused_by_whichever_unit_walks_past_it(tmp_path):
    """Byte-range units: damage far before a shard's last unit is found by the units after it (each
    walks from the shard's start) and, with 2 workers, by whichever worker walks past it."""
    folder, _ = _shards(tmp_path, sizes=(40,))
    path = folder / "shard-000.tar"
    data, members = _tar_layout(path)
    damaged, at = _flip_checksum(data, members, 3 * 5)
    path.write_bytes(damaged)
    with pytest.raises(InputError) as err:
        run(tmp_path / "out", str(folder), length="value:json.num_tokens", chunk_bytes=2048, nproc=2)
    assert err.value.message == (f"{path} is damaged: invalid tar header at byte {at:,} (bad checksum); the members "
                                 "after it cannot be read")


def _mds_copy(tmp_path, kind: str = "raw"):
    folder = tmp_path / "mds"
    shutil.copytree(os.path.join(MDS_FIXTURES, kind), folder)
    return folder


def _edit_index(folder, change) -> None:
    index = json.loads((folder / "index.json").read_text())
    text = change(index)
    (folder / "index.json").write_text(text if isinstance(text, str) else json.dumps(index))


def _shard0(key, value):
    return lambda index: index["shards"][0].update({key: value})


def _raw_text(old: str, new: str):
    return lambda index: json.dumps(index).replace(old, new, 1)


# (kind, change of index.json or shard file, message): MDSWriter's fixtures (shard 0: 7 samples, 2,041 bytes)
MDS_DAMAGE = {
    "samples -5": ("raw", _shard0("samples", -5), "{i}: shard 0 has samples -5; an integer of 0 or more is needed"),
    "samples 10**15": ("raw", _shard0("samples", 10**15), "{i}: shard 0 declares 1,000,000,000,000,000 samples in "
                       "2,041 raw bytes: a raw MDS shard (uint32 offsets) cannot hold that; the index is corrupt"),
    "samples 2**70": ("raw", _raw_text('"samples": 7', f'"samples": {2**70}'), "{i}: shard 0 declares "
                      f"{2**70:,} samples in 2,041 raw bytes: a raw MDS shard (uint32 offsets) cannot hold that; the "
                      "index is corrupt"),
    "samples 1e30": ("raw", _raw_text('"samples": 7', '"samples": 1e30'),
                     "{i}: shard 0 has samples 1e+30; an integer of 0 or more is needed"),
    "samples 6 (one fewer)": ("raw", _shard0("samples", 6), "MDS shard {d}/shard.00000.mds holds 7 samples; "
                              "index.json says 6 (the index or the shard is corrupt)"),
    "compressed samples 8": ("zstd", _shard0("samples", 8), "MDS shard {d}/shard.00000.mds.zstd holds 7 samples; "
                             "index.json says 8 (the index or the shard is corrupt)"),
    "compressed raw bytes 10**9": ("gz", lambda x: x["shards"][0]["raw_data"].update(bytes=10**9),
                                   "MDS shard {d}/shard.00000.mds.gz decompresses to 2041 bytes; index.json says "
                                   "1000000000"),
    "shards null": ("raw", lambda x: x.update(shards=None),
                    "{i} is not an MDS index: 'shards' is null, not a list of shard entries"),
    "shards 5": ("raw", lambda x: x.update(shards=5), "{i} is not an MDS index: 'shards' is 5, not a list of shard "
                 "entries"),
    "shard truncated": ("raw", "truncate", "MDS shard {d}/shard.00003.mds has 1,800 bytes; {i} says 1,862 "
                        "(truncated or replaced)"),
    "shard outside the folder": ("raw", lambda x: x["shards"][0]["raw_data"].update(basename="../x.mds"),
                                 "{i}: shard 0 names the shard file '../x.mds'; it must lie in the index's folder"),
    # the index edited against its shards: the shards' own headers (MDSWriter's config JSON) disagree
    "index says ndarray:float16": ("raw", lambda x: [s["column_encodings"].__setitem__(8, "ndarray:float16")
                                                     for s in x["shards"]],
                                   "MDS shard {d}/shard.00000.mds does not match its index: its header gives column 8 "
                                   '(tokens) the encoding "ndarray:int32", index.json "ndarray:float16"'),
    "compressed, index says uint16": ("zstd", lambda x: [s.update(column_encodings=s["column_encodings"][:3] +
                                                                  ["uint16"] + s["column_encodings"][4:],
                                                                  column_sizes=s["column_sizes"][:3] + [2] +
                                                                  s["column_sizes"][4:]) for s in x["shards"]],
                                      "MDS shard {d}/shard.00000.mds.zstd does not match its index: its header gives "
                                      'column 3 (n) the encoding "int32", index.json "uint16"'),
    "index nested 100,000 deep": ("raw", lambda x: "[" * 100_000, "{i} is not an MDS index: maximum recursion depth "
                                  "exceeded while decoding a JSON array from a unicode string"),
    "int64 column of size 4": ("raw", lambda x: x["shards"][0]["column_encodings"].__setitem__(3, "int64"),
                               "{i}: shard 0 is not a valid MDS shard entry (column 'n' is int64, 8 bytes a sample, "
                               "but its size is 4)"),
    "sizes ['x', ...]": ("raw", lambda x: x["shards"][0].update(column_sizes=["x"] * 9),
                         "{i}: shard 0 is not a valid MDS shard entry (column 'blob': encoding \"bytes\", size \"x\")"),
    "a size 4 bytes short": ("raw", lambda x: [s["column_sizes"].__setitem__(5, 4) or
                                               s["column_encodings"].__setitem__(5, "bytes") for s in x["shards"]],
                             "MDS shard {d}/shard.00000.mds does not match its index: its header gives column 5 "
                             '(score) the encoding "float64", index.json "bytes"'),
}


@pytest.mark.parametrize("case", sorted(MDS_DAMAGE))
def test_corrupt_mds_index_or_shard_is_refused(tmp_path, case):
    """Counts the shards cannot back are refused before anything is allocated from them (10**15 grew
    memory without bound; 2**70 and 1e30 were internal errors; -5 read 27 of 40 samples, ids shifted)."""
    kind, change, message = MDS_DAMAGE[case]
    folder = _mds_copy(tmp_path, kind)
    if change == "truncate":
        shard = folder / "shard.00003.mds"
        shard.write_bytes(shard.read_bytes()[:1800])
    else:
        _edit_index(folder, change)
    result = CliRunner().invoke(app, ["analyze", str(folder), "-o", str(tmp_path / "out"), "--length", "list:tokens",
                                      "--no-progress"])
    assert_user_error(result, 3, message.format(i=folder / "index.json", d=folder))
    assert leftovers(tmp_path) == []


def test_intact_mds_loses_nothing(tmp_path):
    """The fixtures as MDSWriter wrote them: every sample, raw and compressed alike."""
    want = [len(s["tokens"]) for s in mds_samples()]
    for kind in ("raw", "zstd"):
        _, got = run(tmp_path / f"out-{kind}", os.path.join(MDS_FIXTURES, kind), length="list:tokens", chunk_bytes=300)
        assert got.column("length").to_pylist() == want


MEGATRON_DOCS = [[[1, 2, 3]], [[4]], [[5, 6], [7]]]  # sequences of 3, 1, 2, 1 tokens; boundaries [0, 1, 2, 4]


def _megatron_pair(tmp_path):
    """IndexedDatasetBuilder's c.idx / c.bin of MEGATRON_DOCS (uint16 tokens), and the index's layout."""
    write_megatron(str(tmp_path / "c"), MEGATRON_DOCS)
    idx = megatron.read_index(str(tmp_path / "c.idx"), os.path.getsize(tmp_path / "c.idx"))
    megatron.clear_cache()
    return tmp_path / "c.idx", tmp_path / "c.bin", idx


def _poke(path, at: int, value: int, size: int = 8) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + size] = value.to_bytes(size, "little", signed=True)
    path.write_bytes(bytes(data))


MEGATRON_DAMAGE = {
    "boundaries [0,-1,2,4]": (lambda i, b, x: _poke(i, x.documents_at + 8, -1),
                              "corrupt Megatron index {i}: document boundaries must not decrease and must lie in 0..4 "
                              "(the sequence count)"),
    "a length changed": (lambda i, b, x: _poke(i, 34 + 4, 5, 4),  # sequence 1: 1 -> 5 tokens
                         "corrupt Megatron index {i}: sequence 1 has length 5 (10 bytes), but its pointer and the "
                         "next are 2 bytes apart in {b}"),
    "two lengths swapped": (lambda i, b, x: (_poke(i, 34, 1, 4), _poke(i, 34 + 4, 3, 4)),  # same total, same unit
                            "corrupt Megatron index {i}: sequence 0 has length 1 (2 bytes), but its pointer and the "
                            "next are 6 bytes apart in {b}"),
    "a negative length": (lambda i, b, x: _poke(i, 34 + 4, -1, 4),
                          "corrupt Megatron index {i}: negative sequence lengths (sequences 0-4)"),
    ".bin truncated": (lambda i, b, x: b.write_bytes(b.read_bytes()[:10]),
                       "Megatron data {b} has 10 bytes, but its index {i} ends its last sequence at byte 14 "
                       "(truncated, or not the index's data)"),
    ".bin missing": (lambda i, b, x: os.remove(b),
                     "Megatron data {b} (beside its index) cannot be read: {b} does not exist"),
}


@pytest.mark.parametrize("case", sorted(MEGATRON_DAMAGE))
def test_megatron_index_and_data_checked_against_each_other(tmp_path, monkeypatch, case):
    """The index's counts against the .bin's size and its pointers: boundaries [0,-1,2,4] gave documents
    [1,1,2,2] with exit 0; a changed length or a truncated .bin was read as if whole; two swapped
    lengths (the same total) were read as if right. Pointers are compared 2 at a time here (blocks)."""
    monkeypatch.setattr(megatron, "CHECK_BLOCK", 2)
    damage, message = MEGATRON_DAMAGE[case]
    idx, data, layout = _megatron_pair(tmp_path)
    damage(idx, data, layout)
    result = CliRunner().invoke(app, ["analyze", str(idx), "-o", str(tmp_path / "out"), "--no-progress"])
    assert_user_error(result, 3, message.format(i=idx, b=data))
    assert leftovers(tmp_path) == []


def test_intact_megatron_pair_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(megatron, "CHECK_BLOCK", 2)  # the pointers of one unit compared in several blocks
    idx, _, _ = _megatron_pair(tmp_path)
    _, got = run(tmp_path / "out", str(idx), chunk_bytes=4)  # a unit a sequence: every unit's pointers checked
    assert got.column("length").to_pylist() == [3, 1, 2, 1] and got.column("document").to_pylist() == [0, 1, 2, 2]


def _keep_stat(path, write) -> None:
    """``write()`` new content of the same size into ``path``, then its old mtime put back."""
    st = path.stat()
    write()
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _refused_as_stale(args, metrics, source, why: str = "was rewritten (its sampled content differs)") -> None:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert_user_error(result, 3, f"{metrics} is stale: source {source} {why} since `varlen analyze` read it; re-run "
                                 "`varlen analyze`, or pass --allow-stale if the data was moved or copied on purpose")


def test_megatron_bin_and_mds_shards_are_fingerprinted(tmp_path):
    """A rewritten Megatron .bin (same size and mtime) was served by SourceDataset; a replaced MDS shard
    was accepted by plan. Both are recorded as companions of their index and refused now."""
    (tmp_path / "meg").mkdir()
    write_megatron(str(tmp_path / "meg" / "c"), random_docs(20, seed=3))
    m = tmp_path / "m"
    run(m, tmp_path / "meg" / "c")
    entry = json.loads((m / "_manifest.json").read_text())["dataset"]["files"][0]
    assert [c["path"] for c in entry["companions"]] == ["c.bin"]
    binary = tmp_path / "meg" / "c.bin"
    _keep_stat(binary, lambda: binary.write_bytes(bytes(b ^ 0xFF for b in binary.read_bytes())))
    with pytest.raises(InputError, match=re.escape(f"source {binary} was rewritten (its sampled content differs)")):
        SourceDataset(str(m))
    _refused_as_stale(["plan", m, "-o", tmp_path / "p.parquet", "--max-tokens", 4096], m, binary)

    shutil.copytree(os.path.join(MDS_FIXTURES, "raw"), tmp_path / "mds")
    m2 = tmp_path / "m2"
    run(m2, tmp_path / "mds", length="list:tokens")
    shard = tmp_path / "mds" / "shard.00002.mds"
    mine, other = shard.read_bytes(), (tmp_path / "mds" / "shard.00004.mds").read_bytes()
    _keep_stat(shard, lambda: shard.write_bytes(other[:len(mine)].ljust(len(mine), b"\0")))
    _refused_as_stale(["plan", m2, "-o", tmp_path / "p2.parquet", "--max-tokens", 4096], m2, shard)
    _keep_stat(shard, lambda: shard.write_bytes(mine))
    os.remove(tmp_path / "mds" / "shard.00005.mds")
    _refused_as_stale(["sort", m2, "-o", tmp_path / "s"], m2, shard.parent / "shard.00005.mds", "is missing")
