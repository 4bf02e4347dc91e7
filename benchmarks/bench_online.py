"""The step planner in-process (varlen_cli.online) against the balancers trainers carry, same run,
same inputs: one optimizer step of N samples for dp ranks under a budget of B tokens a microbatch.

Planners (each on the same lengths, one core: OMP/MKL threads 1, the process pinned to one CPU):

* ``varlen-packed``: ``plan_step(lengths, dp, seq_len=B, attention_cost=A)`` (rows of B tokens, one a
  microbatch); ``varlen-padded``: ``plan_step(lengths, dp, max_tokens=B, attention_cost=A)``
  (B x T + A x B x T^2 <= B);
* ``verl``: verl's ``get_seqlen_balanced_partitions`` (Karmarkar-Karp) as its trainer uses it: the
  step's samples partitioned over the dp ranks (``equal_size=True``, ``balance_batch``), then each
  rank's into ``ceil(tokens / B)`` microbatches synced to the largest count over the ranks
  (``rearrange_micro_batches`` with ``same_micro_num_in_dp``), both on the cost ``l + A l^2`` (verl's own
  ``calculate_workload`` is ``24576 l + l^2``, the same shape);
* ``trl``: TRL AsyncGRPO's ``TokenBudgetBatcher`` (microbatches of dp rows, each row under B tokens,
  samples placed one by one on the row of least sum(l^2) that fits), with the microbatch it holds at
  the end of the stream flushed (it would carry it into the next step);
* ``lhotse``: Lhotse's ``DynamicBucketingSampler`` on the stream of cuts (duration = tokens,
  ``max_duration=B``, ``quadratic_duration=1/A``: its constraint is then B x T (1 + A T), ours), one
  sampler per rank (``world_size=dp``, ``rank=r``), as a trainer runs it;
* ``first-fit``: each sample in arrival order into the first microbatch with room (sum <= B), the
  microbatches dealt to ranks round-robin.

The peers' code is read at run time from their repositories' mirrors (``--mirror``, default
``/work/.mirror``: ``git show HEAD:<file>``, the named functions compiled alone with the few names they
use; nothing of theirs is committed): verl ``verl/utils/seqlen_balancing.py``, TRL
``trl/experimental/async_grpo/async_grpo_trainer.py``; Lhotse is imported (``pip install lhotse``).

Reported per planner and input: rank imbalance max/mean of sum(l + A l^2) over each rank's samples
(padded plans also in their padded cost), budget violations (microbatches over B in the planner's
own budget: packed sum(l), padded B x T (1 + A T)), fill (tokens / (microbatches x B)) and padding
(padded-tensor plans: empty share of B x T), the microbatch-count mismatch across ranks (max - min),
samples lost, and planning latency: the median CPU milliseconds of ``--repeat`` runs (``time.process_time``:
this machine is shared, wall clocks count the neighbours).

Inputs: RL rollouts (``grpo-8``, ``grpo-16``: groups of 8 / 16 responses sharing a prompt, prompt
lognormal median 400 tokens, response lognormal median 900, sigma 1, capped at 16k) and the real
corpora (``fortunes``, ``manpages``, ``manpages-paragraphs``: benchmarks/corpora.py tokenised with
sample_data/tokenizer.json, tiled to N in a seeded random order); rollouts in generation order (a
group's responses one after another); every length capped where one sample alone fills a padded
microbatch (l (1 + A l) <= B: 22,483 tokens at the defaults).

``--stream`` also compares the streaming planner with the offline plan on the same data: N samples
through ``OnlinePlanner(step_samples=N/8)`` against ``varlen plan --packing --seq-len B`` (grad-accum
the streaming steps' fewest, median or most microbatches a rank, the best of them) on the same
lengths: the fill of each (with and without the stream's last, flushed step).

    PYTHONPATH=. python benchmarks/bench_online.py --sizes 8192,65536 --repeat 5 --stream
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)

import numpy as np  # noqa: E402

from varlen_cli.online import OnlinePlanner, plan_step  # noqa: E402

INPUTS = ("grpo-8", "grpo-16", "fortunes", "manpages", "manpages-paragraphs")
PLANNERS = ("varlen-packed", "varlen-padded", "verl", "trl", "lhotse", "first-fit")


# -- inputs ---------------------------------------------------------------------------------------------
def rollout_lengths(n: int, group: int, seed: int = 0) -> np.ndarray:
    """Prompt + response lengths of n rollouts, ``group`` responses a prompt (in generation order)."""
    rng = np.random.default_rng(seed)
    prompts = -(-n // group)
    prompt = np.clip(rng.lognormal(np.log(400), 0.7, prompts), 16, 4096).astype(np.int64)
    response = np.clip(rng.lognormal(np.log(900), 1.0, prompts * group), 1, 16384).astype(np.int64)
    return (np.repeat(prompt, group) + response)[:n]


def input_lengths(name: str, n: int, work: str) -> np.ndarray | None:
    if name.startswith("grpo-"):
        return rollout_lengths(n, int(name.split("-")[1]))
    from bench_packing import corpus_lengths  # the Debian corpora, tokenised, tiled and shuffled

    return corpus_lengths(name, work, n)


# -- the peers, read from their mirrors --------------------------------------------------------------------
def from_mirror(mirror: str, repo: str, path: str, names: tuple, namespace: dict) -> dict:
    """Compile the top-level functions/classes ``names`` of ``repo``'s ``path`` (its mirror's HEAD) into
    ``namespace``; returns it (KeyError when one is missing)."""
    git_dir = os.path.join(mirror, repo.replace("/", "+"), "repo")
    src = subprocess.run(["git", "--git-dir", git_dir, "show", f"HEAD:{path}"], capture_output=True, text=True,
                         check=True).stdout
    tree = ast.parse(src)
    found = [node for node in tree.body if getattr(node, "name", None) in names]
    if len(found) != len(names):
        raise KeyError(f"{repo}:{path} lacks {set(names) - {n.name for n in found}}")
    exec(compile(ast.Module(found, []), f"{repo}/{path}", "exec"), namespace)
    namespace["__source__"] = f"{repo}@{_head(git_dir)}:{path}"
    return namespace


def _head(git_dir: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def load_peers(mirror: str) -> dict:
    import heapq
    import logging

    peers, notes = {}, {}
    try:
        peers["verl"] = from_mirror(mirror, "volcengine/verl", "verl/utils/seqlen_balancing.py",
                                    ("karmarkar_karp", "get_seqlen_balanced_partitions"), {"heapq": heapq})
    except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
        notes["verl"] = f"unavailable ({type(e).__name__}: {e})"
    try:
        import torch

        peers["trl"] = from_mirror(mirror, "huggingface/trl", "trl/experimental/async_grpo/async_grpo_trainer.py",
                                   ("TokenBudgetBatcher",), {"torch": torch, "logger": logging.getLogger("trl")})
    except Exception as e:  # noqa: BLE001
        notes["trl"] = f"unavailable ({type(e).__name__}: {e})"
    try:
        import lhotse

        peers["lhotse"] = {"__source__": f"lhotse {lhotse.__version__} (installed)"}
    except Exception as e:  # noqa: BLE001
        notes["lhotse"] = f"unavailable ({type(e).__name__}: {e})"
    return peers, notes


# -- each planner: per rank, its microbatches (arrays of sample indices) ----------------------------------
def plan_varlen(lengths, dp, budget, a, packed):
    kw = dict(seq_len=budget) if packed else dict(max_tokens=budget)
    p = plan_step(lengths, dp=dp, attention_cost=a, **kw)
    return [[np.asarray(m) for m in micros] for micros in p.ranks], p


def plan_verl(ns, lengths, dp, budget, a):
    kk = ns["get_seqlen_balanced_partitions"]
    cost = (lengths + a * lengths.astype(np.float64) ** 2).tolist()
    parts = kk(cost, dp, equal_size=True)  # balance_batch: the step over the ranks
    counts = [min(len(p), -(-int(lengths[p].sum()) // budget)) for p in parts]
    synced = max(counts)  # rearrange_micro_batches: the count all-reduced to the largest (same_micro_num_in_dp)
    out = []
    for p in parts:
        p = np.asarray(p)
        micro = kk([cost[i] for i in p.tolist()], min(synced, len(p)), equal_size=False)
        out.append([p[np.asarray(m, np.int64)] for m in micro])
    return out


def plan_trl(ns, lengths, dp, budget):
    items = [{"input_ids": range(int(n))} for n in lengths.tolist()]
    index = {id(item): i for i, item in enumerate(items)}
    batcher = ns["TokenBudgetBatcher"](items, dp, budget)
    micro = [[[index[id(x)] for x in row] for row in mb] for mb in batcher]
    done = {i for mb in micro for row in mb for i in row}
    held = [i for i in range(len(items)) if i not in done and lengths[i] <= budget]
    if held:  # what it holds at the end (it yields a microbatch only when the next sample does not fit)
        rows, loads, sq = [[] for _ in range(dp)], [0] * dp, [0] * dp
        for i in held:
            fits = [r for r in range(dp) if loads[r] + lengths[i] <= budget]
            r = min(fits, key=lambda j: sq[j])
            rows[r].append(i)
            loads[r] += int(lengths[i])
            sq[r] += int(lengths[i]) ** 2
        micro.append(rows)
    return [[np.asarray(mb[r], np.int64) for mb in micro] for r in range(dp)]


def plan_lhotse(lengths, dp, budget, a, cuts=None):
    from lhotse.dataset.sampling import DynamicBucketingSampler

    index = {c.id: i for i, c in enumerate(cuts)}
    out = []
    for r in range(dp):
        sampler = DynamicBucketingSampler(cuts, max_duration=float(budget), quadratic_duration=(1.0 / a) if a else None,
                                          num_buckets=30, shuffle=False, drop_last=False, world_size=dp, rank=r,
                                          buffer_size=len(lengths), seed=0)
        # a cut lhotse repeats to give every rank its batches comes back as "<id>_dup<k>": counted as duplicated
        out.append([np.asarray([index[c.id.split("_dup")[0]] for c in batch], np.int64) for batch in sampler])
    return out


def lhotse_cuts(lengths):
    from lhotse import CutSet
    from lhotse.testing.dummies import dummy_cut

    return CutSet.from_cuts(dummy_cut(i, duration=float(n)) for i, n in enumerate(lengths.tolist()))


def plan_first_fit(lengths, dp, budget):
    loads = np.zeros(0, np.int64)
    where = np.empty(len(lengths), np.int64)
    for i, n in enumerate(lengths.tolist()):
        room = np.flatnonzero(loads + n <= budget)
        if len(room):
            where[i] = room[0]
            loads[room[0]] += n
        else:
            where[i] = len(loads)
            loads = np.append(loads, n)
    micro = [np.flatnonzero(where == m) for m in range(len(loads))]
    return [micro[r::dp] for r in range(dp)]


# -- measures --------------------------------------------------------------------------------------------
def measures(ranks, lengths, budget, a, kind) -> dict:
    """kind: 'packed' (sum l <= B a microbatch, rows of B) or 'padded' (B x T (1 + A T) <= B)."""
    cost = lengths + a * lengths.astype(np.float64) ** 2
    per_rank = np.array([sum(float(cost[m].sum()) for m in micros) for micros in ranks])
    counts = [len(micros) for micros in ranks]
    mbs = [m for micros in ranks for m in micros]
    tokens = int(sum(int(lengths[m].sum()) for m in mbs))
    planned = np.concatenate(mbs) if mbs else np.zeros(0, np.int64)
    out = {"imbalance": float(per_rank.max() / per_rank.mean()) if per_rank.mean() else 1.0,
           "count_mismatch": int(max(counts) - min(counts)), "microbatches_per_rank": [min(counts), max(counts)],
           "fill": tokens / (len(mbs) * budget) if mbs else 0.0,
           "lost": int(len(lengths) - len(np.unique(planned))),
           "duplicated": int(len(planned) - len(np.unique(planned)))}
    if kind == "packed":
        out["violations"] = int(sum(int(lengths[m].sum()) > budget for m in mbs))
    else:
        shape = [(len(m), int(lengths[m].max()) if len(m) else 0) for m in mbs]
        padded = [b * t for b, t in shape]
        model = np.array([sum(len(m) * int(lengths[m].max(initial=0)) * (1 + a * int(lengths[m].max(initial=0)))
                              for m in micros) for micros in ranks])
        out["violations"] = int(sum(b * t * (1 + a * t) > budget * (1 + 1e-12) for b, t in shape))
        out["padding"] = 1.0 - tokens / sum(padded) if sum(padded) else 0.0
        out["imbalance_padded_cost"] = float(model.max() / model.mean()) if model.mean() else 1.0
    return out


def timed(fn, repeat: int) -> tuple:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.process_time()
        result = fn()
        times.append(time.process_time() - t0)
    return result, float(np.median(times)) * 1e3


def run_input(name, lengths, args, peers) -> list[dict]:
    dp, budget, a = args.dp, args.budget, args.attention_cost
    rows = []
    reps = args.repeat if len(lengths) <= 10000 else max(1, args.repeat // 2 + 1)
    jobs = {"varlen-packed": (lambda: plan_varlen(lengths, dp, budget, a, True)[0], "packed"),
            "varlen-padded": (lambda: plan_varlen(lengths, dp, budget, a, False)[0], "padded"),
            "first-fit": (lambda: plan_first_fit(lengths, dp, budget), "packed")}
    if "verl" in peers:
        jobs["verl"] = (lambda: plan_verl(peers["verl"], lengths, dp, budget, a), "packed")
    if "trl" in peers:
        jobs["trl"] = (lambda: plan_trl(peers["trl"], lengths, dp, budget), "packed")
    if "lhotse" in peers:
        cuts = lhotse_cuts(lengths)  # made once; the samplers' passes are timed
        jobs["lhotse"] = (lambda: plan_lhotse(lengths, dp, budget, a, cuts), "padded")
    for planner in args.planners:
        if planner not in jobs:
            continue
        fn, kind = jobs[planner]
        ranks, ms = timed(fn, reps if planner.startswith("varlen") else max(1, min(reps, args.peer_repeat)))
        row = {"input": name, "n": len(lengths), "planner": planner, "ms": ms,
               **measures(ranks, lengths, budget, a, kind)}
        if planner == "lhotse":
            row["ms"] /= dp  # one sampler per rank, each on its own process: the time of one of them
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# -- streaming against offline --------------------------------------------------------------------------
def stream_vs_offline(name, lengths, args) -> dict:
    from bench_plan import write_metrics_dir

    from varlen_cli.plan import PlanConfig, plan

    dp, budget = args.dp, args.budget
    planner = OnlinePlanner(dp=dp, seq_len=budget, attention_cost=args.attention_cost,
                            step_samples=max(1, len(lengths) // 8))
    steps = list(planner.steps(lengths))
    mbs = sum(s.plan.num_microbatches * dp for s in steps)
    online_fill = int(lengths.sum()) / (mbs * budget)
    head = steps[:-1]  # all but the flush (the stream's end: at most one round of microbatches mostly empty)
    head_fill = sum(int(s.lengths.sum()) for s in head) / (sum(s.plan.num_microbatches * dp for s in head) * budget) \
        if head else online_fill
    counts = [s.plan.num_microbatches for s in steps[:-1]] or [steps[0].plan.num_microbatches]
    offline = {}  # grad-accum -> the offline plan's fill and steps: the streaming steps' fewest, median, most
    for ga in sorted({min(counts), int(np.median(counts)), max(counts)}):
        with tempfile.TemporaryDirectory(prefix="varlen-bench-online-") as tmp:
            metrics = write_metrics_dir(os.path.join(tmp, "m"), lengths)
            res = plan(PlanConfig(input=metrics, output=os.path.join(tmp, "plan.parquet"), packing=True,
                                  seq_len=budget, dp=dp, grad_accum=ga, attention_cost=args.attention_cost,
                                  progress=False))
            import pyarrow.parquet as pq

            table = pq.read_table(os.path.join(tmp, "plan.parquet"), columns=["tokens"])
            offline[ga] = (int(np.asarray(table.column("tokens")).sum()) / (table.num_rows * budget), res.num_steps)
    ga = max(offline, key=lambda g: offline[g][0])  # the offline plan's best fill
    offline_fill = offline[ga][0]
    res = type("R", (), {"num_steps": offline[ga][1]})
    row = {"input": name, "n": len(lengths), "stream_steps": len(steps), "grad_accum": ga,
           "online_fill": online_fill, "online_fill_before_flush": head_fill, "offline_fill": offline_fill,
           "offline_steps": res.num_steps, "online_imbalance_max": max(s.plan.imbalance for s in steps)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8192,65536")
    ap.add_argument("--inputs", default=",".join(INPUTS))
    ap.add_argument("--planners", default=",".join(PLANNERS))
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--budget", type=int, default=32768, help="tokens a microbatch (B)")
    ap.add_argument("--attention-cost", type=float, default=1 / (12 * 4096), help="A (default: d = 4096)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per varlen measurement (median)")
    ap.add_argument("--peer-repeat", type=int, default=3, help="runs per peer measurement (median)")
    ap.add_argument("--mirror", default="/work/.mirror")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "varlen-bench-online"))
    ap.add_argument("--stream", action="store_true", help="also the streaming planner against the offline plan")
    ap.add_argument("--json", default=None, help="write every row here")
    args = ap.parse_args()
    args.planners = args.planners.split(",")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    peers, notes = load_peers(args.mirror)
    for peer, ns in peers.items():
        print(f"# {peer}: {ns['__source__']}", flush=True)
    for peer, note in notes.items():
        print(f"# {peer}: {note}", flush=True)
    a, b = args.attention_cost, args.budget  # every sample fits a padded microbatch alone: l (1 + A l) <= B
    longest = int((-1 + np.sqrt(1 + 4 * a * b)) / (2 * a)) if a else b
    while longest * (1 + a * longest) > b:
        longest -= 1
    print(f"# lengths capped at {longest:,} (one sample alone within B x T (1 + A T) <= {b:,})", flush=True)
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        for name in args.inputs.split(","):
            lengths = input_lengths(name, n, args.work)
            if lengths is None:
                continue
            lengths = np.minimum(lengths, longest)
            rows += run_input(name, lengths, args, peers)
            if args.stream and n == max(int(x) for x in args.sizes.split(",")):
                rows.append(stream_vs_offline(name, lengths, args))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
