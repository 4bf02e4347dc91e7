"""Peak memory and time of a mixture's plan, replan and extension: this checkout against another one
(``--before``, e.g. a checkout of main), the same commands on the same files, in the same run.

    PYTHONPATH=. python benchmarks/bench_mixture.py --before /path/to/main [--virtual 4000000] [--repeats 3]

Three sources of lognormal lengths (mu 5, sigma 1, clipped to 8000): ``a`` (a metrics directory),
``b`` (a sorted one), ``c``, weights 1, 1.5 and 0.5, sized so the mixture has about ``--virtual``
virtual rows; budget 16384, dp 8. Each command runs in a fresh process (``python -c``) whose peak
resident memory is read from its own rusage (``os.wait4``); the medians of ``--repeats`` runs are
printed per checkout, and this checkout's as a ratio of ``--before``'s. Commands: ``plan --mix``
(bucket-shuffle; curriculum over the union), ``replan`` from the middle of epoch 0 onto dp 6, and
``--extend`` to 2 epochs, each also with ``--chunk-samples`` a quarter of the mixture (``chunks``:
this checkout's bounded path, or ``--chunk``; the other checkout plans a mixture in one process
whatever the option) and with ``--nproc 2``. ``--only`` runs some of them (the parent is always planned).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _inputs(d: str, virtual: int) -> dict:
    sys.path.insert(0, HERE)
    from bench_plan import write_metrics_dir

    rng = np.random.default_rng(0)
    sizes = {"a": int(virtual * 0.4), "b": int(virtual * 0.4 / 1.5), "c": int(virtual * 0.2 / 0.5)}
    out = {}
    for name, n in sizes.items():
        lengths = np.clip(rng.lognormal(5, 1, n).astype(np.int64), 1, 8000)
        out[name] = write_metrics_dir(os.path.join(d, name), lengths, sorted_by_length=name == "b")
    return out


def _commands(d: str, dirs: dict, chunk: int) -> dict:
    mix = f"a={dirs['a']}:1,b={dirs['b']}:1.5,c={dirs['c']}:0.5"
    base = f"max_tokens=16384, dp=8, overwrite=True, progress=False, mix={mix!r}, input=''"
    p, x = os.path.join(d, "p.parquet"), os.path.join(d, "x.parquet")
    plan = "from varlen_cli.plan import PlanConfig, plan\n"
    rep = ("from varlen_cli.plan.replan import ReplanConfig, ExtendConfig, replan, extend\n"
           "import json, pyarrow.parquet as pq\n")
    steps = f"json.loads(pq.read_schema({p!r}).metadata[b'varlen'])['num_steps'] // 2"
    chunks = f"chunk_samples={chunk}"
    return {
        "mix": plan + f"plan(PlanConfig(output={x!r}, {base}))",
        "mix, chunks": plan + f"plan(PlanConfig(output={x!r}, {base}, {chunks}))",
        "mix, chunks, nproc 2": plan + f"plan(PlanConfig(output={x!r}, {base}, {chunks}, nproc=2))",
        "mix curriculum, chunks": plan + f"plan(PlanConfig(output={x!r}, {base}, {chunks}, order='curriculum'))",
        "parent (mix, chunks)": plan + f"plan(PlanConfig(output={p!r}, {base}, {chunks}))",
        "replan": rep + f"replan(ReplanConfig(plan={p!r}, output={os.path.join(d, 'r.parquet')!r}, dp=6, "
                        f"from_step={steps}, overwrite=True, progress=False))",
        "extend 1->2": rep + f"extend(ExtendConfig(plan={p!r}, output={os.path.join(d, 'e.parquet')!r}, epochs=2, "
                             "overwrite=True, progress=False))",
    }


PEAK = """
import resource
hwm = [int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")]
print(max(hwm + [resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024]))
"""


def _run(code: str, pythonpath: str) -> tuple[float, int]:
    """Seconds and peak resident memory (bytes) of ``python -c code``: its own (``VmHWM``) or its largest
    worker's (``--nproc``), whichever is larger."""
    env = dict(os.environ, PYTHONPATH=pythonpath, VARLEN_NO_PROGRESS="1")
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code + "\n" + PEAK], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {code}\n{proc.stderr[-2000:]}")
    return seconds, int(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the other checkout (PYTHONPATH)")
    ap.add_argument("--virtual", type=int, default=4_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=0, help="--chunk-samples of the 'chunks' commands (default: a "
                                                        "quarter of the mixture)")
    ap.add_argument("--only", default="", help="commands to run (separated by ';'; default: all)")
    a = ap.parse_args()
    versions = {"before": a.before, "this": ROOT}
    with tempfile.TemporaryDirectory() as d:
        dirs = _inputs(d, a.virtual)
        commands = _commands(d, dirs, a.chunk or a.virtual // 4)
        results: dict = {}
        for name, code in commands.items():
            if a.only and name not in a.only.split(";") and not name.startswith("parent"):
                continue
            for version, path in versions.items():
                if version == "before" and ("nproc" in name or "curriculum" in name):
                    continue  # the other checkout refuses --nproc with --mix; its curriculum is its plain mix
                runs = [_run(code, path) for _ in range(a.repeats if not name.startswith("parent") else 1)]
                results[(name, version)] = (statistics.median(r[0] for r in runs), max(r[1] for r in runs))
                s, rss = results[(name, version)]
                print(f"{name:<26} {version:<7} {s:7.2f} s  peak {rss / 2**20:8.0f} MiB", flush=True)
        print(json.dumps({f"{n} | {v}": r for (n, v), r in results.items()}))


if __name__ == "__main__":
    main()
