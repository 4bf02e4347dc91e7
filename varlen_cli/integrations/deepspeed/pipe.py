"""DeepSpeed's pipeline engine on a plan: ``engine.train_batch(data_iter=iter(loader))``.

``PipelineEngine.train_batch`` pulls ``gradient_accumulation_steps`` items per step from
``data_iter`` on its first and last stages: ``(inputs, labels)``, inputs for the first stage, labels
for the loss function on the last. :class:`PipeLoader` is the plan's loader as such tuples:
``inputs`` are the batch's ``input_ids`` (or the keys given), ``labels`` is ``(labels,
normaliser)``, the normaliser ``dp x grad_accum / step_loss_tokens`` (the engine divides the loss
by ``grad_accum`` and averages gradients over ``dp``), so :func:`pipe_loss` (the module's
``loss_fn``) gives the exact mean over the whole step's targets.

The engine sizes its p2p buffers at the first send and keeps them (unless the module has
``dynamic_shape=True``). So a plan whose shapes differ inside a step is refused
(:func:`check_pipe_plan`; ``varlen plan --same-shape-per-step`` makes one), and where the shape
changes from one step to the next the loader calls ``engine.reset_activation_shape()`` at the
point of each stage's schedule where the old buffers are done with: the first stage as it loads the
new step's first microbatch (before its first send), the last stage as it loads the old step's last
microbatch (after its last receive, before the new step's first). The middle stages of a pipeline
of more than two stages load no data: there, a plan whose shape changes between steps is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...loader.batch import IGNORE_INDEX
from ...loader.plan_file import Plan, PlanError
from ...loader.view import LoaderView
from .binding import check_position, sync_lr, write_step_figures
from .config import plan_columns


def _shapes(plan: Plan) -> np.ndarray:
    """``(batch_size, seqlen)`` of every row, shape ``(num_steps, dp, grad_accum, 2)``."""
    cols = plan_columns(plan, ("batch_size", "seqlen"))
    both = np.stack([cols["batch_size"], cols["seqlen"]], axis=-1).astype(np.int64)
    return both.reshape(plan.num_steps, plan.dp, plan.grad_accum, 2)


def check_pipe_plan(plan: Plan, module) -> None:
    """Refuse a plan the pipeline engine's fixed p2p buffers cannot run (see the module docstring)."""
    if getattr(module, "dynamic_shape", False):
        return
    shapes = _shapes(plan)
    inside = np.any(shapes != shapes[:, :, :1], axis=(2, 3))
    if inside.any():
        step, rank = (int(x[0]) for x in np.nonzero(inside))
        seen = sorted({f"{b}x{t}" for b, t in shapes[step, rank].tolist()})
        raise PlanError(f"the plan's microbatch shapes differ inside a step (step {step}, rank {rank}: "
                        f"{', '.join(seen)}) and DeepSpeed's pipeline engine keeps its p2p buffers from the first "
                        f"send: re-plan with --same-shape-per-step, or build the PipelineModule with "
                        f"dynamic_shape=True")
    stages = int(getattr(module, "num_stages", 1) or 1)
    changes = np.any(shapes[1:, :, 0] != shapes[:-1, :, 0], axis=(1, 2)) if plan.num_steps > 1 else np.zeros(0, bool)
    if stages > 2 and changes.any():
        step = int(np.flatnonzero(changes)[0]) + 1
        raise PlanError(f"the plan's shape changes between steps (at step {step}) and the middle stages of a "
                        f"{stages}-stage pipeline load no data, so they cannot re-size their p2p buffers there: "
                        f"build the PipelineModule with dynamic_shape=True, or plan one shape "
                        f"(--static-shapes --num-shapes 1)")


class PipeBatch(tuple):
    """``(inputs, labels)`` as the pipeline engine takes them, with the plan row as ``.info`` (its
    position and sample ids: :func:`~varlen_cli.loader.batch_position` reads it)."""

    info: Any

    def __new__(cls, inputs, labels, info=None):
        batch = super().__new__(cls, (inputs, labels))
        batch.info = info
        return batch

    def __reduce__(self):
        return (PipeBatch, (self[0], self[1], self.info))


class PipeLoader(LoaderView):
    """The plan's loader for ``engine.train_batch(data_iter=iter(loader))`` (module docstring).

    It has the plan loader's interface (:class:`~varlen_cli.loader.view.LoaderView`: ``set_epoch``,
    ``epoch``, ``end_epoch``, ``state_dict``/``load_state_dict``, ``guard``, ``plan``, ``len()``);
    ``loader.loader`` is the plan loader itself. ``inputs``: the batch keys the first stage gets (one:
    a tensor; several: a tuple).
    """

    def __init__(self, loader: Any, engine: Any, binding: Any, inputs: tuple[str, ...] = ("input_ids",)):
        super().__init__(loader)
        self.inputs = tuple(inputs)
        self._engine = engine
        self._binding = binding
        self._dynamic = bool(getattr(engine, "dynamic_shape", False)) or engine.num_stages == 1
        # this rank's (B, T) per step: only fixed p2p buffers need them (a read of the plan file)
        self._shapes = None if self._dynamic else _shapes(self.plan)[:, binding.rank, 0]
        self._sent: tuple | None = None  # the shape of the last step whose first microbatch this stage loaded

    def __iter__(self):
        for batch in self.loader:
            self._before(batch)
            yield self.pair(batch)

    def pair(self, batch: dict) -> PipeBatch:
        """``(inputs, (labels, normaliser))`` of a collated plan batch."""
        inputs = tuple(batch[k] for k in self.inputs)
        targets = max(int(batch["step_loss_tokens"]), 1)
        scale = torch.tensor(self._binding.dp * self.plan.grad_accum / targets, dtype=torch.float32)
        return PipeBatch(inputs[0] if len(inputs) == 1 else inputs, (batch["labels"], scale), batch.get("info"))

    def _before(self, batch: dict) -> None:
        engine = self._engine
        _, step, _, micro = check_position(engine, self._binding, batch, micro=False)
        sync_lr(engine, self._binding)
        write_step_figures(engine, self._binding, batch)
        if self._dynamic:
            return
        shape = tuple(self._shapes[step])
        if engine.is_first_stage() and micro == 0:
            if self._sent is not None and self._sent != shape:
                engine.reset_activation_shape()  # before this step's first send
            self._sent = shape
        if engine.is_last_stage() and micro == self.plan.grad_accum - 1 and step + 1 < self.plan.num_steps \
                and tuple(self._shapes[step + 1]) != shape:
            engine.reset_activation_shape()  # after this step's last receive

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (every stage, between steps: the engine's p2p buffers are sized afresh)."""
        self.loader.load_state_dict(state)
        self._engine.reset_activation_shape()
        self._sent = None


def pipe_loss(logits: torch.Tensor, labels: tuple) -> torch.Tensor:
    """``PipelineModule(loss_fn=pipe_loss)``: the summed next-token cross-entropy of the microbatch x
    the normaliser :class:`PipeLoader` put in its labels (the exact step mean, see the module docstring)."""
    targets, scale = labels
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss * scale.to(loss.device)
