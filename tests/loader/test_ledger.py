"""The consumption ledger (issue 21): every resume path trains each (epoch, step, micro) of a rank
once, or stops with a one-line PlanError before a wrong optimizer step.

The property test drives the documented loop (and the usual ways to get it wrong) over random plans,
stop points, checkpoints and resumes, with the plain and the torchdata loader, and checks the
history of optimizer steps against the plan.
"""

import copy
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.loader_helpers import SyntheticTokens, write_plan
from varlen_cli.loader import Ledger, Plan, PlanError, VariableBatchSizeLR, dataloader_for_plan

LENGTHS = np.random.default_rng(11).integers(1, 90, size=160)


def _plan(tmp_path, name="p", **options) -> Plan:
    path = str(tmp_path / f"{name}.parquet")
    opts = dict(dp=1, grad_accum=2, epochs=2, max_tokens=384, row_group_steps=2)
    opts.update(options)
    write_plan(path, LENGTHS, **opts)
    return Plan.open(path)


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def _pos(batch):
    return tuple(batch["plan_position"].tolist())


# -- the numbered cases of issue 21 that need no framework ---------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_case1_torchdata_resumed_mid_epoch_1_trains_exactly_the_rest(tmp_path, workers):
    """loader.epoch read 0 after torchdata's load_state_dict, so the documented loop replayed the plan
    (126 microbatches consumed of 84 planned)."""
    plan = _plan(tmp_path, dp=2)
    data = SyntheticTokens(LENGTHS)
    extra = {"num_workers": workers, **({"prefetch_factor": 2} if workers else {})}
    cut = plan.epoch_start(1) + 2  # stop after optimizer step `cut`, mid-epoch 1
    loader = dataloader_for_plan(data, plan, rank=1, world_size=2, stateful=True, **extra)
    sched = VariableBatchSizeLR(_optimizer(), plan)
    seen = []
    for epoch in range(loader.epoch, plan.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            seen.append(_pos(batch))
            if batch["info"].micro == plan.grad_accum - 1:
                sched.step()
                if sched.step_index == cut:
                    state, lr_state = copy.deepcopy(loader.state_dict()), sched.state_dict()
    want = [(plan.epoch_of(s), s, 1, m) for s in range(plan.num_steps) for m in range(plan.grad_accum)]
    assert seen == want
    resumed = dataloader_for_plan(data, plan, rank=1, world_size=2, stateful=True, **extra)
    sched = VariableBatchSizeLR(_optimizer(), plan)
    resumed.load_state_dict(state)
    sched.load_state_dict(lr_state)
    assert resumed.epoch == 1
    rest = []
    for epoch in range(resumed.epoch, plan.epochs):  # the documented loop, as written
        resumed.set_epoch(epoch)
        for batch in resumed:
            rest.append(_pos(batch))
            if batch["info"].micro == plan.grad_accum - 1:
                sched.step()
    assert rest == want[cut * plan.grad_accum:]


def test_case4_a_pass_past_the_plans_end_is_refused(tmp_path):
    """One more pass after the last epoch was consumed silently (check_step returned early past the end)."""
    plan = _plan(tmp_path)
    loader = dataloader_for_plan(SyntheticTokens(LENGTHS), plan, rank=0, world_size=1)
    sched = VariableBatchSizeLR(_optimizer(), plan)
    for epoch in range(loader.epoch, plan.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            if batch["info"].micro == plan.grad_accum - 1:
                sched.step()
    assert sched.step_index == plan.num_steps
    with pytest.raises(PlanError, match=rf"^desync: the plan is finished \(all {plan.num_steps} steps of 2 "
                                        r"epoch\(s\) trained\) but rank 0 is given \(epoch 1, step \d+, rank 0, "
                                        r"micro 0\) again: a pass past the plan's end \(re-plan with more --epochs"):
        next(iter(loader))
    with pytest.raises(PlanError, match=rf"^desync: optimizer step {plan.num_steps} is past the plan's end "
                                        rf"\({plan.num_steps} steps, 2 epoch\(s\)\): the trainer runs longer"):
        sched.step()
    # a state saved at the end resumes to nothing, and one more pass is refused the same way
    state = loader.state_dict()
    again = dataloader_for_plan(SyntheticTokens(LENGTHS), plan, rank=0, world_size=1)
    again.load_state_dict(state)
    assert again.epoch == plan.epochs - 1 and list(again) == []
    with pytest.raises(PlanError, match=r"^desync: the plan is finished"):
        next(iter(again))


def test_ledger_travels_in_every_state_and_refuses_a_replay(tmp_path):
    plan = _plan(tmp_path)
    data = SyntheticTokens(LENGTHS)
    loader = dataloader_for_plan(data, plan, rank=0, world_size=1, lr_scale="ignore")
    it = iter(loader)
    for _ in range(5):
        batch = next(it)
    for state in (loader.state_dict(), loader.batch_sampler.state_dict(after=batch)):
        assert state["ledger"] == {"consumed": [[0, 5]], "ended": []}
        again = dataloader_for_plan(data, plan, rank=0, world_size=1, lr_scale="ignore")
        again.load_state_dict(state)
        assert _pos(next(iter(again))) == (0, 2, 0, 1)
        again.set_epoch(0)  # the documented loop keeps the position; a sampler set back to the epoch start...
        again.batch_sampler._resume = None
        with pytest.raises(PlanError, match=r"^desync: rank 0 is given \(epoch 0, step 0, rank 0, micro 0\), "
                                            r"which this job already trained \(it resumed at \(epoch 0, step 2, rank "
                                            r"0, micro 1\)\): the plan is being replayed"):
            next(iter(again))


def test_half_an_epoch_then_the_next_needs_end_epoch(tmp_path):
    plan = _plan(tmp_path)
    data = SyntheticTokens(LENGTHS)
    half = plan.steps_per_epoch[0] // 2

    def run(end_early: bool):
        loader = dataloader_for_plan(data, plan, rank=0, world_size=1, lr_scale="ignore")
        for epoch in range(loader.epoch, plan.epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                if epoch == 0 and batch["info"].step == half:
                    if end_early:
                        loader.end_epoch()
                    break
        return loader

    last = plan.steps_per_epoch[0] - 1
    with pytest.raises(PlanError, match=rf"^desync: epoch 1 started on rank 0 but epoch 0 is incomplete: {half} of "
                                        rf"{plan.steps_per_epoch[0]} steps trained, \(epoch 0, step {half}, rank 0, "
                                        rf"micro 1\) to \(epoch 0, step {last}, rank 0, micro 1\) never \(an epoch "
                                        r"loop that stopped early or skipped set_epoch; to stop an epoch early on "
                                        r"purpose call loader.end_epoch\(\) first\)$"):
        run(end_early=False)
    loader = run(end_early=True)  # said on purpose: the next epoch runs whole, and the state remembers it
    assert loader.state_dict()["ledger"]["ended"] == [0]


@pytest.mark.parametrize("mid_step,check", [(False, True), (True, True), (True, False)])
def test_end_epoch_with_variable_batch_size_lr(tmp_path, mid_step, check):
    """The documented loop with VariableBatchSizeLR: an epoch ended early with loader.end_epoch() (after a
    step, or in the middle of one) moves the plan's LR scale on to the next epoch's first step, whose
    LR is the base LR x that step's lr_scale; skipping steps without end_epoch stays refused.
    ``check=False`` turns the desync checks off, not the plan's LR scale (the scale stayed behind by the
    skipped steps, silently, for the rest of the job)."""
    plan = _plan(tmp_path, lr_scaling="linear")
    scales = plan.lr_scales()
    assert len(set(scales.tolist())) > 1
    stop = plan.steps_per_epoch[0] // 2
    loader = dataloader_for_plan(SyntheticTokens(LENGTHS), plan, rank=0, world_size=1)
    optimizer = _optimizer()
    lr = VariableBatchSizeLR(optimizer, plan) if check else VariableBatchSizeLR(optimizer, plan, guard=loader,
                                                                                check=False)
    taken = []
    for epoch in range(plan.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            info = batch["info"]
            if epoch == 0 and info.step == stop and (mid_step or info.micro == plan.grad_accum - 1):
                loader.end_epoch()
                break
            if info.micro == plan.grad_accum - 1:
                taken.append((info.step, optimizer.param_groups[0]["lr"]))
                optimizer.step()
                lr.step()
    trained = [s for s, _ in taken]
    assert trained == list(range(stop)) + list(range(plan.epoch_start(1), plan.num_steps))
    assert np.allclose([v for _, v in taken], [0.1 * scales[s] for s in trained])
    assert lr.step_index == plan.num_steps


@pytest.mark.parametrize("stateful", [False, True])
def test_a_state_saved_after_end_epoch_resumes_at_the_next_epoch(tmp_path, stateful):
    """A checkpoint taken right after loader.end_epoch() (its position still in the ended epoch) could not
    be resumed: the documented loop started at that epoch and the ledger refused its next microbatch."""
    plan = _plan(tmp_path)
    data = SyntheticTokens(LENGTHS)
    loader = dataloader_for_plan(data, plan, rank=0, world_size=1, lr_scale="ignore", stateful=stateful)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    loader.end_epoch()
    state = copy.deepcopy(loader.state_dict())
    resumed = dataloader_for_plan(data, plan, rank=0, world_size=1, lr_scale="ignore", stateful=stateful)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    rest = []
    for epoch in range(resumed.epoch, plan.epochs):  # the documented loop
        resumed.set_epoch(epoch)
        rest += [_pos(batch) for batch in resumed]
    assert rest == [(1, s, 0, m) for s in range(plan.epoch_start(1), plan.num_steps) for m in range(plan.grad_accum)]


def test_lr_coverage_refuses_the_first_optimizer_step_without_the_plans_scheduler(tmp_path):
    """Issue 37: a loop with a plain LR scheduler trained 2 optimizer steps at the wrong LR before the
    check stopped it, and merely iterating a loader needed lr_scale="ignore". Now: iterating is free,
    and the first optimizer step taken on the plan's microbatches is refused before it runs."""
    plan = _plan(tmp_path)
    scales = plan.lr_scales()
    assert len(set(scales.round(6))) > 1
    looked = dataloader_for_plan(SyntheticTokens(LENGTHS), plan, rank=0, world_size=1)
    assert len(list(looked)) == plan.steps_per_epoch[0] * plan.grad_accum  # a look at the data: no optimizer
    optimizer = _optimizer()
    weight = optimizer.param_groups[0]["params"][0]
    weight.grad = torch.ones(1)
    optimizer.step()  # an optimizer of something else, while no plan loader is being iterated: not the plan's
    base = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    loader = dataloader_for_plan(SyntheticTokens(LENGTHS), plan, rank=0, world_size=1)
    before = weight.detach().clone()
    with pytest.raises(PlanError, match=rf"^the plan's lr_scale \({scales.min():.3g} to {scales.max():.3g}\) is not "
                                        r"applied: an optimizer step is about to run after \(epoch 0, step 0, rank 0, "
                                        r"micro 1\) on rank 0 with no VariableBatchSizeLR of this plan \(wrap the LR "
                                        r"scheduler in VariableBatchSizeLR\(scheduler, plan\) and call its step\(\) "
                                        r"once per optimizer step, or pass lr_scale='ignore' to dataloader_for_plan to "
                                        r"train without it\)\.$"):
        for batch in loader:
            if batch["info"].micro == plan.grad_accum - 1:
                weight.grad = torch.ones(1)
                optimizer.step()
                base.step()
    assert torch.equal(weight.detach(), before)  # refused before the step ran
    ones = _plan(tmp_path, "ones", lr_scaling="none")  # lr_scale all 1: nothing to apply
    for _batch in dataloader_for_plan(SyntheticTokens(LENGTHS), ones, rank=0, world_size=1):
        optimizer.step()
    for _batch in dataloader_for_plan(SyntheticTokens(LENGTHS), plan, rank=0, world_size=1, lr_scale="ignore"):
        optimizer.step()


def test_the_launcher_hint_replaces_replan_with_dp_1(tmp_path, monkeypatch):
    plan = _plan(tmp_path, dp=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(PlanError, match=r"^the plan was made for 2 data-parallel rank\(s\) and the launcher started "
                                        r"WORLD_SIZE=2 processes, but this process sees world size 1: the training "
                                        r"framework did not join them into one process group \(on CPU: "
                                        r"Accelerator\(cpu=True\)"):
        plan.validate(world_size=1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(PlanError, match=r"re-plan with --dp 1 "):
        plan.validate(world_size=1)


# -- the property ------------------------------------------------------------------------------------
LOOPS = ["documented", "from_epoch_0", "no_set_epoch", "half_epoch", "stale_lr", "past_end"]


class History:
    """What the model saw: the optimizer steps applied, checked against the plan as they happen."""

    def __init__(self, plan: Plan, rank: int):
        self.plan, self.rank = plan, rank
        self.done = 0  # steps in the model (the checkpoint this job resumed from, then this job's)
        self.wrong = 0  # optimizer steps applied with other microbatches than the next plan step's
        self.micros: list = []
        self.trained: list = []  # per applied step, the positions trained

    def consume(self, pos):
        self.micros.append(pos)

    def optimizer_step(self):
        s = self.done
        want = [(self.plan.epoch_of(s), s, self.rank, m) for m in range(self.plan.grad_accum)] \
            if s < self.plan.num_steps else None
        if self.micros != want:
            self.wrong += 1
        self.trained.append(list(self.micros))
        self.micros = []
        self.done += 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ga=st.integers(1, 3), epochs=st.integers(1, 3), dp=st.integers(1, 2), stateful=st.booleans(),
       seed=st.integers(0, 10**6), jobs=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=3),
       loop=st.sampled_from(LOOPS), with_lr=st.booleans())
def test_every_resume_trains_each_position_once_or_refuses_before_a_wrong_step(tmp_path, ga, epochs, dp, stateful,
                                                                               seed, jobs, loop, with_lr):
    """``with_lr=False``: no VariableBatchSizeLR (``lr_scale="ignore"``), so the ledger alone keeps the
    data right; with it, the LR pace checks too."""
    if loop == "stale_lr" and not with_lr:
        loop = "documented"
    plan = _plan(tmp_path, f"h{seed}", dp=dp, grad_accum=ga, epochs=epochs, seed=seed, order="random")
    rank = seed % dp
    data = SyntheticTokens(LENGTHS)
    total = plan.num_steps
    checkpoint, stale = None, None  # (model steps, loader state, LR state)
    history = History(plan, rank)
    refused = None
    try:
        for stop_frac, save_frac in jobs + [(2.0, 0.0)]:  # the last job runs to the end
            history.done = checkpoint[0] if checkpoint else 0
            history.micros = []
            loader = dataloader_for_plan(data, plan, rank=rank, world_size=dp, stateful=stateful,
                                         lr_scale="check" if with_lr else "ignore")
            sched = VariableBatchSizeLR(_optimizer(), plan) if with_lr else None
            if checkpoint:
                loader.load_state_dict(copy.deepcopy(checkpoint[1]))
                lr_state = stale[2] if (loop == "stale_lr" and stale and stale[0] != checkpoint[0]) else checkpoint[2]
                if sched is not None:
                    sched.load_state_dict(copy.deepcopy(lr_state))
            stop = int(stop_frac * total * ga) if stop_frac <= 1 else None  # microbatches this job trains
            save_at = int(save_frac * total)  # checkpoint after this optimizer step
            consumed = 0
            first = 0 if loop == "from_epoch_0" else loader.epoch
            for epoch in range(first, plan.epochs):
                if loop != "no_set_epoch":
                    loader.set_epoch(epoch)
                for batch in loader:
                    history.consume(_pos(batch))
                    consumed += 1
                    if batch["info"].micro == ga - 1:
                        history.optimizer_step()  # optimizer.step() comes before scheduler.step()
                        if sched is not None:
                            sched.step()
                        if history.done == save_at or (history.done % 3 == 0):
                            stale, checkpoint = checkpoint, (history.done, copy.deepcopy(loader.state_dict()),
                                                             sched.state_dict() if sched is not None else None)
                    if stop is not None and consumed >= stop:
                        break
                    if loop == "half_epoch" and epoch + 1 < plan.epochs and \
                            batch["info"].step == plan.epoch_start(epoch) + 1:
                        break  # on to the next epoch without finishing this one
                if stop is not None and consumed >= stop:
                    break
            if stop is None and loop == "past_end":
                for batch in loader:
                    history.consume(_pos(batch))
    except PlanError as exc:
        refused = str(exc)
    assert history.wrong == 0, (loop, history.trained)  # never a wrong optimizer step, refused or not
    if refused is None:
        assert history.done == total  # the surviving history trained every step once, in order
        assert not history.micros
    else:
        assert "\n" not in refused
    if loop == "documented":
        assert refused is None, refused


# -- loader states: their shape, and ledgers that cannot be a job's history (issue 31) ------------------
def _state_at(plan, k, **ledger):
    step, micro = divmod(k, plan.grad_accum)
    return {"plan": plan.fingerprint, "epoch": plan.epoch_of(step), "step": step, "micro": micro, "dp": plan.dp,
            "ledger": {"consumed": [[0, k]], "ended": [], **ledger}}


MALFORMED = {  # state -> the message after "invalid loader state: "
    "spans as a string": (lambda s: {**s, "ledger": {"consumed": "0-8", "ended": []}},
                          "its ledger's 'consumed' is '0-8', not a list of [start, stop] pairs"),
    "3-number span": (lambda s: {**s, "ledger": {"consumed": [[0, 4, 8]], "ended": []}},
                      "its ledger's 'consumed' holds [0, 4, 8], not a [start, stop] pair with 0 <= start < stop"),
    "ended not numbers": (lambda s: {**s, "ledger": {"consumed": [[0, 8]], "ended": ["x"]}},
                          "its ledger's 'ended' is ['x'], not a list of epoch numbers"),
    "a list": (lambda s: list(s.items()),
               "it is a list, not a dict (pass what loader.state_dict() returned)"),
    "no epoch": (lambda s: {k: v for k, v in s.items() if k != "epoch"}, "it has no 'epoch'"),
    "step a float": (lambda s: {**s, "step": 4.0}, "its 'step' is 4.0, not an integer >= 0"),
    "ledger a list": (lambda s: {**s, "ledger": [[0, 8]]}, "its 'ledger' is [[0, 8]], not a dict"),
}


@pytest.mark.parametrize("stateful", [False, True])
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_state_is_one_plan_error(tmp_path, case, stateful):
    """A state with spans as a string, 3-number spans, ended ["x"], a list, no epoch: raw ValueError,
    KeyError or AttributeError before."""
    plan = _plan(tmp_path)
    make, message = MALFORMED[case]
    loader = dataloader_for_plan(SyntheticTokens(LENGTHS), plan, rank=0, world_size=1, stateful=stateful)
    state = make(_state_at(plan, 8))
    if stateful and isinstance(state, dict):
        state = {"varlen": state}
    with pytest.raises(PlanError, match="^" + re.escape(f"invalid loader state: {message}") + "$"):
        loader.load_state_dict(state)


def test_a_torchdata_state_whose_loader_part_is_not_a_dict_is_refused(tmp_path):
    """{"varlen": None} (a checkpoint that lost the loader's part) started the job afresh, silently."""
    plan = _plan(tmp_path)
    loader = dataloader_for_plan(SyntheticTokens(LENGTHS), plan, rank=0, world_size=1, stateful=True)
    for part in (None, []):
        with pytest.raises(PlanError, match="^" + re.escape(
                f"invalid loader state: its 'varlen' entry is {part!r}, not the loader's state (pass what "
                "loader.state_dict() returned)") + "$"):
            loader.load_state_dict({"varlen": part})


LR_MALFORMED = {  # VariableBatchSizeLR state -> the message after "invalid VariableBatchSizeLR state: "
    "None": (lambda s: None, "it is a NoneType, not a dict (pass what VariableBatchSizeLR.state_dict() returned)"),
    "no step": (lambda s: {k: v for k, v in s.items() if k != "step"}, "its 'step' is None, not an integer >= 0"),
    "step -1": (lambda s: {**s, "step": -1}, "its 'step' is -1, not an integer >= 0"),
    "step 1.5": (lambda s: {**s, "step": 1.5}, "its 'step' is 1.5, not an integer >= 0"),
    "unscaled 'x'": (lambda s: {**s, "unscaled": "x"},
                     "its 'unscaled' is 'x', not 1 finite learning rate(s) (one per param group)"),
    "unscaled for 2 groups": (lambda s: {**s, "unscaled": [0.1, 0.2]},
                              "its 'unscaled' is [0.1, 0.2], not 1 finite learning rate(s) (one per param group)"),
    "unscaled NaN": (lambda s: {**s, "unscaled": [float("nan")]},
                     "its 'unscaled' is [nan], not 1 finite learning rate(s) (one per param group)"),
}


@pytest.mark.parametrize("case", sorted(LR_MALFORMED))
def test_a_malformed_lr_state_is_one_plan_error(tmp_path, case):
    """step None, 'x', [] or NaN, unscaled None or ['a'], a state that is no dict: raw TypeError,
    ValueError, KeyError or AttributeError before; step -1 and 1.5 were accepted (step_index -1, 1)."""
    plan = _plan(tmp_path)
    make, message = LR_MALFORMED[case]
    sched = VariableBatchSizeLR(_optimizer(), plan)
    good = sched.state_dict()
    with pytest.raises(PlanError, match="^" + re.escape(f"invalid VariableBatchSizeLR state: {message}") + "$"):
        sched.load_state_dict(make(good))
    assert sched.step_index == 0


def test_a_ledger_with_a_gap_is_refused(tmp_path):
    """A ledger [[0,2],[4,8]] was accepted and the job trained to the end without positions 2-3."""
    plan = _plan(tmp_path)
    loader = dataloader_for_plan(SyntheticTokens(LENGTHS), plan, rank=0, world_size=1, lr_scale="ignore")
    with pytest.raises(PlanError, match="^" + re.escape(
            "invalid loader state: its ledger leaves (epoch 0, step 1, rank 0, micro 0) to (epoch 0, step 1, rank 0, "
            "micro 1) untrained, in epoch 0, which was not ended with end_epoch(): those positions would never be "
            "trained (was the state edited, or put together from two jobs?)") + "$"):
        loader.load_state_dict(_state_at(plan, 8, consumed=[[0, 2], [4, 8]]))
    # the same gap inside an epoch ended on purpose is a history the loader writes: accepted
    e1 = plan.epoch_start(1) * plan.grad_accum
    loader.load_state_dict(_state_at(plan, e1 + 2, consumed=[[0, 2], [e1, e1 + 2]], ended=[0]))
    assert _pos(next(iter(loader))) == (1, plan.epoch_start(1) + 1, 0, 0)


@pytest.mark.parametrize("ledger,message", [
    ({"ended": [99]}, "its ledger says epoch 99 was ended early, but the plan has 2 epoch(s) and the state is at "
                      "epoch 0"),
    ({"consumed": [[0, 10]]}, "its ledger holds positions [0, 10) but its position (epoch 0, step 4, rank 0, micro 0) "
                              "is position 8: the ledger and the position come from different points"),
    ({"consumed": [[0, 6], [2, 8]]}, "its ledger's spans [[0, 6], [2, 8]] overlap or are out of order"),
])
def test_a_ledger_that_is_no_history_is_refused(tmp_path, ledger, message):
    plan = _plan(tmp_path)
    loader = dataloader_for_plan(SyntheticTokens(LENGTHS), plan, rank=0, world_size=1)
    with pytest.raises(PlanError, match="^" + re.escape(f"invalid loader state: {message}") + "$"):
        loader.load_state_dict(_state_at(plan, 8, **ledger))


def test_epoch_numbers_out_of_range(tmp_path):
    """"re-plan with --epochs 0 to train longer" was the advice for epoch -1."""
    plan = _plan(tmp_path)
    loader = dataloader_for_plan(SyntheticTokens(LENGTHS), plan, rank=0, world_size=1)
    with pytest.raises(PlanError, match=r"^epoch -1 is out of range: the plan's epochs are 0\.\.1$"):
        loader.set_epoch(-1)
    with pytest.raises(PlanError, match=r"^epoch 2 is out of range: the plan has 2 epoch\(s\) \(re-plan with "
                                        r"--epochs 3 to train longer\)$"):
        loader.set_epoch(2)
    with pytest.raises(PlanError, match=r"^epoch 1\.0 is not an epoch number: the plan's epochs are 0\.\.1$"):
        loader.set_epoch(1.0)
    loader.set_epoch(np.int64(1))
    assert loader.epoch == 1


# -- planted fault 2 (issue 30): a second loader that starts behind the first one's position ------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=st.integers(1, 40), starts=st.lists(st.integers(0, 40), min_size=1, max_size=3),
       runs=st.lists(st.integers(1, 6), min_size=3, max_size=3))
def test_ledger_spans_stay_disjoint(tmp_path_factory, first, starts, runs):
    """Fresh ledgers of one plan and rank in one process, each recording a run of positions from where
    it starts: whatever is accepted or refused, every ledger's spans stay sorted and disjoint, and a
    position another ledger of the job already holds is never recorded again."""
    plan = _LEDGER_PLAN.get("plan") or _LEDGER_PLAN.setdefault("plan", _plan(tmp_path_factory.mktemp("l")))
    total = plan.num_steps * plan.grad_accum
    ledgers = [Ledger(plan, 0)]
    for k in range(min(first, total)):
        ledgers[0].record(*_where(plan, k))
    for start, run in zip(starts, runs):
        ledger = Ledger(plan, 0)
        ledgers.append(ledger)
        before = {id(x): [list(s) for s in x.spans] for x in ledgers}
        for k in range(min(start, total - 1), min(start + run, total)):
            try:
                ledger.record(*_where(plan, k))
            except PlanError:
                break
        for x in ledgers:
            assert all(a < b for a, b in x.spans) and all(
                x.spans[i][1] < x.spans[i + 1][0] for i in range(len(x.spans) - 1)), x.spans
        if ledger.continued is None and start > 0:  # a fresh job starts at 0 or continues at a frontier
            assert ledger.spans == [], (start, ledger.spans, before)


_LEDGER_PLAN: dict = {}


def _where(plan, k):
    step, micro = divmod(k, plan.grad_accum)
    return plan.epoch_of(step), step, micro


def test_two_loaders_second_one_behind(tmp_path):
    """The planted fault: a second loader of the same plan that starts behind the first one's position
    continued its ledger and got spans [[0,6],[4,5]]: refused, the spans stay disjoint."""
    plan = _plan(tmp_path)
    data = SyntheticTokens(LENGTHS)
    first = dataloader_for_plan(data, plan, rank=0, world_size=1, lr_scale="ignore")
    for epoch in range(plan.epochs):  # epoch 0 whole, then one step of epoch 1
        first.set_epoch(epoch)
        for i, _ in enumerate(first):
            if epoch == 1 and i == plan.grad_accum:
                break
    e1 = plan.epoch_start(1) * plan.grad_accum
    assert first.guard.ledger.spans == [[0, e1 + 3]]
    second = dataloader_for_plan(data, plan, rank=0, world_size=1, lr_scale="ignore")
    second.set_epoch(1)  # behind the first loader's position, with no state loaded
    with pytest.raises(PlanError, match=r"^desync: epoch 1 started on rank 0 but epoch 0 is incomplete: 0 of "):
        next(iter(second))
    assert second.guard.ledger.spans == [] and first.guard.ledger.spans == [[0, e1 + 3]]
    third = dataloader_for_plan(data, plan, rank=0, world_size=1, lr_scale="ignore")  # continues at its frontier
    third.load_state_dict(first.state_dict())
    assert _pos(next(iter(third))) == (1, plan.epoch_start(1) + 1, 0, 1)
    assert third.guard.ledger.spans == [[0, e1 + 4]]
