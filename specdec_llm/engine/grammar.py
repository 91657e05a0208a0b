"""Constrained decoding: a row's ``response_format`` as a grammar every emitted token satisfies.

The grammar engine is llguidance (JSON schema, regex, Lark), not ours. What is ours is how
it meets speculation, all of it exact:

- the target's logits are masked at every verified position (the mask after the row's tokens
  and the proposal's tokens before that position), so greedy rows emit the target's own
  constrained argmax and sampled rows sample its masked, renormalised distribution;
- a proposal is cut before its first token the grammar rejects (that token could never be
  accepted); a sampled proposal keeps the cut token's draft distribution, so the rejection
  rule samples the residual there exactly as if the token had been verified and rejected;
- the matcher consumes the row's emitted tokens only: proposals are checked on the matcher
  and rolled back.

Formats (OpenAI's ``response_format`` plus two of ours)::

    {"type": "json_schema", "json_schema": {"schema": {...}}}    # or {"schema": ...} directly
    {"type": "json_object"}                                      # any JSON object
    {"type": "regex", "regex": "..."}
    {"type": "grammar", "grammar": "<Lark>"}
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from .drafting.base import Proposal
from .types import FORMAT_FIELD as FIELD
from .types import RequestError, grammar_text


class Tokens:
    """A tokenizer as llguidance sees it (built once per decoder: about a second for 150k tokens)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]):
        try:
            import llguidance.hf
        except ImportError:  # pragma: no cover - a base dependency
            raise RequestError(FIELD, "needs the llguidance package: pip install llguidance") from None
        if tokenizer is None:
            raise RequestError(FIELD, "this pair has no tokenizer, so it cannot constrain its output; load one")
        eos = sorted(eos_token_ids) or None
        self.ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.compiled: dict[str, Any] = {}  # format (JSON) -> its matcher at the start

    def matcher(self, fmt: dict[str, Any]) -> RowGrammar:
        """A fresh matcher for ``fmt`` (a copy of one compiled per format: a copy is 1,000x cheaper)."""
        key = json.dumps(fmt)  # (not sorted: a schema's property order is its output's)
        if key not in self.compiled:
            self.compiled[key] = self._compile(key)
            while len(self.compiled) > 256:
                self.compiled.pop(next(iter(self.compiled)))
        return RowGrammar(self.compiled[key].deep_copy(), self.vocab_size)

    def _compile(self, key: str) -> Any:
        from llguidance import LLMatcher

        try:
            m = LLMatcher(self.ll, grammar_text(key))
        except (ValueError, RuntimeError) as e:
            raise RequestError(FIELD, f"does not compile: {e}") from None
        if m.is_error():
            raise RequestError(FIELD, f"does not compile: {m.get_error()}")
        return m


class RowGrammar:
    """One row's matcher, advanced by the tokens the row emits."""

    def __init__(self, matcher: Any, vocab_size: int):
        self.m = matcher
        self.words = (vocab_size + 31) // 32
        self.vocab_size = vocab_size
        self.accepting = [bool(matcher.is_accepting())]  # after each emitted token (a stop string may cut some)

    def valid(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (a proposal) the grammar accepts in a row."""
        return int(self.m.validate_tokens(tokens)) if tokens else 0

    def forced(self) -> list[int]:
        """The tokens the grammar admits alone from here (keys, punctuation): free drafts."""
        return [] if self.m.is_stopped() else list(self.m.compute_ff_tokens())

    def forced_after(self, drafts: list[int]) -> list[int]:
        """``forced()`` after ``drafts`` (which the grammar must accept), the matcher unchanged."""
        consumed = sum(self._consume(t) for t in drafts)
        out = self.forced()
        self._rollback(consumed)
        return out

    def _consume(self, token: int) -> int:
        """1 when ``token`` was pushed. A finished grammar takes nothing: an end-of-sequence
        token after it is accepted without a push, so rolling it back would undo a real token."""
        if self.m.is_stopped():
            return 0
        self.m.consume_token(token)
        return 1

    def _rollback(self, n: int) -> None:
        if n and not self.m.rollback(n):
            raise RuntimeError(f"grammar matcher could not roll back {n} tokens: {self.m.get_error()}")

    def mask(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """``logits`` [len(drafts) + 1, V] masked: position i allows what the grammar
        allows after the row's tokens and ``drafts[:i]`` (all of which it must accept)."""
        bits = np.empty((len(drafts) + 1, self.words), dtype=np.int32)
        consumed = 0
        for i in range(len(drafts) + 1):
            self.m.unsafe_compute_mask_ptr(bits[i].ctypes.data, bits[i].nbytes)
            consumed += self._consume(drafts[i]) if i < len(drafts) else 0
        self._rollback(consumed)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[-1]]
        return logits.masked_fill(torch.from_numpy(allowed == 0), float("-inf"))

    def advance(self, tokens: list[int]) -> None:
        """The row emitted ``tokens`` (every one allowed: the logits were masked)."""
        for t in tokens:
            if not self.m.is_stopped():
                self.m.consume_token(t)
            self.accepting.append(bool(self.m.is_accepting()))

    def complete(self, tokens: int) -> bool:
        """The row's first ``tokens`` output tokens are a whole sentence of the grammar."""
        return self.accepting[min(tokens, len(self.accepting) - 1)]


def cut(prop: Proposal, g: RowGrammar) -> Proposal:
    """``prop`` up to its first token ``g`` rejects; a sampled draft keeps that token's ``q``
    (the rejection rule samples its residual: sampling.accept_sampled)."""
    n = g.valid(prop.tokens)
    if n == len(prop.tokens):
        return prop
    short = prop.cut(n)
    if prop.q is not None:
        short.q = prop.q[: n + 1]
    return short
