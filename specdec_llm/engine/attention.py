"""How a model's decoder layers attend: full or sliding-window attention per layer (read
from its config once), and the masks its forward takes for each kind (``RaggedCache``
builds them; ``lean.py`` picks one per layer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel


def layer_kinds(config: Any) -> list[str]:
    """Each decoder layer's attention: ``"full_attention"`` or ``"sliding_attention"``
    (``config.layer_types`` where the family declares it: Gemma 2/3, Qwen2, Cohere 2; else
    every layer slides where ``config.sliding_window`` is set: Mistral, Mixtral, StarCoder2)."""
    n = int(config.num_hidden_layers)
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds)[:n]
    window = getattr(config, "sliding_window", None)
    return ["sliding_attention" if window else "full_attention"] * n


@dataclass(frozen=True)
class Attention:
    """How a model's layers attend, read once per cache: ``window`` (in tokens) of its
    sliding-window layers (None when it has none) and the set of its layer kinds."""

    window: int | None
    kinds: frozenset[str]

    @classmethod
    def of(cls, model: PreTrainedModel) -> Attention:
        kinds = frozenset(layer_kinds(model.config))
        window = int(model.config.sliding_window) if "sliding_attention" in kinds else None
        return cls(window, kinds)

    def masks(self, full: torch.Tensor, sliding: torch.Tensor) -> Any:
        """What the model's forward takes as ``attention_mask`` for the engine's own boolean
        masks: one tensor when every layer is of one kind, else {layer kind: mask}
        (transformers' hybrid families accept that mapping in place of the masks they build)."""
        if self.kinds == {"sliding_attention"}:
            return sliding
        if self.kinds == {"full_attention"}:
            return full
        return {"full_attention": full, "sliding_attention": sliding}
