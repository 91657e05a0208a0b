"""Pair specs: the TOML registry (built-in pairs, the user's file, the environment's
overrides), what a pair's ``draft`` reference is, and where a draft directory lives."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from ..engine import RequestError
from ..engine.devices import DEVICE, FORMS, device_problem
from ..engine.types import SCHEMES
from ..errors import SpecDecError
from ..settings import DTYPE_NAMES, Settings, get_settings

DRAFT_META = "specdec_draft.json"
SHARED_TENSORS = ["model.embed_tokens", "model.norm", "lm_head", "model.rotary_emb"]
VOCAB_SUBSET = "vocab_subset"  # in draft.safetensors: token ids of a SubsetHead draft
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
    # a draft model of its own held quantized ("int4", "int8"): from its GGUF's own int4 blocks
    # where the file has them, else re-quantized (engine/quant.py); its outputs stay the target's
    draft_quantize: str | None = None
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
        """Its ``drafters`` list, else the registered defaults for its draft (engine/drafting/registry.py):
        lookup, suffix and (with a draft) model, quantized or eagle."""
        if self.drafters is not None:
            return list(self.drafters)
        from ..engine.drafting import registry as drafter_registry

        return drafter_registry.defaults(self.draft_kind())

    def check_drafter(self, drafter: str) -> None:
        if drafter != "auto" and drafter not in self.drafter_names():
            known = ", ".join(["auto", *self.drafter_names()])
            raise RequestError("drafter", f"unknown drafter {drafter!r} for pair {self.name}; use one of: {known}")


# every key a pair may set and the TOML type it must have: checked before any value is used
# (a string "false" is truthy: it must not reach from_pretrained as trust_remote_code)
PAIR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
KEY_TYPES = {
    "target": "string",
    "draft": "string",
    "dtype": "string",
    "device": "string",
    "k": 'integer or "auto"',
    "drafters": "list of strings",
    "trust_remote_code": "boolean",
    "compile_draft": "boolean",
    "chat_template": "string",
    "draft_vocab": "integer",
    "draft_quantize": "string",
    "description": "string",
}
WORDS = {  # each type as the error says it
    "string": "a string",
    "boolean": "true or false (a TOML boolean, without quotes)",
    "integer": "an integer",
    'integer or "auto"': 'an integer or "auto"',
    "list of strings": 'a list of strings, e.g. ["lookup", "suffix"]',
}


def has_type(value, kind: str) -> bool:
    """Whether a TOML value is of ``kind`` (a value of ``KEY_TYPES``); a boolean is no integer."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return {
        "string": isinstance(value, str),
        "boolean": isinstance(value, bool),
        "integer": is_int,
        'integer or "auto"': is_int or value == "auto",
        "list of strings": isinstance(value, list) and all(isinstance(v, str) for v in value),
    }[kind]


def toml_type(value) -> str:
    """A value's TOML type with its article ("a string", "an integer"), for errors."""
    for kind, types in (
        ("a boolean", bool),
        ("an integer", int),
        ("a float", float),
        ("a string", str),
        ("an array", list),
        ("a table", dict),
    ):
        if isinstance(value, types):
            return kind
    return f"a {type(value).__name__}"


def read_toml(text: str, source: str) -> dict[str, PairSpec]:
    """The pairs of one TOML text (``source`` names it in errors), every key checked."""
    try:
        whole = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PairError(f"{source}: not valid TOML ({e}); fix that line (docs/pairs.md shows the format)") from None
    other = sorted(set(whole) - {"pairs", "files"})
    if other:  # (a [pair.mine] typo was a pair that silently did not exist)
        raise PairError(f"{source}: unknown table or key {other[0]!r}; a pairs file has [pairs.NAME] and [files.NAME]")
    data = whole.get("pairs", {})
    if not isinstance(data, dict):
        raise PairError(f"{source}: 'pairs' must be a table of pairs, e.g. [pairs.my-pair] (docs/pairs.md)")
    known = set(PairSpec.__dataclass_fields__) - {"name", "source"}
    out = {}
    for name, fields in data.items():
        where = f"{source}: pair {name!r}"
        if not PAIR_NAME.fullmatch(name):  # (it names a queue, a file, a command-line argument)
            raise PairError(
                f"{where}: a pair's name is letters, digits, '.', '_' and '-' (starting with a letter or digit)"
            )
        _check_keys(where, name, fields, known)
        _check_drafting(where, fields)
        out[name] = PairSpec(name=name, source=source, **fields)
    return out


def _check_keys(where: str, name: str, fields: object, known: set[str]) -> None:
    """A pair's table: only known keys, a target, and each key of its type (``where`` names the pair in errors)."""
    if not isinstance(fields, dict):
        raise PairError(f"{where} must be a table ([pairs.{name}] with target = ...), not {fields!r}")
    unknown = set(fields) - known
    if unknown:
        raise PairError(f"{where} has unknown keys {sorted(unknown)}; known: {sorted(known)}")
    if "target" not in fields:
        raise PairError(f"{where} needs a 'target' (model dir, hub id or .gguf file)")
    for key, value in fields.items():
        kind = KEY_TYPES.get(key)
        if kind and not has_type(value, kind):
            raise PairError(f"{where}: {key} must be {WORDS[kind]}, not {value!r} ({toml_type(value)})")
    if fields.get("dtype", "float32") not in DTYPE_NAMES:
        raise PairError(f"{where}: dtype {fields['dtype']!r} unknown; use one of {', '.join(DTYPE_NAMES)}")
    if not DEVICE.fullmatch(fields.get("device", "cpu")):
        raise PairError(f"{where}: device {fields['device']!r} is not a device; use {FORMS}")


def _check_refs(where: str, fields: dict) -> None:
    """The target and the draft name something, a ``layers:`` draft its layers, and a chat
    template by name is a known one (a Jinja template has tags: a misspelt name became the text)."""
    for key in ("target", "draft"):
        if key in fields and not fields[key].strip():
            raise PairError(f"{where}: {key} is empty; name a model dir, hub id or .gguf file (or leave draft out)")
    draft = fields.get("draft") or ""
    if draft.startswith("layers:"):
        layers = draft.removeprefix("layers:").split(",")
        if not all(layer.strip().isdigit() for layer in layers):
            raise PairError(f'{where}: draft {draft!r}: name the target\'s layers it keeps, e.g. "layers:0,1,5"')
    template = fields.get("chat_template")
    if template is not None and template not in CHAT_TEMPLATES and not ("{{" in template or "{%" in template):
        raise PairError(
            f"{where}: chat_template {template!r} is no built-in template ({', '.join(CHAT_TEMPLATES)}) "
            "and no Jinja template; name one of those, or write the template"
        )


def _check_drafting(where: str, fields: dict) -> None:
    """A pair's drafting keys agree: k, the draft and its quantization, compile_draft, draft_vocab, drafters."""
    _check_refs(where, fields)
    k = fields.get("k", "auto")
    if k != "auto" and k < 0:
        raise PairError(f'{where}: k must be "auto" or an integer >= 0, not {k!r}')
    draft = fields.get("draft")
    quantized = isinstance(draft, str) and draft.startswith(QUANTIZED)
    if quantized:
        quantization_scheme(draft, where)
    if fields.get("compile_draft", False) and not quantized:
        raise PairError(
            f"{where}: compile_draft must be true or false, and needs "
            f'draft = "quantized:int4" (it compiles the quantized draft\'s step)'
        )
    draft_quantize = fields.get("draft_quantize")
    if draft_quantize is not None:
        quantization_scheme(QUANTIZED + draft_quantize, f"{where}: draft_quantize")
        if draft_kind(draft) != "model":
            raise PairError(
                f"{where}: draft_quantize needs a draft model of its own (draft = a model "
                f'dir, hub id or .gguf); for the target\'s own weights use draft = "quantized:{draft_quantize}"'
            )
    draft_vocab = fields.get("draft_vocab")
    if draft_vocab is not None and not (draft_vocab > 0 and (quantized or draft_quantize)):
        raise PairError(
            f"{where}: draft_vocab must be a positive number of tokens, e.g. 32768, "
            f'and needs draft = "quantized:int4" or draft_quantize (it narrows the quantized draft\'s head)'
        )
    drafters = fields.get("drafters")
    if drafters is not None:
        from ..engine.drafting import registry as drafter_registry

        why = drafter_registry.check(drafters, draft_kind(draft))
        if why:
            raise PairError(f"{where}: {why}")


def read_text(path: Path) -> str:
    """A pairs file's text: UTF-8 (TOML's encoding), else a PairError saying so."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PairError(f"{path}: not UTF-8 text (byte {e.start + 1}); save it as UTF-8, as TOML asks") from None


def registry() -> dict[str, PairSpec]:
    settings = get_settings()
    pairs = read_toml(resources.files("specdec_llm").joinpath("builtin_pairs.toml").read_text(), "builtin")
    if "config_file" in settings.model_fields_set and not settings.config_file.is_file():  # named, so meant
        raise PairError(
            f"SPECDEC_CONFIG_FILE: {settings.config_file} "
            + ("is not a file" if settings.config_file.exists() else "does not exist")
            + "; point it at your pairs file, or unset it to use the default "
            + str(Settings.model_fields["config_file"].default)
        )
    if settings.config_file.is_file():
        pairs.update(read_toml(read_text(settings.config_file), str(settings.config_file)))
    for spec in pairs.values():
        spec.device = settings.device or spec.device
        spec.dtype = settings.dtype or spec.dtype
    return pairs


def get_spec(name: str) -> PairSpec:
    pairs = registry()
    if name not in pairs:
        settings = get_settings()
        env = (
            " (SPECDEC_DEFAULT_PAIR names it)"
            if "default_pair" in settings.model_fields_set and name == settings.default_pair
            else ""
        )
        raise RequestError("pair", f"unknown pair {name!r}{env}; known pairs: {', '.join(sorted(pairs))}")
    return pairs[name]


CHAT_TEMPLATES = {  # by name, for pairs whose tokenizer has no template (chat_template = "gemma")
    "gemma": (
        "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
        "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
    # ChatML with tools in Qwen2.5's (Hermes') layout: the tool schemas in the system turn,
    # an assistant's calls as <tool_call>{"name", "arguments"}</tool_call>, results as
    # <tool_response> in a user turn. Without tools it is plain ChatML.
    "chatml-tools": (
        "{% if tools %}<|im_start|>system\n"
        "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
        "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
        "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
        "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
        "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
        'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
        '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
        "{% endif %}"
        "{% for m in messages %}"
        "{% if m['role'] == 'system' and loop.first and tools %}"
        "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant"
        "{% if m['content'] %}{{ '\\n' + m['content'] }}{% endif %}"
        "{% for call in m['tool_calls'] %}{% set call = call['function'] if call['function'] is defined else call %}"
        "{{ '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
        "{{ call['arguments'] | tojson }}{{ '}\\n</tool_call>' }}{% endfor %}<|im_end|>\n"
        "{% elif m['role'] == 'tool' %}"
        "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
        "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
        "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
        "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
}


# the token a named template's model turn ends with
CHAT_TURN_ENDS = {"gemma": "<end_of_turn>", "chatml-tools": "<|im_end|>"}


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


def quantization_scheme(draft: str, where: str) -> str:
    """The scheme of ``draft = "quantized:SCHEME"``; a PairError naming the known ones."""
    scheme = draft.removeprefix(QUANTIZED)
    if scheme not in SCHEMES:
        raise PairError(f"{where}: unknown quantization {draft!r}; known: " + ", ".join(QUANTIZED + s for s in SCHEMES))
    return scheme


def check_pair_device(spec: PairSpec) -> None:
    """A PairError, before anything loads, when this machine cannot run the pair's device,
    naming where the device was set: ``SPECDEC_DEVICE``, or the pair's ``device`` key."""
    why = device_problem(spec.device)
    if why is None:
        return
    if get_settings().device:
        raise PairError(f"SPECDEC_DEVICE: {why} (or unset SPECDEC_DEVICE to use each pair's own device)")
    where = "the built-in pairs" if spec.source == "builtin" else spec.source
    raise PairError(
        f"{where}: pair {spec.name!r}: device {why} (the pair's `device` key; or SPECDEC_DEVICE=cpu for every pair)"
    )
