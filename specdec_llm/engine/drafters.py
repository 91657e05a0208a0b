"""Drafters: what proposes the tokens the target verifies, one class each, behind the seam
of protocol.py (read it first).

``FreeDrafter`` proposes from token ids alone: prompt lookup (``Lookup``) and a suffix
index over earlier sequences (``Suffix``); each token's acceptance is learned per bucket
(``Acceptance``). ``ModelDrafter`` runs a draft model with its own KV cache, k one-token
steps for every row that chose it, its acceptance tracked per row (geometric model);
``SelfDrafter`` is the target's own quantized weights, whose cache catches up by copying
the target's. Their cost is measured (autok.CostModel); which one drafts how much for a
row is the batch's plan (autok.plan).
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import hf
from .autok import AcceptanceTracker, Timer, inner_plan
from .protocol import Proposal
from .ragged import RaggedCache
from .sampling import accept_greedy, accept_sampled, probs, sample

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .decoder import Batch, Row
    from .types import Stats


class Acceptance:
    """Per-token acceptance by bucket, learned from verifications (greedy and sampled apart:
    a deterministic draft is accepted with the target's probability of it when sampling).
    A bucket starts at ``prior`` with the weight of two observations."""

    def __init__(self, prior: float, weight: float = 2.0):
        self.prior, self.weight = prior, weight
        self.counts: dict[Hashable, list[float]] = defaultdict(lambda: [0.0, 0.0])  # bucket -> [accepted, examined]

    def rate(self, bucket: Hashable) -> float:
        acc, seen = self.counts.get(bucket, (0.0, 0.0))
        return (acc + self.weight * self.prior) / (seen + self.weight)

    def update(self, buckets: list[Any], n: int) -> None:
        """Tokens up to the first rejection were examined; the first ``n`` were accepted."""
        for i, bucket in enumerate(buckets[: n + 1]):
            c = self.counts[bucket]
            c[0] += i < n
            c[1] += 1


class FreeDrafter:
    """A drafter that reads token ids only (no model): its proposals cost no forward, and it
    is its own session (it keeps no per-batch state). A subclass sets ``name`` and writes
    ``continuation(row, k)``: at most ``k`` tokens to follow ``row.seq``, and each one's
    acceptance bucket (a hashable: tokens of one bucket share a learned acceptance rate)."""

    free, shared = True, False
    features: tuple[int, ...] = ()
    name: str

    def __init__(self, prior: float = 0.3):
        self.acceptance = Acceptance(prior)

    def continuation(self, row: Row, k: int) -> tuple[list[int], list[Hashable]]:
        raise NotImplementedError

    def follow(self, row: Row, drafts: list[int], k: int) -> tuple[list[int], list[Hashable]]:
        """At most ``k`` tokens to follow ``row.seq + drafts``: ``drafts`` are a model
        drafter's own tokens of this iteration, whose forwards check these (two-level
        drafting). A drafter that reads only ``row.seq`` offers nothing past them."""
        return self.continuation(row, k) if not drafts else ([], [])

    def offer(self, row: Row, k: int, drafts: list[int] | None = None) -> Proposal | None:
        """A proposal of at most ``k`` tokens after ``row.seq`` (and ``drafts``), or None."""
        tokens, feats = self.follow(row, drafts or [], k)
        if not tokens:
            return None
        feats = [(row.req.greedy, f) for f in feats]
        return Proposal(self.name, tokens, None, [self.acceptance.rate(f) for f in feats], feats)

    def session(self, batch: Batch) -> FreeDrafter:
        return self

    @property
    def prior(self) -> float:
        return self.acceptance.prior

    def rate(self, row: Row) -> float:
        return self.acceptance.prior

    def time_step(self, rows: int, ids: list[int]) -> None:
        return None

    def behind(self, row: Row) -> int:
        return 0

    def observe(self, row: Row, features: torch.Tensor) -> None:
        pass

    def add(self, row: Row) -> None:
        pass

    def merge(self) -> None:
        pass

    def keep(self, order: list[int]) -> None:
        pass

    def propose(self, rows: list[Row], ks: dict[int, int]) -> dict[int, Proposal]:
        return {b: p for b, k in ks.items() if (p := self.offer(rows[b], k)) is not None}

    def commit(self, b: int, row: Row, prop: Proposal, n: int) -> None:
        self.acceptance.update(prop.features, n)

    def shadow(self, row: Row, prop: Proposal, emitted: list[int]) -> None:
        """Learn from a proposal that was made but not verified (another drafter's was, or
        none): on a greedy row the target's tokens of this iteration (``emitted``) say how
        many of its first tokens would have been accepted. Past ``emitted`` nothing is known
        (a censored observation: examined and accepted, no rejection). Without it a drafter
        the plan keeps passing over would never earn the estimate that gets it chosen."""
        if not row.req.greedy:
            return  # (sampled: a token's acceptance is a probability, not seen from the output)
        n = next((i for i, (a, b) in enumerate(zip(prop.tokens, emitted)) if a != b), None)
        if n is not None:
            self.acceptance.update(prop.features, n)
        else:
            seen = min(len(prop.tokens), len(emitted))
            self.acceptance.update(prop.features[:seen], seen)

    def finish(self, row: Row) -> None:
        pass


class _RowNgrams:
    """For one growing sequence: the end of the most recent occurrence of every n-gram
    (n <= max_n) that has a continuation, updated incrementally as tokens arrive."""

    last: dict[tuple[int, ...], int]

    def __init__(self, max_n: int):
        self.max_n, self.seen, self.last = max_n, 1, {}

    def update(self, seq: list[int]) -> None:
        for e in range(self.seen, len(seq)):  # n-grams ending at e have seq[e] as continuation
            for n in range(1, min(self.max_n, e) + 1):
                self.last[tuple(seq[e - n : e])] = e
        self.seen = max(self.seen, len(seq))


class Lookup(FreeDrafter):
    """Prompt lookup: the longest recent match of the sequence's last n tokens (n from
    ``max_n`` down to ``min_n``) in the row's own prompt and output; the tokens that followed
    it are proposed. A token's bucket is (match length, position), so a long match earns
    longer proposals once it has proven itself."""

    name = "lookup"

    def __init__(self, max_n: int = 4, min_n: int = 1, prior: float = 0.3):
        super().__init__(prior)
        self.max_n, self.min_n = max_n, min_n

    def continuation(self, row: Row, k: int) -> tuple[list[int], list[Any]]:
        return self.follow(row, [], k)

    def follow(self, row: Row, drafts: list[int], k: int) -> tuple[list[int], list[Any]]:
        """Matches are looked up in ``row.seq`` (the index covers it); the n-gram to match may
        end in ``drafts``, and what followed the match may run into them."""
        index = row.state.get(self.name)
        if index is None:
            index = row.state[self.name] = _RowNgrams(self.max_n)
        index.update(row.seq)
        seq = row.seq + drafts if drafts else row.seq
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            e = index.last.get(tuple(seq[-n:]))
            if e is not None:
                tokens = seq[e : e + k]
                return tokens, [(n, min(i, 3)) for i in range(len(tokens))]
        return [], []


class SuffixIndex:
    """Counts of the token that followed each context of ``orders`` tokens in earlier
    sequences (prompt + output), per scope: requests of one scope read only that scope's
    counts. At most ``max_tokens`` tokens over all scopes; the oldest sequences are
    forgotten first (their counts subtracted), so memory stays bounded."""

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
            self._count(self.counts[old_scope], old, -1)
            if not self.counts[old_scope]:
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

    def walk(self, scope: Hashable, seq: list[int], k: int, min_prob: float) -> tuple[list[int], list[Any]]:
        """Up to ``k`` tokens following ``seq``: at each step the most frequent next token of
        the longest context seen; stop when the path's frequency product drops below ``min_prob``."""
        table = self.counts.get(scope)
        if not table:
            return [], []
        tokens, feats, path, ext = [], [], 1.0, list(seq[-max(self.orders) :])
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
            feats.append((order, min(int(p * 4), 3), min(len(tokens) - 1, 3)))
            ext.append(tok)
        return tokens, feats


class Suffix(FreeDrafter):
    """A suffix index over earlier sequences of the same scope (a job's rows, or the
    requests that share no scope), frequency-gated as SuffixDecoding does: a path is
    proposed while the product of its tokens' frequencies stays above ``min_prob``. Rows
    feed it as they finish. A seeded sampled row never reads it (its text must not depend
    on other requests)."""

    name = "suffix"
    shared = True

    def __init__(self, max_tokens: int = 200_000, min_prob: float = 0.1, prior: float = 0.3):
        super().__init__(prior)
        self.index = SuffixIndex(max_tokens)
        self.min_prob = min_prob

    def continuation(self, row: Row, k: int) -> tuple[list[int], list[Any]]:
        return self.follow(row, [], k)

    def follow(self, row: Row, drafts: list[int], k: int) -> tuple[list[int], list[Any]]:
        seq = row.seq[-max(self.index.orders) :] + drafts if drafts else row.seq
        return self.index.walk(row.req.scope, seq, k, self.min_prob)

    def finish(self, row: Row) -> None:
        self.index.add(row.req.scope, row.seq)


class ModelDrafter:
    """A draft model with its own KV cache (a distilled draft, a smaller model of the same
    family). It drafts k tokens for every row that chose it; its per-row acceptance is
    tracked (geometric model), starting from a running estimate over past rows.

    Two levels (``levels = 2``): the draft speculates too. A draft forward feeds, after the
    row's last token, a cheaper proposal of the free drafters the row may use (prompt lookup,
    the suffix index: ``FreeDrafter.follow`` over the row and the drafts so far) and keeps
    the longest prefix the draft itself would have produced, plus its own next token: one
    forward, several draft tokens. The rule one level down is the target's: greedy, the
    draft's argmax; sampled, a one-hot proposal accepted with the draft's probability of it,
    else the draft's residual sampled (``sampling.accept_sampled``), so every draft token
    follows the draft's own distribution, as the target's rejection rule requires. How much
    to check per forward is planned from the measured cost of a draft forward over w tokens
    (``autok.inner_plan``); none is a plain one-token step."""

    free, shared = False, False
    features: tuple[int, ...] = ()
    levels = 2  # its sessions check cheaper proposals (calibration times its forward at several widths)
    row_state: type[ModelRow]  # what a row keeps in row.state[name] (set below the class)

    def __init__(self, model: PreTrainedModel, vocab_size: int, name: str = "model", prior: float = 0.5):
        self.model, self.vocab_size, self.name = model, vocab_size, name
        self.prior = prior  # running acceptance estimate over finished rows

    def session(self, batch: Batch) -> ModelSession:
        return ModelSession(self, batch)

    def tracker(self, row: Row) -> AcceptanceTracker:
        st: ModelRow | None = row.state.get(self.name)
        if st is None:
            st = row.state[self.name] = self.row_state(AcceptanceTracker(self.prior))
        return st.tracker

    def rate(self, row: Row) -> float:
        return self.tracker(row).rate

    def finish(self, row: Row) -> None:
        st: ModelRow | None = row.state.get(self.name)
        if st is not None and st.used:
            self.prior = 0.7 * self.prior + 0.3 * st.tracker.rate

    def time_step(self, rows: int, ids: list[int]) -> Callable[[], float]:
        """A timing callback for calibration: one draft step of ``rows`` rows on ``ids``."""
        forward = self.time_forward(rows, ids)
        return lambda: forward(1)

    def time_forward(self, rows: int, ids: list[int]) -> Callable[[int], float]:
        """A timing callback for calibration: a draft forward of ``w`` tokens per row (two
        levels: the row's last token and w - 1 to check), all their logits kept."""
        cache = RaggedCache(self.model, rows)
        cache.forward([ids] * rows, 1)
        width = cache.width

        def forward(w: int) -> float:
            with Timer() as t:
                cache.forward([ids[:w]] * rows, w)
                hf.sync(self.model)
            cache.crop(width)
            return t.seconds

        return forward


@dataclass
class ModelRow:
    tracker: AcceptanceTracker
    dlen: int = 0  # tokens of row.seq in the draft cache
    used: bool = False


ModelDrafter.row_state = ModelRow


class ModelSession:
    free = False

    def __init__(self, drafter: ModelDrafter, batch: Batch):
        self.d, self.batch = drafter, batch
        self.cache = RaggedCache(drafter.model)
        self.joining: list[RaggedCache] = []
        # per drafting row of this iteration: the cache columns of what it fed first (its last
        # token, or the tokens it was behind) and of each draft token it fed after (d_0, d_1, ...)
        self.head_cols: dict[int, list[int]] = {}
        self.draft_cols: dict[int, list[int]] = {}

    def add(self, row: Row) -> None:
        """A fixed k > 0 drafts at once: prefill now; an auto row's cache is filled the first
        time it drafts with this model (never, while other drafters or k = 0 win)."""
        self.d.tracker(row)
        eager = row.k is not None and row.k > 0 and self.d.name in row.drafters
        self.joining.append(prefill(self.d.model, row.prompt if eager else [], row.stats, "draft_time_s"))
        row.state[self.d.name].dlen = len(row.prompt) - 1 if eager else 0

    def merge(self) -> None:
        if self.joining:
            self.cache.extend(self.joining)
            self.joining = []

    def keep(self, order: list[int]) -> None:
        self.merge()
        if order != list(range(self.cache.rows)):
            self.cache.keep_rows(order)
        self.cache.tidy()

    def behind(self, row: Row) -> int:
        return len(row.seq) - int(row.state[self.d.name].dlen)

    def shadow(self, row: Row, prop: Proposal, emitted: list[int]) -> None:
        pass  # a model drafter drafts only when chosen: every proposal it makes is verified

    def observe(self, row: Row, features: torch.Tensor) -> None:
        pass

    def catch_up(self, rows: list[Row], ks: dict[int, int]) -> None:
        """Bring the draft cache of every drafting row up to ``seq[:-1]``'s last token.

        The first draft step feeds each row what it missed, padded to the longest: B x W
        token passes. A row far behind (or never filled: an auto row's first drafting) is
        cheaper refilled alone from scratch, then only its last token is fed; choose the
        width W that minimises the total."""
        behind = {b: self.behind(rows[b]) for b in ks}

        def passes(w: int) -> int:
            return self.cache.rows * w + sum(len(rows[b].seq) - 1 for b, c in behind.items() if c > w)

        w = min({1, *behind.values()}, key=passes)
        for b, c in behind.items():
            if c > w:
                r = rows[b]
                self.cache.fill_row(b, prefill(self.d.model, r.seq, r.stats, "draft_time_s"))
                r.state[self.d.name].dlen = len(r.seq) - 1

    def check(self, row: Row, drafts: list[int], left: int, head: int, rows: int) -> list[int]:
        return to_check(self.batch, self.d.name, row, drafts, left, head, rows) if self.d.levels > 1 else []

    def propose(self, rows: list[Row], ks: dict[int, int]) -> dict[int, Proposal]:
        """Draft forwards until every row has its ``ks[b]`` tokens. Each forward feeds a row its
        pending token(s) and the cheaper proposal it checks (``check``); the row keeps the
        proposal's prefix the draft agrees with plus the draft's own next token, and the
        columns of the proposal's other tokens leave the cache at once."""
        self.merge()
        ks = {b: k for b, k in ks.items() if k > 0}
        if not ks:
            return {}
        self.catch_up(rows, ks)
        name, costs = self.d.name, self.batch.dec.costs
        drafts: dict[int, list[int]] = {b: [] for b in ks}
        qs: dict[int, list[torch.Tensor]] = {b: [] for b in ks}
        self.head_cols, self.draft_cols = {b: [] for b in ks}, {b: [] for b in ks}
        spent, steady = 0.0, True
        while left := {b: ks[b] - len(drafts[b]) for b in ks if len(drafts[b]) < ks[b]}:
            inputs: list[list[int]] = [[] for _ in rows]
            checked: dict[int, list[int]] = {}
            for b, n in left.items():
                st = rows[b].state[name]
                head = rows[b].seq[st.dlen :] if not drafts[b] else drafts[b][-1:]
                checked[b] = self.check(rows[b], drafts[b], n, len(head), len(left))
                inputs[b] = head + checked[b]
                steady = steady and len(head) == 1
            keep = 1 + max(len(c) for c in checked.values())
            with Timer() as t:
                logits = self.cache.forward(inputs, keep)[..., : self.d.vocab_size]
                hf.sync(self.d.model)
            spent += t.seconds
            fed = sum(len(x) for x in inputs)
            if all(len(x) - len(checked[b]) == 1 for b, x in enumerate(inputs) if x):  # no catch-up in it
                costs[len(left)].observe_draft(name, t.seconds, max(len(x) for x in inputs))
            for b in left:
                r, m, w = rows[b], len(checked[b]), self.cache.width
                r.stats.draft_forwards += 1
                r.stats.draft_time_s += t.seconds * len(inputs[b]) / fed
                a, nxt, q = accept_checked(r, checked[b], logits[b, keep - 1 - m :])
                cols = list(range(w - len(inputs[b]), w))
                self.cache.drop(b, cols[len(cols) - m + a :])  # the checked tokens the draft disagreed with
                (self.draft_cols[b] if drafts[b] else self.head_cols[b]).extend(cols[: len(cols) - m])
                self.draft_cols[b].extend(cols[len(cols) - m : len(cols) - m + a])
                r.state[name].dlen += len(inputs[b]) - m + a
                drafts[b] += checked[b][:a] + [nxt]
                qs[b] += q
            self.cache.trim()
        if steady:
            costs[len(rows)].observe_drafting(name, spent, max(ks.values()))
        return self.proposals(rows, ks, drafts, qs)

    def proposals(
        self, rows: list[Row], ks: dict[int, int], drafts: dict[int, list[int]], qs: dict[int, list[torch.Tensor]]
    ) -> dict[int, Proposal]:
        out: dict[int, Proposal] = {}
        for b, k in ks.items():
            st = rows[b].state[self.d.name]
            st.used = True
            out[b] = Proposal(self.d.name, drafts[b], qs[b] or None, [st.tracker.rate] * k, [None] * k)
        return out

    def commit(self, b: int, row: Row, prop: Proposal, n: int) -> None:
        """The draft keeps the drafts it was fed (d_0..d_{k-2}) that were accepted."""
        k = len(prop.tokens)
        st = row.state[self.d.name]
        st.tracker.update(k, n)
        dropped = self.draft_cols[b][n:]
        if dropped:
            self.cache.drop(b, dropped)
            st.dlen -= len(dropped)


class SelfDrafter(ModelDrafter):
    """The target's own weights, quantized (quant.py), as its draft. Its layers and KV layout
    are the target's, so a row's draft cache catches up by copying the target's keys and
    values of the positions it has not seen (the prompt, tokens another drafter had
    accepted) instead of running the draft over them: the target computed them anyway, and
    exactly. On a long prompt that prefill was most of a quantized draft's cost. The draft's
    own keys and values of the tokens it fed are dropped after each verification and the
    accepted positions copied from the target too, so its cache always holds the target's
    exact keys and values of ``seq[:dlen]``, and only the tokens in flight are its own."""

    def session(self, batch: Batch) -> SelfSession:
        return SelfSession(self, batch)


class SelfSession(ModelSession):
    d: SelfDrafter

    def add(self, row: Row) -> None:
        self.d.tracker(row)
        self.joining.append(RaggedCache(self.d.model, 1))  # filled from the target's cache when it drafts

    def behind(self, row: Row) -> int:
        return min(1, super().behind(row))  # a copy, not a forward, brings it up to date

    def catch_up(self, rows: list[Row], ks: dict[int, int]) -> None:
        """Every drafting row's cache up to ``seq[:-1]``: the target's cache holds exactly
        those positions (its last token is fed by the next verification)."""
        spans = {b: (rows[b].state[self.d.name].dlen, len(rows[b].seq) - 1) for b in ks}
        with Timer() as t:
            self.cache.append_from(self.batch.tcache, spans)
        for b, (start, end) in spans.items():
            rows[b].state[self.d.name].dlen = end
            rows[b].stats.draft_time_s += t.seconds * (end - start) / max(1, sum(e - s for s, e in spans.values()))

    def commit(self, b: int, row: Row, prop: Proposal, n: int) -> None:
        """Everything this iteration fed (the last token, then the drafts) leaves the cache:
        the next catch-up copies the accepted positions from the target."""
        st = row.state[self.d.name]
        st.tracker.update(len(prop.tokens), n)
        self.cache.drop(b, self.head_cols[b] + self.draft_cols[b])
        st.dlen = len(row.seq) - 1  # row.seq is not yet advanced


def to_check(batch: Batch, name: str, row: Row, drafts: list[int], left: int, head: int, rows: int) -> list[int]:
    """Two levels: the cheaper proposal the model drafter ``name``'s next forward for ``row``
    checks (at most ``left - 1`` tokens: the forward adds the draft's own), beside the
    ``head`` tokens it feeds anyway, in a forward of ``rows`` rows. The free drafters the row
    may use offer what follows ``row.seq + drafts``; the plan picks from measured costs
    (``autok.inner_plan``), or for a seeded sampled row, whose text must not depend on
    timings, the first offer whole."""
    inner = [d for d in batch.dec.drafters if isinstance(d, FreeDrafter) and d.name in row.drafters]
    if left < 2 or not inner:
        return []
    offers = (p for d in inner if (p := d.offer(row, left - 1, drafts)) is not None)
    if row.req.seed is not None and not row.req.greedy:
        return next((p.tokens for p in offers), [])
    best = inner_plan(batch.dec.costs[rows], name, offers, head)
    return best.tokens if best is not None else []


def accept_checked(row: Row, checked: list[int], logits: torch.Tensor) -> tuple[int, int, list[torch.Tensor]]:
    """Two levels, one level down: ``logits`` [m + 1, V] are the draft's at its last token
    and after each of the ``m`` ``checked`` tokens. Returns how many checked tokens the draft
    keeps, its own next token, and (sampled rows) the draft's distribution at each kept
    position and the next one: what the target's rejection rule needs of these tokens."""
    req = row.req
    if req.greedy:
        a, nxt = accept_greedy(checked, logits)
        return a, nxt, []
    q = probs(logits, req.temperature, req.top_k, req.top_p)
    a, nxt = accept_sampled(checked, None, q, row.gen)
    return a, nxt, list(q[: a + 1])


def pick(row: Row, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """A draft token from a draft model's logits (and its processed distribution when sampling)."""
    req = row.req
    if req.greedy:
        return int(logits.argmax()), None
    q = probs(logits[None], req.temperature, req.top_k, req.top_p)[0]
    return sample(q, row.gen), q


def prefill(
    model: PreTrainedModel, prompt: list[int], st: Stats, clock: str, features: tuple[int, ...] = ()
) -> RaggedCache:
    """A one-row cache holding ``prompt[:-1]`` (the last token is fed by the first step);
    with ``features``, those layers' outputs at its positions in ``last_features``."""
    own = RaggedCache(model, 1, features)
    if len(prompt) > 1:
        with Timer() as t:
            own.forward([prompt[:-1]], 1)
        setattr(st, clock, getattr(st, clock) + t.seconds)
    return own


if TYPE_CHECKING:
    _Counts = dict[tuple[int, ...], dict[int, int]]  # context -> {next token: count}
