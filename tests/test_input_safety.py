"""Input safety (issue 11, the input side; docs/commands.md "Input safety").

* BAD_INPUTS: each case is refused through the CLI with its exit code and exact one-line message,
  and nothing under the test's folder changes (every input and earlier output hashes the same,
  nothing new appears).
* POLLUTION: files that are not data (docs, markers, varlen's own outputs) inside a source directory
  change nothing: the metrics equal those of the clean directory, for the directory and a glob.
* Staleness overrides, symlinked directories, sys.path, and worker-count independent statistics.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.analyze_helpers import ipc_bytes, read_metrics, text_table, write_jsonl, write_parquet
from tests.conftest import assert_user_error
from varlen_cli.cli import app
from varlen_cli.errors import InputError

NOT_DATA = "a varlen metrics or sorted directory, not a dataset; pass the data it was made from"
STALE_HINT = "re-run `varlen analyze`, or pass --allow-stale if the data was moved or copied on purpose"


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def ok(*args):
    result = cli(*args)
    assert result.exit_code == 0, result.output
    return result


def snapshot(root) -> dict:
    """Every entry under ``root`` (links not followed): file hashes, link targets, kinds."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(str(root)):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, str(root))
            if os.path.islink(path):
                out[rel] = "link:" + os.readlink(path)
            elif os.path.isfile(path):
                with open(path, "rb") as fh:
                    out[rel] = hashlib.sha256(fh.read()).hexdigest()
            else:
                out[rel] = "dir" if os.path.isdir(path) else "special"
    return out


# -- building blocks -------------------------------------------------------------------------------
def make_data(t, name: str = "data"):
    """A directory of two JSONL files (30 and 20 rows)."""
    d = t / name
    d.mkdir()
    write_jsonl(text_table(30, seed=1), d / "a.jsonl")
    write_jsonl(text_table(20, seed=2, first_id=30), d / "b.jsonl")
    return d


def analyzed(t, source=None, out="m", *extra):
    source = source if source is not None else make_data(t)
    ok("analyze", source, "-o", t / out, "--length", "chars:text", "--no-progress", *extra)
    return t / out


def planned(t, metrics, out="plan.parquet"):
    ok("plan", metrics, "-o", t / out, "--max-tokens", 4096)
    return t / out


def sorted_dir(t, metrics, out="s"):
    ok("sort", metrics, "-o", t / out, "--no-progress")
    return t / out


def rewrite_same_size(path) -> None:
    """New content of the same size (lines reversed), with a later mtime."""
    raw = path.read_bytes()
    lines = raw.splitlines(keepends=True)
    new = b"".join(reversed(lines))
    assert new != raw and len(new) == len(raw)
    st = path.stat()
    path.write_bytes(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))


def rewrite_parquet_keep_size_and_mtime(path) -> None:
    """Other values, same byte size, and the old mtime put back: only the footer (statistics) tells."""
    st = path.stat()
    pq.write_table(pa.table({"num_tokens": pa.array(np.arange(2, 42), pa.int64())}), str(path),
                   compression="none", use_dictionary=False)
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def token_counts(t):
    d = t / "tok"
    d.mkdir()
    pq.write_table(pa.table({"num_tokens": pa.array(np.arange(1, 41), pa.int64())}), str(d / "n.parquet"),
                   compression="none", use_dictionary=False)
    return d


def edit_manifest(directory, change) -> None:
    path = directory / "_manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def module(t, name: str, body: str) -> str:
    (t / f"{name}.py").write_text(body)
    return name


def numbers(t, name: str, array) -> str:
    return write_parquet(pa.table({"n": array, "text": ["x"] * len(array)}), t / name)


def malformed(what: str, got: str) -> str:
    return f"has a malformed _manifest.json: '{what}' must be {got}"


# -- the table of bad inputs -----------------------------------------------------------------------
# case -> function(tmp) returning (argv, exit code, message); "{t}" is resolved by the function.
def _mixed(t):
    d = make_data(t)
    (d / "notes.txt").write_text("not data\n")
    return (["analyze", d], 3, f"directory {d} mixes data formats (jsonl: a.jsonl, text: notes.txt); "
            f"pass a glob such as '{d}/**/*.jsonl' to choose the files")


def _bracket_folder_beside_its_match(t):
    """A folder data[1] beside data1, which the glob data[1] matches: data1 was read, silently."""
    make_data(t, "data[1]")
    make_data(t, "data1")
    d = t / "data[1]"
    return (["analyze", d], 3, f"source {d} names an existing path, but as a glob it matches {t / 'data1'} too; to "
            f"read the path, escape its wildcards ({t / 'data[[]1]'}), or rename it")


def _metrics_as_source(t):
    m = analyzed(t)
    return ["analyze", m], 3, f"{m} is {NOT_DATA}"


def _sorted_as_source(t):
    s = sorted_dir(t, analyzed(t))
    return ["analyze", s], 3, f"{s} is {NOT_DATA}"


def _part_as_source(t):
    m = analyzed(t)
    part = m / "part-00000.parquet"
    return ["analyze", part], 3, f"{part} is part of a varlen output ({m}), not a dataset"


def _plan_as_source(t):
    p = planned(t, analyzed(t))
    return ["analyze", p], 3, f"{p} is a varlen plan, not a dataset"


def _run_dir_as_source(t):
    r = t / "run"
    r.mkdir()
    (r / "_run.json").write_text(json.dumps({"format": "varlen-run", "format_version": 1}))
    write_jsonl(text_table(3), r / "x.jsonl")
    return ["analyze", r], 3, f"{r} is a varlen run directory, not a dataset; pass the data it was made from"


def _loop_dir(t):
    d = make_data(t)
    (d / "sub").mkdir()
    os.symlink(d, d / "sub" / "loop")
    return ["analyze", d], 3, f"symlink loop: {d / 'sub' / 'loop'} leads back to {os.path.realpath(d)}"


def _loop_glob(t):
    d = make_data(t)
    (d / "sub").mkdir()
    os.symlink(d, d / "sub" / "loop")
    return (["analyze", f"{d}/**/*.jsonl"], 3,
            f"symlink loop: {d / 'sub' / 'loop'} leads back to {os.path.realpath(d)}")


def _fifo(t):
    os.mkfifo(t / "pipe.jsonl")
    return ["analyze", t / "pipe.jsonl"], 3, f"source {t / 'pipe.jsonl'} is a FIFO (named pipe), not a regular file"


FIFO = "is a FIFO (named pipe), not a regular file"


def _fifo_in_directory(t):
    """A FIFO with a data file's name inside a source directory: refused as a glob refuses it (was skipped)."""
    d = make_data(t)
    os.mkfifo(d / "c.jsonl")
    return ["analyze", d, "-o", t / "m", "--length", "chars:text"], 3, f"source {d / 'c.jsonl'} {FIFO}"


def _socket_in_directory(t):
    import socket

    d = make_data(t)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(d / "c.jsonl"))
    return (["analyze", d, "-o", t / "m", "--length", "chars:text"], 3,
            f"source {d / 'c.jsonl'} is a socket, not a regular file")


def _fifo_plan(command, *extra):
    def case(t):
        os.mkfifo(t / "pipe.parquet")
        return [command, t / "pipe.parquet", *extra], 3, f"plan {t / 'pipe.parquet'} {FIFO}"
    return case


def _fifo_tokenizer(t):
    os.mkfifo(t / "tokenizer.json")
    return (["analyze", make_data(t), "--length", "tokens:text", "--tokenizer", t / "tokenizer.json"], 3,
            f"tokenizer file {t / 'tokenizer.json'} {FIFO}")


def _fifo_difficulty_module(t):
    os.mkfifo(t / "rank.py")  # the test runs in t: --difficulty rank:f imports ./rank.py
    return (["analyze", make_data(t), "--difficulty", "rank:f"], 3, f"--difficulty module rank.py {FIFO}")


def _fifo_memory_profile(t):
    m = analyzed(t)
    os.mkfifo(t / "profile.json")
    return (["plan", m, "-o", t / "p.parquet", "--memory-profile", t / "profile.json", "--max-memory", "1GiB"], 3,
            f"memory profile {t / 'profile.json'} {FIFO}")


def _fifo_sampler_state(t):
    p = planned(t, analyzed(t))
    os.mkfifo(t / "state.json")
    return (["replan", p, "--state", t / "state.json", "--dp", "2", "-o", t / "q.parquet"], 3,
            f"sampler state {t / 'state.json'} {FIFO}")


def _fifo_manifest(t):
    m = analyzed(t)
    os.remove(m / "_manifest.json")
    os.mkfifo(m / "_manifest.json")
    return ["sort", m, "-o", t / "s"], 3, f"manifest {m / '_manifest.json'} {FIFO}"


def _fifo_part(t):
    m = analyzed(t)
    os.remove(m / "part-00000.parquet")
    os.mkfifo(m / "part-00000.parquet")
    return ["plan", m, "-o", t / "p.parquet", "--max-tokens", "4096"], 3, f"part {m / 'part-00000.parquet'} {FIFO}"


def _fifo_hf_config(t):
    os.mkfifo(t / "config.json")
    return (["calibrate", "--hf-config", t / "config.json", "-o", t / "profile.json"], 3,
            f"--hf-config {t / 'config.json'} {FIFO}")


def _device_as_source(t):
    os.symlink("/dev/zero", t / "zero.jsonl")
    return ["analyze", t / "zero.jsonl"], 3, f"source {t / 'zero.jsonl'} is a character device, not a regular file"


def _self_link(t):
    os.symlink("self.jsonl", t / "self.jsonl")
    return (["analyze", t / "self.jsonl"], 3,
            f"source {t / 'self.jsonl'} is not readable: Too many levels of symbolic links")


def _broken_link_in_dir(t):
    d = make_data(t)
    os.symlink("gone.jsonl", d / "c.jsonl")
    return ["analyze", d], 3, f"source {d / 'c.jsonl'} is not readable: No such file or directory"


def _stale_sort(t):
    m = analyzed(t)
    rewrite_same_size(t / "data" / "a.jsonl")
    return (["sort", m, "-o", t / "s"], 3,
            f"{m} is stale: source {t / 'data' / 'a.jsonl'} was modified since `varlen analyze` read it; {STALE_HINT}")


def _stale_plan_size(t):
    m = analyzed(t)
    size = (t / "data" / "b.jsonl").stat().st_size
    with open(t / "data" / "b.jsonl", "a") as fh:
        fh.write('{"id": 99, "text": "more"}\n')
    new = (t / "data" / "b.jsonl").stat().st_size
    return (["plan", m, "-o", t / "p.parquet", "--max-tokens", 4096], 3,
            f"{m} is stale: source {t / 'data' / 'b.jsonl'} changed size ({size} -> {new} bytes) since "
            f"`varlen analyze` read it; {STALE_HINT}")


def _stale_validate_missing(t):
    m = analyzed(t)
    p = planned(t, m)
    os.remove(t / "data" / "b.jsonl")
    return (["validate", p, "--metrics", m], 3,
            f"{m} is stale: source {t / 'data' / 'b.jsonl'} is missing since `varlen analyze` read it; {STALE_HINT}")


def _stale_parquet_footer(t):
    d = token_counts(t)
    m = analyzed(t, d, "m", "--length", "value:num_tokens")
    rewrite_parquet_keep_size_and_mtime(d / "n.parquet")
    return (["plan", m, "-o", t / "p.parquet", "--max-tokens", 4096], 3,
            f"{m} is stale: source {d / 'n.parquet'} was rewritten (its Parquet footer differs) since `varlen analyze` "
            f"read it; {STALE_HINT}")


def _stale_sorted_for_plan(t):
    s = sorted_dir(t, analyzed(t))
    rewrite_same_size(t / "data" / "b.jsonl")
    return (["plan", s, "-o", t / "p.parquet", "--max-tokens", 4096, "--order", "curriculum"], 3,
            f"{s} is stale: source {t / 'data' / 'b.jsonl'} was modified since `varlen analyze` read it; {STALE_HINT}")


def _metrics_rebuilt_after_sort(t):
    m = analyzed(t)
    s = sorted_dir(t, m)
    ok("analyze", t / "data", "-o", m, "--length", "words:text", "--no-progress", "--overwrite")
    return (["plan", s, "-o", t / "p.parquet", "--max-tokens", 4096], 3,
            re.compile(re.escape(f"{s} is stale: {m} was rebuilt after it (artifact ") + r"\w+, now \w+\); "
                       + re.escape("re-run `varlen sort`")))


def _uint64_length(t):
    p = numbers(t, "u.parquet", pa.array([1, 2**63, 2**64 - 1], pa.uint64()))
    return (["analyze", p, "--length", "value:n"], 3,
            f"length column 'n' has 2 values above 2**63-1 in {p} (first: 9223372036854775808); lengths must fit int64")


def _float_length(t):
    p = numbers(t, "f.parquet", pa.array([1.0, 1e19], pa.float64()))
    return (["analyze", p, "--length", "value:n"], 3,
            f"length column 'n' has 1 values above 2**63-1 in {p} (first: 10000000000000000000); "
            "lengths must fit int64")


def _fps_length(t):
    p = numbers(t, "s.parquet", pa.array([1.5, 1e17], pa.float64()))
    return (["analyze", p, "--length", "value:n", "--frames-per-second", "1000"], 3,
            f"length column 'n' has 1 values above 2**63-1 after --frames-per-second 1000 in {p} "
            "(first: 100000000000000000000); lengths must fit int64")


def test_seconds_times_fps_past_float_range_is_one_line():
    """1e300 seconds x 1e10 frames a second is inf: refused in the one line, no numpy overflow warning above it."""
    import warnings

    from varlen_cli.analyze.lengths import value_lengths

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InputError, match=r"has 1 values above 2\*\*63-1 after --frames-per-second 1e\+10 in f "
                                             r"\(first: inf\)"):
            value_lengths(pa.array([1.5, 1e300]), "n", "f", 1e10)


def _function(t, name, body, message, code=3):
    d = make_data(t)
    src = d / "a.jsonl"
    spec = module(t, name, body) + ":f"
    return (["analyze", src, "--length", "chars:text", "--difficulty", spec], code,
            message.format(spec=spec, src=src))


def _total_overflow(t):
    p = numbers(t, "big.parquet", pa.array([2**62, 2**62], pa.int64()))
    return (["analyze", p, "--length", "value:n"], 3,
            "the lengths add up to 9223372036854775808, more than 2**63-1; their total must fit int64")


def _fn_inf(t):
    return _function(t, "varlen_is_inf", "def f(batch):\n    return [float('inf')] * batch.num_rows\n",
                     "difficulty function {spec} returned infinite values for 30 rows (on {src})")


def _fn_exit(t):
    return _function(t, "varlen_is_exit", "import sys\n\ndef f(batch):\n    sys.exit(0)\n",
                     "difficulty function {spec} raised SystemExit (sys.exit(0)) (on {src})")


def _fn_shape(t):
    return _function(t, "varlen_is_shape", "import numpy as np\n\ndef f(batch):\n"
                     "    return np.ones((batch.num_rows // 2, 2))\n",
                     "difficulty function {spec} returned an array of shape (15, 2) for 30 rows; expected shape (30,) "
                     "(on {src})")


def _fn_huge(t):
    return _function(t, "varlen_is_huge", "def f(batch):\n    return [10**400] * batch.num_rows\n",
                     "difficulty function {spec} returned a number too large for float64 (on {src})")


def _fn_exit_on_import(t):
    return _function(t, "varlen_is_exit_import", "import sys\nsys.exit(3)\n",
                     "--difficulty {spec}: cannot import module 'varlen_is_exit_import': SystemExit (sys.exit(3))",
                     code=2)


def _fn_scalar(t):
    return _function(t, "varlen_is_scalar", "def f(batch):\n    return 1.5\n",
                     "difficulty function {spec} returned an array of shape () for 30 rows; expected shape (30,) "
                     "(on {src})")


def _duplicate_columns(t):
    p = t / "dup.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array([1, 2]), pa.array(["a", "b"])], names=["text", "text"]), str(p))
    return ["analyze", p], 3, f"{p} has duplicate column names (text); rename them before analyze"


def _manifest_case(command, change, what, got):
    def case(t):
        m = analyzed(t)
        edit_manifest(m, change)
        argv = {"sort": ["sort", m, "-o", t / "s"], "plan": ["plan", m, "-o", t / "p.parquet", "--max-tokens", 4096],
                "inspect": ["inspect", m]}[command]
        return argv, 3, f"{m} {malformed(what, got)}"
    return case


def _manifest_for_validate(t):
    m = analyzed(t)
    p = planned(t, m)
    edit_manifest(m, lambda x: x.update(format_version="1"))
    return ["validate", p, "--metrics", m], 3, f"{m} {malformed('format_version', 'a non-negative integer')}, got '1'"


BAD_INPUTS = {
    # 4/5/6: discovery
    "mixed formats in a directory": _mixed,
    "a folder named like a glob, beside what the glob matches": _bracket_folder_beside_its_match,
    "metrics directory as a source": _metrics_as_source,
    "sorted directory as a source": _sorted_as_source,
    "part of a metrics directory as a source": _part_as_source,
    "plan file as a source": _plan_as_source,
    "varlen run directory as a source": _run_dir_as_source,
    "symlink loop in a directory": _loop_dir,
    "symlink loop under a ** glob": _loop_glob,
    # 20: paths that cannot be opened, whoever runs the test (root too)
    "FIFO as a source": _fifo,
    # issue 23: a FIFO wherever a file is read (each hung before)
    "FIFO as the plan (inspect)": _fifo_plan("inspect"),
    "FIFO as the plan (validate)": _fifo_plan("validate"),
    "FIFO as the plan (simulate)": _fifo_plan("simulate", "--stages", "2"),
    "FIFO as the tokenizer": _fifo_tokenizer,
    "FIFO as the difficulty module": _fifo_difficulty_module,
    "FIFO as the memory profile": _fifo_memory_profile,
    "FIFO as the sampler state (replan)": _fifo_sampler_state,
    "FIFO as a manifest": _fifo_manifest,
    "FIFO as a part": _fifo_part,
    "FIFO as the --hf-config": _fifo_hf_config,
    "/dev/zero as a source": _device_as_source,
    "symlink to itself": _self_link,
    "broken symlink in a directory": _broken_link_in_dir,
    # 7: stale inputs
    "source rewritten, same size (sort)": _stale_sort,
    "source grew (plan)": _stale_plan_size,
    "source deleted (validate --metrics)": _stale_validate_missing,
    "Parquet rewritten, size and mtime kept (plan)": _stale_parquet_footer,
    "sorted directory's source changed (plan)": _stale_sorted_for_plan,
    "metrics rebuilt after sort (plan)": _metrics_rebuilt_after_sort,
    # 8: lengths must fit int64
    "uint64 length above 2**63": _uint64_length,
    "float length 1e19": _float_length,
    "seconds x fps above 2**63": _fps_length,
    "lengths adding up past 2**63-1": _total_overflow,
    # 11: difficulty functions
    "function returns inf": _fn_inf,
    "function calls sys.exit(0)": _fn_exit,
    "function returns shape (n/2, 2)": _fn_shape,
    "function returns 10**400": _fn_huge,
    "function returns a scalar": _fn_scalar,
    "module calls sys.exit on import": _fn_exit_on_import,
    # 15: malformed inputs
    "Parquet with duplicate column names": _duplicate_columns,
    "manifest num_rows is text (sort)": _manifest_case(
        "sort", lambda x: x.update(num_rows="x"), "num_rows", "a non-negative integer, got 'x'"),
    "manifest part rows is text (plan)": _manifest_case(
        "plan", lambda x: x["parts"][0].update(rows="30"), "parts[0].rows", "a non-negative integer, got '30'"),
    "manifest part file outside the directory (sort)": _manifest_case(
        "sort", lambda x: x["parts"][0].update(file="../data/a.jsonl"), "parts[0].file",
        "a file name inside the directory, got '../data/a.jsonl'"),
    "manifest parts is not a list (inspect)": _manifest_case(
        "inspect", lambda x: x.update(parts={"file": "part-00000.parquet"}), "parts",
        "a list, got {'file': 'part-00000.parquet'}"),
    "manifest mtime_ns is text (plan)": _manifest_case(
        "plan", lambda x: x["dataset"]["files"][0].update(mtime_ns="yesterday"), "dataset.files[0].mtime_ns",
        "a non-negative integer, got 'yesterday'"),
    "manifest format_version is text (validate --metrics)": _manifest_for_validate,
    "FIFO inside a source directory": _fifo_in_directory,
    "socket inside a source directory": _socket_in_directory,
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input(tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)  # difficulty modules are written here and imported from the cwd
    argv, code, message = BAD_INPUTS[case](tmp_path)
    if argv[0] == "analyze":
        argv = [*argv, "-o", tmp_path / "out", "--no-progress"]
    before = snapshot(tmp_path)
    result = cli(*argv)
    assert_user_error(result, code, message)
    assert snapshot(tmp_path) == before  # nothing lost, changed or left behind


# -- source directories with things that are not data ----------------------------------------------
def _add_docs(d, t):
    (d / "LICENSE.txt").write_text("MIT License\n")
    (d / "README.txt").write_text("about\n")
    (d / "README.md").write_text("# about\n")
    (d / "NOTICE").write_text("x\n")
    (d / "CHANGELOG.rst").write_text("x\n")
    (d / "License-Apache.txt").write_text("x\n")


def _add_markers(d, t):
    (d / "_SUCCESS").write_text("")
    (d / ".DS_Store").write_bytes(b"\0\1")
    (d / ".a.jsonl.crc").write_bytes(b"crc")
    (d / "_metadata.jsonl").write_text('{"text": "x"}\n')


def _add_datasets_metadata(d, t):
    (d / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))  # one line: valid JSONL
    (d / "config.json").write_text(json.dumps({"text": "not a sample"}))
    (d / "dataset_infos.json").write_text(json.dumps({"default": {}}))


def _add_metrics(d, t):
    m = analyzed(t, t / "clean", "elsewhere")
    shutil.move(str(m), str(d / "metrics"))


def _add_sorted_and_plan(d, t):
    m = analyzed(t, t / "clean", "elsewhere")
    shutil.move(str(sorted_dir(t, m, "s")), str(d / "sorted"))
    shutil.move(str(planned(t, m)), str(d / "plan.parquet"))  # a Parquet file among JSONL files


def _add_run_dir(d, t):
    r = d / "run"
    r.mkdir()
    write_jsonl(text_table(5, seed=9), r / "extra.jsonl")
    (r / "_run.json").write_text(json.dumps({"format": "varlen-run", "format_version": 1}))


def _add_temporaries(d, t):
    tmp = d / ".out.varlen-tmp-1a2b3c4d"
    tmp.mkdir()
    write_jsonl(text_table(5, seed=9), tmp / "c.jsonl")
    (d / ".out.varlen-old").mkdir()
    write_jsonl(text_table(5, seed=9), d / ".out.varlen-old" / "c.jsonl")


POLLUTION = {
    "README, LICENSE, NOTICE, CHANGELOG": _add_docs,
    "_SUCCESS, .DS_Store, .crc, _metadata": _add_markers,
    "datasets and model metadata json": _add_datasets_metadata,
    "metrics directory inside": _add_metrics,
    "sorted directory and plan file inside": _add_sorted_and_plan,
    "varlen run directory inside": _add_run_dir,
    "temporaries of killed runs": _add_temporaries,
}


@pytest.mark.parametrize("case", list(POLLUTION), ids=list(POLLUTION))
def test_non_data_in_a_source_directory_is_skipped(tmp_path, case):
    clean = make_data(tmp_path, "clean")
    m_clean = analyzed(tmp_path, clean, "m_clean")
    d = make_data(tmp_path, "data")
    POLLUTION[case](d, tmp_path)
    expected = ipc_bytes(read_metrics(m_clean))
    for k, source in enumerate([d, f"{d}/**/*.jsonl", f"{d}/*"]):
        m = analyzed(tmp_path, source, f"m{k}")
        assert ipc_bytes(read_metrics(m)) == expected, source
        files = json.loads((m / "_manifest.json").read_text())["dataset"]["files"]
        assert [f["path"] for f in files] == ["a.jsonl", "b.jsonl"]


def test_symlinked_directories_are_followed_by_directory_and_glob(tmp_path):
    d = make_data(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    write_jsonl(text_table(7, seed=5), other / "c.jsonl")
    os.symlink(other, d / "linked")
    by_dir = read_metrics(analyzed(tmp_path, d, "m1"))
    by_glob = read_metrics(analyzed(tmp_path, f"{d}/**/*.jsonl", "m2"))
    assert ipc_bytes(by_dir) == ipc_bytes(by_glob)
    assert by_dir.num_rows == 30 + 20 + 7


def test_a_path_with_wildcards_is_read_as_named(tmp_path):
    """data[1] alone (no data1): the folder itself (it was "no data files match"); data[[]1] reads it too."""
    (tmp_path / "src").mkdir()  # outputs beside it: not inside the glob's folder
    make_data(tmp_path / "src", "data[1]")
    assert read_metrics(analyzed(tmp_path, tmp_path / "src" / "data[1]", "m1")).num_rows == 50
    assert read_metrics(analyzed(tmp_path, str(tmp_path / "src" / "data[[]1]"), "m2")).num_rows == 50


def test_a_glob_may_pick_one_format_of_a_mixed_directory(tmp_path):
    d = make_data(tmp_path)
    (d / "notes.txt").write_text("one\ntwo\n")
    assert read_metrics(analyzed(tmp_path, f"{d}/*.jsonl", "m1")).num_rows == 50
    assert read_metrics(analyzed(tmp_path, f"{d}/*.txt", "m2")).num_rows == 2


def test_allow_stale_accepts_moved_data(tmp_path):
    m = analyzed(tmp_path)
    p = planned(tmp_path, m)
    shutil.move(str(tmp_path / "data"), str(tmp_path / "moved"))
    assert cli("sort", m, "-o", tmp_path / "s", "--no-progress").exit_code == 3
    ok("sort", m, "-o", tmp_path / "s", "--no-progress", "--allow-stale")
    ok("plan", tmp_path / "s", "-o", tmp_path / "p2.parquet", "--max-tokens", 4096, "--allow-stale")
    ok("validate", p, "--metrics", m, "--allow-stale")


def test_unchanged_sources_pass_and_a_copy_needs_allow_stale(tmp_path):
    d = token_counts(tmp_path)
    m = analyzed(tmp_path, d, "m", "--length", "value:num_tokens")
    ok("plan", m, "-o", tmp_path / "p.parquet", "--max-tokens", 4096)
    shutil.copyfile(d / "n.parquet", tmp_path / "copy.parquet")  # new mtime, same bytes
    os.replace(tmp_path / "copy.parquet", d / "n.parquet")
    assert cli("plan", m, "-o", tmp_path / "p2.parquet", "--max-tokens", 4096).exit_code == 3
    ok("plan", m, "-o", tmp_path / "p2.parquet", "--max-tokens", 4096, "--allow-stale")


def test_difficulty_module_leaves_sys_path_as_it_was(tmp_path, monkeypatch):
    from tests.analyze_helpers import run

    monkeypatch.chdir(tmp_path)
    name = module(tmp_path, "varlen_path_probe", "def f(batch):\n    return [1.0] * batch.num_rows\n")
    before = list(sys.path)
    run(tmp_path / "out", make_data(tmp_path) / "a.jsonl", length="chars:text", difficulty=f"{name}:f")
    assert sys.path == before


@pytest.mark.slow
def test_stats_are_byte_identical_for_one_and_two_workers(tmp_path):
    """Difficulty values whose float sum depends on the order of additions: the manifest's stats
    (and the parts) are still the same bytes for 1 and 2 workers."""
    rng = np.random.default_rng(3)
    score = np.concatenate([[1e16], rng.random(3000) * 10.0 ** rng.integers(-8, 8, 3000)])
    d = tmp_path / "data"
    d.mkdir()
    for k in range(4):
        part = score[k::4]
        write_parquet(pa.table({"score": part, "text": ["x" * (i % 50) for i in range(len(part))]}),
                      d / f"{k}.parquet", row_group_size=97)
    stats = []
    for nproc in (1, 2):
        m = analyzed(tmp_path, d, f"m{nproc}", "--difficulty", "value:score", "--nproc", nproc)
        stats.append(json.dumps(json.loads((m / "_manifest.json").read_text())["stats"], sort_keys=True))
        assert ipc_bytes(read_metrics(m)) == ipc_bytes(read_metrics(tmp_path / "m1"))
    assert stats[0] == stats[1]
    mean = json.loads(stats[0])["difficulty"]["mean"]
    assert mean == pytest.approx(float(np.sum(score.astype(np.longdouble)) / len(score)), rel=1e-12)


# -- property: non-data never changes what discovery takes -------------------------------------------
DATA_NAMES = ["a.jsonl", "b.json", "c.ndjson", "z.jsonl.gz", "readmes.jsonl", "licensed.json"]
NON_DATA_NAMES = ["README.txt", "README", "LICENSE.jsonl", "Licence-MIT.txt", "NOTICE.json", "notes.md",
                  "_SUCCESS", "_meta.jsonl", ".DS_Store", ".x.jsonl", "dataset_info.json", "config.json",
                  "tokenizer.json", "x.csv", "CHANGELOG.rst"]
DIRS = ["", "sub", "sub/deep", "_private", ".hidden", "two"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(st.tuples(st.sampled_from(DIRS), st.sampled_from(DATA_NAMES + NON_DATA_NAMES)),
                        min_size=1, max_size=12, unique=True))
def test_discovery_takes_exactly_the_data_files(tmp_path, entries):
    """Files are written with valid one-line JSON whatever their name, so only the rules decide.
    A directory and a ``**`` glob take exactly the data-named files outside ``_``/``.`` folders."""
    import gzip
    import tempfile

    from varlen_cli.analyze.sources import discover
    from varlen_cli.errors import InputError

    root = tempfile.mkdtemp(dir=tmp_path)
    expected = []
    for folder, name in entries:
        os.makedirs(os.path.join(root, folder), exist_ok=True)
        path = os.path.join(root, folder, name)
        body = b'{"text": "x"}\n'
        with open(path, "wb") as fh:
            fh.write(gzip.compress(body) if name.endswith(".gz") else body)
        if name in DATA_NAMES and not folder.startswith(("_", ".")):
            expected.append(os.path.abspath(path))
    for source in (root, os.path.join(root, "**", "*")):
        if expected:
            assert [f.path for f in discover([source])] == sorted(expected)
        else:
            with pytest.raises(InputError, match="no data files"):
                discover([source])
    shutil.rmtree(root)


# -- freshness of every source kind (issue 31) ------------------------------------------------------
def keep_stat(path, write) -> None:
    """``write()`` new content of the same size into ``path``, then its old mtime put back."""
    st = path.stat()
    write()
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _stale(m, source, why: str = "was rewritten (its sampled content differs)") -> str:
    return f"{m} is stale: source {source} {why} since `varlen analyze` read it; {STALE_HINT}"


def test_parquet_without_statistics_rewritten_at_the_same_size_and_mtime(tmp_path):
    """write_statistics=False: other values at the same size and mtime leave the footer byte-identical;
    the sampled column chunks tell. plan, sort, validate --metrics and SourceDataset all refuse."""
    from varlen_cli.errors import InputError
    from varlen_cli.loader import SourceDataset

    d = tmp_path / "tok"
    d.mkdir()
    path = d / "n.parquet"
    pq.write_table(pa.table({"num_tokens": pa.array(np.arange(1, 201), pa.int64())}), str(path), write_statistics=False)
    m = analyzed(tmp_path, d, "m", "--length", "value:num_tokens")
    p = planned(tmp_path, m)
    raw = path.read_bytes()
    footer = raw[-8 - int.from_bytes(raw[-8:-4], "little"):]
    keep_stat(path, lambda: pq.write_table(pa.table({"num_tokens": pa.array(np.arange(2, 202), pa.int64())}),
                                            str(path), write_statistics=False))
    new = path.read_bytes()
    assert new.endswith(footer) and new != raw  # the footer alone cannot tell
    for argv in (["plan", m, "-o", tmp_path / "p2.parquet", "--max-tokens", 4096], ["sort", m, "-o", tmp_path / "s"],
                 ["validate", p, "--metrics", m]):
        assert_user_error(cli(*argv), 3, _stale(m, path))
    with pytest.raises(InputError, match=re.escape(f"{m} is stale: source {path} was rewritten (its sampled content "
                                                   "differs)")):
        SourceDataset(str(m))
    keep_stat(path, lambda: path.write_bytes(raw))  # the old bytes back: fresh again
    ok("sort", m, "-o", tmp_path / "s", "--no-progress")


def test_an_object_without_etag_or_version_is_checked_by_its_size(tmp_path):
    """A store that keeps no ETag or version (a plain https:// server; memory:// here) records the size
    alone, and the size is still compared: an object rewritten with another size is stale."""
    import fsspec

    from varlen_cli import storage
    from varlen_cli.runtime import freshness

    loc = f"memory://varlen-test-{os.getpid()}/d/x.jsonl"
    fs = fsspec.filesystem("memory")
    fs.pipe_file(loc, b'{"text": "a"}\n')
    try:
        entry = {"path": loc, "format": "jsonl", **freshness.record(storage.stat(loc), "jsonl")}
        assert set(entry) == {"path", "format", "size"}  # nothing but the size to compare
        manifest = {"dataset": {"root": "", "files": [entry]}}
        assert freshness.stale_source(manifest) is None
        fs.pipe_file(loc, b'{"text": "a much longer text"}\n')
        assert freshness.stale_source(manifest) == (loc, "changed size (14 -> 31 bytes)")
        fs.rm_file(loc)
        assert freshness.stale_source(manifest) == (loc, "is missing")
    finally:
        if fs.exists(loc):
            fs.rm_file(loc)
