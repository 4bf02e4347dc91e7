"""The layout check (rows in (step, rank, micro) order, steps and epochs as the metadata says) and the
counts check (list columns and ``num_samples``/``batch_size`` agree, no negative ids)."""

from __future__ import annotations

import numpy as np

from .arrays import Check, Examples, PlanArrays, edges_decrease


class Layout:
    def __init__(self, meta: dict):
        self.meta = meta
        self.dp, self.accum = int(meta["dp"]), int(meta["grad_accum"])
        self.slots = self.dp * self.accum
        self.spe = [int(s) for s in meta.get("steps_per_epoch", [])]
        self.epochs = int(meta.get("epochs", len(self.spe)))
        self.n = 0
        self.bad = {name: Examples() for name in ("step", "rank", "micro")}
        self.edges: list = []  # (first row, first epoch, last epoch) of each window
        self.decrease = self.outside = self.spans = False
        self.rows_per_epoch = np.zeros(max(self.epochs, 0), np.int64)

    def update(self, a: PlanArrays) -> None:
        c, n = a.cols, a.count
        position = a.first_row + np.arange(n)
        for name, want in (("step", position // self.slots), ("rank", position % self.slots // self.accum),
                           ("micro", position % self.accum)):
            self.bad[name].add(c[name] != want, position, a.first_row)
        epoch = c["epoch"].astype(np.int64)
        if n:
            if (np.diff(epoch) < 0).any():
                self.decrease = True
            self.edges.append((a.first_row, int(epoch[0]), int(epoch[-1])))
            if int(epoch.min()) < 0 or int(epoch.max()) >= self.epochs:
                self.outside = True
            else:
                self.rows_per_epoch += np.bincount(epoch, minlength=self.epochs)
            whole = n - n % self.slots
            if whole and (epoch[:whole:self.slots] != epoch[self.slots - 1:whole:self.slots]).any():
                self.spans = True
        self.n += n

    def merge(self, other: Layout) -> None:
        for name, ex in self.bad.items():
            ex.merge(other.bad[name])
        self.edges += other.edges
        self.decrease |= other.decrease
        self.outside |= other.outside
        self.spans |= other.spans
        self.rows_per_epoch += other.rows_per_epoch
        self.n += other.n

    def result(self) -> Check:
        n, slots = self.n, self.slots
        self.decrease |= edges_decrease(self.edges)
        if n % slots:
            return Check("layout", False, f"{n} microbatches is not a multiple of dp x grad_accum = {slots}")
        steps = n // slots
        problems = [f"{name} out of (step, rank, micro) order at rows {ex}" for name, ex in self.bad.items()
                    if ex.values]
        if int(self.meta.get("num_steps", steps)) != steps:
            problems.append(f"metadata says {self.meta.get('num_steps')} steps, the plan has {steps}")
        if "num_microbatches" in self.meta and int(self.meta["num_microbatches"]) != n:
            problems.append(f"metadata says {self.meta['num_microbatches']} microbatches, the plan has {n}")
        if n and self.decrease:
            problems.append("epochs decrease")
        elif n and self.outside:
            problems.append(f"epochs outside 0..{self.epochs - 1}")
        elif len(self.spe) != self.epochs:
            problems.append(f"metadata lists steps for {len(self.spe)} epochs, the plan has {self.epochs}")
        else:
            have = self.rows_per_epoch // slots
            if have.tolist() != self.spe:
                bad = np.flatnonzero(have != np.asarray(self.spe))
                problems.append(f"steps_per_epoch says {self.spe[bad[0]]} steps in epoch {bad[0]}, the epoch column "
                                f"{int(have[bad[0]])}")
            elif steps and self.spans:
                problems.append("a step spans two epochs")
        if problems:
            return Check("layout", False, "; ".join(problems))
        return Check("layout", True, f"{steps} steps x {self.dp} ranks x {self.accum} microbatches, "
                     f"{self.epochs} epoch(s)")


class Counts:
    def __init__(self, packed: bool):
        self.packed = packed
        self.bad = self.under = self.negative = 0
        self.entries = {"sample_ids": 0}

    def update(self, a: PlanArrays) -> bool:
        """False when the list columns disagree or ids are negative (the other checks skip such rows)."""
        c = a.cols
        self.bad += int(np.count_nonzero(c["num_samples"] != np.diff(a.offsets)))
        self.entries["sample_ids"] += len(a.ids)
        ok = True
        for name, values in (("sample_lengths", a.lengths), ("sample_rows", a.rows), ("sample_starts", a.starts),
                             ("source", a.source)):
            if values is not None:
                self.entries[name] = self.entries.get(name, 0) + len(values)
                ok &= len(values) == len(a.ids)
        if not self.packed:
            self.under += int(np.count_nonzero(c["batch_size"] < c["num_samples"]))
        if len(a.ids) and int(a.ids.min()) < 0:
            self.negative += int((a.ids < 0).sum())
            ok = False
        return ok

    def merge(self, other: Counts) -> None:
        self.bad += other.bad
        self.under += other.under
        self.negative += other.negative
        for name, count in other.entries.items():
            self.entries[name] = self.entries.get(name, 0) + count

    def result(self) -> Check:
        problems = []
        if self.bad:
            problems.append(f"num_samples != len(sample_ids) in {self.bad} rows")
        for name, count in self.entries.items():
            if name != "sample_ids" and count != self.entries["sample_ids"]:
                problems.append(f"{name} has {count} entries, sample_ids {self.entries['sample_ids']}")
        if self.under:
            problems.append(f"batch_size < num_samples in {self.under} rows")
        if self.negative:
            problems.append(f"{self.negative} negative sample ids")
        if problems:
            return Check("counts", False, "; ".join(problems))
        return Check("counts", True, "num_samples and batch_size consistent")
