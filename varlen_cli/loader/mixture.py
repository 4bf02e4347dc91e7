"""Datasets of a mixture plan (``varlen plan --mix``): ``{source name: dataset}`` behind one dataset.

A mixture plan's ``sample_ids`` are each source's own ids and its ``source`` column says which
source (``Microbatch.source``, indices into ``plan.meta["mixture"]["sources"]``).
:class:`MixtureDataset` resolves the pair; use it with :func:`mixture_dataloader` (or
``dataloader_for_plan(MixtureDataset(...), plan)``), which hands it each microbatch's plan row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .dataloader import dataloader_for_plan
from .plan_file import Plan, PlanError


class MixtureDataset(torch.utils.data.Dataset):
    """The datasets of a mixture plan's sources, by name; each checked against the plan's recorded length."""

    def __init__(self, datasets: Mapping[str, Any], plan: Plan | str):
        plan = plan if isinstance(plan, Plan) else Plan.open(plan)
        mixture = plan.meta.get("mixture")
        if not mixture:
            raise PlanError(f"{plan.path} is not a mixture plan (made without --mix): use the dataset itself")
        self.names = [s["name"] for s in mixture["sources"]]
        missing = [n for n in self.names if n not in datasets]
        if missing:
            raise PlanError(f"the plan mixes source(s) {', '.join(missing)} but no dataset was given for them "
                            f"(got {', '.join(map(str, datasets)) or 'none'})")
        for source in mixture["sources"]:
            have, want = len(datasets[source["name"]]), int(source["num_rows"])
            if have != want:
                raise PlanError(f"source {source['name']!r} has {have} samples but the plan was made for {want}: "
                                "re-run `varlen analyze` on it and `varlen plan --mix`")
        self.datasets = [datasets[n] for n in self.names]

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def __getitem__(self, key: tuple[str | int, int]):
        """``dataset[(name or source index, sample_id)]``."""
        source, index = key
        k = self.names.index(source) if isinstance(source, str) else int(source)
        return self.datasets[k][index]

    def __getitems__(self, indices: Sequence[int]) -> list:
        info = getattr(indices, "info", None)
        if info is None or info.source is None:
            raise TypeError("MixtureDataset needs each microbatch's plan row: load it with mixture_dataloader or "
                            "dataloader_for_plan")
        return [self.datasets[s][i] for s, i in zip(info.source.tolist(), indices)]


def mixture_dataloader(datasets: Mapping[str, Any], plan: Plan | str, **kwargs):
    """``dataloader_for_plan(MixtureDataset(datasets, plan), plan, **kwargs)``."""
    plan = plan if isinstance(plan, Plan) else Plan.open(plan)
    return dataloader_for_plan(MixtureDataset(datasets, plan), plan, **kwargs)
