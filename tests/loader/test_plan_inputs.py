"""Bad plan files and bad datasets the loader must refuse in one line (issue 23): negative sample ids,
non-finite or negative lr_scale, a FIFO (which used to hang inspect/validate/simulate, deaf to SIGINT),
a directory, and padded-loader items shorter than their analysed length (step_loss_tokens came out 2x)."""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.loader_helpers import ROOT, SyntheticTokens, write_plan
from varlen_cli.loader import Plan, PlanError, dataloader_for_plan

LENGTHS = np.random.default_rng(3).integers(1, 100, size=120)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("inputs") / "plan.parquet")
    write_plan(path, LENGTHS, dp=2, grad_accum=2, epochs=1, max_tokens=512)
    return path


def _with_column(src: str, dst: str, name: str, change, statistics: bool = True) -> str:
    """A copy of the plan with column ``name`` changed by ``change(pylist) -> pylist``."""
    t = pq.read_table(src)
    i = t.schema.get_field_index(name)
    values = change(t.column(name).to_pylist())
    t = t.set_column(i, t.schema.field(i), pa.array(values, type=t.schema.field(i).type))
    pq.write_table(t, dst, write_statistics=statistics)
    return dst


def _negate_first_id(ids):
    ids[0] = [-7] + ids[0][1:]
    return ids


def _set_lr(value):
    def change(scales):
        scales[5] = value
        return scales
    return change


# (kind, make the input from the good plan and a folder, the exact message, {the path} filled in)
CASES = [
    ("negative sample id", lambda good, d: _with_column(good, f"{d}/neg.parquet", "sample_ids", _negate_first_id),
     "{p} holds sample id -7: sample ids index the dataset from 0 (the file was edited or damaged; make it again "
     "with `varlen plan`)"),
    ("negative sample id, no statistics",
     lambda good, d: _with_column(good, f"{d}/negns.parquet", "sample_ids", _negate_first_id, statistics=False),
     "the plan holds sample id -7: sample ids index the dataset from 0 (the file was edited or damaged; make it "
     "again with `varlen plan`)"),
    ("NaN lr_scale", lambda good, d: _with_column(good, f"{d}/nan.parquet", "lr_scale", _set_lr(float("nan"))),
     "{p} holds lr_scale nan at step 1: an LR scale must be a finite number >= 0 (the file was edited or damaged; "
     "make it again with `varlen plan`)"),
    ("inf lr_scale", lambda good, d: _with_column(good, f"{d}/inf.parquet", "lr_scale", _set_lr(float("inf"))),
     "{p} holds lr_scale inf at step 1: an LR scale must be a finite number >= 0 (the file was edited or damaged; "
     "make it again with `varlen plan`)"),
    ("negative lr_scale", lambda good, d: _with_column(good, f"{d}/negl.parquet", "lr_scale", _set_lr(-0.5)),
     "{p} holds lr_scale -0.5 at step 1: an LR scale must be a finite number >= 0 (the file was edited or damaged; "
     "make it again with `varlen plan`)"),
    ("directory", lambda good, d: d, "{p} is a directory, not a plan file (make one with `varlen plan`)"),
]


@pytest.mark.parametrize("kind,make,message", CASES, ids=[c[0] for c in CASES])
def test_bad_plan_files_are_refused_in_one_line(good, tmp_path, kind, make, message):
    path = make(good, str(tmp_path))

    def use():
        plan = Plan.open(path)
        for step in range(plan.num_steps):  # statistics-less files are caught when the row group is read
            plan.step(step)

    with pytest.raises(PlanError) as err:
        use()
    assert str(err.value) == message.format(p=path)


def test_padded_loader_refuses_items_shorter_than_analysed(good):
    """The packed loader refused this already; the padded one trained on and doubled step_loss_tokens."""
    plan = Plan.open(good)
    mb = plan.microbatch(0, 0, 0)
    short = LENGTHS.copy()
    short[mb.sample_ids[0]] = max(1, short[mb.sample_ids[0]] // 2)  # the dataset changed after `varlen analyze`
    loader = dataloader_for_plan(SyntheticTokens(short), plan, rank=0, world_size=2, lr_scale="ignore")
    ids = ", ".join(str(int(i)) for i in mb.sample_ids[:4]) + (", ..." if len(mb.sample_ids) > 4 else "")
    want = (f"step 0 micro 0: the dataset items of samples {ids} hold {int(short[mb.sample_ids].sum())} tokens but "
            f"the plan counted {mb.tokens}: the plan was made for different lengths (another dataset, column or "
            f"tokenizer)")
    with pytest.raises(PlanError) as err:
        next(iter(loader))
    assert str(err.value) == want


FIFO_CODE = "import sys; from varlen_cli.loader import Plan; Plan.open(sys.argv[1])"


@pytest.mark.parametrize("argv", [[sys.executable, "-c", FIFO_CODE], [sys.executable, "-m", "varlen_cli", "inspect"],
                                  [sys.executable, "-m", "varlen_cli", "validate"],
                                  [sys.executable, "-m", "varlen_cli", "simulate", "--stages", "2"]],
                         ids=["Plan.open", "inspect", "validate", "simulate"])
def test_a_fifo_is_refused_not_waited_on(tmp_path, argv):
    fifo = str(tmp_path / "plan.parquet")
    os.mkfifo(fifo)
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([*argv[:4], fifo, *argv[4:]], capture_output=True, text=True, timeout=120, env=env)
    message = f"plan {fifo} is a FIFO (named pipe), not a regular file"
    if argv[1] == "-c":  # a script that lets the PlanError escape: its one line (varlen_cli/errors/entry.py)
        assert (proc.returncode, proc.stderr) == (1, f"varlen: error: {message}\n")
    else:
        assert (proc.returncode, proc.stderr.strip()) == (3, f"varlen: error: {message}")


def test_a_state_file_is_json_not_a_plan(good):
    """Loading a sampler state is not opening a plan: a state of another plan still says so."""
    state = json.loads(json.dumps({"plan": "0" * 16, "epoch": 0, "step": 0, "micro": 0}))
    loader = dataloader_for_plan(SyntheticTokens(LENGTHS), good, rank=0, world_size=2)
    with pytest.raises(PlanError, match="^the sampler state was saved with a different plan file; resume with the same "
                                        "plan$"):
        loader.load_state_dict(state)
