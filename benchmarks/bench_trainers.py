"""Hugging Face Trainer on CPU, tiny Llama: varlen's PlanTrainer vs Trainer's samplers (group_by_length,
batch_rebalance, the default random), in the same run (interleaved), medians of --repeats runs.

    PYTHONPATH=. python benchmarks/bench_trainers.py --repeats 3 [--json out.json]

All four train one epoch over the same samples with about the same samples per optimizer step
(the baselines' batch size is the plan's mean samples per microbatch), pad-to-longest collate for
the baselines. tokens/s counts real (non-padding) tokens only; tokens/CPU-s divides by the process's
CPU time (user + system, all threads), which a loaded machine distorts much less than wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402


class Items(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def pad_collate(items):
    longest = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for r, x in enumerate(items):
        ids[r, : len(x["input_ids"])] = torch.as_tensor(x["input_ids"])
        mask[r, : len(x["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def run(kind: str, rows, plan_path: str, batch_size: int, hidden: int, vocab: int, out: str) -> dict:
    from train_hf_trainer import tiny_llama
    from transformers import Trainer, TrainingArguments

    from varlen_cli.integrations.hf import PlanTrainer

    model = tiny_llama(vocab, 512, hidden=hidden)
    common = dict(output_dir=out, learning_rate=1e-3, report_to=[], use_cpu=True, disable_tqdm=True,
                  save_strategy="no", logging_strategy="no", seed=0, dataloader_num_workers=0)
    data = Items(rows)
    if kind == "varlen":
        trainer = PlanTrainer(plan=plan_path, model=model, args=TrainingArguments(**common), train_dataset=data)
    else:
        args = TrainingArguments(per_device_train_batch_size=batch_size, num_train_epochs=1,
                                 train_sampling_strategy=kind, **common)
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=pad_collate)
    t0, c0 = time.perf_counter(), time.process_time()  # train() only, not the Trainer's construction
    result = trainer.train()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    real = int(sum(len(r) for r in rows))
    return {"kind": kind, "seconds": seconds, "cpu_seconds": cpu, "tokens_per_s": real / seconds,
            "tokens_per_cpu_s": real / cpu, "steps": result.global_step}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=os.path.join(ROOT, "sample_data", "tokenized.parquet"))
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=2048, help="the plan's token budget per microbatch")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from varlen_cli.analyze import AnalyzeConfig, analyze
    from varlen_cli.loader import Plan
    from varlen_cli.plan import PlanConfig, plan

    tmp = tempfile.mkdtemp(prefix="bench-trainers-")
    data_path = os.path.join(tmp, "data.parquet")
    pq.write_table(pq.read_table(args.data).slice(0, args.samples), data_path)
    rows = [np.asarray(x, dtype=np.int64) for x in pq.read_table(data_path).column("input_ids").to_pylist()]
    vocab = max(int(r.max()) for r in rows) + 1
    analyze(AnalyzeConfig(sources=(data_path,), output=os.path.join(tmp, "m"), length="list:input_ids",
                          progress=False))
    plan_path = os.path.join(tmp, "plan.parquet")
    plan(PlanConfig(input=os.path.join(tmp, "m"), output=plan_path, max_tokens=args.max_tokens, epochs=1))
    loaded = Plan.open(plan_path)
    batch_size = max(1, round(len(rows) / (loaded.num_steps * loaded.grad_accum)))
    results = {k: [] for k in ("varlen", "group_by_length", "batch_rebalance", "random")}
    kinds = list(results)
    run("random", rows[:64], plan_path, 8, args.hidden, vocab, os.path.join(tmp, "warmup"))  # process warm-up, dropped
    for rep in range(args.repeats):
        for kind in kinds[rep % len(kinds):] + kinds[: rep % len(kinds)]:  # interleaved, a rotating first
            r = run(kind, rows, plan_path, batch_size, args.hidden, vocab, os.path.join(tmp, f"{kind}-{rep}"))
            results[kind].append(r)
            print(f"  {kind:16s} run {rep}: {r['tokens_per_s']:9.0f} tokens/s, "
                  f"{r['tokens_per_cpu_s']:9.0f} tokens/CPU-s ({r['steps']} steps, {r['seconds']:.1f} s, "
                  f"{r['cpu_seconds']:.1f} CPU-s)", flush=True)
    summary = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in results.items()}
    per_cpu = {k: statistics.median(r["tokens_per_cpu_s"] for r in v) for k, v in results.items()}
    print(f"\nsamples {len(rows)}, plan steps {loaded.num_steps} (budget {args.max_tokens} tokens), baseline batch "
          f"size {batch_size}, hidden {args.hidden}, {args.threads} threads, medians of {args.repeats}:")
    for kind, tps in summary.items():
        print(f"  {kind:16s} {tps:9.0f} tokens/s  ({tps / summary['random']:.2f}x random)   "
              f"{per_cpu[kind]:9.0f} tokens/CPU-s ({per_cpu[kind] / per_cpu['random']:.2f}x random)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"summary": summary, "per_cpu_second": per_cpu, "runs": results, "batch_size": batch_size}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
