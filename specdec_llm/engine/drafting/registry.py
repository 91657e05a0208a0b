"""Drafters by name: the one list the decoder, the pairs, the CLI and LangChain read.

``register_drafter(name, build, ...)`` adds a drafting method: ``build(DraftContext)`` makes
a new drafter (base.py) for a decoder. Packages outside this one register theirs when
imported, or through the ``specdec_llm.drafters`` entry point group (an object reference
to a function called with no arguments that calls ``register_drafter``), so a pairs file
read by a worker process can name them too (the methods that run a model are imported when
built: reading a pairs file loads no torch)::

    [project.entry-points."specdec_llm.drafters"]
    phrases = "my_package.drafting:register"
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, cast

from .base import DraftContext
from .lookup import Lookup
from .suffix import Suffix

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .base import Drafter

log = logging.getLogger(__name__)
GROUP = "specdec_llm.drafters"
MODEL_DRAFTS = ("model", "distilled", "placeholder")  # pair draft kinds (pairs.draft_kind) that are a causal LM


@dataclass(frozen=True)
class Registration:
    name: str
    build: Callable[[DraftContext], Drafter]
    draft_kinds: tuple[str, ...] = ()  # the pair draft kinds it runs on; () needs no draft
    default: bool = False  # listed for a pair that names no drafters (when its draft is of those kinds)
    needs: str = ""  # what it needs, said in errors: "needs ..."


_DRAFTERS: dict[str, Registration] = {}
_loaded_entry_points = False


def register_drafter(
    name: str,
    build: Callable[[DraftContext], Drafter],
    *,
    draft_kinds: tuple[str, ...] = (),
    default: bool = False,
    needs: str = "",
    replace: bool = False,
) -> None:
    """Make drafter ``name`` known: pairs may list it (``drafters = [..., "NAME"]``) and
    requests ask for it (``drafter="NAME"``). ``draft_kinds``: the pair drafts it runs on
    (e.g. ``("model", "distilled")``; empty for a drafter that reads token ids only)."""
    if not name or not name.replace("-", "").replace("_", "").isalnum() or name == "auto" or len(name) > 32:
        raise ValueError(f"drafter name {name!r}: use up to 32 letters, digits, '-' or '_' (and not 'auto')")
    if name in _DRAFTERS and not replace:
        raise ValueError(f"drafter {name!r} is registered already; pass replace=True to replace it")
    _DRAFTERS[name] = Registration(name, build, tuple(draft_kinds), default, needs)


def unregister_drafter(name: str) -> None:
    """Forget drafter ``name`` (decoders built with it keep theirs)."""
    _DRAFTERS.pop(name, None)


def registered() -> dict[str, Registration]:
    """Every known drafter, in registration order (built-in ones first)."""
    global _loaded_entry_points
    if not _loaded_entry_points:
        for ep in entry_points(group=GROUP):
            try:
                ep.load()()
            except Exception as e:  # noqa: BLE001 - one broken plugin: the others and the built-ins still serve
                log.error(
                    "the drafter entry point %r (%s) failed, its drafters are not registered: %r", ep.name, ep.value, e
                )
        _loaded_entry_points = True
    return dict(_DRAFTERS)


def known() -> list[str]:
    return list(registered())


def defaults(draft_kind: str) -> list[str]:
    """The drafters of a pair that lists none, for its draft's kind (pairs.draft_kind)."""
    return [n for n, r in registered().items() if r.default and (not r.draft_kinds or draft_kind in r.draft_kinds)]


def check(names: list[str], draft_kind: str) -> str | None:
    """Why a pair with a draft of ``draft_kind`` cannot list ``names`` (None: it can)."""
    table = registered()
    for i, name in enumerate(names):
        if name not in table:
            return f"unknown drafter {name!r}; known drafters: {', '.join(table)}"
        if name in names[:i]:  # (refused when read: build refused it after the load)
            return f"drafters {names} name {name!r} twice; list each once"
        r = table[name]
        if r.draft_kinds and draft_kind not in r.draft_kinds:
            why = f"drafter {name!r} needs {r.needs or 'a draft of kind ' + ' or '.join(r.draft_kinds)}"
            fits = [n for n, o in table.items() if draft_kind in o.draft_kinds]
            return why + (f" (this draft is of kind {draft_kind}: use drafter {fits[0]!r})" if fits else "")
    return None


def runnable(draft: Any) -> PreTrainedModel:
    """The causal LM a draft runs: the draft model itself, or a feature-level draft's layer."""
    from .eagle import is_feature_draft

    return cast("PreTrainedModel", draft.model if is_feature_draft(draft) else draft)


def build(names: list[str], context: DraftContext) -> list[Drafter]:
    """Drafters by name, in order (the order a fixed k tries them in)."""
    table = registered()
    out: list[Drafter] = []
    for name in names:
        if name not in table:
            raise ValueError(f"unknown drafter {name!r}; known drafters: {', '.join(table)}")
        built = table[name].build(context)
        if built.name != name:  # (requests and pairs name it by its registration)
            raise ValueError(
                f"drafter {name!r} is registered with a factory whose drafter is named {built.name!r}; use one name"
            )
        out.append(built)
    if len({d.name for d in out}) != len(out):
        raise ValueError(f"drafters {names} name one drafter twice")
    return out


def _model(name: str) -> Callable[[DraftContext], Drafter]:
    """A draft model's drafter: "model" and "quantized" are one class over the pair's draft
    (a pair has one draft); the target's own quantized weights share its KV layout and catch
    up from its cache (SelfDrafter), and their acceptance starts high (``SELF_PRIOR``)."""

    def make(c: DraftContext) -> Drafter:
        from .model import ModelDrafter
        from .selfdraft import SELF_PRIOR, SelfDrafter

        draft = c.draft
        if draft is None or runnable(draft) is not draft:
            raise ValueError(
                f"drafter {name!r} needs a draft model: set the pair's draft, or drop {name!r} from drafters"
            )
        quantization = getattr(draft, "quantization", None) or {}
        own = bool(quantization) and quantization.get("of") != "draft"  # the target's own weights, quantized
        return SelfDrafter(draft, c, name, SELF_PRIOR) if own else ModelDrafter(draft, c, name)

    return make


def _eagle(c: DraftContext) -> Drafter:
    from .eagle import EagleDrafter, is_feature_draft

    if not is_feature_draft(c.draft):
        raise ValueError(
            "drafter 'eagle' needs a feature-level draft (specdec-llm distill --kind eagle) as the pair's "
            "draft; drop 'eagle' from drafters or use such a draft"
        )
    return EagleDrafter(c.draft, c)


def _llamacpp(c: DraftContext) -> Drafter:
    """llama.cpp decoding the pair's draft GGUF file, else the target's own (llamacpp.py; optional package)."""
    path = c.draft_file or c.target_file or ""
    if not path.endswith(".gguf"):
        raise ValueError(
            "drafter 'llamacpp' needs the pair's draft or target as a GGUF file; drop 'llamacpp' from drafters"
        )
    from .model import DISTILLED_PRIOR

    try:
        from .llamacpp import LLAMACPP_PRIOR, LlamaCppDrafter

        # the target's own weights agree with it nearly always; a smaller model of its family, as a draft model
        return LlamaCppDrafter(path, c, prior=DISTILLED_PRIOR if c.draft_file else LLAMACPP_PRIOR)
    except ImportError as e:
        raise ValueError(
            f"drafter 'llamacpp' needs llama-cpp-python ({e}): pip install 'specdec-llm[llamacpp]' (llama-cpp-python), or drop 'llamacpp' from drafters"
        ) from None


register_drafter("lookup", lambda c: Lookup(), default=True)
register_drafter("suffix", lambda c: Suffix(), default=True)
register_drafter(
    "model", _model("model"), draft_kinds=MODEL_DRAFTS, default=True, needs="a draft model; set draft = ... or drop it"
)
register_drafter(
    "quantized",
    _model("quantized"),
    draft_kinds=("quantized",),
    default=True,
    needs='draft = "quantized:int4" (or int8, fp8)',
)
register_drafter(
    "eagle",
    _eagle,
    draft_kinds=("eagle",),
    default=True,
    needs="an EAGLE draft directory (specdec-llm distill --kind eagle); set draft = ... or drop 'eagle'",
)


def _forced(c: DraftContext) -> Drafter:
    from .forced import Forced

    if c.grammar is None:
        raise ValueError("drafter 'grammar' needs a decoder with a tokenizer (its rows' grammars); drop 'grammar'")
    return Forced(c.grammar)


# every speculative decoder has it (decoder.py): it proposes only for rows with a response_format
register_drafter("grammar", _forced, needs="a decoder with a tokenizer")
register_drafter(
    "llamacpp", _llamacpp, needs="the pair's draft or target as a GGUF file and llama-cpp-python installed"
)
