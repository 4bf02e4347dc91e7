"""varlen_cli.loader: plan reader, batch sampler, LR wrapper, collate (in-process; real Parquet plans)."""

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.loader_helpers import SyntheticTokens, real_plan, token_lengths, write_plan
from varlen_cli.loader import (
    IGNORE_INDEX,
    PadCollate,
    Plan,
    PlanBatchSampler,
    PlanError,
    VariableBatchSizeLR,
    causal_padding_mask,
    dataloader_for_plan,
    resolve_rank,
)

RNG = np.random.default_rng(7)
LENGTHS = RNG.integers(1, 120, size=300)


@pytest.fixture
def plan_path(tmp_path):
    path = tmp_path / "plan.parquet"
    write_plan(path, LENGTHS, dp=2, grad_accum=3, epochs=2, max_tokens=512, row_group_steps=2)
    return str(path)


def all_rows(path):
    t = pq.read_table(path)
    return t.to_pylist()


def test_open_metadata_seek_and_scan(plan_path):
    plan = Plan.open(plan_path, num_samples=len(LENGTHS), world_size=2)
    meta = json.loads(pq.read_schema(plan_path).metadata[b"varlen"])
    assert (plan.dp, plan.grad_accum, plan.epochs) == (2, 3, 2)
    assert plan.num_steps == meta["num_steps"] == sum(plan.steps_per_epoch)
    assert plan.num_microbatches == plan.num_steps * 6 == pq.ParquetFile(plan_path).metadata.num_rows
    assert plan.epoch_start(1) == plan.steps_per_epoch[0] and plan.epoch_of(plan.epoch_start(1)) == 1
    assert pq.ParquetFile(plan_path).metadata.num_row_groups > 3
    # an O(1) seek: a fresh reader decodes exactly one row group to reach the last step
    fresh = Plan.open(plan_path)
    last = fresh.microbatch(fresh.num_steps - 1, 1, 2)
    assert fresh.row_groups_read == 1 and (last.step, last.rank, last.micro) == (fresh.num_steps - 1, 1, 2)
    # every microbatch read through seeks equals the row in the file
    rows = all_rows(plan_path)
    for row in rows:
        mb = plan.microbatch(row["step"], row["rank"], row["micro"])
        assert mb.sample_ids.tolist() == row["sample_ids"] and mb.seqlen == row["seqlen"]
        assert (mb.epoch, mb.tokens, mb.lr_scale, mb.step_tokens) == (row["epoch"], row["tokens"], row["lr_scale"],
                                                                        row["step_tokens"])
    assert np.array_equal(plan.lr_scales(), [r["lr_scale"] for r in rows[::6]])
    # scanning in order decodes each row group once
    scan = Plan.open(plan_path)
    for step in range(scan.num_steps):
        scan.step(step)
    assert scan.row_groups_read == pq.ParquetFile(plan_path).metadata.num_row_groups


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dp=st.integers(1, 3), ga=st.integers(1, 3), epochs=st.integers(1, 2), rg=st.integers(1, 4),
       n=st.integers(20, 150), seed=st.integers(0, 10**6), cut=st.floats(0, 1), static=st.booleans())
def test_sampler_exactly_once_and_resume(tmp_path, dp, ga, epochs, rg, n, seed, cut, static):
    lengths = np.random.default_rng(seed).integers(1, 64, size=n)
    path = str(tmp_path / f"p{seed}.parquet")
    meta = write_plan(path, lengths, dp=dp, grad_accum=ga, epochs=epochs, max_tokens=256, row_group_steps=rg,
                      seed=seed, static_shapes=static)
    plan = Plan.open(path)
    dropped = set(meta["dropped"]["sample_ids"])
    for epoch in range(epochs):
        streams = []
        for rank in range(dp):
            sampler = PlanBatchSampler(plan, rank, dp, num_samples=n)
            sampler.set_epoch(epoch)
            batches = list(sampler)
            assert len(batches) == len(sampler) == plan.steps_per_epoch[epoch] * ga
            assert all(b.info.epoch == epoch and b.info.rank == rank for b in batches)
            streams.append(batches)
        ids = [i for s in streams for b in s for i in b]
        assert sorted(ids) == sorted(set(range(n)) - dropped)  # every kept sample exactly once per epoch
        # resume mid-epoch from a state taken after k microbatches: the rest of the stream, exactly
        k = int(cut * len(streams[0]))
        for rank in range(dp):
            first = PlanBatchSampler(plan, rank, dp)
            first.set_epoch(epoch)
            it = iter(first)
            for _ in range(k):
                next(it)
            state = first.state_dict()
            resumed = PlanBatchSampler(Plan.open(path), rank, dp)
            resumed.load_state_dict(json.loads(json.dumps(state)))
            it = iter([])
            if resumed.epoch == epoch:  # a state at the epoch's end resumes in the next epoch (or nowhere)
                resumed.set_epoch(epoch)
                it = iter(resumed)
            head = next(it, None)
            assert resumed.plan.row_groups_read <= 1  # the seek decoded one row group: no fast-forwarding
            rest = ([head] if head is not None else []) + list(it)
            assert len(rest) == len(streams[rank]) - k
            assert [list(b) for b in rest] == [list(b) for b in streams[rank][k:]]


def test_dataloader_workers_state_after_batch(tmp_path):
    path = str(tmp_path / "p.parquet")
    write_plan(path, LENGTHS, dp=2, grad_accum=2, epochs=1, max_tokens=256)
    data = SyntheticTokens(LENGTHS)
    loader = dataloader_for_plan(data, path, rank=1, world_size=2, num_workers=2, prefetch_factor=4,
                                 lr_scale="ignore")
    seen = []
    for i, batch in enumerate(loader):
        seen.append(batch["sample_ids"][: batch["num_samples"]].tolist())
        if i == 4:
            state = loader.batch_sampler.state_dict(after=batch)  # the sampler itself ran ahead
            assert loader.batch_sampler.state_dict() != state
    again = dataloader_for_plan(data, path, rank=1, world_size=2, lr_scale="ignore")
    again.batch_sampler.load_state_dict(state)
    assert len(again.batch_sampler) == len(seen) - 5 and len(again) == len(seen)  # the rest; the whole epoch
    rest = [b["sample_ids"][: b["num_samples"]].tolist() for b in again]
    assert rest == seen[5:]
    assert len(again.batch_sampler) == len(seen)  # the epoch is over: the next iteration starts from its beginning


def test_loader_view_is_the_plan_loader_but_its_iteration(tmp_path):
    """An adapter's loader (LoaderView) has the plan loader's length, epochs, guard, sampler and state, and
    its own batches: a resume through the view continues the plan loader's stream."""
    from varlen_cli.loader.view import LoaderView

    class Ids(LoaderView):
        def __iter__(self):
            for batch in self.loader:
                yield batch["sample_ids"][: batch["num_samples"]].tolist()

    path = str(tmp_path / "p.parquet")
    write_plan(path, LENGTHS, dp=2, grad_accum=2, epochs=2, max_tokens=256)
    data = SyntheticTokens(LENGTHS)
    base = dataloader_for_plan(data, path, rank=0, world_size=2, lr_scale="ignore")
    view = Ids(base)
    assert view.plan is base.plan and view.guard is base.guard and view.batch_sampler is base.batch_sampler
    assert len(view) == len(base) and view.epoch == base.epoch == 0
    seen = []
    for i, ids in enumerate(view):
        seen.append(ids)
        if i == 2:
            state = view.state_dict()
            assert state == base.state_dict()
            break
    again = Ids(dataloader_for_plan(data, path, rank=0, world_size=2, lr_scale="ignore"))
    again.load_state_dict(state)
    full = list(Ids(dataloader_for_plan(data, path, rank=0, world_size=2, lr_scale="ignore")))
    assert seen + list(again) == full
    again.set_epoch(1)
    assert again.epoch == again.loader.epoch == 1


def test_loader_imports_only_torch_numpy_pyarrow():
    # varlen_cli.format (the plan format's one definition) imports only pyarrow, numpy, json and storage.files
    code = ("import sys, varlen_cli.loader; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('typer', 'rich', 'click', 'transformers', 'accelerate', 'lightning', 'torchdata') or "
            "(m.startswith('varlen_cli.') and not m.startswith('varlen_cli.loader') "
            "and m not in ('varlen_cli.format', 'varlen_cli.errors', 'varlen_cli.storage', "
            "'varlen_cli.storage.files', 'varlen_cli.errors.entry'))); print(bad)")
    # storage: stdlib only (fsspec lazily); errors.entry: the stdlib-only one-line error hook
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_resolve_rank(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_rank() == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_rank() == (3, 4)
    assert resolve_rank(1, 2) == (1, 2)
    assert resolve_rank(rank=2) == (2, 4)


def _rewrite(src, dst, meta_update=None, drop_columns=(), rows=None):
    t = pq.read_table(src)
    meta = json.loads(t.schema.metadata[b"varlen"])
    if meta_update:
        meta.update(meta_update)
    for c in drop_columns:
        t = t.drop_columns([c])
    if rows is not None:
        t = t.slice(0, rows)
    pq.write_table(t.replace_schema_metadata({"varlen": json.dumps(meta)}), dst)
    return dst


def _bad(kind, tmp_path, good):
    p = str(tmp_path / f"{kind}.parquet")
    if kind == "missing":
        return lambda: Plan.open(p), f"plan file not found: {p}"
    if kind == "directory":
        return (lambda: Plan.open(str(tmp_path)),
                f"{tmp_path} is a directory, not a plan file (make one with `varlen plan`)")
    if kind == "not-parquet":
        with open(p, "w") as fh:
            fh.write("hello")
        return lambda: Plan.open(p), f"{p} is not a readable Parquet file"
    if kind == "no-metadata":
        pq.write_table(pa.table({"a": [1]}), p)
        return (lambda: Plan.open(p),
                f"{p} is not a varlen plan: no 'varlen' schema metadata (make one with `varlen plan`)")
    if kind == "metrics-not-plan":
        _rewrite(good, p, {"format": "varlen-metrics"})
        return lambda: Plan.open(p), f"{p} is not a varlen plan (format 'varlen-metrics', expected 'varlen-plan')"
    if kind == "version":
        _rewrite(good, p, {"format_version": 2})
        return lambda: Plan.open(p), f"{p} has plan format version 2; this loader reads version 1"
    if kind == "column":
        _rewrite(good, p, drop_columns=["step_tokens", "lr_scale"])
        return lambda: Plan.open(p), f"{p} lacks plan columns: lr_scale, step_tokens"
    if kind == "truncated":
        _rewrite(good, p, rows=5)
        meta = json.loads(pq.read_schema(good).metadata[b"varlen"])
        return lambda: Plan.open(p), (f"{p} is inconsistent: 5 rows, expected num_steps x dp x grad_accum = "
                                      f"{meta['num_steps']} x 2 x 3")
    if kind == "world-size":
        return lambda: Plan.open(good, world_size=4), ("the plan was made for 2 data-parallel rank(s) but the world "
                                                       "size is 4: re-plan with --dp 4 (with model parallelism, pass "
                                                       "the data-parallel rank and world size explicitly)")
    if kind == "dataset-size":
        return lambda: Plan.open(good, num_samples=299), ("the plan was made for a dataset of 300 samples but the "
                                                          "dataset has 299: re-run `varlen analyze` and `varlen plan` "
                                                          "on this dataset")
    if kind == "sample-id-range":
        _rewrite(good, p, {"input": {}})
        return lambda: Plan.open(p, num_samples=100), "the plan uses sample id 299 but the dataset has only 100 samples"
    if kind == "rank":
        return lambda: PlanBatchSampler(good, rank=2, world_size=2), "rank 2 is out of range for a plan with dp=2"
    if kind == "epoch":
        return (lambda: PlanBatchSampler(good, 0, 2).set_epoch(2),
                "epoch 2 is out of range: the plan has 2 epoch(s) (re-plan with --epochs 3 to train longer)")
    if kind == "state-other-plan":
        other = str(tmp_path / "other.parquet")
        write_plan(other, LENGTHS, dp=2, grad_accum=3, epochs=2, max_tokens=256)
        state = PlanBatchSampler(other, 0, 2).state_dict()
        return (lambda: PlanBatchSampler(good, 0, 2).load_state_dict(state),
                "the sampler state was saved with a different plan file; resume with the same plan")
    if kind == "too-long-sample":
        data = SyntheticTokens(np.where(np.arange(300) == 0, 5000, LENGTHS))
        plan = Plan.open(good)
        mb = next(mb for s in range(plan.num_steps) for mb in plan.step(s) if 0 in mb.sample_ids.tolist())
        loader = dataloader_for_plan(data, good, rank=mb.rank, world_size=2)
        sampler = loader.batch_sampler

        def run():
            sampler.load_state_dict({"plan": sampler.plan.fingerprint, "epoch": mb.epoch, "step": mb.step,
                                     "micro": mb.micro})
            next(iter(loader))
        return run, (f"sample 0 has 5000 tokens but its microbatch (step {mb.step}) is planned at seqlen {mb.seqlen}: "
                     f"the plan was made for different lengths (another dataset, column or tokenizer)")
    raise AssertionError(kind)


BAD = ["missing", "directory", "not-parquet", "no-metadata", "metrics-not-plan", "version", "column", "truncated",
       "world-size", "dataset-size", "sample-id-range", "rank", "epoch", "state-other-plan", "too-long-sample"]


@pytest.mark.parametrize("kind", BAD)
def test_plan_errors(tmp_path, plan_path, kind):
    call, message = _bad(kind, tmp_path, plan_path)
    with pytest.raises(PlanError) as err:
        call()
    assert isinstance(err.value, ValueError)
    text = str(err.value)
    assert "\n" not in text
    assert text == message or (message.endswith("Parquet file") and text.startswith(message + ": "))


@pytest.mark.parametrize("base", ["lambda", "exponential", "optimizer"])
def test_variable_batch_size_lr(plan_path, base):
    plan = Plan.open(plan_path)
    scales = plan.lr_scales()

    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.5}], lr=0.1)
        if base == "lambda":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.9 ** s)
        elif base == "exponential":  # chainable: computes the new LR from the group's current LR
            sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
        else:
            sched = opt
        return model, opt, VariableBatchSizeLR(sched, plan)

    def unscaled(s):
        f = {"lambda": min(1.0, (s + 1) / 3) * 0.9 ** s, "exponential": 0.8 ** s, "optimizer": 1.0}[base]
        return [0.1 * f, 0.5 * f]

    model, opt, lr = make()
    used = []
    for s in range(plan.num_steps):
        used.append([g["lr"] for g in opt.param_groups])
        assert np.allclose(used[-1], np.array(unscaled(s)) * scales[s], rtol=1e-12)
        assert np.allclose(lr.get_last_lr(), used[-1]) and lr.scale() == scales[s]
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        lr.step()
        if s == 4:
            saved = (json.loads(json.dumps(lr.state_dict())), opt.state_dict())
    assert lr.scale() == 1.0  # past the plan's end
    # resume: optimizer state (holding scaled LRs) first, then the wrapper; the LRs continue exactly
    _, opt2, lr2 = make()
    opt2.load_state_dict(saved[1])
    lr2.load_state_dict(saved[0])
    for s in range(5, plan.num_steps):
        assert [g["lr"] for g in opt2.param_groups] == used[s]
        opt2.step()
        lr2.step()


def test_pad_collate_shapes_masks_and_counts(tmp_path):
    path = str(tmp_path / "s.parquet")
    write_plan(path, LENGTHS, dp=2, grad_accum=2, max_tokens=512, static_shapes=True, num_shapes=3)
    plan = Plan.open(path)
    data = SyntheticTokens(LENGTHS)
    collate = PadCollate(pad_id=0, attention_mask_3d=True)
    loss_tokens = {}
    padded_rows = 0
    for rank in range(2):
        loader = dataloader_for_plan(data, plan, rank=rank, world_size=2, collate_fn=collate, lr_scale="ignore")
        for batch in loader:
            info = batch["info"]
            b, t = plan.shapes[info.shape_id]
            ids, att, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
            assert ids.shape == (b, t) == (info.batch_size, info.seqlen) and ids.dtype == torch.long
            n = batch["num_samples"]
            padded_rows += b - n
            assert batch["sample_ids"][:n].tolist() == info.sample_ids.tolist()
            assert (batch["sample_ids"][n:] == -1).all() and not att[n:].any() and (labels[n:] == IGNORE_INDEX).all()
            for row, sid in enumerate(info.sample_ids.tolist()):
                tokens = data[sid]["input_ids"]
                length = len(tokens)
                assert ids[row, :length].tolist() == tokens.tolist() and (ids[row, length:] == 0).all()
                assert att[row].sum() == length
                assert labels[row, : length - 1].tolist() == tokens[1:].tolist()
                assert (labels[row, length - 1:] == IGNORE_INDEX).all()
            assert batch["num_tokens"] == info.tokens == int(att.sum())
            assert batch["loss_tokens"] == int(batch["loss_mask"].sum()) == info.tokens - n
            assert batch["step_loss_tokens"] == info.step_tokens - info.step_samples
            loss_tokens[info.step] = loss_tokens.get(info.step, 0) + batch["loss_tokens"]
            expected = causal_padding_mask(att.sum(1).numpy(), t)
            brute = torch.zeros(b, t, t, dtype=torch.bool)
            for r in range(b):
                L = int(att[r].sum())
                for i in range(t):
                    brute[r, i, i] = True
                    brute[r, i, : min(i + 1, L)] = True
            assert torch.equal(batch["attention_mask_3d"], brute) and torch.equal(expected, brute)
            last = batch
    assert padded_rows > 0  # static shapes produced padding rows
    # the plan's step target count equals what the collates of all ranks and micros saw
    assert all(loss_tokens[s] == plan.step(s)[0].step_tokens - plan.step(s)[0].step_samples for s in loss_tokens)
    assert last["step_samples"] == last["info"].step_samples


def test_pad_collate_without_plan_info():
    out = PadCollate(pad_id=7, pad_multiple=8, shift_labels=False)([[1, 2, 3], np.array([4]), torch.tensor([5, 6])])
    assert out["input_ids"].tolist() == [[1, 2, 3] + [7] * 5, [4] + [7] * 7, [5, 6] + [7] * 6]
    # unshifted (the model shifts): the first token of a sample is never a target
    assert out["labels"][0].tolist() == [IGNORE_INDEX, 2, 3] + [IGNORE_INDEX] * 5
    assert out["num_tokens"] == 6 and out["loss_tokens"] == int(out["loss_mask"].sum()) == 6 - 3
    assert out["step_tokens"] is None and out["info"] is None


def test_sampler_with_real_planner_plan(tmp_path):
    """End to end: a plan made by varlen analyze + varlen plan from sample_data, static shapes."""
    path = real_plan(tmp_path, max_tokens=2048, dp=2, grad_accum=2, static_shapes=True, num_shapes=3,
                     compile_warmup=True)
    if path is None:
        pytest.skip("varlen_cli.plan is not available")
    plan = Plan.open(path, num_samples=2000, world_size=2)
    assert plan.static_shapes and len(plan.shapes) <= 3 and plan.warmup_steps >= 1
    lengths = token_lengths()
    data = SyntheticTokens(lengths)
    ids, shapes_in_warmup = [], [set(), set()]
    for rank in range(2):
        loader = dataloader_for_plan(data, plan, rank=rank, world_size=2, lr_scale="ignore")
        assert len(loader) == plan.num_steps * 2
        for batch in loader:
            info = batch["info"]
            assert tuple(batch["input_ids"].shape) == tuple(plan.shapes[info.shape_id])
            ids += info.sample_ids.tolist()
            if info.step < plan.warmup_steps:
                shapes_in_warmup[rank].add(info.shape_id)
    dropped = set(plan.dropped.get("sample_ids", []))
    assert sorted(ids) == sorted(set(range(2000)) - dropped)
    # compile warm-up: every rank meets every shape during the warm-up steps
    assert shapes_in_warmup == [set(range(len(plan.shapes)))] * 2


def test_packed_plan_rows_reach_the_collate(tmp_path):
    """Packed plans: the sampler passes sample_lengths/rows/starts on; PadCollate refuses them clearly."""
    path = real_plan(tmp_path, packing=True, seq_len=512, rows_per_microbatch=2, dp=2)
    if path is None:
        pytest.skip("varlen_cli.plan is not available")
    plan = Plan.open(path, num_samples=2000, world_size=2)
    batch = next(iter(PlanBatchSampler(plan, 1, 2)))
    info = batch.info
    assert len(info.sample_lengths) == len(info.sample_rows) == len(info.sample_starts) == len(batch)
    assert info.shape == (2, 512) and int(info.sample_rows.max()) < 2
    data = SyntheticTokens(token_lengths())
    packed = next(iter(dataloader_for_plan(data, plan, rank=0, world_size=2)))  # picks the packed collate
    assert packed["input_ids"].shape == (2, 512) and "cu_seqlens" in packed
    loader = dataloader_for_plan(data, plan, rank=0, world_size=2, collate_fn=PadCollate(), lr_scale="ignore")
    with pytest.raises(PlanError, match=r"^step 0 comes from a packed plan \(--packing\): collate it with "
                                        r"varlen_cli\.loader\.packed\.PackedCollate, not PadCollate$"):
        next(iter(loader))
