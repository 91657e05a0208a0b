"""A weight-only quantized copy of a target: its own weights in 4 (or 8) bits, as a draft.

Activations stay in floating point (this model family has activation outliers: dynamic
int8 activations lose half the agreement). Weights are quantized per output row in groups
of ``GROUP`` input columns, asymmetric: ``w = scale * q + low`` with ``q`` in 0..15 (int4)
or a symmetric per-row int8. The matmuls are PyTorch's own weight-only kernels:

- int4: ``aten._weight_int4pack_mm_for_cpu`` on CPU, ``aten._weight_int4pack_mm`` (tinygemm)
  on CUDA; both take bf16 activations and bf16 (scale, zero) pairs with
  ``w = (q - 8) * scale + zero``, so ``zero = low + 8 * scale``.
- int8: ``aten._weight_int8pack_mm`` (per-row scales), any device.
- fp8: float8 e4m3 weights with per-row scales, and each activation row scaled into e4m3
  on the fly (a floating-point format: the outliers that ruin int8 activations keep their
  relative precision), multiplied by ``torch._scaled_mm`` with fp32 accumulation. Native on
  GPUs with fp8 tensor cores (compute capability 8.9+: L4, L40S, H100, H200); elsewhere
  torch computes it on a slow reference path (30x an fp32 matmul on our CPUs), which the
  schedule's measured draft cost then turns down.

torchao wraps these same kernels behind its tensor subclasses; a GGUF-exact build needs our
own nibbles and scales, so we call the kernels directly (one small module, no subclass).

``blocks`` lets a caller hand over a weight's quantized form instead of quantizing it again
(a GGUF file's own Q4_1 blocks: pairs.gguf_blocks), so the draft's weights are the target's.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from transformers.pytorch_utils import Conv1D

from . import kernels
from .kernels import DynamicInt8Linear, absmax, fastest_ms
from .mapped import complete, mapped_tensors, remove_stale, save_tensors
from .types import SCHEMES

stage = logging.getLogger("specdec_llm.load").info  # a load's stages (the CLI prints them, a worker logs them)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from transformers import PreTrainedModel

GROUP = 32
# a stored draft (``stored_draft_file``) no load has mapped for this many days is deleted when
# another is stored: a torch upgrade, another recipe or new target weights leave the old one behind
STORED_UNUSED_DAYS = 30
STORED_FORMAT = "stored 1"  # what a stored draft's file holds (``packed_state``): change it with that
# the draft's LM head: "auto" (measured at load, below), the target's own (shared), a bf16 copy, an int4 copy,
# an int8 copy (DynamicInt8Linear)
HEADS = ("auto", "target", "bf16", "int4", "int8")
AUTO_MARGIN = 0.8  # "auto" takes a copy (bf16, int8) where its one-row matmul is at most this share of the target's
# the draft's body: every Linear in int4, "mixed" (INT8_PROJECTIONS in dynamic int8, the rest int4), or "auto":
# "mixed" where its projections multiply one row in at most AUTO_MARGIN of int4's time on this machine and
# it agrees with the target at least BODY_AGREEMENT of int4's agreement (``_body_choice``, kept per machine)
BODIES = ("int4", "mixed", "auto")
# the projections "mixed" holds in kernels.DynamicInt8Linear (fbgemm's int8 dot products, each input smoothed
# by what the target's projection sees): those reading normed hidden states or attention outputs. down_proj
# reads act(gate) * up, whose outlier channels cost agreement: on Qwen2.5-Coder-1.5B over arbitrary tokens
# the target's argmax agreed 0.891 with the int4 draft, 0.836 mixed, 0.469 with down_proj in int8 too; on
# code answers 0.996 / 0.984 / 0.895. An AVX2 EPYC multiplies a mixed layer's projections in 0.4-0.6 of
# int4's time (one row; 0.2-0.3 at 9 rows): its draft step 0.37 -> 0.29 of the target's
INT8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")
BODY_AGREEMENT = 0.9


@dataclass
class Blocks:
    """A weight [N, K] as ``scale * q + low`` per group of GROUP columns: q uint8 [N, K] in
    0..15, scale and low float32 [N, K // GROUP]."""

    q: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.float().view(n, k // GROUP, GROUP)
        return (self.scale[..., None] * q + self.low[..., None]).view(n, k)


def quantize4(w: torch.Tensor) -> Blocks:
    """Asymmetric int4 in groups of GROUP (round to nearest)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    low, high = g.amin(-1), g.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-10)
    q = ((g - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Blocks(q.view(n, k), scale, low)


class Int4Linear(torch.nn.Module):
    """y = x @ W.T (+ b) with W held as int4 groups; x in any float dtype, y in x's dtype."""

    packed: torch.Tensor  # buffers
    scales_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None, device: torch.device):
        super().__init__()
        n, k = blocks.q.shape
        self.in_features, self.out_features = k, n
        self.sizes = [n]  # the widths of the projections it computes at once (quant._fuse)
        q = blocks.q.to(device)
        if device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        else:  # tinygemm wants two nibbles per byte, even column first in the high nibble
            packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
        zero = blocks.low + 8 * blocks.scale
        sz = torch.stack([blocks.scale, zero], -1).transpose(0, 1).contiguous()  # [K/G, N, 2]
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", sz.to(device=device, dtype=torch.bfloat16))
        self.blocks: Blocks | None = blocks  # kept until quantized_copy has fused siblings, then dropped
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def stored(cls, tensors: Mapping[str, torch.Tensor], key: str, sizes: list[int] | None = None) -> Int4Linear:
        """The Int4Linear ``packed_state`` kept under ``key``: its packed weight, (scale, zero)
        pairs and bias as the kernel reads them (nothing packed again); ``sizes``: a fused
        one's parts' widths."""
        self = cls.__new__(cls)
        torch.nn.Module.__init__(self)
        groups, n, _ = tensors[f"{key}.scales_zeros"].shape
        self.in_features, self.out_features, self.sizes = groups * GROUP, n, sizes or [n]
        self.register_buffer("packed", tensors[f"{key}.packed"])
        self.register_buffer("scales_zeros", tensors[f"{key}.scales_zeros"])
        self.blocks = None
        self.register_buffer("bias", tensors.get(f"{key}.bias"))
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if flat.device.type == "cpu":
            y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(flat, self.packed, GROUP, self.scales_zeros)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8Linear(torch.nn.Module):
    """Symmetric per-row int8 weights (``aten._weight_int8pack_mm``); x's dtype kept."""

    q: torch.Tensor  # buffers
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        w = w.detach().contiguous()
        scale = (w.abs().amax(-1) / 127).clamp(min=1e-10)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.register_buffer("q", (w / scale[:, None]).round().clamp(-128, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scale.to(flat.dtype))
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


SMOOTH_ALPHA = 0.5  # SmoothQuant's migration strength: s = max|x|^a / max|w|^(1-a) per input channel
# "auto" keeps an int8 head only where its argmax agrees this often with the full head's on ``head_inputs``
# (arbitrary tokens: flat, so lower than on text): Qwen2.5-Coder-1.5B 0.922 (0.981 on code answers, and
# its draft's step 0.67 -> 0.57 of the target's on an AVX2 EPYC); SmolLM2-135M 0.781 (0.955 as its
# draft's head, 0.992 in fp32: the 3.3 ms it saves there do not pay for that)
INT8_AGREEMENT = 0.9


def smoothed_int8(
    target: PreTrainedModel,
    head: torch.nn.Module,
    cache_file: Path | None = None,
    inputs: Callable[[], torch.Tensor] | None = None,
) -> tuple[Callable[[], DynamicInt8Linear], float]:
    """``head`` as a DynamicInt8Linear smoothed by what it sees in ``target`` (``inputs``, by
    default ``head_inputs``) (a builder: built only where it is kept), and the share of those
    inputs where its argmax is the full head's. The smoothing and the share are kept in
    ``cache_file`` per machine and head (a later load skips the target's forward and the check:
    ~4 s of a 1.5B's load)."""
    w = cast(torch.Tensor, head.weight).detach().float()
    bias = getattr(head, "bias", None)  # (Phi-2's head has one)
    key = f"int8 head {head_fingerprint(w)}"
    try:
        seen = kernels.remembered(cache_file, key)
        smooth, agreement = torch.tensor(seen["smooth"], dtype=torch.float32), float(seen["agreement"])
        if smooth.shape == (w.shape[1],) and bool(torch.isfinite(smooth).all()) and smooth.min() > 0:
            return (lambda: DynamicInt8Linear(w, bias, smooth)), agreement
    except (KeyError, TypeError, ValueError, RuntimeError):  # not kept, or damaged: measured again
        pass
    x = inputs() if inputs is not None else head_inputs(target, head)
    smooth = absmax(x, 0).clamp(min=1e-5) ** SMOOTH_ALPHA / absmax(w, 0).clamp(min=1e-5) ** (1 - SMOOTH_ALPHA)
    int8 = DynamicInt8Linear(w, bias, smooth)
    with torch.inference_mode():
        full = head(x.to(cast(torch.Tensor, head.weight).dtype))  # (in the target's dtype: bf16 targets too)
        agree = (int8(x).argmax(-1) == full.argmax(-1)).float().mean().item()
    kernels.remember(cache_file, key, {"smooth": smooth.tolist(), "agreement": agree})
    return (lambda: int8), agree


def head_fingerprint(w: torch.Tensor) -> str:
    """A head's shape and 64 of its rows, hashed: which weights a kept smoothing belongs to."""
    rows = w[:: max(1, w.shape[0] // 64)].contiguous()
    return f"{w.shape[0]}x{w.shape[1]} " + hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16]


@torch.inference_mode()
def head_inputs(model: PreTrainedModel, head: torch.nn.Module, tokens: int = 128) -> torch.Tensor:
    """What ``head`` receives [tokens, hidden] in one forward of ``model`` over ``tokens`` token
    ids spread evenly over the vocabulary: the outlier channels of a model's hidden states are
    its own, whatever the text (on Qwen2.5-Coder-1.5B smoothing from 64 of them agreed 0.981
    against 0.988 from 12 real prompts)."""
    return _seen(model, tokens, head).head_x


FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [N, K] as e4m3 values and per-row fp32 scales [N, 1] (``t ~ values * scale``)."""
    scale = (t.detach().abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    return (t / scale).to(FP8), scale


def fp8_native(device: torch.device) -> bool:
    """Whether ``device`` multiplies fp8 in hardware (CUDA compute capability 8.9 or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(torch.nn.Module):
    """y = x @ W.T (+ b) with W in e4m3 (per-row scales) and x scaled into e4m3 per row on
    each call; fp32 accumulation, y in x's dtype."""

    q: torch.Tensor  # buffers
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        q, scale = fp8_rows(w.float())
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.t().contiguous())  # [1, N], as _scaled_mm takes it
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = fp8_rows(x.reshape(-1, self.in_features))
        out = torch.bfloat16 if x.dtype == torch.float32 and x.is_cuda else x.dtype  # (CUDA: no fp32 output)
        y = torch._scaled_mm(xq, self.q.t(), scale_a=xs, scale_b=self.scale, out_dtype=out)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class CastHead(torch.nn.Module):
    """An LM head held in a smaller float dtype (bf16): the input is cast to it and the
    logits back. On a CPU with bf16 dot products the draft's head (a 49152x576 matrix on the
    demo pair, ~30% of an int4 draft step in fp32) streams half the bytes; the argmax moves
    rarely (greedy agreement 0.988 -> 0.98 on the demo pair: docs/pairs.md)."""

    linear_method = "cast_logits"  # engine/kernels.py gives it the fastest matmul kernel, as for a Linear

    def __init__(self, full: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        weight, bias = cast(torch.Tensor, full.weight), getattr(full, "bias", None)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = torch.nn.Parameter(weight.detach().to(dtype), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def cast_logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.weight, self.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.cast_logits(h.to(self.weight.dtype)).to(h.dtype)


def choose_head(head: torch.nn.Module, kernel_cache: Path | None = None) -> tuple[str, dict[str, float]]:
    """The faster of a bf16 copy of ``head`` and an int8 one (``DynamicInt8Linear``) where it
    multiplies one row in at most AUTO_MARGIN of the time of the target's own head on this
    machine (fastest kernel of each, timed on the real weights, cached with the kernel
    timings), else "target"; and the timings (ms)."""
    weight = cast(torch.Tensor, head.weight)
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return "target", {}  # a bf16/fp16 target's head is already small; GPUs: not measured here
    ms = {  # (the target's head is tuned at every row count anyway; a bf16 copy only where chosen)
        "target": fastest_ms(weight, 1, kernel_cache),
        "bf16": fastest_ms(weight.to(torch.bfloat16), 1, kernel_cache, every=False),
    }
    int8 = fastest_ms(weight, 1, kernel_cache, kind="int8")
    if math.isfinite(int8):  # (a torch without the quantized engine: not a choice)
        ms["int8"] = int8
    return faster_copy(ms, ("bf16", "int8")), ms


def faster_copy(ms: dict[str, float], copies: tuple[str, ...]) -> str:
    """Of ``copies`` timed in ``ms``, the fastest where it takes at most AUTO_MARGIN of the
    target head's time (``ms["target"]``), else "target"."""
    best = min(copies, key=lambda name: ms.get(name, math.inf))
    return best if ms.get(best, math.inf) <= AUTO_MARGIN * ms["target"] else "target"


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # sibling projections of one input


class Fused(torch.nn.Module):
    """Sibling projections of one input (a layer's q, k, v; its gate and up) as one matmul
    (an int4 one here; a float one in lean.py): the first sibling called with an input
    computes all of them, the others read their slice of that result (half the kernel calls
    and casts of a step)."""

    def __init__(self, linear: torch.nn.Module):
        super().__init__()
        self.linear = linear
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.x is not x or self.y is None:  # a reference is kept, so a new input is never mistaken for it
            y: torch.Tensor = self.linear(x)
            self.x, self.y = x, y
            return y
        return self.y


class Slice(torch.nn.Module):
    """One sibling's part of a fused result; the last sibling (called last in the model's own
    order) lets the fused module forget the result, so no layer holds a prefill's activations."""

    def __init__(self, fused: Fused, start: int, stop: int, last: bool):
        super().__init__()
        self.fused, self.start, self.stop, self.last = fused, start, stop, last
        self.in_features, self.out_features = fused.linear.in_features, stop - start
        self.register_state_dict_post_hook(Slice.as_own)  # type: ignore[no-untyped-call]

    @staticmethod
    def as_own(module: Slice, state: dict[str, torch.Tensor], prefix: str, _meta: object) -> None:
        """In a state dict, a float sibling keeps its own names (``q_proj.weight``): its rows of
        the fused weight (views), not the fused Linear once per sibling."""
        whole = module.part_of
        if not isinstance(whole, torch.nn.Linear):
            return
        for name in ("weight", "bias"):
            full = state.pop(f"{prefix}fused.linear.{name}", None)
            if full is None:
                continue
            # (empty where a kernel's packed copy replaced the weight, as for any tuned Linear)
            state[f"{prefix}{name}"] = full[module.start : module.stop] if full.numel() else full

    @property
    def part_of(self) -> torch.nn.Module:
        """The whole matmul (the lean forward calls it once and splits: lean._fuse)."""
        return self.fused.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fused(x)[..., self.start : self.stop]
        if self.last:
            self.fused.x = self.fused.y = None
        return y


def replace_by_slices(module: torch.nn.Module, names: tuple[str, ...] | list[str], whole: torch.nn.Module) -> None:
    """Make ``module``'s sibling projections ``names`` slices of ``whole``, their one matmul
    (its ``sizes``: their widths, in order): the siblings' own weights are dropped, so the
    fused weight replaces them instead of sitting beside them."""
    fused, start, sizes = Fused(whole), 0, cast(list[int], whole.sizes)
    for i, (name, size) in enumerate(zip(names, sizes)):
        setattr(module, name, Slice(fused, start, start + size, last=i == len(names) - 1))
        start += size


def _fuse(module: torch.nn.Module, names: tuple[str, ...]) -> None:
    parts = [p for n in names if isinstance(p := getattr(module, n, None), Int4Linear)]
    if len(parts) < len(names):
        return
    blocks = [p.blocks for p in parts]
    merged = Blocks(*(torch.cat([getattr(b, f) for b in blocks]) for f in ("q", "scale", "low")))
    biases = [p.bias for p in parts]  # (Qwen2's q/k/v have biases; zeros for a sibling without)
    ref = next((b for b in biases if b is not None), None)
    bias = (
        None
        if ref is None
        else torch.cat([ref.new_zeros(p.out_features) if b is None else b for p, b in zip(parts, biases)])
    )
    whole = Int4Linear(merged, bias, parts[0].packed.device)
    whole.sizes = [p.out_features for p in parts]  # its parts' widths, in order
    replace_by_slices(module, names, whole)


def _as_linear(conv: Conv1D) -> torch.nn.Linear:
    """transformers' ``Conv1D`` (y = x @ W + b, W [in, out]) as the Linear it equals."""
    n_in, n_out = conv.weight.shape
    linear = torch.nn.Linear(n_in, n_out, device="meta")
    linear.weight = torch.nn.Parameter(conv.weight.t(), requires_grad=False)
    linear.bias = conv.bias
    return linear


def _quantized(linear: torch.nn.Linear, scheme: str, blocks: Blocks | None) -> torch.nn.Module:
    if scheme == "int8":
        return Int8Linear(linear.weight, linear.bias)
    if scheme == "fp8":
        if linear.in_features % 16 or linear.out_features % 16:
            return linear  # _scaled_mm's shape rule (multiples of 16): stays as it is
        return Fp8Linear(linear.weight, linear.bias)
    if linear.in_features % GROUP or linear.out_features % 16:
        return linear  # the int4 kernels' shape rules (groups of GROUP columns, rows in 16s): stays as it is
    return Int4Linear(blocks or quantize4(linear.weight), linear.bias, linear.weight.device)


def quantized_copy(
    target: PreTrainedModel,
    scheme: str = "int4",
    head: str = "auto",
    blocks: Mapping[str, Blocks] | None = None,
    fuse: bool = True,
    kernel_cache: Path | None = None,
    packed_cache: Path | None = None,
    body: str = "int4",
) -> PreTrainedModel:
    """A draft: the target's structure and norms, every Linear of its layers quantized
    (``scheme``), the embedding shared. Its LM head: the target's own (``"target"``, shared:
    0.99 greedy agreement on the demo pair), a bf16 copy (``"bf16"``: 0.98, and 3 ms less per
    step where the CPU multiplies bf16 natively), an int8 copy (``"int8"``, ``smoothed_int8``:
    0.981 against bf16's 0.996 on Qwen2.5-Coder-1.5B's hidden states), an int4 copy (``"int4"``: 0.87), or ``"auto"``:
    the faster of bf16 and int8 where it is measured faster on this machine (``choose_head``;
    the timings are cached in ``kernel_cache``; int8 only where its argmax agrees with the full
    head's on INT8_AGREEMENT of ``head_inputs``), else the target's. ``blocks``: {parameter name
    (``model.layers.0.mlp.up_proj.weight``): Blocks} to use as they are (the GGUF target's
    own quantized weights). ``fuse``: each layer's q/k/v and gate/up projections run as one
    int4 matmul (``FUSED`` names them). ``packed_cache``: a folder where a CPU int4 draft is
    kept as its kernels read it, per machine (``stored_draft_file``): a later load maps it
    instead of reading the blocks and packing them again (8-9 s of a 1.5B target's load).
    ``body``: ``BODIES`` (CPU int4 only). The target is unchanged."""
    _check(scheme, head, target)
    seen = functools.cache(lambda: _seen(target))  # (one forward of the target serves the head and the body)
    head, head_ms, build, agreement = _head_choice(target, head, kernel_cache, seen)
    blocks = blocks or {}
    body, choice = _known_body(target, scheme, body, kernel_cache)
    file = stored_draft_file(packed_cache, target, scheme, head, fuse, blocks, body)
    stored = _read_stored(file)
    draft = _sharing_copy(target)
    with torch.no_grad():
        if stored:
            _stored_layers(draft, stored)  # (an int4 head too)
        else:
            _quantize_layers(draft, draft.get_output_embeddings(), scheme, blocks, fuse)
            asked = body
            body, choice = _built_body(target, draft, body, choice, fuse, kernel_cache, seen)
            file = file if body == asked else stored_draft_file(packed_cache, target, scheme, head, fuse, blocks, body)
        _set_head(draft, head, blocks, build, stored)
    if file is not None and not stored:
        _store(file, draft)
    draft.requires_grad_(False)
    info: dict[str, Any] = {"scheme": scheme, "head": head, **({"head_ms_one_row": head_ms} if head_ms else {})}
    info.update({"head_agreement": round(agreement, 3)} if agreement < 1 else {})
    info.update(gguf_blocks=len(blocks), fused=fuse, **({"body": body, **choice} if scheme == "int4" else {}))
    vars(draft)["quantization"] = info
    draft.eval()
    return draft


def _set_head(
    draft: PreTrainedModel,
    head: str,
    blocks: Mapping[str, Blocks],
    build: Callable[[], DynamicInt8Linear] | None,
    stored: Mapping[str, torch.Tensor],
) -> None:
    """``draft``'s head as ``_head_choice`` chose it (a stored draft's int4 or int8 head as kept)."""
    module = draft.get_output_embeddings()
    if head == "int4" and not stored:
        draft.set_output_embeddings(_quantized(module, "int4", blocks.get("lm_head.weight")))
    elif head == "bf16":
        draft.set_output_embeddings(CastHead(module, torch.bfloat16))
    elif build is not None:  # (head "int8")
        bias = getattr(module, "bias", None)
        draft.set_output_embeddings(
            DynamicInt8Linear(None, bias, stored=_int8_head(stored)) if "head.int8" in stored else build()
        )


def _head_choice(
    target: PreTrainedModel, head: str, kernel_cache: Path | None, seen: Callable[[], Seen]
) -> tuple[str, dict[str, float], Callable[[], DynamicInt8Linear] | None, float]:
    """``quantized_copy``'s head: its kind (``"auto"`` resolved by ``choose_head``), the timings
    that chose it, an int8 head's builder and agreement (an ``"auto"`` int8 head that agrees
    less than INT8_AGREEMENT: the best float head instead)."""
    head_ms: dict[str, float] = {}
    if head == "auto":
        head, head_ms = choose_head(target.get_output_embeddings(), kernel_cache)
    build, agreement = (
        smoothed_int8(target, target.get_output_embeddings(), kernel_cache, lambda: seen().head_x)
        if head == "int8"
        else (None, 1.0)
    )
    if head_ms and build is not None and agreement < INT8_AGREEMENT:  # (auto) too inexact: the best float head
        build, head = None, faster_copy(head_ms, ("bf16",))
    return head, head_ms, build, agreement


def _known_body(
    target: PreTrainedModel, scheme: str, body: str, kernel_cache: Path | None
) -> tuple[str, dict[str, Any]]:
    """``body`` as far as known before the draft is built: "int4" where mixed cannot run (another
    scheme or device, a torch without the quantized engine), an "auto" this machine already
    chose (``_body_choice`` kept it), else as asked; and what chose it."""
    if body not in BODIES:
        raise ValueError(f"unknown draft body {body!r}; known: {', '.join(BODIES)}")
    cpu = next(target.parameters()).device.type == "cpu"
    if scheme != "int4" or not cpu or not kernels.int8_engine():
        return "int4", {}
    if body == "auto":
        seen = kernels.remembered(kernel_cache, _body_key(target))
        if isinstance(seen, dict) and seen.get("body") in ("int4", "mixed"):
            return str(seen["body"]), {k: v for k, v in seen.items() if k != "body"}
    return body, {}


def _built_body(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    body: str,
    choice: dict[str, Any],
    fuse: bool,
    cache: Path | None,
    seen: Callable[[], Seen],
) -> tuple[str, dict[str, Any]]:
    """The body of ``draft`` (just built in int4) made as ``body`` says ("auto": chosen now)."""
    if body == "auto":
        stage("timing the draft's body: int4 against int8 projections (once per machine)")
        return _body_choice(target, draft, fuse, cache, seen())
    if body == "mixed":
        stage("building the draft's int8 projections (mixed body)")
        _mixed_layers(draft, target, seen().absmax, fuse)
    return body, choice


def _body_key(target: PreTrainedModel) -> str:
    return f"draft body {head_fingerprint(cast(torch.Tensor, target.get_output_embeddings().weight).detach())}"


class Seen(NamedTuple):
    """What one forward of a target over ``_spread`` tokens showed (``_seen``)."""

    absmax: dict[str, torch.Tensor]  # max |x| per input channel of each INT8_PROJECTIONS module, by name
    argmax: torch.Tensor  # the model's argmax at each position
    head_x: torch.Tensor  # what the head received [tokens, hidden]


@torch.inference_mode()
def _seen(model: PreTrainedModel, tokens: int = 128, head: torch.nn.Module | None = None) -> Seen:
    """What ``model``'s INT8_PROJECTIONS and ``head`` (its own by default) receive in one
    forward over ``tokens`` token ids spread over the vocabulary, and its argmax there."""
    seen: dict[str, torch.Tensor] = {}
    head_x: list[torch.Tensor] = []

    def hook(name: str) -> Callable[..., None]:
        def keep(_m: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            m = absmax(args[0].flatten(0, -2).float(), 0)
            seen[name] = m if name not in seen else torch.maximum(seen[name], m)

        return keep

    head = head if head is not None else model.get_output_embeddings()
    hooks = [
        m.register_forward_pre_hook(hook(n))
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head and n.rpartition(".")[2] in INT8_PROJECTIONS
    ]
    hooks.append(head.register_forward_pre_hook(lambda _m, args: head_x.append(args[0].flatten(0, -2).float())))
    try:
        logits = model(_spread(model, tokens)).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return Seen(seen, logits.argmax(-1), head_x[0])


def _spread(model: PreTrainedModel, tokens: int) -> torch.Tensor:
    device = next(model.parameters()).device
    return torch.linspace(0, model.config.vocab_size - 1, tokens).long()[None].to(device)


def _mixed_layers(
    draft: PreTrainedModel, target: PreTrainedModel, seen: Mapping[str, torch.Tensor], fuse: bool
) -> None:
    """``draft``'s INT8_PROJECTIONS as DynamicInt8Linear from the target's weights, each input
    smoothed (SMOOTH_ALPHA) by what the target's projection saw (``seen``); fused siblings as one."""
    weights = dict(target.named_modules())
    for name, module in list(draft.named_modules()):
        mine = [n for n, _ in module.named_children() if n in INT8_PROJECTIONS and f"{name}.{n}" in seen]
        groups = [[n for n in g if n in mine] for g in FUSED] if fuse else []
        groups = [g for g in groups if len(g) > 1]
        groups += [[n] for n in mine if not any(n in g for g in groups)]
        for group in groups:
            parts = [cast(torch.nn.Linear, weights[f"{name}.{n}"]) for n in group]
            w = torch.cat([p.weight.detach().float() for p in parts])
            biases = [p.bias for p in parts]
            bias = (
                None
                if all(b is None for b in biases)
                else torch.cat(
                    [p.weight.new_zeros(p.out_features) if b is None else b.detach() for p, b in zip(parts, biases)]
                )
            )
            x = torch.stack([seen[f"{name}.{n}"] for n in group]).amax(0)
            smooth = x.clamp(min=1e-5) ** SMOOTH_ALPHA / absmax(w, 0).clamp(min=1e-5) ** (1 - SMOOTH_ALPHA)
            whole = DynamicInt8Linear(w, bias, smooth)
            whole.sizes = [p.out_features for p in parts]
            if len(group) > 1:
                replace_by_slices(module, group, whole)
            else:
                setattr(module, group[0], whole)


def _body_choice(
    target: PreTrainedModel, draft: PreTrainedModel, fuse: bool, kernel_cache: Path | None, observed: Seen
) -> tuple[str, dict[str, Any]]:
    """ "mixed" or "int4" for ``draft`` (built in int4), measured once per machine and target and
    kept in ``kernel_cache``: one row through every layer's INT8_PROJECTIONS each way (streamed
    from memory, as in a step), and each body's argmax agreement with the target over
    ``observed``'s tokens (``_seen``). ``draft`` is left mixed where that is chosen."""
    seen, want, _ = observed
    int4 = [(m, n, child) for m in draft.modules() for n, child in m.named_children() if n in INT8_PROJECTIONS]
    dtype = next(target.parameters()).dtype
    with torch.inference_mode():
        int4_agree = (draft(_spread(draft, len(want))).logits[0].argmax(-1) == want).float().mean().item()
        int4_ms = _pass_ms(_projections(draft), dtype)
        _mixed_layers(draft, target, seen, fuse)
        mixed_agree = (draft(_spread(draft, len(want))).logits[0].argmax(-1) == want).float().mean().item()
        mixed_ms = _pass_ms(_projections(draft), dtype)
    faster = mixed_ms <= AUTO_MARGIN * int4_ms
    body = "mixed" if faster and mixed_agree >= BODY_AGREEMENT * int4_agree else "int4"
    if body == "int4":  # its int4 projections back: the draft as built
        for module, n, child in int4:
            setattr(module, n, child)
    choice = {
        "body_ms_one_row": {"int4": round(int4_ms, 3), "mixed": round(mixed_ms, 3)},
        "body_agreement": {"int4": round(int4_agree, 3), "mixed": round(mixed_agree, 3)},
    }
    kernels.remember(kernel_cache, _body_key(target), {"body": body, **choice})
    return body, choice


def _projections(draft: PreTrainedModel) -> list[torch.nn.Module]:
    """The matmuls computing ``draft``'s INT8_PROJECTIONS, each fused one once."""
    out: dict[int, torch.nn.Module] = {}
    for module in draft.modules():
        for n, child in module.named_children():
            if n in INT8_PROJECTIONS:
                whole = getattr(child, "part_of", child)
                out.setdefault(id(whole), whole)
    return list(out.values())


def _pass_ms(modules: list[torch.nn.Module], dtype: torch.dtype, repeats: int = 5) -> float:
    """Milliseconds for one row through every one of ``modules`` in turn, the median of ``repeats``."""
    widths = {int(cast(int, m.in_features)) for m in modules}
    xs = {w: torch.randn(1, w, dtype=dtype) for w in widths}
    times = []
    for i in range(repeats + 1):  # (the first warms up)
        t0 = time.perf_counter()
        for m in modules:
            m(xs[int(cast(int, m.in_features))])
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _check(scheme: str, head: str, target: PreTrainedModel) -> None:
    """A clear error for a scheme or head quantized_copy does not know, fp8 without fp8
    hardware, or a target whose weights a kernel holds packed."""
    device = next(target.parameters()).device
    if any(isinstance(m, torch.nn.Linear) and m.weight.numel() == 0 for m in target.modules()):
        raise ValueError("the target's weights are in a kernel's packed layout: quantize it before preparing it")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r}; known: {', '.join(SCHEMES)}")
    if head not in HEADS:
        raise ValueError(f"unknown draft head {head!r}; known: {', '.join(HEADS)}")
    if scheme == "fp8" and device.type == "cuda" and not fp8_native(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"quantization fp8 needs a GPU with fp8 tensor cores (compute capability 8.9+; this one has "
            f"{major}.{minor}): use quantized:int4 or quantized:int8"
        )


def _sharing_copy(target: PreTrainedModel) -> PreTrainedModel:
    """A model of the target's class holding the target's own tensors (parameters, buffers,
    embeddings and generation config shared, not copied)."""
    with torch.device("meta"):
        draft: PreTrainedModel = type(target)(copy.deepcopy(target.config))
    draft.load_state_dict(target.state_dict(), assign=True)  # the same tensors, not copies
    modules = dict(draft.named_modules())
    for name, buf in target.named_buffers():  # non-persistent buffers (rotary frequencies) too
        owner, _, attr = name.rpartition(".")
        setattr(modules[owner] if owner else draft, attr, buf)
    draft.set_input_embeddings(target.get_input_embeddings())
    draft.set_output_embeddings(target.get_output_embeddings())
    draft.generation_config = target.generation_config
    return draft


def _quantize_layers(
    draft: PreTrainedModel, head: torch.nn.Module, scheme: str, blocks: Mapping[str, Blocks], fuse: bool
) -> None:
    """Every Linear of ``draft`` but its ``head`` quantized (``scheme``; ``blocks`` as they are),
    and each layer's ``FUSED`` projections run as one matmul."""
    for name, module in list(draft.named_modules()):  # a module at a time: its blocks go once fused
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if child is head:
                continue
            if isinstance(child, Conv1D):  # GPT-2's projections: a Linear with its weight transposed
                child = _as_linear(child)
            if isinstance(child, torch.nn.Linear):
                setattr(module, child_name, _quantized(child, scheme, blocks.get(f"{full}.weight")))
        for names in FUSED if fuse else ():
            _fuse(module, names)
        for child in module.modules():
            if isinstance(child, Int4Linear):
                child.blocks = None


def stored_draft_file(
    folder: Path | None,
    target: PreTrainedModel,
    scheme: str,
    head: str,
    fuse: bool,
    blocks: Mapping[str, Blocks],
    body: str = "int4",
) -> Path | None:
    """Where ``quantized_copy`` keeps a CPU int4 draft of ``target`` in ``folder``, packed as
    this machine's kernel reads it; None where none is kept (another scheme or device, a body
    not yet chosen). Named
    by what decides its bytes: the machine and torch (``kernels.machine_key``: the packing
    follows the CPU), the target's dtype, the draft's recipe, and 8 rows of every weight it quantizes."""
    if folder is None or scheme != "int4" or next(target.parameters()).device.type != "cpu" or body == "auto":
        return None
    machine = kernels.machine_key().rsplit("|threads", 1)[0]
    dtype = next(target.parameters()).dtype  # (its biases and norms are the target's, in its dtype)
    h = hashlib.sha256(
        f"{machine}|{dtype}|{STORED_FORMAT}|{scheme}|{head}|{fuse}|{GROUP}|{sorted(blocks)}{'' if body == 'int4' else f'|{body}'}".encode()
    )
    for name, module in target.named_modules():
        w = getattr(module, "weight", None)
        if isinstance(module, (torch.nn.Linear, Conv1D)) and isinstance(w, torch.Tensor) and w.numel():
            h.update(f"{name}{tuple(w.shape)}".encode())
            h.update(w[:: max(1, w.shape[0] // 8)].detach().float().contiguous().numpy().tobytes())
    return folder / f"int4-draft-{h.hexdigest()[:16]}.safetensors"


def _read_stored(file: Path | None) -> dict[str, torch.Tensor]:
    """A stored draft's tensors (mapped), or {} where there is none or it cannot be read. Its
    modification time marks its last use (``_store`` prunes by it)."""
    if file is None or not file.is_file() or not complete(file):  # (a write cut short: built again)
        return {}
    try:
        tensors = dict(mapped_tensors(file))
    except (OSError, ValueError, KeyError, RuntimeError):  # damaged: built again and stored over it
        return {}
    with contextlib.suppress(OSError):  # (a read-only cache is still used)
        os.utime(file)
    return tensors


def _store(file: Path, draft: PreTrainedModel) -> None:
    """Keeps a built draft in ``file`` (``packed_state``), then deletes the stored drafts beside it that no load
    has used for STORED_UNUSED_DAYS (~1 GB each at 1.5B), and the temporary files of writers
    that died a day ago or more. A process that still maps a deleted file keeps reading it."""
    stage(f"keeping the built draft in {file}")
    save_tensors(file, packed_state(draft))
    remove_stale(file.parent, "int4-draft-*.safetensors", STORED_UNUSED_DAYS * 86400)
    remove_stale(file.parent, ".int4-draft-*.tmp")


def packed_state(draft: PreTrainedModel) -> dict[str, torch.Tensor]:
    """A draft's int4 matmuls (each fused one once, named by its parent and parts:
    ``model.layers.0.mlp.gate_proj+up_proj``) and an int8 head, as ``_stored_layers`` reads them."""
    out: dict[str, torch.Tensor] = {}
    for name, module in draft.named_modules():
        for child_name, child in module.named_children():
            key = f"{name}.{child_name}" if name else child_name
            if (
                isinstance(child, Slice)
                and child.start == 0
                and isinstance(child.part_of, (Int4Linear, DynamicInt8Linear))
            ):
                names = next(g for g in FUSED if g[0] == child_name)
                child, key = child.part_of, f"{name}.{'+'.join(names)}"
            elif not isinstance(child, (Int4Linear, DynamicInt8Linear)) or isinstance(module, Fused):
                continue
            if isinstance(child, DynamicInt8Linear):  # a mixed body's projection
                if child is not draft.get_output_embeddings():
                    out.update(_int8_state(key, child))
                continue
            out.update({f"{key}.{part}": t for part, t in child.named_buffers() if t is not None})
    head = draft.get_output_embeddings()
    if isinstance(head, DynamicInt8Linear):
        rows, scale, inv = head.int8_rows()
        out.update({"head.int8": rows, "head.scale": scale, **({"head.inv": inv} if inv is not None else {})})
    return out


def _int8_state(key: str, module: DynamicInt8Linear) -> dict[str, torch.Tensor]:
    rows, scale, inv = module.int8_rows()
    out = {f"{key}.int8": rows, f"{key}.int8_scale": scale, f"{key}.int8_sizes": torch.tensor(module.sizes)}
    out.update({f"{key}.int8_inv": inv} if inv is not None else {})
    return out | ({f"{key}.int8_bias": module.float_bias} if module.float_bias is not None else {})


def _stored(tensors: Mapping[str, torch.Tensor], key: str, sizes: list[int] | None = None) -> torch.nn.Module | None:
    """The matmul ``packed_state`` kept under ``key`` (int4 or a mixed body's int8), or None."""
    if f"{key}.packed" in tensors:
        return Int4Linear.stored(tensors, key, sizes)
    if f"{key}.int8" not in tensors:
        return None
    stored = (tensors[f"{key}.int8"], tensors[f"{key}.int8_scale"], tensors.get(f"{key}.int8_inv"))
    whole = DynamicInt8Linear(None, tensors.get(f"{key}.int8_bias"), stored=stored)
    whole.sizes = [int(n) for n in tensors[f"{key}.int8_sizes"]]
    return whole


def _stored_layers(draft: PreTrainedModel, tensors: Mapping[str, torch.Tensor]) -> None:
    """``draft``'s Linears that ``packed_state`` kept, as it kept them (fused ones fused)."""
    for name, module in list(draft.named_modules()):
        for names in FUSED:
            sizes = [cast(torch.nn.Linear, getattr(module, n)).out_features for n in names if hasattr(module, n)]
            whole = _stored(tensors, f"{name}.{'+'.join(names)}", sizes)
            if whole is not None:
                replace_by_slices(module, names, whole)
        for child_name in [n for n, _ in module.named_children()]:
            whole = _stored(tensors, f"{name}.{child_name}" if name else child_name)
            if whole is not None:
                setattr(module, child_name, whole)


def _int8_head(tensors: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return tensors["head.int8"], tensors["head.scale"], tensors.get("head.inv")


def tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """A model's parameters and buffers, and the copies its tuned Linears multiply by
    (kernels.tune: a weight in a kernel's layout, held instead of the parameter's data)."""
    copies = [c for m in model.modules() for c in (getattr(m, "_kernel_weights", None) or {}).values()]
    return [*model.parameters(), *model.buffers(), *copies]


def model_bytes(model: torch.nn.Module, without: torch.nn.Module | None = None) -> int:
    """Bytes of the tensors a model holds (``tensors``), each counted once (a tied head is the
    embedding), less those it shares with ``without`` (a draft's own: ``model_bytes(draft, target)``)."""
    shared = {_where(t) for t in tensors(without)} if without is not None else set()
    own = {_where(t): t for t in tensors(model) if t.numel() and _where(t) not in shared}
    theirs = {id(m) for m in without.modules()} if without is not None else set()
    opaque = {id(m): m for m in model.modules() if isinstance(m, DynamicInt8Linear) and id(m) not in theirs}
    return sum(t.numel() * t.element_size() for t in own.values()) + sum(m.held_bytes for m in opaque.values())


def _where(t: torch.Tensor) -> int:
    """A tensor's memory, to count it once: its data's address (an opaque tensor, such as
    oneDNN's packed weight, has none: the tensor itself)."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return id(t)
