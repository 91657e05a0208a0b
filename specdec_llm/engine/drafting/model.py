"""A draft model's drafting, written once over a small ``Backend``.

``ModelSession.propose`` runs draft forwards until every row has its k tokens: each forward
feeds a row its pending token(s) and a cheaper proposal to check (two_level.py), keeps what
the draft agrees with plus its own next token, and gives the rest of the fed positions back
to the backend at once. After the verification (``Accepted``) the backend keeps the row's
tokens and the accepted drafts (``Backend.kept``). Backends: a ragged KV cache over the
batch (``RaggedBackend``, here), the target's cache copied (selfdraft.py), EAGLE's feature
inputs (eagle.py), a llama.cpp context per row (llamacpp.py).

A row's own state is ``row.state[name]`` (``ModelRow``): its acceptance (one estimator,
one bucket), how many of its tokens (then drafts) the backend holds, and the backend's
positions of what this iteration fed.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .. import hf
from ..ragged import RaggedCache, prefill
from ..timing import Timer
from .acceptance import RUNNING_WEIGHT, Acceptance
from .base import Accepted, DraftContext, Drafts, Event, Forward, Joined, Left, Moved, Proposal, RowView
from .two_level import accept_checked, to_check

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# a draft model's acceptance before any row has shown its own: an untrained or distilled draft
# of unknown quality, so neither trusted nor written off (the running estimate takes over)
DISTILLED_PRIOR = 0.5
# a draft's second choice is the target's token, where its first is not, with the chance the
# draft gives it (p2 / (1 - p1)) times this scale, learnt from the choices the target settled:
# drafts are overconfident there (the Qwen 0.5B's branch tokens: 4 accepted of 29 expected). It
# starts as if one in four of two expected hits came true; each settled choice weighs 1 and
# the older ones fade (SECOND_MEMORY per choice: about the last 50 count)
SECOND_PRIOR, SECOND_WEIGHT, SECOND_MEMORY = 0.25, 2.0, 0.98
# the running estimate over finished rows moves 0.3 of the way to each row's own rate: about
# the last three rows weigh in (a job's prompts drift; one odd row moves it little). A choice,
# not a measurement.
PRIOR_MEMORY = 0.7


def runner_ups(logits: torch.Tensor) -> list[tuple[int, float]]:
    """Per position of ``logits`` [n, V]: the draft's second choice, and its chance of being the
    target's token where the first is not, as the draft sees it (p2 / (1 - p1))."""
    logits = logits.float()
    top = logits.topk(2, -1)  # (no softmax over the vocabulary: its log-sum-exp is enough)
    p = (top.values - torch.logsumexp(logits, -1, keepdim=True)).exp()
    chance = (p[:, 1] / (1.0 - p[:, 0]).clamp_min(1e-6)).clamp(max=1.0)
    return list(zip(top.indices[:, 1].tolist(), chance.tolist()))


@dataclass
class Branch:
    """A greedy row's alternative path: it leaves the chain at draft ``fork`` with the draft's
    second choice there, then what the draft drafts after it (``tokens``, each with its
    estimated acceptance given the ones before). ``reach``: the chance that its last token is
    reached and is the target's. A branching backend feeds its tokens beside the chain's in
    the same forwards (``cols``: their cache columns); it sees the chain's first ``seen`` fed
    tokens (the row's tokens fed this iteration, then its drafts up to the fork)."""

    fork: int
    tokens: list[int]
    accept: list[float]
    reach: float
    seen: int
    chance: float  # the draft's own p2 / (1 - p1) at the fork
    cols: list[int] = field(default_factory=list)


@dataclass
class ModelRow:
    acceptance: Acceptance
    held: int = 0  # tokens of the row (then its drafts) the backend holds
    fed: list[Any] = field(default_factory=list)  # the backend's positions of what this iteration fed
    used: bool = False  # it drafted for this row
    branches: list[Branch] = field(default_factory=list)  # this iteration's alternative paths


class Backend:
    """Where a model drafter's tokens go. The defaults suit a backend whose state is all in
    ``row.state`` (a llama.cpp context); override what differs."""

    branching = False  # it can feed a row's branches beside its chain (``feed_tree``)

    def __init__(self, name: str, vocab_size: int) -> None:
        self.name, self.vocab_size = name, vocab_size

    def join(self, b: int, row: RowView, features: torch.Tensor | None) -> None:
        """Row ``b`` joined at the end (``features``: the target's at its prompt, if asked)."""

    def leave(self, b: int, row: RowView) -> None:
        """Row ``b`` left: give its resources back."""

    def move(self, order: list[int]) -> None:
        """The new row ``i`` is the old row ``order[i]``."""

    def observe(self, row: RowView, features: torch.Tensor) -> None:
        """The target's features at the row's last token and accepted drafts."""

    def fits(self, row: RowView, k: int) -> bool:
        """Whether it can draft ``k`` tokens for ``row`` now."""
        return True

    def prepare(self, rows: dict[int, RowView]) -> list[Forward]:
        """Bring each drafting row up to date before its first forward (what it still misses
        is fed by that forward); the forwards this ran."""
        return []

    def feed(
        self, rows: dict[int, RowView], inputs: dict[int, list[int]], keep: dict[int, int]
    ) -> tuple[dict[int, torch.Tensor], list[Forward]]:
        """Feed ``inputs[b]`` after what row ``b`` holds; logits [keep[b], V] of its last tokens."""
        raise NotImplementedError

    def feed_tree(
        self,
        rows: dict[int, RowView],
        inputs: dict[int, list[int]],
        keep: dict[int, int],
        feeding: dict[int, list[Branch]],
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], list[Forward]]:
        """``feed``, and ``feeding[b]``: the branches of row ``b`` whose next token this forward
        feeds too, before its inputs (each sees the chain up to its fork, its own tokens and
        itself); their logits [len(feeding[b]), V] (a branching backend)."""
        raise NotImplementedError

    def truncate(self, b: int, row: RowView, n: int) -> None:
        """Keep at most the first ``n`` of the row's tokens and drafts (only what this iteration fed goes)."""
        st = row.state[self.name]
        st.held = min(st.held, n)

    def unbranch(self, b: int, row: RowView) -> None:
        """The row's branches leave the cache (after their verification)."""
        row.state[self.name].branches = []

    def trim(self) -> None:
        """After a step's truncations (a batch-wide cache crops its unused columns)."""

    def kept(self, row: RowView, n: int) -> int:
        """What it keeps of the row once ``n`` of its drafts were accepted (before the row's
        tokens grow): the row's tokens and the accepted drafts it was fed."""
        return len(row.tokens) + n


class RaggedBackend(Backend):
    """A transformers causal LM with its own ragged KV cache over the batch (ragged.py)."""

    branching = True

    def __init__(self, name: str, vocab_size: int, model: PreTrainedModel, features: tuple[int, ...] = ()) -> None:
        super().__init__(name, vocab_size)
        self.model, self.features = model, features
        self.cache = RaggedCache(model, 0, features)
        # (a sliding window reads key positions off the valid columns, which a branch's would skew)
        self.branching = type(self).branching and not self.cache.attention.window
        self.joining: list[RaggedCache] = []
        # its own positions (a draft of learned absolute positions may hold fewer than the target)
        self.positions: int | None = getattr(model.config, "max_position_embeddings", None)

    def fits(self, row: RowView, k: int) -> bool:
        return self.positions is None or len(row.tokens) + k <= self.positions

    def join(self, b: int, row: RowView, features: torch.Tensor | None) -> None:
        self.joining.append(RaggedCache(self.model, 1, self.features))  # filled the first time it drafts

    def merge(self) -> None:
        if self.joining:
            self.cache.extend(self.joining)
            self.joining = []

    def move(self, order: list[int]) -> None:
        self.merge()
        if order != list(range(self.cache.rows)):
            self.cache.keep_rows(order)
        self.cache.tidy()

    def prepare(self, rows: dict[int, RowView]) -> list[Forward]:
        """The first forward feeds each row what it missed, padded to the longest: B x W token
        passes. A row far behind (or never filled: a row's first drafting) is cheaper refilled
        alone from scratch, then only its last token is fed: choose the W with the least passes."""
        self.merge()
        behind = {b: len(r.tokens) - r.state[self.name].held for b, r in rows.items()}

        def passes(w: int) -> int:
            return self.cache.rows * w + sum(len(rows[b].tokens) - 1 for b, c in behind.items() if c > w)

        w, out = min({1, *behind.values()}, key=passes), []
        for b, c in behind.items():
            if c > w:
                own, seconds = prefill(self.model, rows[b].tokens)
                self.cache.fill_row(b, own)
                rows[b].state[self.name].held = len(rows[b].tokens) - 1
                out.append(Forward({b: len(rows[b].tokens) - 1}, len(rows[b].tokens) - 1, seconds, "prefill"))
        return out

    def forward(
        self, inputs: list[list[int]], keep: int, embeds: list[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, float]:
        with Timer() as t:
            logits = self.cache.forward(inputs, keep, embeds)[..., : self.vocab_size]
            hf.sync(self.model)
        return logits, t.seconds

    def record(self, rows: dict[int, RowView], inputs: dict[int, list[int]], seconds: float) -> Forward:
        """Note the cache columns each row's tokens took; the forward's record."""
        w = self.cache.width
        for b, x in inputs.items():
            st = rows[b].state[self.name]
            st.fed += range(w - len(x), w)
            st.held += len(x)
        return Forward({b: len(x) for b, x in inputs.items()}, max(len(x) for x in inputs.values()), seconds)

    def feed(
        self, rows: dict[int, RowView], inputs: dict[int, list[int]], keep: dict[int, int]
    ) -> tuple[dict[int, torch.Tensor], list[Forward]]:
        width = max(keep.values())
        logits, seconds = self.forward([inputs.get(b, []) for b in range(self.cache.rows)], width)
        record = self.record(rows, inputs, seconds)
        return {b: logits[b, width - keep[b] :] for b in inputs}, [record]

    def feed_tree(
        self,
        rows: dict[int, RowView],
        inputs: dict[int, list[int]],
        keep: dict[int, int],
        feeding: dict[int, list[Branch]],
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], list[Forward]]:
        """Each row's chunk is its fed branches' next tokens, then its inputs."""
        chunks = [
            [br.tokens[len(br.cols)] for br in feeding.get(b, [])] + inputs.get(b, []) for b in range(self.cache.rows)
        ]
        sees = {b: self.sees(b, rows[b], len(chunks[b]), feeding.get(b, [])) for b in inputs}
        w = max(keep[b] + len(feeding.get(b, [])) for b in inputs)
        with Timer() as t:
            logits = self.cache.forward(chunks, w, sees=sees)[..., : self.vocab_size]
            hf.sync(self.model)
        chain = self.record(rows, inputs, t.seconds)  # (the chains' columns; the branches' are noted below)
        fed = {b: len(x) for b, x in enumerate(chunks) if x}
        record = Forward(fed, max(fed.values()), t.seconds, branches=max(fed.values()) - chain.width)
        out, side = {}, {}
        for b in inputs:
            nb = len(feeding.get(b, []))
            out[b], side[b] = logits[b, w - keep[b] :], logits[b, w - keep[b] - nb : w - keep[b]]
            for j, br in enumerate(feeding.get(b, [])):
                br.cols.append(self.cache.width - len(chunks[b]) + j)  # (chunks are left-padded)
        return out, side, [record]

    def sees(self, b: int, row: RowView, n: int, feeding: list[Branch]) -> tuple[torch.Tensor, torch.Tensor]:
        """What each of row ``b``'s ``n`` chunk tokens attends to (``RaggedCache.forward``'s
        ``sees``): the chain's tokens see the row without any branch; a branch's token sees
        the chain's first ``seen`` fed tokens, its own earlier tokens and itself."""
        st = row.state[self.name]
        base = self.cache.valid[b].clone()
        base[[c for br in st.branches for c in br.cols]] = False
        past = base.expand(n, -1).clone()
        mine = torch.ones(n, n, dtype=torch.bool).tril()
        for j, br in enumerate(feeding):
            past[j, st.fed[br.seen :]] = False
            past[j, br.cols] = True
            mine[j] = False
            mine[j, j] = True
        mine[len(feeding) :, : len(feeding)] = False
        return past, mine

    def truncate(self, b: int, row: RowView, n: int) -> None:
        st = row.state[self.name]
        if st.held > n:
            self.cache.drop(b, st.fed[n - st.held :])
            del st.fed[n - st.held :]
            st.held = n

    def unbranch(self, b: int, row: RowView) -> None:
        if cols := [c for br in row.state[self.name].branches for c in br.cols]:
            self.cache.drop(b, cols)
        super().unbranch(b, row)

    def trim(self) -> None:
        self.cache.trim()


class ModelDrafter:
    """A draft model with its own KV cache (a distilled draft, a smaller model of the same
    family), drafting in two levels. Its per-row acceptance starts from a running estimate
    over past rows (``prior``), which also chooses the batch size of a bulk job."""

    free, shared = False, False
    levels = 2  # its forwards check cheaper proposals (two_level.py)
    feature_layers: tuple[int, ...] = ()
    row_state = ModelRow  # what a row keeps in row.state[name]

    def __init__(
        self, model: PreTrainedModel | None, context: DraftContext, name: str = "model", prior: float = DISTILLED_PRIOR
    ):
        self.model, self.context, self.name = model, context, name
        self.prior = prior
        self._key: str | None = None
        self.second = [SECOND_PRIOR * SECOND_WEIGHT, SECOND_WEIGHT]  # (hits, chances) of settled second choices

    @property
    def key(self) -> str:
        if self._key is None:
            self._key = hf.weights_fingerprint(self.model) if self.model is not None else ""
        return self._key

    def backend(self, target: Any) -> Backend:
        assert self.model is not None
        return RaggedBackend(self.name, self.context.vocab_size, self.model)

    def open(self, target: Any) -> ModelSession:
        return ModelSession(self, self.backend(target))

    def state(self, row: RowView) -> ModelRow:
        st: ModelRow | None = row.state.get(self.name)
        if st is None:
            st = row.state[self.name] = self.row_state(Acceptance(self.prior, RUNNING_WEIGHT))
        return st

    def rate(self, row: RowView) -> float:
        return self.state(row).acceptance.rate()

    def second_chance(self, chance: float) -> float:
        """The chance that a second choice is the target's token where the first is not, from
        the draft's ``chance`` (p2 / (1 - p1)) and how such chances came true."""
        hits, chances = self.second
        return min(1.0, chance * hits / chances)

    def settle(self, branches: list[Branch], chain: list[int], emitted: list[int]) -> None:
        """The target's tokens (``emitted``, greedy) settle each second choice whose fork the
        chain reached and lost there: whether it was the target's token (a chain a grammar cut
        short settles only the forks it kept)."""
        for br in branches:
            i = br.fork
            if i < min(len(chain), len(emitted)) and emitted[:i] == chain[:i] and emitted[i] != chain[i]:
                hits, chances = self.second
                self.second = [SECOND_MEMORY * hits + (emitted[i] == br.tokens[0]), SECOND_MEMORY * chances + br.chance]

    def finish(self, row: RowView) -> None:
        st: ModelRow | None = row.state.get(self.name)
        if st is not None and st.used:
            self.prior = PRIOR_MEMORY * self.prior + (1 - PRIOR_MEMORY) * st.acceptance.rate()

    def timer(self, rows: int, ids: list[int]) -> Callable[[int], float]:
        """A draft forward of ``w`` tokens per row (the last token and w - 1 to check), all their
        logits kept: one forward of its model over the batch, or its own backend's ``feed``."""
        backend = self.backend(None)
        if not isinstance(backend, RaggedBackend):
            return feed_timer(self, backend, rows, ids)
        model = self.model
        assert model is not None
        cache = RaggedCache.filled(model, rows, ids)
        width = cache.width

        def forward(w: int) -> float:
            with Timer() as t:
                cache.forward([ids[:w]] * rows, w)
                hf.sync(model)
            cache.crop(width)
            return t.seconds

        return forward


def feed_timer(drafter: ModelDrafter, backend: Backend, rows: int, ids: list[int]) -> Callable[[int], float]:
    """``ModelDrafter.timer`` through a backend of the drafter's own: ``rows`` rows holding
    ``ids``, each forward fed ``w`` of them after and then truncated back."""
    views = {b: RowView(list(ids)) for b in range(rows)}
    for b, v in views.items():
        drafter.state(v)
        backend.join(b, v, None)
    backend.prepare(views)
    rest = {b: ids[drafter.state(v).held :] for b, v in views.items()}
    if any(rest.values()):
        backend.feed(views, {b: x for b, x in rest.items() if x}, {b: 1 for b, x in rest.items() if x})
    held = {b: drafter.state(v).held for b, v in views.items()}

    def forward(w: int) -> float:
        with Timer() as t:
            backend.feed(views, dict.fromkeys(views, ids[:w]), dict.fromkeys(views, w))
        for b, v in views.items():
            backend.truncate(b, v, held[b])
        return t.seconds

    def leave() -> None:  # (once the timer is gone: what its rows took, a pooled context, comes back)
        for b, v in views.items():
            backend.leave(b, v)

    weakref.finalize(forward, leave)
    return forward


class ModelSession:
    """The propose loop of every model drafter, over its backend."""

    def __init__(self, drafter: ModelDrafter, backend: Backend) -> None:
        self.d, self.backend = drafter, backend

    def update(self, events: list[Event]) -> None:
        for e in events:
            if isinstance(e, Joined):
                self.d.state(e.row)
                self.backend.join(e.b, e.row, e.features)
            elif isinstance(e, Accepted):
                if e.features is not None:
                    self.backend.observe(e.row, e.features)
                if e.proposal is not None and e.row.sampling.greedy:
                    self.d.settle(self.d.state(e.row).branches, e.proposal.tokens, e.emitted)
                self.backend.unbranch(e.b, e.row)
                if e.proposal is not None and e.n is not None:
                    self.d.state(e.row).acceptance.update([None] * len(e.proposal.tokens), e.n)
                    self.backend.truncate(e.b, e.row, self.backend.kept(e.row, e.n))
            elif isinstance(e, Left):
                self.backend.leave(e.b, e.row)
                if e.finished:
                    self.d.finish(e.row)
            elif isinstance(e, Moved):
                self.backend.move(e.order)
        self.backend.trim()

    def propose(self, rows: Sequence[RowView], ks: dict[int, int]) -> Drafts:
        """Draft forwards until every row has its ``ks[b]`` tokens (a row with nothing to feed
        yet, or that does not fit, has none)."""
        asked = {b: rows[b] for b, k in ks.items() if k > 0 and self.backend.fits(rows[b], k)}
        forwards = self.backend.prepare(asked)
        heads = {b: r.tokens[self.d.state(r).held :] for b, r in asked.items()}
        ks = {b: ks[b] for b in asked if heads[b]}
        for b in ks:
            rows[b].state[self.d.name].fed = []
        drafts: dict[int, list[int]] = {b: [] for b in ks}
        qs: dict[int, list[torch.Tensor]] = {b: [] for b in ks}
        while left := {b: ks[b] - len(drafts[b]) for b in ks if len(drafts[b]) < ks[b]}:
            forwards += self.step({b: rows[b] for b in left}, left, heads, drafts, qs)
        proposals = {}
        for b, k in ks.items():
            st = self.d.state(rows[b])
            st.used = True
            rate = [st.acceptance.rate()] * k
            paths = [
                Proposal(self.d.name, drafts[b][: br.fork] + br.tokens, None, rate[: br.fork] + br.accept)
                for br in st.branches
            ]
            proposals[b] = Proposal(self.d.name, drafts[b], qs[b] or None, rate, [None] * k, None, paths or None)
        return Drafts(proposals, forwards)

    def step(
        self,
        rows: dict[int, RowView],
        left: dict[int, int],
        heads: dict[int, list[int]],
        drafts: dict[int, list[int]],
        qs: dict[int, list[torch.Tensor]],
    ) -> list[Forward]:
        """One draft forward for the rows ``left`` to draft: each feeds its pending token(s)
        and what it checks, keeps what the draft agrees with plus the draft's own token (a
        sampled row: its draft distributions, ``qs``). A greedy row's second choices become
        branches, and the branches most likely to be the target's are drafted on in the same
        forward where a branching backend makes them worth their width (``branch``)."""
        inputs, checked = {}, {}
        for b, n in left.items():
            head = heads[b] if not drafts[b] else drafts[b][-1:]
            checked[b] = self.check(rows[b], drafts[b], n, len(head), len(left))
            inputs[b] = head + checked[b]
        keep = {b: len(c) + 1 for b, c in checked.items()}
        feeding = self.branch(rows, inputs, drafts, left) if self.backend.branching else {}
        hide = any(br.cols for b in rows for br in rows[b].state[self.d.name].branches)  # (branch columns cached)
        if feeding or hide:
            logits, side, forwards = self.backend.feed_tree(rows, inputs, keep, feeding)
        else:
            (logits, forwards), side = self.backend.feed(rows, inputs, keep), {}
        for b, row in rows.items():
            st, m, d0 = row.state[self.d.name], len(checked[b]), len(drafts[b])
            a, nxt, q = accept_checked(row, checked[b], logits[b])
            for br, out in zip(feeding.get(b, []), side.get(b, [])):  # each drafted branch's next token
                br.tokens.append(int(out.argmax()))
                br.accept.append(st.acceptance.rate())
                br.reach *= st.acceptance.rate()
            has_room = self.d.context.nodes > d0 + left[b]  # (a chain that fills the verification has no branch)
            if row.sampling.greedy and self.d.context.trees and has_room:  # the second choices at its new drafts
                rate, seen = st.acceptance.rate(), len(st.fed) - m  # (fed[:seen + j]: the token before draft d0 + j)
                for j, (token, chance) in enumerate(runner_ups(logits[b][: a + 1])):
                    p = self.d.second_chance(chance)
                    reach = rate ** (d0 + j) * (1 - rate) * p  # the chain reaches the fork, loses there, this wins
                    st.branches.append(Branch(d0 + j, [token], [p], reach, seen + j, chance))
            self.backend.truncate(b, row, st.held - (m - a))  # the checked tokens it disagreed with
            drafts[b] += checked[b][:a] + [nxt]
            qs[b] += q
        self.backend.trim()
        catching_up = any(len(x) - len(checked[b]) > 1 for b, x in inputs.items())
        return (
            [Forward(f.rows, f.width, f.seconds, "catch-up", f.branches) for f in forwards] if catching_up else forwards
        )

    def branch(
        self, rows: dict[int, RowView], inputs: dict[int, list[int]], drafts: dict[int, list[int]], left: dict[int, int]
    ) -> dict[int, list[Branch]]:
        """The branches each row drafts on in this forward: the likeliest first, as long as the
        verification has room for their tokens beside the chain (``DraftContext.nodes``) and
        one more token in this forward (at its measured seconds per width) costs less than the
        chance it is accepted times a draft step (what a token is at least worth)."""
        name, n, out = self.d.name, len(inputs), dict[int, list[Branch]]()
        width, step = max(len(x) for x in inputs.values()), self.d.context.price(name, n, 1)
        price = functools.cache(lambda w: self.d.context.price(name, n, max(width, w)))  # (padded to the widest)
        for b in inputs:
            branches = rows[b].state[name].branches
            room = self.d.context.nodes - len(drafts[b]) - left[b] - sum(len(br.tokens) for br in branches if br.cols)
            w = len(inputs[b])
            for br in sorted(branches, key=lambda br: -br.reach):
                if not br.reach * step >= price(w + 1) - price(w):  # (nor the less likely; unmeasured: nan, inf)
                    break
                cost = 1 if br.cols else 2  # (a branch not drafted on yet: its second choice joins too)
                if cost <= room:
                    out.setdefault(b, []).append(br)
                    room, w = room - cost, w + 1
        return out

    def check(self, row: RowView, drafts: list[int], left: int, head: int, rows: int) -> list[int]:
        if self.d.levels < 2:
            return []
        return to_check(self.d.context, self.d.name, row, drafts, left, head, rows)
