"""The per-step figures the trackers log (issue 35): every microbatch of a plan carries its step's
figures over all ranks, read from the plan file a window at a time, equal to the plan's rows (checked
here with numpy); plan_metrics gives them to any logger, plan_metric_events to DeepSpeed's monitor."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.integration_helpers import plan_step_figures
from tests.plan_helpers import write_metrics
from varlen_cli.errors import PlanError
from varlen_cli.loader import Plan, dataloader_for_plan, plan_metric_events, plan_metrics, step_figures
from varlen_cli.plan import PlanConfig, plan

COMMON = {"lr_scaling": "sqrt", "lr_scale_by": "samples", "drop_long": True}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    from varlen_cli.plan import writer

    folder = tmp_path_factory.mktemp("figures")
    lengths = np.random.default_rng(11).integers(1, 700, 1200)
    metrics = write_metrics(folder / "m", lengths)
    padded, packed = str(folder / "padded.parquet"), str(folder / "packed.parquet")
    saved = writer.ROW_GROUP_TARGET
    writer.ROW_GROUP_TARGET = 16  # many row groups: windows cut across them
    try:
        plan(PlanConfig(input=metrics, output=padded, max_tokens=2048, dp=3, grad_accum=2, **COMMON))
        plan(PlanConfig(input=metrics, output=packed, packing=True, seq_len=1024, rows_per_microbatch=2, dp=2,
                        attention_cost=0.001, **COMMON))  # the straggler needs the segments' lengths
    finally:
        writer.ROW_GROUP_TARGET = saved
    return {"padded": padded, "packed": packed, "lengths": lengths}


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_every_microbatch_carries_its_steps_figures(plans, kind, monkeypatch):
    monkeypatch.setattr(step_figures, "WINDOW_ROWS", 10)  # a few steps a window, cut across row groups
    p = Plan.open(plans[kind])
    assert pq.ParquetFile(plans[kind]).metadata.num_row_groups > 3
    want = plan_step_figures(plans[kind])
    for step in range(p.num_steps):
        for rank in range(p.dp):
            got = plan_metrics(p.microbatch(step, rank, p.grad_accum - 1))
            assert got.keys() == want.keys()
            for name, values in want.items():
                assert got[name] == pytest.approx(values[step], rel=1e-12), (step, name)
    assert p.microbatch(3, 0, 0).figures is p.microbatch(3, 1, 0).figures  # one object a step


def test_collated_batches_and_monitor_events(plans):
    p = Plan.open(plans["padded"])
    dataset = [np.arange(n) % 50 for n in plans["lengths"]]
    loader = dataloader_for_plan(dataset, p, rank=1, world_size=3, lr_scale="ignore")
    batch = next(iter(loader))
    want = plan_metrics(p.microbatch(0, 1, 0))
    assert plan_metrics(batch) == want == plan_metrics(batch["info"])
    assert plan_metric_events(batch, 7) == [(name, value, 7) for name, value in want.items()]
    assert set(want) == set(step_figures.METRIC_NAMES)
    with pytest.raises(PlanError, match="^this batch carries no plan figures: collate it with varlen's PadCollate"):
        plan_metrics({"input_ids": batch["input_ids"]})
