"""Measuring the peak memory of one training step per (B, T), in a fresh process per shape.

Every shape runs in its own child process (forked on CPU from a parent that has imported torch and
the model's module but run no torch op; spawned for CUDA). The child builds the model and the
optimizer, runs one warm-up step at a tiny shape (so libraries, kernels and optimizer states are
in place), zeroes the gradients (keeping them allocated, as between accumulation microbatches),
and measures one full training step (forward, loss, backward, optimizer step) at (B, T) on
random ids. Only reading the peak differs by device:

- CUDA: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()`` (the reserved
  peak is recorded too). It already counts parameters and optimizer states.
- CPU: the process's resident peak. Free heap memory is returned to the OS (``malloc_trim``), the
  kernel's high-water mark is reset to the current resident size (``/proc/self/clear_refs``, 5),
  and after the step ``VmHWM - VmRSS(before)`` is what the step added; the tensors alive before it
  (parameters, buffers, optimizer states) are counted exactly from their storages and added.

This module imports torch; the command line imports it only when measuring.
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import InputError, UsageError, WorkerError
from ..runtime import user_code

WARMUP_SHAPE = (1, 8)


@dataclass(frozen=True)
class MeasureSetup:
    """What every child needs (picklable, for spawned children)."""

    model: str  # MODULE:FUNCTION
    device: str = "cpu"
    dtype: str = "float32"
    optimizer: str = "adamw"
    vocab_size: int | None = None
    seed: int = 0


def load_factory(spec: str) -> Callable:
    """The function named by ``MODULE:FUNCTION`` (MODULE a dotted name or a ``.py`` file)."""
    return user_code.load_function(spec, "--model", InputError)


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build(setup: MeasureSetup):
    """``(model, optimizer, vocab_size)`` on the setup's device and dtype."""
    import torch

    model = load_factory(setup.model)()
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"--model {setup.model} returned {type(model).__name__}, not a torch.nn.Module")
    model = model.to(device=setup.device, dtype=_dtype(setup.dtype))
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
    loss = loss_of(_forward(model, ids), ids)
    loss.backward()
    if opt is not None:
        opt.step()


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
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


MMAP_THRESHOLD = 1 << 16  # glibc: allocations above 64 KiB are their own mappings, unmapped when freed


def fix_malloc_policy() -> bool:
    """Make glibc return freed tensor memory to the OS at once (fixed mmap threshold, which also
    turns off its dynamic raising), so resident memory follows live memory as CUDA's allocated
    counter does; without it, freed heap blocks stay resident and inflate small shapes."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, MMAP_THRESHOLD)) and bool(libc.mallopt(-1, MMAP_THRESHOLD))  # M_MMAP/TRIM
    except (OSError, AttributeError):
        return False


_PLUGGED: list[int] = []  # heap chunks taken out of use in this (forked) child; never freed


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def plug_inherited_heap() -> int:
    """Take the free heap chunks of at least ``MMAP_THRESHOLD`` bytes that this forked child inherited
    out of use, so every tensor of the step gets its own fresh mapping, as in a clean process, instead
    of landing in free heap memory left by the parent's history, where what the step frees stays
    resident and inflates the peak. Call after ``fix_malloc_policy`` and ``malloc_trim``: no page is
    touched beyond the chunk headers. Returns the bytes plugged."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.mallinfo2.restype = _MallInfo2
        free_bytes = libc.mallinfo2().fordblks
    except (OSError, AttributeError):
        return 0
    size, plugged, word = 1 << max(free_bytes, 1).bit_length(), 0, ctypes.sizeof(ctypes.c_size_t)
    while size >= MMAP_THRESHOLD:
        ptr = libc.malloc(size)
        if ptr and not ctypes.c_size_t.from_address(ptr - word).value & 2:  # glibc's IS_MMAPPED bit
            _PLUGGED.append(ptr)  # served from a free heap chunk: keep it, try the same size again
            plugged += size
            continue
        libc.free(ptr)
        size //= 2
    return plugged


class CpuPeak:
    """Peak resident memory of this process over the step (plus the tensors alive before it)."""

    method = "cpu-rss: static tensor bytes + (VmHWM after - VmRSS before), HWM reset via clear_refs"

    def start(self, model, opt) -> None:
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        self.static = tensor_bytes(model, opt)
        self.rss0 = _status_kb("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self.reset = True
        except OSError:
            self.reset = False

    def stop(self) -> dict:
        grown = max(0, _status_kb("VmHWM") - self.rss0) * 1024
        return {"peak_bytes": self.static + grown, "static_bytes": self.static, "step_rss_bytes": grown,
                "hwm_reset": self.reset}


class CudaPeak:
    method = "cuda: torch.cuda.max_memory_allocated (and max_memory_reserved) after reset_peak_memory_stats"

    def start(self, model, opt) -> None:
        import torch

        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.static = tensor_bytes(model, opt)

    def stop(self) -> dict:
        import torch

        torch.cuda.synchronize()
        return {"peak_bytes": int(torch.cuda.max_memory_allocated()), "static_bytes": self.static,
                "reserved_bytes": int(torch.cuda.max_memory_reserved())}


def measure_in_process(setup: MeasureSetup, batch: int, seqlen: int, input_ids=None) -> dict:
    """Build, warm up, and measure one step at (batch, seqlen) in THIS process (call it in a fresh one)."""
    import torch

    torch.manual_seed(setup.seed)
    if setup.device == "cpu":
        torch.set_num_threads(1)
        fix_malloc_policy()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        plug_inherited_heap()
    reader = CudaPeak() if setup.device.startswith("cuda") else CpuPeak()
    t0 = time.perf_counter()
    model, opt, vocab = build(setup)
    gen = torch.Generator().manual_seed(setup.seed)
    warm = torch.randint(0, vocab, WARMUP_SHAPE, generator=gen).to(setup.device)
    training_step(model, opt, warm)
    model.zero_grad(set_to_none=False)  # gradients stay allocated, as between accumulation microbatches
    del warm
    if input_ids is None:
        ids = torch.randint(0, vocab, (batch, seqlen), generator=gen).to(setup.device)
    else:
        ids = torch.as_tensor(input_ids, dtype=torch.long).to(setup.device)
    reader.start(model, opt)
    try:
        training_step(model, opt, ids)
        result = reader.stop()
    except torch.OutOfMemoryError:
        return {"batch_size": batch, "seqlen": seqlen, "oom": True}
    result.update(batch_size=batch, seqlen=seqlen, oom=False, seconds=time.perf_counter() - t0,
                  num_parameters=sum(p.numel() for p in model.parameters()), vocab_size=vocab)
    return result


def _child(conn, setup, batch, seqlen, input_ids) -> None:
    from ..errors import VarlenError

    try:
        conn.send(("ok", measure_in_process(setup, batch, seqlen, input_ids)))
    except VarlenError as exc:
        conn.send(("user", (type(exc).__name__, exc.message)))
    except BaseException as exc:  # reported to the parent, which raises it as a worker error
        import traceback

        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def preload(setup: MeasureSetup) -> None:
    """Import (not run) what every child needs, so forked children start in milliseconds: torch,
    the optimizers' lazy import of ``torch._dynamo``, and the model's module."""
    import torch  # noqa: F401

    try:
        import torch._dynamo  # noqa: F401  (torch.optim imports it on first use: ~2 s)
    except ImportError:  # pragma: no cover - older torch
        pass
    load_factory(setup.model)


def start_method(device: str) -> str:
    """fork for CPU on Linux (the parent ran no torch op); spawn for CUDA and elsewhere."""
    method = os.environ.get("VARLEN_CALIBRATE_START")
    if method:
        return method
    return "fork" if sys.platform.startswith("linux") and device == "cpu" else "spawn"


def measure_shape(setup: MeasureSetup, batch: int, seqlen: int, input_ids=None, timeout: float = 600.0) -> dict:
    """Measure one shape in a fresh child process; ``{"oom": True}`` when it ran out of memory or
    was killed by the kernel's OOM killer."""
    import multiprocessing as mp

    from ..errors import ERROR_CLASSES

    method = start_method(setup.device)
    if method == "fork":
        preload(setup)
    ctx = mp.get_context(method)
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, setup, batch, seqlen, input_ids), daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout):
            proc.kill()
            raise WorkerError(f"measuring {batch}x{seqlen} took longer than {timeout:.0f} s")
        kind, payload = recv.recv()
    except EOFError:
        proc.join()
        if proc.exitcode == -9:  # the kernel's OOM killer
            return {"batch_size": batch, "seqlen": seqlen, "oom": True, "killed": True}
        raise WorkerError(f"measuring {batch}x{seqlen}: the process died (exit code {proc.exitcode})") from None
    finally:
        recv.close()
        proc.join()
    if kind == "user":
        raise ERROR_CLASSES.get(payload[0], InputError)(payload[1])
    if kind == "error":
        raise WorkerError(f"measuring {batch}x{seqlen} failed: {payload.splitlines()[0]}")
    return payload
