"""Loading a pair: its target and tokenizer (a pair's named chat template where the
tokenizer has none), its draft by kind, the vocabulary check, torch's threads."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine import SpeculativeDecoder, hf
from ..engine.mapped import mapped_tensors
from ..engine.ragged import unservable
from ..settings import get_settings
from .drafts import REFERENCE, fingerprint, load_draft_dir, quantized_draft, quantized_draft_model, shared_draft
from .eagle_draft import load_eagle_dir
from .gguf import gguf_file, resolve
from .spec import (
    CHAT_TEMPLATES,
    CHAT_TURN_ENDS,
    DRAFT_META,
    PairError,
    PairSpec,
    check_pair_device,
    draft_dir,
    get_spec,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def use_threads(threads: int | None = None) -> None:
    """torch's intra-op threads for this process: ``threads``, else ``SPECDEC_THREADS``;
    neither: torch's own default. The one thread setup (CLI commands, workers, LangChain)."""
    threads = threads or get_settings().threads
    if threads:
        torch.set_num_threads(threads)


def quiet_loading() -> None:
    """No per-tensor progress bars or info logs from transformers while models load
    (for command-line output; a library user keeps transformers' own settings)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def stage(message: str) -> None:
    """A stage of a load that takes a while (assembling, converting, reading, quantizing,
    tuning), logged to ``specdec_llm.load``: the CLI prints it, a worker's log shows it."""
    logging.getLogger("specdec_llm.load").info(message)


def read_weights(src: str, dtype: str):
    """The model in the local directory ``src``, its safetensors mapped a tensor at a time
    (``mapped_tensors``), converted to ``dtype`` a tensor at a time; None where this does not
    apply (another layout, a model that needs its own code)."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    folder = Path(src)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [folder / "model.safetensors"]
    if not folder.is_dir() or not all(f.is_file() for f in files):
        return None
    config = AutoConfig.from_pretrained(src)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None or getattr(config, "auto_map", None):
        return None
    stage(f"reading {sum(f.stat().st_size for f in files) / 1e9:.1f} GB of weights ({dtype}) from {folder.name}")
    state = {}
    for file in files:
        for key, t in mapped_tensors(file):
            state[key] = t.to(DTYPES[dtype]) if t.is_floating_point() else t
    model = cls.from_pretrained(None, config=config, state_dict=state, dtype=DTYPES[dtype])
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(src)
    return model


def load_model(ref: str, dtype: str, device: str, trust_remote_code: bool = False, pair: str = "NAME"):
    from transformers import AutoModelForCausalLM

    src = resolve(ref, trust_remote_code)
    try:
        model = read_weights(src, dtype) if device == "cpu" and Path(src).is_dir() else None
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(
                src, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, local_files_only=Path(src).exists()
            )
    except OSError as e:
        raise PairError(f"cannot load model {ref!r}: {e}") from e
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise PairError(remote_code_refused(ref, pair)) from None
    return model.to(device).eval()


def remote_code_refused(ref: str, pair: str = "NAME") -> str:
    """Why a model that needs its repository's own Python code was not loaded, and how to allow it."""
    return (
        f"model {ref!r} needs custom code from its repository (its config's auto_map), and repository "
        "code is never run unless the pair allows it; after reading that code, set "
        f"`trust_remote_code = true` under the pair's [pairs.{pair}] entry in your pairs file "
        "(SPECDEC_CONFIG_FILE)"
    )


def load_tokenizer(ref: str, trust_remote_code: bool = False, pair: str = "NAME"):
    """The tokenizer of model ``ref``; one that needs its repository's code, not allowed, is
    the same PairError as such a model (transformers' ValueError otherwise)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(resolve(ref, trust_remote_code), trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise PairError(remote_code_refused(ref, pair)) from None


@dataclass
class Pair:
    spec: PairSpec
    target: object
    draft: object | None
    tokenizer: object
    vocab_size: int
    target_fingerprint: str
    draft_info: dict = field(default_factory=dict)

    def held_bytes(self) -> int:
        """The bytes of the weights this pair holds: the target's, and the draft's own (a
        tensor shared with the target once; packed kernel weights included)."""
        from ..engine.quant import model_bytes

        return model_bytes(self.target) + (model_bytes(self.draft, self.target) if self.draft is not None else 0)

    def decoder(self) -> SpeculativeDecoder:
        try:
            return SpeculativeDecoder(
                self.target,
                self.draft,
                self.tokenizer,
                drafters=self.spec.drafter_names(),
                vocab_size=self.vocab_size,
                default_k=self.spec.k,
                kernel_cache=get_settings().cache_dir / "kernels.json",
                compile_draft=self.spec.compile_draft,
                target_file=gguf_file(self.spec.target),
                draft_file=gguf_file(self.spec.draft),
            )
        except ValueError as e:  # a drafter this pair lists cannot run here (llamacpp without its package)
            raise PairError(f"pair {self.spec.name!r}: {e}") from None


def draft_model_unused(spec: PairSpec) -> bool:
    """Whether none of the pair's drafters runs its draft as a model here (they list no draft
    kinds: ``llamacpp`` decoding the draft's GGUF itself): then the draft is not loaded."""
    from ..engine.drafting import registry

    table = registry.registered()
    return spec.draft is not None and all(not table[n].draft_kinds for n in spec.drafter_names() if n in table)


def check_vocab(target_ref: str, tok_t, draft_ref: str, tok_d, vt: int, vd: int) -> int:
    """The shared vocabulary size; a clear error if the tokenizers disagree on it."""
    shared = min(vt, vd, len(tok_t), len(tok_d))
    inv_t = {i: s for s, i in tok_t.get_vocab().items() if i < shared}
    inv_d = {i: s for s, i in tok_d.get_vocab().items() if i < shared}
    if inv_t != inv_d:
        diff = next((i for i in sorted(inv_t) if inv_t.get(i) != inv_d.get(i)), None)
        raise PairError(
            f"vocabulary mismatch: target {target_ref} and draft {draft_ref} use different tokenizers "
            f"(token id {diff}: {inv_t.get(diff)!r} vs {inv_d.get(diff)!r}); a draft must share the target's vocabulary"
        )
    return shared


def _stop_at_turn_end(target, tokenizer, token: str | None) -> None:
    """Decoding stops at the end of the model's turn too (an instruct model's generation
    config lists it; a base model's does not)."""
    if token is None or token not in tokenizer.get_vocab():
        return
    eos = target.generation_config.eos_token_id
    ids = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    end = tokenizer.convert_tokens_to_ids(token)
    if end not in ids:
        target.generation_config.eos_token_id = [*ids, end]


def load_pair(name_or_spec: str | PairSpec) -> Pair:
    # a first load converts a GGUF target and reads its int4 blocks: the file parsed once for both
    with hf.gguf_parsed_once():
        return _load_pair(name_or_spec)


def _load_pair(name_or_spec: str | PairSpec) -> Pair:
    spec = get_spec(name_or_spec) if isinstance(name_or_spec, str) else name_or_spec
    check_pair_device(spec)
    if spec.dtype not in DTYPES:
        raise PairError(f"pair {spec.name}: dtype {spec.dtype!r} unknown; use one of {', '.join(DTYPES)}")
    target = load_model(spec.target, spec.dtype, spec.device, spec.trust_remote_code, pair=spec.name)
    target.__dict__[REFERENCE] = spec.target
    tokenizer = load_tokenizer(spec.target, spec.trust_remote_code, pair=spec.name)
    if spec.chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATES.get(spec.chat_template, spec.chat_template)
        _stop_at_turn_end(target, tokenizer, CHAT_TURN_ENDS.get(spec.chat_template))
    t_fp = fingerprint(target)
    vocab = min(target.config.vocab_size, len(tokenizer))
    draft, info = None, {}
    if spec.draft is None:
        info = {"kind": "none"}
    elif draft_model_unused(spec):
        info = {"kind": "file", "file": spec.draft}  # (run by its drafter: llama.cpp checks its vocabulary)
    elif spec.quantized:
        draft, info = quantized_draft(spec, target, tokenizer)
    elif spec.draft.startswith("layers:"):
        layers = [int(x) for x in spec.draft.removeprefix("layers:").split(",")]
        draft = shared_draft(target, layers)
        info = {"kind": "placeholder", "init_layers": layers, "trained": False}
    else:
        ref = spec.draft
        if ref.startswith("pkg:") or (Path(ref).expanduser() / DRAFT_META).exists():
            path = draft_dir(ref)
            if json.loads((path / DRAFT_META).read_text()).get("kind") == "eagle":
                draft, meta = load_eagle_dir(path, target, t_fp)
            else:
                draft, meta = load_draft_dir(path, target, t_fp)
            info = {"kind": meta.get("kind", "distilled"), **{k: meta[k] for k in meta if k != "target_fingerprint"}}
        else:
            draft = load_model(ref, spec.dtype, spec.device, spec.trust_remote_code, pair=spec.name)
            tok_d = load_tokenizer(ref, spec.trust_remote_code)
            vocab = check_vocab(spec.target, tokenizer, ref, tok_d, target.config.vocab_size, draft.config.vocab_size)
            info = {"kind": "model", "fingerprint": fingerprint(draft)}
            if spec.draft_quantize:  # (its float Linear weights go with the model they were in)
                draft, quantized = quantized_draft_model(spec, draft, tokenizer)
                info.update(quantized, kind="model")
    refuse_unservable(spec, "target", target)
    if info.get("kind") == "model":  # a model of its own (the other drafts are the target's layers)
        refuse_unservable(spec, "draft", draft)
    return Pair(spec, target, draft, tokenizer, vocab, t_fp, info)


def refuse_unservable(spec: PairSpec, what: str, model) -> None:
    """A PairError at load for a model this engine cannot decode, naming its family and why."""
    why = unservable(model)
    if why:
        family = getattr(model.config, "model_type", type(model).__name__)
        raise PairError(
            f"pair {spec.name}: the {what} ({family}, {type(model).__name__}) cannot be decoded by this engine: {why}. "
            "It needs a causal LM whose cache holds attention keys and values (Llama, Qwen, Mistral, Gemma, GPT-2, "
            "... ; docs/pairs.md#families-supported); use another model for it"
        )
