"""Shared checks of the framework integrations (tests/integrations/test_*.py).

Each framework test trains a tiny Llama built from a config on a 300-sample slice of
sample_data/tokenized.parquet, with 2 processes (gloo, a free port each launch) under tests/launcher.py,
which starts ranks as torchrun does (checked against the real torchrun in tests/test_launcher.py), and
compares what ran with the plan and with single-process references computed here from the data and the
model alone.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from tests.loader_helpers import ROOT, TOKENIZED

EXAMPLES = os.path.join(ROOT, "examples")
NUM_SAMPLES = 300


def load_example(name: str):
    """The module ``examples/NAME.py`` (the examples are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_dataset(folder) -> str:
    """The first 300 rows of sample_data/tokenized.parquet as a Parquet file."""
    path = os.path.join(str(folder), "small.parquet")
    if not os.path.exists(path):
        pq.write_table(pq.read_table(TOKENIZED).slice(0, NUM_SAMPLES), path)
    return path


def make_plan(folder, data: str, name: str, **options) -> str:
    """A plan of ``data`` by varlen analyze + varlen plan."""
    from varlen_cli.analyze import AnalyzeConfig, analyze
    from varlen_cli.plan import PlanConfig, plan

    metrics = os.path.join(str(folder), "metrics")
    if not os.path.exists(metrics):
        analyze(AnalyzeConfig(sources=(data,), output=metrics, length="list:input_ids", progress=False))
    out = os.path.join(str(folder), f"{name}.parquet")
    plan(PlanConfig(input=metrics, output=out, overwrite=True, **options))
    return out


def tokens(data: str) -> list:
    return [np.asarray(x, dtype=np.int64) for x in pq.read_table(data).column("input_ids").to_pylist()]


# what each example imports, loaded once in the launcher's zygote (tests/launcher.py) instead of in every rank
_HF = ("transformers.trainer", "transformers.models.llama.modeling_llama", "varlen_cli.integrations.hf")
IMPORTS = {
    "train_hf_trainer.py": _HF + ("torch.utils.tensorboard",),
    "train_trl.py": _HF + ("datasets", "trl.trainer.sft_trainer"),
    "train_accelerate.py": _HF + ("accelerate", "varlen_cli.integrations.accelerate"),
    "train_lightning.py": _HF + ("lightning.pytorch", "lightning.pytorch.loggers", "varlen_cli.integrations.lightning"),
    "train_fsdp2.py": _HF + ("torch.distributed.fsdp", "torch.distributed.checkpoint"),
    "train_tiny_lm.py": ("torch.nn.parallel",),
    # torch._dynamo: DeepSpeed imports it (its Muon optimizer) when it checks the optimizer, seconds a process
    "train_deepspeed.py": _HF + ("torch._dynamo", "deepspeed", "deepspeed.pipe", "varlen_cli.integrations.deepspeed"),
}


def torchrun(script: str, *args, nproc: int = 2, timeout: int = 420, expect_ok: bool = True, real: bool = False):
    """Run ``examples/SCRIPT`` with ``nproc`` ranks as ``torchrun --standalone --nproc-per-node NPROC``
    would: ``real=True`` (or VARLEN_TEST_REAL_TORCHRUN=1 for every launch) under the real command
    (``python -m torch.distributed.run``), else under tests/launcher.py (real processes with torchrun's
    environment, gloo, a free port each time; forked from a process that imported the frameworks once)."""
    if real or os.environ.get("VARLEN_TEST_REAL_TORCHRUN") == "1":
        proc = real_torchrun(os.path.join(EXAMPLES, script), *args, nproc=nproc, timeout=timeout, cwd=ROOT)
    else:
        from tests.launcher import launch

        proc = launch(os.path.join(EXAMPLES, script), *args, nproc=nproc, timeout=timeout, cwd=ROOT,
                      imports=IMPORTS.get(script, ()))
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return proc


def real_torchrun(script: str, *args, nproc: int = 2, timeout: int = 420, cwd=ROOT) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node NPROC SCRIPT ARGS`` (a free port)."""
    from tests.launcher import STATIC_ENV

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(cwd),
                            env=dict(os.environ, **STATIC_ENV))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # past the timeout: SIGTERM, which torchrun's agent passes on to its workers (each in a session of
        # its own, so killing the agent alone would leave them running), then SIGKILL
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=60)
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def logs(log_dir, world: int = 2) -> list:
    return [json.load(open(os.path.join(str(log_dir), f"rank-{r}.json"))) for r in range(world)]


def check_stream(plan, rank_logs) -> None:
    """Each rank ran exactly its plan rows (step, rank, micro) with their samples; every kept sample
    exactly once per epoch."""
    dropped = set(plan.dropped.get("sample_ids", []))
    per_epoch = {e: [] for e in range(plan.epochs)}
    for rank, log in enumerate(rank_logs):
        want = [(plan.epoch_of(s), s, rank, m) for s in range(plan.num_steps) for m in range(plan.grad_accum)]
        got = [tuple(m["position"]) for m in log["micro"]]
        assert got == want, (rank, got[:6], want[:6])
        for m in log["micro"]:
            epoch, step, _, micro = m["position"]
            assert m["samples"] == plan.microbatch(step, rank, micro).sample_ids.tolist()
            per_epoch[epoch] += m["samples"]
    for epoch, ids in per_epoch.items():
        assert sorted(ids) == sorted(set(range(NUM_SAMPLES)) - dropped), epoch


def check_lr(plan, rank_logs, base_lr: float, factor) -> None:
    """At every step the LR in use is base x schedule factor (computed here) x the plan's lr_scale."""
    scales = plan.lr_scales()
    assert len(set(np.round(scales, 6))) > 1  # the plan's batch sizes vary, so does the scale
    for log in rank_logs:
        assert log["steps"] == list(range(plan.num_steps))
        expected_unscaled = [base_lr * factor(s) for s in log["steps"]]
        assert np.allclose(log["unscaled_lr"], expected_unscaled, rtol=1e-9, atol=1e-15)
        assert np.allclose(log["lr"], np.array(expected_unscaled) * scales[log["steps"]], rtol=1e-9, atol=1e-15)


def hf_cosine(warmup: int, total: int):
    """transformers' cosine schedule with linear warm-up (written out here, not imported)."""
    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return factor


def reference_grads(model, plan, data_tokens, step: int = 0) -> dict:
    """Single process, no batching: the gradient of the mean next-token loss over every target of
    ``step`` (all ranks and micros), each sample run alone."""
    model.zero_grad(set_to_none=True)
    ids = [int(i) for mb in plan.step(step) for i in mb.sample_ids]
    total = sum(max(len(data_tokens[i]) - 1, 0) for i in ids)
    loss = 0.0
    for i in ids:
        x = torch.as_tensor(data_tokens[i])[None]
        logits = model(input_ids=x).logits
        loss = loss + F.cross_entropy(logits[0, :-1].float(), x[0, 1:], reduction="sum")
    (loss / total).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict, want: dict, rel: float = 1e-5) -> None:
    names = sorted(want)
    assert sorted(got) == names
    g = torch.cat([got[n].reshape(-1).double() for n in names])
    w = torch.cat([want[n].reshape(-1).double() for n in names])
    err = float((g - w).norm() / w.norm())
    assert err < rel, err


def plan_step_figures(plan_path: str) -> dict[str, np.ndarray]:
    """What the trackers must show for each step of a plan (issue 35), computed here from its columns
    with numpy: real and padded tokens, padding %, samples, lr_scale, the straggler under the plan's
    budget, the largest T and verl's global_seqlen (per-rank real tokens)."""
    t = pq.read_table(plan_path)
    meta = json.loads(t.schema.metadata[b"varlen"])
    c = {n: t.column(n).to_numpy() for n in ("step", "rank", "tokens", "batch_size", "seqlen", "step_samples",
                                             "lr_scale")}
    steps, dp, per_step = int(c["step"].max()) + 1, meta["dp"], meta["dp"] * meta["grad_accum"]
    a, packed = float(meta["budget"]["attention_cost"]), meta["budget"]["cost"] == "packed"
    if packed:
        squares = [sum(int(v) ** 2 for v in row) for row in t.column("sample_lengths").to_pylist()]
        cost = c["tokens"] + a * np.array(squares, dtype=float)
    else:
        cost = c["batch_size"] * c["seqlen"] * (1.0 + a * c["seqlen"])
    load, real = np.zeros((steps, dp)), np.zeros((steps, dp))
    np.add.at(load, (c["step"], c["rank"]), cost)
    np.add.at(real, (c["step"], c["rank"]), c["tokens"])
    tokens = real.sum(1)
    padded = np.bincount(c["step"], weights=c["batch_size"] * c["seqlen"].astype(float))
    seqlen_max = np.zeros(steps)
    np.maximum.at(seqlen_max, c["step"], c["seqlen"])
    return {"varlen/tokens": tokens, "varlen/padded_tokens": padded, "varlen/padding_pct": 100 * (1 - tokens / padded),
            "varlen/samples": c["step_samples"][::per_step], "varlen/lr_scale": c["lr_scale"][::per_step],
            "varlen/straggler": load.max(1) / load.mean(1), "varlen/seqlen_max": seqlen_max,
            "global_seqlen/min": real.min(1), "global_seqlen/max": real.max(1), "global_seqlen/mean": real.mean(1),
            "global_seqlen/minmax_diff": real.max(1) - real.min(1)}


def tensorboard_scalars(folder) -> dict[str, dict[int, float]]:
    """Every scalar of the TensorBoard event files in ``folder``: {tag: {step: value}}, read with
    TensorBoard's own event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def check_tracker_figures(plan_path: str, folder, prefix: str, x_of_step: int, steps) -> None:
    """The ``varlen/*`` and ``global_seqlen/*`` scalars a run logged to TensorBoard in ``folder`` are
    the plan's rows: one value per optimizer step of ``steps``, at x = step + ``x_of_step`` (the
    framework's own step counter), equal to :func:`plan_step_figures` (float32 in the event file)."""
    scalars = tensorboard_scalars(folder)
    for name, values in plan_step_figures(plan_path).items():
        got = scalars[prefix + name]
        assert sorted(got) == [s + x_of_step for s in steps], (name, sorted(got)[:5])
        want = np.array([values[s] for s in steps], dtype=np.float32)
        assert np.allclose([got[s + x_of_step] for s in steps], want, rtol=1e-6, atol=1e-6), name
