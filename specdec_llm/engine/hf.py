"""The one place for transformers version quirks (the forward's cache argument).

Tested with transformers 5.20-5.39 (see pyproject). transformers 5.24 renamed the
forward argument ``past_key_values=`` to ``cache=`` (old name deprecated until 5.40).
Everything else in the engine calls these helpers.

It also holds what the engine changes in transformers' machinery, each measured on this
CPU: KV-cache layers that grow in place (``GrowingLayer``), an attention function that keeps
grouped KV heads grouped under a mask, and per-row-count matmul kernels (``prepare``,
kernels.py).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .lean import runner

_CACHE_KWARG: dict[type[torch.nn.Module], str] = {}


def cache_kwarg(model_cls: type[torch.nn.Module]) -> str:
    """The forward's name for the KV cache argument, per model class."""
    if model_cls not in _CACHE_KWARG:
        params = inspect.signature(model_cls.forward).parameters
        _CACHE_KWARG[model_cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARG[model_cls]


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` / ``values`` are views ``[:rows, :, :width]`` of
    zero-filled buffers with spare columns, so appending a token writes the new column only.

    The stock layer copies the whole cache on every token (``torch.cat``); at batch 16 that
    copy was 39% of a decode step on this CPU. engine/ragged.py moves, adds and drops rows
    inside the same buffers. Spare cells hold zeros or stale finite values: the masks never
    let a row see them, and a masked key must not hold NaN (0 * NaN would leak).
    """

    kbuf: torch.Tensor | None = None
    vbuf: torch.Tensor | None = None
    # views of kbuf / vbuf once reserved (read them only then; transformers' base says "| None")
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def bufs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The reserved buffers (``kbuf``, ``vbuf``)."""
        assert self.kbuf is not None and self.vbuf is not None
        return self.kbuf, self.vbuf

    @property
    def rows(self) -> int:
        return self.keys.shape[0] if self.kbuf is not None else 0

    @property
    def width(self) -> int:
        return self.keys.shape[2] if self.kbuf is not None else 0

    def view(self, rows: int, width: int) -> None:
        kbuf, vbuf = self.bufs
        self.keys, self.values = kbuf[:rows, :, :width], vbuf[:rows, :, :width]

    def reserve(
        self, rows: int, width: int, like_k: torch.Tensor, like_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for ``rows`` x ``width`` (columns grow by half); the live region is kept. Returns the buffers."""
        if not self.is_initialized:
            self.lazy_initialization(like_k, like_v)
        old = self.kbuf
        if old is not None and rows <= old.shape[0] and width <= old.shape[2]:
            return self.bufs
        r = max(rows, old.shape[0] if old is not None else 0)
        w = max(width + max(64, width // 2), old.shape[2] if old is not None else 0)
        kbuf = like_k.new_zeros(r, like_k.shape[1], w, like_k.shape[3])
        vbuf = like_v.new_zeros(r, like_v.shape[1], w, like_v.shape[3])
        live_r, live_w = self.rows, self.width
        if live_r and live_w:
            kbuf[:live_r, :, :live_w] = self.keys
            vbuf[:live_r, :, :live_w] = self.values
        self.kbuf, self.vbuf = kbuf, vbuf
        self.view(live_r, live_w)
        return kbuf, vbuf

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, n = key_states.shape[0], self.width
        m = n + key_states.shape[2]
        kbuf, vbuf = self.reserve(rows, m, key_states, value_states)
        kbuf[:rows, :, n:m] = key_states
        vbuf[:rows, :, n:m] = value_states
        self.view(rows, m)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        if self.kbuf is not None and tokens_to_remove < 0:
            self.view(self.rows, max(0, self.width + tokens_to_remove))

    def reset(self) -> None:
        self.kbuf = self.vbuf = None
        super().reset()


COMPILED_STEP = "_specdec_step"  # where compiled.attach keeps a model's compiled one-token step


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """A DynamicCache of ``GrowingLayer``s, one per decoder layer. A sliding-window layer keeps
    every column too: its window is a mask (``attention.Attention.masks``), so rollback and the ragged
    batch's holes work alike for every layer."""
    cache = DynamicCache(config=model.config)
    cache.layers = [GrowingLayer() for _ in cache.layers]  # type: ignore[no-untyped-call]  # transformers' __init__
    return cache


# -- making a loaded model fast for this engine ----------------------------------------------
ATTENTION = "specdec_sdpa"  # lean.ATTENTIONS names it too (lean.py cannot import this module)


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' sdpa, except that on CPU a masked multi-token query (a verification or a
    ragged chunk) keeps grouped KV heads in the kernel (``enable_gqa``) instead of copying them
    per query head (``repeat_kv``): 6x less time in attention at batch 16 here, same values."""
    if (
        query.device.type == "cpu"
        and attention_mask is not None
        and query.shape[2] > 1
        and getattr(module, "num_key_value_groups", 1) > 1
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
    ):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


@torch.no_grad()
def prepare(model: PreTrainedModel, kernel_cache: Path | None = None) -> dict[str, Any]:
    """Tune a loaded model for this engine (idempotent; the same math, faster kernels).

    - sdpa attention becomes ``_attention`` (grouped KV heads stay grouped on CPU).
    - On CPU, every Linear (and a module declaring ``linear_method``, the draft's
      SubsetHead) calls the matmul kernel measured fastest on this machine for its row
      count (kernels.py): one-token steps and k-token verifications each get theirs.
      ``kernel_cache``: a JSON file keeping those timings per machine. Returns the choice.
    - A Llama-family model gets its lean forward first (lean.py: q/k/v and gate/up fused in
      place of their own weights, tuned too).
    """
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(ATTENTION)
    if model.device.type != "cpu":
        return {}
    from .kernels import tune

    runner(model, kernel_cache)  # first: its fused projections replace the siblings, tuned with the same cache
    return tune(model, kernel_cache)  # the other Linears (those tuned already are skipped)


def sync(model: PreTrainedModel) -> None:
    """Wait for queued GPU work (for timings); a no-op on CPU."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


# -- batches of rows (engine/ragged.py) -------------------------------------------------------
def layers(cache: DynamicCache) -> list[GrowingLayer]:
    """The cache's per-layer buffers (``new_cache`` made them)."""
    return cast(list[GrowingLayer], cache.layers)


@torch.inference_mode()
def forward_rows(
    model: PreTrainedModel,
    ids: torch.Tensor,
    cache: DynamicCache,
    keep: int,
    mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    embeds: torch.Tensor | None = None,
    features: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``ids`` [B, W] on top of ``cache``; float32 logits of the last ``keep`` columns [B, keep, V].

    ``mask`` is a boolean [B, 1, W, L + W] (True = may attend), ``positions`` [B, W]; both
    None when every cached column is valid and no row is padded (plain causal attention).
    ``embeds`` [B, W, H], when given, are the inputs instead of ``ids``' embeddings (a
    feature-level draft's). ``features``: decoder layers whose outputs (the residual stream
    after the layer, before the final norm) come back too, concatenated, float32 [B, W, n*H]
    (None when no layer is asked).
    """
    step = model.__dict__.get(COMPILED_STEP)  # a compiled one-token draft step (compiled.py), where kept
    lean = runner(model)
    if step is not None and step.lean is lean and step.takes(ids, keep, embeds, features):  # (not after a cast)
        return step(ids, cache, mask, positions), None
    if lean is not None:  # the same math without transformers' module machinery (lean.py)
        return lean(ids.to(model.device), cache, keep, mask, positions, embeds, features)
    kwargs: dict[str, Any] = {cache_kwarg(type(model)): cache}
    if mask is not None:
        if model.config._attn_implementation == "eager":  # eager adds a float mask; sdpa takes booleans
            mask = _additive(mask, model.dtype)
        kwargs.update(attention_mask=mask, position_ids=positions)
    if embeds is not None:
        kwargs["inputs_embeds"] = embeds.to(model.device, model.dtype)
    else:
        kwargs["input_ids"] = ids.to(model.device)
    with layer_outputs(model, features) as outs:
        out = model(use_cache=True, logits_to_keep=keep, **kwargs)
    logits: torch.Tensor = out.logits
    return logits.float(), (torch.cat(outs, -1).float() if features else None)


def uses_alibi(model: PreTrainedModel) -> bool:
    """Whether the model's position bias is ALiBi's (Bloom), built from a mask of valid columns."""
    return getattr(model.get_decoder(), "build_alibi_tensor", None) is not None


def alibi_from_masks(model: PreTrainedModel) -> None:
    """ALiBi families (Bloom) build their position bias from a 2-D mask of valid key columns
    (each key's position is the count of valid columns before it) and refuse the boolean
    [B, 1, W, L + W] mask the ragged cache passes. The bias of a key depends on its position
    only (softmax ignores a shift per query), and the block's last query sees every valid key
    of its row, holes and padding excluded: its mask row is that 2-D mask. Installed once per
    model, when its first ragged cache is made."""
    decoder = model.get_decoder()
    build = getattr(decoder, "build_alibi_tensor", None)
    if build is None or "build_alibi_tensor" in decoder.__dict__:
        return

    def from_any_mask(attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        if attention_mask.dim() == 4:
            last = attention_mask[:, 0, -1, :]
            attention_mask = (last if last.dtype == torch.bool else last == 0).long()
        return cast(torch.Tensor, build(attention_mask, num_heads, dtype=dtype))

    decoder.build_alibi_tensor = from_any_mask


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The decoder's layers, found through transformers' own accessor (``get_decoder()``:
    ``model.layers`` in Llama-style families, ``transformer.h`` in GPT-2 and Falcon,
    ``gpt_neox.layers``, ``model.decoder.layers`` in OPT): the ModuleList of
    ``num_hidden_layers`` blocks inside it."""
    n = int(model.config.num_hidden_layers)
    found = [m for m in model.get_decoder().modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    if not found:
        raise NotImplementedError(f"{type(model).__name__}: no list of {n} decoder layers under get_decoder()")
    return found[0]


def _additive(mask: Any, dtype: torch.dtype) -> Any:
    """A boolean mask (or {kind: mask}) as the float one eager attention adds."""
    if isinstance(mask, dict):
        return {kind: _additive(m, dtype) for kind, m in mask.items()}
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


@contextmanager
def layer_outputs(model: PreTrainedModel, layers: tuple[int, ...]) -> Iterator[list[torch.Tensor]]:
    """The outputs of decoder ``layers`` (in that order) of the forwards run inside, caught
    by forward hooks: the residual stream after each layer, before the final norm."""
    outs: list[torch.Tensor] = []
    found: dict[int, torch.Tensor] = {}

    def hook(i: int) -> Callable[..., None]:
        def grab(module: torch.nn.Module, args: Any, output: Any) -> None:
            found[i] = output[0] if isinstance(output, tuple) else output

        return grab

    if not layers:
        yield outs
        return
    blocks = decoder_layers(model)
    handles = [blocks[i].register_forward_hook(hook(i)) for i in dict.fromkeys(layers)]
    try:
        yield outs
        outs += [found[i] for i in layers]
    finally:
        for h in handles:
            h.remove()


def weights_fingerprint(model: PreTrainedModel) -> str:
    """Identity of a model's weights: tensor names and shapes plus the embedding's first rows."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    emb = cast(torch.Tensor, model.get_input_embeddings().weight)
    h.update(emb[: min(512, emb.shape[0])].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


_GGUF_LOCK = threading.RLock()
_GGUF_READERS: dict[tuple[str, str], Any] = {}  # the open blocks' parses: nested blocks and threads share them
_GGUF_SAVED: list[Any] = []  # gguf's own functions while a block is open
_GGUF_BLOCKS = [0]  # open gguf_parsed_once blocks in this process


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, transformers' GGUF loading parses each file once, builds gguf's
    tensor-name map once per architecture and dequantizes in large chunks on every core.
    transformers 5.x parses the file's metadata on every call (config, tokenizer, weights:
    three parses, ~4.5 s each for SmolLM2's 49k-token vocabulary) and builds the name map once
    per module (~400 times, 5.7 s). Each parse slices a plain view of the file's mapping
    (``_plain_reader``), and each tensor is dequantized by gguf's own block kernels over
    chunks on a thread per core (``_dequantize``). All of these are looked up as ``gguf.X`` at
    call time. Blocks nest and may run in several threads: the first to open installs these,
    the last to close restores gguf's own, and they share the parses. A parse is kept until the
    last block ends or ``gguf_done`` lets it go (a 151k-token vocabulary's is 0.5 GB); the
    pages it read are unmapped at every block's end."""
    import gguf

    module: Any = gguf  # (its attributes replaced while a block is open)
    with _GGUF_LOCK:
        if not _GGUF_BLOCKS[0]:
            _GGUF_SAVED[:] = gguf.GGUFReader, gguf.get_tensor_name_map, gguf.dequantize
            module.GGUFReader, module.get_tensor_name_map = _parsed, functools.lru_cache(maxsize=None)(_GGUF_SAVED[1])
            module.dequantize = functools.partial(_dequantize, _GGUF_SAVED[2])
        _GGUF_BLOCKS[0] += 1
    try:
        yield
    finally:
        with _GGUF_LOCK:
            _GGUF_BLOCKS[0] -= 1
            for r in _GGUF_READERS.values():
                drop_gguf_pages(r)
            if not _GGUF_BLOCKS[0]:
                module.GGUFReader, module.get_tensor_name_map, module.dequantize = _GGUF_SAVED
                _GGUF_READERS.clear()


def _parsed(path: Any, mode: Any = "r") -> Any:
    """``gguf.GGUFReader`` while a block is open: each file parsed once."""
    key = (str(path), mode)
    with _GGUF_LOCK:
        if key not in _GGUF_READERS:
            _GGUF_READERS[key] = _plain_reader()(path, mode)
        return _GGUF_READERS[key]


@functools.cache
def _plain_reader() -> type:
    """gguf's reader slicing a plain ndarray view of its numpy.memmap (kept as ``mapped``): the
    same parse and tensors, without numpy.memmap's cost per slice (a 151k-token vocabulary is
    ~760k slices: Qwen2.5's parse 6.6 -> 2.0 s, and transformers' reading of its fields
    1.5 -> 0.8 s)."""
    import numpy as np
    from gguf.gguf_reader import GGUFReader  # (not ``gguf.GGUFReader``, which a block replaces)

    class PlainReader(GGUFReader):
        @property
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, value: Any) -> None:
            self.mapped, self._plain = value, value.view(np.ndarray)

    return PlainReader


DEQUANTIZE_CHUNK = 1 << 13  # blocks per call of gguf's kernel (2-9 MB of float32 out)


def _dequantize(fallback: Callable[[Any, Any], Any], data: Any, qtype: Any) -> Any:
    """``gguf.dequantize``'s result, from gguf's own kernel for the type (``dequantize_blocks``,
    so the values are its own) over chunks of blocks on a thread per core: numpy releases the
    GIL in its loops, and gguf's own driver splits a tensor into 16-row groups on one core
    (Qwen2.5 1.5B's head, Q6_K: 5.5 -> 1.6 s on 2 cores)."""
    from concurrent.futures import ThreadPoolExecutor

    import gguf
    import numpy as np

    kernel = getattr(gguf.quants, qtype.name, None)
    if kernel is None or qtype.name in ("F32", "F16"):
        return fallback(data, qtype)  # (a view or a cast)
    kernel.init_grid()  # (the types with a lookup grid build it once, as gguf's driver does)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.asarray(data).view(np.ndarray).reshape(-1, size)
    out = np.empty((blocks.shape[0], block), np.float32)

    def chunk(start: int) -> None:
        out[start : start + DEQUANTIZE_CHUNK] = kernel.dequantize_blocks(blocks[start : start + DEQUANTIZE_CHUNK])

    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        list(pool.map(chunk, range(0, len(blocks), DEQUANTIZE_CHUNK)))
    return out.reshape(gguf.quants.quant_shape_from_byte_shape(data.shape, qtype))


def gguf_done(path: Any) -> None:
    """``path``'s last reader in a load is done: the open ``gguf_parsed_once`` blocks forget its
    parse, and the pages it read are unmapped."""
    with _GGUF_LOCK:
        for key in [key for key in _GGUF_READERS if key[0] == str(path)]:
            drop_gguf_pages(_GGUF_READERS.pop(key))


def drop_gguf_pages(reader: Any) -> None:
    """Unmap the pages of a GGUF file that ``reader`` (a ``_plain_reader`` parse) has read: they stay in
    the page cache and a later read maps them again, but the process no longer holds them
    (a 1.5B model's file is 1.1 GB of resident memory once its weights were converted)."""
    import mmap

    mapped = getattr(getattr(reader, "mapped", None), "_mmap", None)  # numpy.memmap's own mmap
    if isinstance(mapped, mmap.mmap) and not mapped.closed:
        mapped.madvise(mmap.MADV_DONTNEED)
