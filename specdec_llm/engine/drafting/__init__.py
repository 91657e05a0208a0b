"""Drafting: what proposes the tokens the target verifies, one file per method.

``base.py`` is the seam (read it first): a ``Drafter`` opens a ``Session`` per batch, which
proposes (``Drafts``: proposals and the forwards it ran) and hears what happened to the rows
(events). The methods: prompt lookup (``lookup.py``) and a suffix index (``suffix.py``),
free drafters (``free.py``); a draft model (``model.py``: the propose loop, written once over
a ``Backend``), the target's own quantized copy (``selfdraft.py``), a feature-level draft
(``eagle.py``), llama.cpp (``llamacpp.py``); two-level drafting (``two_level.py``); one
acceptance estimator (``acceptance.py``); drafters by name (``registry.py``).
"""

from typing import TYPE_CHECKING, Any

from .base import DraftContext, Drafts, Forward, Proposal, RowView, Sampling
from .free import FreeDrafter
from .registry import known, register_drafter, unregister_drafter

if TYPE_CHECKING:
    from .model import Backend, ModelDrafter, ModelRow


def __getattr__(name: str) -> Any:
    """The draft-model loop (torch) loads on first use: the registry alone reads no model."""
    if name in ("Backend", "ModelDrafter", "ModelRow"):
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Backend",
    "DraftContext",
    "Drafts",
    "Forward",
    "FreeDrafter",
    "ModelDrafter",
    "ModelRow",
    "Proposal",
    "RowView",
    "Sampling",
    "known",
    "register_drafter",
    "unregister_drafter",
]
