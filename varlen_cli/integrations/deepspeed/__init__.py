"""DeepSpeed on a varlen plan (``pip install "varlen-cli[deepspeed]"``): ZeRO 0-3 and the pipeline engine.

    from varlen_cli.integrations import deepspeed as varlen_ds

    engine, optimizer, loader, lr_scheduler = varlen_ds.initialize(plan, dataset, model=model, config=ds_config,
                                                                   optimizer=optimizer, lr_scheduler=base_scheduler)
    for epoch in range(loader.epoch, loader.plan.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            loss_sum = ...                                    # summed token loss of the microbatch
            varlen_ds.backward(engine, loss_sum, batch)      # the exact mean over the step's targets
            engine.step()                                    # after every microbatch
    varlen_ds.save_checkpoint(engine, loader, "ckpt")        # and load_checkpoint(engine, loader, "ckpt")

What the plain setup gets wrong, and what each name does instead (docs/integrations.md):

* ``deepspeed.initialize(training_data=...)`` re-shards the data with a ``DistributedSampler``:
  :func:`initialize` refuses ``training_data`` and builds the plan's loader for this rank of the
  engine's data-parallel group (not of the world, under pipeline or tensor parallelism);
* ``gradient_accumulation_steps`` is a config constant: it is set from the plan (another value is
  refused, as are micro batch sizes that contradict the plan and DeepSpeed's own data sampling);
* ``engine.backward`` divides the loss by it: :func:`backward` scales the summed loss to the exact
  mean over the step's targets across ranks and turns that division off;
* the engine steps the LR scheduler only after updates it applied: the given scheduler (or a
  constant LR) is wrapped in the plan's ``VariableBatchSizeLR``, which also steps for a skipped
  (overflow) update, so the LR of every applied step is base x ``lr_scale`` of that step;
* :func:`save_checkpoint` / :func:`load_checkpoint` carry the loader's position and ledger in
  DeepSpeed's ``client_state``: exact mid-epoch resume, and the elastic restart on a plan made by
  ``varlen replan``;
* the pipeline engine fixes its p2p buffer shapes at the first send: a plan whose shapes differ
  inside a step is refused (``--same-shape-per-step``), and :class:`PipeLoader` re-sizes the buffers
  between steps of different shapes; :func:`pipe_loss` is the matching ``loss_fn``.

Per-step tracker figures: with a monitor in the DeepSpeed config (``tensorboard``, ``wandb``,
``csv_monitor``, ``comet``), :func:`backward` (and :class:`PipeLoader`) write the plan's figures of
every optimizer step (``varlen/tokens``, ``varlen/padding_pct``, ``varlen/straggler``, verl's
``global_seqlen/*``, ...) through the engine's ``monitor`` at DeepSpeed's step axis
(:func:`~.binding.write_step_figures`).
"""

from __future__ import annotations

from .binding import PlanBinding, binding_of
from .checkpoint import load_checkpoint, save_checkpoint
from .engine import backward, initialize
from .pipe import PipeBatch, PipeLoader, pipe_loss

__all__ = ["PipeBatch", "PipeLoader", "PlanBinding", "backward", "binding_of", "initialize", "load_checkpoint",
           "pipe_loss", "save_checkpoint"]
