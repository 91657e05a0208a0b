"""One request while it decodes in a batch (and its result once finished)."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

import torch

from .accounting import Ledger
from .sampling import accept_greedy, accept_sampled, probs
from .text import TextCallback, TextStream
from .types import FinishReason, GenerationRequest, GenerationResult, Stats

if TYPE_CHECKING:
    from .decoder import SpeculativeDecoder
    from .protocol import Proposal


class Row:
    def __init__(
        self, dec: SpeculativeDecoder, req: GenerationRequest, prompt: list[int], on_text: TextCallback | None, tag: Any
    ) -> None:
        self.dec, self.req, self.tag = dec, req, tag
        self.prompt = prompt
        self.seq = list(prompt)
        self.out: list[int] = []
        seed = req.seed if req.seed is not None else random.getrandbits(63)
        self.gen = torch.Generator().manual_seed(seed)
        self.drafters = [d.name for d in dec.row_drafters(req)]
        self.k = dec.fixed_k(req)  # None: the batch's plan chooses
        self.state: dict[str, Any] = {}  # per drafter: that drafter's state for this row
        self.stats = Stats(prompt_tokens=len(prompt))
        self.ledger = Ledger()
        self.stream_ = TextStream(dec.tokenizer, req.stop, on_text)
        self.grammar = dec.grammar(req.response_format) if req.response_format is not None else None
        self.finish_reason: FinishReason | None = None
        self.result: GenerationResult | None = None
        self.t0 = time.perf_counter()

    @property
    def text(self) -> str:
        return self.stream_.text

    def room(self) -> int:
        return min(self.req.max_new_tokens - len(self.out), self.dec.context_length - len(self.seq))

    def accept(self, prop: Proposal | None, logits: torch.Tensor) -> tuple[int, int]:
        """(accepted drafts, the target's next token) from the verification's logits."""
        req = self.req
        drafts = prop.tokens if prop else []
        if self.grammar is not None:
            logits = self.grammar.mask(logits, drafts)
        if req.greedy:
            return accept_greedy(drafts, logits)
        p = probs(logits, req.temperature, req.top_k, req.top_p)
        q = torch.stack(prop.q) if prop and prop.q is not None else None
        return accept_sampled(drafts, q, p, self.gen)

    def advance(self, new: list[int]) -> None:
        """Append the iteration's tokens; decide whether the row is finished; stream."""
        cut = next((i + 1 for i, tok in enumerate(new) if tok in self.dec.eos_token_ids), None)
        new = new[:cut] if cut else new
        if self.grammar is not None:
            self.grammar.advance(new)
        self.seq += new
        self.out += new
        self.ledger.emitted += len(new)
        if not self.stats.time_to_first_token_s:
            self.stats.time_to_first_token_s = time.perf_counter() - self.t0
        keep = self.stream_.update(self.out, find_stop=not cut)  # (an end-of-sequence token ends the text)
        if cut:
            self.finish_reason = "eos"
        elif keep is not None:
            self.out = self.out[:keep]
            self.finish_reason = "stop"
        elif len(self.out) >= self.req.max_new_tokens:
            self.finish_reason = "length"
        elif len(self.seq) >= self.dec.context_length:
            self.finish_reason = "context"
        self.stream(final=self.finish_reason is not None)

    def stream(self, final: bool) -> None:
        self.stream_.send(final)

    def finish(self) -> None:
        assert self.finish_reason is not None
        st = self.stats
        st.finish_reason = self.finish_reason
        self.ledger.close(st, time.perf_counter() - self.t0, len(self.out), self.finish_reason == "stop")
        for d in self.dec.drafters:
            d.finish(self)
        self.result = GenerationResult(
            text=self.text, token_ids=list(self.out), finish_reason=st.finish_reason, stats=st
        )
