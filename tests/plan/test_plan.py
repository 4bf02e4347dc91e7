"""varlen plan: end to end, bad inputs, drops, tails, determinism, metadata, row groups."""

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.conftest import sample
from tests.plan_helpers import check_plan, epoch_ids, read_plan, write_metrics
from varlen_cli.cli import app
from varlen_cli.errors import InputError, OutputError
from varlen_cli.plan import PlanConfig, plan

runner = CliRunner()


def lognormal(n, seed=0, mu=5.0, sigma=1.0, hi=4000):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mu, sigma, n).astype(np.int64), 1, hi)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    L = lognormal(2000)
    return {
        "root": root, "L": L,
        "metrics": write_metrics(root / "metrics", L, parts=2),
        "sorted": write_metrics(root / "sorted", L, sorted_by="length", parts=3),
        "tiny": write_metrics(root / "tiny", [5, 6, 7]),
        "long": write_metrics(root / "long", [10, 20, 5000, 30, 6000]),
        "empty_dir": str(_mkdir(root / "not_metrics")),
    }


def _mkdir(p):
    os.makedirs(p, exist_ok=True)
    return p


def test_cli_end_to_end_from_analyze(tmp_path):
    """analyze (real Parquet + tokenizer) -> plan via the CLI: summary printed, invariants hold."""
    from varlen_cli.analyze import AnalyzeConfig, analyze

    m = tmp_path / "m"
    analyze(AnalyzeConfig(sources=(sample("text.parquet"),), output=str(m), tokenizer=sample("tokenizer.json"),
                          progress=False))
    out = tmp_path / "plan.parquet"
    res = runner.invoke(app, ["plan", str(m), "-o", str(out), "--max-tokens", "2048", "--dp", "2",
                              "--grad-accum", "2", "--pad-multiple", "8", "--epochs", "2", "--seed", "3"])
    assert res.exit_code == 0, res.output
    for word in ("steps", "padding %", "budget fill %", "straggler", "distinct shapes", "lr_scale", "dropped"):
        assert word in res.output
    lengths = pq.read_table(m).column("length").to_numpy()
    d, md = check_plan(out, lengths, max_tokens=2048, dp=2, grad_accum=2)
    for e in range(2):
        assert sorted(epoch_ids(d, e)) == list(range(len(lengths)))
    assert epoch_ids(d, 0) != epoch_ids(d, 1)  # a different shuffle per epoch
    assert all(t % 8 == 0 for t in d["seqlen"])
    # metadata per docs/formats.md
    for key in ("varlen_version", "config", "input", "dp", "grad_accum", "epochs", "num_steps",
                "steps_per_epoch", "num_microbatches", "shapes", "warmup_steps", "base_batch_size", "lr_scaling",
                "lr_scale_by", "packing", "dropped", "stats"):
        assert key in md, key
    man = json.load(open(m / "_manifest.json"))
    assert md["input"]["artifact_id"] == man["artifact_id"] and md["input"]["kind"] == "metrics"
    assert md["input"]["dataset_digest"] == man["dataset"]["digest"]
    assert md["config"]["max_tokens"] == 2048 and md["packing"] is None
    assert sum(md["steps_per_epoch"]) == md["num_steps"]
    assert md["stats"]["over_budget_microbatches"] == 0
    assert md["lr_scale_by"] == "loss-tokens"  # the default: the base is the mean step's loss tokens
    assert abs(np.mean(d["step_loss_tokens"][:: 4]) - md["base_batch_size"]) < 1e-6


def test_row_groups_hold_whole_steps(dirs, tmp_path, monkeypatch):
    from varlen_cli.plan import writer

    monkeypatch.setattr(writer, "ROW_GROUP_TARGET", 64)  # small groups on a small plan
    out = tmp_path / "p.parquet"
    plan(PlanConfig(input=dirs["metrics"], output=str(out), max_tokens=4096, dp=3, grad_accum=1, max_samples=2))
    pf = pq.ParquetFile(out)
    assert pf.metadata.num_row_groups > 1
    prev_max = -1
    for g in range(pf.metadata.num_row_groups):
        rg = pf.metadata.row_group(g)
        assert rg.num_rows % 3 == 0
        st = rg.column(pf.schema_arrow.get_field_index("step")).statistics
        assert st.has_min_max and st.min == prev_max + 1
        prev_max = st.max


def test_same_seed_same_plan_and_sorted_by_1_or_4_workers(dirs, tmp_path):
    L = dirs["L"]
    one = write_metrics(tmp_path / "s1", L, sorted_by="length", parts=1)
    four = write_metrics(tmp_path / "s4", L, sorted_by="length", split_points=[3, 700, 1900])
    outs = []
    for i, (src, order) in enumerate([(one, "curriculum"), (four, "curriculum"), (one, "bucket-shuffle"),
                                      (four, "bucket-shuffle"), (dirs["metrics"], "bucket-shuffle")]):
        out = tmp_path / f"p{i}.parquet"
        plan(PlanConfig(input=src, output=str(out), max_tokens=4096, dp=4, order=order, seed=7, epochs=2))
        outs.append(pq.read_table(out))
    assert outs[0].equals(outs[1])
    assert outs[2].equals(outs[3])
    assert outs[2].equals(outs[4])  # bucket-shuffle does not depend on the input's row order
    out = tmp_path / "p9.parquet"
    plan(PlanConfig(input=four, output=str(out), max_tokens=4096, dp=4, order="bucket-shuffle", seed=8, epochs=2))
    assert not pq.read_table(out).equals(outs[3])


def test_with_varlen_sort(dirs, tmp_path):
    """Sorted by the real `varlen sort` with 1 and 2 workers: the same curriculum plan."""
    from varlen_cli.sort import SortConfig, sort

    tables = []
    for nproc in (1, 2):
        s = tmp_path / f"sorted{nproc}"
        sort(SortConfig(metrics_dir=dirs["metrics"], output=str(s), by=("length",), nproc=nproc, progress=False))
        out = tmp_path / f"p{nproc}.parquet"
        plan(PlanConfig(input=str(s), output=str(out), max_tokens=4096, dp=2, order="curriculum"))
        tables.append(pq.read_table(out))
        d, _ = check_plan(out, dirs["L"], max_tokens=4096, dp=2)
        lens = [max(dirs["L"][ids]) for ids in d["sample_ids"]]
        steps = np.array(d["step"])
        mx = [max(np.array(lens)[steps == s]) for s in range(steps.max() + 1)]
        mn = [min(dirs["L"][np.concatenate([np.array(i) for i, st in zip(d["sample_ids"], steps) if st == s])])
              for s in range(steps.max() + 1)]
        assert all(mx[s] <= mn[s + 1] for s in range(len(mx) - 1))
    assert tables[0].equals(tables[1])


def test_drop_long_and_tail_drop_recorded(dirs, tmp_path):
    out = tmp_path / "p.parquet"
    r = plan(PlanConfig(input=dirs["long"], output=str(out), max_tokens=4096, drop_long=True))
    d, md = read_plan(out)
    assert sorted(epoch_ids(d.to_pydict(), 0)) == [0, 1, 3]
    assert md["dropped"]["count"] == 2 and md["dropped"]["reason"]["too_long"] == 2
    assert md["dropped"]["sample_ids"] == [2, 4] and list(r.dropped_ids) == [2, 4]
    # tail: 3 single-sample microbatches (max-samples 1), dp 2 -> one is dropped
    r = plan(PlanConfig(input=dirs["tiny"], output=str(out), max_tokens=100, dp=2, max_samples=1, tail="drop",
                        overwrite=True))
    d, md = read_plan(out)
    kept = epoch_ids(d.to_pydict(), 0)
    assert len(kept) == 2 and md["dropped"]["reason"]["tail"] == 1
    assert sorted(kept + md["dropped"]["sample_ids"]) == [0, 1, 2]
    assert r.stats["dropped"] == 1


def test_tail_split_never_drops(dirs, tmp_path):
    out = tmp_path / "p.parquet"
    # 3 samples fit one microbatch; dp 3 needs 3: split into singles
    plan(PlanConfig(input=dirs["tiny"], output=str(out), max_tokens=100, dp=3))
    d, md = check_plan(out, [5, 6, 7], max_tokens=100, dp=3)
    assert sorted(epoch_ids(d, 0)) == [0, 1, 2] and md["num_steps"] == 1


def test_overwrite_is_atomic(dirs, tmp_path):
    out = tmp_path / "p.parquet"
    plan(PlanConfig(input=dirs["metrics"], output=str(out), max_tokens=4096, seed=1))
    old = out.read_bytes()
    with pytest.raises(OutputError, match="already exists; pass --overwrite"):
        plan(PlanConfig(input=dirs["metrics"], output=str(out), max_tokens=4096))
    assert out.read_bytes() == old
    # a failing plan leaves the old file alone and no temporary file behind
    with pytest.raises(InputError):
        plan(PlanConfig(input=dirs["long"], output=str(out), max_tokens=4096, overwrite=True))
    assert out.read_bytes() == old
    plan(PlanConfig(input=dirs["metrics"], output=str(out), max_tokens=4096, overwrite=True))
    assert pq.read_table(out).num_rows > 0 and out.read_bytes() != old
    assert sorted(os.listdir(tmp_path)) == ["p.parquet"]
    # --overwrite replaces only a varlen plan
    out.write_text("old")
    with pytest.raises(OutputError, match="is not a varlen plan; --overwrite replaces only varlen outputs"):
        plan(PlanConfig(input=dirs["metrics"], output=str(out), max_tokens=4096, overwrite=True))
    assert out.read_text() == "old"


def test_compile_warmup_and_curriculum_epochs(dirs, tmp_path):
    out = tmp_path / "p.parquet"
    plan(PlanConfig(input=dirs["sorted"], output=str(out), max_tokens=4096, dp=4, grad_accum=2, num_shapes=5,
                    static_shapes=True, compile_warmup=True, order="curriculum", epochs=3, curriculum_epochs=1))
    d, md = check_plan(out, dirs["L"], max_tokens=4096, dp=4, grad_accum=2)
    w = md["warmup_steps"]
    assert w == 3 and len(md["shapes"]) == 5  # ceil(5 shapes / 2 micro)
    for r in range(4):
        seen = {sid for s, rk, sid in zip(d["step"], d["rank"], d["shape_id"]) if s < w and rk == r}
        assert seen == set(range(5))
    assert md["orders"] == ["curriculum", "bucket-shuffle", "bucket-shuffle"]
    for e in range(3):
        assert sorted(epoch_ids(d, e)) == list(range(2000))


def test_lr_scaling_options(dirs, tmp_path):
    out = tmp_path / "p.parquet"
    for scaling, by, base in [("sqrt", "tokens", None), ("linear", "samples", 32.0), ("none", "samples", None)]:
        plan(PlanConfig(input=dirs["metrics"], output=str(out), max_tokens=4096, dp=2, lr_scaling=scaling,
                        lr_scale_by=by, base_batch_size=base, overwrite=True))
        d, md = check_plan(out, dirs["L"], max_tokens=4096, dp=2)  # checks the formula
        if base:
            assert md["base_batch_size"] == base


def test_packed_plan(dirs, tmp_path):
    out = tmp_path / "p.parquet"
    r = plan(PlanConfig(input=dirs["metrics"], output=str(out), packing=True, seq_len=4096, max_tokens=16384,
                        dp=2, grad_accum=2, max_per_row=32, epochs=2))
    d, md = check_plan(out, dirs["L"], max_tokens=16384, dp=2, grad_accum=2, packed=True)
    assert md["packing"]["rows_per_microbatch"] == 4 and md["packing"]["max_per_row"] == 32
    assert len(md["shapes"]) == 1 and md["shapes"][0] == [4, 4096]
    for e in range(2):
        assert sorted(epoch_ids(d, e)) == list(range(2000))
    for rows, in zip(d["sample_rows"]):
        assert max(np.bincount(rows)) <= 32
    assert 0.9 < r.packing["efficiency"] <= 1.0
    # split-long: chunks cover every token once
    out2 = tmp_path / "p2.parquet"
    plan(PlanConfig(input=dirs["long"], output=str(out2), packing=True, seq_len=1024, split_long=True))
    d2, _ = read_plan(out2)
    d2 = d2.to_pydict()
    covered = {}
    for ids, starts, lens in zip(d2["sample_ids"], d2["sample_starts"], d2["sample_lengths"]):
        for i, s, n in zip(ids, starts, lens):
            covered.setdefault(i, []).append((s, n))
    for i, L in enumerate([10, 20, 5000, 30, 6000]):
        segs = sorted(covered[i])
        assert segs[0][0] == 0 and sum(n for _, n in segs) == L
        assert all(a + n == b for (a, n), (b, _) in zip(segs, segs[1:]))


BAD = [
    (["--max-tokens", "3"], "tiny", 3, "the budget is below every sample: --max-tokens 3 fits none of the 3 samples "
                                       "(the shortest has 5 tokens)"),
    (["--max-tokens", "4096"], "long", 3, "2 samples do not fit the budget --max-tokens 4,096 (the longest has 6,000 "
                                          "tokens); raise --max-tokens or pass --drop-long"),
    (["--max-tokens", "100", "--dp", "0"], "tiny", 2, "--dp must be >= 1 (got 0)"),
    (["--max-tokens", "100", "--grad-accum", "0"], "tiny", 2, "--grad-accum must be >= 1 (got 0)"),
    (["--max-tokens", "0"], "tiny", 2, "--max-tokens must be >= 1 (got 0)"),
    ([], "tiny", 2, "--max-tokens is required (or --max-memory with --memory-profile, or --packing --seq-len T)"),
    (["--max-tokens", "100", "--order", "curriculum"], "tiny", 2, "--order curriculum needs a sorted input, but {tiny} "
                                                                  "is a metrics directory (sample_id order); sort it "
                                                                  "first: `varlen sort {tiny} -o SORTED_DIR`"),
    (["--max-tokens", "100"], "empty_dir", 3, "{empty_dir} is not a varlen metrics or sorted directory (no "
                                              "_manifest.json); create one with `varlen analyze` (and `varlen sort` "
                                              "for curriculum order)"),
    (["--max-tokens", "100"], "missing", 3, "{missing} does not exist"),
    (["--max-tokens", "100", "--static-shapes"], "tiny", 2, "--static-shapes needs --num-shapes K (the number of (B, "
                                                            "T) shapes)"),
    (["--max-tokens", "100", "--dp", "4"], "tiny", 3, "3 samples cannot fill 4 microbatch slots (1 step(s) x dp 4 x "
                                                      "grad-accum 1) without duplicating samples; lower "
                                                      "--dp/--grad-accum or pass --tail drop"),
    (["--max-tokens", "100", "--dp", "4", "--tail", "drop"], "tiny", 3, "3 samples are fewer than the 4 microbatches "
                                                                        "of one step (dp x grad-accum); nothing would "
                                                                        "be left after --tail drop: lower "
                                                                        "--dp/--grad-accum"),
    (["--max-tokens", "100", "--curriculum-epochs", "1"], "tiny", 2, "--curriculum-epochs needs --order curriculum or "
                                                                     "reverse"),
    (["--max-tokens", "100", "--seq-len", "64"], "tiny", 2, "--seq-len needs --packing"),
    (["--packing"], "tiny", 2, "--packing needs --seq-len T (the packed row length)"),
    (["--packing", "--seq-len", "1000"], "long", 3, "2 samples are longer than --seq-len 1,000 (the longest has 6,000 "
                                                    "tokens); pass --split-long, --drop-long or a larger --seq-len"),
    (["--packing", "--seq-len", "100", "--drop-long", "--split-long"], "long", 2, "--drop-long and --split-long "
                                                                                  "exclude each other"),
    (["--packing", "--seq-len", "1000", "--max-tokens", "500"], "tiny", 2, "--seq-len 1000 does not fit the budget "
                                                                           "--max-tokens 500"),
    (["--max-tokens", "100", "--attention-cost", "-1"], "tiny", 2, "--attention-cost must be >= 0 (got -1.0)"),
    (["--max-tokens", "100", "--output-exists"], "tiny", 4, "output {out} already exists; pass --overwrite to replace "
                                                            "it"),
]


@pytest.mark.parametrize("args,src,code,message", BAD, ids=[b[3][:40] for b in BAD])
def test_bad_inputs(dirs, tmp_path, args, src, code, message):
    out = tmp_path / "plan.parquet"
    if "--output-exists" in args:
        args = [a for a in args if a != "--output-exists"]
        out.write_text("x")
    paths = dict(dirs, missing=str(dirs["root"] / "nope"), out=str(out))
    res = runner.invoke(app, ["plan", paths[src], "-o", str(out)] + args)
    assert res.exit_code == code, res.output
    want = message.format(**{k: v for k, v in paths.items() if isinstance(v, str)})
    assert res.stderr.strip() == f"varlen: error: {want}" if hasattr(res, "stderr") else want in res.output
    if "--output-exists" not in args and code != 4:
        assert not out.exists()


# Choice options are Literal types: typer rejects a bad value before the library runs (one line through
# `varlen`'s main), and the library's generic check rejects it from Python with the message it always had.
BAD_CHOICES = [
    ("order", "sorted", "--order must be one of curriculum, reverse, bucket-shuffle, random (got 'sorted')",
     "'sorted' is not one of 'curriculum', 'reverse', 'bucket-shuffle', 'random'"),
    ("lr_scaling", "cubic", "--lr-scaling must be one of linear, sqrt, none (got 'cubic')",
     "'cubic' is not one of 'linear', 'sqrt', 'none'"),
]


@pytest.mark.parametrize("name,value,message,cli_message", BAD_CHOICES, ids=[b[0] for b in BAD_CHOICES])
def test_bad_choices(dirs, tmp_path, monkeypatch, capsys, name, value, message, cli_message):
    from varlen_cli.cli import main
    from varlen_cli.errors import UsageError

    out = tmp_path / "plan.parquet"
    with pytest.raises(UsageError) as info:
        plan(PlanConfig(input=dirs["tiny"], output=str(out), max_tokens=100, **{name: value}))
    assert info.value.message == message and info.value.exit_code == 2
    flag = "--" + name.replace("_", "-")
    # main() defaults VARLEN_START_METHOD to fork for its fresh process; keep that out of this test process
    # (later multi-worker tests would fork a threaded pytest), and restore the variable afterwards.
    monkeypatch.setenv("VARLEN_START_METHOD", os.environ.get("VARLEN_START_METHOD", "spawn"))
    argv = ["varlen", "plan", dirs["tiny"], "-o", str(out), "--max-tokens", "100", flag, value]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    err = capsys.readouterr().err  # ends "(see `PROG plan --help`)"; PROG depends on how python was started
    assert err.startswith(f"varlen: error: Invalid value for '{flag}': Value error, {cli_message}. (see `")
    assert err.endswith("plan --help`)\n") and err.count("\n") == 1
    assert not out.exists()


def test_reverse_order_survives_a_tail_split(tmp_path):
    """Regression (found by hypothesis in CI): splitting a reverse-order microbatch for the tail must
    keep the halves in sequence order, so steps stay non-increasing in difficulty."""
    import numpy as np
    import pyarrow.parquet as pq

    from tests.plan_helpers import write_metrics
    from varlen_cli.plan import PlanConfig, plan

    lengths = np.array([0] * 9 + [1, 2])
    src = write_metrics(str(tmp_path / "in"), lengths, sorted_by="length")
    out = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=src, output=out, max_tokens=64, dp=1, grad_accum=2, order="reverse", max_samples=5))
    rows = pq.read_table(out).select(["step", "sample_ids"]).to_pylist()
    per_step = {}
    for r in rows:
        per_step.setdefault(r["step"], []).extend(lengths[r["sample_ids"]].tolist())
    steps = [per_step[s] for s in sorted(per_step)]
    assert all(min(a) >= max(b) for a, b in zip(steps, steps[1:]))
    assert [i for r in rows for i in r["sample_ids"]] == list(range(10, -1, -1))


def test_steps_that_complete_no_sample_are_reported(dirs, tmp_path):
    """A --split-long step holding only non-final chunks completes no sample: with the LR scaled by
    samples its lr_scale is 0. The summary counts those steps (and says what to do), from the plan's
    own columns; the CLI table shows the row."""
    out = tmp_path / "p.parquet"
    r = plan(PlanConfig(input=dirs["long"], output=str(out), packing=True, seq_len=256, split_long=True,
                        lr_scale_by="samples"))
    t = pq.read_table(out).to_pydict()
    per_step = {s: (n, lr) for s, n, lr in zip(t["step"], t["step_samples"], t["lr_scale"])}
    idle = sorted(s for s, (n, lr) in per_step.items() if n == 0)
    assert idle and all(per_step[s][1] == 0 for s in idle)
    assert r.stats["zero_lr_scale_steps"] == len(idle)
    for by in ("tokens", "loss-tokens"):
        by_tokens = plan(PlanConfig(input=dirs["long"], output=str(tmp_path / "q.parquet"), packing=True, seq_len=256,
                                    split_long=True, lr_scale_by=by, overwrite=True))
        assert "zero_lr_scale_steps" not in by_tokens.stats
