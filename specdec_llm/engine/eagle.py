"""A feature-level draft (EAGLE, arXiv 2401.15077; EAGLE-3, 2503.01840) behind the drafter seam.

The draft reads the target's own hidden states instead of re-deriving them from tokens:
its input at position j is the pair (the target's feature f_j, the next token x_{j+1}),
where f_j is the target's residual stream after a few of its decoder layers, fused into
one vector; one decoder layer shaped like the target's runs over those pairs with its own
KV cache, and the target's final norm and (vocabulary-subset) head turn its output h_j
into a prediction of x_{j+2}. For later draft tokens the draft's own output h replaces the
fused feature (the target has not seen those tokens yet).

The target's features come free with every target forward (the decoder asks its cache for
the layers this drafter reads: ``EagleDrafter.features``): after the prefill for the
prompt, after each verification for the positions it accepted. A row keeps them pending
until it next drafts with this model: the first draft step feeds every pending pair (real
features), the next steps one drafted pair each. Drafted pairs are always dropped after
the verification (``commit``): accepted tokens come back with the target's real features.

The draft object (``specdec_llm/training/eagle.py`` trains it; ``specdec_llm/pairs`` builds and loads it) provides:
``model`` (a one-layer causal LM run on ``inputs_embeds``), ``feature_layers``,
``fuse(f) -> g`` and ``inputs(ids, g) -> inputs_embeds``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from . import hf
from .autok import Timer
from .drafters import ModelDrafter, ModelRow, ModelSession, pick
from .protocol import Proposal
from .ragged import RaggedCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .decoder import Batch, Row

OWN = (0,)  # the draft's own output h: the residual stream after its (only) decoder layer


class FeatureDraft(Protocol):
    model: PreTrainedModel
    feature_layers: list[int]

    def fuse(self, f: torch.Tensor) -> torch.Tensor: ...

    def inputs(self, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor: ...


def is_feature_draft(draft: object) -> bool:
    return hasattr(draft, "feature_layers") and hasattr(draft, "inputs")


@dataclass
class _EagleRow(ModelRow):
    pending: list[torch.Tensor] = field(default_factory=list)  # target features not yet fed, in order


class EagleDrafter(ModelDrafter):
    """Drafts with a feature-level draft; otherwise a model drafter (acceptance tracking,
    calibrated step cost, the batch's plan chooses it per row like any model)."""

    row_state = _EagleRow
    levels = 1  # its inputs are features as well as tokens: it drafts one token per forward

    def __init__(self, draft: FeatureDraft, vocab_size: int, name: str = "eagle", prior: float = 0.5):
        super().__init__(draft.model, vocab_size, name, prior)
        self.draft = draft
        self.features = tuple(draft.feature_layers)  # the target layers the decoder returns

    def session(self, batch: Batch) -> _EagleSession:
        return _EagleSession(self, batch)

    @torch.no_grad()
    def embed(self, tokens: list[int], g: torch.Tensor, fuse: bool = False) -> torch.Tensor:
        """The draft's inputs [len(tokens), H] for ``tokens`` paired with ``g``: the draft's own
        outputs, or (``fuse``) the target's features [len(tokens), n*H]."""
        g = g.to(self.model.device, self.model.dtype)
        if fuse:
            g = self.draft.fuse(g)
        ids = torch.tensor([tokens], device=g.device)
        return self.draft.inputs(ids, g[None])[0]

    def time_step(self, rows: int, ids: list[int]) -> Callable[[], float]:
        cache = RaggedCache(self.model, rows, OWN)
        hidden = self.model.config.hidden_size
        g = torch.zeros(len(ids), hidden, dtype=self.model.dtype, device=self.model.device)
        cache.forward([ids] * rows, 1, [self.embed(ids, g)] * rows)
        width = cache.width

        def step() -> float:
            with Timer() as t:
                u = self.embed(ids[:1], g[:1])
                cache.forward([ids[:1]] * rows, 1, [u] * rows)
                hf.sync(self.model)
            cache.crop(width)
            return t.seconds

        return step


class _EagleSession(ModelSession):
    d: EagleDrafter

    def __init__(self, drafter: EagleDrafter, batch: Batch):
        super().__init__(drafter, batch)
        self.cache = RaggedCache(drafter.model, 0, OWN)
        self.columns: list[int] = []  # the cache column fed at each draft step of this iteration

    def add(self, row: Row) -> None:
        self.d.tracker(row)
        self.joining.append(RaggedCache(self.d.model, 1, OWN))

    def observe(self, row: Row, feats: torch.Tensor) -> None:
        """The target's features [m, n*H] of the row's next ``m`` positions (prefilled or accepted)."""
        row.state[self.d.name].pending.append(feats)

    def behind(self, row: Row) -> int:
        return sum(len(f) for f in row.state[self.d.name].pending)

    def propose(self, rows: list[Row], ks: dict[int, int]) -> dict[int, Proposal]:
        self.merge()
        # a row whose prompt was one token has no feature yet: nothing to draft from
        ks = {b: k for b, k in ks.items() if k > 0 and self.behind(rows[b])}
        if not ks:
            return {}
        d, name = self.d, self.d.name
        drafts: dict[int, list[int]] = {b: [] for b in ks}
        qs: dict[int, list[torch.Tensor]] = {b: [] for b in ks}
        own: dict[int, torch.Tensor] = {}  # each row's last draft output h
        empty = torch.zeros(0)
        self.columns = []
        for j in range(max(ks.values())):
            inputs: list[list[int]] = [[] for _ in rows]
            embeds = [empty] * len(rows)
            with Timer() as t:
                for b, k in ks.items():
                    if k <= j:
                        continue
                    if j == 0:  # every pending pair: (real feature f_i, token x_{i+1}) up to the last token
                        st = rows[b].state[name]
                        feats = torch.cat(st.pending)
                        st.pending, st.dlen = [], st.dlen + len(feats)
                        inputs[b] = rows[b].seq[len(rows[b].seq) - len(feats) :]
                        embeds[b] = d.embed(inputs[b], feats, fuse=True)
                    else:  # (the draft's own output, the token it drafted)
                        inputs[b] = drafts[b][-1:]
                        embeds[b] = d.embed(inputs[b], own[b][None])
                logits = self.cache.forward(inputs, 1, embeds)[:, -1, : d.vocab_size]
                hf.sync(d.model)
            assert self.cache.last_features is not None
            h = self.cache.last_features[:, -1]
            self.columns.append(self.cache.width - 1)
            own.update({b: h[b] for b in ks if inputs[b]})
            self.record(rows, inputs, logits, t.seconds, drafts, qs, steady=j > 0)
        return self.proposals(rows, ks, drafts, qs)

    def record(
        self,
        rows: list[Row],
        inputs: list[list[int]],
        logits: torch.Tensor,
        seconds: float,
        drafts: dict[int, list[int]],
        qs: dict[int, list[torch.Tensor]],
        steady: bool,
    ) -> None:
        """One draft step's token for every row that fed it, and its share of the step's time;
        a ``steady`` (one-token) step's time is the draft cost the plan reads."""
        fed = sum(len(x) for x in inputs)
        for b in drafts:
            if inputs[b]:
                r = rows[b]
                r.stats.draft_forwards += 1
                r.stats.draft_time_s += seconds * len(inputs[b]) / fed
                tok, q = pick(r, logits[b])
                drafts[b].append(tok)
                if q is not None:
                    qs[b].append(q)
        if steady:
            self.batch.dec.costs[sum(1 for x in inputs if x)].observe_draft(self.d.name, seconds)

    def commit(self, b: int, row: Row, prop: Proposal, n: int) -> None:
        """Drafted pairs (steps 2..k) leave the cache whatever was accepted: the accepted
        tokens return with the target's real features (``observe``)."""
        k = len(prop.tokens)
        row.state[self.d.name].tracker.update(k, n)
        if k > 1:
            self.cache.drop(b, self.columns[1:k])
