"""Benchmark varlen_cli.loader: per-step loader overhead, O(1) resume, and tiny-LM tokens/s per batching.

    python benchmarks/bench_loader.py overhead [--samples 200000] [--max-tokens 8192] [--repeats 5]
    python benchmarks/bench_loader.py lm [--variants a,b,c] [--repeats 3] [--device cpu]

overhead: a synthetic dataset (lognormal lengths) -> varlen analyze -> varlen plan; then, per
optimizer step, the time the loader takes (plan reading + dataset fetch + padding collate) with a
no-op model, against a realistic step of a small GPT on the same batches, measured in the same run.
Also: the time to resume at the middle of the plan (one row-group read) against step 0.

lm: the tiny LM of examples/ for one epoch of sample_data/tokenized.parquet with
(a) a fixed batch size, random order, each batch padded to its longest sample (the usual
    DataLoader; batch size chosen to give the same number of steps as (b));
(b) a bucket-shuffle plan (varlen plan --order bucket-shuffle);
(c) a --static-shapes --num-shapes 3 --compile-warmup plan under torch.compile (inductor).
Each variant runs in its own process; reports tokens/s (median of --repeats), padding %, and
the process's peak RSS. Numbers are from the machine it runs on: say which.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(1, ROOT)

import numpy as np  # noqa: E402


def _plan(metrics: str, out: str, **options) -> str:
    from varlen_cli.plan import PlanConfig, plan

    plan(PlanConfig(input=metrics, output=out, overwrite=True, **options))
    return out


def _analyze(source: str, out: str, length: str) -> str:
    from varlen_cli.analyze import AnalyzeConfig, analyze

    analyze(AnalyzeConfig(sources=(source,), output=out, length=length, overwrite=True, progress=False))
    return out


class SyntheticDataset:
    """Token ids of given lengths, stored flat (like a memory-mapped tokenised corpus)."""

    def __init__(self, lengths, vocab=2000, seed=0):
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.values = np.random.default_rng(seed).integers(0, vocab, size=int(self.offsets[-1]), dtype=np.int64)

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, i):
        return self.values[self.offsets[i]:self.offsets[i + 1]]


# -- overhead -------------------------------------------------------------------------------------
def overhead(args) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from tiny_lm import TinyGPT, loss_sum

    from varlen_cli.loader import Plan, dataloader_for_plan

    torch.set_num_threads(args.threads)
    work = tempfile.mkdtemp(prefix="bench-loader-")
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 0.8, size=args.samples).astype(np.int64), 8,
                      min(args.max_len, args.max_tokens))
    pq.write_table(pa.table({"length": lengths}), os.path.join(work, "lengths.parquet"))
    t0 = time.perf_counter()
    metrics = _analyze(os.path.join(work, "lengths.parquet"), os.path.join(work, "metrics"), "value:length")
    plan_path = _plan(metrics, os.path.join(work, "plan.parquet"), max_tokens=args.max_tokens, dp=1,
                      grad_accum=args.grad_accum, order="bucket-shuffle", pad_multiple=8)
    prep = time.perf_counter() - t0
    plan = Plan.open(plan_path)
    data = SyntheticDataset(lengths)
    print(f"# {args.samples} samples, {int(lengths.sum())} tokens, plan: {plan.num_steps} steps x "
          f"{plan.grad_accum} microbatches, {os.path.getsize(plan_path) / 1e6:.1f} MB, "
          f"{pq.ParquetFile(plan_path).metadata.num_row_groups} row groups (analyze+plan {prep:.1f} s)")

    # 1. the loader alone (no-op model): plan rows -> dataset fetch -> padded tensors
    loader_ms, sampler_us = [], []
    for _ in range(args.repeats):
        sampler = dataloader_for_plan(data, plan_path, lr_scale="ignore").batch_sampler
        t = time.perf_counter()
        n = sum(1 for _ in sampler)
        sampler_us.append((time.perf_counter() - t) / n * 1e6)
        loader = dataloader_for_plan(data, plan_path, lr_scale="ignore")
        t = time.perf_counter()
        n = 0
        for _ in loader:
            n += 1
        loader_ms.append((time.perf_counter() - t) / n * 1e3 * plan.grad_accum)
    # 2. a realistic step on the same batches: small GPT forward + backward + AdamW
    model = TinyGPT(2000, max(t for _, t in plan.shapes), args.d_model, args.layers, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = dataloader_for_plan(data, plan_path, lr_scale="ignore")
    step_ms, wait_ms = [], []
    it = iter(loader)
    for s in range(args.model_steps):
        t = time.perf_counter()
        wait = 0.0
        for _ in range(plan.grad_accum):
            w = time.perf_counter()
            batch = next(it)
            wait += time.perf_counter() - w
            loss = loss_sum(model(batch["input_ids"], batch["attention_mask"]), batch["labels"])
            (loss / batch["step_loss_tokens"]).backward()
        opt.step()
        opt.zero_grad()
        if s > 0:  # the first step warms up allocators
            step_ms.append((time.perf_counter() - t) * 1e3)
            wait_ms.append(wait * 1e3)
    # 3. O(1) resume: seek to the middle of the plan vs its start, on a fresh reader
    seek = {}
    for name, step in (("start", 0), ("middle", plan.num_steps // 2), ("end", plan.num_steps - 1)):
        times = []
        for _ in range(args.repeats):
            fresh = dataloader_for_plan(data, plan_path, lr_scale="ignore")
            t = time.perf_counter()
            fresh.batch_sampler.load_state_dict({"plan": fresh.batch_sampler.plan.fingerprint, "epoch": 0,
                                                 "step": step, "micro": 0})
            next(iter(fresh))
            times.append((time.perf_counter() - t) * 1e3)
        seek[name] = statistics.median(times)
    med = statistics.median
    realistic = med(step_ms)
    print()
    print("| measure | value |")
    print("|---|---|")
    print(f"| sampler (plan rows -> id lists), per microbatch | {med(sampler_us):.1f} us |")
    print(f"| loader, no-op model (sampler + fetch + collate), per step | {med(loader_ms):.3f} ms |")
    print(f"| small GPT step on CPU (d={args.d_model}, {args.layers} layers, {args.threads} threads), "
          f"same batches | {realistic:.1f} ms |")
    print(f"| loader / CPU step | {100 * med(loader_ms) / realistic:.3f} % |")
    print(f"| loader / 100 ms GPU step (nominal) | {100 * med(loader_ms) / 100:.3f} % |")
    print(f"| main-loop wait for batches inside the model loop, per step | {med(wait_ms):.3f} ms |")
    print(f"| resume + first batch at step 0 / middle / last | {seek['start']:.2f} / {seek['middle']:.2f} / "
          f"{seek['end']:.2f} ms |")


# -- tiny LM variants -----------------------------------------------------------------------------
def _variant(args) -> None:
    """One variant in this process; prints one JSON line."""
    import torch
    from tiny_lm import TinyGPT, TokenDataset, loss_sum

    from varlen_cli.loader import PadCollate, Plan, dataloader_for_plan

    torch.set_num_threads(args.threads)
    data = TokenDataset(os.path.join(ROOT, "sample_data", "tokenized.parquet"))
    torch.manual_seed(0)
    v = args.variant
    if v == "a":
        plan = None
        gen = torch.Generator().manual_seed(0)
        sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(data, generator=gen),
                                                args.batch_size, drop_last=False)
        loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=PadCollate(pad_multiple=8))
        max_len = int(data.lengths().max()) + 8
    else:
        plan = Plan.open(args.plan_file)
        loader = dataloader_for_plan(data, plan, lr_scale="ignore")  # throughput only: no LR schedule here
        max_len = max(t for _, t in plan.shapes)
    model = TinyGPT(data.vocab_size, max_len, args.d_model, args.layers, args.heads).to(args.device)
    net = model
    if v == "c":
        from torch import _dynamo

        _dynamo.config.recompile_limit = max(8, len(plan.shapes) + 1)
        net = torch.compile(model, dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warm = plan.warmup_steps if plan is not None and v == "c" else 0
    real = padded = 0
    t_start = time.perf_counter()
    t_warm = None
    warm_tokens = 0
    steps = 0
    max_padded = 0
    for batch in loader:
        ids = batch["input_ids"].to(args.device)
        loss = loss_sum(net(ids, batch["attention_mask"].to(args.device)), batch["labels"].to(args.device))
        (loss / max(1, batch["loss_tokens"])).backward()
        info = batch["info"]
        if info is None or info.micro == info_ga(plan):
            opt.step()
            opt.zero_grad()
            steps += 1
        real += batch["num_tokens"]
        padded += ids.numel()
        max_padded = max(max_padded, ids.numel())
        if t_warm is not None:
            warm_tokens += batch["num_tokens"]
        if t_warm is None and steps >= warm:
            t_warm = time.perf_counter()
    if args.device == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t_start
    after = time.perf_counter() - t_warm
    peak = (torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps({"variant": v, "steps": steps, "tokens": real, "padded": padded, "seconds": total,
                      "tokens_per_s": real / total, "tokens_per_s_after_warmup": warm_tokens / after if after else None,
                      "padding_pct": 100 * (1 - real / padded), "max_padded_tokens": max_padded,
                      "peak_mb": peak, "warmup_steps": warm}))


def info_ga(plan) -> int:
    return plan.grad_accum - 1 if plan is not None else 0


def lm(args) -> None:
    from varlen_cli.loader import Plan

    work = tempfile.mkdtemp(prefix="bench-lm-")
    metrics = _analyze(os.path.join(ROOT, "sample_data", "tokenized.parquet"), os.path.join(work, "m"),
                       "list:input_ids")
    plan_b = _plan(metrics, os.path.join(work, "b.parquet"), max_tokens=args.max_tokens, order="bucket-shuffle",
                   pad_multiple=8)
    plan_c = _plan(metrics, os.path.join(work, "c.parquet"), max_tokens=args.max_tokens, order="bucket-shuffle",
                   static_shapes=True, num_shapes=3, compile_warmup=True, pad_multiple=8)
    steps_b = Plan.open(plan_b).num_steps
    batch_a = max(1, round(2000 / steps_b))
    rows = []
    for v in args.variants.split(","):
        plan_file = {"a": "", "b": plan_b, "c": plan_c}[v]
        runs = []
        for _ in range(args.repeats if v != "c" else args.compile_repeats):
            cmd = [sys.executable, os.path.abspath(__file__), "_variant", "--variant", v, "--plan-file", plan_file,
                   "--batch-size", str(batch_a), "--threads", str(args.threads), "--device", args.device,
                   "--d-model", str(args.d_model), "--layers", str(args.layers), "--heads", str(args.heads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
        rows.append((v, runs))
    print(f"# tiny LM (d={args.d_model}, {args.layers} layers), one epoch of sample_data/tokenized.parquet "
          f"(2,000 samples, 89,106 tokens), --max-tokens {args.max_tokens}; (a) batch size {batch_a} "
          f"= same steps as (b); device {args.device}, {args.threads} threads; median of the runs")
    print()
    print("| variant | steps | padding % | max B x T | tokens/s (all) | tokens/s after warm-up | vs (a) | peak MB |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    names = {"a": "(a) fixed batch, random, pad to longest", "b": "(b) bucket-shuffle plan",
             "c": "(c) static shapes (3) + torch.compile"}
    for v, runs in rows:
        tps = statistics.median(r["tokens_per_s"] for r in runs)
        after = statistics.median(r["tokens_per_s_after_warmup"] or r["tokens_per_s"] for r in runs)
        if v == "a":
            base = after
        ratio = f"{after / base:.2f}x" if base else "-"
        r0 = runs[0]
        print(f"| {names[v]} | {r0['steps']} | {r0['padding_pct']:.1f} | {r0['max_padded_tokens']} | {tps:.0f} | "
              f"{after:.0f} | {ratio} | {statistics.median(r['peak_mb'] for r in runs):.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description="varlen_cli.loader benchmarks")
    p.add_argument("part", choices=["overhead", "lm", "_variant"], help="what to measure")
    p.add_argument("--samples", type=int, default=200_000, help="overhead: synthetic samples")
    p.add_argument("--max-tokens", type=int, default=None, help="token budget per microbatch")
    p.add_argument("--max-len", type=int, default=2048, help="overhead: longest synthetic sample")
    p.add_argument("--grad-accum", type=int, default=1, help="overhead: microbatches per step")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    p.add_argument("--compile-repeats", type=int, default=1, help="lm: runs of the compiled variant")
    p.add_argument("--model-steps", type=int, default=6, help="overhead: model steps timed")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: a shared 2-core machine slows down "
                                                          "badly with more)")
    p.add_argument("--d-model", type=int, default=None, help="model width")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--variants", default="a,b,c", help="lm: which of a,b,c")
    p.add_argument("--device", default="cpu", help="lm: cpu or cuda")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--plan-file", help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=16, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.part == "overhead":
        args.max_tokens = args.max_tokens or 8192
        args.d_model, args.layers = args.d_model or 128, args.layers or 2
    else:
        args.max_tokens = args.max_tokens or 2048
        args.d_model, args.layers = args.d_model or 64, args.layers or 2
    if args.part != "_variant":
        print("$ python benchmarks/bench_loader.py " + " ".join(sys.argv[1:]))
    {"overhead": overhead, "lm": lm, "_variant": _variant}[args.part](args)


if __name__ == "__main__":
    main()
