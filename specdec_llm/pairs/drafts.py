"""Draft models that share the target's tensors: target layers with the target's embedding,
norm and head (``shared_draft``, a frequency-ranked ``SubsetHead``), distilled draft
directories, the target's own quantized copy; and how a draft names its target
(``reference``, ``fingerprint``)."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

import torch

from ..engine import kernels
from ..settings import get_settings
from .gguf import cached_gguf_blocks, local_ref
from .spec import DRAFT_META, SHARED_TENSORS, VOCAB_SUBSET, PairError, PairSpec, quantization_scheme

REFERENCE = "_specdec_reference"  # load_pair keeps the target's reference (as the pair names it) on the model


def reference(model) -> str:
    """How a draft's metadata names its target: the pair's reference (``pkg:...``, a hub id,
    a path) where ``load_pair`` loaded it, else the model's own name; never a cache path."""
    return model.__dict__.get(REFERENCE) or getattr(model.config, "_name_or_path", "") or model.config.model_type


def fingerprint(model) -> str:
    """Identity of a model's weights: tensor names and shapes plus the embedding's values."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(tensor.shape)};".encode())
    emb = model.get_input_embeddings().weight
    h.update(emb[: min(512, emb.shape[0])].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class SubsetHead(torch.nn.Module):
    """A draft LM head over a frequency-ranked subset of the vocabulary (as FR-Spec and
    EAGLE-3 do): the target head's rows for ``ids`` only, so a draft step costs a fraction of
    a full-vocabulary head. Other tokens get logit -inf: the draft never proposes them, and
    verification stays exact over the whole vocabulary. The rows are a copy made at load, in
    ``dtype`` (default: the full head's; a pair's ``draft_vocab`` head stays fp32: in bf16 it
    measured no faster for the 0.5B Qwen draft, 10.3 vs 10.0 tok/s, bench_engine.py)."""

    linear_method = "subset_logits"  # engine/kernels.py gives it the fastest matmul kernel, as for a Linear

    def __init__(self, full: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype | None = None):
        super().__init__()
        weight = full.weight.detach()
        self.vocab = weight.shape[0]
        self.register_buffer("ids", ids.long().to(weight.device), persistent=False)
        self.weight = torch.nn.Parameter(weight[self.ids].to(dtype or weight.dtype).contiguous(), requires_grad=False)

    def subset_logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        sub = self.subset_logits(h.to(self.weight.dtype)).to(h.dtype)
        out = sub.new_full((*sub.shape[:-1], self.vocab), float("-inf"))
        return out.index_copy_(-1, self.ids, sub)


def shared_draft(target, layers: list[int], vocab_subset: torch.Tensor | None = None):
    """A draft made of copies of ``layers`` of the target, sharing the target's embedding,
    final norm, rotary embedding and LM head (the same tensors, held once in memory); with
    ``vocab_subset`` (token ids) its head covers those tokens only (SubsetHead)."""
    base = getattr(target, "model", None)
    if base is None or not hasattr(base, "layers"):
        raise PairError(f"shared-tensor drafts need a Llama-style model (model.layers); got {type(target).__name__}")
    n = len(base.layers)
    if not layers or any(not 0 <= i < n for i in layers):
        raise PairError(f"draft layers {layers} out of range: the target has layers 0..{n - 1}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    with torch.device("meta"):
        draft = type(target)(config)
    draft.model.embed_tokens = base.embed_tokens
    draft.model.norm = base.norm
    draft.model.rotary_emb = base.rotary_emb
    draft.lm_head = target.lm_head if vocab_subset is None else SubsetHead(target.lm_head, vocab_subset)
    draft.model.layers = torch.nn.ModuleList(copy.deepcopy(base.layers[i]) for i in layers)
    kernels.untune(draft.model.layers)  # a tuned target's Linears multiply by its own copies: the draft's are its own
    for new_idx, layer in enumerate(draft.model.layers):
        layer.self_attn.layer_idx = new_idx
    draft.generation_config = target.generation_config
    for p in draft.parameters():
        p.requires_grad_(False)
    return draft.eval()


def refuse_other_target(meta: dict, path: Path, target_fp: str, what: str, made: str, fix: str) -> None:
    """A PairError unless the draft directory's ``meta`` names this target's fingerprint."""
    if meta["target_fingerprint"] != target_fp:
        raise PairError(
            f"{what} {path} was {made} for target {meta['target_fingerprint']} "
            f"({meta.get('target', '?')}); this target is {target_fp}. Use the draft with its own target or {fix}."
        )


def load_draft_dir(path: Path, target, target_fp: str):
    """Load a distilled draft directory against ``target``; refuse a different target."""
    from safetensors.torch import load_file

    meta = json.loads((path / DRAFT_META).read_text())
    refuse_other_target(meta, path, target_fp, "draft", "distilled", "distil a new one (specdec-llm distill)")
    own = load_file(str(path / "draft.safetensors"))
    draft = shared_draft(target, meta["init_layers"], own.pop(VOCAB_SUBSET, None))
    dtype = next(target.parameters()).dtype
    missing = draft.load_state_dict({k: v.to(dtype) for k, v in own.items()}, strict=False)
    bad = [k for k in missing.missing_keys if not any(k.startswith(s) for s in SHARED_TENSORS)]
    if bad or missing.unexpected_keys:
        raise PairError(
            f"draft {path}: tensors do not fit the target (missing {bad[:3]}, unexpected {missing.unexpected_keys[:3]})"
        )
    return draft, meta


def quantized_draft(spec: PairSpec, target, tokenizer=None):
    """The target's own weights quantized (``draft = "quantized:SCHEME"``); for a GGUF target
    at int4, built from the file's own Q4_0/Q4_1/Q4_K blocks, so its weights are the target's."""
    scheme = quantization_scheme(spec.draft, f"pair {spec.name}")
    return quantized_model(spec, target, spec.target, scheme, tokenizer, target)


def quantized_draft_model(spec: PairSpec, draft, tokenizer=None):
    """A draft model of its own held quantized (``draft_quantize``): the same, from its file."""
    model, info = quantized_model(spec, draft, spec.draft, spec.draft_quantize, tokenizer, None)
    model.quantization["of"] = "draft"  # (not the target's weights: registry picks ModelDrafter)
    return model, {**info, "kind": "model"}


def quantized_model(spec: PairSpec, model, ref: str, scheme: str, tokenizer, target):
    """``model`` with its Linear weights quantized (``scheme``), from its GGUF file's int4 blocks
    where it has them; its head over ``draft_vocab`` tokens when the pair says so."""
    from ..engine.quant import model_bytes, quantized_copy

    logging.getLogger("specdec_llm.load").info(f"quantizing {ref} into the draft ({scheme})")
    blocks: Mapping = {}
    ref = local_ref(ref)
    if scheme == "int4" and ref.endswith(".gguf"):
        blocks = cached_gguf_blocks(Path(ref).expanduser(), model, spec.trust_remote_code)
    try:
        cache = get_settings().cache_dir
        draft = quantized_copy(  # (its body measured on this machine: quant.BODIES)
            model,
            scheme,
            blocks=blocks,
            kernel_cache=cache / "kernels.json",
            packed_cache=cache / "drafts",
            body="auto",
        )
    except ValueError as e:  # a scheme this device cannot run
        raise PairError(f"pair {spec.name}: {e}") from None
    if spec.draft_vocab:
        ids = vocab_subset(tokenizer, spec.draft_vocab, model.config.vocab_size)
        head = SubsetHead(model.get_output_embeddings(), ids)  # (in the model's dtype: the pair's choice)
        draft.set_output_embeddings(head)
        dtype = str(head.weight.dtype).removeprefix("torch.")
        draft.quantization["head"] = f"subset: {len(ids)} of {model.config.vocab_size} tokens ({dtype})"
    info = {"kind": "quantized", **draft.quantization, "draft_bytes": model_bytes(draft, target)}
    if target is not None:
        info["target_bytes"] = model_bytes(target)
    return draft, info


def vocab_subset(tokenizer, n: int, vocab_size: int):
    """The ``n`` token ids most frequent in the bundled text sample (``drafts/vocab_sample.txt.gz``:
    self-instruct's seed prompts and SmolLM2-135M-Instruct's greedy answers to the distillation
    prompts) under ``tokenizer``, plus every special token (so a draft can end a turn), topped up
    in the tokenizer's own order when the sample has fewer distinct tokens, sorted;
    cached per tokenizer in the cache folder (a tokenizer pass over 1 MB of text, once)."""
    import gzip
    from collections import Counter

    vocab = tokenizer.get_vocab()
    key = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:12]
    cache = get_settings().cache_dir / "models" / f"vocab-subset-2-{key}-{n}.json"
    if cache.is_file():
        return torch.tensor(json.loads(cache.read_text()))
    sample = resources.files("specdec_llm").joinpath("drafts/vocab_sample.txt.gz").read_bytes()
    text = gzip.decompress(sample).decode("utf-8")
    counts = Counter(t for ids in tokenizer(text.split("\n\n"), add_special_tokens=False)["input_ids"] for t in ids)
    special = {int(t) for t in tokenizer.all_special_ids}
    keep = {t for t in special | {t for t, _ in counts.most_common(max(0, n - len(special)))} if 0 <= t < vocab_size}
    # the sample holds fewer distinct tokens than a large vocabulary has (Gemma's 262k: ~11k):
    # the rest in the tokenizer's own order (BPE merge order, a proxy for frequency)
    ids = sorted(keep | set([t for t in range(vocab_size) if t not in keep][: max(0, n - len(keep))]))
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(ids))
    tmp.replace(cache)
    return torch.tensor(ids)
