"""``varlen export deepspeed PLAN -o DIR``: a plan in DeepSpeed's own variable-batch format.

DeepSpeed's ``data_sampling/variable_batch_size_and_lr.py`` plans with ``batch_by_seqlens`` and
returns ``(microbatch_ids, batch_sizes, batch_max_seqlens)``: ``microbatch_ids`` a list of
``(batch_id, [sample ids])`` in the order its ``dataloader_for_variable_batch_size`` deals them to
the data-parallel ranks (a ``DistributedSampler`` without shuffling: item ``j`` goes to rank
``j % dp``), ``batch_sizes`` the size each batch's LR is scaled by and ``batch_max_seqlens`` the
length its samples are padded to. This module writes a varlen plan as those three, so a DeepSpeed
user who keeps ``dataloader_for_variable_batch_size`` and DeepSpeed's ``VariableBatchSizeLR`` trains
the plan's microbatches, on the plan's ranks, at the plan's LR scale:

* item ``j = (step * grad_accum + micro) * dp + rank`` is the plan row ``(step, rank, micro)``,
  ``batch_id`` the step (global over epochs);
* ``batch_sizes[step]`` is what the step's ``lr_scale`` is linear in: its loss tokens (``--lr-scale-by
  loss-tokens``, the default), tokens or samples; the manifest holds the plan's ``base_batch_size`` and
  ``lr_scaling`` (DeepSpeed's ``scale_lr`` then gives the plan's ``lr_scale``);
* ``batch_max_seqlens[step]`` is the largest padded length ``T`` of the step's microbatches.

The directory holds ``sample_ids.npy``, ``microbatch_offsets.npy``, ``batch_ids.npy``,
``batch_sizes.npy``, ``batch_max_seqlens.npy`` and ``_export.json`` (docs/formats.md);
:func:`read_deepspeed_export` turns it into DeepSpeed's Python lists. Vectorised (numpy, pyarrow), no
torch. Packed and mixture plans are refused: DeepSpeed's loader has neither packed rows nor sources.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from . import format, storage
from .errors import InputError, OutputError, UsageError
from .runtime.choices import OVERWRITE_HELP, PANEL_RUN, STORAGE_OPTION_HELP, doc

Target = Literal["deepspeed"]
EXPORT_FORMAT = format.DEEPSPEED_EXPORT_FORMAT
EXPORT_VERSION = 1
MANIFEST = format.EXPORT_MANIFEST_NAME
FILES = ("sample_ids.npy", "microbatch_offsets.npy", "batch_ids.npy", "batch_sizes.npy", "batch_max_seqlens.npy")
_COLUMNS = ("step", "rank", "micro", "sample_ids", "seqlen")

__all__ = ["DeepSpeedExport", "ExportConfig", "ExportResult", "export", "read_deepspeed_export"]


@dataclass(frozen=True)
class ExportConfig:
    """Options of ``varlen export``."""

    target: Target = doc(help="What to write: deepspeed (DeepSpeed's microbatch_ids, batch_sizes and "
                              "batch_max_seqlens, for its dataloader_for_variable_batch_size and VariableBatchSizeLR).")
    plan: str = doc(help="The plan file (varlen plan; local or an s3://... object).")
    output: str = doc(help="Directory to write (local).")
    overwrite: bool = doc(False, OVERWRITE_HELP, panel=PANEL_RUN)
    storage_options: tuple = doc((), STORAGE_OPTION_HELP, panel=PANEL_RUN)


@dataclass
class ExportResult:
    output: str
    microbatches: int
    steps: int
    samples: int  # sample ids written (all epochs)
    dp: int
    grad_accum: int
    lr_scaling_method: str
    base_batch_size: float
    batch_size_unit: str
    seconds: float = 0.0
    files: list = field(default_factory=lambda: list(FILES))


def export(config: ExportConfig) -> ExportResult:
    """Write ``config.plan`` as ``config.target``'s format into the directory ``config.output``."""
    from .runtime import artifacts, safety

    t0 = time.perf_counter()
    if storage.is_remote(config.output):
        raise UsageError(f"varlen export writes a local directory, not {config.output}")
    storage.configure(config.storage_options)
    safety.check_no_overlap(config.output, [config.plan])
    arrays, meta = deepspeed_arrays(config.plan)
    out = artifacts.AtomicDir(config.output, config.overwrite)
    out.check()
    with safety.output_lock(out.path, config.output):
        out.create()
        try:
            for name, values in arrays.items():
                _save(out.file(name), values)
            artifacts.atomic_write_json(out.file(MANIFEST), {**meta, **artifacts.provenance()})
            out.commit()
        except BaseException:
            out.abort()
            raise
    return ExportResult(output=config.output, microbatches=int(len(arrays["batch_ids.npy"])),
                        steps=int(meta["num_steps"]), samples=int(len(arrays["sample_ids.npy"])), dp=meta["dp"],
                        grad_accum=meta["grad_accum"], lr_scaling_method=meta["lr_scaling_method"],
                        base_batch_size=meta["base_batch_size"], batch_size_unit=meta["batch_size_unit"],
                        seconds=time.perf_counter() - t0)


def _save(path: str, values: np.ndarray) -> None:
    try:
        np.save(path, values, allow_pickle=False)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None


# -- the plan as DeepSpeed's arrays --------------------------------------------------------------------
def plan_table(path: str, columns=_COLUMNS):
    """The plan's ``columns`` and last the step column its ``lr_scale`` is linear in (``step_samples``,
    ``step_tokens`` or ``step_loss_tokens``: :func:`~varlen_cli.plan.lr.step_column`), as a pyarrow table,
    its metadata and fingerprint, checked: a varlen plan whose rows are ``num_steps x dp x grad_accum``
    (at least one step) in ``(step, rank, micro)`` order."""
    from .plan.lr import step_column

    try:
        pf, meta = format.open_plan_file(path)
    except format.FormatError as exc:
        raise InputError(str(exc)) from None
    problems = format.plan_schema_problems(pf.schema_arrow, meta)
    if problems:
        raise InputError(f"{path} {problems[0]}")
    column = step_column(meta)
    if column not in pf.schema_arrow.names:  # an optional column (format.PLAN_OPTIONAL_COLUMNS)
        raise InputError(f"{path} has no {column} column, which its lr_scale (--lr-scale-by "
                         f"{meta.get('lr_scale_by')}) follows: plan it again with this varlen")
    with storage.translate_errors(path):
        table = pf.read(columns=[*columns, column])
    dp, ga, steps = int(meta["dp"]), int(meta["grad_accum"]), int(meta["num_steps"])
    rows = np.arange(table.num_rows, dtype=np.int64)
    want = {"step": rows // (dp * ga), "rank": rows // ga % dp, "micro": rows % ga}
    if steps < 1 or table.num_rows != steps * dp * ga or any(
            not np.array_equal(table.column(k).to_numpy(), v) for k, v in want.items() if k in table.column_names):
        raise InputError(f"{path} is not a valid plan: its rows are not num_steps x dp x grad_accum = {steps} x {dp} "
                         f"x {ga} in (step, rank, micro) order (the file was edited or damaged)")
    return table, meta, format.plan_fingerprint(pf.schema_arrow)


def deepspeed_arrays(path: str) -> tuple[dict[str, np.ndarray], dict]:
    """The export's arrays (file name -> values) and manifest fields for the plan at ``path``."""
    import pyarrow.compute as pc

    table, meta, fingerprint = plan_table(path)
    if meta.get("packing"):
        raise UsageError(f"{path} is a packed plan (--packing): DeepSpeed's variable-batch loader pads samples and "
                         f"has no packed rows; export a padded plan")
    if meta.get("mixture") or "source" in table.column_names:
        raise UsageError(f"{path} mixes several sources (--mix): DeepSpeed's loader indexes one dataset; export a "
                         f"plan of one source")
    dp, ga, steps = int(meta["dp"]), int(meta["grad_accum"]), int(meta["num_steps"])
    j = np.arange(steps * dp * ga, dtype=np.int64)  # DeepSpeed's item j: step, then micro, then rank
    step, rem = j // (dp * ga), j % (dp * ga)
    rows = (step * dp + rem % dp) * ga + rem // dp
    ids = pc.take(table.column("sample_ids").combine_chunks(), rows)
    offsets = ids.offsets.to_numpy().astype(np.int64)
    sample_ids = pc.list_flatten(ids).to_numpy().astype(np.int64)
    unit = meta.get("lr_scale_by") or "samples"
    first = np.arange(steps, dtype=np.int64) * dp * ga
    sizes = table.column(table.column_names[-1]).to_numpy()[first]  # the step column lr_scale follows
    seqlens = table.column("seqlen").to_numpy().astype(np.int64).reshape(steps, dp * ga).max(axis=1)
    base = meta.get("base_batch_size")
    arrays = {"sample_ids.npy": sample_ids, "microbatch_offsets.npy": offsets - offsets[0], "batch_ids.npy": step,
              "batch_sizes.npy": sizes.astype(np.int64), "batch_max_seqlens.npy": seqlens}
    manifest = {"format": EXPORT_FORMAT, "format_version": EXPORT_VERSION, "target": "deepspeed",
                "plan": {"path": os.path.abspath(path) if not storage.is_remote(path) else path,
                         "fingerprint": fingerprint},
                "dp": dp, "grad_accum": ga, "num_steps": steps, "steps_per_epoch": list(meta["steps_per_epoch"]),
                "microbatches": int(len(step)), "lr_scaling_method": meta.get("lr_scaling") or "linear",
                "base_batch_size": float(base) if base is not None else 1.0, "batch_size_unit": unit,
                "files": list(FILES)}
    return arrays, manifest


# -- reading it back ------------------------------------------------------------------------------------
@dataclass
class DeepSpeedExport:
    """A ``varlen export deepspeed`` directory as DeepSpeed takes it (see the module docstring)::

        ex = read_deepspeed_export("out/ds")
        loader, _ = dataloader_for_variable_batch_size(dataset, ex.microbatch_ids, ex.batch_max_seqlens,
                                                       dataloader_rank=rank, dataloader_num_replicas=ex.dp,
                                                       dataloader_batch_size=1, ...)
        lr = lr_scheduler_for_variable_batch_size(ex.base_batch_size, ex.batch_sizes, loader, optimizer,
                                                  lr_scaling_method=ex.lr_scaling_method)
    """

    microbatch_ids: list  # [(batch_id, [sample ids]), ...]
    batch_sizes: list
    batch_max_seqlens: list
    dp: int
    grad_accum: int
    lr_scaling_method: str
    base_batch_size: float
    manifest: dict


def read_deepspeed_export(path: str) -> DeepSpeedExport:
    """Read a ``varlen export deepspeed`` directory; a damaged or inconsistent one is refused."""
    from .storage.files import open_regular

    try:
        with open_regular(os.path.join(path, MANIFEST), what="export manifest", error=InputError) as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as exc:
        raise InputError(f"{path} is not a varlen export directory: cannot read its {MANIFEST} ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != EXPORT_FORMAT:
        raise InputError(f"{path} is not a varlen export directory (its {MANIFEST} is not a {EXPORT_FORMAT} manifest)")
    arrays = {name: _load(path, name) for name in FILES}
    if not _consistent(arrays, manifest):
        raise InputError(f"{path} is damaged: its arrays do not agree with each other or with {MANIFEST}")
    ids, offsets, batch_ids = arrays["sample_ids.npy"], arrays["microbatch_offsets.npy"], arrays["batch_ids.npy"]
    microbatch_ids = list(zip(batch_ids.tolist(), (a.tolist() for a in np.split(ids, offsets[1:-1]))))
    return DeepSpeedExport(microbatch_ids=microbatch_ids, batch_sizes=arrays["batch_sizes.npy"].tolist(),
                           batch_max_seqlens=arrays["batch_max_seqlens.npy"].tolist(), dp=int(manifest["dp"]),
                           grad_accum=int(manifest["grad_accum"]), lr_scaling_method=manifest["lr_scaling_method"],
                           base_batch_size=float(manifest["base_batch_size"]), manifest=manifest)


def _consistent(arrays: dict, manifest: dict) -> bool:
    """The arrays' sizes agree with each other and with the manifest; offsets ascend; batch ids are steps."""
    ids, offsets, batch_ids = arrays["sample_ids.npy"], arrays["microbatch_offsets.npy"], arrays["batch_ids.npy"]
    try:
        steps, m = int(manifest["num_steps"]), int(manifest["microbatches"])
    except (KeyError, TypeError, ValueError):
        return False
    return (m > 0 and len(offsets) == m + 1 and len(batch_ids) == m and offsets[0] == 0 and offsets[-1] == len(ids)
            and not np.any(np.diff(offsets) < 0) and len(arrays["batch_sizes.npy"]) == steps
            and len(arrays["batch_max_seqlens.npy"]) == steps and 0 <= batch_ids.min() <= batch_ids.max() < steps)


def _load(path: str, name: str) -> np.ndarray:
    try:
        values = np.load(os.path.join(path, name), allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"{path} is damaged: cannot read {name} ({exc})") from None
    if values.ndim != 1 or values.dtype.kind not in "iu":
        raise InputError(f"{path} is damaged: {name} is not a 1-D integer array")
    return values.astype(np.int64, copy=False)
