"""`varlen run`: the whole pipeline in one launch, its outputs, and its failure behaviour."""

import json
import os
import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.conftest import sample
from tests.launcher import launch
from varlen_cli.cli import app
from varlen_cli.errors import InputError, OutputError, UsageError
from varlen_cli.run import RunConfig, run
from varlen_cli.validate import ValidateConfig, validate


def _cli(*args, cwd=None):
    env = dict(os.environ, VARLEN_NO_PROGRESS="1")
    return subprocess.run([sys.executable, "-m", "varlen_cli", *args], capture_output=True, text=True, cwd=cwd, env=env)


def test_quick_start_run_needs_only_source_and_output(tmp_path):
    out = tmp_path / "out"
    proc = _cli("run", sample("tokenized.parquet"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["_run.json", "metrics", "plan.parquet"]
    manifest = json.loads((out / "_run.json").read_text())
    assert manifest["auto_max_tokens"] == 16384 and manifest["plan"]["num_steps"] > 0
    assert "varlen run" in proc.stdout and "padding %" in proc.stdout
    result = validate(ValidateConfig(str(out / "plan.parquet"), metrics=str(out / "metrics")))
    assert result.ok, result.violations


def test_run_curriculum_two_workers_matches_one_worker(tmp_path):
    """Analyze + sort distributed in one process group, then plan: same plan as with one worker."""
    common = dict(analyze={"tokenizer": sample("tokenizer.json"), "length": "tokens:text"},
                  plan={"order": "curriculum", "dp": 2, "grad_accum": 2, "max_tokens": 2048}, progress=False)
    one = run(RunConfig(sources=(sample("text.parquet"),), output=str(tmp_path / "one"), **common))
    two = run(RunConfig(sources=(sample("text.parquet"),), output=str(tmp_path / "two"), nproc=2, **common))
    assert one.sort is not None and two.sort is not None
    assert two.analyze.num_parts == 2
    a = pq.read_table(tmp_path / "one" / "plan.parquet")
    b = pq.read_table(tmp_path / "two" / "plan.parquet")
    assert a.equals(b)
    assert pq.read_table(tmp_path / "one" / "sorted").equals(pq.read_table(tmp_path / "two" / "sorted"))
    assert validate(ValidateConfig(str(tmp_path / "two" / "plan.parquet"), metrics=str(tmp_path / "two" / "sorted"))).ok


def test_run_failure_leaves_no_output(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(InputError, match="samples do not fit the budget --max-tokens 100"):
        run(RunConfig(sources=(sample("tokenized.parquet"),), output=str(out), plan={"max_tokens": 100},
                      progress=False))
    assert not out.exists()
    assert [p for p in os.listdir(tmp_path)] == []


def test_run_refuses_existing_output_and_unknown_stage_option(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OutputError, match="already exists; pass --overwrite"):
        run(RunConfig(sources=(sample("tokenized.parquet"),), output=str(out)))
    with pytest.raises(UsageError, match="unknown plan option"):
        run(RunConfig(sources=(sample("tokenized.parquet"),), output=str(tmp_path / "x"), plan={"budget": 3}))


@pytest.mark.slow
def test_stages_under_torchrun_match_one_process(tmp_path):
    """`torchrun -m varlen_cli STAGE`: the launcher's environment path (not --nproc) gives the same
    artifacts as one in-process worker; a user error is reported with the failing rank. The stages run
    under tests/launcher.py (torchrun's worker environment, checked against the real torchrun in
    tests/test_launcher.py; ranks forked from a process that imported varlen once); the one-worker
    references in this process."""
    env = dict(os.environ, VARLEN_NO_PROGRESS="1", OMP_NUM_THREADS="1")
    src = sample("text.jsonl")
    analyze = ["analyze", src, "-o", str(tmp_path / "m2"), "--length", "words:text"]
    sort = ["sort", str(tmp_path / "m2"), "-o", str(tmp_path / "s2"), "--ties", "shuffle", "--seed", "3"]
    proc = launch("varlen_cli", *analyze, module=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = launch("varlen_cli", *sort, module=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runner = CliRunner()
    assert runner.invoke(app, ["analyze", src, "-o", str(tmp_path / "m1"), "--length", "words:text"]).exit_code == 0
    sorted_ = runner.invoke(app, ["sort", str(tmp_path / "m1"), "-o", str(tmp_path / "s1"), "--ties", "shuffle",
                                  "--seed", "3"])
    assert sorted_.exit_code == 0, sorted_.output
    assert len(os.listdir(tmp_path / "m2")) == 3  # two parts and the manifest
    assert pq.read_table(tmp_path / "m1").equals(pq.read_table(tmp_path / "m2"))
    assert pq.read_table(tmp_path / "s1").equals(pq.read_table(tmp_path / "s2"))
    proc = launch("varlen_cli", *sort, module=True, env=env, timeout=300)  # output exists now
    assert proc.returncode != 0
    # every rank finds the output there; the first to fail makes torchrun stop the other, which may not print
    assert re.search(r"varlen: error: \[rank [01]\] output \S+ already exists; pass --overwrite", proc.stderr), \
        proc.stderr[-2000:]


def test_plan_of_a_run_records_its_final_paths_and_finds_its_metrics_after_a_move(tmp_path):
    """`varlen run` builds OUT in a temporary sibling and renames it: what its artifacts record (the
    plan's input, the manifests' paths) is where they end up, never the temporary (`varlen inspect`
    showed the deleted `.OUT.varlen-tmp-...` as the plan's input); moved elsewhere, replan finds the
    metrics through the path relative to the plan."""
    out = tmp_path / "out"
    result = run(RunConfig(sources=(sample("tokenized.parquet"),), output=str(out), plan={"dp": 2, "epochs": 2},
                           progress=False))
    meta = json.loads(pq.read_schema(out / "plan.parquet").metadata[b"varlen"])
    assert meta["input"]["path"] == meta["config"]["input"] == str(out / "metrics")
    assert meta["input"]["relative_path"] == "metrics" and result.plan.output == str(out / "plan.parquet")
    assert ".varlen-tmp" not in (out / "metrics" / "_manifest.json").read_text() + (out / "_run.json").read_text()
    shown = CliRunner().invoke(app, ["inspect", str(out / "plan.parquet")], env={"COLUMNS": "200"}).output
    assert f"{out / 'metrics'} (metrics" in shown and ".varlen-tmp" not in shown
    assert validate(ValidateConfig(str(out / "plan.parquet"), metrics=str(out / "metrics"))).ok
    moved = tmp_path / "moved"
    os.rename(out, moved)
    proc = _cli("replan", str(moved / "plan.parquet"), "--from-step", "1", "--dp", "3", "-o",
                str(tmp_path / "r.parquet"))
    assert proc.returncode == 0, proc.stderr
    replanned = json.loads(pq.read_schema(tmp_path / "r.parquet").metadata[b"varlen"])
    assert replanned["input"]["path"] == str(moved / "metrics") and replanned["dp"] == 3


def test_lengths_in_characters_are_said_so(tmp_path):
    """analyze without --tokenizer on a text column measures characters: its summary and stderr say so,
    and `varlen plan --max-tokens` of those metrics says it budgets characters (it did so silently)."""
    runner = CliRunner()
    res = runner.invoke(app, ["analyze", sample("text.parquet"), "-o", str(tmp_path / "m"), "--no-progress"],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "chars:text (characters, not tokens)" in res.stdout
    assert res.stderr == ("varlen: warning: the lengths are characters (chars:text), not tokens: `varlen plan "
                          "--max-tokens N` budgets N characters per microbatch (pass --tokenizer FILE_OR_DIR to "
                          "measure tokens)\n")
    res = runner.invoke(app, ["plan", str(tmp_path / "m"), "-o", str(tmp_path / "p.parquet"), "--max-tokens", "4096",
                              "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["output"], res.output
    assert res.stderr == ("varlen: warning: the metrics' lengths are characters (chars:text), not tokens: "
                          "--max-tokens 4096 budgets 4,096 characters per microbatch (analyze with --tokenizer "
                          "FILE_OR_DIR for token lengths)\n")
    tokens = runner.invoke(app, ["analyze", sample("text.parquet"), "-o", str(tmp_path / "t"), "--no-progress",
                                 "--tokenizer", sample("tokenizer.json"), "--json"])
    assert tokens.exit_code == 0 and tokens.stderr == "" and json.loads(tokens.stdout)["length"] == "tokens:text"


def test_run_counts_assistant_tokens_with_target_length(tmp_path):
    """`varlen run` offers analyze's chat options (--length chat:COLUMN, a tokenizer directory,
    --target-length): its plan counts the assistant tokens, as analyze + plan do."""
    from typer.testing import CliRunner

    from tests.formats_helpers import CHAT_TEMPLATE, chat_source, sentencepiece_dir
    from varlen_cli.cli import app

    pytest.importorskip("transformers")
    tok_dir = sentencepiece_dir(tmp_path, "LlamaTokenizer", CHAT_TEMPLATE)
    src, _ = chat_source(tmp_path)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", src, "-o", str(out), "--length", "chat:messages", "--tokenizer", tok_dir,
                                      "--target-length", "assistant", "--lr-scale-by", "tokens", "--dp", "2",
                                      "--order", "random", "--tail", "drop", "--no-progress"])
    assert result.exit_code == 0, result.output
    target = pq.read_table(out / "metrics", columns=["sample_id", "target_length"]).to_pydict()
    per_id = dict(zip(target["sample_id"], target["target_length"]))
    rows = pq.read_table(out / "plan.parquet").to_pylist()
    per_step: dict = {}
    for r in rows:
        per_step[r["step"]] = per_step.get(r["step"], 0) + sum(per_id[i] for i in r["sample_ids"])
    assert all(r["step_loss_tokens"] == per_step[r["step"]] for r in rows)
    meta = json.loads(pq.read_schema(out / "plan.parquet").metadata[b"varlen"])
    assert meta["loss_tokens"] == "target_length" and meta["config"]["lr_scale_by"] == "tokens"
    report = validate(ValidateConfig(str(out / "plan.parquet"), metrics=str(out / "metrics")))
    loss = next(c for c in report.checks if c.name == "loss tokens")
    assert report.ok and not loss.skipped
