"""OnlinePlanner over generated streams: every sample in exactly one step, each step under its target
(and at least the target less one unit before the end), group runs whole, every step a valid plan
(tests/online_helpers.py); state_dict at any point, through JSON, into a new planner: the same steps
from there on, nothing lost or repeated; and two separate processes plan the same steps."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.online_helpers import check_budget, check_counts, check_exactly_once, check_groups, fingerprint
from varlen_cli.errors import InputError, UsageError
from varlen_cli.online import OnlinePlanner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETTINGS = settings(max_examples=int(os.environ.get("ONLINE_EXAMPLES", "60")), deadline=None)


@st.composite
def stream_case(draw):
    n = draw(st.integers(0, 300))
    lengths = np.array(draw(st.lists(st.integers(0, 900), min_size=n, max_size=n)), np.int64)
    group_size = draw(st.sampled_from([None, 1, 2, 4]))
    groups = None if group_size is None else [int(i) for i in np.arange(n) // group_size]
    packed = draw(st.booleans())
    kw = dict(dp=draw(st.integers(1, 4)), num_microbatches=draw(st.sampled_from([None, None, 4])))
    if packed:
        kw.update(seq_len=4096 if group_size == 4 else 1024, split=group_size is None and draw(st.booleans()))
    else:
        kw.update(max_tokens=4096, attention_cost=draw(st.sampled_from([0.0, 1e-4])))
    if draw(st.booleans()):
        kw["step_tokens"] = draw(st.integers(1, 20000))
    else:
        kw["step_samples"] = draw(st.integers(1, 64))
    bound = draw(st.sampled_from([None, None, "buffer_tokens", "buffer_samples"]))
    if bound is not None:  # a buffer bound: at least a target of its kind, or the only target
        target = kw.get("step_tokens" if bound == "buffer_tokens" else "step_samples")
        kw[bound] = draw(st.integers(target or 1, 4 * (target or (20000 if bound == "buffer_tokens" else 64))))
        if draw(st.booleans()):
            kw.pop("step_tokens", None), kw.pop("step_samples", None)
    return lengths, groups, kw


def _within_bound(planner, kw) -> bool:
    """After the ready steps are taken, the buffer is within its bounds."""
    state = planner.state_dict()
    return (len(state["ids"]) <= kw.get("buffer_samples", len(state["ids"]))
            and sum(state["lengths"]) <= kw.get("buffer_tokens", sum(state["lengths"])))


def _run(planner, lengths, groups, start=0):
    steps = []
    g = None if groups is None else groups[start:]
    for step in planner.steps(lengths[start:], g):
        steps.append(step)
    return steps


def _check_steps(steps, lengths, groups, kw):
    ids = np.concatenate([s.ids for s in steps]) if steps else np.zeros(0, np.int64)
    assert ids.tolist() == list(range(len(lengths)))  # every sample once, in stream order, steps in order
    assert [s.step for s in steps] == list(range(len(steps)))
    for s in steps[:-1]:  # all steps but the last (the flush) meet the target
        size = int(s.lengths.sum()) if "step_tokens" in kw else len(s.ids)
        target = kw.get("step_tokens", kw.get("step_samples"))
        if kw.get("num_microbatches") is None and target is not None:
            assert size <= target or len(s.ids) == 1 or (groups is not None and len({groups[i] for i in s.ids}) == 1)
    for s in steps:
        check_exactly_once(s.plan, s.lengths)
        check_budget(s.plan, s.lengths, max_tokens=kw.get("max_tokens"), seq_len=kw.get("seq_len"),
                     attention_cost=kw.get("attention_cost", 0.0))
        check_counts(s.plan, kw["dp"], kw["num_microbatches"])
        if groups is not None:
            check_groups(s.plan, [groups[i] for i in s.ids])


@SETTINGS
@given(stream_case(), st.data())
def test_stream_steps_and_exact_resume(case, data):
    lengths, groups, kw = case
    try:
        steps = _run(OnlinePlanner(**kw), lengths, groups)
    except InputError as e:  # a sample or group over the budget, or a step over num_microbatches
        assert "\n" not in str(e)
        return
    _check_steps(steps, lengths, groups, kw)
    # stop after any sample, save, load into a new planner (through JSON), go on: the same steps
    cut = data.draw(st.integers(0, len(lengths)))
    first = OnlinePlanner(**kw)
    before = []
    for i in range(cut):
        first.add(int(lengths[i]), None if groups is None else groups[i])
        while (step := first.next_step()) is not None:
            before.append(step)
        assert _within_bound(first, kw)
    state = json.loads(json.dumps(first.state_dict()))
    second = OnlinePlanner(**kw)
    second.load_state_dict(state)
    after = _run(second, lengths, groups, start=cut)
    assert [fingerprint(s.plan) for s in before + after] == [fingerprint(s.plan) for s in steps]
    assert [s.ids.tolist() for s in before + after] == [s.ids.tolist() for s in steps]


def test_target_and_group_runs():
    planner = OnlinePlanner(dp=2, max_tokens=1000, step_tokens=100)
    steps = list(planner.steps([30] * 10))
    assert [len(s.ids) for s in steps] == [3, 3, 3, 1]  # 90 tokens a step (the 4th sample would pass 100)
    planner = OnlinePlanner(dp=2, max_tokens=1000, step_samples=3)
    steps = list(planner.steps([30] * 8, groups=[0, 0, 1, 1, 2, 2, 2, 3]))
    assert [s.ids.tolist() for s in steps] == [[0, 1], [2, 3], [4, 5, 6], [7]]  # runs whole, <= 3 samples
    # a run is planned only once complete: the open run waits for the next id (or the flush)
    planner = OnlinePlanner(dp=1, max_tokens=1000, step_samples=2)
    for g in (5, 5, 5):
        planner.add(10, g)
    assert planner.next_step() is None
    planner.add(10, 6)
    assert planner.next_step().ids.tolist() == [0, 1, 2]  # the whole run, though longer than the target
    assert [s.ids.tolist() for s in planner.flush()] == [[3]]


def test_a_buffer_bound_alone_forms_steps_as_the_buffer_fills():
    """Without a step target the bound is the target: the sample that would pass it completes a step
    of what is held (lengths that never add up to the bound exactly still form steps)."""
    steps = list(OnlinePlanner(dp=2, max_tokens=100, buffer_tokens=100).steps([30] * 10))
    assert [s.ids.tolist() for s in steps] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]  # 90 tokens: the 4th passes 100
    steps = list(OnlinePlanner(dp=1, max_tokens=100, buffer_samples=4).steps([10] * 5, groups="aabbc"))
    assert [s.ids.tolist() for s in steps] == [[0, 1, 2, 3], [4]]  # the run "b" completes when "c" comes
    # by hand: a step that is ready must be taken before the next add
    planner = OnlinePlanner(dp=1, max_tokens=100, buffer_tokens=100)
    for _ in range(4):
        planner.add(30)
    with pytest.raises(InputError, match=r"^sample 4 would bring the buffer past buffer_tokens 100 and its step was "
                                         r"not taken: call next_step\(\) until it returns None before add\(\)$"):
        planner.add(30)
    assert planner.next_step().ids.tolist() == [0, 1, 2] and planner.next_step() is None
    planner.add(30)
    # a run longer than the bound: nothing held is complete
    planner = OnlinePlanner(dp=1, max_tokens=100, buffer_tokens=50)
    planner.add(30, "x")
    with pytest.raises(InputError, match=r"^sample 1 would bring the buffer past buffer_tokens 50 and no step is "):
        planner.add(30, "x")


def test_steps_over_items_carry_them():
    items = [{"input_ids": [1] * n, "g": i // 2} for i, n in enumerate([5, 7, 3, 9, 4, 4, 8])]
    steps = list(OnlinePlanner(dp=2, max_tokens=64, step_tokens=20).steps(iter(items), group=lambda x: x["g"]))
    assert [i for s in steps for i in s.ids.tolist()] == list(range(7))
    assert all(s.items == [items[i] for i in s.ids.tolist()] for s in steps)
    assert [len(s.ids) for s in steps] == [2, 4, 1]  # group runs whole, <= 20 tokens: 12, 20, then the flush


def test_planner_refusals():
    with pytest.raises(UsageError, match=r"^OnlinePlanner needs a step target: step_tokens or step_samples \(or a "):
        OnlinePlanner(dp=1, max_tokens=10)
    with pytest.raises(UsageError, match="^OnlinePlanner takes one step target: step_tokens or step_samples, not"):
        OnlinePlanner(dp=1, max_tokens=10, step_tokens=5, step_samples=5)
    assert OnlinePlanner(dp=2, max_tokens=10, num_microbatches=3).target == 60  # every microbatch full
    assert OnlinePlanner(dp=2, max_tokens=10, buffer_tokens=50).target == 50
    with pytest.raises(UsageError, match=r"^step_tokens 200 is more than buffer_tokens 100: the buffer could never "):
        OnlinePlanner(dp=1, max_tokens=10, step_tokens=200, buffer_tokens=100)
    planner = OnlinePlanner(dp=1, max_tokens=100, step_samples=2, buffer_samples=2)
    planner.add(5, 1)
    planner.add(5, 1)
    with pytest.raises(InputError, match=r"^sample 2 would bring the buffer past buffer_samples 2 and no step is "
                                         r"complete \(a sample or group run is longer\): raise the bound$"):
        planner.add(5, 1)
    with pytest.raises(InputError, match="every sample of a grouped stream needs a group id"):
        planner.add(5)
    other = OnlinePlanner(dp=2, max_tokens=100, step_samples=10)
    with pytest.raises(InputError, match="^the OnlinePlanner state was saved with other options"):
        other.load_state_dict(planner.state_dict())


PLAN_IN_A_PROCESS = """
import hashlib, json, sys
import numpy as np
from varlen_cli.online import OnlinePlanner, plan_step
assert "torch" not in sys.modules
rng = np.random.default_rng(7)
lengths = np.minimum(rng.lognormal(6.5, 1.0, 3000).astype(np.int64) + 32, 4000)
out = []
for kw in (dict(max_tokens=16384, attention_cost=2e-5), dict(seq_len=8192, attention_cost=2e-5),
           dict(max_tokens=32768, pad_multiple=64)):
    p = plan_step(lengths, dp=4, groups=np.arange(3000) // 2, **kw)
    out.append([[m.tolist() for m in r] for r in p.ranks] + [p.cost.tolist(), p.seqlens.tolist()])
    for s in OnlinePlanner(dp=4, step_tokens=400000, **kw).steps(lengths):
        out.append([[m.tolist() for m in r] for r in s.plan.ranks] + [s.plan.cost.tolist(), s.ids.tolist()])
print(hashlib.sha256(json.dumps(out).encode()).hexdigest())
"""


def test_same_plan_in_two_processes_without_a_collective():
    """Two separate interpreters (no torch, nothing shared) plan the same steps, bit for bit."""
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONHASHSEED="random")
    digests = [subprocess.run([sys.executable, "-c", PLAN_IN_A_PROCESS], capture_output=True, text=True, env=env,
                              timeout=120, check=True).stdout.strip() for _ in range(2)]
    assert len(digests[0]) == 64 and digests[0] == digests[1]
    assert hashlib.sha256(b"").hexdigest() != digests[0]
