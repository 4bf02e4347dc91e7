"""``OnlinePlanner``: :func:`~varlen_cli.online.plan_step`'s guarantees over a stream of samples.

Samples arrive one at a time (:meth:`OnlinePlanner.add`) and wait in a bounded buffer. As soon as
the buffered samples hold the step's target (``step_tokens`` tokens, or ``step_samples`` samples),
the oldest of them, up to the target, become one step planned by :func:`plan_step`'s planner
(:meth:`OnlinePlanner.next_step`): a step holds a near-constant number of tokens, and a sample
waits at most until the target is met after it. At the end of the stream :meth:`OnlinePlanner.flush`
plans what is left.

Every sample gets a stream id, its 0-based position in the stream; a :class:`Step` gives its samples'
ids. ``groups`` are runs of consecutive samples with the same group id (a GRPO group, a DPO pair
as the stream yields them): a run is planned only once complete (the next sample has another id,
or the stream ended) and never split across steps or microbatches.

:meth:`OnlinePlanner.state_dict` holds the counters and the buffered, not yet planned samples
(their ids, lengths, group ids): a planner made with the same options and loaded from it continues
exactly, nothing lost and nothing repeated. The planner needs no collective: every rank that feeds
it the same samples plans the same steps. Imports only numpy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError, UsageError
from .form import TooManyMicrobatches
from .spec import StepSpec, make_spec
from .step import StepPlan, plan_with

STATE_VERSION = 1
ROUND_SPILL = 0.5
"""A packed step passing whole rounds of microbatches by less than this share of one is cut back."""
ROUND_FILL = 0.99
"""... to this share of its whole rounds' tokens (the packer fills rows to about 99.5%)."""


@dataclass(frozen=True)
class Step:
    """One planned step: its number, the stream ids of its samples and their plan (``plan``'s
    indices are positions in ``ids``)."""

    step: int
    ids: np.ndarray  # int64 stream ids of the step's samples
    lengths: np.ndarray  # int64, aligned with ids
    plan: StepPlan
    items: list | None = None  # the samples themselves, aligned with ids (steps() over items)

    def rank_ids(self, rank: int) -> list[np.ndarray]:
        """Stream ids of rank ``rank``'s microbatches (a split sample once per entry)."""
        return [self.ids[m] for m in self.plan.ranks[rank]]


def item_length(item: Any, key: str = "input_ids") -> int:
    """Tokens of one stream item: ``len(item[key])`` for a dict, else ``len(item)``."""
    return len(item[key]) if isinstance(item, dict) else len(item)


def _with_items(step: Step, held: dict) -> Step:
    """``step`` with its items (taken out of ``held``) when the stream gave items."""
    if not held:
        return step
    return dataclasses.replace(step, items=[held.pop(i) for i in step.ids.tolist()])


class OnlinePlanner:
    """Plan steps from a stream (see the module docstring). The planning options are
    :func:`~varlen_cli.online.plan_step`'s; a step holds at most ``step_tokens`` tokens (or
    ``step_samples`` samples), and at least that minus one unit once the stream has that many.
    ``buffer_samples`` / ``buffer_tokens`` bound what is held: the sample that would pass the bound
    completes a step of what is held (the buffer holds at most the bound plus that sample until the
    step is taken); one group run longer than the bound is refused in one line."""

    def __init__(self, *, dp, max_tokens=None, seq_len=None, num_microbatches=None, attention_cost=0.0,
                 max_samples=None, pad_multiple=1, lr_scaling="none", base_batch_size=None, lr_scale_by="loss-tokens",
                 split=False, max_per_row=None, step_tokens=None, step_samples=None, buffer_samples=None,
                 buffer_tokens=None):
        self.spec: StepSpec = make_spec(
            dp=dp, max_tokens=max_tokens, seq_len=seq_len, num_microbatches=num_microbatches,
            attention_cost=attention_cost, max_samples=max_samples, pad_multiple=pad_multiple, lr_scaling=lr_scaling,
            base_batch_size=base_batch_size, lr_scale_by=lr_scale_by, split=split, max_per_row=max_per_row)
        if step_tokens is not None and step_samples is not None:
            raise UsageError("OnlinePlanner takes one step target: step_tokens or step_samples, not both")
        if step_tokens is None and step_samples is None:  # the buffer's bound, or the step's microbatches full
            step_tokens, step_samples = self._default_target(buffer_tokens, buffer_samples)
        for name, value in (("step_tokens", step_tokens), ("step_samples", step_samples),
                            ("buffer_samples", buffer_samples), ("buffer_tokens", buffer_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
                raise UsageError(f"{name} must be an integer >= 1 (got {value!r})")
        for target, bound, noun in ((step_tokens, buffer_tokens, "tokens"), (step_samples, buffer_samples, "samples")):
            if target is not None and bound is not None and target > bound:
                raise UsageError(f"step_{noun} {target:,} is more than buffer_{noun} {bound:,}: the buffer could never "
                                 f"hold a step; raise buffer_{noun} or lower step_{noun}")
        self.by_tokens = step_tokens is not None
        self.target = int(step_tokens if self.by_tokens else step_samples)
        self.buffer_samples = None if buffer_samples is None else int(buffer_samples)
        self.buffer_tokens = None if buffer_tokens is None else int(buffer_tokens)
        self.next_id = 0  # stream id of the next sample added
        self.step = 0  # number of the next step planned
        self._ids: list[int] = []
        self._lengths: list[int] = []
        self._grouped: bool | None = None  # whether the stream's samples come with group ids (None: no sample yet)
        self._groups: list = []  # group id per buffered sample (grouped streams)
        self._tokens = 0  # tokens buffered
        self._open, self._open_tokens = 0, 0  # the last group run (it may go on): samples and tokens

    def _default_target(self, buffer_tokens, buffer_samples) -> tuple:
        """Without a step target: the buffer's bound (a step as soon as the buffer is full), else with
        ``num_microbatches`` every microbatch of the step full; else refused in one line."""
        if buffer_tokens is not None:
            return buffer_tokens, None
        if buffer_samples is not None:
            return None, buffer_samples
        if self.spec.num_microbatches is not None:
            return self.spec.dp * self.spec.num_microbatches * self.spec.microbatch_tokens, None
        raise UsageError("OnlinePlanner needs a step target: step_tokens or step_samples (or a buffer bound, "
                         "buffer_tokens / buffer_samples, or num_microbatches)")

    # -- feeding --------------------------------------------------------------------------------------
    @property
    def buffered(self) -> int:
        """Samples held, not yet planned."""
        return len(self._ids)

    def add(self, length: int, group=None) -> int:
        """Buffer one sample of ``length`` tokens (``group``: its group id); returns its stream id."""
        length = int(length)
        if length < 0:
            raise InputError(f"sample {self.next_id} has a negative length ({length})")
        if self._grouped is None:
            self._grouped = group is not None
        elif self._grouped != (group is not None):
            raise InputError(f"sample {self.next_id}: every sample of a grouped stream needs a group id (or none does)")
        if group is not None:
            group = group.item() if isinstance(group, np.generic) else group
        self._check_bound(length, group)
        if group is not None:
            if self._groups and self._groups[-1] == group:  # the open run goes on
                self._open, self._open_tokens = self._open + 1, self._open_tokens + length
            else:  # a new run: the one before is complete
                self._open, self._open_tokens = 1, length
            self._groups.append(group)
        self._ids.append(self.next_id)
        self._lengths.append(length)
        self._tokens += length
        self.next_id += 1
        return self.next_id - 1

    def _over_bound(self, samples: int, tokens: int) -> bool:
        """Whether holding ``samples`` samples of ``tokens`` tokens passes a buffer bound."""
        return ((self.buffer_samples is not None and samples > self.buffer_samples)
                or (self.buffer_tokens is not None and tokens > self.buffer_tokens))

    def _check_bound(self, length: int, group) -> None:
        """The sample that would pass a buffer bound is taken when it completes a step of what is held
        (the complete runs before it, :meth:`ready`); refused when nothing held is complete (one run
        longer than the bound) or when the buffer is already past its bound (its step not taken)."""
        held, tokens = len(self._ids), self._tokens
        if not self._over_bound(held + 1, tokens + length):
            return
        ends_run = self._grouped and bool(self._groups) and self._groups[-1] != group
        complete = held - (0 if ends_run else self._open)  # held samples complete once this one is added
        if self._over_bound(held, tokens) or not complete:
            bound = (f"buffer_samples {self.buffer_samples:,}" if self.buffer_samples is not None
                     and held + 1 > self.buffer_samples else f"buffer_tokens {self.buffer_tokens:,}")
            why = ("its step was not taken: call next_step() until it returns None before add()" if complete
                   else "no step is complete (a sample or group run is longer): raise the bound")
            raise InputError(f"sample {self.next_id} would bring the buffer past {bound} and {why}")

    def _complete(self) -> int:
        """Buffered samples whose group run is complete (all of them without groups)."""
        return len(self._ids) - self._open

    def ready(self) -> bool:
        """Whether the buffer holds a whole step: the target met by complete samples, or a buffer bound
        passed (by the sample that completes the step of what is held)."""
        k = self._complete()
        held = self._tokens - self._open_tokens if self.by_tokens else k
        return k > 0 and (held >= self.target or self._over_bound(len(self._ids), self._tokens))

    # -- planning -------------------------------------------------------------------------------------
    def _runs(self, k: int) -> np.ndarray | None:
        """Unit (run) index of each of the first ``k`` buffered samples, None without groups."""
        if not self._grouped:
            return None
        g = self._groups[:k]
        change = np.fromiter((a != b for a, b in zip(g[1:], g[:-1])), dtype=bool, count=max(k - 1, 0))
        return np.concatenate([[0], np.cumsum(change)]).astype(np.int64) if k else np.zeros(0, np.int64)

    def _head(self, k: int, runs: np.ndarray | None, flush: bool = False) -> int:
        """How many of the first ``k`` samples the next step takes: whole runs up to the target; for
        packed rows (not at the flush) cut back to whole rounds of microbatches (:meth:`_whole_rounds`)."""
        lengths = np.asarray(self._lengths[:k], np.int64)
        weight = lengths if self.by_tokens else np.ones(k, np.int64)
        take = self._cut(np.cumsum(weight), self.target, runs, k)
        if self.spec.packed and not flush and self.spec.num_microbatches is None:
            take = self._whole_rounds(np.cumsum(lengths), take, runs, k)
        return take

    @staticmethod
    def _cut(cum: np.ndarray, limit: float, runs: np.ndarray | None, k: int) -> int:
        """The most of the first ``k`` samples, whole runs, whose ``cum`` stays within ``limit`` (at
        least the first run: a unit over the limit is a step of its own)."""
        take = int(np.searchsorted(cum, limit, side="right"))
        if runs is not None and 0 < take < k and runs[take] == runs[take - 1]:
            take = int(np.searchsorted(runs, runs[take], side="left"))  # back to the run's start
        if take == 0:
            take = int(np.searchsorted(runs, 0, side="right")) if runs is not None else 1
        return take

    def _whole_rounds(self, cum_tokens: np.ndarray, take: int, runs: np.ndarray | None, k: int) -> int:
        """A step's microbatches come in rounds of dp (one a rank): a step whose tokens pass a whole
        number of rounds by less than :data:`ROUND_SPILL` of one would spend a round mostly empty, so it
        stops at :data:`ROUND_FILL` of the whole rounds and the rest waits for the next step."""
        per_round = self.spec.dp * self.spec.microbatch_tokens
        tokens = int(cum_tokens[take - 1]) if take else 0
        rounds, spill = divmod(tokens, per_round)
        if rounds < 1 or spill >= ROUND_SPILL * per_round:
            return take
        return min(take, self._cut(cum_tokens, rounds * per_round * ROUND_FILL, runs, k))

    def next_step(self, flush: bool = False) -> Step | None:
        """The next step when the buffer holds one (``flush``: also a last, smaller one), else None."""
        k = len(self._ids) if flush else self._complete()
        if not k or (not flush and not self.ready()):
            return None
        runs = self._runs(k)
        take = self._head(k, runs, flush)
        while True:
            lengths = np.asarray(self._lengths[:take], np.int64)
            try:
                plan = plan_with(self.spec, lengths, None if runs is None else runs[:take])
                break
            except TooManyMicrobatches as e:  # num_microbatches fixed: fewer samples this step
                fewer = self._shrink(take, runs, e.needed)
                if fewer == take:
                    raise
                take = fewer
        ids = np.asarray(self._ids[:take], np.int64)
        if take > len(self._ids) - self._open:  # a flush took the open run
            self._open, self._open_tokens = 0, 0
        del self._ids[:take], self._lengths[:take], self._groups[:take]
        self._tokens -= int(lengths.sum())
        step = Step(self.step, ids, lengths, plan)
        self.step += 1
        return step

    def _shrink(self, take: int, runs: np.ndarray | None, needed: int) -> int:
        """A shorter head when ``take`` samples need ``needed`` microbatches, more than the step has."""
        slots = self.spec.dp * self.spec.num_microbatches
        fewer = min(take - 1, math.floor(take * slots / needed))
        if runs is not None and fewer > 0:
            fewer = int(np.searchsorted(runs, runs[fewer], side="left")) if fewer < take else fewer
        return max(fewer, 1 if runs is None else int(np.searchsorted(runs, 0, side="right")))

    def steps(self, stream: Iterable, groups: Iterable | None = None, flush: bool = True, *,
              length: Callable[[Any], int] | None = None, group: Callable[[Any], Any] | None = None) -> Iterator[Step]:
        """Feed ``stream`` and yield every step as soon as it is whole; then, with ``flush``, the rest.
        ``stream`` yields lengths, or items (an iterator, an ``IterableDataset``) whose tokens
        ``length(item)`` counts (default: ``len(item["input_ids"])`` or ``len(item)``); the steps then
        carry their items. Group ids come from ``groups`` (aligned with the stream) or ``group(item)``."""
        group_iter = iter(groups) if groups is not None else None
        held: dict[int, Any] = {}
        for element in stream:
            counted = length is None and isinstance(element, (int, np.integer))
            g = next(group_iter) if group_iter is not None else (None if group is None else group(element))
            sid = self.add(element if counted else (length or item_length)(element), g)
            if not counted:
                held[sid] = element
            while (step := self.next_step()) is not None:
                yield _with_items(step, held)
        if flush:
            for step in self.flush():
                yield _with_items(step, held)

    def flush(self) -> Iterator[Step]:
        """Plan what is left in the buffer (the stream ended)."""
        while (step := self.next_step(flush=True)) is not None:
            yield step

    # -- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The counters and the buffered, unplanned samples: plain Python values (JSON and torch.save)."""
        return {"version": STATE_VERSION, "options": self._options(), "next_id": self.next_id, "step": self.step,
                "ids": list(self._ids), "lengths": list(self._lengths), "grouped": self._grouped,
                "groups": list(self._groups), "open": self._open}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`: refused in one line when it was saved with other options."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise InputError("not an OnlinePlanner state (or one of another version)")
        if state.get("options") != self._options():
            raise InputError(f"the OnlinePlanner state was saved with other options ({state.get('options')}); make "
                             f"the planner with the same ones ({self._options()})")
        ids, lengths, groups = list(state["ids"]), [int(x) for x in state["lengths"]], list(state["groups"])
        grouped, open_run = state["grouped"], int(state["open"])
        if len(ids) != len(lengths) or (grouped and len(groups) != len(ids)) or not 0 <= open_run <= len(ids):
            raise InputError("the OnlinePlanner state is damaged: its buffered ids, lengths and groups disagree")
        self.next_id, self.step = int(state["next_id"]), int(state["step"])
        self._ids, self._lengths, self._groups, self._grouped = [int(x) for x in ids], lengths, groups, grouped
        self._tokens = sum(lengths)
        self._open, self._open_tokens = open_run, sum(lengths[len(lengths) - open_run:])

    def _options(self) -> dict:
        s = self.spec
        return {"dp": s.dp, "budget": s.budget.to_metadata(), "pad_multiple": s.shape.pad_multiple,
                "seq_len": s.seq_len, "rows_per_microbatch": s.rows_per_mb, "num_microbatches": s.num_microbatches,
                "max_per_row": s.max_per_row, "split": s.split, "lr_scaling": s.lr_scaling,
                "lr_scale_by": s.lr_scale_by, "base_batch_size": s.base_batch_size,
                "target": [("tokens" if self.by_tokens else "samples"), self.target],
                "buffer": [self.buffer_samples, self.buffer_tokens]}  # a bound passed completes a step
