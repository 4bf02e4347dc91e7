"""An RL-style loop (GRPO-like) on varlen's step planner: rollouts generated while training, their
lengths planned with ``varlen_cli.online.plan_step``, trained on data-parallel ranks under DDP.

    torchrun --nproc-per-node 2 examples/train_rl_stream.py --iterations 4
    python examples/train_rl_stream.py --iterations 4          # one process

Each iteration:

1. every rank generates its own rollouts: ``--prompts`` random prompts, ``--group`` sampled
   responses each from the current policy (a bigram model), a response ending at the EOS token or
   at ``--max-response``; the reward is the share of "good" tokens, the advantage the reward minus
   its group's mean (GRPO);
2. the ranks all-gather their rollouts (each rank read its own shard; the lengths, and here the
   rollouts too, are gathered), so every rank holds the same buffer in the same order;
3. every rank calls ``plan_step`` on the buffer's lengths with the same options: the same plan on
   every rank, no further collective. Every rank gets the same number of microbatches (DDP's
   all-reduce per backward needs it), each under the token budget (``--max-tokens``, or packed rows
   of ``--seq-len``), the ranks' costs balanced on ``l + A l^2``, a group never split
   (``groups=``: the advantages are per group);
4. each rank trains on its microbatches (``rank_batches``: the plan loaders' collates): the
   policy-gradient loss summed over response tokens, divided by the step's response tokens (known
   before the step: exact normalisation) times the world size (DDP averages), the LR times the step's
   ``lr_scale``; one optimizer step per iteration.

``--log-dir`` writes rank-R.json: per iteration the rollouts' ids each rank trained, its microbatch
count, LR, loss and mean reward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from varlen_cli.loader.packed import packed_layout  # noqa: E402
from varlen_cli.online import plan_step  # noqa: E402
from varlen_cli.online.loader import rank_batches  # noqa: E402

VOCAB, EOS, GOOD = 32, 0, 7  # token 0 ends a response; the reward counts token 7


class Bigram(torch.nn.Module):
    """The policy: the next token's logits from the previous token."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(VOCAB, VOCAB)
        torch.nn.init.zeros_(self.table.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=4, help="generate-then-train iterations")
    p.add_argument("--prompts", type=int, default=6, help="prompts per rank per iteration")
    p.add_argument("--group", type=int, default=4, help="responses per prompt (a GRPO group)")
    p.add_argument("--max-response", type=int, default=48, help="longest response, in tokens")
    p.add_argument("--max-tokens", type=int, default=512, help="padded budget: B x T of a microbatch")
    p.add_argument("--seq-len", type=int, default=None, help="pack rows of this many tokens instead")
    p.add_argument("--attention-cost", type=float, default=1e-3, help="A in the cost l + A l^2")
    p.add_argument("--lr", type=float, default=0.5, help="base learning rate (times the step's lr_scale)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the sampling (offset by rank)")
    p.add_argument("--log-dir", default=None, help="write rank-R.json here")
    return p.parse_args(argv)


@torch.no_grad()
def generate(policy: Bigram, args, rng: np.random.Generator, gen: torch.Generator, first_id: int) -> list[dict]:
    """This rank's rollouts: prompt + sampled response, reward, group-relative advantage."""
    rollouts = []
    for p in range(args.prompts):
        prompt = rng.integers(1, VOCAB, int(rng.integers(2, 9))).tolist()
        group = []
        for _ in range(args.group):
            tokens = list(prompt)
            for _ in range(args.max_response):
                probs = torch.softmax(policy(torch.tensor([tokens[-1]]))[0], dim=-1)
                tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
                if tokens[-1] == EOS:
                    break
            response = tokens[len(prompt):]
            group.append({"input_ids": tokens, "prompt_len": len(prompt),
                          "reward": sum(t == GOOD for t in response) / len(response)})
        mean = float(np.mean([r["reward"] for r in group]))
        for r in group:
            r["advantage"] = r["reward"] - mean
            r["group"] = first_id + p
            rollouts.append(r)
    return rollouts


def gather(rollouts: list[dict], world: int) -> list[dict]:
    """Every rank's rollouts, rank after rank (each rank generated its own shard)."""
    if world == 1:
        return rollouts
    every = [None] * world
    dist.all_gather_object(every, rollouts)
    return [r for shard in every for r in shard]


def response_loss(policy, batch: dict, buffer: list[dict]) -> torch.Tensor:
    """Sum over response tokens of -advantage x log p(token), padded or packed: each entry of the
    microbatch (a sample, or a chunk of one) weighs the targets that are response tokens."""
    info, labels = batch["info"], batch["labels"]  # labels: next-token targets, -100 off the samples
    logp = torch.log_softmax(policy(batch["input_ids"]), dim=-1)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).reshape(-1)
    if "cu_seqlens" in batch:  # packed rows: where each entry starts in the flattened R x T batch
        where = packed_layout(info.sample_lengths, info.sample_rows, info.seqlen, info.batch_size)["flat_index"]
        starts, sizes = info.sample_starts, info.sample_lengths
    else:
        where = np.arange(info.num_samples) * info.seqlen
        starts = np.zeros(info.num_samples, np.int64)
        sizes = [len(buffer[i]["input_ids"]) for i in info.sample_ids.tolist()]
    weight = torch.zeros_like(picked)
    for flat, sid, start, size in zip(where.tolist(), info.sample_ids.tolist(), np.asarray(starts).tolist(),
                                      np.asarray(sizes).tolist()):
        r = buffer[sid]  # position k of the entry predicts token start + k + 1 of the sample
        lo, hi = max(r["prompt_len"] - 1 - start, 0), min(len(r["input_ids"]) - 1 - start, size)
        weight[flat + lo:flat + max(lo, hi)] = r["advantage"]
    return -(picked * weight * (labels.reshape(-1) != -100)).sum()


def response_tokens(buffer: list[dict]) -> int:
    return sum(len(r["input_ids"]) - r["prompt_len"] for r in buffer)


def train(args) -> list[dict]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(args.seed)
    policy = Bigram()
    model = torch.nn.parallel.DistributedDataParallel(policy) if world > 1 else policy
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    rng = np.random.default_rng([args.seed, rank])
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    budget = dict(seq_len=args.seq_len) if args.seq_len else dict(max_tokens=args.max_tokens)
    log = []
    for it in range(args.iterations):
        mine = generate(policy, args, rng, gen, first_id=(it * world + rank) * args.prompts)
        buffer = gather(mine, world)
        lengths = np.array([len(r["input_ids"]) for r in buffer])
        plan = plan_step(lengths, dp=world, attention_cost=args.attention_cost, groups=[r["group"] for r in buffer],
                         lr_scaling="sqrt", base_batch_size=args.prompts * args.group * world * 20,
                         lr_scale_by="tokens", **budget)
        for group in opt.param_groups:
            group["lr"] = args.lr * plan.lr_scale
        # the normaliser: response tokens of the whole step, over all ranks (the same on every rank)
        norm, total = response_tokens(buffer), 0.0
        trained = []
        for batch in rank_batches(plan, buffer, rank):
            loss = response_loss(model, batch, buffer)
            (loss * world / norm).backward()
            total += float(loss.detach())
            trained += [int(i) for i in batch["info"].sample_ids.tolist()]
        opt.step()
        opt.zero_grad()
        reward = float(np.mean([r["reward"] for r in buffer]))
        log.append({"iteration": it, "ids": trained, "buffer": len(buffer), "microbatches": plan.num_microbatches,
                    "imbalance": plan.imbalance, "lr": opt.param_groups[0]["lr"], "loss": total / norm,
                    "reward": reward, "groups": [buffer[i]["group"] for i in trained]})
        if rank == 0:
            print(f"iteration {it}: {len(buffer)} rollouts, {int(lengths.sum()):,} tokens, "
                  f"{plan.num_microbatches} microbatch(es) a rank, imbalance {plan.imbalance:.3f}, "
                  f"mean reward {reward:.3f}", flush=True)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        with open(os.path.join(args.log_dir, f"rank-{rank}.json"), "w") as fh:
            json.dump(log, fh)
    if world > 1:
        dist.destroy_process_group()
    return log


def main(argv=None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
