"""varlen replan: the rest of a plan from step N for another dp; exactly-once across the two plans,
curriculum continuation, LR base kept, determinism, a real 2 -> 3 rank gloo restart, bad inputs."""

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.conftest import assert_user_error
from tests.launcher import launch
from tests.plan_helpers import write_metrics
from varlen_cli.cli import app
from varlen_cli.loader import Plan, PlanBatchSampler, PlanError
from varlen_cli.plan import PlanConfig, plan
from varlen_cli.plan.replan import ReplanConfig, replan
from varlen_cli.validate import ValidateConfig, validate

runner = CliRunner()
N = 600
WORKER = os.path.join(os.path.dirname(__file__), "replan_worker.py")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("replan")
    lengths = np.random.default_rng(7).integers(4, 300, N)
    metrics = write_metrics(root / "metrics", lengths, parts=2)
    sorted_dir = write_metrics(root / "sorted", lengths, sorted_by="length")
    parent = str(root / "parent.parquet")
    plan(PlanConfig(input=metrics, output=parent, max_tokens=2048, dp=2, grad_accum=2, epochs=2, seed=3))
    curric = str(root / "curric.parquet")
    plan(PlanConfig(input=sorted_dir, output=curric, max_tokens=2048, dp=2, order="curriculum", epochs=2))
    return {"root": root, "L": lengths, "metrics": metrics, "sorted": sorted_dir, "parent": parent, "curric": curric}


def rows(path):
    t = pq.read_table(path, columns=["epoch", "step", "rank", "sample_ids", "lr_scale", "step_samples",
                                     "step_loss_tokens"]).to_pydict()
    return t, json.loads(pq.read_schema(path).metadata[b"varlen"])


def epoch_ids(t, epoch, lo=0, hi=None):
    hi = max(t["step"]) + 1 if hi is None else hi
    return [i for e, s, ids in zip(t["epoch"], t["step"], t["sample_ids"]) if e == epoch and lo <= s < hi for i in ids]


@pytest.mark.parametrize("step_frac", [0.0, 0.3, 0.7])
def test_exactly_once_across_the_two_plans(dirs, tmp_path, step_frac):
    parent = Plan.open(dirs["parent"])
    n0 = parent.steps_per_epoch[0]
    step = int(step_frac * n0)
    out = str(tmp_path / "new.parquet")
    res = replan(ReplanConfig(plan=dirs["parent"], output=out, dp=3, from_step=step, grad_accum=1))
    p, pm = rows(dirs["parent"])
    t, m = rows(out)
    done = epoch_ids(p, 0, 0, step)
    rest = epoch_ids(t, 0)
    assert sorted(done + rest) == list(range(N))  # every sample of the epoch exactly once
    assert sorted(epoch_ids(t, 1)) == list(range(N))  # the remaining epoch, whole, for dp 3
    assert m["dp"] == 3 and m["grad_accum"] == 1 and m["epochs"] == 2
    lin = m["lineage"]
    assert lin["parent"] == parent.fingerprint and lin["from_step"] == step and lin["first_step"] == step
    assert lin["first_epoch"] == 0 and lin["consumed_samples"] == len(done)
    # LR: same base batch size, so lr_scale / step_loss_tokens is the parent's constant (linear, by loss tokens)
    assert m["base_batch_size"] == pm["base_batch_size"] and m["lr_scale_by"] == "loss-tokens"
    ratio = np.array(t["lr_scale"] + p["lr_scale"]) * pm["base_batch_size"]
    assert np.allclose(ratio, np.array(t["step_loss_tokens"] + p["step_loss_tokens"]))
    assert res.num_steps == sum(m["steps_per_epoch"])


def test_from_the_second_epoch_and_determinism(dirs, tmp_path):
    parent = Plan.open(dirs["parent"])
    step = parent.epoch_start(1) + 2
    a, b = str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")
    for out in (a, b):
        replan(ReplanConfig(plan=dirs["parent"], output=out, dp=3, from_step=step))
    assert pq.read_table(a).equals(pq.read_table(b))  # deterministic
    p, _ = rows(dirs["parent"])
    t, m = rows(a)
    assert m["epochs"] == 1 and m["lineage"]["first_epoch"] == 1
    assert sorted(epoch_ids(p, 1, 0, step) + epoch_ids(t, 0)) == list(range(N))


def test_curriculum_continues_where_it_stopped(dirs, tmp_path):
    parent = Plan.open(dirs["curric"])
    step = parent.steps_per_epoch[0] // 2
    out = str(tmp_path / "c.parquet")
    replan(ReplanConfig(plan=dirs["curric"], output=out, dp=3, from_step=step))
    p, _ = rows(dirs["curric"])
    t, _ = rows(out)
    # position of each sample in the sorted order (length, then id), derived from the data
    order = np.lexsort((np.arange(N), dirs["L"]))
    where = np.empty(N, np.int64)
    where[order] = np.arange(N)

    def steps(table, lo, hi):
        out = {}
        for e, s, ids in zip(table["epoch"], table["step"], table["sample_ids"]):
            if e == 0 and lo <= s < hi:
                out.setdefault(s, []).extend(ids)
        return [where[out[s]] for s in sorted(out)]

    seq = steps(p, 0, step) + steps(t, 0, max(t["step"]) + 1)
    for a, b in zip(seq, seq[1:]):
        assert a.max() < b.min()  # no sample of a step harder than any sample of the next step


def test_state_file_and_sampler_resume(dirs, tmp_path):
    parent = Plan.open(dirs["parent"])
    sampler = PlanBatchSampler(parent, rank=0, world_size=2)
    it = iter(sampler)
    for _ in range(4 * parent.grad_accum):
        last = next(it)
    state = sampler.state_dict(after=last)
    state_path = tmp_path / "state.json"
    state_path.write_text(json.dumps(state))
    out = str(tmp_path / "s.parquet")
    res = runner.invoke(app, ["replan", dirs["parent"], "--state", str(state_path), "--dp", "3", "-o", out])
    assert res.exit_code == 0, res.output
    new = Plan.open(out)
    assert new.meta["lineage"]["from_step"] == state["step"] == 4
    resumed = PlanBatchSampler(new, rank=1, world_size=3)
    resumed.load_state_dict(state)  # a state of the parent at the step the plan starts at
    assert resumed.state_dict()["plan"] == new.fingerprint and resumed.state_dict()["step"] == 0
    with pytest.raises(PlanError, match="replanned from step 4"):
        resumed.load_state_dict({**state, "step": 5})
    with pytest.raises(PlanError, match="different plan file"):
        resumed.load_state_dict({**state, "plan": "0123456789abcdef"})


def _launch(world, args):
    """``world`` gloo ranks of the worker script, started as torchrun starts them (tests/launcher.py: the
    rendezvous store on a free port held by this process, so no port race)."""
    proc = launch(WORKER, *args, nproc=world, timeout=180, imports=("varlen_cli.loader.replan",))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_gloo_two_ranks_restart_on_three(dirs, tmp_path):
    parent = Plan.open(dirs["parent"])
    stop = parent.steps_per_epoch[0] // 2
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    _launch(2, [dirs["parent"], str(first), str(N), "--stop-step", str(stop)])
    new = str(tmp_path / "new.parquet")
    res = runner.invoke(app, ["replan", dirs["parent"], "--state", str(first / "sampler_state.json"), "--dp", "3",
                              "--grad-accum", "1", "-o", new])
    assert res.exit_code == 0, res.output
    _launch(3, [new, str(second), str(N), "--resume-from", str(first)])
    logs1 = [json.load(open(first / f"rank-{r}.json")) for r in range(2)]
    logs2 = [json.load(open(second / f"rank-{r}.json")) for r in range(3)]
    seen = [i for log in logs1 + logs2 for i in log["ids"]]
    assert sorted(seen) == list(range(N))  # over the epoch every sample exactly once
    assert logs1[0]["steps"] == list(range(stop))
    assert logs2[0]["steps"] == list(range(Plan.open(new).steps_per_epoch[0]))
    # LR continuous: the optimizer's LR per loss token is the same constant before and after the restart
    lr = np.array(logs1[0]["lr"] + logs2[0]["lr"])
    loss_tokens = np.array(logs1[0]["step_loss_tokens"] + logs2[0]["step_loss_tokens"])
    assert np.allclose(lr / loss_tokens, 0.1 / parent.meta["base_batch_size"])
    assert logs2[0]["lr"] == logs2[2]["lr"]


def test_bad_inputs(dirs, tmp_path):
    parent = Plan.open(dirs["parent"])
    out = str(tmp_path / "x.parquet")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"plan": "0123456789abcdef", "epoch": 0, "step": 1, "micro": 0, "dp": 2}))
    changed = write_metrics(tmp_path / "changed", np.r_[dirs["L"], [5]])
    moved = str(tmp_path / "moved.parquet")
    _copy_with_input(dirs["parent"], moved, changed)
    ns = parent.num_steps
    table = [
        (["--from-step", str(ns)], 2, f"step {ns} is beyond the plan: {dirs['parent']} has {ns} steps "
                                      f"(0..{ns - 1}), nothing is left to replan"),
        (["--from-step", "-1"], 2, "--from-step must be >= 0 (got -1)"),
        ([], 2, "give exactly one of --from-step N and --state SAMPLER_STATE.json"),
        (["--from-step", "1", "--state", str(other)], 2,
         "give exactly one of --from-step N and --state SAMPLER_STATE.json"),
        (["--state", str(other)], 3, f"the sampler state {other} was saved with another plan (fingerprint "
                                     f"0123456789abcdef, {dirs['parent']} has {parent.fingerprint})"),
        (["--state", str(tmp_path / "nope.json")], 3, f"sampler state {tmp_path / 'nope.json'} does not exist"),
        (["--from-step", "1", "--dp", "0"], 2, "--dp must be >= 1 (got 0)"),
    ]
    for args, code, message in table:
        argv = ["replan", dirs["parent"], "-o", out, *args]
        if "--dp" not in args:
            argv += ["--dp", "3"]
        assert_user_error(runner.invoke(app, argv), code, message)
    res = runner.invoke(app, ["replan", moved, "-o", out, "--dp", "3", "--from-step", "1"])
    assert_user_error(res, 3, f"{changed} changed since {moved} was planned: it has {N + 1:,} samples, "
                              f"the plan was made for {N:,}")
    res = runner.invoke(app, ["replan", str(tmp_path / "missing.parquet"), "-o", out, "--dp", "3", "--from-step", "1"])
    assert_user_error(res, 3, f"plan {tmp_path / 'missing.parquet'} does not exist")
    assert not os.path.exists(out)


def test_bad_states(dirs, tmp_path):
    """replan --state checks a state as the loader does: step -3 blamed --from-step, micro 7 was accepted
    for grad-accum 2."""
    parent = Plan.open(dirs["parent"])
    good = {"plan": parent.fingerprint, "epoch": 0, "step": 3, "micro": 1, "dp": 2}
    ns, e1 = parent.num_steps, parent.epoch_start(1)
    cases = [
        ({**good, "step": -3}, "is not a loader state: its 'step' is -3, not an integer >= 0"),
        ({**good, "micro": 7}, f"is at micro 7 of step 3, but {dirs['parent']} has grad_accum 2 (micros 0..1)"),
        ({**good, "step": ns + 5, "epoch": 1}, f"is at step {ns + 5}, beyond the end of {dirs['parent']} ({ns} steps): "
                                               f"nothing is left to replan"),
        ({**good, "epoch": 1}, f"says epoch 1 at step 3, but step 3 of {dirs['parent']} is in epoch 0"),
        ({**good, "step": "3"}, "is not a loader state: its 'step' is '3', not an integer >= 0"),
        ({**good, "ledger": {"consumed": [[0, 1, 2]]}}, "is not a loader state: its ledger's 'consumed' holds "
                                                         "[0, 1, 2], not a [start, stop] pair with 0 <= start < stop"),
        # a gap the loader refuses was replanned away: positions 2-3 never trained (issue 31 adversarial round)
        ({**good, "ledger": {"consumed": [[0, 2], [4, 7]]}},
         f"is not a loader state of {dirs['parent']}: its ledger leaves (step 1, micro 0) to (step 1, micro 1) "
         "untrained, in epoch 0, which was not ended with end_epoch(): those positions would never be trained (was the "
         "state edited, or put together from two jobs?)"),
        ({**good, "ledger": {"consumed": [[0, 9]]}},
         f"is not a loader state of {dirs['parent']}: its ledger holds positions [0, 9) but its position (step 3, "
         "micro 1) is position 7: the ledger and the position come from different points"),
        (f"[{'[' * 100_000}", "cannot read sampler state {path}: maximum recursion depth exceeded while decoding a "
                              "JSON array from a unicode string"),
        # saved after loader.end_epoch(): replanning from it trained the rest of the ended epoch
        ({**good, "ledger": {"consumed": [[0, 7]], "ended": [0]}},
         f"is in epoch 0, which its ledger says was ended early (loader.end_epoch()): its loader resumes at the next "
         f"epoch, step {e1}; replan from there with --from-step {e1}"),
    ]
    path = tmp_path / "state.json"
    for state, message in cases:
        path.write_text(state if isinstance(state, str) else json.dumps(state))
        res = runner.invoke(app, ["replan", dirs["parent"], "--state", str(path), "--dp", "3", "-o",
                                  str(tmp_path / "x.parquet")])
        assert_user_error(res, 3, message.format(path=path) if isinstance(state, str) else
                          f"the sampler state {path} {message}")
    path.write_text(json.dumps([good]))
    res = runner.invoke(app, ["replan", dirs["parent"], "--state", str(path), "--dp", "3", "-o", str(tmp_path / "x")])
    assert_user_error(res, 3, f"sampler state {path} is not a JSON object")
    path.write_text(json.dumps({**good, "epoch": 1, "step": e1, "micro": 0}))  # a state right after epoch 0
    res = runner.invoke(app, ["replan", dirs["parent"], "--state", str(path), "--dp", "3", "-o",
                              str(tmp_path / "y.parquet")])
    assert res.exit_code == 0, res.output
    assert Plan.open(str(tmp_path / "y.parquet")).meta["lineage"]["from_step"] == e1


def _copy_with_input(src, dst, input_path):
    """The plan ``src`` rewritten as if it had been planned from ``input_path`` (a source that changed)."""
    t = pq.read_table(src)
    meta = json.loads(t.schema.metadata[b"varlen"])
    meta["input"]["path"] = input_path
    pq.write_table(t.replace_schema_metadata({b"varlen": json.dumps(meta).encode()}), dst)


@pytest.mark.parametrize("options", [
    {"packing": True, "seq_len": 512, "max_tokens": None},
    {"same_shape_per_step": True},
    {"num_shapes": 4, "static_shapes": True, "compile_warmup": True},
    {"order": "random"},
    {"order": "reverse", "epochs": 3, "curriculum_epochs": 1},
], ids=["packing", "same-shape", "static-shapes", "random", "reverse-then-shuffle"])
def test_every_planner_option_replans_exactly_once(dirs, tmp_path, options):
    options = {"max_tokens": 2048, "dp": 2, "grad_accum": 2, "epochs": 2, **options}
    src = dirs["sorted"] if options.get("order") == "reverse" else dirs["metrics"]
    parent = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=src, output=parent, **options))
    p, pm = rows(parent)
    step = pm["steps_per_epoch"][0] + pm["steps_per_epoch"][1] // 3  # inside epoch 1
    out = str(tmp_path / "n.parquet")
    replan(ReplanConfig(plan=parent, output=out, dp=3, from_step=step))
    t, m = rows(out)
    assert sorted(epoch_ids(p, 1, 0, step) + epoch_ids(t, 0)) == list(range(N))
    assert m["epochs"] == options["epochs"] - 1 and m["lineage"]["first_epoch"] == 1
    assert m["orders"] == pm["orders"][1:]  # the same order policy per epoch (curriculum switch included)


def test_replan_lists_what_the_parents_tail_dropped(dirs, tmp_path):
    """A parent whose epoch in progress left samples out (--tail drop): they are in neither plan, so the
    replan's first epoch lists them as dropped too, and it passes its own check and validate."""
    parent = str(tmp_path / "p.parquet")
    plan(PlanConfig(input=dirs["metrics"], output=parent, max_tokens=512, dp=7, grad_accum=2, epochs=2,
                    same_shape_per_step=True, tail="drop", progress=False))
    pm = json.loads(pq.read_schema(parent).metadata[b"varlen"])
    gone = [t["sample_ids"] for t in pm["dropped"]["tail"] if t["epoch"] == 0][0]
    out = str(tmp_path / "r.parquet")
    replan(ReplanConfig(plan=parent, output=out, dp=3, from_step=pm["steps_per_epoch"][0] // 2, progress=False))
    t, m = rows(out)
    assert set(gone) <= set(next(e["sample_ids"] for e in m["dropped"]["tail"] if e["epoch"] == 0))
    assert not set(gone) & set(epoch_ids(t, 0))
    assert validate(ValidateConfig(plan=out, metrics=dirs["metrics"])).ok


def test_replan_is_bounded_by_its_epochs_and_a_chunk(dirs, tmp_path, monkeypatch):
    """replan plans with the chunked planner (the consumed samples a bitmap): its memory is the microbatch
    tables of the epochs it plans and one chunk, never the parent's samples; when even that does not fit,
    it is refused in one line before any work (here: 1,000 bytes available)."""
    from varlen_cli.plan import cost_model
    from varlen_cli.plan.chunked import run

    monkeypatch.setattr(cost_model, "available_memory", lambda: 1000)
    out = str(tmp_path / "new.parquet")
    args = ["replan", dirs["parent"], "-o", out, "--dp", "3", "--from-step", "2"]
    need = (N * 2 * run.TABLE_BYTES_PER_ENTRY + run.CHUNK_BYTES_PER_SAMPLE * N) / 2**30
    assert_user_error(runner.invoke(app, args), 2,
                      f"the plan would hold {N * 2:,} sample entries (2 epoch(s) of {N} samples), about "
                      f"{need:,.1f} GiB while planning, more than the 0.0 GiB of memory available; run it on a "
                      "machine with more memory (`varlen replan` holds the microbatch tables of the epochs it plans "
                      "and one chunk)")
    assert not os.path.exists(out)


def test_extend_is_bounded_by_the_new_epochs_and_a_chunk(dirs, tmp_path, monkeypatch):
    """--extend plans the new epochs with the chunked planner: its memory is the new epochs' microbatch
    tables and one chunk, never the parent's samples; when even that does not fit, it is refused in one
    line that says to extend by fewer epochs (here: 1,000 bytes available)."""
    from varlen_cli.plan import cost_model
    from varlen_cli.plan.chunked import run

    monkeypatch.setattr(cost_model, "available_memory", lambda: 1000)
    out = str(tmp_path / "new.parquet")
    need = (N * run.TABLE_BYTES_PER_ENTRY + run.CHUNK_BYTES_PER_SAMPLE * N) / 2**30
    assert_user_error(runner.invoke(app, ["plan", "--extend", dirs["parent"], "-o", out, "--epochs", "3"]), 2,
                      f"the plan would hold {N:,} sample entries (1 epoch(s) of {N:,} samples), about {need:,.1f} GiB "
                      "while planning, more than the 0.0 GiB of memory available; extend the plan by fewer epochs at a "
                      "time (a smaller --epochs, then extend its output again)")
    assert not os.path.exists(out)


@pytest.mark.parametrize("budget", ["200", "8192"])
def test_replan_of_a_drop_long_plan_to_another_budget_is_refused_in_one_line(dirs, tmp_path, budget):
    """A smaller budget drops samples the epoch in progress may already have trained, a larger one lets in
    samples the parent dropped from it: which were trained is not in the plan file, so the planner's own
    check failed (an internal error, exit 1). Refused before planning; the plan's own budget still replans."""
    parent = str(tmp_path / "long.parquet")
    plan(PlanConfig(input=dirs["metrics"], output=parent, max_tokens=2048, dp=2, epochs=2, seed=3, drop_long=True))
    out = str(tmp_path / "small.parquet")
    res = runner.invoke(app, ["replan", parent, "--from-step", "3", "--dp", "3", "--max-tokens", budget, "-o", out])
    assert_user_error(res, 2, f"{parent} drops the samples that fit no microbatch (--drop-long), and replan cannot "
                      "move it to another budget: the samples a new budget drops or lets in cannot be told apart from "
                      "those the epoch in progress already trained; replan with the plan's budget, or plan the rest "
                      "afresh (`varlen plan --drop-long` with the new budget)")
    assert not os.path.exists(out)
    same = runner.invoke(app, ["replan", parent, "--from-step", "3", "--dp", "3", "--max-tokens", "2048", "-o", out])
    assert same.exit_code == 0, same.output
    assert validate(ValidateConfig(out, metrics=dirs["metrics"])).ok
