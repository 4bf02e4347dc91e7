"""The recipes of docs/loader.md and docs/integrations.md run as written: each ```python block that
starts with ``# recipe: NAME (FILE)`` is saved as FILE and started with 2 CPU processes (gloo) as the
command the docs give under it starts them, on a plan of a slice of sample_data/tokenized.parquet,
under tests/launcher.py, which starts each rank as torchrun does (its environment is checked against
the real torchrun's in tests/test_launcher.py) from a process that imported the frameworks once
(VARLEN_TEST_REAL_TORCHRUN=1: under the real command)."""

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
         "lightning": ["lightning", "transformers"], "torchdata": ["torchdata"], "ddp": []}
PRELOAD = {"hf": IMPORTS["train_hf_trainer.py"], "trl": IMPORTS["train_trl.py"],
           "accelerate": IMPORTS["train_accelerate.py"], "lightning": IMPORTS["train_lightning.py"],
           "torchdata": ("torchdata.stateful_dataloader",), "ddp": ("torch.nn.parallel",)}


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


def _run(folder, name: str, file: str, *args) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 FILE ARGS`` in ``folder``: tests/launcher.py with the recipe's framework
    imported once (VARLEN_TEST_REAL_TORCHRUN=1: the real command)."""
    if os.environ.get("VARLEN_TEST_REAL_TORCHRUN") == "1":
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
    steps = Plan.open(plan_path).num_steps
    out = _run(tmp_path, name, file, *args).stdout
    if name in ("ddp", "torchdata", "accelerate"):
        assert f"trained to step {steps}" in out, out[-2000:]
    if name == "ddp":  # run again: it resumes from its last checkpoint and trains the rest
        assert os.path.exists(tmp_path / "ckpt.pt")
        assert f"rank 1: trained to step {steps}" in _run(tmp_path, name, file, *args).stdout
    if name in ("hf", "trl"):
        assert os.listdir(tmp_path / f"out-{name}")  # its checkpoints
