"""The target's own weights, quantized (quant.py), as its draft.

Its layers and KV layout are the target's, so a row's draft cache catches up by copying the
target's keys and values of the positions it has not seen (the prompt, tokens another drafter
had accepted) instead of running the draft over them: the target computed them anyway, and
exactly. On a long prompt that prefill was most of a quantized draft's cost. The draft's own
keys and values of the tokens it fed leave after each verification and the accepted
positions are copied from the target too, so its cache always holds the target's exact keys
and values of the row's tokens but the last, and only the tokens in flight are its own.
"""

from __future__ import annotations

from typing import Any

from ..ragged import RaggedCache
from ..timing import Timer
from .base import Forward, RowView
from .model import ModelDrafter, RaggedBackend

# its acceptance before any row has shown its own: an int4 copy of the target agrees with it on
# ~0.98-0.99 of greedy tokens (docs/pairs.md, the quantized self-draft), so the plan tries it
# from the first row
SELF_PRIOR = 0.9


class SelfBackend(RaggedBackend):
    def __init__(self, name: str, vocab_size: int, model: Any, target: RaggedCache) -> None:
        super().__init__(name, vocab_size, model)
        self.target = target

    def prepare(self, rows: dict[int, RowView]) -> list[Forward]:
        """Every drafting row's cache up to its tokens but the last: the target's cache holds
        exactly those positions (the last token is fed by the next verification)."""
        self.merge()
        spans = {b: (r.state[self.name].held, len(r.tokens) - 1) for b, r in rows.items()}
        with Timer() as t:
            self.cache.append_from(self.target, spans)
        for b, r in rows.items():
            r.state[self.name].held = spans[b][1]
        copied = {b: e - s for b, (s, e) in spans.items() if e > s}
        return [Forward(copied, max(copied.values()), t.seconds, "prefill")] if copied else []

    def kept(self, row: RowView, n: int) -> int:
        """Everything this iteration fed (the last token, then the drafts) leaves: the next
        ``prepare`` copies the accepted positions from the target."""
        return len(row.tokens) - 1


class SelfDrafter(ModelDrafter):
    """The ``quantized`` drafter: a model drafter whose cache is copied from the target's."""

    def backend(self, target: Any) -> SelfBackend:
        assert self.model is not None
        return SelfBackend(self.name, self.context.vocab_size, self.model, target)
