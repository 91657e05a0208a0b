"""A decoder forward without transformers' module machinery: the same operations in the same
order as the family's own ``forward``, called directly on the model's own tensors, norms and
(kernel-tuned, quantized) Linear forwards, with q/k/v and gate/up each as one matmul.

Why: a 135M-parameter target's one-token step on 2 CPU cores is ~18 ms, of which ~3 ms is
Python in transformers (module calls, keyword plumbing, mask and cache dispatch). Every
iteration of every drafter pays it, and so does each draft-model step; fusing the sibling
projections saves ~90 kernel calls more. Measured on an AMD EPYC (avx512_bf16), fp32, a
200-token cache, through RaggedCache: 19.6 -> 15.0 ms at 1 token, 24.0 -> 18.6 ms at 5
(``benchmarks/bench_forward.py``: "engine" vs "plain").

The families (``FAMILIES``): Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norms), Phi-3
(q/k/v and gate/up already fused, partial rotary), Gemma 2/3 (norms with +1 and around both
blocks, a scaled embedding, final soft-capping, Gemma 3's q/k norms and its local rotary for
sliding layers). Norms, activations and the embedding are the model's own modules' forwards
(their math, bit for bit); what this module writes itself is the attention around sdpa and
the rotary embedding (the families' own formula). transformers' forward stays the fallback:
``runner(model)`` returns None for anything else (other layouts, attention soft-capping,
rope types that change with length, eager attention, GPUs: the lean path is not measured
there), and ``hf.forward_rows`` then calls the model itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn.functional as F

from .quant import replace_by_slices

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import DynamicCache, PreTrainedModel


class _Layer(Protocol):
    """What this forward reads of a cache layer (hf.GrowingLayer; named here, as hf imports this)."""

    width: int

    def update(self, k: torch.Tensor, v: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]: ...


ENABLED = True  # tests and benchmarks compare both paths by flipping this
# the attention implementations whose math this forward repeats: transformers' sdpa and the
# engine's (hf.ATTENTION, the same kernel with grouped heads kept; named here, as hf imports this)
ATTENTIONS = ("sdpa", "specdec_sdpa")
# transformers' modeling module of each family served -> its layer layout: "pre" (a norm before
# attention and before the MLP: Llama's) or "sandwich" (also a norm after each: Gemma's)
FAMILIES = {
    "llama": "pre",
    "mistral": "pre",
    "qwen2": "pre",
    "qwen3": "pre",
    "phi3": "pre",
    "gemma2": "sandwich",
    "gemma3": "sandwich",
}
ROPE_TYPES = ("default", "linear", "llama3")  # inv_freq fixed at load (not "dynamic", "longrope")


@dataclass(frozen=True)
class Layer:
    """One decoder layer's parts. ``qkv`` / ``gate_up``: one matmul over the siblings (their
    output ``sizes``), or None (the siblings are called apart); ``post_attn`` / ``post_mlp``: the
    norms after each block (sandwich layouts), else None; ``kind``: its attention kind."""

    norm_in: Any
    attn: Any
    qkv: Any
    post_attn: Any
    norm_mlp: Any
    mlp: Any
    gate_up: Any
    post_mlp: Any
    kind: str


class LeanDecoder:
    """``__call__(ids, cache, keep, mask, positions, embeds, features)`` as ``hf.forward_rows``:
    ``ids`` [B, W] on top of ``cache`` (hf.GrowingLayer layers); float32 logits of the last
    ``keep`` columns, and the asked layers' outputs. ``mask``: one boolean mask, or {layer
    kind: mask} (``attention.Attention.masks``)."""

    def __init__(self, model: PreTrainedModel, kernel_cache: Path | None = None, force: str | None = None) -> None:
        from .attention import layer_kinds

        base, cfg = model.get_decoder(), model.config
        self.dtype = model.dtype  # a model cast later gets a new runner
        self.embed: Any = model.get_input_embeddings()
        self.norm, self.head, self.rotary = base.norm, model.get_output_embeddings(), base.rotary_emb
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        sandwich = FAMILIES.get(family(model) or "") == "sandwich"
        self.layers: list[Layer] = []
        fused = torch.nn.ModuleList()
        for layer, kind in zip(base.layers, layer_kinds(cfg)):
            attn, mlp = layer.self_attn, layer.mlp
            for owner, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
                made = _fuse(owner, names)
                if made is not None:
                    fused.append(made)
            qkv = _native(attn, "qkv_proj") or _whole([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up = _native(mlp, "gate_up_proj") or _whole([mlp.gate_proj, mlp.up_proj])
            norms = (
                (layer.post_attention_layernorm, layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)
                if sandwich
                else (None, layer.post_attention_layernorm, None)
            )
            self.layers.append(
                Layer(layer.input_layernorm, attn, qkv, norms[0], norms[1], mlp, gate_up, norms[2], kind)
            )
        self.kinds = sorted({entry.kind for entry in self.layers})
        if len(fused):  # (supported: on the CPU)
            from .kernels import tune

            tune(fused, kernel_cache, force)  # the fused shapes get their own measured kernels
        self.fused = fused

    def rotary_of(
        self, positions: torch.Tensor, dtype: torch.dtype, kind: str = "full_attention"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin at ``positions`` [B, W] for layers of ``kind``, [B, 1, W, rotary dim]
        (the families' rotary math; Gemma 3 keeps one table per layer kind)."""
        inv_freq = getattr(self.rotary, f"{kind}_inv_freq", None)
        if inv_freq is None:
            inv_freq, scaling = self.rotary.inv_freq, self.rotary.attention_scaling
        else:
            scaling = getattr(self.rotary, f"{kind}_attention_scaling")
        freqs = positions[..., None].float() * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos: torch.Tensor = (emb.cos() * scaling).to(dtype).unsqueeze(1)
        sin: torch.Tensor = (emb.sin() * scaling).to(dtype).unsqueeze(1)
        return cos, sin

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (the model's own: Gemma's scales them)."""
        out: torch.Tensor = self.embed.forward(ids)
        return out

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm.forward(h)
        return out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-normed hidden states (Gemma's soft-capping included)."""
        logits: torch.Tensor = self.head(h)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    @torch.inference_mode()
    def __call__(
        self,
        ids: torch.Tensor,
        cache: DynamicCache,
        keep: int,
        mask: Any = None,
        positions: torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
        features: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = ids.shape[1]
        h = embeds.to(self.embed.weight.device, self.dtype) if embeds is not None else self.embed_ids(ids)
        caught: dict[int, torch.Tensor] = {}
        layers = cast("list[_Layer]", cache.layers)
        past = layers[0].width
        if positions is None:
            positions = (torch.arange(w, device=h.device) + past).unsqueeze(0)
        if mask is None and w > 1:  # one row, no holes: causal over the past and the chunk
            mask = torch.ones(w, past + w, dtype=torch.bool, device=h.device).tril(past)[None, None]
        masks = mask if isinstance(mask, dict) else dict.fromkeys(self.kinds, mask)
        rotary = {kind: self.rotary_of(positions, h.dtype, kind) for kind in self.kinds}
        for i, entry in enumerate(self.layers):
            cos, sin = rotary[entry.kind]
            h = layer(entry, h, cos, sin, masks[entry.kind], self.head_dim, layers[i].update)
            if i in features:
                caught[i] = h
        feats = torch.cat([caught[i] for i in features], -1).float() if features else None
        return self.logits(self.final_norm(h[:, -keep:])), feats


def layer(
    entry: Layer,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor | None,
    head_dim: int,
    kv: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """One decoder layer over ``h`` [B, W, H]: ``kv`` takes the chunk's keys and values
    [B, heads, W, head_dim] into the cache and returns everything the chunk attends to
    (``GrowingLayer.update``; compiled.py writes its buffers in place)."""
    attn, mlp = entry.attn, entry.mlp
    rows, w = h.shape[:2]
    shape, rot = (rows, w, -1, head_dim), cos.shape[-1]

    def rope(x: torch.Tensor) -> torch.Tensor:
        r, half = x[..., :rot], rot // 2
        out = r * cos + torch.cat((-r[..., half:], r[..., :half]), dim=-1) * sin
        return out if rot == head_dim else torch.cat([out, x[..., rot:]], dim=-1)  # (partial rotary: Phi-3)

    x = entry.norm_in.forward(h)
    if entry.qkv is not None:
        q, k, v = entry.qkv.forward(x).split(entry.qkv.sizes, dim=-1)
    else:
        q, k, v = attn.q_proj.forward(x), attn.k_proj.forward(x), attn.v_proj.forward(x)
    q, k, v = q.reshape(shape).transpose(1, 2), k.reshape(shape).transpose(1, 2), v.reshape(shape).transpose(1, 2)
    if getattr(attn, "q_norm", None) is not None:  # (Qwen3, Gemma 3: over each head)
        q, k = attn.q_norm.forward(q), attn.k_norm.forward(k)
    k, v = kv(rope(k), v)
    a = F.scaled_dot_product_attention(rope(q), k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
    a = attn.o_proj.forward(a.transpose(1, 2).reshape(rows, w, -1))
    h = h + (entry.post_attn.forward(a) if entry.post_attn is not None else a)
    x = entry.norm_mlp.forward(h)
    if entry.gate_up is not None:
        g, u = entry.gate_up.forward(x).split(entry.gate_up.sizes, dim=-1)
    else:
        g, u = mlp.gate_proj.forward(x), mlp.up_proj.forward(x)
    m = mlp.down_proj.forward(_act(mlp)(g) * u)
    out: torch.Tensor = h + (entry.post_mlp.forward(m) if entry.post_mlp is not None else m)
    return out


def _act(mlp: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    act = getattr(mlp, "act_fn", None) or mlp.activation_fn  # (Phi-3 names it activation_fn)
    return cast("Callable[[torch.Tensor], torch.Tensor]", act.forward)


def _native(module: Any, name: str) -> Any:
    """A projection the family already fuses (Phi-3's qkv_proj, gate_up_proj), with its ``sizes``."""
    proj = getattr(module, name, None)
    if proj is None:
        return None
    if name == "qkv_proj":
        q = module.config.num_attention_heads * module.head_dim
        kv = module.config.num_key_value_heads * module.head_dim
        proj.sizes = [q, kv, kv]
    else:
        proj.sizes = [proj.out_features // 2] * 2
    return proj


def _whole(linears: list[Any]) -> torch.nn.Module | None:
    """The one matmul sibling projections are slices of (``_fuse`` or a quantized copy made
    them: ``quant.Slice``), None when they are separate."""
    whole = getattr(linears[0], "part_of", None)
    if whole is None or any(getattr(m, "part_of", None) is not whole for m in linears):
        return None
    return whole if whole.sizes == [m.out_features for m in linears] else None


def _fuse(owner: Any, names: tuple[str, ...]) -> torch.nn.Linear | None:
    """Sibling float Linears of ``owner`` that read the same input (q/k/v, gate/up) become
    slices of one Linear over their concatenated weights (``quant.replace_by_slices``): one
    matmul instead of several, and the fused weight replaces theirs (transformers' own forward
    calls the slices, so both forwards share it). Returns the new Linear, None when the
    siblings are absent, already fused or tuned, or not all plain float Linears. (A kernel may round the
    last bits differently for another output width, as any two kernels may: kernels.py; on the
    demo target the logits came out bit-identical.)"""
    found = [getattr(owner, n, None) for n in names]
    if not all(type(m) is torch.nn.Linear and getattr(m, "_kernels", None) is None for m in found):
        return None
    linears = cast(list[torch.nn.Linear], found)
    ws: list[torch.Tensor] = [m.weight.detach() for m in linears]  # plain Linears (checked above)
    if len({(w.dtype, w.shape[1]) for w in ws}) != 1 or (
        ws[0].dtype not in (torch.float32, torch.bfloat16, torch.float16)
    ):
        return None
    has_bias = [m.bias is not None for m in linears]
    with torch.device("meta"):
        fused = torch.nn.Linear(ws[0].shape[1], sum(w.shape[0] for w in ws), bias=any(has_bias), dtype=ws[0].dtype)
    fused.weight = torch.nn.Parameter(torch.cat([w.contiguous() for w in ws]), requires_grad=False)
    if any(has_bias):
        bias = torch.cat(
            [m.bias.detach() if m.bias is not None else w.new_zeros(w.shape[0]) for m, w in zip(linears, ws)]
        )
        fused.bias = torch.nn.Parameter(bias, requires_grad=False)
    else:
        fused.register_parameter("bias", None)
    fused.sizes = [int(w.shape[0]) for w in ws]  # type: ignore[assignment]
    replace_by_slices(owner, names, fused)
    return fused


def family(model: PreTrainedModel) -> str | None:
    """The transformers modeling module the model's decoder layers come from (``FAMILIES``'
    keys: "llama", "qwen3", ...), None when its layers are of several or none."""
    try:
        layers = model.get_decoder().layers
    except AttributeError:
        return None
    mods = {type(layer).__module__.rsplit(".", 1)[-1] for layer in layers}
    if len(mods) != 1:
        return None
    return mods.pop().removeprefix("modeling_")


def supported(model: PreTrainedModel) -> bool:
    """A decoder of a family in ``FAMILIES`` on the CPU with sdpa attention, a rotary table
    fixed at load, no attention soft-capping, and the family's own activation."""
    cfg = model.config
    name = family(model)
    if name not in FAMILIES or model.device.type != "cpu":
        return False
    base = model.get_decoder()
    params = getattr(cfg, "rope_parameters", None) or {}
    per_kind = [v for v in params.values() if isinstance(v, dict)]  # (Gemma 3: one per layer kind)
    ropes = [p.get("rope_type", "default") for p in per_kind or [params]]
    return (
        hasattr(base, "rotary_emb")
        and hasattr(base, "norm")
        and cfg._attn_implementation in ATTENTIONS
        and getattr(cfg, "attn_logit_softcapping", None) is None
        and getattr(cfg, "pretraining_tp", 1) == 1
        and not getattr(cfg, "use_bidirectional_attention", False)
        and all(r in ROPE_TYPES for r in ropes)
    )


def build(model: PreTrainedModel, kernel_cache: Path | None = None, force: str | None = None) -> LeanDecoder | None:
    """Build the model's lean forward now (``hf.prepare`` does, after tuning the kernels:
    the fused projections are tuned with the same timing cache, or ``force``d to one kernel
    as kernels.tune does); None if unsupported."""
    lean = LeanDecoder(model, kernel_cache, force) if supported(model) else None
    model.__dict__["_specdec_lean"] = lean
    return lean


def runner(model: PreTrainedModel, kernel_cache: Path | None = None) -> LeanDecoder | None:
    """The model's lean forward, or None: use transformers'. Built once per model dtype and
    kept on the model (``hf.prepare`` builds it first, with the kernel-timing cache)."""
    if not ENABLED:
        return None
    lean = model.__dict__.get("_specdec_lean", False)
    if lean is False or (lean is not None and lean.dtype != model.dtype):
        return build(model, kernel_cache)
    return cast("LeanDecoder | None", lean)
