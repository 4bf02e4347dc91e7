"""One rank of tests/online/test_stream_loader.py, started as torchrun starts it (tests/launcher.py):
a tiny LM under DDP (gloo) trained on a stream planned by OnlinePlanner through dataloader_for_stream
(padded, then packed), the loss summed over tokens and divided by the step's loss tokens (times the
world size: DDP averages), StreamLR on the optimizer. ``--stops 7,8``: save the loader, model and
optimizer state after 7 and 8 microbatches (and run on to the end); ``--resume-from DIR``: in this new
process, resume each state saved in DIR in turn, to the end. Each rank writes what it trained (step,
micro, stream ids, lr, loss), per run, to ``--log-dir``/rank-R.json."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import torch.distributed as dist

from varlen_cli.online import OnlinePlanner, dataloader_for_stream
from varlen_cli.online.loader import StreamLR

VOCAB = 64


def stream(n: int, seed: int, skew: int = 0):
    """The same items on every rank (``skew``: this rank's lengths differ, to be refused)."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(3.5, 0.9, n).astype(np.int64) + 2, 200)
    for i, n_tok in enumerate(lengths.tolist()):
        yield {"input_ids": rng.integers(1, VOCAB, n_tok + (skew if i == 3 else 0)).tolist(), "group": i // 2}


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.out = torch.nn.Linear(16, VOCAB)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


def run(args, packed: bool, rank: int, world: int, resume: str | None = None) -> list:
    """Train on the stream to its end (from ``resume``'s state when given); save a state at each of
    ``args.stops`` microbatches. Returns what this rank trained."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyLM())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    budget = dict(seq_len=512, attention_cost=1e-3) if packed else dict(max_tokens=512, pad_multiple=8)
    planner = OnlinePlanner(dp=world, step_tokens=3000, lr_scaling="sqrt", base_batch_size=2500, lr_scale_by="tokens",
                            **budget)
    loader = dataloader_for_stream(stream(args.samples, 11, args.skew * rank), planner, group=lambda x: x["group"],
                                   resume="skip")
    sched = StreamLR(opt, loader)
    log = []
    if resume:
        state = torch.load(resume, weights_only=False)
        loader.load_state_dict(state["loader"])
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        log = state["log"]
    stops = [] if resume else args.stops
    for step in loader.steps():
        for batch in step:  # this rank's microbatches of the step, then the optimizer step
            info = batch["info"]
            logits = model(batch["input_ids"])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1),
                                                     reduction="sum", ignore_index=-100)
            (loss * world / batch["step_loss_tokens"]).backward()
            log.append({"step": info.step, "micro": info.micro, "ids": info.sample_ids.tolist(),
                        "lr": opt.param_groups[0]["lr"], "scale": info.lr_scale, "loss": float(loss),
                        "G": step.num_microbatches})
            if info.micro == step.num_microbatches - 1:
                opt.step()
                opt.zero_grad()
                sched.step()
            if len(log) in stops:  # a checkpoint: what a new process resumes from
                torch.save({"loader": loader.state_dict(), "model": model.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "log": list(log)},
                           os.path.join(args.log_dir, f"state-{'packed' if packed else 'padded'}-{len(log)}-{rank}.pt"))
    return log


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--stops", type=lambda s: [int(x) for x in s.split(",") if x], default=[])
    ap.add_argument("--resume-from", default=None, help="a --log-dir of a run with --stops: resume each of its states")
    ap.add_argument("--skew", type=int, default=0)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for packed in (False, True):
        mode = "packed" if packed else "padded"
        if args.resume_from is None:
            out[mode] = run(args, packed, rank, world)
            continue
        for stop in sorted(int(name.split("-")[2]) for name in os.listdir(args.resume_from)
                           if name.startswith(f"state-{mode}-") and name.endswith(f"-{rank}.pt")):
            path = os.path.join(args.resume_from, f"state-{mode}-{stop}-{rank}.pt")
            out[f"{mode}-{stop}"] = run(args, packed, rank, world, resume=path)
    with open(os.path.join(args.log_dir, f"rank-{rank}.json"), "w") as fh:
        json.dump(out, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
