"""Output safety (issue 11): nothing varlen did not make is replaced, nothing is lost when a command
fails or is killed, and every bad input or fault is one line with its exit code.

Each row of :data:`CASES` runs one command line in a fresh copy of a small workspace (a source
directory, its metrics, a plan, a run directory) and checks the exit code, the exact one-line
message, that every input and previous output is byte-identical afterwards (tree hashes), and that
no temporary or lock is left beside the outputs. docs/commands.md "Output safety" lists the rows.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.analyze_helpers import text_table, write_jsonl
from tests.conftest import ROOT, assert_user_error
from tests.launcher import launch
from tests.plan_helpers import write_metrics
from varlen_cli import format
from varlen_cli.cli import app
from varlen_cli.runtime import safety

runner = CliRunner()
ENV = dict(os.environ, VARLEN_NO_PROGRESS="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


# -- helpers ---------------------------------------------------------------------------------------
def tree_hash(path: str) -> str:
    """Names, link targets and bytes of everything under ``path`` (not following links)."""
    h = hashlib.sha256()
    if not os.path.lexists(path):
        return "absent"
    for root, dirs, files in os.walk(path) if os.path.isdir(path) and not os.path.islink(path) else [("", [], [path])]:
        dirs.sort()
        for name in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            p = os.path.join(root, name)
            h.update(os.path.relpath(p, path).encode())
            if os.path.islink(p):
                h.update(b"->" + os.readlink(p).encode())
            else:
                with open(p, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()


def leftovers(*dirs: str) -> list[str]:
    """Temporaries, set-aside old outputs and locks of varlen beside its outputs."""
    tags = (safety.TMP_TAG, safety.OLD_TAG, safety.LOCK_TAG)
    return sorted(n for d in dirs for n in os.listdir(d) if any(t in n for t in tags))


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "varlen_cli", *args], capture_output=True, text=True,
                          env=env or ENV, timeout=300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """src/ (JSONL), m/ (its metrics), p.parquet (a plan of m), r/ (a varlen run of src)."""
    root = tmp_path_factory.mktemp("ws")
    (root / "src").mkdir()
    write_jsonl(text_table(300, seed=4), root / "src" / "a.jsonl")
    for args in (["analyze", "src", "-o", "m", "--length", "words:text"],
                 ["plan", "m", "-o", "p.parquet", "--max-tokens", "256"],
                 ["run", "src", "-o", "r", "--length", "words:text", "--max-tokens", "256", "--no-progress"]):
        cwd = os.getcwd()
        os.chdir(root)
        try:
            result = runner.invoke(app, args)
        finally:
            os.chdir(cwd)
        assert result.exit_code == 0, result.output
    return root


@pytest.fixture
def ws(base, tmp_path, monkeypatch):
    """A fresh copy of the workspace, as the current directory."""
    root = tmp_path / "ws"
    shutil.copytree(base, root, symlinks=True)
    monkeypatch.chdir(root)
    return root


def lengths_of(metrics: str) -> np.ndarray:
    return pq.read_table(os.path.join(metrics, "part-00000.parquet")).column("length").to_numpy()


# -- the table ----------------------------------------------------------------------------------------
# Each setup gets the workspace and returns (args, exit code, message or compiled pattern, paths that
# must be unchanged). Paths are relative to the workspace.
def _run_overwrite_failing(ws):
    n = int((lengths_of("r/metrics") > 10).sum())
    return (["run", "src", "-o", "r", "--length", "words:text", "--max-tokens", "10", "--overwrite", "--no-progress"],
            3, f"{n:,} samples do not fit the budget --max-tokens 10 (the longest has "
               f"{int(lengths_of('r/metrics').max()):,} tokens); raise --max-tokens or pass --drop-long", ["r", "src"])


def _analyze_onto_source(ws):
    return (["analyze", "src", "-o", "src", "--overwrite"], 4,
            "output src is the input src; write the output elsewhere", ["src", "m"])


def _analyze_inside_source(ws):
    return (["analyze", "src", "-o", "src/metrics"], 4,
            "output src/metrics lies inside the input src; write the output elsewhere", ["src"])


def _analyze_glob_inside_source(ws):
    return (["analyze", "src/*.jsonl", "-o", "src/metrics"], 4,
            "output src/metrics lies inside the input src/*.jsonl; write the output elsewhere", ["src"])


def _analyze_inside_file_url_source(ws):
    src = f"file://{ws}/src"  # a file:// URL is the local path: the same overlap rules
    return (["analyze", src, "-o", "src/metrics"], 4,
            f"output src/metrics lies inside the input {src}; write the output elsewhere", ["src"])


def _plan_output_as_file_url(ws):
    out = f"file://{ws}/p2.parquet"  # was written to ./file:/.../p2.parquet, reported as a success
    return (["plan", "m", "-o", out, "--max-tokens", "256"], 4,
            f"output {out} is a URL; varlen writes a local output by its path: give {ws}/p2.parquet",
            ["file:", "p2.parquet"])


def _analyze_contains_source(ws):
    os.makedirs("outer/data")
    shutil.copy("src/a.jsonl", "outer/data/a.jsonl")
    return (["analyze", "outer/data", "-o", "outer", "--overwrite"], 4,
            "output outer contains the input outer/data; write the output elsewhere", ["outer"])


def _plan_into_metrics(ws):
    return (["plan", "m", "-o", "m/part-00000.parquet", "--max-tokens", "256", "--overwrite"], 4,
            "output m/part-00000.parquet lies inside the input m; write the output elsewhere", ["m"])


def _sort_onto_input(ws):
    return ["sort", "m", "-o", "m", "--overwrite"], 4, "output m is the input m; write the output elsewhere", ["m"]


def _run_inside_source(ws):
    return (["run", "src", "-o", "src/run", "--max-tokens", "256"], 4,
            "output src/run lies inside the input src; write the output elsewhere", ["src"])


def _symlinked_dir_output(ws):
    os.symlink("m", "mlink")
    return (["analyze", "src", "-o", "mlink", "--overwrite"], 4,
            "output mlink is a symbolic link; --overwrite does not replace links or their targets (remove the link "
            "or give the real path)", ["m", "mlink", "src"])


def _symlinked_plan_output(ws):
    os.symlink("p.parquet", "plink.parquet")
    return (["plan", "m", "-o", "plink.parquet", "--max-tokens", "256", "--overwrite"], 4,
            "output plink.parquet is a symbolic link; --overwrite does not replace links or their targets (remove "
            "the link or give the real path)", ["p.parquet", "plink.parquet"])


def _dangling_symlink_output(ws):
    os.symlink("nowhere", "gone")
    return (["analyze", "src", "-o", "gone"], 4, "output gone already exists; pass --overwrite to replace it",
            ["gone"])


def _overwrite_foreign_dir(ws):
    os.makedirs("mine")
    (ws / "mine" / "thesis.tex").write_text("years of work")
    return (["analyze", "src", "-o", "mine", "--overwrite"], 4,
            "output mine is a directory varlen did not make (no varlen _manifest.json or _run.json); --overwrite "
            "replaces only varlen outputs", ["mine"])


def _run_overwrite_foreign_dir(ws):
    os.makedirs("mine")
    (ws / "mine" / "notes.txt").write_text("keep")
    return (["run", "src", "-o", "mine", "--max-tokens", "256", "--overwrite"], 4,
            "output mine is a directory varlen did not make (no varlen _manifest.json or _run.json); --overwrite "
            "replaces only varlen outputs", ["mine"])


def _tokenizer_inside_output(ws):
    shutil.copy(os.path.join(ROOT, "sample_data", "tokenizer.json"), "m/tokenizer.json")
    return (["analyze", "src", "-o", "m", "--length", "tokens:text", "--tokenizer", "m/tokenizer.json",
             "--overwrite"], 4, "output m contains the input m/tokenizer.json; write the output elsewhere", ["m"])


def _difficulty_module_inside_output(ws):
    (ws / "m" / "rank.py").write_text("def f(batch):\n    return [0.0] * batch.num_rows\n")
    return (["analyze", "src", "-o", "m", "--difficulty", "m.rank:f", "--overwrite"], 4,
            f"output m contains the input {os.path.join('m', 'rank.py')}; write the output elsewhere", ["m"])


def _run_tokenizer_inside_output(ws):
    shutil.copy(os.path.join(ROOT, "sample_data", "tokenizer.json"), "r/tok.json")
    return (["run", "src", "-o", "r", "--length", "tokens:text", "--tokenizer", "r/tok.json", "--max-tokens", "256",
             "--overwrite", "--no-progress"], 4, "output r contains the input r/tok.json; write the output elsewhere",
            ["r"])


def _run_profile_inside_output(ws):
    (ws / "r" / "profile.json").write_text("{}")
    return (["run", "src", "-o", "r", "--memory-profile", "r/profile.json", "--max-memory", "1GiB", "--overwrite"], 4,
            "output r contains the input r/profile.json; write the output elsewhere", ["r"])


def _overwrite_varlen_dir_with_user_files(ws):
    (ws / "m" / "notes.txt").write_text("keep")
    os.makedirs("m/mine")
    return (["analyze", "src", "-o", "m", "--length", "words:text", "--overwrite"], 4,
            "output m holds files varlen did not write (mine/, notes.txt); --overwrite replaces only what varlen made: "
            "move them out first", ["m"])


def _sort_overwrite_with_user_file(ws):
    assert runner.invoke(app, ["sort", "m", "-o", "s"]).exit_code == 0
    (ws / "s" / "part-00009.parquet").write_text("not varlen's: the manifest does not list it")
    return (["sort", "m", "-o", "s", "--overwrite"], 4,
            "output s holds files varlen did not write (part-00009.parquet); --overwrite replaces only what varlen "
            "made: move them out first", ["s"])


def _run_overwrite_with_user_files(ws):
    (ws / "r" / "metrics" / "notes.txt").write_text("keep")
    (ws / "r" / "README").write_text("keep")
    return (["run", "src", "-o", "r", "--length", "words:text", "--max-tokens", "256", "--overwrite",
             "--no-progress"], 4,
            f"output r holds files varlen did not write (README, {os.path.join('metrics', 'notes.txt')}); "
            "--overwrite replaces only what varlen made: move them out first", ["r"])


def _overwrite_foreign_file(ws):
    (ws / "notes.parquet").write_text("not a plan")
    return (["plan", "m", "-o", "notes.parquet", "--max-tokens", "256", "--overwrite"], 4,
            "output notes.parquet is not a varlen plan; --overwrite replaces only varlen outputs", ["notes.parquet"])


def _plan_output_named_like_folder(ws):
    return (["plan", "m", "-o", "newdir/", "--max-tokens", "256"], 4,
            "output newdir/ ends with '/', which names a folder; give a file name such as newdir/plan.parquet",
            ["newdir"])


def _dir_output_is_file(ws):
    return (["analyze", "src", "-o", "p.parquet", "--overwrite"], 4, "output p.parquet exists and is not a directory",
            ["p.parquet"])


def _plan_output_is_dir(ws):
    return (["plan", "m", "-o", "r", "--max-tokens", "256", "--overwrite"], 4,
            "output r is a directory; give a file name such as plan.parquet", ["r"])


def _live_lock(ws):
    lock = ws / ".m.varlen-lock"
    lock.write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "time": 0}))
    return (["analyze", "src", "-o", "m", "--overwrite", "--length", "words:text"], 4,
            f"output m is being written by pid {os.getpid()} on {os.uname().nodename} (lock {lock}); wait for it "
            "to finish, or remove the lock if that process is gone", ["m", ".m.varlen-lock"])


def _full_disk(ws):
    os.environ["VARLEN_FAULT_FULL_DISK"] = "1"  # removed by the test after the command
    return (["analyze", "src", "-o", "m", "--overwrite", "--length", "words:text"], 4,
            re.compile(r"cannot write .*/\.m\.varlen-tmp-[0-9a-f]+/_manifest\.json: No space left on device"),
            ["m", "src"])


def _plan_seed_negative(ws):
    return (["plan", "m", "-o", "p.parquet", "--max-tokens", "256", "--seed", "-1", "--overwrite"], 2,
            "--seed must be between 0 and 2^63-1 (got -1)", ["p.parquet", "m"])


def _run_seed_negative(ws):
    return (["run", "src", "-o", "r", "--seed", "-1", "--overwrite"], 2,
            "--seed must be between 0 and 2^63-1 (got -1)", ["r", "src"])


def _max_tokens_huge(ws):
    return (["plan", "m", "-o", "p.parquet", "--max-tokens", str(10**20), "--overwrite"], 2,
            f"--max-tokens must be at most 2^53 (got {10**20})", ["p.parquet"])


def _pad_multiple_2_32(ws):
    return (["plan", "m", "-o", "p.parquet", "--max-tokens", "256", "--pad-multiple", str(2**32), "--overwrite"], 2,
            f"--pad-multiple must be at most 2,147,483,647 (plans store it as int32; got {2**32})", ["p.parquet"])


def _seqlen_over_int32(ws):
    write_metrics(ws / "huge", [3_000_000_000, 5])
    return (["plan", "huge", "-o", "p.parquet", "--max-tokens", str(2**40), "--overwrite"], 3,
            "huge has a sample of 3,000,000,000 tokens; plans hold lengths up to 2,147,483,647 (int32)",
            ["p.parquet", "huge"])


def _padded_seqlen_over_int32(ws):
    write_metrics(ws / "mid", [2**30 + 1, 5])  # fits int32, but padded to a multiple of 2^30 it is 2^31
    return (["plan", "mid", "-o", "p.parquet", "--max-tokens", str(2**40), "--pad-multiple", str(2**30),
             "--overwrite"], 2,
            f"a microbatch would have seqlen {2**31:,}, more than plans store (2,147,483,647, int32); "
            "lower --pad-multiple or --max-tokens", ["p.parquet", "mid"])


def _base_batch_tiny(ws):
    return (["plan", "m", "-o", "p.parquet", "--max-tokens", "256", "--base-batch-size", "1e-320", "--overwrite"], 2,
            "--base-batch-size 1e-320 gives a non-finite lr_scale; give a larger base batch size", ["p.parquet"])


def _rewrite_plan(src: str, dst: str, table=None, meta_update=None) -> None:
    t = pq.read_table(src)
    meta = json.loads(t.schema.metadata[b"varlen"])
    meta.update(meta_update or {})
    t = (table if table is not None else t).replace_schema_metadata({b"varlen": json.dumps(meta).encode()})
    pq.write_table(t, dst)


def _malformed_metadata(ws):
    _rewrite_plan("p.parquet", "bad.parquet", meta_update={"dp": "two"})
    return (["validate", "bad.parquet"], 3,
            "bad.parquet has malformed plan metadata: 'dp' is \"two\", expected an integer >= 1", ["bad.parquet"])


def _malformed_metadata_inspect(ws):
    _rewrite_plan("p.parquet", "bad.parquet", meta_update={"dropped": {"sample_ids": "all"}})
    return (["inspect", "bad.parquet"], 3,
            "bad.parquet has malformed plan metadata: 'dropped' is {\"sample_ids\": \"all\"}, expected an object of "
            "sample id lists", ["bad.parquet"])


def _corrupted_pages(ws):
    data = bytearray((ws / "p.parquet").read_bytes())
    meta_len = int.from_bytes(data[-8:-4], "little")
    for i in range(8, len(data) - meta_len - 8, 3):  # every data page, not the footer
        data[i] ^= 0x5A
    (ws / "bad.parquet").write_bytes(bytes(data))
    return ["validate", "bad.parquet"], 3, re.compile(r"cannot read plan bad\.parquet: .+"), ["bad.parquet"]


def _corrupted_pages_inspect(ws):
    _corrupted_pages(ws)
    return ["inspect", "bad.parquet"], 3, re.compile(r"cannot read plan bad\.parquet: .+"), ["bad.parquet"]


def _overwrite_output_missing_parent(ws):
    """A missing parent is created (test_missing_output_parents_are_created); one that is a file cannot be."""
    (ws / "afile").write_text("user data\n")
    return (["plan", "m", "-o", "afile/such/p.parquet", "--max-tokens", "256"], 4,
            f"cannot create output afile/such/p.parquet: {ws / 'afile'} is not a directory",
            ["m", "afile"])


CASES = [
    ("run --overwrite, then the run fails", _run_overwrite_failing),
    ("analyze onto its source", _analyze_onto_source),
    ("analyze into its source", _analyze_inside_source),
    ("analyze glob into its source", _analyze_glob_inside_source),
    ("analyze inside a file:// source", _analyze_inside_file_url_source),
    ("plan output given as a file:// URL", _plan_output_as_file_url),
    ("analyze onto a directory holding its source", _analyze_contains_source),
    ("plan into its metrics", _plan_into_metrics),
    ("sort onto its input", _sort_onto_input),
    ("run into its source", _run_inside_source),
    ("symlinked directory output", _symlinked_dir_output),
    ("symlinked plan output", _symlinked_plan_output),
    ("dangling symlink output", _dangling_symlink_output),
    ("--overwrite of a directory varlen did not make", _overwrite_foreign_dir),
    ("run --overwrite of a directory varlen did not make", _run_overwrite_foreign_dir),
    ("--overwrite of a file varlen did not make", _overwrite_foreign_file),
    ("analyze --overwrite, tokenizer inside the output", _tokenizer_inside_output),
    ("analyze --overwrite, difficulty module inside the output", _difficulty_module_inside_output),
    ("run --overwrite, tokenizer inside the output", _run_tokenizer_inside_output),
    ("run --overwrite, memory profile inside the output", _run_profile_inside_output),
    ("--overwrite of a varlen directory holding user files", _overwrite_varlen_dir_with_user_files),
    ("sort --overwrite, a part the manifest does not list", _sort_overwrite_with_user_file),
    ("run --overwrite, user files in the run and its metrics", _run_overwrite_with_user_files),
    ("directory output is a plan file", _dir_output_is_file),
    ("plan output named like a folder", _plan_output_named_like_folder),
    ("plan output is a directory", _plan_output_is_dir),
    ("output locked by a live process", _live_lock),
    ("disk full while writing the manifest", _full_disk),
    ("plan --seed -1", _plan_seed_negative),
    ("run --seed -1", _run_seed_negative),
    ("plan --max-tokens 1e20", _max_tokens_huge),
    ("plan --pad-multiple 2^32", _pad_multiple_2_32),
    ("a sample of 3e9 tokens", _seqlen_over_int32),
    ("padded seqlen over int32", _padded_seqlen_over_int32),
    ("--base-batch-size 1e-320", _base_batch_tiny),
    ("malformed metadata types (validate)", _malformed_metadata),
    ("malformed metadata types (inspect)", _malformed_metadata_inspect),
    ("corrupted plan pages", _corrupted_pages),
    ("corrupted plan pages (inspect)", _corrupted_pages_inspect),
    ("plan output in a missing directory", _overwrite_output_missing_parent),
]
PROTECTED = ["src", "m", "p.parquet", "r"]  # checked in every case besides the case's own paths


@pytest.mark.parametrize("setup", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_or_fault_is_one_line_and_loses_nothing(ws, setup):
    args, code, message, keep = setup(ws)
    paths = sorted(set(PROTECTED + keep))
    before = {p: tree_hash(p) for p in paths}
    lock_before = leftovers(str(ws))
    try:
        with warnings.catch_warnings():  # a warning would be a second line on the user's stderr
            warnings.simplefilter("error")
            result = runner.invoke(app, args)
    finally:
        os.environ.pop("VARLEN_FAULT_FULL_DISK", None)
    assert_user_error(result, code, message)
    assert {p: tree_hash(p) for p in paths} == before
    assert leftovers(str(ws)) == lock_before  # no temporary, old output or lock left (a planted lock stays)


def test_missing_output_parents_are_created(ws):
    """Every command writes into directories that do not exist yet (they were refused: "directory ...
    does not exist"), through the output lock's one path; nothing else is left beside the outputs."""
    commands = [
        (["analyze", "src", "-o", "new/a/metrics", "--length", "words:text"], "new/a/metrics/_manifest.json"),
        (["sort", "m", "-o", "new/s/sorted"], "new/s/sorted/_manifest.json"),
        (["plan", "m", "-o", "new/p/plan.parquet", "--max-tokens", "256"], "new/p/plan.parquet"),
        (["replan", "p.parquet", "--from-step", "1", "--dp", "1", "-o", "new/r/plan.parquet"], "new/r/plan.parquet"),
        (["run", "src", "-o", "new/run/out", "--length", "words:text", "--max-tokens", "256"],
         "new/run/out/plan.parquet"),
    ]
    for args, made in commands:
        result = runner.invoke(app, [*args, "--no-progress"] + (["--json"] if args[0] != "replan" else []))
        assert result.exit_code == 0, (args, result.output)
        assert os.path.exists(made), args
        assert leftovers(os.path.dirname(os.path.dirname(made)) or ".") == [] and leftovers(str(ws)) == []
    assert runner.invoke(app, ["validate", "new/p/plan.parquet", "--metrics", "m"]).exit_code == 0


# -- validate: violations, not crashes ----------------------------------------------------------------
def test_validate_out_of_range_id_with_metrics(ws):
    t = pq.read_table("p.parquet")
    ids = t.column("sample_ids").to_pylist()
    ids[0] = [10**9] + ids[0][1:]
    _rewrite_plan("p.parquet", "bad.parquet", t.set_column(t.schema.get_field_index("sample_ids"), "sample_ids",
                                                            pa.array(ids, pa.list_(pa.int64()))))
    n = len(lengths_of("m"))
    result = runner.invoke(app, ["validate", "bad.parquet", "--metrics", "m"])
    assert result.exit_code == 6, result.output
    assert result.stderr.splitlines() == [f"varlen: violation: coverage: sample ids outside 0..{n - 1}"]


def test_validate_refuses_non_finite_lr_scale(ws):
    t = pq.read_table("p.parquet")
    scales = t.column("lr_scale").to_numpy().copy()
    scales[0] = np.inf
    _rewrite_plan("p.parquet", "bad.parquet", t.set_column(t.schema.get_field_index("lr_scale"), "lr_scale",
                                                            pa.array(scales)))
    result = runner.invoke(app, ["validate", "bad.parquet"])
    assert result.exit_code == 6
    assert result.stderr.splitlines() == ["varlen: violation: lr_scale: 1 rows whose lr_scale is not finite"]


def test_validate_uses_per_epoch_tail_drops(ws):
    """--tail drop over several epochs: each epoch's own drops count (the union gave false
    duplicates), and moving one epoch's drops to another is caught (the union hid it)."""
    write_metrics(ws / "ten", [100] * 10)  # one sample per microbatch: 10 microbatches for 4 slots, 2 dropped
    args = ["plan", "ten", "-o", "t.parquet", "--max-tokens", "150", "--dp", "4", "--tail", "drop", "--epochs", "3",
            "--seed", "5"]
    assert runner.invoke(app, args).exit_code == 0
    meta = json.loads(pq.read_schema("t.parquet").metadata[b"varlen"])
    tails = {t["epoch"]: t["sample_ids"] for t in meta["dropped"]["tail"]}
    assert len(tails) == 3 and all(len(v) == 2 for v in tails.values())
    assert len({tuple(sorted(v)) for v in tails.values()}) >= 2  # epochs drop different samples
    assert runner.invoke(app, ["validate", "t.parquet", "--metrics", "ten"]).exit_code == 0
    e0, e1 = sorted(tails)[:2]
    swapped = [{"epoch": e1 if t["epoch"] == e0 else e0 if t["epoch"] == e1 else t["epoch"],
                "sample_ids": t["sample_ids"]} for t in meta["dropped"]["tail"]]
    _rewrite_plan("t.parquet", "bad.parquet", meta_update={"dropped": {**meta["dropped"], "tail": swapped}})
    result = runner.invoke(app, ["validate", "bad.parquet"])
    assert result.exit_code == 6
    assert result.stderr.startswith("varlen: violation: coverage: ")


# -- locks, leftovers, kills --------------------------------------------------------------------------
def test_stale_lock_and_leftovers_of_killed_runs_are_cleaned(ws):
    (ws / ".m.varlen-lock").write_text(json.dumps({"pid": dead_pid(), "host": os.uname().nodename}))
    (ws / ".m.varlen-tmp-0123456789ab").mkdir()
    (ws / ".m.varlen-tmp-0123456789ab" / "part-00000.parquet").write_text("half")
    (ws / ".p.parquet.varlen-tmp-abcdef").write_text("half a plan")
    (ws / ".p.parquet.varlen-lock").write_text("garbage")  # unreadable and old: stale
    os.utime(ws / ".p.parquet.varlen-lock", (0, 0))
    launcher = ws.parent / f"{safety.LAUNCH_PREFIX}{dead_pid()}-x"
    launcher.mkdir()
    safety_dir = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(ws.parent)
    try:
        tempfile.tempdir = None
        assert runner.invoke(app, ["analyze", "src", "-o", "m", "--overwrite", "--length", "words:text"]).exit_code == 0
        assert runner.invoke(app, ["plan", "m", "-o", "p.parquet", "--max-tokens", "256", "--overwrite"]).exit_code == 0
    finally:
        if safety_dir is None:
            os.environ.pop("TMPDIR")
        else:
            os.environ["TMPDIR"] = safety_dir
        tempfile.tempdir = None
    assert leftovers(str(ws)) == [] and not launcher.exists()


def test_swap_killed_between_renames_puts_the_old_output_back(ws):
    """A run killed after setting the old output aside but before renaming the new one in: the next
    run restores it (and, without --overwrite, refuses to replace it)."""
    before = tree_hash("m")
    os.rename("m", ".m.varlen-old-deadbeef0000")
    result = runner.invoke(app, ["analyze", "src", "-o", "m", "--length", "words:text"])
    assert_user_error(result, 4, "output m already exists; pass --overwrite to replace it")
    assert tree_hash("m") == before and leftovers(str(ws)) == []


def test_overwrite_replaces_an_empty_directory_and_a_varlen_output(ws):
    os.makedirs("empty")
    assert runner.invoke(app, ["analyze", "src", "-o", "empty", "--overwrite"]).exit_code == 0
    assert os.path.isfile("empty/_manifest.json")
    old = tree_hash("r")
    assert runner.invoke(app, ["run", "src", "-o", "r", "--max-tokens", "300", "--overwrite",
                               "--no-progress"]).exit_code == 0
    assert tree_hash("r") != old and os.path.isfile("r/_run.json") and leftovers(str(ws)) == []


def _wait_for(pattern: str, root, timeout: float = 120.0) -> None:
    t0 = time.time()
    while not any(re.fullmatch(pattern, n) for n in os.listdir(root)):
        assert time.time() - t0 < timeout, f"{pattern} never appeared"
        time.sleep(0.05)


def _big_source(root, files=2, rows=30000) -> str:
    src = root / "big"
    src.mkdir()
    for k in range(files):
        write_jsonl(text_table(rows, seed=k), src / f"d{k}.jsonl")
    return str(src)


@pytest.mark.slow
@pytest.mark.parametrize("sig,code,line", [(signal.SIGTERM, 143, "varlen: terminated"),
                                           (signal.SIGINT, 130, "varlen: interrupted")])
def test_signalled_run_under_nproc_2_keeps_the_old_output(ws, sig, code, line):
    """SIGTERM/SIGINT while `run --nproc 2 --overwrite` builds its temporary: the exit code of one
    process (143/130), one line, the old run directory intact, and no temporary left."""
    big = _big_source(ws)
    before = tree_hash("r")
    proc = subprocess.Popen([sys.executable, "-m", "varlen_cli", "run", big, "-o", "r", "--overwrite", "--nproc", "2",
                             "--max-tokens", "4096"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(ENV, VARLEN_PAUSE="analyze.unit"),  # the stage is still running when signalled
                            cwd=ws, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))
    _wait_for(r"\.r\.varlen-tmp-[0-9a-f]+", ws)
    time.sleep(0.5)
    os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)  # ctrl-C hits the whole group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert err.splitlines()[-1] == line and "internal error" not in err
    assert tree_hash("r") == before and leftovers(str(ws)) == []
    assert cli("validate", "r/plan.parquet").returncode == 0


@pytest.mark.parametrize("args,output", [
    (["analyze", "src", "-o", "m", "--length", "chars:text", "--overwrite"], "m"),
    (["plan", "m", "-o", "p.parquet", "--max-tokens", "300", "--overwrite"], "p.parquet"),
    (["run", "src", "-o", "r", "--max-tokens", "300", "--overwrite", "--no-progress"], "r"),
], ids=["directory", "plan file", "run directory"])
def test_a_failing_rename_in_swap_in_keeps_the_old_output(ws, monkeypatch, args, output):
    """The rename of the new output into place fails (EXDEV, as across filesystems): one line, exit 4,
    the old output back byte for byte, nothing left beside it. (Catches a swap that deletes the old
    output before the new one is in place.)"""
    before = tree_hash(output)
    real_rename = os.rename

    def rename(src, dst):
        if safety.TMP_TAG in os.path.basename(src) and os.path.basename(dst) == output:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), src)
        return real_rename(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", rename)
        result = runner.invoke(app, args)
    assert_user_error(result, 4, f"cannot put output {output} in place: {os.strerror(errno.EXDEV)}")
    assert tree_hash(output) == before and leftovers(str(ws)) == []


def _signal_after_the_swap(ws, args, output, sig=signal.SIGTERM):
    """Run ``args`` paused right after its output was swapped in (``VARLEN_PAUSE=commit.swapped``),
    signal it there; returns (exit code, stderr)."""
    before = safety.identity(output)
    proc = subprocess.Popen([sys.executable, "-m", "varlen_cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(ENV, VARLEN_PAUSE="commit.swapped"), cwd=ws,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))
    t0 = time.time()
    while safety.identity(output) == before:  # the new output is in place: the run is paused just after
        assert time.time() - t0 < 120 and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.parametrize("sig,what", [(signal.SIGTERM, "terminated"), (signal.SIGINT, "interrupted")])
def test_signal_just_after_the_swap_reports_success(ws, sig, what):
    """The new plan was committed when the signal came: exit 0 and a line saying the output is complete
    (it reported failure before), the plan valid, nothing left beside it."""
    code, err = _signal_after_the_swap(ws, ["plan", "m", "-o", "p.parquet", "--max-tokens", "300", "--overwrite"],
                                       "p.parquet", sig)
    assert code == 0 and err.splitlines() == [f"varlen: {what} after p.parquet was written; it is complete"], err
    assert json.loads(pq.read_schema("p.parquet").metadata[b"varlen"])["config"]["max_tokens"] == 300
    assert cli("validate", "p.parquet", "--metrics", "m").returncode == 0 and leftovers(str(ws)) == []


@pytest.mark.slow
def test_signal_to_the_launcher_after_a_worker_swapped(ws):
    """`analyze --nproc 2`: rank 0 swapped the new metrics in, then the launcher is terminated: exit 0,
    the new metrics in place, no set-aside old output or temporary left."""
    def lengths():
        return pq.read_table("m").column("length").to_numpy()  # every part, in name order

    old = lengths()
    shutil.copy("src/a.jsonl", "src/b.jsonl")  # two work units: two workers (--nproc is capped by the units)
    old = np.concatenate([old, old])
    code, err = _signal_after_the_swap(ws, ["analyze", "src", "-o", "m", "--nproc", "2", "--overwrite",
                                            "--length", "chars:text"], "m")
    assert code == 0 and err.splitlines()[-1] == "varlen: terminated after m was written; it is complete", err
    new = lengths()  # chars, not words: the new metrics
    assert (new >= old).all() and (new > old).any() and leftovers(str(ws)) == []


def test_sigterm_while_printing_the_gantt_chart(ws):
    """SIGTERM while `simulate --gantt-step` writes its chart (blocked on a full pipe): `varlen: terminated`,
    exit 143, no traceback (it was an internal error)."""
    proc = subprocess.Popen([sys.executable, "-m", "varlen_cli", "simulate", "p.parquet", "--stages", "16",
                             "--schedule", "1f1b", "--gantt-step", "0", "--width", "4096"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, cwd=ws)
    assert proc.stdout.read(1)  # printing has begun; the chart (over 64 KiB) fills the pipe and blocks
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and err.decode().splitlines() == ["varlen: terminated"], err[-2000:]


@pytest.mark.slow
def test_killed_worker_leaves_old_output_and_next_run_cleans(ws):
    """SIGKILL (no cleanup possible): the old output stays; the next run removes the temporary."""
    before = tree_hash("m")
    shutil.copy("src/a.jsonl", "src/b.jsonl")  # two work units: two workers (--nproc is capped by the units)
    env = dict(ENV, VARLEN_FAULT="analyze.unit:1")
    proc = cli("analyze", "src", "-o", "m", "--overwrite", "--nproc", "2", env=env)
    assert proc.returncode == 5, proc.stderr
    assert tree_hash("m") == before
    assert cli("analyze", "src", "-o", "m", "--overwrite", "--length", "words:text").returncode == 0
    assert leftovers(str(ws)) == []


@pytest.mark.slow
def test_concurrent_runs_to_one_output(ws):
    """Two plans to one output at once: each succeeds or fails on the lock; the plan left is valid."""
    args = [sys.executable, "-m", "varlen_cli", "plan", "m", "-o", "same.parquet", "--max-tokens", "256",
            "--overwrite", "--epochs", "20"]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ws)
             for _ in range(3)]
    outs = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert any(code == 0 for code, _ in outs)
    for code, err in outs:
        assert code == 0 or (code == 4 and re.fullmatch(
            r"varlen: error: output same\.parquet is being written by pid \d+ on \S+ \(lock .*\.same\.parquet\."
            r"varlen-lock\); wait for it to finish, or remove the lock if that process is gone\n", err)), err
    assert cli("validate", "same.parquet", "--metrics", "m").returncode == 0
    assert leftovers(str(ws)) == []


# -- torchrun ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_plan_validate_inspect_under_torchrun(ws):
    """`torchrun --nproc-per-node 2 -m varlen_cli plan|validate|inspect|simulate|calibrate`: rank 0 works,
    writes and prints, rank 1 waits and exits 0; the plan equals a one-process plan byte for byte
    (minus created_at). Under tests/launcher.py (torchrun's worker environment, checked against the real
    torchrun in tests/test_launcher.py; ranks forked from a process that imported varlen)."""

    def two_ranks(args):
        return launch("varlen_cli", *args, module=True, cwd=ws, env=ENV, timeout=300)

    plan_args = ["plan", "m", "-o", "t.parquet", "--max-tokens", "256", "--dp", "2", "--seed", "3"]
    proc = two_ranks(plan_args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert runner.invoke(app, ["plan", "m", "-o", "one.parquet", "--max-tokens", "256", "--dp", "2", "--seed",
                               "3"]).exit_code == 0
    assert pq.read_table(ws / "t.parquet").equals(pq.read_table(ws / "one.parquet"))
    (ws / "hf.json").write_text(json.dumps({"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
                                            "num_hidden_layers": 2, "num_attention_heads": 4}))

    # only rank 0 prints: each --json is one document (every rank printed one before)
    for args in (["validate", "t.parquet", "--metrics", "m", "--json"], ["inspect", "t.parquet", "--json"],
                 ["simulate", "t.parquet", "--stages", "2", "--json"],
                 ["calibrate", "--hf-config", "hf.json", "-o", "prof.json", "--json"]):
        proc = two_ranks(args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert isinstance(json.loads(proc.stdout), (dict, list)), args  # raises on a second document
    proc = two_ranks(plan_args)
    assert proc.returncode != 0  # the output exists now: every rank reports rank 0's error
    assert proc.stderr.count("output t.parquet already exists; pass --overwrite to replace it") == 2
    # run: one process group for all stages (analyze and sort on both ranks, plan on rank 0)
    run_args = ["run", "src", "-o", "r", "--overwrite", "--order", "curriculum", "--max-tokens", "256", "--no-progress"]
    proc = two_ranks(run_args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(ws / "r")) == ["_run.json", "metrics", "plan.parquet", "sorted"]
    assert runner.invoke(app, ["validate", "r/plan.parquet", "--metrics", "r/sorted"]).exit_code == 0
    assert leftovers(str(ws)) == []


# -- python -O: invariants are checks, not asserts ----------------------------------------------------
def test_no_assert_in_the_package():
    """Every invariant is a real check (python -O drops asserts)."""
    pattern = re.compile(r"^\s*assert\b", re.M)
    found = []
    for root, _, files in os.walk(os.path.join(ROOT, "varlen_cli")):
        for name in files:
            if name.endswith(".py") and pattern.search(open(os.path.join(root, name)).read()):
                found.append(name)
    assert found == []


def test_budget_check_raises_an_internal_consistency_error():
    from types import SimpleNamespace

    from varlen_cli.errors import InternalConsistencyError
    from varlen_cli.plan.chunked.finish import check_budget
    from varlen_cli.plan.config import PlanConfig

    c = PlanConfig(input="m", output="p", max_tokens=100)
    ctx = SimpleNamespace(packing=False, budget=SimpleNamespace(max_tokens=100))
    with pytest.raises(InternalConsistencyError, match="1 microbatches over budget"):
        check_budget(c, ctx, [SimpleNamespace(over=1, t_max=50)])


# -- format ----------------------------------------------------------------------------------------
def test_int32_plans_and_optional_column_stay_readable(ws):
    """A plan without step_loss_tokens (older plans) still validates and loads."""
    t = pq.read_table("p.parquet")
    _rewrite_plan("p.parquet", "old.parquet", t.drop_columns(["step_loss_tokens"]))
    assert format.plan_schema_problems(pq.read_schema("old.parquet"), json.loads(
        pq.read_schema("old.parquet").metadata[b"varlen"])) == []
    assert runner.invoke(app, ["validate", "old.parquet", "--metrics", "m"]).exit_code == 0
