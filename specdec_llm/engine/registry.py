"""Drafters by name: the one place that knows every drafter class (drafters.py and the
feature-level one in eagle.py), so neither module imports the other's users."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from .drafters import KNOWN, MODELS, Lookup, ModelDrafter, SelfDrafter, Suffix
from .eagle import EagleDrafter, is_feature_draft

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .drafters import Drafter


def runnable(draft: Any) -> PreTrainedModel:
    """The causal LM a draft runs: the draft model itself, or a feature-level draft's layer."""
    return cast("PreTrainedModel", draft.model if is_feature_draft(draft) else draft)


def build(names: list[str], draft_model: Any = None, vocab_size: int | None = None) -> list[Drafter]:
    """Drafters by name, in order (the order a fixed k tries them in). "model" and "quantized"
    are the same drafter class over the pair's draft model (a pair has one draft); "eagle"
    runs a feature-level draft (eagle.py)."""
    out: list[Drafter] = []
    for name in names:
        if name == "lookup":
            out.append(Lookup())
        elif name == "suffix":
            out.append(Suffix())
        elif name == "eagle":
            if not is_feature_draft(draft_model):
                raise ValueError(
                    "drafter 'eagle' needs a feature-level draft (specdec-llm distill --kind eagle) as the pair's "
                    "draft; drop 'eagle' from drafters or use such a draft"
                )
            out.append(EagleDrafter(draft_model, vocab_size or int(draft_model.model.config.vocab_size)))
        elif name in MODELS:
            if draft_model is None or runnable(draft_model) is not draft_model:
                raise ValueError(
                    f"drafter {name!r} needs a draft model: set the pair's draft, or drop {name!r} from drafters"
                )
            # the target's own weights in 4 bits agree with it on ~0.99 of greedy tokens (docs/pairs.md):
            # start there, so the schedule tries it from the first row; rows then correct it
            # and shares the target's KV layout, so it catches up from the target's cache (SelfDrafter)
            own = bool(getattr(draft_model, "quantization", None))
            cls = SelfDrafter if own else ModelDrafter
            out.append(cls(draft_model, vocab_size or int(draft_model.config.vocab_size), name, 0.9 if own else 0.5))
        else:
            raise ValueError(f"unknown drafter {name!r}; known drafters: {', '.join(KNOWN)}")
    if len({d.name for d in out}) != len(out):
        raise ValueError(f"drafters {names} name one drafter twice")
    return out
