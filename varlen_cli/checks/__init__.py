"""The invariants of a plan, checked on its arrays: ``varlen validate`` (:mod:`varlen_cli.validate`,
which reads a plan file) and the planner's own last step before writing (so the planner cannot
write a plan that ``varlen validate`` rejects) run these same checks.

The checks run on *windows*: consecutive plan rows that hold whole steps (:class:`PlanArrays`, with
``first_row``), fed one after another to :class:`PlanChecks`; a whole plan in memory is one window
(:func:`run_checks`). A plan of a billion samples is checked window by window in bounded memory
(issue 25): whatever a check needs across windows is kept small (per-step values, the distinct
seqlens), and exactly-once is a bitmap of one bit per sample and epoch. Everything is recomputed from
the columns and the metadata, vectorised over segments (CSR offsets of the list columns).
Imports numpy, the plan format and the budget only (no planner).

One module a concern:

* :mod:`~varlen_cli.checks.arrays`: :class:`PlanArrays`, :class:`Check` and the helpers every check uses;
* :mod:`~varlen_cli.checks.layout`: the layout and counts checks;
* :mod:`~varlen_cli.checks.coverage`: exactly once per epoch, over the keys of
  :mod:`~varlen_cli.checks.keys`, the split samples of :mod:`~varlen_cli.checks.split` and the tiling
  of :mod:`~varlen_cli.checks.tiling` (chunks spilled by :mod:`~varlen_cli.checks.key_spill`);
* :mod:`~varlen_cli.checks.budget`: the budget and shapes checks;
* :mod:`~varlen_cli.checks.steps`: the per-step totals, ``lr_scale``, straggler and loss tokens;
* :mod:`~varlen_cli.checks.driver`: :class:`PlanChecks` and :func:`run_checks`, every check at once;
* :mod:`~varlen_cli.checks.scan`: a plan file read in windows of whole steps.
"""

from .arrays import MAX_EXAMPLES, Check, Examples, PlanArrays, segment_reduce
from .budget import DENSE_SEQLEN, BudgetCheck, Shapes
from .coverage import Coverage
from .driver import PlanChecks, run_checks
from .key_spill import KeyRangeSpill
from .keys import Bitmap, Keys, keys_of, mixture_copies, mixture_extra
from .layout import Counts, Layout
from .split import SplitInfo, split_info
from .steps import LossTokens, Lr, StepTotals, Straggler, completed, final_entries

__all__ = [
    "DENSE_SEQLEN", "MAX_EXAMPLES", "Bitmap", "BudgetCheck", "Check", "Counts", "Coverage", "Examples", "KeyRangeSpill",
    "Keys", "Layout", "LossTokens", "Lr", "PlanArrays", "PlanChecks", "Shapes", "SplitInfo", "StepTotals", "Straggler",
    "completed", "final_entries", "keys_of", "mixture_copies", "mixture_extra", "run_checks", "segment_reduce",
    "split_info",
]
