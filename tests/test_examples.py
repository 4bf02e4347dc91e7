"""examples/train_tiny_lm.py end to end: 2-process DDP on CPU (gloo), resume, torch.compile."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.launcher import launch
from tests.loader_helpers import ROOT, real_plan, token_lengths, write_plan
from varlen_cli.loader import Plan

SCRIPT = os.path.join(ROOT, "examples", "train_tiny_lm.py")


def _tiny_lm():
    spec = importlib.util.spec_from_file_location("tiny_lm", os.path.join(ROOT, "examples", "tiny_lm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan(tmp_path, **options):
    """A plan of sample_data/tokenized.parquet by the real planner (or the test planner until it exists)."""
    path = real_plan(tmp_path, **options)
    if path is None:
        path = str(tmp_path / "plan.parquet")
        write_plan(path, token_lengths(), **options)
    return path


def _run(*args, timeout=180):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _logs(log_dir, world):
    return [json.load(open(os.path.join(log_dir, f"rank-{r}.json"))) for r in range(world)]


@pytest.mark.slow
def test_ddp_two_ranks_exactly_once_lr_and_resume(tmp_path):
    plan_path = _plan(tmp_path, max_tokens=2048, dp=2, grad_accum=2)
    plan = Plan.open(plan_path)
    assert plan.num_steps >= 6
    save_at = plan.num_steps // 2 - 1
    ckpt = str(tmp_path / "state.pt")
    small = ["--d-model", "32", "--layers", "1"]
    out = _run("--plan", plan_path, "--nproc", "2", "--lr", "0.01", "--log-dir", str(tmp_path / "full"),
               "--save-state", ckpt, "--save-at", str(save_at), *small)
    assert "tokens/s" in out and "padding" in out
    full = _logs(tmp_path / "full", 2)
    # both ranks ran every step of the plan
    assert full[0]["steps"] == full[1]["steps"] == list(range(plan.num_steps))
    # across ranks, every sample of the epoch exactly once (nothing dropped here)
    ids = [i for log in full for step in log["samples"] for i in step]
    dropped = set(plan.dropped.get("sample_ids", []))
    assert sorted(ids) == sorted(set(range(2000)) - dropped) and not dropped
    # each step's LR is the base schedule's LR times the plan's lr_scale
    factor = _tiny_lm().warmup_cosine(2, plan.num_steps)
    scales = plan.lr_scales()
    for log in full:
        assert np.allclose(log["lr_scale"], scales)
        assert np.allclose(log["unscaled_lr"], [0.01 * factor(s) for s in log["steps"]], rtol=1e-12)
        assert np.allclose(log["lr"], np.array(log["unscaled_lr"]) * scales, rtol=1e-12)
    assert len(set(scales.round(6))) > 1  # the plan's batch sizes vary, so the scale does
    # resume from the mid-epoch checkpoint: the rest of the stream, LRs and losses, exactly
    # (the full run above used the script's own --nproc launcher; the resume runs its 2 ranks under
    # tests/launcher.py, as torchrun starts them)
    proc = launch(SCRIPT, "--plan", plan_path, "--lr", "0.01", "--log-dir", str(tmp_path / "resumed"), "--resume", ckpt,
                  *small, imports=("torch.nn.parallel",), timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    resumed = _logs(tmp_path / "resumed", 2)
    for a, b in zip(full, resumed):
        k = save_at + 1
        assert b["steps"] == a["steps"][k:]
        assert b["samples"] == a["samples"][k:]
        assert b["lr"] == a["lr"][k:]
        assert b["loss"] == a["loss"][k:]  # same model, optimizer and data: bit-identical on CPU


@pytest.mark.slow
def test_compile_static_shapes_no_recompiles_after_warmup(tmp_path):
    """torch.compile(dynamic=False) on a --static-shapes --compile-warmup plan with 3 shapes.

    Uses the aot_eager backend: it exercises dynamo's graph capture, guards and recompilation
    exactly like inductor, without inductor's C++ code generation (20+ s per graph on 2 cores).
    """
    plan_path = _plan(tmp_path, max_tokens=2048, dp=1, grad_accum=2, static_shapes=True, num_shapes=3,
                      compile_warmup=True)
    plan = Plan.open(plan_path)
    assert plan.static_shapes and len(plan.shapes) <= 3 and plan.warmup_steps >= 1
    out = _run("--plan", plan_path, "--compile", "--compile-backend", "aot_eager", "--d-model", "32", "--layers", "1",
               "--max-steps", str(plan.warmup_steps + 4), "--log-dir", str(tmp_path / "log"))
    log = _logs(tmp_path / "log", 1)[0]
    assert log["compiles_after_warmup"] == 0
    assert log["compiled_shapes"] == len(plan.shapes) == log["compiles"]
    assert sorted(map(tuple, log["shapes"])) == sorted(plan.shapes)
    assert "compiled shapes" in out and "0 after the" in out


def test_tiny_lm_packed_forward_equals_unpacked():
    """The example model on a packed row (block-diagonal mask, restarting positions) gives each
    sample exactly the logits of its own unpadded forward: no cross-contamination."""
    import torch

    from varlen_cli.loader.packed import block_causal_mask

    tiny = _tiny_lm()
    torch.manual_seed(0)
    model = tiny.TinyGPT(50, 16, d_model=32, n_layers=2, n_heads=4).eval()
    a, b = torch.randint(0, 50, (5,)), torch.randint(0, 50, (7,))
    row = torch.cat([a, b, torch.zeros(4, dtype=torch.long)])[None]
    segments = torch.tensor([[1] * 5 + [2] * 7 + [0] * 4])
    positions = torch.tensor([list(range(5)) + list(range(7)) + list(range(4))])
    with torch.no_grad():
        packed = model(row, segments != 0, positions, block_causal_mask(segments))
        alone_a = model(a[None], torch.ones(1, 5, dtype=torch.bool))
        alone_b = model(b[None], torch.ones(1, 7, dtype=torch.bool))
    assert torch.allclose(packed[0, :5], alone_a[0], atol=1e-5)
    assert torch.allclose(packed[0, 5:12], alone_b[0], atol=1e-5)


def test_a_replanned_plan_without_the_parents_checkpoint_is_refused(tmp_path, monkeypatch):
    """`varlen replan --from-step 2` then train_tiny_lm.py without --resume trained a fresh model on the
    rest of the data, exit 0: the loader refuses it before the first batch."""
    import re

    from varlen_cli.loader import PlanError
    from varlen_cli.plan.replan import ReplanConfig, replan

    parent = _plan(tmp_path, max_tokens=2048, dp=1, grad_accum=2)
    child = str(tmp_path / "child.parquet")
    replan(ReplanConfig(plan=parent, output=child, dp=1, from_step=2, progress=False))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    spec = importlib.util.spec_from_file_location("train_tiny_lm", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with pytest.raises(PlanError, match="^" + re.escape(
            f"{child} continues a job from its global step 2 (made by `varlen replan` from step 2 of its parent), but "
            f"this loader starts fresh: load the checkpoint the plan was made from (loader.load_state_dict(its loader "
            f"state)) before iterating, or a new model trains on the rest of the data only") + "$"):
        example.train(example.parse_args(["--plan", child, "--d-model", "16", "--layers", "1"]))


SEQ2SEQ = os.path.join(ROOT, "examples", "train_seq2seq.py")


@pytest.mark.slow
def test_seq2seq_two_ranks_exact_stream_target_padding_lr_and_loss(tmp_path):
    """examples/train_seq2seq.py on a two-budget plan (issue 36), 2 gloo ranks: each rank runs exactly its
    plan rows in order, every pair once; the encoder side is B x seqlen, the decoder inputs and labels
    B x target_seqlen; each microbatch's loss targets are its targets' tokens and each step's the plan's
    step_loss_tokens (the sum of its target_length), which lr_scale follows (--lr-scale-by tokens)."""
    from typer.testing import CliRunner

    from varlen_cli.cli import app

    spec = importlib.util.spec_from_file_location("train_seq2seq", SEQ2SEQ)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    data, metrics, plan_path = str(tmp_path / "pairs.parquet"), str(tmp_path / "m"), str(tmp_path / "plan.parquet")
    example.make_data(data, n=240)
    runner = CliRunner()
    for args in (["analyze", data, "-o", metrics, "--length", "list:input_ids", "--target-length", "list:labels"],
                 ["plan", metrics, "-o", plan_path, "--max-tokens", "384", "--max-target-tokens", "256", "--dp", "2",
                  "--grad-accum", "2", "--lr-scale-by", "tokens", "--pad-multiple", "8"]):
        result = runner.invoke(app, [*args, "--no-progress"])
        assert result.exit_code == 0, result.output
    proc = launch(SEQ2SEQ, "--plan", plan_path, "--data", data, "--log-dir", str(tmp_path / "log"),
                  imports=("torch.nn.parallel",), timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan, logs = Plan.open(plan_path), _logs(tmp_path / "log", 2)
    targets = [len(r["labels"]) for r in example.PairDataset(data).rows]
    base = plan.meta["base_batch_size"]
    for rank, log in enumerate(logs):
        rows = list(plan.microbatches(rank))
        assert [mb["ids"][:row.num_samples] for mb, row in zip(log["microbatches"], rows)] == \
            [row.sample_ids.tolist() for row in rows] and len(log["microbatches"]) == len(rows)
        for mb, row in zip(log["microbatches"], rows):
            assert mb["encoder_shape"] == [row.batch_size, row.seqlen]
            assert mb["decoder_shape"] == mb["labels_shape"] == [row.batch_size, row.target_seqlen]
            assert max(targets[i] for i in row.sample_ids) <= row.target_seqlen
            assert row.target_seqlen * row.batch_size <= 256 and row.seqlen * row.batch_size <= 384
            assert mb["loss_tokens"] == sum(targets[i] for i in row.sample_ids)
        steps = {row.step: row for row in rows}
        for step, ids, lr, scale in zip(log["steps"], log["samples"], log["lr"], log["lr_scale"]):
            step_ids = [i for row in plan.step(step) for i in row.sample_ids]
            assert ids == [i for row in plan.step(step) if row.rank == rank for i in row.sample_ids]
            assert steps[step].step_loss_tokens == sum(targets[i] for i in step_ids)
            assert scale == pytest.approx(steps[step].step_loss_tokens / base)
            assert lr == pytest.approx(3e-3 * scale)
    seen = [i for log in logs for step in log["samples"] for i in step]
    assert sorted(seen) == list(range(240))
    loss = np.add(logs[0]["loss"], logs[1]["loss"])  # each step's mean target-token loss, over both ranks
    assert loss[-1] < loss[0]  # it learns
RL_SCRIPT = os.path.join(ROOT, "examples", "train_rl_stream.py")


def _rl_logs(log_dir, world):
    return [json.load(open(os.path.join(log_dir, f"rank-{r}.json"))) for r in range(world)]


def _check_rl(logs, world, base_lr=0.5):
    for it in range(len(logs[0])):
        rows = [log[it] for log in logs]
        trained = sorted(i for row in rows for i in row["ids"])
        assert trained == list(range(rows[0]["buffer"]))  # every rollout of the iteration once, over the ranks
        assert len({row["microbatches"] for row in rows}) == 1  # the same microbatch count on every rank
        owner = {}
        for r, row in enumerate(rows):
            for g in row["groups"]:
                owner.setdefault(g, set()).add(r)
        assert all(len(ranks) == 1 for ranks in owner.values())  # a GRPO group never split (one microbatch)
        assert rows[0]["lr"] != base_lr and all(np.isfinite(row["loss"]) for row in rows)


@pytest.mark.slow
def test_rl_stream_two_ranks(tmp_path):
    """examples/train_rl_stream.py on 2 gloo ranks (as torchrun starts them): each rank generates its
    own rollouts, they are gathered and planned with plan_step on every rank, trained under DDP."""
    proc = launch(RL_SCRIPT, "--iterations", "3", "--log-dir", str(tmp_path / "padded"),
                  imports=("torch.nn.parallel",), timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "microbatch(es) a rank" in proc.stdout
    _check_rl(_rl_logs(tmp_path / "padded", 2), 2)


def test_rl_stream_packed_one_process(tmp_path):
    spec = importlib.util.spec_from_file_location("train_rl_stream", RL_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    logs = module.train(module.parse_args(["--iterations", "2", "--seq-len", "256", "--log-dir", str(tmp_path)]))
    _check_rl([logs], 1)
