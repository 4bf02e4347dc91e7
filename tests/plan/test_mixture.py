"""varlen plan --mix: exactly the weight's copies per epoch, determinism, curriculum over the union,
tokens per source, the loader's MixtureDataset, bad inputs."""

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


def test_curriculum_over_the_union(dirs, tmp_path):
    res = _plan(dirs, tmp_path / "c.parquet", order="curriculum", epochs=1)
    rows, meta = _entries(res.output)
    names = [s["name"] for s in meta["mixture"]["sources"]]
    diff = np.array([dirs["D"][names[k]][i] for k, i in rows[:, 2:]])
    steps = rows[:, 1]
    lo = np.array([diff[steps == s].min() for s in range(steps.max() + 1)])
    hi = np.array([diff[steps == s].max() for s in range(steps.max() + 1)])
    assert (hi[:-1] <= lo[1:]).all()  # no sample of a step harder than any sample of the next step
    assert len(set(rows[steps == steps.max() // 2, 2].tolist())) > 1  # the sources are interleaved


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
        (f"a={a}:0", 2, "--mix weight of 'a' must be > 0 (got 0)"),
        (f"a={a}:-1", 2, "--mix weight of 'a' must be > 0 (got -1)"),
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


def test_extend_of_a_mixture_stays_in_one_process(dirs, tmp_path):
    """A mixture plan is extended in one process (its samples held): --nproc is refused in one line, for
    --extend of a mixture as for --mix itself; without it the extension passes validate."""
    parent = _plan(dirs, tmp_path / "p.parquet", epochs=1).output
    out = str(tmp_path / "e.parquet")
    assert_user_error(runner.invoke(app, ["plan", "--extend", parent, "--epochs", "2", "-o", out, "--nproc", "2"]), 2,
                      "--nproc applies to plans of one metrics or sorted directory: a mixture plan (--mix) is extended "
                      "in one process")
    assert_user_error(runner.invoke(app, ["plan", "--mix", _mix(dirs), "--max-tokens", "1024", "-o", out,
                                          "--nproc", "2"]), 2,
                      "--nproc applies to plans of one metrics or sorted directory, not to --mix")
    res = runner.invoke(app, ["plan", "--extend", parent, "--epochs", "2", "-o", out])
    assert res.exit_code == 0, res.output
    assert validate(ValidateConfig(plan=out)).ok
