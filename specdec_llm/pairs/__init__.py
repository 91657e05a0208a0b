"""Pairs: a target and a draft model, named, loaded once, vocabulary-checked.

A model reference is any of:
- a local Hugging Face model directory, or a hub id (offline machines need a local dir);
- a ``.gguf`` file, or ``pkg:DIST/FILE.gguf`` for a GGUF shipped inside an installed
  Python distribution (the bundled SmolLM2 target). GGUF files are dequantized once and
  converted into a safetensors cache (``SPECDEC_CACHE_DIR``), so later loads take ~1 s;
- for drafts only, ``layers:0,1`` (a placeholder built from those target layers) or a
  directory written by ``specdec-llm distill`` (``specdec_draft.json`` inside): its own
  layers in safetensors; the embedding, final norm and LM head are the target's own
  tensors, shared, not copied.

The registry merges built-in pairs (``builtin_pairs.toml``), the user's TOML file
(``SPECDEC_CONFIG_FILE``) and ``SPECDEC_DEVICE`` / ``SPECDEC_DTYPE`` overrides.

One module per job: ``spec`` (the registry, draft references), ``gguf`` (model files,
GGUF caches), ``drafts`` (shared-tensor, distilled and quantized drafts), ``eagle_draft``
(EAGLE drafts) and ``loading`` (a pair's models, tokenizer, vocabulary check, threads).
Callers import from here.
"""

import importlib
from typing import TYPE_CHECKING, Any

from .spec import (
    CHAT_TEMPLATES,
    CHAT_TURN_ENDS,
    DRAFT_META,
    QUANTIZED,
    SHARED_TENSORS,
    VOCAB_SUBSET,
    PairError,
    PairSpec,
    check_pair_device,
    draft_dir,
    draft_kind,
    get_spec,
    quantization_scheme,
    read_toml,
    registry,
)

if TYPE_CHECKING:
    from .drafts import (
        REFERENCE,
        SubsetHead,
        fingerprint,
        load_draft_dir,
        quantized_draft,
        reference,
        refuse_other_target,
        shared_draft,
        vocab_subset,
    )
    from .eagle_draft import KIND, OWN_PREFIXES, EagleDraft, build_eagle, default_feature_layers, load_eagle_dir
    from .gguf import GGUF_INT4, cached_gguf_blocks, gguf_blocks, gguf_file, local_ref, resolve, tokenizer_only
    from .loading import (
        DTYPES,
        Pair,
        check_vocab,
        load_model,
        load_pair,
        load_tokenizer,
        quiet_loading,
        remote_code_refused,
        use_threads,
    )

# the rest loads torch and transformers (seconds): imported on first use, so that a command that
# only reads the registry (`run`, checking its pair before a worker loads it) starts at once
_LAZY = {
    "drafts": "REFERENCE SubsetHead fingerprint load_draft_dir quantized_draft reference refuse_other_target "
    "shared_draft vocab_subset",
    "eagle_draft": "KIND OWN_PREFIXES EagleDraft build_eagle default_feature_layers load_eagle_dir",
    "gguf": "GGUF_INT4 cached_gguf_blocks gguf_blocks gguf_file local_ref resolve tokenizer_only",
    "loading": "DTYPES Pair check_vocab load_model load_pair load_tokenizer quiet_loading remote_code_refused "
    "use_threads",
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names.split()}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)


__all__ = [
    "CHAT_TEMPLATES",
    "CHAT_TURN_ENDS",
    "DRAFT_META",
    "DTYPES",
    "GGUF_INT4",
    "KIND",
    "OWN_PREFIXES",
    "QUANTIZED",
    "REFERENCE",
    "SHARED_TENSORS",
    "VOCAB_SUBSET",
    "EagleDraft",
    "Pair",
    "PairError",
    "PairSpec",
    "SubsetHead",
    "build_eagle",
    "cached_gguf_blocks",
    "check_pair_device",
    "check_vocab",
    "default_feature_layers",
    "draft_dir",
    "draft_kind",
    "fingerprint",
    "get_spec",
    "gguf_blocks",
    "gguf_file",
    "load_draft_dir",
    "load_eagle_dir",
    "load_model",
    "load_pair",
    "load_tokenizer",
    "local_ref",
    "quantization_scheme",
    "quantized_draft",
    "quiet_loading",
    "read_toml",
    "reference",
    "refuse_other_target",
    "registry",
    "remote_code_refused",
    "resolve",
    "shared_draft",
    "tokenizer_only",
    "use_threads",
    "vocab_subset",
]
