"""Train a tiny encoder-decoder on a two-budget varlen plan under DDP: both sides padded to the plan's shapes.

A plan with ``--max-target-tokens`` bounds every microbatch's padded source B x T (the encoder) and
its padded target B x T_target (the decoder); the loader's ``PadCollate`` pads the source to the
plan's ``seqlen`` and the target to its ``target_seqlen`` (``decoder_input_ids``, ``labels``). A toy
corpus (no downloads: each target is its source reversed, plus a few of its tokens again, so targets
may outnumber sources), then the plan, then training on 2 local ranks:

    python examples/train_seq2seq.py --make-data /tmp/pairs.parquet
    varlen analyze /tmp/pairs.parquet -o /tmp/m --length list:input_ids --target-length list:labels
    varlen plan /tmp/m -o /tmp/plan.parquet --max-tokens 512 --max-target-tokens 384 --dp 2 --lr-scale-by tokens
    python examples/train_seq2seq.py --plan /tmp/plan.parquet --data /tmp/pairs.parquet --nproc 2

Loss normalisation: every microbatch's summed token loss over its decoder targets is divided by the
step's target count (the plan's ``step_loss_tokens``: the sum of the step's ``target_length``, known
before the step runs) and multiplied by the world size (DDP averages gradients), so the accumulated
gradient is that of the mean target-token loss of the whole step. With ``--lr-scale-by tokens`` the
plan's ``lr_scale`` follows the same target counts.

``--log-dir`` writes rank-R.json per rank (steps, sample ids, LRs, losses, each microbatch's decoder shape).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from varlen_cli.errors.entry import exit_on_error  # noqa: E402
from varlen_cli.loader import PadCollate, Plan, VariableBatchSizeLR, dataloader_for_plan  # noqa: E402

VOCAB = 32  # token ids 2..31; 0 pads and starts the decoder


class PairDataset(torch.utils.data.Dataset):
    """Item i: ``{"input_ids": source, "labels": target}`` of row i (the keys ``tokenizer(src, text_target=tgt)``
    gives), from a Parquet file with list columns ``input_ids`` and ``labels``."""

    def __init__(self, path: str):
        table = pq.read_table(path, columns=["input_ids", "labels"])
        self.rows = [{k: np.asarray(v, np.int64) for k, v in row.items()} for row in table.to_pylist()]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


class TinySeq2Seq(nn.Module):
    """Embeddings, a ``torch.nn.Transformer`` (encoder and decoder) and an output head."""

    def __init__(self, max_len: int, d_model: int = 32, heads: int = 2, layers: int = 1):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.core = nn.Transformer(d_model, heads, layers, layers, 4 * d_model, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d_model, VOCAB)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1]))[None]

    def forward(self, input_ids, attention_mask, decoder_input_ids) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(decoder_input_ids.shape[1])
        # the decoder's padding follows its real positions: the causal mask keeps them out of every real one
        out = self.core(self.embed(input_ids), self.embed(decoder_input_ids), tgt_mask=causal, tgt_is_causal=True,
                        src_key_padding_mask=~attention_mask, memory_key_padding_mask=~attention_mask)
        return self.head(out)


def make_data(path: str, n: int = 400, seed: int = 0) -> None:
    """The toy corpus: sources of 1-48 tokens; each target its source reversed and 0-12 of its tokens again."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        src = rng.integers(2, VOCAB, int(rng.integers(1, 49)))
        tgt = np.concatenate([src[::-1], src[:int(rng.integers(0, 13))]])
        rows.append({"input_ids": src.tolist(), "labels": tgt.tolist()})
    pq.write_table(pa.Table.from_pylist(rows), path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--make-data", default=None, help="write the toy corpus to this Parquet file and exit")
    p.add_argument("--plan", help="plan file from `varlen plan --max-target-tokens`")
    p.add_argument("--data", help="Parquet file of (input_ids, labels) pairs: the dataset the plan was made for")
    p.add_argument("--nproc", type=int, default=1, help="start this many local DDP workers (gloo on CPU)")
    p.add_argument("--lr", type=float, default=3e-3, help="base learning rate (before the plan's lr_scale)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation seed")
    p.add_argument("--log-dir", default=None, help="write rank-R.json logs here")
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> dict:
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    dist = torch.distributed.is_initialized()
    try:
        log = _train(args, rank, world, dist)
        if dist:  # every rank meets before the group goes
            torch.distributed.barrier()
        return log
    finally:
        if dist:
            torch.distributed.destroy_process_group()


def _train(args, rank: int, world: int, dist: bool) -> dict:
    plan = Plan.open(args.plan)
    loader = dataloader_for_plan(PairDataset(args.data), plan, collate_fn=PadCollate(pad_id=0))
    torch.manual_seed(args.seed)
    longest = max(plan.config.get("max_tokens") or 1, plan.config.get("max_target_tokens") or 1)
    model = TinySeq2Seq(longest + 1)
    net = torch.nn.parallel.DistributedDataParallel(model) if dist else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = VariableBatchSizeLR(optimizer, plan)
    log = {"rank": rank, "steps": [], "samples": [], "lr": [], "lr_scale": [], "loss": [], "microbatches": []}
    step_ids, step_loss = [], 0.0
    for epoch in range(plan.epochs):
        loader.batch_sampler.set_epoch(epoch)
        for batch in loader:
            info = batch["info"]
            last = info.micro == plan.grad_accum - 1
            with contextlib.nullcontext() if (last or not dist) else net.no_sync():
                logits = net(batch["input_ids"], batch["attention_mask"], batch["decoder_input_ids"])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100,
                                       reduction="sum")
                (loss * world / batch["step_loss_tokens"]).backward()
            step_loss += float(loss.detach()) / batch["step_loss_tokens"]
            step_ids += batch["sample_ids"][: batch["num_samples"]].tolist()
            log["microbatches"].append({"step": info.step, "ids": batch["sample_ids"].tolist(),
                                        "decoder_shape": list(batch["decoder_input_ids"].shape),
                                        "labels_shape": list(batch["labels"].shape),
                                        "encoder_shape": list(batch["input_ids"].shape),
                                        "loss_tokens": batch["loss_tokens"],
                                        "step_loss_tokens": batch["step_loss_tokens"]})
            if not last:
                continue
            log["lr"].append(optimizer.param_groups[0]["lr"])
            log["lr_scale"].append(info.lr_scale)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            log["steps"].append(info.step)
            log["samples"].append(step_ids)
            log["loss"].append(step_loss)
            step_ids, step_loss = [], 0.0
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        with open(os.path.join(args.log_dir, f"rank-{rank}.json"), "w") as fh:
            json.dump(log, fh)
    if rank == 0:
        print(f"rank 0: {len(log['steps'])} steps, final loss {log['loss'][-1]:.3f}", flush=True)
    return log


def launch_local(nproc: int, argv) -> None:
    """Start ``nproc`` workers with torch's elastic launcher (what torchrun uses) on a free port."""
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"seq2seq-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
                          start_method="spawn", local_addr="127.0.0.1")
    elastic_launch(config, _worker)(argv)


def _worker(argv) -> dict:
    return exit_on_error(train, parse_args(argv))  # --nproc: the launcher shows a worker's PlanError line


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.make_data:
        make_data(args.make_data)
    elif args.nproc > 1 and "RANK" not in os.environ:
        launch_local(args.nproc, [a for i, a in enumerate(argv) if a != "--nproc" and argv[i - 1] != "--nproc"])
    else:
        train(args)


if __name__ == "__main__":
    exit_on_error(main)  # a PlanError: its one line (also in torchrun's summary), not a traceback per rank
