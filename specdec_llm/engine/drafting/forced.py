"""The grammar as a drafter: where a row's ``response_format`` admits one token only (a JSON
key, a separator, a closing brace), those tokens are proposed for free.

Under the grammar's mask (engine/grammar.py) a forced token is the target's only choice, so it
is always accepted: greedy or sampled, its acceptance is 1. Its ``follow`` also reads what is
forced after a model drafter's own drafts, so a draft model's forwards check the forced tokens
after their drafts (two levels) and a chain runs through keys and values alike. Rows without a
``response_format`` get nothing from it. Its matcher is its own, advanced with the row's tokens:
it sees the row as plain data, like every drafter.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from .base import Proposal, RowView
from .free import FreeDrafter


class _Matcher:
    """A row's grammar matcher and how many of the row's tokens it has consumed."""

    def __init__(self, grammar: Any, seen: int) -> None:
        self.grammar, self.seen = grammar, seen


class Forced(FreeDrafter):
    name = "grammar"

    def __init__(self, matcher: Callable[[dict[str, Any]], Any]):
        super().__init__(prior=1.0)
        self.matcher = matcher  # response_format -> a fresh matcher (engine/grammar.py's RowGrammar)

    def continuation(self, row: RowView, k: int) -> tuple[list[int], list[Hashable]]:
        return self.follow(row, [], k)

    def follow(self, row: RowView, drafts: list[int], k: int) -> tuple[list[int], list[Hashable]]:
        if row.response_format is None or k <= 0:
            return [], []
        m = row.state.get(self.name)
        if m is None:  # a new row: its matcher starts after the prompt (tokens the row has emitted follow)
            m = row.state[self.name] = _Matcher(self.matcher(row.response_format), row.prompt_length)
        m.grammar.advance(row.tokens[m.seen :])
        m.seen = len(row.tokens)
        if drafts and m.grammar.valid(drafts) < len(drafts):
            return [], []
        tokens = m.grammar.forced_after(drafts)[:k]
        return tokens, [("forced", i) for i in range(len(tokens))]

    def offer(self, row: RowView, k: int, drafts: list[int] | None = None) -> Proposal | None:
        prop = super().offer(row, k, drafts)
        if prop is not None:
            prop.accept = [1.0] * len(prop.tokens)  # the mask leaves the target no other choice
        return prop
