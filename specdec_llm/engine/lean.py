"""A Llama forward without transformers' module machinery: the same operations in the same
order as ``LlamaForCausalLM.forward`` (so the same logits, bit for bit, on the CPU), called
directly on the model's own tensors and (kernel-tuned, quantized) Linear forwards.

Why: a 135M-parameter target's one-token step on 2 CPU cores is ~18 ms, of which ~3 ms is
Python in transformers (module calls, keyword plumbing, mask and cache dispatch). Every
iteration of every drafter pays it, and so does each draft-model step. Measured on an AMD
EPYC (avx512_bf16), fp32, 200-token cache: 19.4 -> 16.3 ms at 1 token, 22.9 -> 19.8 ms at 5
(``benchmarks/bench_forward.py --paths``). transformers' own forward stays the fallback:
``runner(model)`` returns None for anything but a plain Llama-family decoder on the CPU
(other architectures, rope types that change with length, eager attention, GPUs: the lean
path is not yet measured there), and ``hf.forward_rows`` then calls the model itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

ENABLED = True  # tests and benchmarks compare both paths by flipping this


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype  # LlamaRMSNorm: in float32, then back
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class LeanLlama:
    """``__call__(ids, cache, keep, mask, positions)`` as ``hf.forward_rows``: ``ids`` [B, W]
    on top of ``cache`` (hf.GrowingLayer layers); float32 logits of the last ``keep`` columns."""

    def __init__(self, model: PreTrainedModel) -> None:
        base, cfg = model.model, model.config
        self.embed = base.embed_tokens
        self.layers = [(layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp)
                       for layer in base.layers]  # fmt: skip
        self.norm, self.head, self.rotary = base.norm, model.lm_head, base.rotary_emb
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @torch.inference_mode()
    def __call__(
        self,
        ids: torch.Tensor,
        cache: DynamicCache,
        keep: int,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows, w = ids.shape
        h = F.embedding(ids, self.embed.weight, self.embed.padding_idx)
        past = cache.layers[0].width
        if positions is None:
            positions = (torch.arange(w, device=h.device) + past).unsqueeze(0)
        if mask is None and w > 1:  # one row, no holes: causal over the past and the chunk
            mask = torch.ones(w, past + w, dtype=torch.bool, device=h.device).tril(past)[None, None]
        freqs = positions[..., None].float() * self.rotary.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = self.rotary.attention_scaling
        cos: torch.Tensor = (emb.cos() * scaling).to(h.dtype).unsqueeze(1)
        sin: torch.Tensor = (emb.sin() * scaling).to(h.dtype).unsqueeze(1)
        half, shape = self.head_dim // 2, (rows, w, -1, self.head_dim)

        def rope(x: torch.Tensor) -> torch.Tensor:
            return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

        for i, (norm1, attn, norm2, mlp) in enumerate(self.layers):
            x = _rms(h, norm1.weight, norm1.variance_epsilon)
            q = rope(attn.q_proj.forward(x).view(shape).transpose(1, 2))
            k = rope(attn.k_proj.forward(x).view(shape).transpose(1, 2))
            v = attn.v_proj.forward(x).view(shape).transpose(1, 2)
            k, v = cache.layers[i].update(k, v)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
            h = h + attn.o_proj.forward(a.transpose(1, 2).reshape(rows, w, -1))
            x = _rms(h, norm2.weight, norm2.variance_epsilon)
            h = h + mlp.down_proj.forward(F.silu(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x))
        h = _rms(h[:, -keep:], self.norm.weight, self.norm.variance_epsilon)
        return self.head(h).float()


def supported(model: PreTrainedModel) -> bool:
    """A plain Llama-family decoder on the CPU with sdpa attention and a static rotary table."""
    from transformers.models.llama import modeling_llama as ml

    from .hf import ATTENTION

    cfg = model.config
    base = getattr(model, "model", None)
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    return (
        model.device.type == "cpu"
        and type(base) is ml.LlamaModel
        and all(type(layer) is ml.LlamaDecoderLayer for layer in base.layers)
        and type(base.rotary_emb) is ml.LlamaRotaryEmbedding
        and cfg._attn_implementation in (ATTENTION, "sdpa")
        and getattr(cfg, "hidden_act", "silu") == "silu"
        and getattr(cfg, "pretraining_tp", 1) == 1
        and rope in ("default", "linear", "llama3")  # inv_freq fixed at load (not "dynamic")
    )


def runner(model: PreTrainedModel) -> LeanLlama | None:
    """The model's lean forward (built once, kept on the model), or None: use transformers'."""
    if not ENABLED:
        return None
    lean = model.__dict__.get("_specdec_lean", False)
    if lean is False:
        lean = LeanLlama(model) if supported(model) else None
        model.__dict__["_specdec_lean"] = lean
    return lean
