"""FSDP2 (torch.distributed.fsdp.fully_shard) on a plan, 2 processes on CPU (gloo): exact stream, LR,
first-step gradient (gathered from the shards) and a resume from a torch.distributed.checkpoint."""

import os

import pytest
import torch

pytest.importorskip("transformers")

from tests.integration_helpers import (  # noqa: E402
    assert_grads_close,
    check_lr,
    check_stream,
    load_example,
    logs,
    make_plan,
    reference_grads,
    small_dataset,
    tokens,
    torchrun,
)
from varlen_cli.loader import Plan  # noqa: E402


@pytest.mark.slow
def test_fsdp2_two_ranks_exact_stream_lr_gradient_and_resume(tmp_path):
    data = small_dataset(tmp_path)
    plan_path = make_plan(tmp_path, data, "padded", max_tokens=512, dp=2, grad_accum=2, epochs=2)
    plan = Plan.open(plan_path)
    save_at = plan.epoch_start(1) + 2  # mid-epoch 1
    common = ["--plan", plan_path, "--data", data, "--lr", "3e-3", "--warmup-steps", "2", "--ckpt", tmp_path / "ck"]
    # ranks under tests/launcher.py, checked against the real torchrun in tests/test_launcher.py
    torchrun("train_fsdp2.py", *common, "--save-at", save_at, "--log-dir", tmp_path / "full")
    full = logs(tmp_path / "full")
    check_stream(plan, full)
    check_lr(plan, full, 3e-3, load_example("tiny_lm").warmup_cosine(2, plan.num_steps))
    data_tokens = tokens(data)
    vocab = max(int(t.max()) for t in data_tokens) + 1
    model = load_example("train_hf_trainer").tiny_llama(vocab, max(t for _, t in plan.shapes))
    got = torch.load(os.path.join(tmp_path / "full", "grad0.pt"))
    assert_grads_close(got, reference_grads(model, plan, data_tokens))
    torchrun("train_fsdp2.py", *common, "--resume", "--log-dir", tmp_path / "resumed")
    k = save_at + 1
    for a, b in zip(full, logs(tmp_path / "resumed")):
        assert b["steps"] == a["steps"][k:] and b["lr"] == a["lr"][k:]
        assert b["micro"] == a["micro"][k * plan.grad_accum:]
