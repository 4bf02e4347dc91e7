"""``varlen sort`` in one process: key packing, exact splitters over simulated ranks, the whole
stage at world size 1 (both engines), the manifest, the CLI summary and bad inputs."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.conftest import assert_user_error
from tests.sort_helpers import (
    DISTRIBUTIONS,
    concat,
    distribution,
    leftovers,
    manifest_of,
    metrics_columns,
    read_sorted,
    reference_order,
    simulate,
    write_metrics,
)
from varlen_cli.cli import app
from varlen_cli.errors import InputError
from varlen_cli.runtime import artifacts
from varlen_cli.sort import SortConfig, sort
from varlen_cli.sort import keys as sk

COLUMNS = ("sample_id", "length", "difficulty")


def assert_rows(table: pa.Table, columns: dict, order: np.ndarray) -> None:
    """``table`` holds exactly the rows of ``columns`` in ``order`` (bit for bit, NaN included)."""
    assert table.num_rows == len(order)
    for name in columns:
        got = table.column(name).to_numpy()
        want = np.asarray(columns[name])[order]
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name


# -- keys ------------------------------------------------------------------------------------------
def test_splitmix64_reference_values():
    # splitmix64 of states 1*golden, 2*golden, ...: the published sequence for seed 0
    out = sk.splitmix64(np.array([0, 0x9E3779B97F4A7C15], dtype=np.uint64))
    assert [hex(int(x)) for x in out] == ["0xe220a8397b1dcdaf", "0x6e789e6aa1b965f4"]


def test_shuffle_hash_is_a_pure_bijection():
    ids = np.arange(100_000, dtype=np.int64)
    h = sk.shuffle_hash(ids, 42)
    assert len(np.unique(h)) == len(ids)
    assert np.array_equal(h[1234:5678], sk.shuffle_hash(ids[1234:5678], 42))  # no dependence on neighbours
    assert not np.array_equal(h, sk.shuffle_hash(ids, 43))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(allow_nan=False, width=64), min_size=1, max_size=40))
def test_float_ordinals_keep_the_order(values):
    v = np.array(values, dtype=np.float64)
    for integral in ([False, True] if sk._column_stats("x", v, None).integral else [False]):
        u = sk.ordinal(v, integral)
        i, j = np.triu_indices(len(v), 1)
        assert np.array_equal(u[i] < u[j], v[i] < v[j])
        assert np.array_equal(u[i] == u[j], v[i] == v[j])  # -0.0 == 0.0


KEY_VALUES = {
    "ints": st.integers(-(1 << 63), (1 << 63) - 1),
    "small ints": st.integers(-3, 3),
    "floats": st.floats(allow_nan=False, width=64),
    "floats with NaN": st.one_of(st.floats(width=64), st.just(float("nan")), st.just(-0.0)),
    "integral floats": st.integers(-(1 << 40), 1 << 40).map(float),
}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    kind_a=st.sampled_from(sorted(KEY_VALUES)),
    kind_b=st.sampled_from(sorted(KEY_VALUES)),
    by=st.sampled_from([("a",), ("b",), ("a", "b"), ("b", "a"), ("a", "sample_id")]),
    descending=st.booleans(),
    ties=st.sampled_from(["id", "shuffle"]),
    seed=st.integers(0, (1 << 64) - 1),
    world=st.integers(1, 6),
)
def test_simulated_sample_sort_is_exact(data, kind_a, kind_b, by, descending, ties, seed, world):
    """Any key distribution and world size: the global order is the reference order, and rank r
    receives exactly rows [N*r/P, N*(r+1)/P) (perfect balance)."""
    n = data.draw(st.integers(0, 60))
    a = data.draw(st.lists(KEY_VALUES[kind_a], min_size=n, max_size=n))
    b = data.draw(st.lists(KEY_VALUES[kind_b], min_size=n, max_size=n))
    ids = np.array(data.draw(st.lists(st.integers(0, 1 << 62), min_size=n, max_size=n, unique=True)), dtype=np.int64)
    a_dtype = np.int64 if kind_a in ("ints", "small ints") else np.float64
    b_dtype = np.int64 if kind_b in ("ints", "small ints") else np.float64
    cols = {"sample_id": ids, "a": np.array(a, dtype=a_dtype), "b": np.array(b, dtype=b_dtype)}
    spec = sk.KeySpec(by=by, descending=descending, ties=ties, seed=seed, nan="last")
    outs, rows = simulate(cols, world, spec)
    want = reference_order(cols, by, descending, ties, seed, "last")
    for name in cols:
        assert concat(outs, name).tobytes() == cols[name][want].tobytes()
    assert rows == [hi - lo for lo, hi in (artifacts.row_bounds(n, world, r) for r in range(world))]


@pytest.mark.parametrize("kind", DISTRIBUTIONS)
def test_balance_for_skewed_keys(kind):
    """(a) all keys equal, (b) 90% one value, (c) Zipf, (d) sorted, (e) reverse sorted: 16
    simulated ranks get max/mean <= 1.02 (exact splitters: at most one row apart)."""
    n = 200_003
    cols = metrics_columns(distribution(kind, n))
    for world in (2, 16):
        outs, rows = simulate(cols, world, sk.KeySpec(by=("difficulty",)))
        assert max(rows) - min(rows) <= 1
        assert max(rows) / (n / world) <= 1.02
    order = np.lexsort((cols["sample_id"], cols["difficulty"]))
    assert np.array_equal(concat(outs, "sample_id"), cols["sample_id"][order])


def mixed_kind_keys(n: int, seed: int = 3) -> np.ndarray:
    """Float keys whose kind differs by rank slice: the first third integral (and beyond 2**32), the
    middle third fractional, the last third integral again, their ranges interleaved. A rank that
    chose its key coding from its own rows (integral: int64 codes; else: float bits) would order
    its rows differently from the others, so the merged order would be wrong."""
    rng = np.random.default_rng(seed)
    third = n // 3
    integral = rng.integers(-40, 40, third).astype(np.float64)  # few values: a truncated 3.25 meets a 3.0
    integral[::7] *= 1 << 34  # and some beyond 32 bits
    fractional = rng.integers(-40, 40, third) + rng.choice([0.25, 0.5, 0.75], third)
    tail = rng.integers(-40, 40, n - 2 * third).astype(np.float64)
    return np.concatenate([integral, fractional, tail])


@pytest.mark.parametrize("world", [3, 6])
def test_mixed_integral_and_fractional_keys_across_ranks(world):
    cols = metrics_columns(mixed_kind_keys(3001), lengths=np.ones(3001, dtype=np.int64))
    kinds = []
    for rank in range(world):
        lo, hi = artifacts.row_bounds(3001, world, rank)
        part = cols["difficulty"][lo:hi]
        kinds.append(bool(np.all(part == np.round(part))))
    assert True in kinds and False in kinds  # some ranks see only integral keys, others only fractional
    for descending in (False, True):
        outs, rows = simulate(cols, world, sk.KeySpec(by=("difficulty",), descending=descending))
        want = reference_order(cols, ("difficulty",), descending)
        assert concat(outs, "sample_id").tolist() == cols["sample_id"][want].tolist()


def test_more_ranks_than_rows_simulated():
    cols = metrics_columns([3.0, 1.0, 2.0])
    outs, rows = simulate(cols, 7, sk.KeySpec(by=("difficulty",)))
    assert sorted(rows) == [0, 0, 0, 0, 1, 1, 1] and concat(outs, "sample_id").tolist() == [1, 2, 0]


def test_layout_packs_typical_keys_in_one_word():
    cols = metrics_columns(np.arange(1000, dtype=np.float64) % 97)
    spec = sk.KeySpec(by=("difficulty",))
    stats = sk.merge_stats([sk.local_stats(spec, cols)])
    lay = sk.layout(spec, stats)
    assert lay.fields == [("difficulty", 7, "key"), ("sample_id", 10, "id")] and lay.words == 1
    assert set(sk.decodable(spec, stats, lay, {k: v.dtype for k, v in cols.items()})) == {"difficulty", "sample_id"}


# -- the stage at world size 1 -------------------------------------------------------------------------
def _dataset(n: int, seed: int = 0, nan: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.zipf(1.5, n), 5000)
    diff = lengths.astype(np.float64)
    diff[rng.random(n) < 0.2] = -0.0
    if nan:
        diff[rng.random(n) < 0.1] = np.nan
    ids = rng.permutation(n).astype(np.int64) * 5 + 3  # not contiguous: a sorted directory as input
    return {"sample_id": ids, "length": lengths.astype(np.int64), "difficulty": diff}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(0, 400),
    seed=st.integers(0, 1000),
    by=st.sampled_from(["difficulty", "length", "length,difficulty", "sample_id", "difficulty,length"]),
    descending=st.booleans(),
    ties=st.sampled_from(["id", "shuffle"]),
    engine=st.sampled_from(["numpy", "torch"]),
    contiguous=st.booleans(),
)
def test_sort_in_process_matches_reference(tmp_path_factory, n, seed, by, descending, ties, engine, contiguous):
    cols = _dataset(n, seed, nan=seed % 3 == 0)
    if contiguous:
        cols["sample_id"] = np.arange(n, dtype=np.int64)
    src = write_metrics(tmp_path_factory.mktemp("m") / "m", cols, parts=[n // 3, n - n // 3], row_group_size=50)
    out = tmp_path_factory.mktemp("o") / "sorted"
    res = sort(SortConfig(src, str(out), by=by, descending=descending, ties=ties, seed=seed, nan="last",
                          engine=engine, progress=False))
    keys = tuple(by.split(","))
    assert_rows(read_sorted(out), cols, reference_order(cols, keys, descending, ties, seed, "last"))
    assert res.num_rows == n and res.balance == 1.0


def test_manifest_of_a_sorted_directory(tmp_path):
    cols = _dataset(1000, 1)
    src = write_metrics(tmp_path / "m", cols, parts=3)
    res = sort(SortConfig(src, str(tmp_path / "s"), by=("length", "difficulty"), descending=True, ties="shuffle",
                          seed=9, progress=False))
    m = manifest_of(tmp_path / "s")
    src_m = manifest_of(src)
    assert m["format"] == "varlen-metrics" and m["kind"] == "sorted" and m["stage"] == "sort"
    assert m["order"] == {"by": ["length", "difficulty"], "descending": True, "ties": "shuffle", "seed": 9,
                          "nan": "error"}
    assert m["input"] == {"path": os.path.abspath(src), "artifact_id": src_m["artifact_id"]}
    assert m["dataset"] == src_m["dataset"] and m["stats"] == src_m["stats"] and m["columns"] == src_m["columns"]
    assert m["num_rows"] == 1000 and m["world_size"] == 1 and m["balance"] == 1.0 and m["rows_per_worker"] == [1000]
    table = read_sorted(tmp_path / "s")
    first, last = table.slice(0, 1).to_pylist()[0], table.slice(999, 1).to_pylist()[0]
    assert m["parts"] == [{"file": "part-00000.parquet", "rows": 1000,
                           "first_key": [first["length"], first["difficulty"]],
                           "last_key": [last["length"], last["difficulty"]]}]
    assert set(m["seconds"]) == {"read", "keys", "local_sort", "splitters", "exchange", "merge", "write"}
    assert m["peak_rss_bytes"][0] > 0 and res.manifest == m
    # The artifact id depends on what was computed, not how: same for another run with other runtime options.
    again = sort(SortConfig(src, str(tmp_path / "s2"), by=("length", "difficulty"), descending=True, ties="shuffle",
                            seed=9, progress=False, engine="torch", single_file=True))
    assert again.manifest["artifact_id"] == m["artifact_id"]
    third = sort(SortConfig(src, str(tmp_path / "s3"), by=("length", "difficulty"), descending=False, ties="shuffle",
                            seed=9, progress=False))
    assert third.manifest["artifact_id"] != m["artifact_id"]
    # The sorted directory is itself valid input (re-sorting by sample_id gives the input back).
    back = sort(SortConfig(str(tmp_path / "s"), str(tmp_path / "back"), by="sample_id", progress=False))
    assert_rows(read_sorted(tmp_path / "back"), cols, np.argsort(cols["sample_id"]))
    assert back.manifest["input"]["artifact_id"] == m["artifact_id"]


def test_empty_input_gives_a_valid_empty_output(tmp_path):
    empty = {"sample_id": np.zeros(0, np.int64), "length": np.zeros(0, np.int64), "difficulty": np.zeros(0)}
    for name, parts in (("none", []), ("one", [0])):
        src = write_metrics(tmp_path / name, empty, parts=parts)
        res = sort(SortConfig(src, str(tmp_path / f"{name}-out"), progress=False))
        table = pq.read_table(str(tmp_path / f"{name}-out"))
        assert table.num_rows == 0 and table.schema.names == list(COLUMNS)
        assert res.num_rows == 0 and res.balance == 1.0
        m = manifest_of(tmp_path / f"{name}-out")
        assert m["num_rows"] == 0 and m["parts"] == [{"file": "part-00000.parquet", "rows": 0, "first_key": None,
                                                      "last_key": None}]


def test_nan_last_and_extra_columns(tmp_path):
    """--nan last puts NaN keys after all others (also descending); other numeric columns (any
    width, booleans, timestamps) travel with their rows unchanged."""
    n = 500
    rng = np.random.default_rng(3)
    cols = _dataset(n, 3, nan=True)
    cols["flag"] = rng.random(n) < 0.5
    cols["score32"] = rng.normal(size=n).astype(np.float32)
    cols["small"] = rng.integers(-100, 100, n).astype(np.int16)
    cols["when"] = (rng.integers(0, 10**9, n)).astype("datetime64[ms]")
    schema = pa.schema([("sample_id", pa.int64()), ("length", pa.int64()), ("difficulty", pa.float64()),
                        ("flag", pa.bool_()), ("score32", pa.float32()), ("small", pa.int16()),
                        ("when", pa.timestamp("ms"))])
    src = write_metrics(tmp_path / "m", cols, parts=2, schema=schema, row_group_size=77)
    for desc in (False, True):
        out = tmp_path / f"s{desc}"
        sort(SortConfig(src, str(out), nan="last", descending=desc, progress=False))
        table = read_sorted(out)
        assert table.schema == schema
        assert_rows(table, cols, reference_order(cols, ("difficulty",), desc, "id", 0, "last"))
        d = table.column("difficulty").to_numpy()
        k = int(np.isnan(d).sum())
        assert k > 0 and np.isnan(d[-k:]).all()
    out = tmp_path / "by-small"
    sort(SortConfig(src, str(out), by=("flag", "small", "when"), nan="last", progress=False))
    assert_rows(read_sorted(out), cols, np.lexsort((cols["sample_id"], cols["when"], cols["small"], cols["flag"])))


def test_cli_sort_prints_a_summary(tmp_path):
    src = write_metrics(tmp_path / "m", _dataset(300, 4), parts=2)
    result = CliRunner().invoke(app, ["sort", src, "-o", str(tmp_path / "s"), "--by", "length", "--descending",
                                      "--ties", "shuffle", "--seed", "5", "--single-file", "--no-progress"])
    assert result.exit_code == 0, result.output
    for text in ("varlen sort", "rows", "300", "balance (max / mean)", "1.000", "length descending, ties shuffle",
                 "seconds per phase", "exchange", "peak memory"):
        assert text in result.stdout, text
    assert sorted(os.listdir(tmp_path / "s")) == ["_manifest.json", "part-00000.parquet"]
    # --overwrite replaces it atomically
    again = CliRunner().invoke(app, ["sort", src, "-o", str(tmp_path / "s"), "--overwrite", "--no-progress"])
    assert again.exit_code == 0 and manifest_of(tmp_path / "s")["order"]["by"] == ["difficulty"]
    assert leftovers(tmp_path) == ["m", "s"]


# -- bad inputs --------------------------------------------------------------------------------------
def _plain_dir(t):
    (t / "plain").mkdir()
    (t / "plain" / "x.parquet").write_bytes(b"")
    return str(t / "plain")


def _metrics(t, cols=None, **kw):
    return write_metrics(t / "m", cols if cols is not None else _dataset(50, 0), **kw)


def _with_text(t):
    cols = _dataset(10, 0)
    cols["text"] = np.array(["x"] * 10)
    schema = pa.schema([("sample_id", pa.int64()), ("length", pa.int64()), ("difficulty", pa.float64()),
                        ("text", pa.string())])
    return write_metrics(t / "m", cols, schema=schema)


def _dup_ids(t):
    cols = _dataset(50, 0)
    cols["sample_id"][7] = cols["sample_id"][30]
    return write_metrics(t / "m", cols)


def _inconsistent(t):
    path = _metrics(t)
    m = manifest_of(path)
    m["num_rows"] = 60
    with open(os.path.join(path, "_manifest.json"), "w") as fh:
        json.dump(m, fh)
    return path


def _nan_metrics(t):
    d = np.arange(50, dtype=np.float64)
    d[[11, 40, 3]] = np.nan
    return _metrics(t, metrics_columns(d))


# Each case: a function of tmp_path returning (arguments, message, exit code); the message is exact.
CASES = {
    "missing input": lambda t: ([str(t / "nope")], f"{t / 'nope'} does not exist", 3),
    "not a metrics directory": lambda t: (
        [_plain_dir(t)],
        f"{t / 'plain'} is not a varlen metrics directory (no _manifest.json); create one with `varlen analyze`", 3),
    "a file, not a directory": lambda t: (
        [str((t / "f.parquet").write_bytes(b"x") and t / "f.parquet")],
        f"{t / 'f.parquet'} is not a varlen metrics directory; create one with `varlen analyze`", 3),
    "unknown key column": lambda t: (
        [_metrics(t), "--by", "length,hardness"],
        f"unknown key column 'hardness'; {t / 'm'} has columns sample_id, length, difficulty", 3),
    "NaN keys": lambda t: (
        [_nan_metrics(t)],
        f"key column 'difficulty' has 3 NaN values in {t / 'm'} (the first is sample_id 3); "
        "pass --nan last to put them at the end", 3),
    "non-numeric column": lambda t: (
        [_with_text(t)], f"column 'text' in {t / 'm'} has type string; sort carries only numeric columns", 3),
    "non-numeric key": lambda t: (
        [_with_text(t), "--by", "text"], "key column 'text' has type string; sort keys must be numeric", 3),
    "duplicate sample ids": lambda t: (
        [_dup_ids(t)], re.compile(r"sample_id \d+ appears more than once in .*/m; sample ids must be unique"), 3),
    "inconsistent manifest": lambda t: (
        [_inconsistent(t)], f"{t / 'm'} is inconsistent: _manifest.json says 60 rows but its parts hold 50", 3),
    "missing part": lambda t: (
        [(lambda p: (os.remove(os.path.join(p, "part-00001.parquet")), p)[1])(_metrics(t, parts=2))],
        f"{t / 'm'} is incomplete: part-00001.parquet listed in _manifest.json is missing", 3),
    "bad --seed": lambda t: ([_metrics(t), "--seed", "-1"], "--seed must be an integer from 0 to 2**64-1, got -1", 2),
    "empty --by name": lambda t: (
        [_metrics(t), "--by", "length,,difficulty"],
        "--by needs column names separated by commas, got 'length,,difficulty'", 2),
    "repeated --by": lambda t: ([_metrics(t), "--by", "length,length"], "--by names column 'length' more than once", 2),
    "bad --nproc": lambda t: ([_metrics(t), "--nproc", "0"], "--nproc must be at least 1, got 0", 2),
}


# Choice options are Literal types: typer rejects a bad value before sort runs (one line through `varlen`'s
# main); from Python, the library's generic choice check rejects it.
BAD_CHOICES = [
    ("ties", "random", "--ties must be one of id, shuffle (got 'random')", "'random' is not one of 'id', 'shuffle'"),
    ("nan", "first", "--nan must be one of error, last (got 'first')", "'first' is not one of 'error', 'last'"),
    ("device", "tpu", "--device must be one of cpu, cuda (got 'tpu')", "'tpu' is not one of 'cpu', 'cuda'"),
]


@pytest.mark.parametrize("name,value,message,cli_message", BAD_CHOICES, ids=[b[0] for b in BAD_CHOICES])
def test_bad_choices(tmp_path, monkeypatch, capsys, name, value, message, cli_message):
    from varlen_cli.cli import main
    from varlen_cli.errors import UsageError
    from varlen_cli.sort import SortConfig, sort

    src, out = _metrics(tmp_path), tmp_path / "out"
    with pytest.raises(UsageError) as info:
        sort(SortConfig(metrics_dir=src, output=str(out), progress=False, **{name: value}))
    assert info.value.message == message and info.value.exit_code == 2
    # main() defaults VARLEN_START_METHOD to fork for its fresh process; keep that out of this test process
    # (later multi-worker tests would fork a threaded pytest), and restore the variable afterwards.
    monkeypatch.setenv("VARLEN_START_METHOD", os.environ.get("VARLEN_START_METHOD", "spawn"))
    monkeypatch.setattr("sys.argv", ["varlen", "sort", src, "-o", str(out), f"--{name}", value])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    err = capsys.readouterr().err  # ends "(see `PROG sort --help`)"; PROG depends on how python was started
    assert err.startswith(f"varlen: error: Invalid value for '--{name}': Value error, {cli_message}. (see `")
    assert err.endswith("sort --help`)\n") and err.count("\n") == 1
    assert not os.path.lexists(out)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_input(tmp_path, case):
    args, message, code = CASES[case](tmp_path)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["sort", *args, "-o", str(out), "--no-progress"])
    assert_user_error(result, code, message)
    assert result.stdout == ""
    assert not os.path.lexists(out) and not any(n.startswith(".out") for n in os.listdir(tmp_path))


def test_output_exists_or_is_the_input(tmp_path):
    src = _metrics(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    result = CliRunner().invoke(app, ["sort", src, "-o", str(tmp_path / "out")])
    assert result.exit_code == 4
    assert result.stderr == f"varlen: error: output {tmp_path / 'out'} already exists; pass --overwrite to replace it\n"
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
    result = CliRunner().invoke(app, ["sort", src, "-o", src, "--overwrite"])
    assert result.exit_code == 4
    assert result.stderr == f"varlen: error: output {src} is the input {src}; write the output elsewhere\n"
    assert sorted(os.listdir(tmp_path)) == ["m", "out"]


def test_nan_error_from_the_library(tmp_path):
    with pytest.raises(InputError, match="has 3 NaN values"):
        sort(SortConfig(_nan_metrics(tmp_path), str(tmp_path / "o"), progress=False))
    assert sorted(os.listdir(tmp_path)) == ["m"]
