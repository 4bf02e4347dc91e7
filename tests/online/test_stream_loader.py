"""dataloader_for_stream on 2 real gloo ranks under DDP (tests/online/stream_worker.py, started as
torchrun starts ranks): every rank reads the same stream and gets the same number of microbatches a
step (DDP's all-reduce per backward would hang otherwise), every sample is trained once over the ranks,
groups stay in one microbatch, the LR is the base LR times the step's scale; a state saved mid-step and
mid-stream resumes in new processes exactly (the rest of the microbatches, and at a step boundary the
same losses); a rank that reads another stream is refused. In-process: the collated batches against
the planned step, empty microbatches, and the loader's refusals."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.launcher import launch
from varlen_cli.errors import PlanError
from varlen_cli.online import OnlinePlanner, dataloader_for_stream

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stream_worker.py")


def _run(log_dir, *args):
    log_dir.mkdir(exist_ok=True)
    proc = launch(WORKER, "--log-dir", str(log_dir), *args, imports=("torch.nn.parallel",), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.load(open(log_dir / f"rank-{r}.json")) for r in range(2)]


def _rows(log):
    return [(r["step"], r["micro"], r["ids"], r["lr"]) for r in log]


@pytest.mark.slow
def test_two_ranks_exactly_once_and_exact_resume(tmp_path):
    """One run (padded, then packed) saves states after 5, 6 and 9 microbatches (after a whole step and
    inside one, checked below); a new pair of processes resumes each to the end."""
    full = _run(tmp_path / "full", "--stops", "5,6,9")
    for mode in ("padded", "packed"):
        logs = [full[r][mode] for r in range(2)]
        ids = [i for log in logs for row in log for i in row["ids"]]
        assert sorted(ids) == list(range(400))  # every sample once over the ranks
        assert [(r["step"], r["micro"]) for r in logs[0]] == [(r["step"], r["micro"]) for r in logs[1]]
        where = {}  # group ids (i // 2) whole, each in one microbatch of one rank
        for rank, log in enumerate(logs):
            for row in log:
                for i in row["ids"]:
                    where.setdefault(i // 2, set()).add((rank, row["step"], row["micro"]))
        assert all(len(places) == 1 for places in where.values())
        for row in logs[0] + logs[1]:
            assert row["lr"] == pytest.approx(0.5 * row["scale"], rel=1e-12)
        assert len({row["scale"] for row in logs[0]}) > 1
    resumed = _run(tmp_path / "resumed", "--resume-from", str(tmp_path / "full"))
    for mode in ("padded", "packed"):
        boundaries = {k + 1 for k, r in enumerate(full[0][mode]) if r["micro"] == r["G"] - 1}
        assert {5, 6, 9} - boundaries and {5, 6, 9} & boundaries  # a state inside a step and one after a step
        for stop in (5, 6, 9):
            for rank in range(2):
                a, b = full[rank][mode], resumed[rank][f"{mode}-{stop}"]  # b: the first rows, then the resumed
                assert _rows(b) == _rows(a)  # the rest of the stream, exactly once, with the same LRs
                if stop in boundaries:  # the same model, optimizer and data: the same losses, bit for bit
                    assert [r["loss"] for r in b] == [r["loss"] for r in a]


@pytest.mark.slow
def test_a_rank_reading_another_stream_is_refused(tmp_path):
    (tmp_path / "skew").mkdir()
    proc = launch(WORKER, "--log-dir", str(tmp_path / "skew"), "--skew", "5", "--samples", "60",
                  imports=("torch.nn.parallel",), timeout=120)
    assert proc.returncode != 0
    assert "the ranks planned different samples; every rank must read the same stream" in proc.stderr


def _items(n=120, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 50, int(k)).tolist() for k in rng.integers(0, 90, n)]


@pytest.mark.parametrize("budget", [dict(max_tokens=256, pad_multiple=4), dict(seq_len=128, split=True)])
def test_batches_are_the_planned_microbatches(budget):
    items = _items()
    got = {}
    for rank in range(3):
        planner = OnlinePlanner(dp=3, step_samples=40, **budget)
        loader = dataloader_for_stream(items, planner, rank=rank, world_size=3, check_ranks=False)
        for step in loader.steps():
            for batch in step:
                info = batch["info"]
                assert (info.step, info.rank) == (step.step, rank) and batch["step_loss_tokens"] == step.loss_tokens
                real = [items[i] for i in info.sample_ids.tolist()]
                if "cu_seqlens" in batch:
                    assert batch["input_ids"].shape == (info.batch_size, 128)
                    toks = batch["input_ids"].reshape(-1)[batch["segment_ids"].reshape(-1) > 0].tolist()
                    want = [t for item, s, n in zip(real, info.sample_starts, info.sample_lengths)
                            for t in item[s:s + n]]
                    assert toks == want
                else:
                    assert batch["input_ids"].shape == (info.batch_size, info.seqlen)
                    for row, item in zip(batch["input_ids"].tolist(), real):
                        assert row[:len(item)] == item
                got.setdefault(step.step, []).append((rank, info.micro, len(real)))
    for rows in got.values():
        counts = [sum(1 for r, _, _ in rows if r == rank) for rank in range(3)]
        assert len(set(counts)) == 1  # the same microbatches on every rank


def test_empty_microbatches_collate_to_one_padding_row():
    items = [[1, 2, 3], [4, 5]]
    for budget in (dict(max_tokens=64), dict(seq_len=16)):
        planner = OnlinePlanner(dp=2, step_samples=10, num_microbatches=2, **budget)
        batches = list(dataloader_for_stream(items, planner, rank=1, world_size=2, check_ranks=False))
        assert len(batches) == 2
        empty = [b for b in batches if b["num_samples"] == 0]
        assert empty and all(int(b["loss_mask"].sum()) == 0 and b["input_ids"].shape[0] == 1 for b in empty)


def test_loader_refusals():
    planner = OnlinePlanner(dp=2, max_tokens=256, step_samples=4)
    with pytest.raises(PlanError, match=r"^the OnlinePlanner plans for dp 2 ranks but this job has 3: make it with "
                                        r"dp=3$"):
        dataloader_for_stream([], planner, rank=0, world_size=3)
    loader = dataloader_for_stream(_items(10), planner, rank=0, world_size=2, check_ranks=False)
    next(iter(loader))
    other = dataloader_for_stream(_items(10), OnlinePlanner(dp=2, max_tokens=256, step_samples=4), rank=0,
                                  world_size=2)
    with pytest.raises(PlanError, match="needs resume='skip'"):
        other.load_state_dict(loader.state_dict())
    other = dataloader_for_stream(_items(10), OnlinePlanner(dp=2, max_tokens=256, step_samples=4), rank=1,
                                  world_size=2, resume="skip")
    with pytest.raises(PlanError, match="^the stream loader state is rank 0's; this is rank 1$"):
        other.load_state_dict(loader.state_dict())
