"""DeepSpeed on a plan (varlen_cli.integrations.deepspeed), with the real engine: CPU, gloo, 2 processes.

One 2-rank launch (tests/integrations/deepspeed_runs.py) trains the plan under ZeRO 0, 1, 2 and 3,
resumes ZeRO-2 and ZeRO-3 from DeepSpeed's own mid-epoch checkpoints, overflows one bf16 step (under
the engine and under PlanTrainer), runs a 2-stage pipeline and collects the refusals; the tests below
check what each run did against the plan and against single-process references. A 3-rank launch
continues the ZeRO-0 job on a plan made by ``varlen replan --dp 3``; Hugging Face's Trainer runs with a
ZeRO-2 config through PlanTrainer (full run and resume).
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("deepspeed", reason="deepspeed is not installed: pip install 'varlen-cli[deepspeed]' (.ci/run "
                                        "installs it, and CI fails if it cannot)")
pytest.importorskip("transformers")

from tests.integration_helpers import (  # noqa: E402
    EXAMPLES,
    IMPORTS,
    NUM_SAMPLES,
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
from tests.launcher import launch  # noqa: E402
from varlen_cli.loader import Plan  # noqa: E402
from varlen_cli.loader.replan import first_step  # noqa: E402

RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_runs.py")
PRELOAD = ("transformers.models.llama.modeling_llama", "torch._dynamo", "deepspeed", "deepspeed.pipe",
           "varlen_cli.integrations.deepspeed")
LR, WARMUP = 3e-3, 2
SAVE_AT = {0: 3, 2: 6, 3: 6, "pipe": 4}  # deepspeed_runs.py's checkpoints (after this global step)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """The plans, and every run of deepspeed_runs.py (one 2-rank launch)."""
    folder = tmp_path_factory.mktemp("ds")
    data = small_dataset(folder)
    common = dict(max_tokens=512, grad_accum=2, lr_scaling="linear")
    plans = {"padded": make_plan(folder, data, "padded", dp=2, epochs=2, **common),
             "other": make_plan(folder, data, "other", dp=2, epochs=2, seed=1, **common),
             "pipe": make_plan(folder, data, "pipe", dp=1, same_shape_per_step=True, **common),
             "pipebad": make_plan(folder, data, "pipebad", dp=1, **common)}
    os.makedirs(folder / "empty")
    proc = launch(RUNS, folder, data, imports=PRELOAD, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return folder, data, {name: Plan.open(path) for name, path in plans.items()}


@pytest.fixture(scope="module")
def reference(ds):
    """The first step's exact gradient (single process, each sample alone) and the model's vocabulary."""
    _, data, plans = ds
    data_tokens = tokens(data)
    vocab = max(int(t.max()) for t in data_tokens) + 1
    model = load_example("train_hf_trainer").tiny_llama(vocab, max(t for _, t in plans["padded"].shapes))
    return reference_grads(model, plans["padded"], data_tokens), vocab


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_trains_the_plan_exactly(ds, reference, stage):
    """Each rank trains exactly its plan rows, at LR = base x lr_scale every step, and the first step's
    gradient (after DeepSpeed's reduction) is the single-process exact mean over the step's targets."""
    folder, _, plans = ds
    plan = plans["padded"]
    run = logs(folder / f"z{stage}")
    check_stream(plan, run)
    check_lr(plan, run, LR, load_example("tiny_lm").warmup_cosine(WARMUP, plan.num_steps))
    assert all(all(r["applied"]) for r in run)
    assert_grads_close(torch.load(folder / f"z{stage}" / "grad0.pt"), reference[0], rel=1e-5)
    zero0 = [m["loss"] for m in logs(folder / "z0")[0]["micro"]]
    assert np.allclose([m["loss"] for m in run[0]["micro"]], zero0, rtol=1e-5)  # the same training in every stage


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_from_deepspeeds_checkpoint_is_bit_exact(ds, stage):
    """A fresh engine loads DeepSpeed's mid-epoch checkpoint: the rest of the stream, LRs and losses are the
    uninterrupted run's, bit for bit."""
    folder, _, plans = ds
    plan = plans["padded"]
    k = SAVE_AT[stage] + 1
    assert 0 < k < plan.steps_per_epoch[0]  # mid-epoch
    for full, resumed in zip(logs(folder / f"z{stage}"), logs(folder / f"z{stage}-resumed")):
        assert resumed["steps"] == full["steps"][k:]
        assert resumed["lr"] == full["lr"][k:]
        assert resumed["micro"] == full["micro"][k * plan.grad_accum:]
    if stage == 2:  # DeepSpeed's TensorBoard monitor got the plan's figures of every step, at global_steps
        check_tracker_figures(plan.path, folder / "tb-z2" / "varlen", "", 1, range(plan.num_steps))
        check_tracker_figures(plan.path, folder / "tb-z2-resumed" / "varlen", "", 1, range(k, plan.num_steps))


@pytest.mark.slow
def test_a_skipped_update_keeps_the_lr_on_the_plan(ds):
    """bf16 ZeRO-2: step 1's gradient overflows, DeepSpeed skips that update and does not step the
    scheduler; the plan's scheduler steps anyway, so every later step still runs at base x its lr_scale."""
    folder, _, plans = ds
    plan = plans["padded"]
    factor = load_example("tiny_lm").warmup_cosine(WARMUP, plan.num_steps)
    for run in logs(folder / "bf16"):
        assert run["steps"] == [0, 1, 2, 3] and run["applied"] == [True, False, True, True]
        want = [LR * factor(s) * plan.lr_scales()[s] for s in run["steps"]]
        assert np.allclose(run["lr"], want, rtol=1e-9)


@pytest.mark.slow
def test_plan_trainer_under_deepspeed_keeps_the_lr_on_the_plan_across_a_skipped_update(ds):
    """PlanTrainer, bf16 ZeRO-2 config, step 1 overflowing: Trainer steps no scheduler after the skipped
    update, PlanTrainer's plan scheduler steps anyway (else step 2 would run at step 1's lr_scale, or,
    with 2 micros a step, stop with a desync)."""
    folder, _, plans = ds
    plan = plans["padded"]
    for run in logs(folder / "hf-bf16"):
        assert run["steps"] == [0, 1, 2, 3] and run["skipped"] == [False, True, False, False]
        assert np.allclose(run["lr"], [LR * plan.lr_scales()[s] for s in range(4)], rtol=1e-9)


@pytest.mark.slow
def test_pipeline_engine_two_stages_same_shape_plan(ds, reference):
    """2 stages (data-parallel size 1): the first stage is fed its plan rows in order, the LR follows the
    plan, the first step's loss is the exact mean over its targets, and the shape changes between steps
    (p2p buffers re-sized) run through; a resume from the pipeline's checkpoint continues exactly."""
    folder, data, plans = ds
    plan = plans["pipe"]
    shapes = {mb.shape for s in range(plan.num_steps) for mb in plan.step(s)}
    assert len(shapes) > 1 and all(len({mb.shape for mb in plan.step(s)}) == 1 for s in range(plan.num_steps))
    first, last = logs(folder / "pipe")
    check_stream(plan, [first])
    assert last["micro"] == first["micro"]  # the last stage loads the same microbatches (for their labels)
    check_lr(plan, [first, last], LR, load_example("tiny_lm").warmup_cosine(WARMUP, plan.num_steps))
    data_tokens = tokens(data)
    model = torch.nn.Sequential(*load_example("train_deepspeed").pipe_layers(reference[1],
                                                                             max(t for _, t in plan.shapes)))
    ids = [int(i) for mb in plan.step(0) for i in mb.sample_ids]
    with torch.no_grad():
        total = sum(float(F.cross_entropy(model(torch.as_tensor(data_tokens[i])[None])[0, :-1],
                                          torch.as_tensor(data_tokens[i][1:]), reduction="sum")) for i in ids)
    assert first["loss"][0] == pytest.approx(total / sum(len(data_tokens[i]) - 1 for i in ids), rel=1e-5)
    k = SAVE_AT["pipe"] + 1
    for full, resumed in zip((first, last), logs(folder / "pipe-resumed")):
        assert resumed["steps"] == full["steps"][k:] and resumed["loss"] == full["loss"][k:]
        assert resumed["micro"] == full["micro"][k * plan.grad_accum:]


@pytest.mark.slow
def test_refusals_are_one_line(ds):
    folder, _, plans = ds
    found = json.load(open(folder / "refusals.json"))
    training_data = ("deepspeed.initialize(training_data=...) wraps the dataset in DeepSpeed's own loader, whose "
                     "DistributedSampler re-shards it across the ranks: its batches are not the plan's. Pass the "
                     "dataset to varlen_cli.integrations.deepspeed.initialize(plan, dataset, ...) and train on the "
                     "loader it returns")
    pipebad = plans["pipebad"]
    step = next(s for s in range(pipebad.num_steps) if len({mb.shape for mb in pipebad.step(s)}) > 1)
    seen = ", ".join(sorted({f"{b}x{t}" for b, t in (mb.shape for mb in pipebad.step(step))}))
    assert found == {
        "training_data": training_data,
        "engine_with_training_data": training_data,
        "grad_accum": "the DeepSpeed config has gradient_accumulation_steps=3 but the plan was made with --grad-accum "
                      "2: leave it out (varlen sets it from the plan) or re-plan",
        "implied_grad_accum": "the DeepSpeed config has train_batch_size=64 and train_micro_batch_size_per_gpu=4, "
                              "which make 8 accumulation steps on 2 data-parallel ranks, but the plan was made with "
                              "--grad-accum 2: leave them out (varlen sets them from the plan)",
        "other_plan": f"rank 1 trains another plan ({plans['other'].path}: {plans['other'].num_steps} steps x "
                      f"grad_accum 2) than rank 0 ({plans['padded'].path}: {plans['padded'].num_steps} steps x "
                      f"grad_accum 2): every rank must train the same plan (unequal microbatch counts per step hang "
                      f"ZeRO 2/3 and pipelines)",
        "no_checkpoint": f"no DeepSpeed checkpoint in {folder / 'empty'}: nothing to resume from",
        "pipe_shapes": f"the plan's microbatch shapes differ inside a step (step {step}, rank 0: {seen}) and "
                       f"DeepSpeed's pipeline engine keeps its p2p buffers from the first send: re-plan with "
                       f"--same-shape-per-step, or build the PipelineModule with dynamic_shape=True",
    }


def test_the_config_takes_the_plans_batch_settings(tmp_path):
    """gradient_accumulation_steps and the micro batch size come from the plan: DeepSpeed's micro batch size
    only counts samples, so a variable plan's mean replaces a given value; a plan of one batch size refuses
    another, as do settings that imply another accumulation; DeepSpeed's own data sampling is refused."""
    from varlen_cli.errors import PlanError
    from varlen_cli.integrations.deepspeed.config import engine_config

    data = small_dataset(tmp_path)
    variable = Plan.open(make_plan(tmp_path, data, "variable", max_tokens=512, dp=2, grad_accum=2, lr_scaling="none"))
    fixed = Plan.open(make_plan(tmp_path, data, "fixed", max_tokens=2048, dp=2, grad_accum=2, lr_scaling="none",
                                static_shapes=True, num_shapes=1))
    mean = round(sum(mb.num_samples for r in range(2) for mb in variable.microbatches(r)) / variable.num_microbatches)
    base = {"zero_optimization": {"stage": 2}}
    got = engine_config({**base, "train_micro_batch_size_per_gpu": 1, "train_batch_size": "auto"}, variable)
    assert got == {**base, "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": mean}
    b = fixed.microbatch(0, 0, 0).batch_size
    assert engine_config({**base, "train_micro_batch_size_per_gpu": b}, fixed)["train_micro_batch_size_per_gpu"] == b
    with pytest.raises(PlanError, match=rf"^the DeepSpeed config has train_micro_batch_size_per_gpu={b + 1} but every "
                                        rf"microbatch of the plan holds {b} \(padded\) samples: leave it out or set "
                                        r'"auto"$'):
        engine_config({**base, "train_micro_batch_size_per_gpu": b + 1}, fixed)
    with pytest.raises(PlanError, match=r"^the DeepSpeed config has gradient_accumulation_steps='2': give a positive "
                                        r'integer, "auto", or leave it out$'):
        engine_config({**base, "gradient_accumulation_steps": "2"}, variable)
    with pytest.raises(PlanError, match=r"^the DeepSpeed config enables data_efficiency: DeepSpeed would sample and "
                                        r"batch the data itself"):
        engine_config({**base, "data_efficiency": {"enabled": True}}, variable)
    with pytest.raises(PlanError, match=r"^the DeepSpeed config has ZeRO stage 2 but DeepSpeed's pipeline engine runs "
                                        r"ZeRO stage 0 or 1 only$"):
        engine_config(base, variable, pipe=True)


@pytest.mark.slow
def test_elastic_restart_from_deepspeeds_checkpoint_on_three_ranks(ds, tmp_path):
    """The ZeRO-0 job checkpointed at step n continues on 3 ranks on `varlen replan --from-step n --dp 3`:
    across both plans every sample is trained once per epoch, the steps run on without a gap, and the LR
    at every global step is the one schedule there x the plan's lr_scale."""
    from typer.testing import CliRunner

    from varlen_cli.cli import app

    folder, data, plans = ds
    parent, n = plans["padded"], SAVE_AT[0] + 1
    res = CliRunner().invoke(app, ["replan", parent.path, "--from-step", str(n), "--dp", "3", "-o",
                                   str(tmp_path / "dp3.parquet")])
    assert res.exit_code == 0, res.output
    new = Plan.open(str(tmp_path / "dp3.parquet"))
    torchrun("train_deepspeed.py", "--plan", new.path, "--data", data, "--zero", "0", "--resume", "--ckpt",
             folder / "ckpt-z0", "--total-steps", parent.num_steps, "--log-dir", tmp_path / "after", nproc=3)
    before = [{**run, "micro": run["micro"][: n * parent.grad_accum]} for run in logs(folder / "z0")]
    after = logs(tmp_path / "after", 3)
    factor = load_example("tiny_lm").warmup_cosine(WARMUP, parent.num_steps)
    per_epoch: dict = {}
    for run, plan, offset in [(r, parent, 0) for r in before] + [(r, new, n) for r in after]:
        steps = run["steps"][:n] if plan is parent else run["steps"]
        assert steps == (list(range(n)) if plan is parent else list(range(n, n + new.num_steps)))
        scales = plan.lr_scales()[np.array(steps) - offset]
        assert np.allclose(run["lr"][: len(steps)], [LR * factor(s) * c for s, c in zip(steps, scales)], rtol=1e-9)
        for m in run["micro"]:
            epoch = m["position"][0] + (0 if plan is parent else parent.epoch_of(n))
            per_epoch.setdefault(epoch, []).extend(m["samples"])
    assert first_step(new) == n and sorted(per_epoch) == [0, 1]
    for ids in per_epoch.values():
        assert sorted(ids) == list(range(NUM_SAMPLES))


def hf(*args) -> None:
    """examples/train_hf_trainer.py on 2 ranks (tests/launcher.py), DeepSpeed imported once with transformers."""
    script = os.path.join(EXAMPLES, "train_hf_trainer.py")
    proc = launch(script, *args, imports=IMPORTS["train_hf_trainer.py"] + PRELOAD)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.slow
def test_hf_trainer_with_a_deepspeed_zero2_config(ds, reference, tmp_path):
    """PlanTrainer with TrainingArguments(deepspeed=...), ZeRO-2: the plan's stream, LR and first-step
    gradient (the engine's reduced gradient), and a resume from Trainer's DeepSpeed checkpoint that
    continues bit for bit."""
    folder, data, plans = ds
    plan = plans["padded"]
    config = tmp_path / "zero2.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
                                  "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                  "train_batch_size": "auto", "gradient_clipping": "auto"}))
    save = SAVE_AT[2] + 1
    common = ["--plan", plan.path, "--data", data, "--lr", LR, "--warmup-steps", WARMUP, "--max-grad-norm", "0",
              "--deepspeed", config]
    hf(*common, "--out", tmp_path / "out", "--log-dir", tmp_path / "full", "--save-steps", save)
    full = logs(tmp_path / "full")
    check_stream(plan, full)
    check_lr(plan, full, LR, hf_cosine(WARMUP, plan.num_steps))
    assert_grads_close(torch.load(tmp_path / "full" / "grad0.pt"), reference[0], rel=1e-5)
    shutil.copytree(tmp_path / "out" / f"checkpoint-{save}", tmp_path / "again" / f"checkpoint-{save}")
    hf(*common, "--out", tmp_path / "again", "--log-dir", tmp_path / "resumed", "--resume")
    for a, b in zip(full, logs(tmp_path / "resumed")):
        assert b["steps"] == a["steps"][save:] and b["lr"] == a["lr"][save:]
        assert b["micro"] == a["micro"][save * plan.grad_accum:]

