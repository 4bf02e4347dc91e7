"""One training step of the user's model, measured in THIS process (the measuring child calls it; see
:mod:`varlen_cli.memory.procs` for the processes and docs/memory.md for what is counted).

The step is what a training loop does: build the model (``.to(device, dtype)``, ``train()``) and the
optimizer, one warm-up step at ``1 x 8``, ``zero_grad(set_to_none=False)`` (gradients stay allocated,
as between accumulation microbatches), then one step at ``B x T`` on random ids: forward, loss,
backward, optimizer step, the model's output held until the step ends (as ``outputs =
model(**batch); outputs.loss.backward()`` holds it). Only how the peak is read depends on the device:

- CPU: the process's peak resident memory (``VmHWM``), the allocator left as it is;
- CUDA: the peak of torch's reserved memory plus what the process holds on the device outside torch's
  allocator at the end of the step (CUDA context, loaded kernels, library handles).

This module imports torch; only the measuring child imports it.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..errors import InputError, UsageError
from ..runtime import user_code

WARMUP_SHAPE = (1, 8)


@dataclass(frozen=True)
class MeasureSetup:
    """What every measuring process needs (JSON-able: it is sent to the child)."""

    model: str  # MODULE:FUNCTION
    device: str = "cpu"
    dtype: str = "float32"
    optimizer: str = "adamw"
    vocab_size: int | None = None
    seed: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def load_factory(spec: str) -> Callable:
    """The function named by ``MODULE:FUNCTION`` (MODULE a dotted name or a ``.py`` file)."""
    return user_code.load_function(spec, "--model", InputError)


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _user_call(what: str, setup: MeasureSetup, fn, *args):
    """``fn(*args)``; an exception of the user's model is an input error (exit 3), out-of-memory excepted."""
    try:
        return fn(*args)
    except Exception as exc:
        if is_out_of_memory(exc):
            raise
        raise InputError(f"--model {setup.model}: {what} raised {user_code.describe(exc)}") from None


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's CUDA out-of-memory, or its CPU allocator failing (``DefaultCPUAllocator: can't allocate``)."""
    import torch

    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def build(setup: MeasureSetup):
    """``(model, optimizer, vocab_size)`` on the setup's device and dtype."""
    import torch

    if setup.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available to this torch")
    factory = load_factory(setup.model)
    model = _user_call(f"{setup.model.rpartition(':')[2]}()", setup, factory)
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"--model {setup.model} returned {type(model).__name__}, not a torch.nn.Module")
    model = _user_call(f"moving the model to {setup.device} {setup.dtype}", setup,
                       lambda: model.to(device=setup.device, dtype=_dtype(setup.dtype)))
    model.train()
    vocab = setup.vocab_size or _vocab_of(model)
    if vocab is None:
        raise UsageError(f"cannot tell the vocabulary size of {setup.model}; pass --vocab-size V")
    params = [p for p in model.parameters() if p.requires_grad]
    if setup.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-5)
    elif setup.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=1e-5, momentum=0.9)
    else:
        opt = None
    return model, opt, int(vocab)


def _vocab_of(model) -> int | None:
    config = getattr(model, "config", None)
    if getattr(config, "vocab_size", None):
        return int(config.vocab_size)
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if emb is None:  # the first embedding table
        import torch

        emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return int(emb.num_embeddings) if emb is not None and hasattr(emb, "num_embeddings") else None


def _forward(model, ids):
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "labels" in params or kwargs:
        return model(input_ids=ids, labels=ids)
    if "input_ids" in params:
        return model(input_ids=ids)
    return model(ids)


def loss_of(out, ids):
    """``out.loss`` when present, else next-token cross-entropy on the logits, else the scalar."""
    import torch

    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(logits, torch.Tensor):
        raise InputError(f"the model returned {type(out).__name__}: expected .loss, .logits or a tensor")
    if logits.dim() == 0:
        return logits
    if logits.dim() != 3:
        raise InputError(f"the model returned a tensor of shape {tuple(logits.shape)}: expected logits (B, T, V) "
                         "or a scalar loss")
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1))


def training_step(model, opt, ids) -> None:
    """Forward, loss, backward, optimizer step; the output lives until the end, as in a training loop
    that keeps ``outputs`` (the conservative case: its logits stay allocated through backward)."""
    out = _forward(model, ids)
    loss = loss_of(out, ids)
    loss.backward()
    if opt is not None:
        opt.step()
    del out, loss


def tensor_bytes(model, opt) -> int:
    """Bytes of the distinct storages of parameters, buffers, gradients and optimizer states."""
    import torch

    seen = {}
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if opt is not None:
        tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        storage = t.untyped_storage()
        seen[(storage.device.type, storage.data_ptr())] = storage.nbytes()
    return int(sum(seen.values()))


# -- reading the peak: the only device-specific part -----------------------------------------------
def status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``, ``RssFile``...), in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


class CpuPeak:
    """The process's peak resident memory over its whole life (``VmHWM``: interpreter, libraries, model,
    optimizer states, warm-up and the step), with the allocator as a training process has it."""

    method = "cpu: VmHWM (peak resident memory) of the measuring process, default allocator"

    def start(self, model, opt) -> None:
        self.static = tensor_bytes(model, opt)
        self.base = status_bytes("VmRSS")

    def stop(self) -> dict:
        return {"peak_bytes": status_bytes("VmHWM"), "base_bytes": self.base, "static_bytes": self.static}


class CudaPeak:
    """Peak reserved memory plus the process's device memory outside torch's allocator."""

    method = ("cuda: max_memory_reserved + (device memory in use - memory_reserved) at the end of the step "
              "(CUDA context, kernels, libraries)")

    def start(self, model, opt) -> None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.static = tensor_bytes(model, opt)
        self.base = int(torch.cuda.memory_reserved())

    def stop(self) -> dict:
        import torch

        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        outside = max(0, int(total - free) - int(torch.cuda.memory_reserved()))
        reserved = int(torch.cuda.max_memory_reserved())
        return {"peak_bytes": reserved + outside, "reserved_bytes": reserved, "context_bytes": outside,
                "allocated_bytes": int(torch.cuda.max_memory_allocated()), "base_bytes": self.base + outside,
                "static_bytes": self.static, "device_total_bytes": int(total)}


def _device_name(device: str) -> str:
    import platform

    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") else (platform.processor() or platform.machine())


def measure_in_process(setup: MeasureSetup, batch: int, seqlen: int, input_ids=None) -> dict:
    """Build, warm up, and measure one step at (batch, seqlen) in THIS process (a fresh one, or a child
    forked from a process that only imported torch and the model's module)."""
    import torch

    torch.manual_seed(setup.seed)
    reader = CudaPeak() if setup.device.startswith("cuda") else CpuPeak()
    t0 = time.perf_counter()
    model, opt, vocab = build(setup)
    gen = torch.Generator().manual_seed(setup.seed)
    warm = torch.randint(0, vocab, WARMUP_SHAPE, generator=gen).to(setup.device)
    _user_call(f"the warm-up step at {WARMUP_SHAPE[0]}x{WARMUP_SHAPE[1]}", setup, training_step, model, opt, warm)
    model.zero_grad(set_to_none=False)  # gradients stay allocated, as between accumulation microbatches
    del warm
    if input_ids is None:
        ids = torch.randint(0, vocab, (batch, seqlen), generator=gen).to(setup.device)
    else:
        ids = torch.as_tensor(input_ids, dtype=torch.long).to(setup.device)
    reader.start(model, opt)
    try:
        _user_call(f"the training step at {batch}x{seqlen}", setup, training_step, model, opt, ids)
        result = reader.stop()
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        return {"batch_size": batch, "seqlen": seqlen, "oom": True}
    result.update(batch_size=batch, seqlen=seqlen, oom=False, seconds=time.perf_counter() - t0,
                  threads=torch.get_num_threads(), num_parameters=sum(p.numel() for p in model.parameters()),
                  vocab_size=vocab, torch_version=torch.__version__, device_name=_device_name(setup.device))
    return result
