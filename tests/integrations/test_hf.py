"""Hugging Face Trainer on a plan (varlen_cli.integrations.hf.PlanTrainer): 2-process DDP on CPU,
exact stream/LR/gradient/resume, the padding-free packed path, and each silent failure of the plain
setup (issue 12) turned into a one-line PlanError."""

import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from tests.integration_helpers import (  # noqa: E402
    assert_grads_close,
    check_lr,
    check_stream,
    check_tracker_figures,
    hf_cosine,
    load_example,
    logs,
    make_plan,
    reference_grads,
    small_dataset,
    tokens,
    torchrun,
)
from varlen_cli.errors import PlanError  # noqa: E402
from varlen_cli.loader import PadCollate, Plan, VariableBatchSizeLR, dataloader_for_plan, to_model_inputs  # noqa: E402
from varlen_cli.loader.packed import PackedCollate  # noqa: E402


def _example():
    return load_example("train_hf_trainer")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    data = small_dataset(folder)
    padded = make_plan(folder, data, "padded", max_tokens=512, dp=2, grad_accum=2, epochs=2)
    packed = make_plan(folder, data, "packed", packing=True, seq_len=512, rows_per_microbatch=1, dp=2, grad_accum=2,
                       epochs=2)
    return folder, data, padded, packed


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_trainer_two_ranks_exact_stream_lr_gradient_and_resume(setup, kind):
    folder, data, padded, packed = setup
    plan_path = padded if kind == "padded" else packed
    plan = Plan.open(plan_path)
    assert plan.num_steps >= 6 and plan.epochs == 2
    save_at = plan.num_steps // 2 - 1  # mid-way through epoch 0 or 1
    out, log_dir = folder / f"out-{kind}", folder / f"log-{kind}"
    common = ["--plan", plan_path, "--data", data, "--lr", "3e-3", "--warmup-steps", "2", "--max-grad-norm", "0"]
    # ranks under tests/launcher.py (checked against the real torchrun in tests/test_launcher.py)
    torchrun("train_hf_trainer.py", *common, "--out", out, "--log-dir", log_dir, "--save-steps", save_at + 1,
             "--tensorboard", folder / f"tb-{kind}")
    full = logs(log_dir)
    check_stream(plan, full)
    # report_to=["tensorboard"]: the plan's figures of every step, at Trainer's global_step (step + 1)
    check_tracker_figures(plan_path, folder / f"tb-{kind}", "train/", 1, range(plan.num_steps))
    check_lr(plan, full, 3e-3, hf_cosine(2, plan.num_steps))
    # the first step's gradient (after DDP's all-reduce) equals the exact single-process mean over targets
    example = _example()
    data_tokens = tokens(data)
    vocab = max(int(t.max()) for t in data_tokens) + 1  # the example's TokenDataset.vocab_size
    model = example.tiny_llama(vocab, max(t for _, t in plan.shapes))
    want = reference_grads(model, plan, data_tokens, step=0)
    assert_grads_close(torch.load(os.path.join(log_dir, "grad0.pt")), want, rel=1e-5)
    if kind == "packed":  # resume is the same code path for both layouts; run it once (CI time)
        return
    # resume from Trainer's own mid-run checkpoint: the rest of the stream, LRs and losses, exactly
    resumed_out = folder / f"resumed-{kind}"
    shutil.copytree(out / f"checkpoint-{save_at + 1}", resumed_out / f"checkpoint-{save_at + 1}")
    torchrun("train_hf_trainer.py", *common, "--out", resumed_out, "--log-dir", folder / f"log2-{kind}", "--resume",
             "--tensorboard", folder / f"tb2-{kind}")
    resumed = logs(folder / f"log2-{kind}")
    k = save_at + 1
    check_tracker_figures(plan_path, folder / f"tb2-{kind}", "train/", 1, range(k, plan.num_steps))
    for a, b in zip(full, resumed):
        assert b["steps"] == a["steps"][k:]
        assert b["lr"] == a["lr"][k:]
        assert b["micro"] == a["micro"][k * plan.grad_accum:]  # positions, samples and losses, bit-identical


def test_packed_logits_equal_each_sample_alone(setup):
    """Padding-free Llama path: a packed row through to_model_inputs gives every sample the logits of
    its own forward (1e-5 fp32), in each style and attention implementation; varlen's 2D mask (the
    obvious call) does not."""
    _, data, _, packed = setup
    plan = Plan.open(packed)
    data_tokens = tokens(data)
    batch = next(iter(dataloader_for_plan(data_tokens, plan, rank=0, world_size=2)))
    info = batch["info"]
    assert len(info.sample_ids) >= 3
    example = _example()
    for attn, style in [("sdpa", "hf"), ("eager", "hf"), ("eager", "sdpa"), ("sdpa", "sdpa")]:
        model = example.tiny_llama(2000, 512, attn=attn).eval()
        with torch.no_grad():
            logits = model(**to_model_inputs(batch, style=style, labels=False)).logits
            col = np.zeros(info.batch_size, dtype=np.int64)
            for sid, ln, row in zip(info.sample_ids, info.sample_lengths, info.sample_rows):
                alone = model(input_ids=torch.as_tensor(data_tokens[sid])[None]).logits[0]
                got = logits[row, col[row]:col[row] + ln]
                assert torch.allclose(got, alone, atol=1e-5, rtol=1e-5), (attn, style, float((got - alone).abs().max()))
                col[row] += ln
            # the silent failure: the 2D mask the collate also returns makes samples attend to each other
            wrong = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits
            second = int(info.sample_lengths[0])
            sid = int(info.sample_ids[1])
            alone = model(input_ids=torch.as_tensor(data_tokens[sid])[None]).logits[0]
            assert not torch.allclose(wrong[0, second:second + len(data_tokens[sid])], alone, atol=1e-3)
    flash = to_model_inputs(batch, style="flash")
    assert flash["input_ids"].shape == (1, batch["input_ids"].numel()) and "attention_mask" not in flash
    assert flash["cu_seq_lens_q"].dtype == torch.int32 and flash["max_length_k"] == batch["max_seqlen"]
    assert not any(k in flash for k in ("info", "plan_position", "sample_ids", "num_tokens"))


def test_model_loss_with_num_items_is_the_exact_step_mean(setup):
    """HF's own causal-LM loss, fed to_model_inputs + num_items_in_batch from the plan, summed over
    the step's microbatches of both ranks, equals the exact mean over the step's targets; the
    obvious setup (pre-shifted labels shifted again, Trainer's token count) does not."""
    _, data, padded, packed = setup
    example = _example()
    data_tokens = tokens(data)
    for plan_path, collate in [(padded, PadCollate()), (padded, PadCollate(labels="unshifted")),
                               (packed, PackedCollate())]:
        plan = Plan.open(plan_path)
        model = example.tiny_llama(2000, 512).eval()
        total, hf_count = 0.0, 0
        batches = []
        for rank in range(2):
            loader = dataloader_for_plan(data_tokens, plan, rank=rank, world_size=2, collate_fn=collate)
            batches += [b for b, _ in zip(loader, range(plan.grad_accum))]
        with torch.no_grad():
            for b in batches:
                out = model(**to_model_inputs(b), num_items_in_batch=b["num_items_in_batch"])
                total += float(out.loss)
                hf_count += int((b["labels"][..., 1:] != -100).sum())  # what Trainer counts
            ids = [int(i) for mb in plan.step(0) for i in mb.sample_ids]
            targets = sum(len(data_tokens[i]) - 1 for i in ids)
            exact = sum(float(F.cross_entropy(model(input_ids=torch.as_tensor(data_tokens[i])[None]).logits[0, :-1],
                                              torch.as_tensor(data_tokens[i][1:]), reduction="sum")) for i in ids)
        assert batches[0]["num_items_in_batch"] == batches[0]["step_loss_tokens"] == targets
        assert total == pytest.approx(exact / targets, rel=1e-5)
        if collate.labels == "shifted" and plan_path == padded:
            # the obvious setup: Trainer counts labels[..., 1:] (off by one target per sample) and the
            # model shifts the pre-shifted labels again, training position t on token t + 2
            assert hf_count == targets - sum(len(mb.sample_ids) for mb in plan.step(0))
            b = batches[0]
            hf_targets = b["labels"][:, 1:-1]  # HF's target of position t is labels[t + 1]
            keep = hf_targets != -100
            assert keep.any() and torch.equal(hf_targets[keep], b["input_ids"][:, 2:][keep])
        else:
            assert hf_count == targets or plan_path == packed


# -- the silent failures of the plain setup, now one-line PlanErrors ------------------------------
def _args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[], disable_tqdm=True, **kw)


def test_trainer_refuses_other_grad_accum_steps_and_samplers(setup, tmp_path):
    from varlen_cli.integrations.hf import PlanTrainer

    _, data, padded, _ = setup
    model = _example().tiny_llama(2000, 512)
    with pytest.raises(PlanError, match=r"^gradient_accumulation_steps=3 but the plan was made with --grad-accum 2: "
                                        r"leave it at 1 \(PlanTrainer takes it from the plan\) or re-plan$"):
        PlanTrainer(plan=padded, model=model, args=_args(tmp_path, gradient_accumulation_steps=3),
                    train_dataset=tokens(data))
    with pytest.raises(PlanError, match=r"^max_steps=10000 but the plan ends at step \d+: re-plan with more --epochs$"):
        PlanTrainer(plan=padded, model=model, args=_args(tmp_path, max_steps=10000), train_dataset=tokens(data))
    with pytest.raises(PlanError, match=r"^train_sampling_strategy='group_by_length' with a plan: the plan already "
                                        r"makes and orders the batches; leave the Trainer's sampler at its default$"):
        PlanTrainer(plan=padded, model=model, args=_args(tmp_path, train_sampling_strategy="group_by_length"),
                    train_dataset=tokens(data))
    with pytest.raises(PlanError, match=r"^the plan was made for 2 data-parallel rank\(s\) but the Trainer runs 1 "
                                        r"process\(es\): re-plan with --dp 1, or launch 2 processes$"):
        PlanTrainer(plan=padded, model=model, args=_args(tmp_path), train_dataset=tokens(data))
    with pytest.raises(PlanError, match=r"^num_train_epochs=5 but the plan has 2 epoch\(s\): leave it out "
                                        r"\(PlanTrainer trains the plan's epochs\), pass 2, or stop early with "
                                        r"max_steps$"):
        PlanTrainer(plan=padded, model=model, args=_args(tmp_path, num_train_epochs=5), train_dataset=tokens(data))
    one = make_plan(tmp_path, data, "dp1", max_tokens=512, dp=1, grad_accum=2, epochs=2)
    trainer = PlanTrainer(plan=one, model=model, args=_args(tmp_path, num_train_epochs=2), train_dataset=tokens(data))
    assert trainer.args.gradient_accumulation_steps == 2


def test_checkpoint_of_another_plan_is_refused(setup, tmp_path):
    from varlen_cli.integrations.hf import load_plan_state, save_plan_state

    _, _, padded, packed = setup
    save_plan_state(str(tmp_path / "ck"), Plan.open(padded), {"epoch": 0, "step": 1, "micro": 0}, 1)
    assert load_plan_state(str(tmp_path / "ck"), Plan.open(padded))["global_step"] == 1
    with pytest.raises(PlanError, match=r"^\S+ck was saved with another plan \(\S+padded.parquet\); resume with the "
                                        r"same plan file$"):
        load_plan_state(str(tmp_path / "ck"), Plan.open(packed))
    with pytest.raises(PlanError, match=r"has no varlen_plan_state.json: it was not saved by a PlanTrainer"):
        load_plan_state(str(tmp_path), Plan.open(padded))


@pytest.mark.parametrize("kind, message", [
    ("fifo", r"^plan state \S+/varlen_plan_state\.json is a FIFO \(named pipe\), not a regular file$"),
    ("text", r"^cannot read \S+/varlen_plan_state\.json: Expecting value: line 1 column 1 \(char 0\)$"),
    ("list", r"^\S+/varlen_plan_state\.json is not a plan state \(a JSON object\)$"),
])
def test_a_bad_plan_state_is_one_line(setup, tmp_path, kind, message):
    """The checkpoint's plan state is read like every other input: a FIFO is refused (never read: it would
    block), a file that is not a JSON object is a PlanError, not an internal error."""
    from varlen_cli.integrations.hf import STATE_FILE, load_plan_state

    path = tmp_path / STATE_FILE
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text("not json" if kind == "text" else "[1, 2]")
    with pytest.raises(PlanError, match=message):
        load_plan_state(str(tmp_path), Plan.open(setup[2]))


def test_epoch_replay_and_grad_accum_mismatch_raise_before_the_wrong_step(setup):
    """Trainer's old behaviour, reproduced on the plain loader: set_epoch that misses the batch
    sampler replays epoch 0 under epoch 1's LR scales; an accumulation of 1 instead of 2 pairs the
    wrong micros. The ledger stops the replay at its first microbatch (nothing of it is trained),
    the LR pace the accumulation mismatch at the second step's first microbatch."""
    _, data, padded, _ = setup
    plan = Plan.open(padded)
    data_tokens = tokens(data)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    loader = dataloader_for_plan(data_tokens, plan, rank=0, world_size=2)
    sched = VariableBatchSizeLR(opt, plan)
    for batch in loader:  # epoch 0, stepped as the plan says
        if batch["info"].micro == plan.grad_accum - 1:
            sched.step()
    assert sched.step_index == plan.steps_per_epoch[0]
    with pytest.raises(PlanError, match=r"^desync: rank 0 is given \(epoch 0, step 0, rank 0, micro 0\), which this "
                                        r"job already trained: the plan is being replayed \(start the epoch loop at "
                                        r"the loader's epoch"):
        next(iter(loader))  # forgot set_epoch: the second pass is epoch 0 again

    loader = dataloader_for_plan(data_tokens, plan, rank=0, world_size=2)
    sched = VariableBatchSizeLR(opt, plan)
    batches = iter(loader)
    first = next(batches)
    assert first["info"].micro == 0
    with pytest.raises(PlanError, match=r"^desync: optimizer step 0 \(epoch 0\) needs micros 0\.\.1 of rank 0 but the "
                                        r"trainer consumed 1 microbatch\(es\): \(epoch 0, step 0, rank 0, micro 0\)"):
        sched.step()  # stepping after every microbatch (gradient_accumulation_steps=1)
