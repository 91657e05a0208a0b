"""The drafter seam: what the decode loop asks of a drafter, and nothing else.

A ``Drafter`` belongs to a decoder (long-lived: a draft model, a suffix index shared by
requests, acceptance statistics). Each ``Batch`` opens one ``Session`` of every drafter for
its per-batch state (a draft model's KV cache, rows aligned with the batch's rows); a
row's own state lives in ``row.state[drafter.name]``. One iteration::

    free drafters      session.propose(rows, ks)  before the plan (their proposals cost no forward)
    the plan           which drafter and k per row (autok.plan: measured costs, drafter.rate(row))
    model drafters     session.propose(rows, ks)  for the rows that chose them (draft forwards,
                                                  each checking the free drafters' proposals: two levels)
    the target         verifies every row's [last token] + proposal in one forward
    each row           session.commit(b, row, proposal, n): n tokens accepted, roll back the rest
                       session.shadow(row, offer, emitted): a free proposal that was not verified

A new drafting method is one class with these methods plus one ``register_drafter`` call
(``registry.py``); the decoder, the pairs, the CLI and LangChain learn its name from there.
Most drafters subclass ``drafters.FreeDrafter`` (write ``continuation(row, k)``: tokens from
token ids, no model; ``follow(row, drafts, k)`` as well, and a model drafter's forwards check
its proposals after their own drafts too) or ``drafters.ModelDrafter`` (a draft model with
its own KV cache, ``levels = 2``: calibration also times its forward over several tokens).
``examples/custom_drafter.py`` adds one from outside the package.

Exactness is the loop's, not the drafter's: whatever a drafter proposes, the target's
verification decides every emitted token (greedy: identical to the target's; sampled: the
rejection rule with the proposal's ``q``, or a one-hot draft when ``q`` is None).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from .decoder import Batch, Row


@dataclass
class Proposal:
    """A drafter's tokens for one row, with their draft distributions (``q``; None for a
    deterministic drafter) and the estimated acceptance of each token given the ones before it."""

    drafter: str
    tokens: list[int]
    q: list[torch.Tensor] | None = None
    accept: list[float] = field(default_factory=list)  # estimated P(token i accepted | tokens before it were)
    features: list[Any] = field(default_factory=list)  # the drafter's acceptance bucket of each token

    def expected(self, k: int) -> float:
        """Expected tokens from one verification of the first ``k`` tokens (the target's own one included)."""
        e, run = 1.0, 1.0
        for a in self.accept[:k]:
            run *= a
            e += run
        return e

    def cut(self, k: int) -> Proposal:
        q = self.q[:k] if self.q is not None else None
        return Proposal(self.drafter, self.tokens[:k], q, self.accept[:k], self.features[:k])


class Session(Protocol):
    """A drafter's state for one batch. Rows are addressed by their place ``b`` in the batch."""

    def add(self, row: Row) -> None:
        """A row joined the batch (it is appended at the end at the next ``merge``)."""

    def merge(self) -> None:
        """Copy the rows that joined since the last call into the batch-wide state."""

    def keep(self, order: list[int]) -> None:
        """Rows left or moved: the new row ``i`` is the old row ``order[i]``."""

    def propose(self, rows: list[Row], ks: dict[int, int]) -> dict[int, Proposal]:
        """A proposal of at most ``ks[b]`` tokens for each row ``b`` asked (none if it has nothing)."""

    def commit(self, b: int, row: Row, prop: Proposal, n: int) -> None:
        """The target accepted the first ``n`` tokens of ``prop``: learn, and roll back the rest."""

    def shadow(self, row: Row, prop: Proposal, emitted: list[int]) -> None:
        """A free drafter's proposal that was not verified, and the tokens the row emitted."""

    def behind(self, row: Row) -> int:
        """Tokens this session must feed before it can draft for ``row`` (0 for free drafters)."""

    def observe(self, row: Row, features: torch.Tensor) -> None:
        """The target's features (``Drafter.features`` layers) at the row's new positions."""


class Drafter(Protocol):
    """What proposes tokens for the target to verify.

    ``free``: proposes from token ids alone (no forward); the batch asks it before planning
    and its proposals cost only their verification. Otherwise it runs a model: ``rate`` is
    its per-token acceptance estimate for a row and ``time_step`` times one of its draft
    steps (calibration), so the plan can weigh it. ``shared``: it learns from other requests
    (a seeded sampled row, whose text must depend on its seed alone, skips it). ``features``:
    the target layers whose outputs its sessions ``observe`` (empty for most). ``prior``:
    its acceptance estimate before a row has shown its own (a model drafter's running
    estimate over past rows chooses the batch size of a bulk job)."""

    name: str
    free: bool
    shared: bool
    features: tuple[int, ...]

    @property
    def prior(self) -> float: ...

    def session(self, batch: Batch) -> Session: ...

    def rate(self, row: Row) -> float:
        """The estimated probability that each drafted token is accepted, for this row."""

    def time_step(self, rows: int, ids: list[int]) -> Callable[[], float] | None:
        """A callback timing one draft step of ``rows`` rows on ``ids`` (None: no draft step)."""

    def finish(self, row: Row) -> None:
        """The row finished (a suffix index learns its text; an estimate its acceptance)."""


@dataclass(frozen=True)
class DraftContext:
    """What a drafter's factory gets from the decoder that builds it."""

    draft: Any  # the pair's draft: a causal LM, a feature-level draft (eagle.py), or None
    vocab_size: int  # the vocabulary target and draft share
    tokenizer: Any = None  # the pair's tokenizer (None when the decoder has none)
    target_file: str | None = None  # the file the target was loaded from, if one (a GGUF: llamacpp.py)
    context_length: int = 2048  # the longest sequence the decoder serves
