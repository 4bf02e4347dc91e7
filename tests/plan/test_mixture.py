"""varlen plan --mix: exactly the weight's copies per epoch, determinism, curriculum over the union (one
chunk or several), tokens per source, the loader's MixtureDataset, bad inputs; the chunked planner's
mixture sequence (tile order, and the sorted union merged from runs) read by any range; the same bytes
for 1 and 2 workers, for a plan, its replan and its extension."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.conftest import assert_user_error
from tests.plan_helpers import write_metrics
from varlen_cli.cli import app
from varlen_cli.loader import Plan, PlanError
from varlen_cli.loader.mixture import MixtureDataset, mixture_dataloader
from varlen_cli.plan import PlanConfig, plan
from varlen_cli.plan.replan import ReplanConfig, replan
from varlen_cli.validate import ValidateConfig, validate

runner = CliRunner()
SIZES = {"a": 300, "b": 200, "c": 101, "d": 150}
WEIGHTS = {"a": 1.0, "b": 2.0, "c": 0.5, "d": 1.5}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(2)
    out = {"root": root, "L": {}, "D": {}}
    for name, n in SIZES.items():
        out["L"][name] = rng.integers(3, 300, n)
        out["D"][name] = rng.random(n) * 100
        out[name] = write_metrics(root / name, out["L"][name], out["D"][name])
    out["s"] = write_metrics(root / "s", out["L"]["b"], out["D"]["b"], sorted_by="difficulty")  # b, sorted
    return out


def _mix(dirs, names=WEIGHTS):
    return ",".join(f"{k}={dirs[k]}:{WEIGHTS[k]:g}" for k in names)


def _plan(dirs, out, **options):
    options = {"max_tokens": 1024, "dp": 2, "epochs": 2, "mix": _mix(dirs), **options}
    return plan(PlanConfig(input="", output=str(out), **options))


def _entries(path):
    t = pq.read_table(path).to_pydict()
    rows = []
    for e, s, ids, src in zip(t["epoch"], t["step"], t["sample_ids"], t["source"]):
        rows += [(e, s, k, i) for k, i in zip(src, ids)]
    return np.array(rows, dtype=np.int64).reshape(-1, 4), json.loads(pq.read_schema(path).metadata[b"varlen"])


def test_each_sample_as_often_as_its_weight(dirs, tmp_path):
    res = _plan(dirs, tmp_path / "p.parquet")
    rows, meta = _entries(res.output)
    names = [s["name"] for s in meta["mixture"]["sources"]]
    assert names == list(WEIGHTS)
    for e in range(2):
        for k, name in enumerate(names):
            n, w = SIZES[name], WEIGHTS[name]
            counts = np.bincount(rows[(rows[:, 0] == e) & (rows[:, 2] == k), 3], minlength=n)
            assert len(counts) == n
            assert counts.sum() == int(np.floor(w) * n + round((w % 1) * n))
            assert set(np.unique(counts)) <= {int(np.floor(w)), int(np.ceil(w))}
            # tokens per source per epoch: recorded and summed independently from the metrics lengths
            tokens = int((counts * dirs["L"][name]).sum())
            assert meta["mixture"]["sources"][k]["tokens_per_epoch"][e] == tokens
    assert validate(ValidateConfig(plan=res.output)).ok


def test_packed_mixture(dirs, tmp_path):
    res = _plan(dirs, tmp_path / "packed.parquet", max_tokens=None, packing=True, seq_len=512, epochs=1)
    rows, meta = _entries(res.output)
    assert meta["packing"] and len(rows) == sum(s["samples_per_epoch"] for s in meta["mixture"]["sources"])
    assert validate(ValidateConfig(plan=res.output)).ok


def test_deterministic_for_a_seed(dirs, tmp_path):
    a = _plan(dirs, tmp_path / "a.parquet", seed=4).output
    b = _plan(dirs, tmp_path / "b.parquet", seed=4).output
    c = _plan(dirs, tmp_path / "c.parquet", seed=5).output
    assert pq.read_table(a).equals(pq.read_table(b))
    ra, _ = _entries(a)
    rc, _ = _entries(c)
    half = sorted(set(ra[ra[:, 2] == 2, 3].tolist()))
    assert len(half) == round(0.5 * SIZES["c"]) and half != sorted(set(rc[rc[:, 2] == 2, 3].tolist()))


@pytest.mark.parametrize("chunk", [1 << 23, 137])
def test_curriculum_over_the_union(dirs, tmp_path, chunk):
    res = _plan(dirs, tmp_path / "c.parquet", order="curriculum", epochs=1, chunk_samples=chunk)
    rows, meta = _entries(res.output)
    names = [s["name"] for s in meta["mixture"]["sources"]]
    diff = np.array([dirs["D"][names[k]][i] for k, i in rows[:, 2:]])
    steps = rows[:, 1]
    lo = np.array([diff[steps == s].min() for s in range(steps.max() + 1)])
    hi = np.array([diff[steps == s].max() for s in range(steps.max() + 1)])
    assert (hi[:-1] <= lo[1:]).all()  # no sample of a step harder than any sample of the next step
    assert len(set(rows[steps == steps.max() // 2, 2].tolist())) > 1  # the sources are interleaved
    assert meta["chunks"]["count"] == -(-sum(s["samples_per_epoch"] for s in meta["mixture"]["sources"]) // chunk)
    assert validate(ValidateConfig(plan=res.output)).ok


def test_loader_resolves_sources(dirs, tmp_path):
    res = _plan(dirs, tmp_path / "p.parquet", epochs=1)
    datasets = {name: [(name, i) for i in range(n)] for name, n in SIZES.items()}
    seen = []
    for rank in range(2):
        loader = mixture_dataloader(datasets, res.output, rank=rank, world_size=2, collate_fn=lambda items: items,
                                    lr_scale="ignore")
        for items in loader:
            seen += items
    rows, _ = _entries(res.output)
    names = list(WEIGHTS)
    assert sorted(seen) == sorted((names[k], i) for k, i in rows[:, 2:].tolist())
    plan_ = Plan.open(res.output)
    with pytest.raises(PlanError, match=r"^source 'b' has 199 samples but the plan was made for 200: re-run"):
        MixtureDataset({**datasets, "b": datasets["b"][:-1]}, plan_)
    with pytest.raises(PlanError, match=r"^the plan mixes source\(s\) d but no dataset was given for them"):
        MixtureDataset({k: v for k, v in datasets.items() if k != "d"}, plan_)


def test_summary_lists_tokens_per_source(dirs, tmp_path):
    out = str(tmp_path / "s.parquet")
    res = runner.invoke(app, ["plan", "--mix", _mix(dirs, ["a", "c"]), "-o", out, "--max-tokens", "1024"],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "tokens of a (weight 1) per epoch" in res.output and "tokens of c (weight 0.5) per epoch" in res.output
    res = runner.invoke(app, ["inspect", out], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "tokens per source per epoch" in res.output


def test_bad_inputs(dirs, tmp_path):
    out = str(tmp_path / "x.parquet")
    a = dirs["a"]
    table = [
        (f"a={a}:0", 2, "--mix weight of 'a' must be a finite number > 0 (got 0)"),
        (f"a={a}:-1", 2, "--mix weight of 'a' must be a finite number > 0 (got -1)"),
        (f"a={a}:inf", 2, "--mix weight of 'a' must be a finite number > 0 (got inf)"),
        (f"a={a}:1e400", 2, "--mix weight of 'a' must be a finite number > 0 (got 1e400)"),
        (f"a={a}:nan", 2, "--mix weight of 'a' must be a finite number > 0 (got nan)"),
        (f"a={a}:1,c={dirs['c']}:1e-9", 2, "--mix weight 1e-09 of 'c' gives none of its 101 samples a place in an "
                                            "epoch (round(1e-09 x 101) = 0); give it a weight of at least 0.0099, or "
                                            "leave it out"),
        (f"a={a}:x", 2, "--mix weight of 'a' is not a number (got 'x')"),
        (f"{a}:1", 2, f"--mix entry '{a}:1' is not name=DIR:weight"),
        (f"a={a}:1,a={a}:2", 2, "--mix names source 'a' twice"),
        (f"a={tmp_path / 'none'}:1", 3, f"{tmp_path / 'none'} does not exist"),
    ]
    for spec, code, message in table:
        res = runner.invoke(app, ["plan", "--mix", spec, "-o", out, "--max-tokens", "1024"])
        assert_user_error(res, code, message)
    res = runner.invoke(app, ["plan", a, "--mix", f"a={a}:1", "-o", out, "--max-tokens", "1024"])
    assert_user_error(res, 2, "--mix names the directories itself: give no INPUT_DIR")
    huge = f"a={a}:1e20"
    res = runner.invoke(app, ["plan", "--mix", huge, "-o", out, "--max-tokens", "1024"])
    assert_user_error(res, 2, "--mix makes 30,000,000,000,000,000,000,000 samples per epoch, more than a plan holds "
                              "(2^31); lower the weights")


def _bytes(path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


@pytest.mark.slow
def test_two_workers_write_the_same_mixture_plan_replan_and_extension(dirs, tmp_path):
    """A mixture of several chunks (curriculum: the sorted union merged from runs; then bucket-shuffle) on 1
    and 2 workers: the same bytes for the plan, its replan (a count of copies left per sample) and its
    extension; each passes validate."""
    out = {}
    for nproc in (1, 2):
        out[nproc] = [_plan(dirs, tmp_path / f"p{nproc}.parquet", order="curriculum", curriculum_epochs=1,
                            chunk_samples=300, nproc=nproc, progress=False).output]
    parent = out[1][0]
    steps = Plan.open(parent).steps_per_epoch
    for nproc in (1, 2):
        out[nproc].append(str(tmp_path / f"r{nproc}.parquet"))
        replan(ReplanConfig(plan=parent, output=out[nproc][-1], dp=3, from_step=steps[0] // 3, nproc=nproc,
                            progress=False))
        out[nproc].append(str(tmp_path / f"e{nproc}.parquet"))
        res = runner.invoke(app, ["plan", "--extend", parent, "--epochs", "3", "-o", out[nproc][-1],
                                  "--nproc", str(nproc)])
        assert res.exit_code == 0, res.output
    for one, two in zip(out[1], out[2]):
        assert _bytes(one) == _bytes(two), one
        assert validate(ValidateConfig(plan=one)).ok


def _sources(dirs, curricular: bool, seed: int = 3):
    from varlen_cli.plan.chunked.sources import MixSource, MixtureInput

    weights = {"a": 1.0, "s": 2.0, "c": 0.5, "d": 40.0}  # s: rows not in id order; d: copies span chunks
    return MixtureInput([MixSource(k, dirs[k], w) for k, w in weights.items()], seed, curricular, False), weights


def _reference(dirs, weights: dict, curricular: bool, seed: int = 3) -> np.ndarray:
    """The virtual rows (source, id) in one process: each source's rows ``floor(w)`` times then its extra
    subset's rows (row order), or all sorted by (difficulty, source, id) over the union."""
    from varlen_cli.checks import mixture_extra

    src, ids, diff = [], [], []
    for k, (name, w) in enumerate(weights.items()):
        data = "b" if name == "s" else name
        n, d = SIZES[data], dirs["D"][data]
        row_ids = np.lexsort((np.arange(n), d)) if name == "s" else np.arange(n)  # the ids in row order
        row_of = np.argsort(row_ids)
        i = np.concatenate([np.tile(row_ids, int(w)), row_ids[np.sort(row_of[mixture_extra(n, w, seed, k)])]])
        src.append(np.full(len(i), k))
        ids.append(i)
        diff.append(d[i])
    src, ids, diff = np.concatenate(src), np.concatenate(ids), np.concatenate(diff)
    if curricular:
        order = np.lexsort((ids, src, diff))
        src, ids = src[order], ids[order]
    return np.stack([src, ids], axis=1)


@pytest.mark.parametrize("curricular", [False, True])
def test_mixture_sequence_read_by_ranges_is_the_whole(dirs, tmp_path, monkeypatch, curricular):
    """The chunked planner's mixture sequence, read by any ranges (a chunk's, or the reversed sequence's),
    is the virtual rows of the whole mixture in one process; every copy of a sample numbered once. (The
    runs' searches read blocks between held values, one every ``STRIDE``: patched down to 5 here.)"""
    from types import SimpleNamespace

    from varlen_cli.plan.chunked import sources
    from varlen_cli.plan.chunked.chunks import ChunkSpec

    monkeypatch.setattr(sources._Sorted, "STRIDE", 5)

    mix, weights = _sources(dirs, curricular)
    want = _reference(dirs, weights, curricular)
    assert mix.num_rows == len(want)
    for piece in (97, 1 << 20):  # runs of 97 rows (a curriculum's merge), or one run per source
        tmp = tmp_path / f"{piece}"
        tmp.mkdir()
        mix.runs, mix._splits = [], {}
        mix.prepare(ChunkSpec(mix.num_rows, piece), str(tmp), SimpleNamespace(rank=0, world_size=1,
                                                                               barrier=lambda: None), True)
        rng = np.random.default_rng(piece)
        cuts = np.unique(np.concatenate([[0, mix.num_rows], rng.integers(0, mix.num_rows, 12)]))
        got = [mix.read(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]
        ids = np.concatenate([g.ids for g in got])
        source = np.concatenate([g.source for g in got]).astype(np.int64)
        assert np.array_equal(np.stack([source, ids], axis=1), want)
        copy = np.concatenate([g.copy for g in got])
        last = np.concatenate([g.last for g in got])
        keys = source * 1000 + ids
        order = np.lexsort((copy, keys))
        first = np.r_[True, keys[order][1:] != keys[order][:-1]]
        rank = np.arange(len(keys)) - np.maximum.accumulate(np.where(first, np.arange(len(keys)), 0))
        assert np.array_equal(copy[order], rank)  # copies 0, 1, ... of each sample, once each
        assert np.array_equal(last[order], np.r_[first[1:], True])  # the last copy of each sample
        lengths = np.concatenate([g.length for g in got])
        names = ["b" if name == "s" else name for name in weights]
        assert np.array_equal(lengths, np.array([dirs["L"][names[k]][i] for k, i in want]))
