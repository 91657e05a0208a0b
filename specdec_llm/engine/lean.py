"""A Llama forward without transformers' module machinery: the same operations in the same
order as ``LlamaForCausalLM.forward``, called directly on the model's own tensors and
(kernel-tuned, quantized) Linear forwards, with q/k/v and gate/up each as one matmul.

Why: a 135M-parameter target's one-token step on 2 CPU cores is ~18 ms, of which ~3 ms is
Python in transformers (module calls, keyword plumbing, mask and cache dispatch). Every
iteration of every drafter pays it, and so does each draft-model step; fusing the sibling
projections saves ~90 kernel calls more. Measured on an AMD EPYC (avx512_bf16), fp32, a
200-token cache, through RaggedCache: 19.6 -> 15.0 ms at 1 token, 24.0 -> 18.6 ms at 5
(``benchmarks/bench_forward.py``: "engine" vs "plain"). transformers' forward stays the fallback:
``runner(model)`` returns None for anything but a plain Llama-family decoder on the CPU
(other architectures, rope types that change with length, eager attention, GPUs: the lean
path is not yet measured there), and ``hf.forward_rows`` then calls the model itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import DynamicCache, PreTrainedModel

    from .hf import GrowingLayer

ENABLED = True  # tests and benchmarks compare both paths by flipping this
# the attention implementations whose math this forward repeats: transformers' sdpa and the
# engine's (hf.ATTENTION, the same kernel with grouped heads kept; named here, as hf imports this)
ATTENTIONS = ("sdpa", "specdec_sdpa")


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype  # LlamaRMSNorm: in float32, then back
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class LeanLlama:
    """``__call__(ids, cache, keep, mask, positions, embeds, features)`` as ``hf.forward_rows``:
    ``ids`` [B, W] on top of ``cache`` (hf.GrowingLayer layers); float32 logits of the last
    ``keep`` columns, and the asked layers' outputs."""

    def __init__(self, model: PreTrainedModel, kernel_cache: Path | None = None, force: str | None = None) -> None:
        base, cfg = model.model, model.config
        self.dtype = model.dtype  # the fused copies are of this dtype: a model cast later gets a new runner
        self.embed = base.embed_tokens
        self.norm, self.head, self.rotary = base.norm, model.lm_head, base.rotary_emb
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layers: list[tuple[Any, ...]] = []
        fused = torch.nn.ModuleList()
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = _fuse([attn.q_proj, attn.k_proj, attn.v_proj]), _fuse([mlp.gate_proj, mlp.up_proj])
            fused.extend(m for m in (qkv, gate_up) if isinstance(m, torch.nn.Linear))
            self.layers.append((layer.input_layernorm, attn, qkv, layer.post_attention_layernorm, mlp, gate_up))
        if len(fused):  # (supported: on the CPU)
            from .kernels import tune

            tune(fused, kernel_cache, force)  # the fused shapes get their own measured kernels
            for m in fused:  # the row-major weight is only kept if its kernel runs somewhere
                copies = getattr(m, "_kernel_weights", None) or {}
                weight = cast(torch.Tensor, m.weight)
                if copies and all(c is not weight for c in copies.values()):
                    weight.data = weight.data.new_empty(0)
        self.fused = fused

    def rotary_of(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin at ``positions`` [B, W], [B, 1, W, head_dim] (LlamaRotaryEmbedding's math)."""
        freqs = positions[..., None].float() * self.rotary.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = self.rotary.attention_scaling
        cos: torch.Tensor = (emb.cos() * scaling).to(dtype).unsqueeze(1)
        sin: torch.Tensor = (emb.sin() * scaling).to(dtype).unsqueeze(1)
        return cos, sin

    @torch.inference_mode()
    def __call__(
        self,
        ids: torch.Tensor,
        cache: DynamicCache,
        keep: int,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
        features: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = ids.shape[1]
        if embeds is not None:
            h = embeds.to(self.embed.weight.device, self.dtype)
        else:
            h = F.embedding(ids, self.embed.weight, self.embed.padding_idx)
        caught: dict[int, torch.Tensor] = {}
        layers = cast("list[GrowingLayer]", cache.layers)
        past = layers[0].width
        if positions is None:
            positions = (torch.arange(w, device=h.device) + past).unsqueeze(0)
        if mask is None and w > 1:  # one row, no holes: causal over the past and the chunk
            mask = torch.ones(w, past + w, dtype=torch.bool, device=h.device).tril(past)[None, None]
        cos, sin = self.rotary_of(positions, h.dtype)
        for i, entry in enumerate(self.layers):
            h = layer(entry, h, cos, sin, mask, self.head_dim, layers[i].update)
            if i in features:
                caught[i] = h
        feats = torch.cat([caught[i] for i in features], -1).float() if features else None
        h = _rms(h[:, -keep:], self.norm.weight, self.norm.variance_epsilon)
        logits: torch.Tensor = self.head(h)
        return logits.float(), feats


def layer(
    entry: tuple[Any, ...],
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor | None,
    head_dim: int,
    kv: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """One decoder layer (an entry of ``LeanLlama.layers``) over ``h`` [B, W, H]: ``kv`` takes
    the chunk's keys and values [B, heads, W, head_dim] into the cache and returns everything
    the chunk attends to (``GrowingLayer.update``; compiled.py writes its buffers in place)."""
    norm1, attn, qkv, norm2, mlp, gate_up = entry
    rows, w = h.shape[:2]
    shape, half = (rows, w, -1, head_dim), head_dim // 2

    def rope(x: torch.Tensor) -> torch.Tensor:
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    x = _rms(h, norm1.weight, norm1.variance_epsilon)
    if qkv is not None:
        q, k, v = qkv.forward(x).split(qkv.sizes, dim=-1)
    else:
        q, k, v = attn.q_proj.forward(x), attn.k_proj.forward(x), attn.v_proj.forward(x)
    q = rope(q.reshape(shape).transpose(1, 2))
    k, v = kv(rope(k.reshape(shape).transpose(1, 2)), v.reshape(shape).transpose(1, 2))
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
    h = h + attn.o_proj.forward(a.transpose(1, 2).reshape(rows, w, -1))
    x = _rms(h, norm2.weight, norm2.variance_epsilon)
    if gate_up is not None:
        g, u = gate_up.forward(x).split(gate_up.sizes, dim=-1)
    else:
        g, u = mlp.gate_proj.forward(x), mlp.up_proj.forward(x)
    out: torch.Tensor = h + mlp.down_proj.forward(F.silu(g) * u)
    return out


def _fuse(linears: list[Any]) -> torch.nn.Module | None:
    """One Linear over sibling Linears that read the same input (q/k/v, gate/up): one matmul
    instead of several over the same dot products (a kernel may round the last bits
    differently for another output width, as any two kernels may: kernels.py; on the demo
    target the logits came out bit-identical). A copy of their weights (the siblings keep
    theirs for transformers' own forward); None unless all are plain float Linears (a
    quantized copy fused its own: that matmul, called once here instead of through its parts)."""
    whole = getattr(linears[0], "part_of", None)  # engine/quant.py: Slice parts of one int4 matmul
    if whole is not None:
        own = all(getattr(m, "part_of", None) is whole for m in linears)
        return whole if own and whole.sizes == [m.out_features for m in linears] else None
    if not all(type(m) is torch.nn.Linear for m in linears):
        return None
    ws: list[torch.Tensor] = [m.weight.detach() for m in linears]  # plain Linears (checked above)
    if len({(w.dtype, w.shape[1]) for w in ws}) != 1 or (
        ws[0].dtype not in (torch.float32, torch.bfloat16, torch.float16)
    ):
        return None
    has_bias = [m.bias is not None for m in linears]
    fused = torch.nn.Linear(
        ws[0].shape[1], sum(w.shape[0] for w in ws), bias=any(has_bias), device=ws[0].device, dtype=ws[0].dtype
    )
    fused.weight.data = torch.cat([w.contiguous() for w in ws])
    if any(has_bias):
        fused.bias.data = torch.cat(
            [m.bias.detach() if m.bias is not None else w.new_zeros(w.shape[0]) for m, w in zip(linears, ws)]
        )
    fused.requires_grad_(False)
    fused.sizes = [int(w.shape[0]) for w in ws]  # type: ignore[assignment]
    return fused


def supported(model: PreTrainedModel) -> bool:
    """A plain Llama-family decoder on the CPU with sdpa attention and a static rotary table."""
    from transformers.models.llama import modeling_llama as ml

    cfg = model.config
    base = getattr(model, "model", None)
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    return (
        model.device.type == "cpu"
        and type(base) is ml.LlamaModel
        and all(type(layer) is ml.LlamaDecoderLayer for layer in base.layers)
        and type(base.rotary_emb) is ml.LlamaRotaryEmbedding
        and cfg._attn_implementation in ATTENTIONS
        and getattr(cfg, "hidden_act", "silu") == "silu"
        and getattr(cfg, "pretraining_tp", 1) == 1
        and rope in ("default", "linear", "llama3")  # inv_freq fixed at load (not "dynamic")
    )


def build(model: PreTrainedModel, kernel_cache: Path | None = None, force: str | None = None) -> LeanLlama | None:
    """Build the model's lean forward now (``hf.prepare`` does, after tuning the kernels:
    the fused projections are tuned with the same timing cache, or ``force``d to one kernel
    as kernels.tune does); None if unsupported."""
    lean = LeanLlama(model, kernel_cache, force) if supported(model) else None
    model.__dict__["_specdec_lean"] = lean
    return lean


def runner(model: PreTrainedModel, kernel_cache: Path | None = None) -> LeanLlama | None:
    """The model's lean forward, or None: use transformers'. Built once per model dtype and
    kept on the model (``hf.prepare`` builds it first, with the kernel-timing cache)."""
    if not ENABLED:
        return None
    lean = model.__dict__.get("_specdec_lean", False)
    if lean is False or (lean is not None and lean.dtype != model.dtype):
        return build(model, kernel_cache)
    return cast("LeanLlama | None", lean)
