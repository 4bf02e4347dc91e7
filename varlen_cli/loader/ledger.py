"""The consumption ledger: which positions of one rank's stream a job has trained, across resumes.

A rank's microbatches are numbered ``k = step * grad_accum + micro`` (``step`` global over the
plan's epochs; every rank has the same positions). The ledger holds the consumed ``k`` as sorted,
disjoint ``[start, stop)`` spans (one span for a job trained in order, one more per epoch ended
early) and the epochs ended early on purpose (``loader.end_epoch()``). It travels in every state the
loader saves, so a resumed job knows what was trained before its checkpoint.

:meth:`Ledger.record` refuses, with a one-line :class:`PlanError` naming the positions and the likely
cause: a position trained twice (a replay after a resume, an epoch loop that went back), positions
skipped inside an epoch, and an epoch started while an earlier one is incomplete and was not ended
with ``end_epoch()``. The plan's end needs no rule here: the sampler yields only plan positions, so
a pass past the end is a replay. A new loader that starts exactly where the previous loader of the
same plan and rank in this process stopped (a framework that makes one loader per epoch) continues
that loader's ledger.
"""

from __future__ import annotations

import bisect

from .. import format
from ..errors import PlanError
from .plan_file import Plan
from .replan import first_step, lineage

_LATEST: dict = {}  # (plan fingerprint, rank) -> the ledger that recorded last in this process

LOOP_HINT = "start the epoch loop at the loader's epoch, `for epoch in range(loader.epoch, plan.epochs)`, " \
            "and call loader.set_epoch(epoch) in it"


class Ledger:
    """The consumed positions of one rank's stream (see the module docstring)."""

    def __init__(self, plan: Plan, rank: int = 0):
        self.plan = plan
        self.rank = int(rank)
        self.spans: list[list[int]] = []  # sorted, disjoint [start, stop) of consumed positions
        self.ended: set[int] = set()  # epochs ended early on purpose (end_epoch)
        self.restored_at: int | None = None  # the position this job resumed at (None: a fresh job)
        self.continued: Ledger | None = None  # the previous loader's ledger this one took over

    # -- positions -------------------------------------------------------------------------------
    def index(self, step: int, micro: int) -> int:
        return int(step) * self.plan.grad_accum + int(micro)

    def describe(self, k: int) -> str:
        step, micro = divmod(int(k), self.plan.grad_accum)
        if step >= self.plan.num_steps:
            return f"(the end of the plan, step {step})"
        return f"(epoch {self.plan.epoch_of(step)}, step {step}, rank {self.rank}, micro {micro})"

    def epoch_span(self, epoch: int) -> tuple[int, int]:
        """``[start, stop)`` positions of ``epoch``."""
        start = self.plan.epoch_start(epoch)
        return self.index(start, 0), self.index(start + self.plan.steps_per_epoch[epoch], 0)

    @property
    def frontier(self) -> int:
        """The position right after the last one consumed (0 when none was)."""
        return self.spans[-1][1] if self.spans else 0

    @property
    def total(self) -> int:
        return self.plan.num_steps * self.plan.grad_accum

    def consumed(self, k: int) -> bool:
        i = bisect.bisect_right(self.spans, [k, float("inf")]) - 1
        return i >= 0 and self.spans[i][0] <= k < self.spans[i][1]

    def count(self, lo: int, hi: int) -> int:
        """Consumed positions in ``[lo, hi)``."""
        return sum(max(0, min(b, hi) - max(a, lo)) for a, b in self.spans)

    # -- recording -------------------------------------------------------------------------------
    def record(self, epoch: int, step: int, micro: int) -> None:
        """Record a consumed position; :class:`PlanError` if it breaks a rule (module docstring)."""
        k = self.index(step, micro)
        if not self.spans and self.restored_at is None and not self._continues(k):
            self._check_fresh_start()
        if self.consumed(k):
            raise PlanError(self._replay_message(k))
        if epoch in self.ended:
            raise PlanError(f"desync: rank {self.rank} is given {self.describe(k)} but epoch {epoch} was ended "
                            f"early with loader.end_epoch(): {LOOP_HINT}")
        if k < self.frontier:
            raise PlanError(f"desync: rank {self.rank} is given {self.describe(k)}, before this job's last trained "
                            f"position {self.describe(self.frontier - 1)}: the plan is trained in order ({LOOP_HINT})")
        if k > self.frontier:
            self._check_gap(self.frontier, k, epoch)
        if self.spans and self.spans[-1][1] == k:
            self.spans[-1][1] = k + 1
        else:
            self.spans.append([k, k + 1])
        _LATEST[(self.plan.fingerprint, self.rank)] = self

    def _continues(self, k: int) -> bool:
        """A new loader of a job that continues where the previous loader of the same plan and rank in
        this process stopped (a framework that makes a loader per epoch): take over its ledger. Only
        at exactly that loader's frontier; the checks that follow then see the whole job's history."""
        previous = _LATEST.get((self.plan.fingerprint, self.rank))
        if previous is None or previous is self or previous.frontier != k or k == 0:
            return False
        self.spans = [list(span) for span in previous.spans]
        self.ended = set(previous.ended)
        self.continued = previous
        return True

    def _check_fresh_start(self) -> None:
        """A job that starts without a loaded state: refused on a plan that continues another job's
        steps (``varlen replan``), which would train a fresh model on the rest of the data only."""
        start = first_step(self.plan)
        if start > 0:
            info = lineage(self.plan)
            made = f"`varlen replan` from step {info['from_step']} of its parent" if "from_step" in info else \
                "`varlen replan`"
            if info.get("kind") == "extend":
                made = "`varlen plan --extend` of a plan made by `varlen replan`"
            raise PlanError(f"{self.plan.path} continues a job from its global step {start} (made by {made}), but "
                            f"this loader starts fresh: load the checkpoint the plan was made from "
                            f"(loader.load_state_dict(its loader state)) before iterating, or a new model trains on "
                            f"the rest of the data only")

    def _replay_message(self, k: int) -> str:
        where = (f" (it resumed at {self.describe(self.restored_at)})" if self.restored_at is not None else "")
        if self.frontier >= self.total and self.count(0, self.total) + self._ended_size() >= self.total:
            return (f"desync: the plan is finished (all {self.plan.num_steps} steps of {self.plan.epochs} epoch(s) "
                    f"trained) but rank {self.rank} is given {self.describe(k)} again: a pass past the plan's end "
                    f"(re-plan with more --epochs, or `varlen plan --extend PLAN --epochs N`, to train longer)")
        return (f"desync: rank {self.rank} is given {self.describe(k)}, which this job already trained{where}: the "
                f"plan is being replayed ({LOOP_HINT}; a new pass over an epoch needs set_epoch)")

    def _ended_size(self) -> int:
        size = 0
        for e in self.ended:
            lo, hi = self.epoch_span(e)
            size += (hi - lo) - self.count(lo, hi)
        return size

    def _check_gap(self, lo: int, hi: int, epoch: int) -> None:
        """Positions ``[lo, hi)`` are being skipped: only the rest of epochs ended with end_epoch() may be."""
        start, _ = self.epoch_span(epoch)
        for e in range(self.plan.epoch_of(lo // self.plan.grad_accum), epoch):
            if e in self.ended:
                continue
            first, stop = self.epoch_span(e)
            done = self.count(first, stop)
            missing_from = max(lo, first)
            raise PlanError(
                f"desync: epoch {epoch} started on rank {self.rank} but epoch {e} is incomplete: "
                f"{done // self.plan.grad_accum} of {self.plan.steps_per_epoch[e]} steps trained, "
                f"{self.describe(missing_from)} to {self.describe(stop - 1)} never (an epoch loop that stopped early "
                f"or skipped set_epoch; to stop an epoch early on purpose call loader.end_epoch() first)")
        if hi > max(lo, start):
            first = self.describe(max(lo, start))
            raise PlanError(f"desync: rank {self.rank} is given {self.describe(hi)} but {first} "
                            f"to {self.describe(hi - 1)} were never trained: microbatches were skipped (a wrapper or "
                            f"a fast-forward dropped them; resume from the loader's state_dict() instead)")

    def end_epoch(self, epoch: int) -> None:
        """Mark ``epoch`` as ended early on purpose: its untrained positions may be skipped."""
        self.plan.check_epoch(epoch)
        self.ended.add(int(epoch))

    # -- state -----------------------------------------------------------------------------------
    def state(self, upto: int | None = None) -> dict:
        """The ledger as a small JSON-able dict: spans clipped to positions ``< upto``."""
        upto = self.frontier if upto is None else int(upto)
        spans = [[a, min(b, upto)] for a, b in self.spans if a < upto]
        return {"consumed": spans, "ended": sorted(self.ended)}

    def restore(self, state: dict | None, position: int) -> None:
        """Load a ledger saved with a loader state at ``position`` (its shape checked by
        :func:`varlen_cli.format.loader_state_problem`); a state without one (older states, sampler
        states of a standalone sampler) means every position before it was trained. Refuses a ledger
        that is not a history this loader can write: spans out of order or past the position, an
        ended epoch the plan does not have, or untrained positions outside the epochs ended early."""
        if state is None:
            self.spans = [[0, int(position)]] if position > 0 else []
            self.ended = set()
        else:
            spans = [[int(a), int(b)] for a, b in state.get("consumed", [])]
            ended = {int(e) for e in state.get("ended", [])}
            problem = self._history_problem(spans, ended, int(position))
            if problem is not None:
                raise PlanError(f"invalid loader state: {problem}")
            self.spans, self.ended = spans, ended
        self.restored_at = int(position)

    def _history_problem(self, spans: list[list[int]], ended: set[int], position: int) -> str | None:
        """Why ``spans`` and ``ended`` cannot be the ledger of a job at ``position`` (None if they can):
        :func:`varlen_cli.format.ledger_history_problem`, the rule ``varlen replan --state`` keeps too."""
        return format.ledger_history_problem(spans, ended, position, self.plan.grad_accum,
                                             list(self.plan.steps_per_epoch), self.describe)
