"""The drafter seam: what the decode loop and a drafter say to each other, all plain data.

A ``Drafter`` belongs to a decoder (long-lived: a draft model, a suffix index shared by
requests, acceptance statistics). Each batch opens one ``Session`` of every drafter for its
per-batch state (a draft model's KV cache). Rows are addressed by their place ``b`` in the
batch and seen as ``RowView``s, each drafter its own copy: tokens, sampling parameters, a
generator, state. One iteration::

    free drafters   session.propose(rows, ks)  before the plan (their proposals cost no forward)
    the plan        which drafter and k per row (measured costs, drafter.rate(row))
    model drafters  session.propose(rows, ks)  for the rows that chose them: Drafts, the
                                               proposals and a record of every forward run
    the target      verifies every row's [last token] + proposal in one forward
    every session   session.update(events)     Accepted per row, then Left for every row that
                                               left (for any reason), Moved, and Joined

The loop owns time and lifecycle: it feeds the ``Forward`` records to its cost model and
charges them to the rows; every row that leaves, finished or not, reaches every session as
``Left``, so a drafter's resources (a llama.cpp context) come back. No drafter sees the
loop's objects.

Ready for what comes next without another seam: a ``Proposal`` may carry ``parents`` (a tree
of candidates, one parent index per token; None is a chain), and a grammar is one more free
drafter (proposing forced tokens) plus ``Proposal.cut`` at the first token it rejects.

Exactness is the loop's, not the drafter's: whatever a drafter proposes, the target's
verification decides every emitted token (greedy: identical to the target's; sampled: the
rejection rule with the proposal's ``q``, or a one-hot draft when ``q`` is None).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Sampling:
    """A row's sampling parameters (``greedy``: temperature 0)."""

    greedy: bool = True
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


@dataclass(eq=False)
class RowView:
    """What a drafter sees of a row, its own copy (each drafter has one view per row, the same
    object while the row lasts): its tokens (prompt and output so far: a list of its own, which
    the loop extends as the row grows, or copies again where the drafter changed it), sampling,
    a generator of the drafter's own (seeded from the row's seed: its draws do not move the
    row's), the drafters the row may use, its scope (requests of one scope share what a suffix
    index learns), ``state`` (the drafter's own: by convention its slot is ``state[name]``),
    and its ``response_format`` (a grammar its output satisfies: forced.py) after
    ``prompt_length`` prompt tokens. Nothing a drafter does to its view changes the row."""

    tokens: list[int]
    sampling: Sampling = field(default_factory=Sampling)
    gen: torch.Generator | None = None
    drafters: tuple[str, ...] = ()
    scope: str | None = None
    state: dict[str, Any] = field(default_factory=dict)
    response_format: dict[str, Any] | None = None
    prompt_length: int = 0

    @property
    def seeded(self) -> bool:
        """A seeded sampled row: its text must depend on its seed alone (not on timings or
        other requests)."""
        return self.sampling.seed is not None and not self.sampling.greedy


@dataclass
class Proposal:
    """A drafter's tokens for one row, with their draft distributions (``q``; None for a
    deterministic drafter), the estimated acceptance of each token given the ones before it
    and each token's acceptance bucket (``buckets``: what its acceptance is learnt under).
    ``parents``: a tree's parent index per token (-1: the row's last token); None is a chain.
    ``branches``: a model drafter's own alternatives for a greedy row, each a path from the
    row's last token that leaves the chain where the draft's second choice may be the
    target's token (its ``accept`` there: the draft's p2 / (1 - p1)), with what the draft
    drafted after it; the loop may verify them as tree branches (branches.py)."""

    drafter: str
    tokens: list[int]
    q: list[torch.Tensor] | None = None
    accept: list[float] = field(default_factory=list)
    buckets: list[Hashable] = field(default_factory=list)
    parents: list[int] | None = None
    branches: list[Proposal] | None = None

    def expected(self, k: int) -> float:
        """Expected tokens from one verification of the first ``k`` tokens (the target's own one included)."""
        e, run = 1.0, 1.0
        for a in self.accept[:k]:
            run *= a
            e += run
        return e

    def cut(self, k: int) -> Proposal:
        """The first ``k`` tokens."""
        q = self.q[:k] if self.q is not None else None
        parents = self.parents[:k] if self.parents is not None else None
        branches = [p for p in self.branches or () if self.fork(p) < k] or None
        return Proposal(self.drafter, self.tokens[:k], q, self.accept[:k], self.buckets[:k], parents, branches)

    def fork(self, path: Proposal) -> int:
        """Where ``path`` leaves these tokens: the index of its first token that differs."""
        return next((i for i, (a, b) in enumerate(zip(path.tokens, self.tokens)) if a != b), len(self.tokens))


@dataclass(frozen=True)
class Forward:
    """One forward (or cache copy) a drafter ran: the rows it fed (place -> tokens), its width
    (the most tokens any row fed) and its seconds. ``kind``: "draft", a forward that fed each
    row its one pending token (and tokens to check), which the cost model learns from;
    "catch-up", one that also fed a row tokens it had missed; "prefill", a row's cache filled
    alone or copied (charged to its rows only)."""

    rows: dict[int, int]
    width: int
    seconds: float
    kind: str = "draft"
    branches: int = 0  # of its width, the tokens branches fed (model.py): not the chains' cost


@dataclass
class Drafts:
    """What ``Session.propose`` returns: a proposal per row (none where it has nothing) and
    the forwards it ran."""

    proposals: dict[int, Proposal] = field(default_factory=dict)
    forwards: list[Forward] = field(default_factory=list)


@dataclass(frozen=True)
class Joined:
    """Row ``b`` joined (appended at the end). ``features``: the target's outputs of the
    drafter's ``feature_layers`` at the prompt's positions (None if it reads none)."""

    b: int
    row: RowView
    features: torch.Tensor | None = None


@dataclass(frozen=True)
class Accepted:
    """Row ``b``'s verification: ``proposal`` is this session's for the row (None if it made
    none), ``n`` how many of its tokens the target accepted (None: not verified, another
    drafter's was), ``emitted`` the tokens the row emitted, ``features`` the target's outputs
    at the row's last token and the accepted drafts (None if the drafter reads none). Sent
    before the row's tokens grow by ``emitted``."""

    b: int
    row: RowView
    proposal: Proposal | None
    n: int | None
    emitted: list[int]
    features: torch.Tensor | None = None


@dataclass(frozen=True)
class Left:
    """Row ``b`` left the batch: ``finished`` (a result) or not (cancelled, timed out, a failed
    step). Its resources go back now; the places of the rows that stay change in ``Moved``."""

    b: int
    row: RowView
    finished: bool


@dataclass(frozen=True)
class Moved:
    """After rows left: the new row ``i`` is the old row ``order[i]``."""

    order: list[int]


Event = Joined | Accepted | Left | Moved


class Session(Protocol):
    """A drafter's state for one batch."""

    def propose(self, rows: Sequence[RowView], ks: dict[int, int]) -> Drafts:
        """A proposal of at most ``ks[b]`` tokens for each row ``b`` asked (none if it has nothing)."""

    def update(self, events: list[Event]) -> None:
        """What happened to the batch's rows since the last call, in order."""


class Drafter(Protocol):
    """What proposes tokens for the target to verify.

    ``free``: proposes from token ids alone (no forward); the loop asks it before planning and
    its proposals cost only their verification. Otherwise it runs a model: ``rate`` is its
    per-token acceptance estimate for a row, ``timer`` times its forwards (calibration) and
    ``levels`` is 2 where its forwards also check cheaper proposals (calibration then times
    them at several widths). ``shared``: it learns from other requests (a seeded sampled row
    skips it). ``feature_layers``: the target layers whose outputs its sessions get in
    ``Joined`` and ``Accepted`` (empty for most). ``prior``: its acceptance estimate before a
    row has shown its own. ``key``: what its measured costs depend on besides its name (a
    model's weights)."""

    name: str
    free: bool
    shared: bool
    levels: int
    feature_layers: tuple[int, ...]

    @property
    def prior(self) -> float: ...

    @property
    def key(self) -> str: ...

    def open(self, target: Any) -> Session:
        """A session for a batch whose target KV cache is ``target`` (read only: a self-draft
        copies the target's keys and values from it)."""

    def rate(self, row: RowView) -> float:
        """The estimated probability that each drafted token is accepted, for this row."""

    def timer(self, rows: int, ids: list[int]) -> Callable[[int], float] | None:
        """A callback timing one of its forwards of ``w`` tokens per row over ``rows`` rows on
        ``ids`` (None: it runs no forward)."""


Offers = Callable[[RowView, list[int], int], list[Proposal]]  # (row, drafts, k) -> the free drafters' offers
Price = Callable[[str, int, int], float]  # (drafter, rows, width) -> seconds of one of its forwards


def no_offers(row: RowView, drafts: list[int], k: int) -> list[Proposal]:
    return []


def unmeasured(name: str, rows: int, width: int) -> float:
    return 1.0 if width == 1 else float("inf")


@dataclass(frozen=True)
class DraftContext:
    """What a drafter's factory gets from the decoder that builds it. ``offers`` and ``price``
    serve two-level drafting (two_level.py): what the row's free drafters offer after its
    tokens and some drafts, and the measured seconds of a draft forward; ``grammar`` makes a
    row's grammar matcher (forced.py)."""

    draft: Any  # the pair's draft: a causal LM, a feature-level draft (eagle.py), or None
    vocab_size: int  # the vocabulary target and draft share
    tokenizer: Any = None  # the pair's tokenizer (None when the decoder has none)
    target_file: str | None = None  # the file the target was loaded from, if one (a GGUF: llamacpp.py)
    context_length: int = 2048  # the longest sequence the decoder serves
    offers: Offers = no_offers
    price: Price = unmeasured
    grammar: Callable[[dict[str, Any]], Any] | None = None  # response_format -> a fresh matcher (forced.py)
    trees: bool = True  # the loop verifies trees: a model drafter's alternatives are wanted (Proposal.branches)
    nodes: int = 8  # the most drafted tokens one verification of a row holds (its chain and branches)
    draft_file: str | None = None  # the file the pair's draft comes from, if a GGUF (llamacpp.py runs it)
