"""`varlen export deepspeed PLAN -o DIR`: the plan as DeepSpeed's own (microbatch_ids, batch_sizes,
batch_max_seqlens), consumed by DeepSpeed's dataloader_for_variable_batch_size and VariableBatchSizeLR
(each rank gets exactly its plan rows, the LR is base x lr_scale every step); the output is written like
every varlen output (atomic, --overwrite replaces only an export) and a damaged export is refused."""

import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.integration_helpers import make_plan, small_dataset
from varlen_cli.cli import app
from varlen_cli.errors import InputError
from varlen_cli.export import read_deepspeed_export
from varlen_cli.loader import Plan


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    data = small_dataset(folder)
    common = dict(max_tokens=512, dp=2, grad_accum=2, epochs=2, lr_scaling="linear")
    return folder, {"samples": make_plan(folder, data, "samples", lr_scale_by="samples", **common),
                    "tokens": make_plan(folder, data, "tokens", lr_scale_by="tokens", **common),
                    "loss-tokens": make_plan(folder, data, "loss-tokens", **common),  # the default
                    "packed": make_plan(folder, data, "packed", packing=True, seq_len=512, dp=2, grad_accum=2)}


def export(*args):
    return CliRunner().invoke(app, ["export", "deepspeed", *map(str, args)])


@pytest.mark.parametrize("unit", ["samples", "tokens", "loss-tokens"])
@pytest.mark.filterwarnings("ignore::UserWarning")  # DeepSpeed's VariableBatchSizeLR calls step(epoch) at start
def test_deepspeeds_own_loader_and_lr_consume_the_export(plans, tmp_path, unit):
    sampling = pytest.importorskip("deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr")
    import torch

    folder, paths = plans
    plan = Plan.open(paths[unit])
    res = export(plan.path, "-o", tmp_path / "ds", "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert (summary["microbatches"], summary["steps"], summary["dp"]) == (plan.num_microbatches, plan.num_steps, 2)
    ex = read_deepspeed_export(str(tmp_path / "ds"))
    assert (ex.dp, ex.grad_accum, ex.lr_scaling_method) == (2, 2, "linear")
    assert ex.manifest["batch_size_unit"] == unit
    ids = list(range(int(plan.input["num_rows"])))  # dataset[i] = i: the loader yields sample ids
    for rank in range(plan.dp):
        loader, _ = sampling.dataloader_for_variable_batch_size(
            ids, ex.microbatch_ids, ex.batch_max_seqlens, dataloader_rank=rank, dataloader_num_replicas=ex.dp,
            dataloader_batch_size=1, dataloader_num_workers=0)
        got = [list(batch) for batch in loader]
        want = [mb.sample_ids.tolist() for mb in plan.microbatches(rank)]
        assert got == want, rank
    for step in range(plan.num_steps):
        assert ex.batch_max_seqlens[step] == max(mb.seqlen for mb in plan.step(step))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    lr = sampling.lr_scheduler_for_variable_batch_size(ex.base_batch_size, ex.batch_sizes, None, optimizer,
                                                       lr_scaling_method=ex.lr_scaling_method)
    seen = []
    for _ in range(plan.num_steps):
        seen.append(optimizer.param_groups[0]["lr"])
        lr.step()
    assert len(set(np.round(seen, 6))) > 1
    assert np.allclose(seen, plan.lr_scales(), rtol=1e-12)


def test_output_safety_and_refusals(plans, tmp_path):
    folder, paths = plans
    out = tmp_path / "ds"
    assert export(paths["samples"], "-o", out).exit_code == 0
    again = export(paths["samples"], "-o", out)
    assert again.exit_code == 4 and f"output {out} already exists; pass --overwrite to replace it" in again.output
    assert export(paths["tokens"], "-o", out, "--overwrite").exit_code == 0  # replaces its own export
    assert read_deepspeed_export(str(out)).manifest["batch_size_unit"] == "tokens"
    (out / "notes.txt").write_text("mine")
    res = export(paths["samples"], "-o", out, "--overwrite")
    assert res.exit_code == 4 and "holds files varlen did not write (notes.txt)" in res.output
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "a").write_text("x")
    res = export(paths["samples"], "-o", foreign, "--overwrite")
    assert res.exit_code == 4 and "is a directory varlen did not make" in res.output
    res = export(paths["packed"], "-o", tmp_path / "packed")
    assert res.exit_code == 2 and "is a packed plan (--packing): DeepSpeed's variable-batch loader pads samples" \
        in res.output
    assert not os.path.exists(tmp_path / "packed")


def test_a_damaged_export_is_refused(plans, tmp_path):
    folder, paths = plans
    out = tmp_path / "ds"
    assert export(paths["samples"], "-o", out).exit_code == 0
    offsets = np.load(out / "microbatch_offsets.npy")
    np.save(out / "microbatch_offsets.npy", offsets[:-1])
    with pytest.raises(InputError, match=r"is damaged: its arrays do not agree with each other or with _export\.json$"):
        read_deepspeed_export(str(out))
    (out / "_export.json").write_text("[]")
    with pytest.raises(InputError, match=r"is not a varlen export directory \(its _export\.json is not a "
                                         r"varlen-deepspeed-export manifest\)$"):
        read_deepspeed_export(str(out))


def test_the_step_column_is_what_lr_scale_follows_and_an_older_plan_without_it_is_refused(plans, tmp_path):
    """batch_sizes come from the column lr_scale is linear in (plan/lr.py's step_column, read straight from
    each plan's columns here: lr_scale = column / base_batch_size); a plan whose lr_scale follows the loss
    tokens but lacks the optional step_loss_tokens column is refused in one line, not exported wrong."""
    import pyarrow.parquet as pq

    from varlen_cli.plan.lr import step_column

    folder, paths = plans
    for unit, column in (("samples", "step_samples"), ("tokens", "step_tokens"), ("loss-tokens", "step_loss_tokens")):
        meta = json.loads(pq.read_schema(paths[unit]).metadata[b"varlen"])
        assert step_column(meta) == column
        t = pq.read_table(paths[unit], columns=[column, "lr_scale"])
        assert np.allclose(t.column("lr_scale").to_numpy(), t.column(column).to_numpy() / meta["base_batch_size"])
    assert step_column({"lr_scale_by": "tokens", "loss_tokens": "target_length"}) == "step_loss_tokens"
    assert step_column({}) == "step_samples"  # plans made before lr_scale_by was recorded
    table = pq.read_table(paths["loss-tokens"])
    old = tmp_path / "old.parquet"
    pq.write_table(table.drop_columns(["step_loss_tokens"]), old)
    res = export(old, "-o", tmp_path / "ds")
    assert res.exit_code == 3, res.output
    assert (f"{old} has no step_loss_tokens column, which its lr_scale (--lr-scale-by loss-tokens) follows: plan it "
            f"again with this varlen") in " ".join(res.output.split())
    assert not os.path.exists(tmp_path / "ds")
