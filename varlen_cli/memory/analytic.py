"""The memory profile of a Hugging Face decoder from its ``config.json`` alone (no weights, no torch).

``peak(B, T) = c0 + c1*B*T + c2*B*T^2`` with every term listed in :func:`analytic_terms` and
explained, with its source, in docs/memory.md. Llama-family layouts (llama, mistral, qwen2,
qwen3, ...: RMSNorm, rotary q/k, grouped-query attention, gated SiLU MLP) are counted tensor by
tensor from what autograd saves for backward in ``transformers``' modelling code.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..errors import InputError, UsageError
from ..storage.files import open_regular
from . import fit as fitting
from .profile import require_regular_file

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}  # state tensors per parameter (param dtype)
SHARDINGS = ("none", "zero1", "zero2", "zero3", "fsdp")
ATTENTIONS = ("eager", "sdpa", "flash")
FP32 = 4


def dtype_name(value: str) -> str:
    name = DTYPE_ALIASES.get(value.lower(), value.lower())
    if name not in DTYPE_BYTES:
        raise UsageError(f"--dtype must be one of float32, bfloat16, float16 (or fp32, bf16, fp16) (got {value!r})")
    return name


@dataclass(frozen=True)
class Architecture:
    vocab_size: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    attention_bias: bool
    mlp_bias: bool

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv + h if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate + (2 * self.intermediate + h if self.mlp_bias else 0)
        return attn + mlp + 2 * h  # + two RMSNorm weights

    @property
    def params(self) -> int:
        embed = self.vocab_size * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params + self.hidden


def read_hf_config(path: str) -> tuple[dict, Architecture]:
    """The config's dict and the architecture varlen counts; an error naming a missing field."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    require_regular_file(path, "--hf-config")
    try:
        with open_regular(path, what="--hf-config") as fh:
            cfg = json.load(fh)
    except OSError as exc:
        raise InputError(f"--hf-config {path} is not readable: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError):
        raise InputError(f"--hf-config {path} is not JSON") from None
    if not isinstance(cfg, dict):
        raise InputError(f"--hf-config {path} is not a JSON object")
    text = cfg.get("text_config")
    cfg = text if isinstance(text, dict) and "hidden_size" not in cfg else cfg
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in need if not isinstance(cfg.get(k), int) or cfg.get(k) < 1]
    if missing:
        raise InputError(f"--hf-config {path}: no positive integer {', '.join(missing)} (varlen counts Llama-family "
                         "decoders: llama, mistral, qwen2, ...)")
    heads = cfg["num_attention_heads"]
    arch = Architecture(
        vocab_size=cfg["vocab_size"], hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"],
        layers=cfg["num_hidden_layers"], heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        tied=bool(cfg.get("tie_word_embeddings", False)), attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)))
    return cfg, arch


def analytic_terms(arch: Architecture, dtype: str, attention: str = "eager", checkpointing: bool = False,
                   optimizer: str = "adamw", sharding: str = "none", world_size: int = 1) -> list[dict]:
    """Every term of the model: ``{"name", "coefficient": "c0"|"c1"|"c2", "bytes", "formula"}``."""
    s = DTYPE_BYTES[dtype]
    h, i, L, a, V = arch.hidden, arch.intermediate, arch.layers, arch.heads, arch.vocab_size
    q, kv = a * arch.head_dim, arch.kv_heads * arch.head_dim
    rep = arch.kv_heads != arch.heads  # repeat_kv materialises k and v at q's width
    n = world_size
    shard_p = n if sharding in ("zero3", "fsdp") else 1
    shard_g = n if sharding in ("zero2", "zero3", "fsdp") else 1
    shard_o = n if sharding != "none" else 1
    P, k_opt = arch.params, OPTIMIZER_STATES[optimizer]
    terms = [
        ("parameters", "c0", P * s / shard_p, f"params x {s} B" + (f" / {n}" if shard_p > 1 else "")),
        ("gradients", "c0", P * s / shard_g, f"params x {s} B" + (f" / {n}" if shard_g > 1 else "")),
        ("optimizer states", "c0", k_opt * P * s / shard_o,
         f"{k_opt} x params x {s} B" + (f" / {n}" if shard_o > 1 and k_opt else "")),
    ]
    if shard_p > 1:  # FSDP/ZeRO-3 gathers one layer's full parameters (and its full gradients) at a time
        terms.append(("gathered layer", "c0", 2 * arch.layer_params * s, f"2 x layer params x {s} B"))
    # per token, per layer: what autograd saves (docs/memory.md lists the op behind each)
    norm = (FP32 + s) * h if s != FP32 else 2 * h * FP32  # RMSNorm: fp32 input, normed (+ bf16 cast)
    layer = {
        "input RMSNorm": norm,
        "q, k after rotary (matmul inputs)": s * (q + (q if rep else kv)),
        "v (matmul input)": s * (q if rep else kv),
        "attention output (o_proj input)": s * q,
        "post-attention RMSNorm": norm,
        "MLP gate, SiLU(gate), up, product": 4 * s * i,
    }
    if attention != "eager":
        layer["attention logsumexp"] = FP32 * a
    per_layer = sum(layer.values())
    scores = a * (FP32 + (s if s != FP32 else 0)) if attention == "eager" else 0  # softmax fp32 (+ cast)
    if checkpointing:
        terms.append(("checkpointed layer inputs", "c1", L * s * h, f"layers x hidden x {s} B"))
        terms.append(("one recomputed layer", "c1", per_layer, " + ".join(layer)))
        if scores:
            terms.append(("one recomputed layer's attention scores", "c2", scores, "heads x (4 B fp32 softmax"
                          + (f" + {s} B cast)" if s != FP32 else ")")))
    else:
        for name, value in layer.items():
            terms.append((f"{name} (x {L} layers)", "c1", L * value, f"{L} x {value} B"))
        if scores:
            terms.append((f"attention scores (x {L} layers)", "c2", L * scores,
                          f"{L} x heads x (4 B fp32 softmax" + (f" + {s} B cast)" if s != FP32 else ")")))
    terms += [
        ("final RMSNorm", "c1", norm, "as a layer's"),
        ("logits", "c1", s * V, f"vocab x {s} B (held by the output)"),
        ("token ids, labels", "c1", 3 * 8, "int64 ids, labels, shifted labels"),
        # The two transient peaks of backward, which do not coincide: the peak is their maximum.
        ("loss backward: log-softmax output, its gradient, the logits' gradient", "loss", 3 * FP32 * V,
         "3 x vocab x 4 B"),
    ]
    if scores:
        terms.append(("attention backward: one layer's probability and score gradients", "attention", 2 * FP32 * a,
                      "2 x heads x 4 B"))
        freed = layer["attention output (o_proj input)"] + layer["post-attention RMSNorm"]
        freed += layer["MLP gate, SiLU(gate), up, product"]
        terms.append(("... minus what that layer's backward already freed (o_proj input, MLP, norm)",
                      "attention_freed", freed, "o_proj input + post-attention RMSNorm + MLP"))
    return [{"name": nm, "coefficient": c, "bytes": float(b), "formula": f} for nm, c, b, f in terms]


def term_peak(terms: list, batch: int, seqlen: int) -> float:
    """The term model's peak at (B, T), N = B*T:
    c0 + c1*N + c2*N*T + max(loss*N, attention*N*T - attention_freed*N)."""
    kinds = ("c0", "c1", "c2", "loss", "attention", "attention_freed")
    total = {k: sum(t["bytes"] for t in terms if t["coefficient"] == k) for k in kinds}
    n = batch * seqlen
    return (total["c0"] + total["c1"] * n + total["c2"] * n * seqlen
            + max(total["loss"] * n, total["attention"] * n * seqlen - total["attention_freed"] * n))


def grid(max_seqlen: int) -> list:
    """Shapes the c-form is fitted on: T from 16 doubling to max_seqlen, B in 1, 8, 64."""
    ts, t = [], 16
    while t < max_seqlen:
        ts.append(t)
        t *= 2
    ts.append(max_seqlen)
    return [(b, t) for t in ts for b in (1, 8, 64)]


def analytic_profile_fields(path: str, dtype: str = "bfloat16", attention: str = "eager", checkpointing: bool = False,
                            optimizer: str = "adamw", sharding: str = "none", world_size: int = 1,
                            max_seqlen: int | None = None) -> dict:
    """The fields of an analytic profile: model, architecture, terms, the term model's peaks on a
    grid of shapes, and their c-form fit (c0, c1, c2) with its error."""
    if attention not in ATTENTIONS:
        raise UsageError(f"--attention must be one of {', '.join(ATTENTIONS)} (got {attention!r})")
    if sharding not in SHARDINGS:
        raise UsageError(f"--sharding must be one of {', '.join(SHARDINGS)} (got {sharding!r})")
    if optimizer not in OPTIMIZER_STATES:
        raise UsageError(f"--optimizer must be one of adamw, sgd, none (got {optimizer!r})")
    if world_size < 1:
        raise UsageError(f"--world-size must be >= 1 (got {world_size})")
    if sharding == "none" and world_size != 1:
        raise UsageError("--world-size needs --sharding zero1|zero2|zero3|fsdp (replicated states do not shrink)")
    dtype = dtype_name(dtype)
    cfg, arch = read_hf_config(path)
    terms = analytic_terms(arch, dtype, attention, checkpointing, optimizer, sharding, world_size)
    max_seqlen = max_seqlen or min(int(cfg.get("max_position_embeddings") or 4096), 32768)
    points = [{"batch_size": b, "seqlen": t, "peak_bytes": term_peak(terms, b, t)} for b, t in grid(max_seqlen)]
    fit, error = fitting.fit_points(points)
    return {
        "model": cfg.get("_name_or_path") or os.path.abspath(path), "model_type": cfg.get("model_type"),
        "device": "any", "dtype": dtype, "torch_version": None, "optimizer": optimizer,
        "vocab_size": arch.vocab_size, "num_parameters": arch.params,
        "analytic": {"attention": attention, "checkpointing": checkpointing, "sharding": sharding,
                     "world_size": world_size, "architecture": arch.__dict__, "terms": terms},
        "max_seqlen": max_seqlen, "points": points, "fit": fit, "fit_error": error,
    }
