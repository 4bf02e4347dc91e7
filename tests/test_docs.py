"""Every command and option has help text and is documented in the README or docs/."""

import glob
import os
import re

import pytest
import typer.main

from varlen_cli.cli import app, click_module

click = click_module()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _docs_text() -> str:
    # docs/cli.md is --help itself (generated): the guides must say it in their own words
    paths = [os.path.join(ROOT, "README.md")] + sorted(p for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
                                                       if os.path.basename(p) != "cli.md")
    return "\n".join(open(p).read() for p in paths)


def _commands():
    group = typer.main.get_command(app)
    ctx = click.core.Context(group)
    return [(name, group.get_command(ctx, name)) for name in group.list_commands(ctx)]


EXPECTED = {"analyze", "sort", "plan", "run", "inspect", "validate", "simulate"}


def test_all_stage_commands_exist():
    assert EXPECTED <= {name for name, _ in _commands()}


@pytest.mark.parametrize("name,command", _commands(), ids=[n for n, _ in _commands()])
def test_command_and_options_documented(name, command):
    docs = _docs_text()
    assert command.help and command.help.strip(), f"command {name} has no help"
    assert f"varlen {name}" in docs, f"`varlen {name}` is not in README.md or docs/"
    for param in command.params:
        if param.param_type_name == "option":
            assert param.help and param.help.strip(), f"{name} {param.opts[0]} has no help text"
            longs = [o for o in param.opts + param.secondary_opts if o.startswith("--") and o != "--help"]
            assert any(o in docs for o in longs), f"{name} option {longs} is not documented in README.md or docs/"
        elif param.param_type_name == "argument":
            assert getattr(param, "help", None), f"{name} argument {param.name} has no help text"


# -- the README's command block runs as written ----------------------------------------------------
SKIP_MARK = "# needs "  # a trailing comment saying what a line needs that a test machine lacks (a GPU, a model)


def readme_commands() -> list[str]:
    """The shell lines of the README's block under "## The commands", continuation lines joined,
    comment lines and blank lines dropped."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## The commands", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines, pending = [], ""
    for raw in block.splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        pending = ""
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def test_readme_block_is_found_and_marks_what_it_skips():
    commands = readme_commands()
    assert commands[0] == "mkdir -p out" and len(commands) > 15
    skipped = [c for c in commands if SKIP_MARK in c]
    assert any(c.split()[1] == "calibrate" for c in skipped)  # a GPU and the user's model
    assert all(c.split(SKIP_MARK, 1)[1].strip() for c in skipped)  # each says what it needs
    assert len(skipped) <= len(commands) // 3  # most of the block runs on the sample data


@pytest.mark.slow
def test_readme_commands_run_in_order_in_a_fresh_directory(tmp_path):
    """Every line of the README's command block, in order, in an empty directory holding only
    sample_data/ (and `varlen` on PATH: this interpreter's): each exits 0."""
    import subprocess
    import sys

    work = tmp_path / "fresh"
    work.mkdir()
    os.symlink(os.path.join(ROOT, "sample_data"), work / "sample_data")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "varlen").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m varlen_cli "$@"\n')
    (bin_dir / "varlen").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONPATH=ROOT,
               VARLEN_NO_PROGRESS="1")
    ran = []
    for command in readme_commands():
        if SKIP_MARK in command:
            continue
        result = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, f"{command}\n{result.stderr[-2000:]}"
        ran.append(command)
    assert os.path.isfile(work / "out" / "plan-dp3.parquet") and os.path.isfile(work / "out" / "run" / "_run.json")
    assert len(ran) == len([c for c in readme_commands() if SKIP_MARK not in c]) > 10


# -- docs/formats.md lists every key a plan's metadata has --------------------------------------------
NESTED_FREE = {"config", "shapes", "steps_per_epoch", "orders"}  # values whose keys are documented elsewhere
# (config: every PlanConfig field, docs/plan.md; schedule.steps_by_order: one key per candidate order;
#  memory.profile: the profile's own fields, docs/memory.md; budget.model: listed in its row)
OPAQUE = {"schedule.steps_by_order", "memory.profile", "budget.model", "dropped.reason"}


def _key_paths(meta: dict) -> set:
    """Every key of a plan's metadata: top-level ``a``, ``a.b`` in objects and ``a.b[].c`` in lists of objects."""
    paths = set()
    for key, value in meta.items():
        paths.add(key)
        if key in NESTED_FREE or not isinstance(value, dict):
            continue
        for sub, inner in value.items():
            path = f"{key}.{sub}"
            paths.add(path)
            if path in OPAQUE:
                continue
            items = inner if isinstance(inner, list) else []
            for item in items:
                if isinstance(item, dict):
                    paths.update(f"{path}[].{k}" for k in item)
    return paths


def _formats_metadata_section() -> str:
    text = open(os.path.join(ROOT, "docs", "formats.md")).read()
    return text[text.index("### Schema metadata"):text.index("Row groups hold whole steps")]


def test_formats_md_lists_every_plan_metadata_key(tmp_path):
    """Plans of every kind (padded with shapes, packed and split with an auto attention cost, a mixture
    with drops, a replan, an extension, a memory plan, a schedule-ordered plan): each key they write
    is in docs/formats.md's metadata table, written as `key` or `key.sub` (`key.sub[].item` in lists)."""
    import json

    import numpy as np
    import pyarrow.parquet as pq

    from tests.plan_helpers import write_metrics
    from varlen_cli.plan import PlanConfig, plan
    from varlen_cli.plan.replan import ExtendConfig, ReplanConfig, extend, replan

    lengths = np.concatenate([np.random.default_rng(1).integers(1, 200, 120), [0, 900]])
    m = write_metrics(tmp_path / "m", lengths)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"format": "varlen-memory-profile", "format_version": 1, "mode": "measured",
                                   "model": "m:f", "fit": {"c0": 2 * 2**20, "c1": 16000.0, "c2": 20.0}}))
    made = []

    def make(name, **options):
        out = str(tmp_path / f"{name}.parquet")
        plan(PlanConfig(output=out, progress=False, **{"input": m, **options}))
        made.append(out)
        return out

    padded = make("padded", max_tokens=512, drop_long=True, dp=2, num_shapes=3, compile_warmup=True, epochs=2,
                  order="random", tail="drop")
    make("packed", packing=True, seq_len=128, split_long=True, attention_cost="auto", model_dim=64, layers=2, dp=2)
    mixed = make("mixed", input="", mix=f"a={m}:1.5,b={m}:0.5", max_tokens=200, drop_long=True, dp=2, grad_accum=2,
                 tail="drop", order="random")  # one sample per microbatch: a tail is dropped
    assert json.loads(pq.read_schema(mixed).metadata[b"varlen"])["dropped"]["tail"][0]["sources"]
    make("memory", memory_profile=str(profile), max_memory="64MiB", packing=True, seq_len=256, split_long=True)
    make("schedule", max_tokens=512, drop_long=True, dp=2, grad_accum=2, schedule="1f1b", stages=2)
    make("two budgets", input=write_metrics(tmp_path / "t", lengths, targets=lengths // 2), max_tokens=512,
         max_target_tokens=300, drop_long=True, dp=2, num_shapes=3)
    made.append(replan(ReplanConfig(plan=padded, output=str(tmp_path / "r.parquet"), dp=3, from_step=1)).output)
    made.append(extend(ExtendConfig(plan=made[-1], output=str(tmp_path / "e.parquet"), epochs=3)).output)
    section = _formats_metadata_section()
    documented = set(re.findall(r"`([a-z_]+(?:\.[a-z_]+(?:\[\]\.[a-z_]+)?)?)`", section))
    written = set().union(*(_key_paths(json.loads(pq.read_schema(p).metadata[b"varlen"])) for p in made))
    missing = sorted(written - documented)
    assert not missing, f"docs/formats.md's metadata table lacks {missing}"


# -- every name a docstring or a doc cites exists (tests/doc_cites.py) ---------------------------------
# Stale cites allowed for a reason (each must still be stale; remove it when fixed).
ALLOWED_STALE_CITES: set = set()


def test_the_cite_checker_finds_stale_cites():
    from tests import doc_cites

    module = "varlen_cli.checks.driver"  # cites as its docstrings would write them
    text = ("``coverage.Coverage``, ``coverage.finish``, ``plan.core.plan``, ``plan.core.finish``, ``format.nope``, "
            ":func:`run_checks`, :func:`keys_of`, :func:`nope`, :func:`.split_info`, :func:`.nope`, "
            ":meth:`varlen_cli.budget.Budget.microbatch_cost`, :meth:`~varlen_cli.budget.Budget.nope`, "
            ":mod:`varlen_cli.plan_checks`, :func:`os.open`, :class:`dict`, "
            "``split.count`` (a parameter), ``meta.get``, ``plan.parquet``")
    cites = doc_cites.docstring_cites(module, text)
    stale = [c for role, c in cites if not doc_cites.cite_exists(module, c, role=role)]
    assert stale == ["nope", ".nope", "varlen_cli.budget.Budget.nope", "varlen_cli.plan_checks", "coverage.finish",
                     "plan.core.finish", "format.nope"]
    assert len(cites) == 15  # not split.count, meta.get, plan.parquet
    doc = ("`varlen_cli.checks.run_checks`, `varlen_cli.checks.nope`, `varlen_cli/runtime/files.py`, "
           "`varlen_cli/storage/files.py`, `PlanBatchSampler.state_dict`, `PlanBatchSampler.nope`, `budget.model`")
    assert doc_cites.stale_doc_cites(doc) == ["varlen_cli.checks.nope", "varlen_cli/runtime/files.py",
                                              "PlanBatchSampler.nope"]


def test_every_name_a_docstring_cites_exists():
    from tests import doc_cites

    stale = {c for module in sorted(doc_cites.modules()) for c in doc_cites.stale_docstring_cites(module)}
    assert sorted(stale - ALLOWED_STALE_CITES) == [], "docstrings cite names that do not exist"
    assert sorted(ALLOWED_STALE_CITES - stale) == [], "fixed: remove from ALLOWED_STALE_CITES"


def test_every_name_a_doc_cites_exists():
    from tests import doc_cites

    paths = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    stale = [(os.path.basename(p), c) for p in paths for c in doc_cites.stale_doc_cites(open(p).read())]
    assert stale == [], "README.md and docs/*.md cite names or paths that do not exist"
