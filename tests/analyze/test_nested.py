"""Nested field paths (``--length KIND:PATH``, ``--target-length KIND:PATH``), a target length for any
data, and speech corpora's manifests: Lhotse CutSets and Shar directories written by lhotse, NeMo
shard ranges expanded by NeMo's rule (issue 36)."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.analyze_helpers import read_metrics, run, write_jsonl
from varlen_cli.cli import app
from varlen_cli.errors import UsageError
from varlen_cli.loader import SourceDataset

TOKENIZER = "sample_data/tokenizer.json"


def _rows(n: int, seed: int = 0) -> list[dict]:
    """Rows with a struct, a list of structs (some empty) and a column whose name holds a dot."""
    rng = np.random.default_rng(seed)
    words = ["a", "bb", "ccc", "dddd", "é"]
    out = []
    for i in range(n):
        k = int(rng.integers(0, 3)) if i % 5 else 1
        segs = [{"text": " ".join(rng.choice(words, int(rng.integers(1, 6)))), "n": int(rng.integers(0, 9))}
                for _ in range(k)]
        out.append({"meta": {"len": int(rng.integers(1, 100)), "inner": {"ids": rng.integers(0, 50, 3).tolist()}},
                    "segs": segs, "my.col": i, "text": "x" * i})
    return out


def _expected(rows: list[dict], path: str):
    from varlen_cli.analyze.paths import parse, value

    steps = parse(path).steps
    return [value(r[steps[0]], steps[1:]) for r in rows]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_nested_paths_in_jsonl_and_parquet(tmp_path, fmt):
    rows = [r for r in _rows(40) if r["segs"]]
    path = tmp_path / f"d.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    _, got = run(tmp_path / "m", path, length="value:meta.len", target_length="chars:segs[-1].text",
                 difficulty="value:segs[0].n", chunk_bytes=200)
    assert got.column("length").to_pylist() == _expected(rows, "meta.len")
    assert got.column("target_length").to_pylist() == [len(t) for t in _expected(rows, "segs[-1].text")]
    assert got.column("difficulty").to_pylist() == [float(v) for v in _expected(rows, "segs[0].n")]
    _, got = run(tmp_path / "m2", path, length="list:meta.inner.ids", target_length="value:my.col",
                 difficulty="value:my.col")
    assert got.column("length").to_pylist() == [3] * len(rows)
    assert got.column("target_length").to_pylist() == [r["my.col"] for r in rows]
    items = SourceDataset(tmp_path / "m2", columns=["segs[0].text", "meta.inner.ids", "my.col", "meta"])
    for i in (0, len(rows) // 2, len(rows) - 1):
        item = items[i]
        assert item["segs[0].text"] == rows[i]["segs"][0]["text"] and item["my.col"] == rows[i]["my.col"]
        assert item["meta.inner.ids"].tolist() == rows[i]["meta"]["inner"]["ids"] and item["meta"] == rows[i]["meta"]


BAD_PATHS = {
    "missing field": (["--length", "value:meta.size"],
                      "field 'meta.size' not found in {f}: meta has no field 'size' (its fields: len, inner)", 3),
    "index past the end": (["--length", "chars:segs[0].text"],
                           "field 'segs[0].text' not found in {f}: segs[0] is out of range in {short} of {n} rows "
                           "(the shortest list there has 0 elements)", 3),
    "index into a struct": (["--length", "value:meta[0]"],
                            "field 'meta[0]' not found in {f}: meta is a struct (fields: len, inner), not a list, so "
                            "it has no element [0]", 3),
    "field of a list": (["--length", "value:segs.n"],
                        "field 'segs.n' not found in {f}: segs is a list, not a struct, so it has no field 'n'", 3),
    "field of a string": (["--target-length", "chars:text.x"],
                          "field 'text.x' not found in {f}: text is a string, not a struct, so it has no field 'x'", 3),
    "missing column": (["--length", "value:recording.num_samples"],
                       "column 'recording' not found in {f} (columns: meta, segs, my.col, text)", 3),
    "bad syntax": (["--length", "value:segs[x].n"],
                   "--length value:segs[x].n: 'segs[x].n' is not a field path: cannot read '[x].n' after 'segs' "
                   "(PATH is a column, or a field nested in struct/list columns: a.b, a[0].b, a[-1])", 2),
    "bad target kind": (["--target-length", "chat:segs"],
                        "--target-length must be KIND:PATH with KIND one of list, tokens, chars, bytes, words, value, "
                        "or assistant (with --length chat:COLUMN); got 'chat:segs'", 2),
    "target tokens without tokenizer": (["--target-length", "tokens:text"],
                                        "--target-length tokens:text needs --tokenizer FILE", 2),
    "target fractional": (["--target-length", "value:segs[0].n", "--target-frames-per-second", "0"],
                          "--target-frames-per-second must be a positive number, got 0.0", 2),
    "target fps without value": (["--target-length", "chars:text", "--target-frames-per-second", "10"],
                                 "--target-frames-per-second needs --target-length value:PATH (seconds to turn into "
                                 "frames)", 2),
    "fps without value": (["--length", "chars:text", "--frames-per-second", "100"],
                          "--frames-per-second needs --length value:PATH (seconds to turn into frames); the length "
                          "is chars:text", 2),
    "fps with an auto length of text": (["--length", "auto", "--frames-per-second", "100"],
                                        "--frames-per-second needs --length value:PATH (seconds to turn into frames); "
                                        "the length is chars:text", 2),
}


@pytest.mark.parametrize("case", BAD_PATHS)
def test_bad_paths_are_one_line(tmp_path, case):
    rows = _rows(30)
    src = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    args, message, code = BAD_PATHS[case]
    if "--length" not in args:
        args = [*args, "--length", "value:meta.len"]
    result = CliRunner().invoke(app, ["analyze", str(src), "-o", str(tmp_path / "m"), "--no-progress", *args])
    short = sum(1 for r in rows if not r["segs"])
    assert result.exit_code == code, result.output
    assert result.stderr.strip().splitlines() == [f"varlen: error: {message}".format(f=src, short=short, n=len(rows))]


# -- Lhotse -------------------------------------------------------------------------------------------------
def _cuts(n: int = 23):
    """A CutSet of cuts with a recording and supervisions (texts of 0..n words), written by lhotse."""
    lhotse = pytest.importorskip("lhotse")
    rng = np.random.default_rng(3)
    words = ["hello", "world", "speech", "to", "text", "ünï"]
    cuts = []
    for i in range(n):
        seconds = float(rng.integers(20, 900)) / 100
        rec = lhotse.Recording(id=f"rec{i}", sources=[lhotse.AudioSource(type="file", channels=[0],
                                                                         source=f"/audio/{i}.flac")],
                               sampling_rate=16000, num_samples=int(seconds * 16000), duration=seconds)
        sups = [lhotse.SupervisionSegment(id=f"sup{i}-{k}", recording_id=rec.id, start=0.0, duration=seconds,
                                          text=" ".join(rng.choice(words, i + k)), speaker=f"s{i % 3}")
                for k in range(1 + i % 2)]
        cuts.append(lhotse.MonoCut(id=f"cut{i}", start=0.0, duration=seconds, channel=0, recording=rec,
                                   supervisions=sups))
    return lhotse.CutSet.from_cuts(cuts)


def test_lhotse_cutset_with_frames_and_transcript_tokens(tmp_path):
    """The issue's command on a CutSet lhotse wrote: frames of each cut at 100 per second, tokens of its
    first supervision's text through a real tokenizer; SourceDataset items are lhotse's cuts."""
    from tokenizers import Tokenizer

    cuts = _cuts()
    cuts.to_file(str(tmp_path / "cuts.jsonl.gz"))
    result = CliRunner().invoke(app, ["analyze", str(tmp_path / "cuts.jsonl.gz"), "-o", str(tmp_path / "m"),
                                      "--length", "value:duration", "--frames-per-second", "100", "--target-length",
                                      "tokens:supervisions[0].text", "--tokenizer", TOKENIZER, "--json"])
    assert result.exit_code == 0, result.output
    got = read_metrics(tmp_path / "m")
    tok = Tokenizer.from_file(TOKENIZER)
    tok.no_truncation()  # the file sets truncation at 128 and padding: lengths are the true counts
    tok.no_padding()
    back = type(cuts).from_file(str(tmp_path / "cuts.jsonl.gz"))  # lhotse reads it back: its order, its values
    assert got.column("length").to_pylist() == [math.ceil(c.duration * 100 - 1e-9) for c in back]
    assert got.column("target_length").to_pylist() == [len(tok.encode(c.supervisions[0].text)) for c in back]
    assert got.column("sample_id").to_pylist() == list(range(len(back)))
    items = SourceDataset(tmp_path / "m", columns=["id", "recording.num_samples", "supervisions"])
    for i, cut in enumerate(back):
        item = items[i]
        assert (item["id"], item["recording.num_samples"]) == (cut.id, cut.recording.num_samples)
        assert [s["text"] for s in item["supervisions"]] == [s.text for s in cut.supervisions]


def test_lhotse_shar_directory_reads_the_cut_shards_in_lhotse_order(tmp_path):
    cuts = _cuts(11)
    audio = tmp_path / "audio"
    audio.mkdir()
    import soundfile

    for cut in cuts:  # Shar stores the audio: real (silent) files for lhotse to copy into its tar shards
        soundfile.write(str(audio / f"{cut.id}.wav"), np.zeros(cut.recording.num_samples, np.float32), 16000)
        cut.recording.sources[0].source = str(audio / f"{cut.id}.wav")
    shar = tmp_path / "shar"
    shar.mkdir()
    cuts.to_shar(str(shar), fields={"recording": "wav"}, shard_size=4)
    assert any(p.name.startswith("recording.") for p in shar.iterdir())  # a directory of two formats
    _, got = run(tmp_path / "m", shar, length="value:duration", frames_per_second=100,
                 target_length="words:supervisions[-1].text")
    back = list(type(cuts).from_shar(in_dir=str(shar)))
    assert got.column("length").to_pylist() == [math.ceil(c.duration * 100 - 1e-9) for c in back]
    assert got.column("target_length").to_pylist() == [len(c.supervisions[-1].text.split()) for c in back]
    items = SourceDataset(tmp_path / "m", columns=["id"])
    assert [items[i]["id"] for i in range(len(back))] == [c.id for c in back]


# -- NeMo ---------------------------------------------------------------------------------------------------
NEMO_EXAMPLES = ["manifest__OP_0..11_CL_.json", "manifest_{0..11}.json", "manifest_(0..11).json",
                 "manifest_[0..11].json", "manifest_<0..11>.json", "manifest_{00..11}.json", "shard_{a,b}_{1..2}.json",
                 "manifest__OP_0..11..4_CL_.json"]


def test_nemo_shard_ranges_expand_as_nemo_does(tmp_path, monkeypatch):
    """NeMo's rule on the forms its docs use (``_OP_``/``_CL_`` for config files, ``{}``, ``()``, ``[]``, ``<>``),
    against ``braceexpand`` after NeMo's replacements, which is what ``expand_sharded_filepaths`` runs."""
    import braceexpand

    from varlen_cli.analyze.corpora import expand_nemo

    for example in NEMO_EXAMPLES:
        nemo = example
        for a, b in zip(["(", "[", "<", "_OP_", ")", "]", ">", "_CL_"], "{{{{}}}}"):
            nemo = nemo.replace(a, b)
        expected = [str(tmp_path / p) for p in braceexpand.braceexpand(nemo, escape=False)]
        for p in expected:
            open(p, "w").close()
        assert expand_nemo(str(tmp_path / example)) == expected, example
    assert expand_nemo(str(tmp_path / "manifest__OP_0..11_CL_.json"))[:3] == [str(tmp_path / f"manifest_{k}.json")
                                                                            for k in (0, 1, 2)]
    monkeypatch.setitem(sys.modules, "braceexpand", None)  # not installed: the extra named
    with pytest.raises(UsageError) as info:
        expand_nemo(str(tmp_path / "manifest__OP_0..11_CL_.json"))
    assert info.value.message == (f"{tmp_path}/manifest__OP_0..11_CL_.json is a brace-expanded shard range (NeMo's), "
                                  "which needs the 'braceexpand' package: pip install 'varlen-cli[nemo]'")


def test_nemo_manifest_range_sample_ids_follow_the_range(tmp_path):
    """sample_id follows the range (0, 1, ..., 10, 11: NeMo's order), not sorted paths (0, 1, 10, 11, 2...);
    a missing shard is refused in one line."""
    rows = []
    for k in range(12):
        shard = [{"audio_filepath": f"{k}_{i}.wav", "duration": k + i / 10, "text": "w " * i} for i in range(3)]
        write_jsonl(pa.Table.from_pylist(shard), tmp_path / f"manifest_{k}.json")
        rows += shard
    res, got = run(tmp_path / "m", tmp_path / "manifest__OP_0..11_CL_.json", length="value:duration",
                   frames_per_second=10, target_length="chars:text")
    assert got.column("length").to_pylist() == [math.ceil(r["duration"] * 10 - 1e-9) for r in rows]
    assert got.column("target_length").to_pylist() == [len(r["text"]) for r in rows]
    assert [f["path"] for f in res.manifest["dataset"]["files"]] == [f"manifest_{k}.json" for k in range(12)]
    items = SourceDataset(tmp_path / "m", columns=["audio_filepath"])
    assert [items[i]["audio_filepath"] for i in range(len(rows))] == [r["audio_filepath"] for r in rows]
    result = CliRunner().invoke(app, ["analyze", str(tmp_path / "manifest__OP_0..12_CL_.json"), "-o",
                                      str(tmp_path / "m2"), "--length", "value:duration", "--no-progress"])
    assert result.exit_code == 3
    assert result.stderr.strip() == (f"varlen: error: {tmp_path}/manifest_12.json does not exist: file 13 of the 13 "
                                     f"that the shard range {tmp_path}/manifest__OP_0..12_CL_.json names "
                                     f"({tmp_path}/manifest_{{0..12}}.json)")


@pytest.mark.parametrize("form", ["manifest_[0..11].json", "manifest_(0..11).json", "manifest_<0..11>.json"])
def test_nemo_bracket_forms_are_ranges_not_globs(tmp_path, form):
    """NeMo's ``[0..11]``, ``(0..11)`` and ``<0..11>`` name the 12 shards as ``_OP_0..11_CL_`` does: ``[0..11]``
    is no glob (whose class ``[0.1]`` read 2 of the 12 shards), the others no missing path."""
    (tmp_path / "d").mkdir()
    for k in range(12):
        write_jsonl(pa.Table.from_pylist([{"duration": k + 0.5, "text": "w"}]), tmp_path / "d" / f"manifest_{k}.json")
    res, got = run(tmp_path / "m", tmp_path / "d" / form, length="value:duration", frames_per_second=10)
    assert [f["path"] for f in res.manifest["dataset"]["files"]] == [f"manifest_{k}.json" for k in range(12)]
    assert got.column("length").to_pylist() == [10 * k + 5 for k in range(12)]


def test_targets_longer_than_their_samples_plan_and_validate(tmp_path):
    """A seq2seq target_length is counted apart from the source: a microbatch's targets may outnumber its
    tokens (translation into a longer language). Padded and packed plans count them as the loss tokens and
    pass validate (the planner stored tokens-without-a-target unsigned: -7 became 249)."""
    rng = np.random.default_rng(5)
    rows = [{"src": {"ids": rng.integers(0, 9, int(rng.integers(1, 8))).tolist()},
             "tgt": rng.integers(0, 9, int(rng.integers(1, 30))).tolist()} for _ in range(60)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    _, got = run(tmp_path / "m", tmp_path / "pairs.parquet", length="list:src.ids", target_length="list:tgt")
    targets = got.column("target_length").to_numpy()
    assert (targets > got.column("length").to_numpy()).any()
    runner = CliRunner()
    for extra in ([], ["--packing", "--seq-len", "16"]):
        plan = str(tmp_path / f"plan{len(extra)}.parquet")
        result = runner.invoke(app, ["plan", str(tmp_path / "m"), "-o", plan, "--max-tokens", "32", "--dp", "2",
                                     "--no-progress", *extra])
        assert result.exit_code == 0, result.output
        assert runner.invoke(app, ["validate", plan, "--metrics", str(tmp_path / "m")]).exit_code == 0
        table = pq.read_table(plan)
        per_step = {}
        for step, ids, loss in zip(*(table.column(c).to_pylist() for c in ("step", "sample_ids", "step_loss_tokens"))):
            per_step.setdefault(step, [0, loss])[0] += int(targets[ids].sum())
        assert all(want == loss for want, loss in per_step.values())
