"""varlen plan --extend: existing steps unchanged, epochs appended (as a fresh plan would plan them),
sampler states carry over, bad inputs; plus a property test of replan's exactly-once."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.conftest import assert_user_error
from tests.plan_helpers import write_metrics
from varlen_cli.cli import app
from varlen_cli.errors import InputError
from varlen_cli.loader import Plan, PlanBatchSampler
from varlen_cli.plan import PlanConfig, plan
from varlen_cli.plan.replan import ExtendConfig, ReplanConfig, extend, replan
from varlen_cli.validate import ValidateConfig, validate

runner = CliRunner()
N = 400


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("extend")
    lengths = np.random.default_rng(11).integers(3, 250, N)
    metrics = write_metrics(root / "metrics", lengths)
    parent = str(root / "parent.parquet")
    plan(PlanConfig(input=metrics, output=parent, max_tokens=1024, dp=2, grad_accum=2, epochs=2, seed=5))
    return {"root": root, "L": lengths, "metrics": metrics, "parent": parent}


def _meta(path):
    return json.loads(pq.read_schema(path).metadata[b"varlen"])


@pytest.mark.parametrize("order", ["bucket-shuffle", "random"])
def test_existing_steps_unchanged_and_new_epochs_as_planned_afresh(dirs, tmp_path, order):
    parent = str(tmp_path / f"p-{order}.parquet")
    plan(PlanConfig(input=dirs["metrics"], output=parent, max_tokens=1024, dp=2, grad_accum=2, epochs=2, seed=5,
                    order=order))
    out = str(tmp_path / "e.parquet")
    res = runner.invoke(app, ["plan", "--extend", parent, "--epochs", "4", "-o", out])
    assert res.exit_code == 0, res.output
    old, new = pq.read_table(parent), pq.read_table(out)
    pm, m = _meta(parent), _meta(out)
    assert new.slice(0, len(old)).drop_columns([]).to_pydict() == old.to_pydict()  # same rows for existing steps
    # the new epochs are those of a fresh 4-epoch plan with the same base batch size (seed streams per epoch)
    fresh = str(tmp_path / "fresh.parquet")
    plan(PlanConfig(input=dirs["metrics"], output=fresh, max_tokens=1024, dp=2, grad_accum=2, epochs=4, seed=5,
                    order=order, base_batch_size=pm["base_batch_size"]))
    f = pq.read_table(fresh).to_pydict()
    e = new.to_pydict()
    for name in ("epoch", "step", "rank", "micro", "sample_ids", "lr_scale", "seqlen", "batch_size"):
        assert e[name] == f[name], name
    shapes = [m["shapes"][i] for i in e["shape_id"]]
    assert shapes == [_meta(fresh)["shapes"][i] for i in f["shape_id"]]
    assert m["epochs"] == 4 and m["num_steps"] == sum(m["steps_per_epoch"]) == len(e["step"]) // 4
    assert m["steps_per_epoch"][:2] == pm["steps_per_epoch"]
    assert m["lineage"]["parent"] == Plan.open(parent).fingerprint and m["lineage"]["parent_steps"] == pm["num_steps"]
    for ep in range(4):
        ids = [i for k, ids in zip(e["epoch"], e["sample_ids"]) if k == ep for i in ids]
        assert sorted(ids) == list(range(N))
    assert validate(ValidateConfig(plan=out, metrics=dirs["metrics"])).ok


def test_sampler_state_carries_over(dirs, tmp_path):
    out = str(tmp_path / "e.parquet")
    extend(ExtendConfig(plan=dirs["parent"], output=out, epochs=3))
    old = PlanBatchSampler(dirs["parent"], rank=1, world_size=2, epoch=1)
    it = iter(old)
    for _ in range(3):
        next(it)
    state = old.state_dict()
    new = PlanBatchSampler(out, rank=1, world_size=2)
    new.load_state_dict(state)
    assert new.state_dict() == {**state, "plan": Plan.open(out).fingerprint}
    assert [list(x) for x in new] == [list(x) for x in it]  # the rest of epoch 1 is the same


def test_extend_a_replanned_plan(dirs, tmp_path):
    first = str(tmp_path / "r.parquet")
    replan(ReplanConfig(plan=dirs["parent"], output=first, dp=3, from_step=3))
    out = str(tmp_path / "re.parquet")
    extend(ExtendConfig(plan=first, output=out, epochs=4))
    m = _meta(out)
    assert m["lineage"]["first_step"] == 3 and m["lineage"]["kind"] == "extend" and m["epochs"] == 4
    assert validate(ValidateConfig(plan=out, metrics=dirs["metrics"])).ok


def test_bad_inputs(dirs, tmp_path):
    out = str(tmp_path / "x.parquet")
    p = dirs["parent"]
    table = [
        (["--epochs", "2"], 2, f"--epochs 2 must be more than the 2 epoch(s) of {p} to extend it"),
        (["--epochs", "3", "--dp", "4"], 2, "--dp cannot be combined with --extend: the extended plan keeps the "
                                            "plan's options (use `varlen replan` to change the layout)"),
        (["--epochs", "3", "--seed", "1"], 2, "--seed cannot be combined with --extend: the extended plan keeps the "
                                              "plan's options (use `varlen replan` to change the layout)"),
    ]
    for args, code, message in table:
        assert_user_error(runner.invoke(app, ["plan", "--extend", p, "-o", out, *args]), code, message)
    changed = write_metrics(tmp_path / "changed", dirs["L"][:-1])
    res = runner.invoke(app, ["plan", changed, "--extend", p, "--epochs", "3", "-o", out])
    assert_user_error(res, 3, f"{changed} changed since {p} was planned: it has {N - 1:,} samples, the plan was "
                              f"made for {N:,}")
    assert_user_error(runner.invoke(app, ["plan", "-o", out, "--max-tokens", "10"]), 2,
                      "missing INPUT_DIR: the metrics or sorted directory to plan (or --extend PLAN)")


def test_an_invalid_parent_is_refused_as_validate_refuses_it(dirs, tmp_path):
    """A parent with a NaN lr_scale: validate finds the violation (exit 6); --extend, whose output keeps the
    parent's rows, refuses it with validate's verdict (exit 6, one line, no output), not as its own bug."""
    import pyarrow as pa

    table = pq.read_table(dirs["parent"])
    lr = table.column("lr_scale").to_numpy().copy()
    lr[3] = np.nan
    bad = str(tmp_path / "bad.parquet")
    pq.write_table(table.set_column(table.schema.get_field_index("lr_scale"), "lr_scale", pa.array(lr)), bad)
    assert runner.invoke(app, ["validate", bad]).exit_code == 6
    out = str(tmp_path / "e.parquet")
    assert_user_error(runner.invoke(app, ["plan", "--extend", bad, "--epochs", "3", "-o", out]), 6,
                      f"{bad} is not a valid plan, so neither would its extension be: violation: lr_scale: 1 rows "
                      f"whose lr_scale is not finite (see `varlen validate {bad}`)")
    assert not (tmp_path / "e.parquet").exists()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dp=st.integers(1, 3), new_dp=st.integers(1, 4), accum=st.integers(1, 2), frac=st.floats(0, 0.99),
       order=st.sampled_from(["bucket-shuffle", "random", "curriculum"]), seed=st.integers(0, 3))
def test_replan_exactly_once_property(dirs, tmp_path_factory, dp, new_dp, accum, frac, order, seed):
    root = tmp_path_factory.mktemp("prop")
    src = dirs["metrics"] if order != "curriculum" else write_metrics(root / "s", dirs["L"], sorted_by="length")
    parent = str(root / "p.parquet")
    plan(PlanConfig(input=src, output=parent, max_tokens=1024, dp=dp, grad_accum=accum, order=order, seed=seed))
    steps = Plan.open(parent).num_steps
    step = int(frac * steps)
    out = str(root / "n.parquet")
    p = pq.read_table(parent).to_pydict()
    done = [i for s, ids in zip(p["step"], p["sample_ids"]) if s < step for i in ids]
    if N - len(done) < new_dp * accum:  # fewer samples left than slots of one step: cannot be laid out
        with pytest.raises(InputError, match="cannot fill"):
            replan(ReplanConfig(plan=parent, output=out, dp=new_dp, from_step=step))
        return
    replan(ReplanConfig(plan=parent, output=out, dp=new_dp, from_step=step))
    n = pq.read_table(out).to_pydict()
    rest = [i for ids in n["sample_ids"] for i in ids]
    assert sorted(done + rest) == list(range(N))
