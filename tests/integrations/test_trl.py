"""The real TRL ``SFTTrainer`` through ``PlanTrainerMixin`` (examples/train_trl.py), 2 processes on CPU
(gloo): each rank's stream is the plan's, every sample once per epoch, the LR is TRL's schedule x the
plan's lr_scale, the first step's gradient is the exact single-process mean over the step's targets,
and a resume from TRL's own checkpoint reproduces the uninterrupted run bit for bit."""

import os
import shutil

import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from tests.integration_helpers import (  # noqa: E402
    assert_grads_close,
    check_lr,
    check_stream,
    hf_cosine,
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
def test_sft_trainer_two_ranks_exact_stream_lr_gradient_and_resume(tmp_path):
    data = small_dataset(tmp_path)
    plan = Plan.open(make_plan(tmp_path, data, "padded", max_tokens=512, dp=2, grad_accum=2, epochs=2))
    save_at = plan.epoch_start(1) + 1  # inside epoch 1
    common = ["--plan", plan.path, "--data", data, "--lr", "3e-3", "--warmup-steps", "2"]
    torchrun("train_trl.py", *common, "--out", tmp_path / "out", "--log-dir", tmp_path / "full",
             "--save-steps", save_at)  # tests/launcher.py, checked against the real torchrun (tests/test_launcher.py)
    full = logs(tmp_path / "full")
    check_stream(plan, full)
    check_lr(plan, full, 3e-3, hf_cosine(2, plan.num_steps))
    data_tokens = tokens(data)
    vocab = int(max(ids.max() for ids in pq.read_table(data).column("input_ids").to_numpy(zero_copy_only=False))) + 1
    model = load_example("train_hf_trainer").tiny_llama(vocab, max(t for _, t in plan.shapes))
    assert_grads_close(torch.load(os.path.join(tmp_path / "full", "grad0.pt")),
                       reference_grads(model, plan, data_tokens, step=0))
    resumed_out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "out" / f"checkpoint-{save_at}", resumed_out / f"checkpoint-{save_at}")
    torchrun("train_trl.py", *common, "--out", resumed_out, "--log-dir", tmp_path / "rest", "--resume")
    for a, b in zip(full, logs(tmp_path / "rest")):
        assert b["steps"] == a["steps"][save_at:] and b["lr"] == a["lr"][save_at:]
        assert b["micro"] == a["micro"][save_at * plan.grad_accum:]  # positions, samples and losses


@pytest.mark.parametrize("option, message", [
    ("packing", r"^SFTConfig\(packing=True\) with a plan: the plan makes the batches, so TRL's packing would be "
                r"ignored; pack with `varlen plan --packing --seq-len T` \(PlanTrainer trains the packed rows\) and "
                r"leave packing=False$"),
    ("padding_free", r"^SFTConfig\(padding_free=True\) with a plan: PlanTrainer collates the plan's batches itself, "
                     r"so TRL's padding-free collation would be ignored; a plan made with `varlen plan --packing` is "
                     r"padding-free: leave padding_free=False$"),
])
def test_trls_own_batching_options_are_refused(tmp_path, option, message):
    """They were silently ignored under the plan trainer (the plan makes the batches)."""
    from trl import SFTConfig, SFTTrainer

    from varlen_cli.errors import PlanError
    from varlen_cli.integrations.hf import PlanTrainerMixin

    class PlanSFTTrainer(PlanTrainerMixin, SFTTrainer):
        pass

    data = small_dataset(tmp_path)
    plan = make_plan(tmp_path, data, "padded", max_tokens=512)
    args = SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_length=None, **{option: True})
    with pytest.raises(PlanError, match=message):
        PlanSFTTrainer(plan=plan, model=torch.nn.Linear(2, 2), args=args, train_dataset=tokens(data))
