"""``varlen analyze`` in one process: each length kind, each difficulty kind, the manifest, the CLI."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.analyze_helpers import ipc_bytes, read_metrics, run, text_table, write_arrow_file, write_jsonl, write_parquet
from tests.conftest import sample
from varlen_cli.cli import app
from varlen_cli.runtime import artifacts, freshness

TOKENIZER = sample("tokenizer.json")


def _texts():
    return pq.read_table(sample("text.parquet")).column("text").to_pylist()


def _raw_tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(TOKENIZER)
    tok.no_truncation()
    tok.no_padding()
    return tok


# -- lengths -----------------------------------------------------------------------------------------
def test_tokens_undo_truncation_and_padding(tmp_path):
    shipped = json.load(open(TOKENIZER))
    assert shipped["truncation"]["max_length"] == 128 and shipped["padding"]["strategy"] == {"Fixed": 128}
    texts = _texts()
    expected = [len(e.ids) for e in _raw_tokenizer().encode_batch(texts)]
    res, got = run(tmp_path / "m", sample("text.parquet"), length="tokens:text", tokenizer=TOKENIZER)
    lengths = got.column("length").to_pylist()
    assert lengths == expected
    assert max(lengths) > 128 and min(lengths) < 128  # neither truncated nor padded
    assert res.stats["total"] == sum(expected) and res.stats["max"] == max(expected)
    # --no-special-tokens: the template's [BOS] and [EOS] are left out.
    _, plain = run(tmp_path / "p", sample("text.parquet"), length="tokens:text", tokenizer=TOKENIZER,
                   special_tokens=False)
    assert plain.column("length").to_pylist() == [n - 2 for n in expected]
    # The default length with a tokenizer and a text column is tokens:text.
    res2, auto = run(tmp_path / "a", sample("text.jsonl"), tokenizer=TOKENIZER)
    assert res2.length == "tokens:text" and auto.column("length").to_pylist() == expected


def test_list_lengths_match_tokens(tmp_path):
    res, got = run(tmp_path / "m", sample("tokenized.parquet"))
    assert res.length == "list:input_ids"  # auto
    ids = pq.read_table(sample("tokenized.parquet")).column("input_ids").to_pylist()
    assert got.column("length").to_pylist() == [len(x) for x in ids]
    assert got.column("length").to_pylist() == [len(e.ids) for e in _raw_tokenizer().encode_batch(_texts())]


def test_chars_bytes_words(tmp_path):
    texts = ["", "a", "two  words", " lead and trail ", "tab\tsep\nnew", "ünï cödé", "日本語 テキスト",
             "nbsp\u00a0sep", "em\u2003space", "vt\x0bsep", "emoji 🙂🙂"]
    src = write_parquet(pa.table({"text": texts}), tmp_path / "t.parquet", row_group_size=4)
    for kind, fn in [("chars", len), ("bytes", lambda s: len(s.encode())), ("words", lambda s: len(s.split()))]:
        _, got = run(tmp_path / kind, src, length=f"{kind}:text")
        assert got.column("length").to_pylist() == [fn(s) for s in texts], kind
    # bytes of a binary column too
    src2 = write_parquet(pa.table({"b": pa.array([b"", b"\x00\x01", b"abc"])}), tmp_path / "b.parquet")
    _, got = run(tmp_path / "bin", src2, length="bytes:b")
    assert got.column("length").to_pylist() == [0, 2, 3]


def test_value_lengths(tmp_path):
    src = write_parquet(pa.table({"n": pa.array([0, 5, 7, 1000000], pa.int32()),
                                  "f": pa.array([0.0, 5.0, 7.0, 1e6])}), tmp_path / "v.parquet")
    for col in ("n", "f"):
        _, got = run(tmp_path / col, src, length=f"value:{col}")
        assert got.column("length").to_pylist() == [0, 5, 7, 1000000]
    # Audio seconds to frames: ceil(seconds x F).
    rows = [json.loads(line) for line in open(sample("audio_manifest.jsonl"))]
    res, got = run(tmp_path / "audio", sample("audio_manifest.jsonl"), length="value:duration",
                   frames_per_second=100.0, difficulty="value:speaker")
    assert got.column("length").to_pylist() == [math.ceil(round(r["duration"] * 100, 6)) for r in rows]
    assert got.column("difficulty").to_pylist() == [float(r["speaker"]) for r in rows]
    assert res.manifest["config"]["frames_per_second"] == 100.0


# -- difficulty --------------------------------------------------------------------------------------
def _reference_rarity(token_lists):
    counts = np.bincount(np.concatenate([np.asarray(t, dtype=np.int64) for t in token_lists]))
    total = counts.sum()
    return [float(np.mean(np.log(total) - np.log(counts[t]))) if len(t) else 0.0 for t in token_lists]


def test_vocab_rarity_tokens_and_list(tmp_path):
    ids = [e.ids for e in _raw_tokenizer().encode_batch(_texts())]
    expected = _reference_rarity(ids)
    _, tok = run(tmp_path / "t", sample("text.parquet"), length="tokens:text", tokenizer=TOKENIZER,
                 difficulty="vocab-rarity")
    np.testing.assert_allclose(tok.column("difficulty").to_numpy(), expected, rtol=1e-12)
    _, lst = run(tmp_path / "l", sample("tokenized.parquet"), length="list:input_ids", difficulty="vocab-rarity")
    np.testing.assert_allclose(lst.column("difficulty").to_numpy(), expected, rtol=1e-12)
    assert ipc_bytes(tok.select(["sample_id", "length"])) == ipc_bytes(lst.select(["sample_id", "length"]))
    # The same ids from an Arrow file of many small batches (chunked columns).
    arrow = write_arrow_file(pq.read_table(sample("tokenized.parquet")), tmp_path / "ids.arrow", batch_rows=97)
    _, arr = run(tmp_path / "a", arrow, length="list:input_ids", difficulty="vocab-rarity")
    assert ipc_bytes(arr) == ipc_bytes(lst)
    # A list column holding an empty list: rarity 0, the rest unchanged by it.
    table = pa.table({"input_ids": pa.array([[1, 2, 2], [], [3]], pa.list_(pa.int64()))})
    src = write_parquet(table, tmp_path / "e.parquet")
    _, small = run(tmp_path / "e", src, length="list:input_ids", difficulty="vocab-rarity")
    np.testing.assert_allclose(small.column("difficulty").to_numpy(), _reference_rarity([[1, 2, 2], [], [3]]))


def test_difficulty_length_and_value(tmp_path):
    _, got = run(tmp_path / "l", sample("text.parquet"), length="chars:text")
    assert got.column("difficulty").to_pylist() == [float(x) for x in got.column("length").to_pylist()]
    _, got = run(tmp_path / "v", sample("text.parquet"), length="chars:text", difficulty="value:id")
    assert got.column("difficulty").to_pylist() == [float(i) for i in range(2000)]


def test_difficulty_user_function(tmp_path, monkeypatch):
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "varlen_test_scores.py").write_text(textwrap.dedent("""
        import pyarrow.compute as pc

        def vowel_share(batch):
            text = batch.column("text")
            vowels = pc.count_substring_regex(text, pattern="[aeiou]")
            return pc.divide(pc.cast(vowels, "float64"), pc.add(pc.utf8_length(text), 1))

        def as_list(batch):
            return [float(i) for i in batch.column("id").to_pylist()]
    """))
    monkeypatch.syspath_prepend(str(mod))
    texts = _texts()
    expected = [sum(ch in "aeiou" for ch in t) / (len(t) + 1) for t in texts]
    _, got = run(tmp_path / "f", sample("text.parquet"), length="chars:text",
                 difficulty="varlen_test_scores:vowel_share")
    np.testing.assert_allclose(got.column("difficulty").to_numpy(), expected)
    # A module in the current directory is found too (as `python -m` would), and plain lists work.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "varlen_cwd_scores.py").write_text("def neg_id(batch):\n    return [-float(i) for i in "
                                              "batch.column('id').to_pylist()]\n")
    monkeypatch.chdir(cwd)
    _, got = run(tmp_path / "g", sample("text.jsonl"), length="chars:text", difficulty="varlen_cwd_scores:neg_id")
    assert got.column("difficulty").to_pylist() == [-float(i) for i in range(2000)]


# -- manifest, overwrite, CLI --------------------------------------------------------------------------
def test_manifest_and_overwrite(tmp_path):
    out = tmp_path / "m"
    res, got = run(out, sample("text.parquet"), length="chars:text")
    m = artifacts.read_manifest(str(out))
    assert sorted(os.listdir(out)) == ["_manifest.json", "part-00000.parquet"]
    assert m["format"] == "varlen-metrics" and m["kind"] == "metrics" and m["stage"] == "analyze"
    assert m["num_rows"] == 2000 and m["parts"] == [{"file": "part-00000.parquet", "rows": 2000}]
    assert m["config"]["length"] == "chars:text" and m["config"]["sources"] == [sample("text.parquet")]
    assert m["columns"] == {"sample_id": "int64", "length": "int64", "difficulty": "float64"}
    assert m["order"]["by"] == ["sample_id"]
    f = m["dataset"]["files"][0]
    raw = open(sample("text.parquet"), "rb").read()
    footer = raw[-8 - int.from_bytes(raw[-8:-4], "little"):-8]
    assert f == {"path": "text.parquet", "size": len(raw), "rows": 2000, "format": "parquet",
                 "mtime_ns": os.stat(sample("text.parquet")).st_mtime_ns,
                 "footer": hashlib.sha256(footer).hexdigest()[:16],
                 "sample": freshness.content_fields(sample("text.parquet"), len(raw), "parquet")["sample"]}
    lengths = np.array(got.column("length").to_pylist())
    s = m["stats"]["length"]
    assert (s["count"], s["total"], s["min"], s["max"]) == (2000, lengths.sum(), lengths.min(), lengths.max())
    assert s["p50"] == int(np.percentile(lengths, 50, method="inverted_cdf"))
    assert s["p99"] == int(np.percentile(lengths, 99, method="inverted_cdf"))
    assert sum(s["histogram"]["log2_bins"]) == 2000
    assert m["stats"]["difficulty"]["max"] == float(lengths.max())
    # pyarrow reads the directory as one dataset (the manifest is skipped).
    assert pq.read_table(str(out)).num_rows == 2000
    # --overwrite replaces it; the artifact id only depends on what was computed.
    res2, _ = run(out, sample("text.parquet"), length="words:text", overwrite=True)
    m2 = artifacts.read_manifest(str(out))
    assert m2["config"]["length"] == "words:text" and m2["artifact_id"] != m["artifact_id"]
    assert sorted(p for p in os.listdir(tmp_path)) == ["m"]


def test_cli_runs_and_prints_summary(tmp_path):
    out = tmp_path / "cli"
    result = CliRunner().invoke(app, ["analyze", sample("text.jsonl"), "-o", str(out), "--tokenizer", TOKENIZER,
                                      "--difficulty", "vocab-rarity", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "samples" in result.stdout and "2,000" in result.stdout and "tokens:text" in result.stdout
    assert "vocab-rarity" in result.stdout and "lengths (log2 bins)" in result.stdout
    assert read_metrics(out).num_rows == 2000


def test_help_lists_every_option():
    result = CliRunner().invoke(app, ["analyze", "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    assert result.exit_code == 0
    for option in ("--output", "--length", "--tokenizer", "--no-special-tokens", "--frames-per-second",
                   "--difficulty", "--nproc", "--overwrite", "--device"):
        assert option in result.stdout, option


def test_cli_does_not_import_torch():
    import subprocess

    code = "import sys, varlen_cli.cli, varlen_cli.cli.analyze; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_jsonl_sample_data_equals_parquet(tmp_path):
    _, a = run(tmp_path / "a", sample("text.jsonl"), tokenizer=TOKENIZER)
    t = pq.read_table(sample("text.parquet"))
    src = write_jsonl(t, tmp_path / "copy.jsonl")
    _, b = run(tmp_path / "b", src, tokenizer=TOKENIZER)
    assert ipc_bytes(a) == ipc_bytes(b)
    assert text_table(3).num_rows == 3


def test_vocab_rarity_without_the_id_cache(tmp_path, monkeypatch):
    """Over the cache budget, the second pass reads and tokenizes again: same result."""
    from varlen_cli.analyze import core as analyze_module

    _, cached = run(tmp_path / "c", sample("text.parquet"), length="tokens:text", tokenizer=TOKENIZER,
                    difficulty="vocab-rarity")
    monkeypatch.setattr(analyze_module, "RARITY_CACHE_BYTES", 0)
    _, reread = run(tmp_path / "r", sample("text.parquet"), length="tokens:text", tokenizer=TOKENIZER,
                    difficulty="vocab-rarity")
    assert ipc_bytes(reread) == ipc_bytes(cached)


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=30), cut=st.integers(0, 30), seed=st.integers(0, 99))
def test_rarity_does_not_depend_on_unit_boundaries(lengths, cut, seed):
    from varlen_cli.analyze.difficulty import rarity

    lengths = np.array(lengths, dtype=np.int64)
    ids = np.random.default_rng(seed).integers(0, 5, int(lengths.sum()))
    counts = np.bincount(ids, minlength=5) + 1
    whole = rarity(lengths, ids, counts)
    k = min(cut, len(lengths))
    split = int(lengths[:k].sum())
    parts = np.concatenate([rarity(lengths[:k], ids[:split], counts), rarity(lengths[k:], ids[split:], counts)])
    assert whole.tobytes() == parts.tobytes()
    starts = np.cumsum(lengths) - lengths
    expected = [float(np.mean(np.log(counts.sum()) - np.log(counts[ids[a:a + n]]))) if n else 0.0
                for a, n in zip(starts, lengths)]
    np.testing.assert_allclose(whole, expected, rtol=1e-12)
