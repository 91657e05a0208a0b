"""The one place for transformers version quirks (forward kwargs, KV-cache cropping).

Tested with transformers 5.20-5.39 (see pyproject). transformers 5.24 renamed the
forward argument ``past_key_values=`` to ``cache=`` (old name deprecated until 5.40) and
``DynamicCache.crop`` takes a negative count of tokens to remove (4.x took the final
absolute length). Everything else in the engine calls these helpers.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch
import transformers
from transformers import DynamicCache

_MAJOR = int(transformers.__version__.split(".")[0])


@lru_cache(maxsize=None)
def _cache_kwarg(model_cls: type) -> str:
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


@torch.inference_mode()
def forward(model, token_ids: list[int], cache: DynamicCache, logits_to_keep: int) -> torch.Tensor:
    """Run ``token_ids`` (one sequence) on top of ``cache``; return float32 logits [logits_to_keep, V]."""
    ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
    kwargs = {_cache_kwarg(type(model)): cache}
    out = model(input_ids=ids, use_cache=True, logits_to_keep=logits_to_keep, **kwargs)
    return out.logits[0].float()


def sync(model) -> None:
    """Wait for queued GPU work (for timings); a no-op on CPU."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of ``cache`` (rollback after a rejection)."""
    current = cache.get_seq_length()
    if length >= current:
        return
    if _MAJOR >= 5:
        cache.crop(length - current)  # negative: tokens to remove
    else:
        cache.crop(length)  # 4.x: absolute length


# -- batches of rows (engine/ragged.py) -------------------------------------------------------
def layers(cache: DynamicCache) -> list:
    """The cache's per-layer objects; each holds ``keys`` / ``values`` [B, heads, L, head_dim]."""
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer":
            raise NotImplementedError(f"batched decoding needs plain DynamicLayer caches, not {type(layer).__name__}")
    return cache.layers


def set_layer(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values


@torch.inference_mode()
def forward_rows(model, ids: torch.Tensor, cache: DynamicCache, keep: int, mask=None, positions=None) -> torch.Tensor:
    """Run ``ids`` [B, W] on top of ``cache``; float32 logits of the last ``keep`` columns [B, keep, V].

    ``mask`` is a boolean [B, 1, W, L + W] (True = may attend), ``positions`` [B, W]; both
    None when every cached column is valid and no row is padded (plain causal attention).
    """
    kwargs = {_cache_kwarg(type(model)): cache}
    if mask is not None:
        if model.config._attn_implementation == "eager":  # eager adds a float mask; sdpa takes booleans
            mask = torch.zeros(mask.shape, dtype=model.dtype, device=mask.device).masked_fill(~mask, torch.finfo(model.dtype).min)
        kwargs.update(attention_mask=mask, position_ids=positions)
    out = model(input_ids=ids.to(model.device), use_cache=True, logits_to_keep=keep, **kwargs)
    return out.logits.float()
