"""Bad inputs to ``varlen analyze``: one clear line, the documented exit code, and no partial output."""

from __future__ import annotations

import gzip
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.analyze_helpers import leftovers, run, text_table, write_jsonl, write_parquet
from tests.conftest import assert_user_error, sample
from varlen_cli.cli import app
from varlen_cli.errors import InputError, OutputError, UsageError

TOK = sample("tokenizer.json")


def _numbers(tmp, values, name="n.parquet"):
    return write_parquet(pa.table({"n": pa.array(values, pa.float64()), "text": ["x"] * len(values)}), tmp / name)


def _first_batch_rows() -> int:
    """Rows of the first batch a difficulty function gets from text.parquet: its first row group."""
    return pq.ParquetFile(sample("text.parquet")).metadata.row_group(0).num_rows


def _module(tmp, body: str, name: str) -> str:
    (tmp / f"{name}.py").write_text(body)
    return name


# Each case: a function of tmp_path returning (arguments after SOURCE..., message, exit code).
# "{out}" in a message is the output path; the message must match exactly.
CASES = {
    "missing source": lambda t: ([str(t / "nope.parquet")], f"source {t / 'nope.parquet'} does not exist", 3),
    "no data files in directory": lambda t: (
        [str((t / "empty").mkdir() or t / "empty")],
        f"no data files (Parquet, Arrow, JSONL, text) found in directory {t / 'empty'}", 3),
    "glob matches nothing": lambda t: (
        [str(t / "*.parquet")], f"no data files (Parquet, Arrow, JSONL, text) match {t / '*.parquet'}", 3),
    "unsupported file": lambda t: (
        [str((t / "x.csv").write_text("a,b\n") and t / "x.csv")],
        f"unsupported source file {t / 'x.csv'}: expected .parquet, .arrow/.feather, .jsonl[.gz], .txt[.gz], a "
        "Megatron .idx, an MDS or LitData index.json, WebDataset .tar shards or a Lance dataset", 3),
    "corrupt parquet": lambda t: (
        [str((t / "bad.parquet").write_bytes(b"not parquet at all") and t / "bad.parquet")],
        re.compile(re.escape(f"cannot read Parquet file {t / 'bad.parquet'}: ") + r".+"), 3),
    "invalid jsonl": lambda t: (
        [str((t / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n') and t / "bad.jsonl"), "--length", "chars:text"],
        re.compile(re.escape(f"invalid JSONL in {t / 'bad.jsonl'} (bytes 0-24): ") + r".+"), 3),
    "not utf-8 text": lambda t: (
        [str((t / "bad.txt").write_bytes(b"ok\n\xff\xfe\n") and t / "bad.txt")], f"{t / 'bad.txt'} is not valid UTF-8 "
                                                                                 "text", 3),
    # the same bytes as "not utf-8 text", in a JSON string: accepted before (and an internal error with tokens)
    "not utf-8 jsonl": lambda t: (
        [str((t / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n') and t / "bad.jsonl")],
        f"invalid JSONL in {t / 'bad.jsonl'} (bytes 0-30): not valid UTF-8", 3),
    "not utf-8 jsonl, tokens": lambda t: (
        [str((t / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n') and t / "bad.jsonl"),
         "--length", "tokens:text", "--tokenizer", sample("tokenizer.json")],
        f"invalid JSONL in {t / 'bad.jsonl'} (bytes 0-30): not valid UTF-8", 3),
    "not utf-8 jsonl.gz": lambda t: (
        [str((t / "bad.jsonl.gz").write_bytes(gzip.compress(b'{"text": "\xff"}\n')) and t / "bad.jsonl.gz")],
        f"invalid JSONL in {t / 'bad.jsonl.gz'} (file): not valid UTF-8", 3),
    "DatasetDict directory": lambda t: (
        [str(_dataset_dict(t))],
        f"{t / 'dd'} is a Hugging Face DatasetDict; pass one split directory (test, train)", 3),
    "unknown column": lambda t: (
        [sample("text.parquet"), "--length", "chars:body"],
        f"column 'body' not found in {sample('text.parquet')} (columns: id, text)", 3),
    "unknown difficulty column": lambda t: (
        [sample("text.jsonl"), "--length", "chars:text", "--difficulty", "value:score"],
        f"column 'score' not found in {sample('text.jsonl')} (columns: id, text)", 3),
    "wrong column type (list)": lambda t: (
        [sample("text.parquet"), "--length", "list:text"],
        f"--length list:text needs a list column, but 'text' is string in {sample('text.parquet')}", 3),
    "wrong column type (text)": lambda t: (
        [sample("tokenized.parquet"), "--length", "chars:input_ids"],
        "--length chars:input_ids needs a text column, but 'input_ids' is list<element: int32> in "
        f"{sample('tokenized.parquet')}", 3),
    "wrong column type (value)": lambda t: (
        [sample("text.parquet"), "--length", "value:text"],
        f"length column 'text' must be numeric, but it is string in {sample('text.parquet')}", 3),
    "wrong column type (difficulty)": lambda t: (
        [sample("text.parquet"), "--length", "chars:text", "--difficulty", "value:text"],
        f"difficulty column 'text' must be numeric, but it is string in {sample('text.parquet')}", 3),
    "list of strings for vocab-rarity": lambda t: (
        [write_parquet(pa.table({"w": [["a", "b"]]}), t / "w.parquet"), "--length", "list:w",
         "--difficulty", "vocab-rarity"],
        "--difficulty vocab-rarity needs integer token ids, but 'w' holds string", 3),
    "empty dataset (jsonl)": lambda t: (
        [str((t / "e.jsonl").write_bytes(b"") is not None and t / "e.jsonl"), "--length", "chars:text"],
        "the sources hold no samples (empty dataset)", 3),
    "empty dataset (parquet)": lambda t: (
        [write_parquet(text_table(0), t / "e.parquet"), "--length", "chars:text"],
        "the sources hold no samples (empty dataset)", 3),
    "missing tokenizer": lambda t: (
        [sample("text.parquet"), "--tokenizer", str(t / "tok.json")],
        f"tokenizer file or directory {t / 'tok.json'} does not exist", 3),
    "invalid tokenizer": lambda t: (
        [sample("text.parquet"), "--tokenizer",
         str((t / "tok.json").write_text('{"version": "1.0"}') and t / "tok.json")],
        re.compile(re.escape(f"{t / 'tok.json'} is not a valid tokenizer.json: ") + r"[^\n]+"), 3),
    "tokens without tokenizer": lambda t: (
        [sample("text.parquet"), "--length", "tokens:text"], "--length tokens:text needs --tokenizer FILE", 2),
    "vocab-rarity without token ids": lambda t: (
        [sample("text.parquet"), "--length", "chars:text", "--difficulty", "vocab-rarity"],
        "--difficulty vocab-rarity needs token ids: use --length tokens:COLUMN --tokenizer FILE or "
        "--length list:COLUMN on a column of token ids", 2),
    "bad --length": lambda t: (
        [sample("text.parquet"), "--length", "tokens"],
        "--length must be KIND:PATH with KIND one of list, tokens, chars, bytes, words, value, chat; "
        "got 'tokens'", 2),
    "bad --difficulty": lambda t: (
        [sample("text.parquet"), "--difficulty", "hardness"],
        "--difficulty must be length, value:COLUMN, vocab-rarity or MODULE:FUNCTION; got 'hardness'", 2),
    "bad --frames-per-second": lambda t: (
        [sample("audio_manifest.jsonl"), "--length", "value:duration", "--frames-per-second", "0"],
        "--frames-per-second must be a positive number, got 0.0", 2),
    "bad --nproc": lambda t: ([sample("text.parquet"), "--nproc", "0"], "--nproc must be at least 1, got 0", 2),
    "cannot guess length": lambda t: (
        [write_parquet(pa.table({"path": ["a.flac"], "speaker": [3]}), t / "p.parquet")],
        "cannot guess the length column; pass --length KIND:COLUMN (columns: path, speaker)", 2),
    "negative values": lambda t: (
        [_numbers(t, [1.0, -3.0, 2.0, -1.0]), "--length", "value:n"],
        f"column 'n' has 2 negative values in {t / 'n.parquet'} (first: -3)", 3),
    "NaN values": lambda t: (
        [_numbers(t, [1.0, float("nan"), 2.0]), "--length", "value:n"], "column 'n' has 1 NaN values in "
                                                                        f"{t / 'n.parquet'}", 3),
    "infinite values": lambda t: (
        [_numbers(t, [1.0, float("inf")]), "--length", "value:n", "--frames-per-second", "10"],
        f"column 'n' has 1 infinite values in {t / 'n.parquet'}", 3),
    "NaN difficulty": lambda t: (
        [_numbers(t, [1.0, float("nan")]), "--length", "chars:text", "--difficulty", "value:n"],
        f"column 'n' has 1 NaN values in {t / 'n.parquet'}", 3),
    "null values": lambda t: (
        [write_jsonl(pa.table({"text": ["a", None, "b"]}), t / "n.jsonl"), "--length", "chars:text"],
        f"column 'text' has 1 null values in {t / 'n.jsonl'}", 3),
    "fractional value without fps": lambda t: (
        [sample("audio_manifest.jsonl"), "--length", "value:duration"],
        f"length column 'duration' has fractional values in {sample('audio_manifest.jsonl')}; "
        "pass --frames-per-second F to turn seconds into frames", 3),
    "function raises": lambda t: (
        [sample("text.parquet"), "--length", "chars:text", "--difficulty",
         _module(t, "def f(batch):\n    raise ValueError('boom')\n", "varlen_err_raises") + ":f"],
        f"difficulty function varlen_err_raises:f raised ValueError: boom (on {sample('text.parquet')})", 3),
    "function wrong count": lambda t: (
        [sample("text.parquet"), "--length", "chars:text", "--difficulty",
         _module(t, "def f(batch):\n    return [1.0]\n", "varlen_err_count") + ":f"],
        f"difficulty function varlen_err_count:f returned 1 values for {_first_batch_rows()} rows (on "
        f"{sample('text.parquet')})", 3),
    "function returns NaN": lambda t: (
        [sample("text.parquet"), "--length", "chars:text", "--difficulty",
         _module(t, "def f(batch):\n    return [float('nan')] * batch.num_rows\n", "varlen_err_nan") + ":f"],
        f"difficulty function varlen_err_nan:f returned NaN for {_first_batch_rows()} rows (on "
        f"{sample('text.parquet')})", 3),
    "function returns text": lambda t: (
        [sample("text.parquet"), "--length", "chars:text", "--difficulty",
         _module(t, "def f(batch):\n    return batch.column('text')\n", "varlen_err_text") + ":f"],
        re.compile(r"difficulty function varlen_err_text:f must return numbers, got ndarray: .+"), 3),
    "function module missing": lambda t: (
        [sample("text.parquet"), "--length", "chars:text", "--difficulty", "varlen_no_such_module:f"],
        "--difficulty varlen_no_such_module:f: cannot import module 'varlen_no_such_module': ModuleNotFoundError: "
        "No module named 'varlen_no_such_module'", 2),
    "function missing": lambda t: (
        [sample("text.parquet"), "--length", "chars:text", "--difficulty",
         _module(t, "x = 1\n", "varlen_err_nofunc") + ":f"],
        "--difficulty varlen_err_nofunc:f: module 'varlen_err_nofunc' has no function 'f'", 2),
}


def _dataset_dict(t):
    root = t / "dd"
    for split in ("train", "test"):
        (root / split).mkdir(parents=True)
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    return root


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_input(tmp_path, monkeypatch, case):
    work = tmp_path / "in"
    work.mkdir()
    monkeypatch.chdir(work)  # user modules are written here and found on the current directory
    args, message, code = CASES[case](work)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["analyze", *args, "-o", str(out), "--no-progress"])
    assert_user_error(result, code, message)
    assert result.stdout == ""
    assert leftovers(tmp_path) == []  # neither the output nor its temporary directory


def test_unreadable_source(tmp_path):
    """A source that exists but cannot be opened: a symlink loop (runs as any user, root too), and a
    file without read permission (only where permissions apply, i.e. not as root)."""
    loop = tmp_path / "loop.parquet"
    os.symlink("loop.parquet", loop)
    with pytest.raises(InputError) as err:
        run(tmp_path / "out", loop, length="chars:text")
    assert err.value.message == f"source {loop} is not readable: Too many levels of symbolic links"
    assert leftovers(tmp_path) == []
    os.remove(loop)
    src = write_parquet(text_table(10), tmp_path / "locked.parquet")
    os.chmod(src, 0)
    try:
        if os.access(src, os.R_OK):
            return  # root reads any file; the branch is covered by the loop above
        with pytest.raises(InputError) as err:
            run(tmp_path / "out", src, length="chars:text")
        assert err.value.message == f"source {src} is not readable: Permission denied"
        assert leftovers(tmp_path) == []
    finally:
        os.chmod(src, 0o644)


def test_output_exists_without_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = CliRunner().invoke(app, ["analyze", sample("text.parquet"), "-o", str(out), "--length", "chars:text"])
    assert result.exit_code == 4
    assert result.stderr == f"varlen: error: output {out} already exists; pass --overwrite to replace it\n"
    assert os.listdir(out) == ["keep.txt"] and leftovers(tmp_path) == ["out"]
    with pytest.raises(OutputError):
        run(out, sample("text.parquet"), length="chars:text")
    # An output path that is a file is refused even with --overwrite.
    (tmp_path / "outfile").write_text("x")
    with pytest.raises(OutputError, match="exists and is not a directory"):
        run(tmp_path / "outfile", sample("text.parquet"), length="chars:text", overwrite=True)


def test_failure_keeps_previous_output(tmp_path):
    """With --overwrite, a run that fails leaves the old output as it was."""
    out = tmp_path / "out"
    run(out, sample("text.parquet"), length="chars:text")
    before = sorted(os.listdir(out))
    with pytest.raises(UsageError):
        run(out, sample("text.parquet"), length="tokens:text", overwrite=True)
    with pytest.raises(InputError):
        run(out, sample("text.parquet"), length="chars:nope", overwrite=True)
    assert sorted(os.listdir(out)) == before and leftovers(tmp_path) == ["out"]


def test_gzip_jsonl_invalid(tmp_path):
    path = tmp_path / "bad.jsonl.gz"
    with gzip.open(path, "wb") as fh:
        fh.write(b'{"text": "a"}\nnot json\n')
    with pytest.raises(InputError, match=re.escape(f"invalid JSONL in {path} (file): ")):
        run(tmp_path / "out", path, length="chars:text")
    assert leftovers(tmp_path) == []


def test_schema_differs_between_files(tmp_path):
    write_parquet(text_table(5), tmp_path / "a.parquet")
    write_parquet(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(InputError) as err:
        run(tmp_path / "out", tmp_path / "a.parquet", tmp_path / "b.parquet", length="chars:text")
    assert err.value.message == f"column 'text' not found in {tmp_path / 'b.parquet'} (columns: body)"
    assert pq.read_table(tmp_path / "a.parquet").num_rows == 5


def test_an_in_memory_dataset_is_refused(tmp_path):
    """analyze() of an in-memory datasets.Dataset said "output lies inside the input Dataset(...)"."""
    datasets = pytest.importorskip("datasets")
    from varlen_cli.analyze import AnalyzeConfig, analyze

    ds = datasets.Dataset.from_dict({"text": ["a", "bb"]})
    message = ("analyze reads sources from files, local or remote (paths or URLs), not an in-memory datasets.Dataset: "
               "a datasets.Dataset is measured by varlen_cli.analyze.analyze_dataset(dataset, output, ...)")
    for sources in ((ds,), ds):
        with pytest.raises(UsageError, match="^" + re.escape(message) + "$"):
            analyze(AnalyzeConfig(sources=sources, output=str(tmp_path / "m")))
    with pytest.raises(UsageError, match="^give at least one SOURCE$"):
        analyze(AnalyzeConfig(sources=(), output=str(tmp_path / "m")))
    assert not os.path.exists(tmp_path / "m")
