"""``LoaderView``: a framework adapter's loader over a plan loader, with the plan loader's interface.

An adapter that hands the plan loader's batches on in its own form (moved to a device, turned into a
pipeline engine's tuples) keeps everything else of the plan loader: its length, epochs, guard,
batch sampler and state are the wrapped loader's, so the adapter writes only its ``__iter__``.
"""

from __future__ import annotations

from typing import Any


class LoaderView:
    """The plan loader ``loader``'s interface (``len()``, ``set_epoch``, ``end_epoch``, ``epoch``,
    ``guard``, ``batch_sampler``, ``plan``, ``state_dict``/``load_state_dict``), delegated to it;
    ``view.loader`` is the plan loader itself. Subclasses define ``__iter__``."""

    def __init__(self, loader: Any):
        self.loader = loader
        self.plan = loader.plan

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def end_epoch(self) -> None:
        self.loader.end_epoch()

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    @property
    def guard(self):
        return self.loader.guard

    @property
    def batch_sampler(self):
        return self.loader.batch_sampler

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
