"""Bad inputs across the pipeline: each gives one line on stderr, its exit code, and no output."""

import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.conftest import assert_user_error, sample
from varlen_cli.cli import app

runner = CliRunner()


def _write(path, data: bytes):
    with open(path, "wb") as fh:
        fh.write(data)
    return str(path)


def _corrupt_parquet(tmp):
    return [_write(tmp / "bad.parquet", b"PAR1 this is not parquet at all PAR1")]


def _truncated_jsonl(tmp):
    return [_write(tmp / "t.jsonl", b'{"text": "one"}\n{"text": "tw')]


def _wrong_type(tmp):
    return [sample("text.parquet"), "--length", "list:text"]


def _nan_values(tmp):
    pq.write_table(pa.table({"n": [3.0, float("nan"), 2.0]}), tmp / "nan.parquet")
    return [str(tmp / "nan.parquet"), "--length", "value:n"]


def _empty_dataset(tmp):
    return [_write(tmp / "empty.jsonl", b"")]


def _gz_garbage(tmp):
    return [_write(tmp / "g.jsonl.gz", b"not gzip data")]


def _unknown_column(tmp):
    return [sample("text.parquet"), "--length", "chars:body"]


def _longest_tokenized() -> int:
    """The longest sample of tokenized.parquet, from the data itself."""
    return max(len(ids) for ids in pq.read_table(sample("tokenized.parquet")).column("input_ids").to_pylist())


def _budget_below_longest(tmp):
    return [sample("tokenized.parquet"), "--max-tokens", "300"]


def _unwritable_output(tmp):
    _write(tmp / "afile", b"x")
    return [sample("tokenized.parquet"), "-o", str(tmp / "afile" / "out")]


def _existing_output(tmp):
    (tmp / "out").mkdir()
    return [sample("tokenized.parquet")]


def _unsupported_file(tmp):
    return [_write(tmp / "data.csv", b"a,b\n1,2\n")]


# (name, args builder, exit code, message on stderr)
CASES = [
    ("corrupted parquet", _corrupt_parquet, 3, "cannot read Parquet file"),
    ("truncated jsonl line", _truncated_jsonl, 3, "invalid JSONL in"),
    ("gzip that is not gzip", _gz_garbage, 3, "cannot read"),
    ("wrong column type", _wrong_type, 3, "--length list:text needs a list column, but 'text' is string"),
    ("unknown column", _unknown_column, 3, "column 'body' not found in"),
    ("NaN values", _nan_values, 3, "column 'n' has 1 NaN values in"),
    ("empty dataset", _empty_dataset, 3, "the sources hold no samples (empty dataset)"),
    ("budget below the longest sample", _budget_below_longest, 3,
     f"samples do not fit the budget --max-tokens 300 (the longest has {_longest_tokenized():,} tokens)"),
    ("unwritable output", _unwritable_output, 4, "cannot create output"),
    ("existing output", _existing_output, 4, "already exists; pass --overwrite to replace it"),
    ("unsupported file type", _unsupported_file, 3, "unsupported source file"),
]


@pytest.mark.parametrize("name,build,code,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_one_line_exit_code_no_output(tmp_path, name, build, code, message):
    args = build(tmp_path)
    if "-o" not in args:
        args = args[:1] + ["-o", str(tmp_path / "out")] + args[1:]
    before = set(os.listdir(tmp_path))
    result = runner.invoke(app, ["run", *args, "--no-progress"])
    assert_user_error(result, code, re.compile(".*" + re.escape(message) + ".*"))
    # Nothing new where outputs go: no final directory, no temporary leftovers.
    assert set(os.listdir(tmp_path)) == before


def test_zero_length_samples_are_kept_with_a_warning(tmp_path):
    src = _write(tmp_path / "lines.txt", b"hello world\n\nfoo\n\n")
    result = runner.invoke(app, ["run", src, "-o", str(tmp_path / "out"), "--length", "words:text", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "varlen: warning: 2 samples have length 0; they are kept" in result.stderr
    rows = pq.read_table(tmp_path / "out" / "plan.parquet").column("sample_ids").to_pylist()
    ids = sorted(i for row in rows for i in row)
    assert ids == [0, 1, 2, 3]


def test_usage_errors_are_one_line_with_exit_code_2(tmp_path):
    env = dict(os.environ, VARLEN_NO_PROGRESS="1")
    for args, message in [
        (["analyze", sample("text.parquet")], "Missing option '-o' / '--output'"),
        (["plan", "x", "-o", "y", "--bogus"], "No such option: --bogus"),
        (["analyze", sample("text.parquet"), "-o", str(tmp_path / "m"), "--length", "nope"], "--length must be "
                                                                                             "KIND:PATH"),
        (["plan", "x", "-o", "y", "--max-tokens", "10", "--dp", "0"], "--dp must be >= 1"),
    ]:
        proc = subprocess.run([sys.executable, "-m", "varlen_cli", *args], capture_output=True, text=True, env=env)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], proc.stderr


def test_debug_shows_the_traceback(tmp_path):
    env = dict(os.environ, VARLEN_NO_PROGRESS="1")
    proc = subprocess.run([sys.executable, "-m", "varlen_cli", "--debug", "analyze", str(tmp_path / "missing"), "-o",
                           str(tmp_path / "m")], capture_output=True, text=True, env=env)
    assert proc.returncode == 3
    assert "Traceback" in proc.stderr and proc.stderr.strip().endswith("does not exist")


def test_outputs_stay_inside_the_output_directory(tmp_path):
    """A run writes only inside OUT (no files beside it, nothing in the working directory)."""
    work = tmp_path / "work"
    work.mkdir()
    before = set(os.listdir(tmp_path))
    result = runner.invoke(app, ["run", sample("tokenized.parquet"), "-o", str(tmp_path / "out"), "--no-progress",
                                 "--order", "curriculum"])
    assert result.exit_code == 0, result.output
    assert set(os.listdir(tmp_path)) == before | {"out"}
    assert sorted(os.listdir(tmp_path / "out")) == ["_run.json", "metrics", "plan.parquet", "sorted"]
    data = json.loads((tmp_path / "out" / "_run.json").read_text())
    assert data["sorted"]["artifact_id"] and data["metrics"]["artifact_id"]


def test_plan_refuses_a_sorted_dir_whose_metrics_were_rebuilt(tmp_path):
    from varlen_cli.analyze import AnalyzeConfig, analyze
    from varlen_cli.errors import InputError
    from varlen_cli.plan import PlanConfig, plan
    from varlen_cli.sort import SortConfig, sort

    metrics, sorted_ = str(tmp_path / "m"), str(tmp_path / "s")
    analyze(AnalyzeConfig(sources=(sample("tokenized.parquet"),), output=metrics, progress=False))
    sort(SortConfig(metrics_dir=metrics, output=sorted_, progress=False))
    plan(PlanConfig(input=sorted_, output=str(tmp_path / "ok.parquet"), max_tokens=4096, order="curriculum"))
    # The dataset changes and the metrics are rebuilt; the sorted directory is now stale.
    analyze(AnalyzeConfig(sources=(sample("text.parquet"),), output=metrics, length="chars:text", overwrite=True,
                          progress=False))
    with pytest.raises(InputError, match=r"s is stale: .*m was rebuilt after it .*; re-run `varlen sort`"):
        plan(PlanConfig(input=sorted_, output=str(tmp_path / "p.parquet"), max_tokens=4096, order="curriculum"))
    assert not (tmp_path / "p.parquet").exists()
