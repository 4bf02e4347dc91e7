"""The recipes of docs/loader.md and docs/integrations.md run as written: each ```python block that
starts with ``# recipe: NAME (FILE)`` is saved as FILE and started with 2 CPU processes (gloo) as the
command the docs give under it starts them, on a plan of a slice of sample_data/tokenized.parquet
(torchtitan: a packed plan of it; Megatron: the slice written as a Megatron corpus by megatron-core),
under tests/launcher.py, which starts each rank as torchrun does (its environment is checked against
the real torchrun's in tests/test_launcher.py) from a process that imported the frameworks once
(VARLEN_TEST_REAL_TORCHRUN=1: under the real command); the torchtitan and DeepSpeed recipes under the
real ``torchrun`` command."""

import os
import re
import subprocess

import pyarrow.parquet as pq
import pytest

from tests.integration_helpers import IMPORTS, make_plan, real_torchrun, small_dataset
from tests.launcher import launch
from tests.loader_helpers import ROOT
from varlen_cli.loader import Plan

RECIPE = re.compile(r"```python\n# recipe: (\w+) \((\S+)\)\n(.*?)```", re.S)
TOKENIZER = os.path.join(ROOT, "sample_data", "tokenizer.json")


def _recipes() -> dict:
    found = {}
    for doc in ("loader.md", "integrations.md"):
        for name, file, code in RECIPE.findall(open(os.path.join(ROOT, "docs", doc)).read()):
            found[name] = (file, code)
    return found


RECIPES = _recipes()
NEEDS = {"hf": ["transformers"], "trl": ["trl", "datasets"], "accelerate": ["accelerate", "transformers"],
         "lightning": ["lightning", "transformers"], "torchdata": ["torchdata"], "ddp": [],
         "torchtitan": ["torchtitan.components.checkpoint"], "megatron": ["megatron.core"],
         "deepspeed": ["deepspeed", "transformers"]}
# the recipes run under the real torchrun command (their frameworks' own 2-rank tests run under
# tests/launcher.py)
REAL = ("torchtitan", "deepspeed")
PRELOAD = {"hf": IMPORTS["train_hf_trainer.py"], "trl": IMPORTS["train_trl.py"],
           "accelerate": IMPORTS["train_accelerate.py"], "lightning": IMPORTS["train_lightning.py"],
           "torchdata": ("torchdata.stateful_dataloader",), "ddp": ("torch.nn.parallel",),
           "torchtitan": ("torchtitan.components.checkpoint", "torchtitan.components.optimizer",
                          "varlen_cli.integrations.torchtitan"),
           "megatron": ("megatron.core.num_microbatches_calculator", "varlen_cli.integrations.megatron")}


def test_the_docs_hold_every_recipe():
    assert sorted(RECIPES) == sorted(NEEDS)
    for name, (_, code) in RECIPES.items():  # seeded before the model is made: a resumed run compares with a fresh one
        seed = re.search(r"^(torch\.manual_seed|set_seed|L\.seed_everything)\(0\)", code, re.M)
        model = re.search(r"^\S.*(LlamaForCausalLM\(config\)|Module\(config\)|DistributedDataParallel\()", code, re.M)
        assert seed and model and seed.start() < model.start(), name


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recipes")
    data = str(folder / "rows.parquet")
    pq.write_table(pq.read_table(small_dataset(folder)).slice(0, 160), data)
    return make_plan(folder, data, "plan", max_tokens=512, dp=2, grad_accum=2, epochs=2), data


def _titan_inputs(folder: str, data: str) -> list:
    """The torchtitan recipe's arguments: a packed plan without LR scaling, and the metrics directory."""
    plan = make_plan(folder, data, "plan-titan", packing=True, seq_len=512, max_tokens=1024, dp=2, grad_accum=2,
                     epochs=2, lr_scaling="none")
    return [plan, os.path.join(folder, "metrics")]


def _megatron_inputs(folder: str, data: str) -> list:
    """The Megatron recipe's arguments: the rows written as a Megatron corpus by megatron-core's
    IndexedDatasetBuilder (a sequence per row), ``varlen analyze PREFIX``, ``varlen plan --packing``."""
    from tests.formats_helpers import write_megatron
    from varlen_cli.analyze import AnalyzeConfig, analyze
    from varlen_cli.plan import PlanConfig, plan

    prefix = os.path.join(folder, "corpus_text_document")
    write_megatron(prefix, [[row] for row in pq.read_table(data).column("input_ids").to_pylist()])
    analyze(AnalyzeConfig(sources=(prefix,), output=os.path.join(folder, "mg"), progress=False, overwrite=True))
    out = os.path.join(folder, "plan-mg.parquet")
    plan(PlanConfig(input=os.path.join(folder, "mg"), output=out, packing=True, seq_len=512, max_tokens=1024, dp=2,
                    grad_accum=2, epochs=2, lr_scaling="linear", overwrite=True))
    return [out, prefix]


PACKED = {"torchtitan": _titan_inputs, "megatron": _megatron_inputs}  # recipes with their own inputs


def _run(folder, name: str, file: str, *args, real: bool = False) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 FILE ARGS`` in ``folder``: the real command (``real``, or
    VARLEN_TEST_REAL_TORCHRUN=1), else tests/launcher.py with the recipe's framework imported once."""
    if real or os.environ.get("VARLEN_TEST_REAL_TORCHRUN") == "1":
        proc = real_torchrun(file, *args, cwd=folder)
    else:
        proc = launch(os.path.join(str(folder), file), *args, cwd=folder, imports=PRELOAD.get(name, ()))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(NEEDS))
def test_recipe_runs_as_written_on_two_processes(plan, tmp_path, name):
    for module in NEEDS[name]:
        pytest.importorskip(module)
    plan_path, data = plan
    file, code = RECIPES[name]
    (tmp_path / file).write_text(code)
    args = [plan_path, data] + ([TOKENIZER] if name == "trl" else [])
    if name in PACKED:
        args = PACKED[name](os.path.dirname(plan_path), data)
    steps = Plan.open(args[0]).num_steps
    out = _run(tmp_path, name, file, *args, real=name in REAL).stdout
    if name in ("ddp", "torchdata", "accelerate", "torchtitan", "megatron", "deepspeed"):
        assert f"trained to step {steps}" in out, out[-2000:]
    if name == "ddp":  # run again: it resumes from its last checkpoint and trains the rest
        assert os.path.exists(tmp_path / "ckpt.pt")
        assert f"rank 1: trained to step {steps}" in _run(tmp_path, name, file, *args).stdout
    if name in ("hf", "trl"):
        assert os.listdir(tmp_path / f"out-{name}")  # its checkpoints
