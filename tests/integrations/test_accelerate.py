"""accelerate on a plan (varlen_cli.integrations.accelerate): 2-process loop on CPU (gloo) with exact
stream, LR, first-step gradient and save_state/load_state resume; accelerator.prepare(loader) stops
with a one-line PlanError."""

import os

import pytest
import torch

pytest.importorskip("accelerate")
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
from varlen_cli.errors import PlanError  # noqa: E402
from varlen_cli.integrations.accelerate import prepare_plan_dataloader  # noqa: E402
from varlen_cli.loader import Plan, dataloader_for_plan  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("acc")
    data = small_dataset(folder)
    return folder, data, make_plan(folder, data, "padded", max_tokens=512, dp=2, grad_accum=2, epochs=2)


@pytest.mark.slow
def test_accelerate_two_ranks_exact_stream_lr_gradient_and_resume(setup):
    folder, data, plan_path = setup
    plan = Plan.open(plan_path)
    save_at = plan.num_steps // 2 - 1
    common = ["--plan", plan_path, "--data", data, "--lr", "3e-3", "--warmup-steps", "2", "--ckpt", folder / "ckpt"]
    # ranks under tests/launcher.py, checked against the real torchrun in tests/test_launcher.py
    torchrun("train_accelerate.py", *common, "--save-at", save_at, "--log-dir", folder / "full")
    full = logs(folder / "full")
    check_stream(plan, full)
    tiny_lm = load_example("tiny_lm")
    check_lr(plan, full, 3e-3, tiny_lm.warmup_cosine(2, plan.num_steps))
    data_tokens = tokens(data)
    vocab = max(int(t.max()) for t in data_tokens) + 1
    model = load_example("train_hf_trainer").tiny_llama(vocab, max(t for _, t in plan.shapes))
    assert_grads_close(torch.load(os.path.join(folder / "full", "grad0.pt")), reference_grads(model, plan, data_tokens))
    torchrun("train_accelerate.py", *common, "--resume", "--log-dir", folder / "resumed")
    resumed = logs(folder / "resumed")
    k = save_at + 1
    for a, b in zip(full, resumed):
        assert b["steps"] == a["steps"][k:] and b["lr"] == a["lr"][k:]
        assert b["micro"] == a["micro"][k * plan.grad_accum:]  # positions, samples, losses: bit-identical


@pytest.mark.slow
def test_accelerator_prepare_of_the_loader_is_refused_in_one_line(setup):
    """The usual accelerate habit, prepare(loader), re-sharded the per-rank stream (rank 0 would get
    micros 0, 2, ..., rank 1 micros 1, 3, ...) into a plain DataLoader (`loader.epoch`: AttributeError):
    refused by the real accelerate's prepare(), naming prepare_plan_dataloader."""
    from accelerate import Accelerator

    folder, data, plan_path = setup
    one = make_plan(folder, data, "dp1", max_tokens=512, dp=1, grad_accum=2)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    loader = dataloader_for_plan(tokens(data), one, rank=0, world_size=1)
    with pytest.raises(PlanError, match=r"^accelerator\.prepare\(loader\) would re-shard the plan's per-rank "
                                        r"loader: use varlen_cli\.integrations\.accelerate\.prepare_plan_dataloader"
                                        r"\(accelerator, loader\) for it \(and prepare the model and optimizer as "
                                        r"usual\)$"):
        accelerator.prepare(torch.nn.Linear(2, 2), loader)
    assert prepare_plan_dataloader(accelerator, loader).epoch == 0  # the way that works


def test_prepare_plan_dataloader_checks(setup, tmp_path):
    from accelerate import Accelerator

    from varlen_cli.integrations.accelerate import plan_loss, prepare_plan_dataloader

    folder, data, plan_path = setup
    one = make_plan(folder, data, "dp1", max_tokens=512, dp=1, grad_accum=2)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    loader = dataloader_for_plan(tokens(data), one, rank=0, world_size=1)
    with pytest.raises(PlanError, match=r"^Accelerator\(gradient_accumulation_steps=3\) but the plan was made with "
                                        r"--grad-accum 2: pass gradient_accumulation_steps=2$"):
        prepare_plan_dataloader(accelerator, loader)
    with pytest.raises(PlanError, match=r"^the plan was made for 2 data-parallel rank\(s\) but the world size is 1"):
        prepare_plan_dataloader(accelerator, dataloader_for_plan(tokens(data), plan_path, rank=0, world_size=2))
    with pytest.raises(PlanError, match="takes the loader made by varlen_cli.loader.dataloader_for_plan"):
        prepare_plan_dataloader(accelerator, torch.utils.data.DataLoader([1, 2]))
    accelerator.gradient_accumulation_steps = 2
    wrapped = prepare_plan_dataloader(accelerator, loader)
    batch = next(iter(wrapped))
    # accelerate's backward divides by 2: the factor puts it back and divides by the step's targets
    factor = float(plan_loss(torch.tensor(10.0), batch, accelerator))
    assert factor == pytest.approx(10.0 * 2 / batch["step_loss_tokens"])
    assert wrapped.state_dict()["micro"] == 1  # after the consumed microbatch


def test_a_scheduler_stepped_twice_per_optimizer_step_is_refused(setup):
    """accelerator.prepare(scheduler) steps it once per process per optimizer step (the LR schedule
    would run world-size times too fast): the second step() of a step finds no microbatch consumed."""
    from varlen_cli.loader import VariableBatchSizeLR

    folder, data, plan_path = setup
    plan = Plan.open(plan_path)
    loader = dataloader_for_plan(tokens(data), plan, rank=0, world_size=2)
    scheduler = VariableBatchSizeLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), plan)
    batches = iter(loader)
    for _ in range(plan.grad_accum):
        next(batches)
    scheduler.step()
    with pytest.raises(PlanError, match=r"^desync: VariableBatchSizeLR\.step\(\) is called for optimizer step 1 but "
                                        r"none of that step's microbatches was consumed: the scheduler is stepped more "
                                        r"than once per optimizer step \(do not accelerator\.prepare\(\) it"):
        scheduler.step()
