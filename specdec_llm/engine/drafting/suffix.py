"""A suffix index over earlier sequences of the same scope (SuffixDecoding, arXiv 2411.04975):
bulk jobs repeat themselves."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from .base import RowView
from .free import PRIOR, FreeDrafter, position

_Counts = dict[tuple[int, ...], dict[int, int]]  # context -> {next token: count}
# a token's frequency among its context's continuations, in quarters: its bucket, with its
# context order and position (a path's likely tokens earn their own acceptance)
FREQUENCIES = 4


class SuffixIndex:
    """Counts of the token that followed each context of ``orders`` tokens in earlier
    sequences (prompt + output), per scope: requests of one scope read only that scope's
    counts. At most ``max_tokens`` tokens over all scopes; the oldest sequences are
    forgotten first (their counts subtracted), so memory stays bounded."""

    # orders 2-8: contexts short enough to recur across requests, long enough to pick one
    # continuation (SuffixDecoding's tree matches a few to tens of tokens); max_tokens 200,000:
    # a bound on memory (about 5 counters per token and order, tens of MB), not a measured
    # optimum: the oldest sequences are forgotten past it
    def __init__(self, max_tokens: int = 200_000, orders: tuple[int, ...] = (2, 3, 4, 6, 8)):
        self.max_tokens, self.orders = max_tokens, orders
        self.docs: OrderedDict[tuple[Hashable, int], list[int]] = (
            OrderedDict()
        )  # (scope, serial) -> tokens, oldest first
        self.counts: dict[Hashable, _Counts] = {}  # scope -> {context tuple: {next token: count}}
        self.tokens = 0
        self.serial = 0

    def add(self, scope: Hashable, tokens: list[int]) -> None:
        tokens = list(tokens)[-self.max_tokens :]
        self.serial += 1
        self.docs[(scope, self.serial)] = tokens
        self.tokens += len(tokens)
        self._count(self.counts.setdefault(scope, {}), tokens, +1)
        while self.tokens > self.max_tokens:
            (old_scope, _), old = self.docs.popitem(last=False)
            self.tokens -= len(old)
            table = self.counts.get(old_scope)  # (gone where the scope's sequences left were too short to count)
            if table is not None:
                self._count(table, old, -1)
                if not table:
                    del self.counts[old_scope]

    def _count(self, table: _Counts, tokens: list[int], sign: int) -> None:
        for n in self.orders:
            for e in range(n, len(tokens)):
                ctx = tuple(tokens[e - n : e])
                nxt = table.setdefault(ctx, {})
                c = nxt.get(tokens[e], 0) + sign
                if c > 0:
                    nxt[tokens[e]] = c
                else:
                    nxt.pop(tokens[e], None)
                    if not nxt:
                        del table[ctx]

    def walk(self, scope: Hashable, seq: list[int], k: int, min_prob: float) -> tuple[list[int], list[Hashable]]:
        """Up to ``k`` tokens following ``seq``: at each step the most frequent next token of
        the longest context seen; stop when the path's frequency product drops below ``min_prob``."""
        table = self.counts.get(scope)
        if not table:
            return [], []
        tokens, buckets, path, ext = list[int](), list[Hashable](), 1.0, list(seq[-max(self.orders) :])
        for _ in range(k):
            hit = next(
                (
                    (i, table[c])
                    for i, n in reversed(list(enumerate(self.orders)))
                    if len(ext) >= n and (c := tuple(ext[-n:])) in table
                ),
                None,
            )
            if hit is None:
                break
            order, nxt = hit
            tok, count = max(nxt.items(), key=lambda kv: kv[1])
            p = count / sum(nxt.values())
            path *= p
            if path < min_prob:
                break
            tokens.append(tok)
            buckets.append((order, min(int(p * FREQUENCIES), FREQUENCIES - 1), position(len(tokens) - 1)))
            ext.append(tok)
        return tokens, buckets


class Suffix(FreeDrafter):
    """A suffix index over earlier sequences of the same scope (a job's rows, or the
    requests that share no scope), frequency-gated as SuffixDecoding does: a path is
    proposed while the product of its tokens' frequencies stays above ``min_prob``. Rows
    feed it as they finish. A seeded sampled row never reads it (its text must not depend
    on other requests)."""

    name = "suffix"
    shared = True

    # min_prob 0.1: a guess, not a measurement; a path below it is proposed rarely enough to be
    # accepted that its verification width is better spent (the planner cuts by acceptance anyway)
    def __init__(self, max_tokens: int = 200_000, min_prob: float = 0.1, prior: float = PRIOR):
        super().__init__(prior)
        self.index = SuffixIndex(max_tokens)
        self.min_prob = min_prob

    def continuation(self, row: RowView, k: int) -> tuple[list[int], list[Hashable]]:
        return self.follow(row, [], k)

    def follow(self, row: RowView, drafts: list[int], k: int) -> tuple[list[int], list[Hashable]]:
        seq = row.tokens[-max(self.index.orders) :] + drafts if drafts else row.tokens
        return self.index.walk(row.scope, seq, k, self.min_prob)

    def finish(self, row: RowView) -> None:
        self.index.add(row.scope, row.tokens)
