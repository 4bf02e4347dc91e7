"""``varlen report`` (issue 35): the reports of a padded, a packed, a curriculum and a mixture plan,
rendered by a real headless Chromium (not blank, every plot drawn, nothing fetched), with the numbers
of ``varlen inspect --json``, which are checked against the plans' own columns; the PNG format; a
large plan's report in bounded memory; bad inputs in one line."""

from __future__ import annotations

import html
import json
import os
import re
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests import browser
from tests.conftest import assert_user_error
from tests.plan_helpers import write_metrics
from varlen_cli import inspect as inspect_module
from varlen_cli.cli import app
from varlen_cli.plan import PlanConfig, plan
from varlen_cli.report import ReportConfig, report

runner = CliRunner()
N, N2 = 3000, 1500
COMMON = {"lr_scaling": "linear", "lr_scale_by": "samples", "drop_long": True, "seed": 3}
# the plots each kind of plan gets (the page's <figure id="fig-...">), written out here, not taken from the code
STEP_PLOTS = ["lengths", "tokens", "padding", "samples", "lr_scale", "straggler", "rank_cost", "shapes"]
EXPECTED_PLOTS = {
    "padded": STEP_PLOTS + ["dropped"],
    "packed": STEP_PLOTS + ["row_fill", "dropped"],
    "curriculum": STEP_PLOTS + ["difficulty", "dropped"],
    "mixture": STEP_PLOTS + ["sources", "dropped"],
}


def _metrics(path, lengths, difficulty, sorted_by=None) -> str:
    """A metrics (or sorted) directory whose manifest has the length histogram analyze writes."""
    from varlen_cli.runtime.text import log2_histogram

    write_metrics(path, lengths, difficulty, sorted_by=sorted_by, parts=2)
    manifest_path = os.path.join(str(path), "_manifest.json")
    manifest = json.load(open(manifest_path))
    bins = log2_histogram(lengths)
    manifest["stats"] = {"length": {"histogram": {"log2_bins": bins[:int(np.flatnonzero(bins).max()) + 1].tolist()}}}
    json.dump(manifest, open(manifest_path, "w"))
    return str(path)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("report")
    rng = np.random.default_rng(35)
    lengths = (rng.lognormal(5.0, 1.0, N).astype(np.int64) + 1)
    lengths[:3] = 9000  # too long for every budget below: dropped
    difficulty = rng.random(N) * 10.0
    metrics = _metrics(folder / "m", lengths, difficulty)
    by_difficulty = _metrics(folder / "s", lengths, difficulty, sorted_by="difficulty")
    other = _metrics(folder / "m2", rng.lognormal(4.0, 0.8, N2).astype(np.int64) + 1, rng.random(N2))
    configs = {
        "padded": dict(input=metrics, max_tokens=4096, dp=2, grad_accum=2),
        "packed": dict(input=metrics, packing=True, seq_len=2048, rows_per_microbatch=2, dp=2, lr_scaling="sqrt"),
        "curriculum": dict(input=by_difficulty, order="curriculum", max_tokens=8192, dp=4, lr_scaling="none"),
        "mixture": dict(input="", mix=f"a={metrics}:1,b={other}:0.5", max_tokens=4096, dp=2),
    }
    out = {}
    for name, options in configs.items():
        path = str(folder / f"{name}.parquet")
        plan(PlanConfig(output=path, overwrite=True, **{**COMMON, **options}))
        out[name] = path
    pages = {name: report(ReportConfig(plan=path, output=str(folder / f"{name}.html"),
                                       metrics=by_difficulty if name == "curriculum" else None)).output
             for name, path in out.items()}
    return {"folder": folder, "plans": out, "pages": pages, "metrics": metrics, "sorted": by_difficulty,
            "difficulty": difficulty}


def _page_data(page: str) -> dict:
    text = open(page, encoding="utf-8").read()
    block = re.search(r'<script type="application/json" id="varlen-inspect">(.*?)</script>', text, re.S).group(1)
    return json.loads(block.replace("<\\/", "</"))


def _clean(value):
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


# -- in a real browser ---------------------------------------------------------------------------------
FRAME_CHECK = """<!DOCTYPE html><html><body>{frames}<pre id="result">pending</pre><script>
window.addEventListener("load", function () {{
  var out = {{}};
  document.querySelectorAll("iframe").forEach(function (f) {{
    var d = f.contentDocument, figs = [];
    d.querySelectorAll("figure").forEach(function (fig) {{
      var svg = fig.querySelector("svg"), r = svg ? svg.getBoundingClientRect() : {{width: 0, height: 0}};
      figs.push({{id: fig.id, width: r.width, height: r.height,
                 shapes: svg ? svg.querySelectorAll("rect, polyline, polygon").length : 0,
                 caption: (fig.querySelector(".caption") || {{}}).textContent || ""}});
    }});
    out[f.id] = {{title: d.title, figures: figs, data: d.getElementById("varlen-inspect") !== null,
                 fetched: f.contentWindow.performance.getEntriesByType("resource").map(function (e) {{
                   return e.name; }})}};
  }});
  document.getElementById("result").textContent = JSON.stringify(out);
}});
</script></body></html>"""


def test_reports_render_in_chromium_with_every_plot_and_nothing_fetched(plans, tmp_path):
    pages = plans["pages"]
    frames = "".join(f'<iframe id="{name}" src="file://{page}" style="width:840px;height:400px"></iframe>'
                     for name, page in pages.items())
    check = tmp_path / "check.html"
    check.write_text(FRAME_CHECK.format(frames=frames))
    dom = browser.dump_dom(f"file://{check}")
    found = json.loads(html.unescape(re.search(r'<pre id="result">(.*?)</pre>', dom, re.S).group(1)))
    for name in pages:
        got = found[name]
        assert got["title"] == f"varlen report: {name}.parquet" and got["data"]
        assert got["fetched"] == []  # no image, font, script or style loaded from anywhere
        plots = [f for f in got["figures"] if f["id"] != "fig-config"]
        assert [f["id"] for f in plots] == [f"fig-{i}" for i in EXPECTED_PLOTS[name]]
        for f in plots:  # each drawn by the browser, with shapes, and a caption saying what to look for
            assert f["width"] >= 700 and f["height"] >= 60 and f["shapes"] >= 1 and len(f["caption"]) > 40, f
        assert "fig-config" in [f["id"] for f in got["figures"]]
        text = open(pages[name], encoding="utf-8").read()  # and no external URL anywhere in the page
        assert not re.search(r"(src|href)\s*=|url\(|https?://|@import", text, re.I)


def test_screenshots_are_not_blank(plans, tmp_path):
    from PIL import Image

    pages = list(plans["pages"].values())
    grid = "".join(f'<iframe src="file://{p}" style="position:absolute;left:{860 * (k % 2)}px;top:{1500 * (k // 2)}px;'
                   f'width:860px;height:1500px;border:0"></iframe>' for k, p in enumerate(pages))
    wrapper = tmp_path / "grid.html"
    wrapper.write_text(f"<!DOCTYPE html><html><body style='margin:0'>{grid}</body></html>")
    shot = browser.screenshot(f"file://{wrapper}", str(tmp_path / "shot.png"), 1720, 3000)
    image = np.asarray(Image.open(shot).convert("RGB"))
    assert image.shape == (3000, 1720, 3)
    for k in range(len(pages)):
        tile = image[1500 * (k // 2):1500 * (k // 2) + 1500, 860 * (k % 2):860 * (k % 2) + 860].reshape(-1, 3)
        ink = np.any(tile < 235, axis=1).mean()
        assert ink > 0.05, (k, ink)  # text, axes and filled plots, not a white page
        blue = np.all(np.abs(tile.astype(int) - [31, 119, 180]) < 8, axis=1).sum()
        assert blue > 2000, (k, blue)  # the bars of the length histogram, drawn


# -- the numbers ---------------------------------------------------------------------------------------
def test_page_numbers_are_inspect_json(plans):
    for name, path in plans["plans"].items():
        args = ["inspect", path, "--json"] + (["--metrics", plans["sorted"]] if name == "curriculum" else [])
        res = runner.invoke(app, args)
        assert res.exit_code == 0, res.output
        assert _page_data(plans["pages"][name]) == _clean(json.loads(res.stdout))
        text = open(plans["pages"][name], encoding="utf-8").read()
        stats = json.loads(json.dumps(_page_data(plans["pages"][name])["metadata"]["stats"]))
        summary = re.search(r'<table id="summary">(.*?)</table>', text, re.S).group(1)
        for key in ("steps", "samples", "tokens", "padding_pct", "dropped"):  # the visible summary, as inspect prints
            assert f"<th>{key}</th><td class=\"num\">{inspect_module.fmt(stats[key])}</td>" in summary


def _expected(path: str, meta: dict, difficulty=None) -> dict:
    """What the plots show, computed here from the plan's columns with numpy (not varlen's code)."""
    t = pq.read_table(path)
    col = {c: t.column(c).to_numpy() for c in ("step", "rank", "tokens", "batch_size", "seqlen", "num_samples",
                                                "lr_scale")}
    step, steps, dp = col["step"], int(col["step"].max()) + 1, meta["dp"]
    tokens = np.bincount(step, weights=col["tokens"], minlength=steps)
    padded = np.bincount(step, weights=col["batch_size"] * col["seqlen"].astype(float), minlength=steps)
    samples = np.bincount(step, weights=col["num_samples"], minlength=steps)
    cost = col["tokens"] if meta["packing"] else col["batch_size"] * col["seqlen"]  # A = 0: the plan's budget
    load = np.zeros((steps, dp))
    np.add.at(load, (step, col["rank"]), cost)
    out = {"tokens_per_step": tokens, "padded_tokens_per_step": padded, "padding_pct": 100 * (1 - tokens / padded),
           "samples_per_step": samples, "mean_sample_length": tokens / samples,
           "lr_scale": col["lr_scale"][::dp * meta["grad_accum"]], "straggler": load.max(1) / load.mean(1),
           "heat": (load / load.mean(1, keepdims=True)).T,
           "shapes": Counter(zip(col["batch_size"].tolist(), col["seqlen"].tolist()))}
    entry_step = np.repeat(step, col["num_samples"])
    if meta["packing"]:
        lengths, rows = t.column("sample_lengths").to_pylist(), t.column("sample_rows").to_pylist()
        fill = [sum(n for n, r in zip(ls, rs) if r == row) / T
                for ls, rs, R, T in zip(lengths, rows, col["batch_size"], col["seqlen"]) for row in range(R)]
        out["row_fill"] = np.bincount(np.minimum((np.array(fill) * 20).astype(int), 19), minlength=20)
    if meta.get("mixture"):
        source = np.concatenate(t.column("source").to_pylist())
        counts = np.zeros((len(meta["mixture"]["sources"]), steps))
        np.add.at(counts, (source, entry_step), 1)
        out["source_shares"] = counts / counts.sum(0)
    if difficulty is not None:
        ids = np.concatenate(t.column("sample_ids").to_pylist())
        value = difficulty[ids]
        out["difficulty"] = (np.bincount(entry_step, weights=value) / np.bincount(entry_step),
                             [value[entry_step == s].min() for s in range(steps)],
                             [value[entry_step == s].max() for s in range(steps)])
    return out


def test_plotted_figures_equal_the_plans_columns(plans):
    for name, path in plans["plans"].items():
        data = _page_data(plans["pages"][name])
        series, meta = data["series"], data["metadata"]
        want = _expected(path, meta, plans["difficulty"] if name == "curriculum" else None)
        assert series["steps"] == meta["num_steps"] == len(want["tokens_per_step"]) <= inspect_module.PLOT_BUCKETS
        assert series["bucket_edges"] == list(range(series["steps"] + 1))  # one step a bucket at this size
        for key in inspect_module.STEP_SERIES:
            b = series[key]["buckets"]
            assert b["mean"] == pytest.approx(want[key], rel=1e-9) and b["min"] == b["mean"] == b["max"], (name, key)
            assert series[key]["min"] == pytest.approx(want[key].min()) and \
                series[key]["max"] == pytest.approx(want[key].max()), (name, key)
        heat = series["rank_cost_heat"]
        assert heat["rows"] == [[r, r] for r in range(meta["dp"])]
        edges = heat["bucket_edges"]  # columns of consecutive steps: each the mean of its steps
        assert edges[0] == 0 and edges[-1] == series["steps"] and np.all(np.diff(edges) >= 1)
        assert len(edges) - 1 == min(series["steps"], inspect_module.HEAT_BUCKETS)
        columns = [want["heat"][:, a:b].mean(axis=1) for a, b in zip(edges, edges[1:])]
        assert np.allclose(heat["ratio"], np.array(columns).T, rtol=1e-9)
        shapes = series["shapes"]
        assert shapes["distinct"] == len(want["shapes"]) and shapes["microbatches"] == meta["num_microbatches"]
        assert all(want["shapes"][(b, t)] == n for b, t, n in shapes["top"])  # the most used, with their counts
        assert [n for _, _, n in shapes["top"]] == sorted(want["shapes"].values(), reverse=True)[:len(shapes["top"])]
        if "row_fill" in want:
            assert series["row_fill"]["bins"] == want["row_fill"].tolist()
        if "source_shares" in want:
            assert np.allclose(series["source_shares"]["buckets"], want["source_shares"])
            assert series["source_shares"]["sources"] == ["a", "b"]
        if "difficulty" in want:  # float32 per sample id
            mean, low, high = want["difficulty"]
            b = series["difficulty"]["buckets"]
            assert b["mean"] == pytest.approx(mean, rel=1e-6) and b["min"] == pytest.approx(low, rel=1e-6)
            assert b["max"] == pytest.approx(high, rel=1e-6)
        assert meta["dropped"]["count"] >= 3  # the three 9,000-token samples, and the page says how many
        assert f"{meta['dropped']['count']:,} sample entries left out" in open(plans["pages"][name]).read()


def test_length_histograms(plans):
    packed = _page_data(plans["pages"]["packed"])
    lengths = np.concatenate(pq.read_table(plans["plans"]["packed"]).column("sample_lengths").to_pylist())
    want = np.bincount(np.floor(np.log2(lengths)).astype(int) + 1)
    assert packed["series"]["length_histogram"] == {"of": "sample_lengths", "log2_bins": want.tolist()}
    padded = _page_data(plans["pages"]["padded"])
    t = pq.read_table(plans["plans"]["padded"])
    want = np.bincount(np.floor(np.log2(t.column("seqlen").to_numpy())).astype(int) + 1,
                       weights=t.column("num_samples").to_numpy())
    assert padded["series"]["length_histogram"] == {"of": "seqlen", "log2_bins": want.astype(int).tolist()}
    curriculum = _page_data(plans["pages"]["curriculum"])  # --metrics: the metrics' own histogram is drawn
    assert curriculum["metrics"]["stats"]["length"] == json.load(open(os.path.join(plans["sorted"],
                                                                                   "_manifest.json")))["stats"]["length"]
    assert "the metrics&#x27; histogram" in open(plans["pages"]["curriculum"]).read()


def test_buckets_keep_each_buckets_extremes(plans, monkeypatch):
    """Downsampled (fewer buckets than steps, read in many small windows), each bucket still holds the
    min, max and mean of its steps."""
    from varlen_cli import format
    from varlen_cli.checks import scan

    monkeypatch.setattr(inspect_module, "PLOT_BUCKETS", 7)
    monkeypatch.setattr(scan, "TARGET_VALUES", 64)
    pf, meta = format.open_plan_file(plans["plans"]["padded"])
    series = inspect_module.plan_series(pf, meta)
    want = _expected(plans["plans"]["padded"], meta)["straggler"]
    edges = series["bucket_edges"]
    assert len(edges) == 8 and edges[0] == 0 and edges[-1] == len(want)
    b = series["straggler"]["buckets"]
    for k in range(7):
        part = want[edges[k]:edges[k + 1]]
        assert (b["min"][k], b["max"][k]) == pytest.approx((part.min(), part.max()), rel=1e-12)
        assert b["mean"][k] == pytest.approx(part.mean(), rel=1e-12)


# -- png, memory, errors ---------------------------------------------------------------------------------
def test_png_is_one_image_of_every_plot(plans, tmp_path):
    from PIL import Image

    out = tmp_path / "packed.png"
    res = runner.invoke(app, ["report", plans["plans"]["packed"], "-o", str(out), "--format", "png", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["plots"] == EXPECTED_PLOTS["packed"] and summary["output"] == str(out)
    image = Image.open(out)
    assert image.format == "PNG" and image.info["Software"].startswith("varlen report")
    assert image.width >= 760 and image.height > 250 * len(EXPECTED_PLOTS["packed"])
    pixels = np.asarray(image.convert("RGB")).reshape(-1, 3)
    assert np.any(pixels < 235, axis=1).mean() > 0.05
    res = runner.invoke(app, ["report", plans["plans"]["packed"], "-o", str(out), "--format", "png", "--overwrite"])
    assert res.exit_code == 0, res.output  # its own image: replaced


def test_large_plan_report_in_bounded_memory(tmp_path, monkeypatch):
    """Read in windows of a few steps and kept in buckets: reading the plan peaks far below the plan's
    own size (Arrow: one window; Python and numpy: the buckets and a window), and the whole report
    (plots and page included) within a fixed bound."""
    import tracemalloc

    from varlen_cli.checks import scan
    from varlen_cli.inspect import InspectConfig, inspect_artifact
    from varlen_cli.plan import writer

    monkeypatch.setattr(writer, "ROW_GROUP_TARGET", 64)  # small row groups, so small windows can be read
    lengths = np.random.default_rng(5).integers(1, 100, 300_000)
    path = str(tmp_path / "big.parquet")
    plan(PlanConfig(input=write_metrics(tmp_path / "m", lengths), output=path, max_tokens=2048, dp=4, **COMMON))
    ids_bytes = 8 * len(lengths)
    monkeypatch.setattr(scan, "TARGET_VALUES", 2048)
    previous, pool = pa.default_memory_pool(), pa.proxy_memory_pool(pa.default_memory_pool())
    pa.set_memory_pool(pool)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        info = inspect_artifact(InspectConfig(path))
        reading = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.reset_peak()
        report(ReportConfig(plan=path, output=str(tmp_path / "big.html")))
        whole = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(previous)
    assert pool.max_memory() < ids_bytes / 16, pool.max_memory()  # Arrow: one window, not the plan
    assert reading < ids_bytes / 4, reading
    assert whole < 6 << 20, whole
    assert info["series"]["steps"] > 2 * inspect_module.PLOT_BUCKETS  # downsampled
    assert len(_page_data(str(tmp_path / "big.html"))["series"]["straggler"]["buckets"]["max"]) == \
        inspect_module.PLOT_BUCKETS


def test_bad_inputs_are_one_line(plans, tmp_path, monkeypatch):
    padded = plans["plans"]["padded"]
    assert_user_error(runner.invoke(app, ["report", padded, "-o", str(tmp_path / "r.png")]), 2,
                      f"-o {tmp_path / 'r.png'} names a png file but --format is html: pass --format png, or name it "
                      f"{tmp_path / 'r'}.html")
    assert_user_error(runner.invoke(app, ["report", padded, "-o", "s3://bucket/r.html"]), 2,
                      "-o s3://bucket/r.html: a report is written to a local file (copy it to object storage after)")
    assert_user_error(runner.invoke(app, ["report", plans["metrics"], "-o", str(tmp_path / "r.html")]), 3,
                      f"{plans['metrics']} is a metrics directory, not a plan: `varlen report` draws plans (`varlen "
                      "inspect` shows directories)")
    foreign = tmp_path / "notes.html"
    foreign.write_text("<p>mine</p>")
    assert_user_error(runner.invoke(app, ["report", padded, "-o", str(foreign)]), 4,
                      f"output {foreign} already exists; pass --overwrite to replace it")
    assert_user_error(runner.invoke(app, ["report", padded, "-o", str(foreign), "--overwrite"]), 4,
                      f"output {foreign} is not a varlen report; --overwrite replaces only varlen outputs")
    assert foreign.read_text() == "<p>mine</p>"
    assert_user_error(runner.invoke(app, ["report", padded, "-o", str(tmp_path / "r.html"), "--metrics",
                                          plans["folder"] / "m2"]), 3,
                      re.compile(r".*m2 describes dataset test of 1,500 samples, the plan was built from test of 3000: "
                                 r"pass the metrics the plan was made from"))
    assert_user_error(runner.invoke(app, ["report", plans["plans"]["mixture"], "-o", str(tmp_path / "r.html"),
                                          "--metrics", plans["metrics"]]), 2,
                      "--metrics does not apply to a mixture plan (varlen plan --mix): it has one input per source")
    import sys

    monkeypatch.setitem(sys.modules, "PIL", None)  # Pillow missing: the extra is named
    assert_user_error(runner.invoke(app, ["report", padded, "-o", str(tmp_path / "r.png"), "--format", "png"]), 2,
                      "--format png needs Pillow: pip install 'varlen-cli[report]' (the HTML report needs nothing "
                      "more)")
    assert not [p for p in os.listdir(tmp_path) if p.startswith("r.") or "varlen-tmp" in p]


def test_overwrite_replaces_only_a_varlen_report(plans, tmp_path):
    """``--overwrite`` replaces a page or image varlen report wrote, not a file of the user's that only
    mentions ``varlen report`` (the generator mark, not the words, makes a report)."""
    padded = plans["plans"]["padded"]
    notes = tmp_path / "notes.html"
    mine = "<html><body><h1>Notes: comparing varlen report pages</h1><p>keep this</p></body></html>"
    notes.write_text(mine)
    assert_user_error(runner.invoke(app, ["report", padded, "-o", str(notes), "--overwrite"]), 4,
                      f"output {notes} is not a varlen report; --overwrite replaces only varlen outputs")
    assert notes.read_text() == mine
    page = tmp_path / "r.html"
    for args in ([], ["--overwrite"]):  # its own page: replaced
        res = runner.invoke(app, ["report", padded, "-o", str(page), *args])
        assert res.exit_code == 0, res.output


DATA_CHECK = """<!DOCTYPE html><html><body><iframe id="f" src="file://{page}"></iframe><pre id="result">pending</pre>
<script>window.addEventListener("load", function () {{
  var d = document.getElementById("f").contentDocument, out;
  try {{ out = JSON.parse(d.getElementById("varlen-inspect").textContent).path; }} catch (e) {{ out = "broken: " + e; }}
  document.getElementById("result").textContent = out + " scripts=" + d.scripts.length;
}});</script></body></html>"""


def test_data_block_holds_any_plan_path(plans, tmp_path):
    """A plan named ``<!--<script>.parquet``: the page's inline JSON is still the inspect data, read
    back whole by a browser (no ``<`` in it can change where the block ends), and no script runs."""
    import shutil

    path = tmp_path / "<!--<script>.parquet"
    shutil.copy(plans["plans"]["padded"], path)
    page = report(ReportConfig(plan=str(path), output=str(tmp_path / "r.html"))).output
    check = tmp_path / "check.html"
    check.write_text(DATA_CHECK.format(page=page))
    dom = browser.dump_dom(f"file://{check}")
    assert html.unescape(re.search(r'<pre id="result">(.*?)</pre>', dom, re.S).group(1)) == \
        f"{path} scripts=1"  # the data block, which runs nothing
    assert _page_data(page)["path"] == str(path)
