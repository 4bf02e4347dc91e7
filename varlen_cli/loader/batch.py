"""Batch conventions shared by the padded and packed collate functions: the label conventions and the
bookkeeping every collated batch gets (plan position, ``label_convention``, ``num_items_in_batch``).

* ``"shifted"`` (default): ``labels[t]`` is the target of position ``t`` (the next token);
* ``"unshifted"`` (``model_shifts_labels=True``): ``labels[t]`` is the token at ``t`` itself, for
  models that shift internally; the first token of every sample (every packed entry) is ``-100``.
"""

from __future__ import annotations

from typing import Any, Literal

from .position import stamp

IGNORE_INDEX = -100  # label of positions without a target (PyTorch's cross_entropy default)
LabelMode = Literal["shifted", "unshifted"]


def labels_mode(shift_labels: bool = True, labels: str | None = None,
                model_shifts_labels: bool | None = None) -> str:
    """Resolve the label convention from the collate options (``labels`` wins, then ``model_shifts_labels``)."""
    if labels is not None:
        if labels not in ("shifted", "unshifted"):
            raise ValueError(f"labels must be 'shifted' or 'unshifted', not {labels!r}")
        return labels
    if model_shifts_labels is not None:
        return "unshifted" if model_shifts_labels else "shifted"
    return "shifted" if shift_labels else "unshifted"


def finish_batch(out: dict, info: Any, mode: str) -> dict:
    """Add the plan position, the label convention and ``num_items_in_batch`` to a collated batch."""
    out["label_convention"] = mode
    out["num_items_in_batch"] = out.get("step_loss_tokens")
    return stamp(out, info)
