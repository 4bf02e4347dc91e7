"""``step_loss_tokens`` (issue 11, item 9): the loss targets of each step with shifted labels, against
an independent count by token position, with empty and one-token samples, padded and packed, split
and unsplit; and `varlen validate` catches a wrong value."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.plan_helpers import write_metrics
from varlen_cli.plan import PlanConfig, plan
from varlen_cli.validate import ValidateConfig, validate


def _lengths(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 90, size=120)
    lengths[rng.choice(120, 25, replace=False)] = 0  # empty samples
    lengths[rng.choice(120, 25, replace=False)] = 1  # one-token samples: no target
    return lengths


def _targets_by_position(rows: list, lengths: np.ndarray, packed: bool) -> dict:
    """Per step: token positions p of each planned piece of a sample that have a next token of the
    same sample (p + 1 < length), counted position by position."""
    per_step: dict = {}
    for row in rows:
        n = 0
        for k, sid in enumerate(row["sample_ids"]):
            start = row["sample_starts"][k] if packed else 0
            size = row["sample_lengths"][k] if packed else int(lengths[sid])
            n += sum(1 for p in range(start, start + size) if p + 1 < int(lengths[sid]))
        per_step[row["step"]] = per_step.get(row["step"], 0) + n
    return per_step


CASES = {
    "padded": dict(max_tokens=400, dp=2, grad_accum=2),
    "padded, pad multiple, epochs": dict(max_tokens=512, dp=3, pad_multiple=8, epochs=2),
    "packed": dict(packing=True, seq_len=128, rows_per_microbatch=2, dp=2),
    "packed, split": dict(packing=True, seq_len=32, split_long=True, dp=2, grad_accum=2, epochs=2),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_step_loss_tokens_equal_targets_counted_by_position(tmp_path, name, seed):
    options = CASES[name]
    lengths = _lengths(seed)
    metrics = write_metrics(tmp_path / "m", lengths)
    out = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=metrics, output=out, seed=seed, **options))
    rows = pq.read_table(out).to_pylist()
    want = _targets_by_position(rows, lengths, packed=bool(options.get("packing")))
    got = {r["step"]: r["step_loss_tokens"] for r in rows}
    assert got == want
    # the old formula undercounts: each empty sample (and, split, each non-final chunk) is off by one
    naive = {r["step"]: r["step_tokens"] - r["step_samples"] for r in rows}
    assert naive != want
    assert validate(ValidateConfig(out, metrics=metrics)).ok


def test_validate_catches_a_wrong_step_loss_tokens(tmp_path):
    lengths = _lengths(3)
    metrics = write_metrics(tmp_path / "m", lengths)
    out = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=metrics, output=out, packing=True, seq_len=128, dp=2))
    table = pq.read_table(out)
    wrong = table.column("step_tokens").to_numpy() - table.column("step_samples").to_numpy()
    bad = table.set_column(table.schema.get_field_index("step_loss_tokens"), "step_loss_tokens", pa.array(wrong))
    pq.write_table(bad.replace_schema_metadata(table.schema.metadata), tmp_path / "bad.parquet")
    result = validate(ValidateConfig(str(tmp_path / "bad.parquet")))
    # the column is wrong against the lengths; lr_scale (by loss tokens, the default) then disagrees with it too
    assert sorted(c.name for c in result.violations) == ["loss tokens", "lr_scale"]
    meta = json.loads(table.schema.metadata[b"varlen"])
    assert meta["packing"]["seq_len"] == 128


@pytest.mark.parametrize("name", ["padded", "packed"])
@pytest.mark.parametrize("labels", ["shifted", "unshifted"])
def test_loader_step_loss_tokens_are_the_collated_targets_of_the_step(tmp_path, name, labels):
    """What a trainer divides by: every batch's ``step_loss_tokens`` (and ``num_items_in_batch``) equals
    the targets the collate itself marks in all microbatches of that step, with empty and one-token
    samples, in either label convention."""
    from varlen_cli.loader import PackedCollate, PadCollate, Plan, dataloader_for_plan

    options = CASES[name]
    lengths = _lengths(3)
    metrics = write_metrics(tmp_path / "m", lengths)
    out = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=metrics, output=out, **options))
    dataset = [np.arange(1, int(n) + 1, dtype=np.int64) for n in lengths]
    p = Plan.open(out)
    collate = PackedCollate(labels=labels) if options.get("packing") else PadCollate(labels=labels)
    marked: dict = {}
    announced: dict = {}
    for rank in range(p.dp):
        for batch in dataloader_for_plan(dataset, p, rank=rank, world_size=p.dp, collate_fn=collate,
                                          lr_scale="ignore"):  # counts only, no optimizer
            step = int(batch["info"].step)
            marked[step] = marked.get(step, 0) + int(batch["loss_mask"].sum())
            announced.setdefault(step, set()).add((int(batch["step_loss_tokens"]), int(batch["num_items_in_batch"])))
    assert {s: {(n, n)} for s, n in marked.items()} == announced
