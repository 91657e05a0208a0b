"""One request while it decodes in a batch (and its result once finished)."""

from __future__ import annotations

import copy
import random
import time
import weakref
import zlib
from typing import Any

import torch

from . import tree
from .accounting import Ledger
from .drafting.base import Proposal, RowView, Sampling
from .grammar import RowGrammar
from .sampling import accept_greedy, accept_sampled, probs
from .text import TextStream
from .types import FinishReason, GenerationRequest, GenerationResult, Stats

_OWNERS: weakref.WeakValueDictionary[int, Row] = weakref.WeakValueDictionary()  # id(view) -> its row


class Row:
    """``drafters``: the names of the drafters it may use; ``k``: its fixed k (None: the
    batch's plan chooses); ``grammar``: its ``response_format``'s matcher (grammar.py), which
    masks its verified positions. ``view(name)`` is what drafter ``name`` sees of it."""

    def __init__(
        self,
        req: GenerationRequest,
        prompt: list[int],
        drafters: list[str],
        k: int | None,
        text: TextStream,
        eos: set[int],
        context_length: int,
        tag: Any = None,
        grammar: RowGrammar | None = None,
    ) -> None:
        self.req, self.tag, self.prompt, self.drafters, self.k = req, tag, prompt, drafters, k
        self.eos, self.context_length = eos, context_length
        self.seq = list(prompt)
        self.out: list[int] = []
        seed = req.seed if req.seed is not None else random.getrandbits(63)
        self.seed, self.gen = seed, torch.Generator().manual_seed(seed)
        self.sampling = Sampling(req.greedy, req.temperature, req.top_k, req.top_p, req.seed)
        self.views: dict[str, RowView] = {}
        self.stats = Stats(prompt_tokens=len(prompt))
        self.ledger = Ledger()
        self.text_stream = text
        self.grammar = grammar
        self.finish_reason: FinishReason | None = None
        self.result: GenerationResult | None = None
        self.t0 = time.perf_counter()

    @property
    def text(self) -> str:
        return self.text_stream.text

    @property
    def seeded(self) -> bool:
        return self.sampling.seed is not None and not self.sampling.greedy

    def view(self, drafter: str) -> RowView:
        """What ``drafter`` sees of the row, its own copy: the tokens (a list ``advance`` extends,
        or copies again where the drafter changed it), a state and a generator (seeded from the
        row's seed: a drafter's draws never move the row's own) of its own, a copy of the row's
        ``response_format``."""
        v = self.views.get(drafter)
        if v is None:
            gen = torch.Generator().manual_seed((self.seed + zlib.crc32(drafter.encode())) % 2**63)
            fmt = copy.deepcopy(self.req.response_format)
            v = RowView(
                list(self.seq), self.sampling, gen, tuple(self.drafters), self.req.scope, {}, fmt, len(self.prompt)
            )
            self.views[drafter], _OWNERS[id(v)] = v, self
        return v

    @staticmethod
    def of(view: RowView) -> Row | None:
        """The row whose view ``view`` is (None for a view the loop did not make)."""
        return _OWNERS.get(id(view))

    def forget(self, drafter: str) -> None:
        """The row drafts no more with ``drafter`` (it raised: decoder.Guarded)."""
        self.drafters = [d for d in self.drafters if d != drafter]
        for v in self.views.values():
            v.drafters = tuple(self.drafters)

    def room(self) -> int:
        return min(self.req.max_new_tokens - len(self.out), self.context_length - len(self.seq))

    def accept(self, prop: Proposal | None, logits: torch.Tensor) -> tuple[list[int], int]:
        """(the accepted drafts' indices in ``prop``, the target's next token) from the
        verification's logits: a chain's first n, or a tree's accepted path (tree.py)."""
        req = self.req
        drafts = prop.tokens if prop else []
        if prop is not None and prop.parents is not None:
            if req.greedy:
                return tree.accept_greedy(drafts, prop.parents, logits)
            p = probs(logits, req.temperature, req.top_k, req.top_p)
            return tree.accept_sampled(drafts, prop.parents, p, self.gen)
        if self.grammar is not None:
            logits = self.grammar.mask(logits, drafts)
        if req.greedy:
            n, nxt = accept_greedy(drafts, logits)
        else:
            p = probs(logits, req.temperature, req.top_k, req.top_p)
            q = torch.stack(prop.q) if prop and prop.q is not None else None
            n, nxt = accept_sampled(drafts, q, p, self.gen)
        return list(range(n)), nxt

    def advance(self, new: list[int]) -> None:
        """Append the iteration's tokens; decide whether the row is finished; stream."""
        cut = next((i + 1 for i, tok in enumerate(new) if tok in self.eos), None)
        new = new[:cut] if cut else new
        if self.grammar is not None:
            self.grammar.advance(new)
        n = len(self.seq)
        self.seq += new
        self.out += new
        for v in self.views.values():  # (a list each: a drafter's changes reach neither the row nor another drafter)
            if len(v.tokens) == n and (not n or v.tokens[-1] == self.seq[n - 1]):
                v.tokens += new  # (as it was: a step's tokens only)
            else:  # (its drafter changed it: the row's again)
                v.tokens = list(self.seq)
        self.ledger.emitted += len(new)
        if not self.stats.time_to_first_token_s:
            self.stats.time_to_first_token_s = time.perf_counter() - self.t0
        keep = self.text_stream.update(self.out)
        if keep is not None:  # (before an end-of-sequence token in the same step: k = 0 stopped a step before it)
            self.out = self.out[:keep]
            self.finish_reason = "stop"
        elif cut:
            self.finish_reason = "eos"
        elif len(self.out) >= self.req.max_new_tokens:
            self.finish_reason = "length"
        elif len(self.seq) >= self.context_length:
            self.finish_reason = "context"
        self.stream(final=self.finish_reason is not None)
        if self.text_stream.error is not None and self.finish_reason is None:  # (the caller gets the error)
            self.finish_reason = "cancelled"

    def stream(self, final: bool) -> None:
        self.text_stream.send(final)

    def finish(self) -> None:
        """The row's result (its drafters hear that it left when the batch lets it go)."""
        assert self.finish_reason is not None
        st = self.stats
        st.finish_reason = self.finish_reason
        self.ledger.close(st, time.perf_counter() - self.t0, len(self.out), self.finish_reason == "stop")
        self.result = GenerationResult(
            text=self.text,
            token_ids=list(self.out),
            finish_reason=st.finish_reason,
            stats=st,
            complete=None if self.grammar is None else self.grammar.complete(len(self.out)),
        )
