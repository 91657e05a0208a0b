"""A feature-level draft (EAGLE, arXiv 2401.15077; EAGLE-3, 2503.01840) behind the drafter seam.

The draft reads the target's own hidden states instead of re-deriving them from tokens:
its input at position j is the pair (the target's feature f_j, the next token x_{j+1}),
where f_j is the target's residual stream after a few of its decoder layers, fused into
one vector; one decoder layer shaped like the target's runs over those pairs with its own
KV cache, and the target's final norm and (vocabulary-subset) head turn its output h_j
into a prediction of x_{j+2}. For later draft tokens the draft's own output h replaces the
fused feature (the target has not seen those tokens yet).

The target's features come free with every target forward (the loop asks its cache for
the layers this drafter reads: ``feature_layers``) and reach the session in ``Joined`` (the
prompt's) and ``Accepted`` (the row's last token and accepted drafts). A row keeps them
pending until it next drafts with this model: the first draft forward feeds every pending
pair (real features), the next ones one drafted pair each. Drafted pairs always leave after
the verification (``EagleBackend.kept``): accepted tokens come back with the target's real
features. The propose loop is the model drafter's (model.py), in one level: its inputs are
features as well as tokens.

The draft object (``specdec_llm/training/eagle.py`` trains it; ``specdec_llm/pairs`` builds and loads it) provides:
``model`` (a one-layer causal LM run on ``inputs_embeds``), ``feature_layers``,
``fuse(f) -> g`` and ``inputs(ids, g) -> inputs_embeds``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .. import hf
from ..ragged import RaggedCache
from ..timing import Timer
from .base import DraftContext, Forward, RowView
from .model import DISTILLED_PRIOR, ModelDrafter, ModelRow, RaggedBackend

if TYPE_CHECKING:
    from transformers import PreTrainedModel

OWN = (0,)  # the draft's own output h: the residual stream after its (only) decoder layer


class FeatureDraft(Protocol):
    model: PreTrainedModel
    feature_layers: list[int]

    def fuse(self, f: torch.Tensor) -> torch.Tensor: ...

    def inputs(self, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor: ...


def is_feature_draft(draft: object) -> bool:
    return hasattr(draft, "feature_layers") and hasattr(draft, "inputs")


@dataclass
class EagleRow(ModelRow):
    pending: list[torch.Tensor] = field(default_factory=list)  # the target's features not yet fed, in order


class EagleBackend(RaggedBackend):
    """A ragged cache fed (feature, token) pairs: the target's pending features first, then
    the draft's own output ``h`` of the previous forward."""

    branching = False  # (a branch's inputs would need the draft's own output at its parent)

    def __init__(self, drafter: EagleDrafter) -> None:
        super().__init__(drafter.name, drafter.context.vocab_size, drafter.draft.model, OWN)
        self.d = drafter
        self.own: dict[int, torch.Tensor] = {}  # each drafting row's last draft output h

    def join(self, b: int, row: RowView, features: torch.Tensor | None) -> None:
        super().join(b, row, features)
        st = row.state[self.name]
        st.held = 1  # the first token is never an input: pairs are (f_i, x_(i+1))
        if features is not None:
            st.pending.append(features)

    def observe(self, row: RowView, features: torch.Tensor) -> None:
        row.state[self.name].pending.append(features)

    def prepare(self, rows: dict[int, RowView]) -> list[Forward]:
        """Nothing to catch up on: the first forward feeds every pending pair."""
        self.merge()
        return []

    def feed(
        self, rows: dict[int, RowView], inputs: dict[int, list[int]], keep: dict[int, int]
    ) -> tuple[dict[int, torch.Tensor], list[Forward]]:
        empty = torch.zeros(0)
        embeds = [empty] * self.cache.rows
        with Timer() as t:
            for b, x in inputs.items():
                st = rows[b].state[self.name]
                if st.pending:  # (real feature f_i, token x_(i+1)) up to the last token
                    embeds[b] = self.d.embed(x, torch.cat(st.pending), fuse=True)
                    st.pending = []
                else:  # (the draft's own output, the token it drafted)
                    embeds[b] = self.d.embed(x, self.own[b][None])
        logits, seconds = self.forward([inputs.get(b, []) for b in range(self.cache.rows)], 1, embeds)
        assert self.cache.last_features is not None
        h = self.cache.last_features[:, -1]
        self.own = {b: h[b] for b in inputs}
        record = self.record(rows, inputs, seconds + t.seconds)
        return {b: logits[b] for b in inputs}, [record]

    def kept(self, row: RowView, n: int) -> int:
        """Drafted pairs leave whatever was accepted: the accepted tokens return with the
        target's real features."""
        return len(row.tokens)


class EagleDrafter(ModelDrafter):
    """Drafts with a feature-level draft; otherwise a model drafter (acceptance tracking,
    calibrated step cost, the batch's plan chooses it per row like any model)."""

    levels = 1  # its inputs are features as well as tokens: it drafts one token per forward
    row_state = EagleRow

    def __init__(self, draft: FeatureDraft, context: DraftContext, name: str = "eagle", prior: float = DISTILLED_PRIOR):
        super().__init__(draft.model, context, name, prior)
        self.draft = draft
        self.feature_layers = tuple(draft.feature_layers)  # the target layers the loop returns

    def backend(self, target: Any) -> EagleBackend:
        return EagleBackend(self)

    @torch.no_grad()
    def embed(self, tokens: list[int], g: torch.Tensor, fuse: bool = False) -> torch.Tensor:
        """The draft's inputs [len(tokens), H] for ``tokens`` paired with ``g``: the draft's own
        outputs, or (``fuse``) the target's features [len(tokens), n*H]."""
        model = self.draft.model
        g = g.to(model.device, model.dtype)
        if fuse:
            g = self.draft.fuse(g)
        ids = torch.tensor([tokens], device=g.device)
        return self.draft.inputs(ids, g[None])[0]

    def timer(self, rows: int, ids: list[int]) -> Callable[[int], float]:
        """One draft step of ``rows`` rows (its forwards are one token wide)."""
        model = self.draft.model
        cache = RaggedCache(model, rows, OWN)
        g = torch.zeros(len(ids), model.config.hidden_size, dtype=model.dtype, device=model.device)
        cache.forward([ids] * rows, 1, [self.embed(ids, g)] * rows)
        width = cache.width

        def step(w: int) -> float:
            with Timer() as t:
                u = self.embed(ids[:1], g[:1])
                cache.forward([ids[:1]] * rows, 1, [u] * rows)
                hf.sync(model)
            cache.crop(width)
            return t.seconds

        return step
