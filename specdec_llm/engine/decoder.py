"""The speculative decoding loop over a batch of rows: draft -> verify -> accept -> roll back.

Every request is a row of a ``Batch`` (a single ``generate`` is a batch of one). An
iteration runs the draft k steps for all rows at once (one forward per step), then ONE
target forward verifies every row's ``[last token] + drafts``; each row accepts its own
longest agreeing prefix (greedy) or applies the rejection rule (sampling), so rows
advance by different amounts (ragged), finish at different times and leave, and new
rows join between iterations after their own prefill (continuous batching). Nothing
already in a cache is ever recomputed.

Invariant after every iteration, per row: the target's cache holds ``seq[:-1]`` (the last
emitted token is pending, its logits not yet computed) and the draft's cache holds
``seq[:dlen]``. Rolled-back positions become holes (see ragged.py). k = 0 is plain
target-only decoding through the same loop; k is chosen per iteration from the batch's
size and its rows' acceptance (autok.py), or fixed per request.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterable

import torch

from . import hf
from .autok import AcceptanceTracker, BatchCosts, KSchedule, Timer, calibrate
from .ragged import RaggedCache
from .sampling import accept_greedy, accept_sampled, probs, sample
from .types import GenerationRequest, GenerationResult, RequestError, Stats

TextCallback = Callable[[str], None]


class SpeculativeDecoder:
    """Holds a target, an optional draft and a tokenizer; serves requests one at a time
    (``generate``) or batched (``generate_many``, or a ``Batch`` driven step by step).

    ``vocab_size`` is the vocabulary both models share (a padded embedding beyond it is
    ignored). ``default_k`` is what a request's k="auto" means: "auto" (choose per
    iteration from measured costs) or a fixed integer. A seeded sampling request never
    uses the timing-driven schedule (the same seed must give the same text whatever the
    machine's timings): it uses ``default_k`` when that is an integer, else ``seeded_k``.
    """

    def __init__(
        self,
        target,
        draft=None,
        tokenizer=None,
        *,
        vocab_size: int | None = None,
        eos_token_ids: list[int] | None = None,
        max_k: int = 8,
        default_k: int | str = "auto",
        seeded_k: int = 4,
        context_length: int | None = None,
    ):
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        for model in (target, draft):
            if model is not None:
                hf.prepare(model)
        sizes = [m.config.vocab_size for m in (target, draft) if m is not None]
        self.vocab_size = vocab_size or min(sizes)
        if eos_token_ids is None:  # the generation config's, plus the tokenizer's (chat end-of-turn)
            eos = target.generation_config.eos_token_id if target.generation_config else None
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
            if tokenizer is not None and tokenizer.eos_token_id is not None:
                eos_token_ids.append(tokenizer.eos_token_id)
        self.eos_token_ids = set(eos_token_ids)
        self.context_length = context_length or getattr(target.config, "max_position_embeddings", None) or 2048
        self.max_k = max_k if draft is not None else 0
        self.default_k, self.seeded_k = default_k, seeded_k
        self.costs = BatchCosts(max_k=self.max_k)
        self.acceptance_prior = 0.5  # running estimate over finished requests

    @property
    def cost(self):
        """The cost model of single-request decoding."""
        return self.costs[1]

    # -- public -----------------------------------------------------------------------
    def encode(self, request: GenerationRequest) -> list[int]:
        if not isinstance(request.prompt, str):
            return list(request.prompt)
        if self.tokenizer is None:
            raise RequestError("prompt", "this decoder has no tokenizer; pass token ids")
        if request.chat:  # special-token text in a chat prompt could end the turn and inject another: refused
            from ..chat import check_turn_text

            check_turn_text(self.tokenizer, request.prompt, "prompt")
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": request.prompt}], tokenize=False, add_generation_prompt=True
            )
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(request.prompt)["input_ids"]

    def prepare(self, request: GenerationRequest) -> list[int]:
        """Validate and encode; RequestError names the field at fault."""
        request.validate()
        prompt = self.encode(request)
        if len(prompt) >= self.context_length:
            raise RequestError(
                "prompt",
                f"is {len(prompt)} tokens but the model's context is {self.context_length}; "
                f"shorten it by at least {len(prompt) - self.context_length + 1} tokens",
            )
        if any(t >= self.vocab_size for t in prompt):
            raise RequestError("prompt", f"has token ids outside the vocabulary (size {self.vocab_size})")
        return prompt

    def generate(self, request: GenerationRequest, on_text: TextCallback | None = None) -> GenerationResult:
        batch = Batch(self)
        row = batch.add(request, on_text)
        while batch.rows:
            batch.step()
        return row.result

    def generate_many(
        self, requests: Iterable[GenerationRequest], max_batch: int = 8
    ) -> list[GenerationResult | RequestError]:
        """Continuous batching over ``requests``: up to ``max_batch`` rows decode together, a
        finished row's place goes to the next request at once. A bad request's entry is its
        RequestError; the others are unaffected. Results in request order."""
        pending = deque(enumerate(requests))
        results: list = [None] * len(pending)
        self.calibrate_batches(min(max_batch, len(pending)))
        batch = Batch(self)
        while pending or batch.rows:
            while pending and len(batch.rows) < max_batch:
                i, req = pending.popleft()
                try:
                    batch.add(req, tag=i)
                except RequestError as e:
                    results[i] = e
            if batch.rows:
                for row in batch.step():
                    results[row.tag] = row.result
        return results

    # -- speed model ------------------------------------------------------------------
    def fixed_k(self, request: GenerationRequest) -> int | None:
        """The request's fixed k, or None when the batch's schedule chooses it."""
        if request.mode == "baseline" or self.draft is None:
            return 0
        k = request.k if request.k != "auto" else self.default_k
        if k != "auto":
            return k
        if request.seed is not None and not request.greedy:
            return self.seeded_k
        return None

    def calibrate_batches(self, max_batch: int) -> None:
        """Calibrate every batch-size bucket up to ``max_batch`` now (a few seconds each on a
        CPU), instead of stalling a running batch the first time it reaches a size."""
        if self.draft is None or self.default_k != "auto":
            return
        for rows in sorted({BatchCosts.bucket(r) for r in range(1, max_batch + 1)}):
            if not self.costs[rows].calibrated:
                self.calibrate(rows)

    def calibrate(self, rows: int = 1, context: int = 64) -> None:
        """Measure draft step and verify(k) times at a batch of ``rows`` on this device."""
        cost = self.costs[rows]
        rows = BatchCosts.bucket(rows)
        ids = [t % self.vocab_size for t in range(1, context + 1)]
        tcache, dcache = RaggedCache(self.target, rows), RaggedCache(self.draft, rows)
        tcache.forward([ids] * rows, 1)
        dcache.forward([ids] * rows, 1)

        def time_verify(k: int) -> float:
            with Timer() as t:
                tcache.forward([ids[: k + 1]] * rows, k + 1)
                hf.sync(self.target)
            tcache.crop(context)
            return t.seconds

        def time_draft() -> float:
            with Timer() as t:
                dcache.forward([ids[:1]] * rows, 1)
                hf.sync(self.draft)
            dcache.crop(context)
            return t.seconds

        time_verify(0), time_draft()  # warm up
        calibrate(cost, time_verify, time_draft)


class Row:
    """One request while it decodes (and its result once finished)."""

    def __init__(self, dec: SpeculativeDecoder, req: GenerationRequest, prompt: list[int], on_text, tag):
        self.dec, self.req, self.on_text, self.tag = dec, req, on_text, tag
        self.prompt = prompt
        self.seq = list(prompt)
        self.out: list[int] = []
        self.dlen = 0  # tokens of seq in the draft cache
        seed = req.seed if req.seed is not None else random.getrandbits(63)
        self.gen = torch.Generator().manual_seed(seed)
        self.k = dec.fixed_k(req)  # None: the batch's schedule chooses
        self.tracker = AcceptanceTracker(dec.acceptance_prior) if self.k is None else None
        self.stats = Stats(prompt_tokens=len(prompt))
        self.pos_proposed: list[int] = []
        self.pos_accepted: list[int] = []
        self.text = ""
        self.emitted_chars = 0
        self.finish_reason: str | None = None
        self.result: GenerationResult | None = None
        self.t0 = time.perf_counter()
        self.rows_seen = 0  # sum over iterations of the batch's size

    def room(self) -> int:
        return min(self.req.max_new_tokens - len(self.out), self.dec.context_length - len(self.seq))

    def pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A draft token from the draft's logits (and its processed distribution when sampling)."""
        if self.req.greedy:
            return int(logits.argmax()), None
        q = probs(logits[None], self.req.temperature, self.req.top_k, self.req.top_p)[0]
        return sample(q, self.gen), q

    def accept(self, drafts: list[int], qs: list, logits: torch.Tensor) -> tuple[int, int]:
        req = self.req
        if req.greedy:
            return accept_greedy(drafts, logits)
        p = probs(logits, req.temperature, req.top_k, req.top_p)
        return accept_sampled(drafts, torch.stack(qs) if qs else None, p, self.gen)

    def advance(self, k: int, n: int, new: list[int]) -> None:
        """Append the iteration's tokens; decide whether the row is finished; stream."""
        self.account(k, n)
        cut = next((i + 1 for i, tok in enumerate(new) if tok in self.dec.eos_token_ids), None)
        new = new[:cut] if cut else new
        self.seq += new
        self.out += new
        st = self.stats
        if not st.time_to_first_token_s:
            st.time_to_first_token_s = time.perf_counter() - self.t0
        self.text = self.decode(self.out)
        if cut:
            self.finish_reason = "eos"
        elif self.find_stop():
            self.finish_reason = "stop"
        elif len(self.out) >= self.req.max_new_tokens:
            self.finish_reason = "length"
        elif len(self.seq) >= self.dec.context_length:
            self.finish_reason = "context"
        self.stream(final=self.finish_reason is not None)
        if self.finish_reason:
            self.finish()

    # -- bookkeeping --------------------------------------------------------------------
    def account(self, k: int, n: int) -> None:
        st = self.stats
        st.target_forwards += 1
        st.k_values.append(k)
        st.draft_tokens_proposed += k
        st.draft_tokens_accepted += n
        while len(self.pos_proposed) < k:
            self.pos_proposed.append(0)
            self.pos_accepted.append(0)
        for i in range(k):
            self.pos_proposed[i] += 1
            self.pos_accepted[i] += i < n
        if k and self.tracker is not None:
            self.tracker.update(k, n)

    def decode(self, ids: list[int]) -> str:
        if self.dec.tokenizer is None:
            return ""
        return self.dec.tokenizer.decode(ids, skip_special_tokens=True)

    def find_stop(self) -> bool:
        """Cut text (and tokens) before the first stop string; True if one was found."""
        hits = [i for i in (self.text.find(s) for s in self.req.stop) if i >= 0]
        if not hits:
            return False
        cut = min(hits)
        self.text = self.text[:cut]
        keep = len(self.out)
        while keep and len(self.decode(self.out[:keep])) > cut:
            keep -= 1
        self.out = self.out[:keep]
        return True

    def stream(self, final: bool) -> None:
        """Send newly safe text: hold back what could still become a stop string."""
        if self.on_text is None:
            return
        safe = len(self.text)
        if not final:
            safe -= max((len(s) for s in self.req.stop), default=1) - 1
            while safe > self.emitted_chars and self.text[safe - 1] == "\ufffd":  # partial UTF-8
                safe -= 1
        if safe > self.emitted_chars:
            self.on_text(self.text[self.emitted_chars : safe])
            self.emitted_chars = safe

    def finish(self) -> None:
        st, dec = self.stats, self.dec
        wall = time.perf_counter() - self.t0
        st.finish_reason = self.finish_reason
        st.output_tokens = len(self.out)
        st.wall_time_s = wall
        st.tokens_per_s = st.output_tokens / wall if wall > 0 else 0.0
        st.acceptance_rate = st.draft_tokens_accepted / st.draft_tokens_proposed if st.draft_tokens_proposed else 0.0
        st.mean_accepted_length = st.output_tokens / st.target_forwards if st.target_forwards else 0.0
        st.per_position_acceptance = [a / p for a, p in zip(self.pos_accepted, self.pos_proposed)]
        st.batch_rows = self.rows_seen / st.target_forwards if st.target_forwards else 1.0
        if self.tracker is not None:
            dec.acceptance_prior = 0.7 * dec.acceptance_prior + 0.3 * self.tracker.rate
        self.result = GenerationResult(text=self.text, token_ids=list(self.out), finish_reason=self.finish_reason, stats=st)


class Batch:
    """Rows decoding together. ``add`` a request (prefilled alone, then merged), ``step``
    until ``rows`` is empty; ``step`` returns the rows that finished in it."""

    def __init__(self, dec: SpeculativeDecoder):
        self.dec = dec
        self.rows: list[Row] = []
        self.tcache = RaggedCache(dec.target)
        self.dcache = RaggedCache(dec.draft) if dec.draft is not None else None
        self.schedule = KSchedule()
        self.joining: list[list[RaggedCache]] = []  # per joined row: its own target (and draft) cache

    def add(self, request: GenerationRequest, on_text: TextCallback | None = None, tag=None) -> Row:
        """Join the batch (validates first: a RequestError leaves the batch untouched). The
        row is prefilled alone now and merged into the batch's caches at the next step, with
        every other row that joined meanwhile (one copy for a burst of joins)."""
        dec = self.dec
        prompt = dec.prepare(request)
        row = Row(dec, request, prompt, on_text, tag)
        own = [self._prefill(self.tcache.model, prompt, row.stats, "target_time_s")]
        if self.dcache is not None:
            # a fixed k > 0 drafts at once: prefill now; an auto row's draft is filled when the
            # schedule first drafts with it (never, while k = 0 wins)
            eager = row.k is not None and row.k > 0
            own.append(self._prefill(self.dcache.model, prompt if eager else [], row.stats, "draft_time_s"))
            row.dlen = len(prompt) - 1 if eager else 0
        self.joining.append(own)
        self.rows.append(row)
        return row

    @staticmethod
    def _prefill(model, prompt: list[int], st: Stats, clock: str) -> RaggedCache:
        """A one-row cache holding ``prompt[:-1]`` (the last token is fed by the first step)."""
        own = RaggedCache(model, 1)
        if len(prompt) > 1:
            with Timer() as t:
                own.forward([prompt[:-1]], 1)
            setattr(st, clock, getattr(st, clock) + t.seconds)
        return own

    def merge(self) -> None:
        """Move the caches of rows that joined since the last step into the batch's caches."""
        if self.joining:
            for cache, owns in zip((self.tcache, self.dcache), zip(*self.joining)):
                cache.extend(list(owns))
            self.joining = []

    def choose_k(self) -> list[int]:
        dec, rows = self.dec, self.rows
        auto = [b for b, r in enumerate(rows) if r.k is None]
        k_auto, probe = 0, None
        if auto:
            cost = dec.costs[len(rows)]
            if not cost.calibrated:
                dec.calibrate(len(rows))
            k_auto = self.schedule.next_k(cost, [rows[b].tracker.rate for b in auto])
            if self.schedule.probing:  # refresh the estimate on the row cheapest to bring up to date
                probe = min(auto, key=lambda b: len(rows[b].seq) - rows[b].dlen)
        ks = []
        for b, r in enumerate(rows):
            k = r.k if r.k is not None else (k_auto if probe in (None, b) else 0)
            ks.append(max(0, min(k, r.room() - 1)))
        return ks

    def catch_up(self, ks: list[int]) -> None:
        """Bring the draft cache of every drafting row up to ``seq[:-1]``'s last token.

        The first draft step feeds each row what it missed, padded to the longest: B x W
        token passes. A row far behind (or never filled: an auto row's first drafting) is
        cheaper refilled alone from scratch, then only its last token is fed; choose the
        width W that minimises the total."""
        rows, n_rows = self.rows, self.dcache.rows
        behind = {b: len(rows[b].seq) - rows[b].dlen for b in range(len(rows)) if ks[b]}
        if not behind:
            return

        def passes(w: int) -> int:
            return n_rows * w + sum(len(rows[b].seq) - 1 for b, c in behind.items() if c > w)

        w = min({1, *behind.values()}, key=passes)
        for b, c in behind.items():
            if c > w:
                r = rows[b]
                self.dcache.fill_row(b, self._prefill(self.dcache.model, r.seq, r.stats, "draft_time_s"))
                r.dlen = len(r.seq) - 1

    def step(self) -> list[Row]:
        self.merge()
        dec, rows = self.dec, self.rows
        ks = self.choose_k()
        big_k = max(ks)
        self.catch_up(ks)
        observe = any(r.k is None for r in rows)
        drafts: list[list[int]] = [[] for _ in rows]
        qs: list[list] = [[] for _ in rows]
        columns = []  # draft cache column fed at each draft step
        for j in range(big_k):
            inputs = [(r.seq[r.dlen :] if j == 0 else drafts[b][-1:]) if ks[b] > j else [] for b, r in enumerate(rows)]
            with Timer() as t:
                logits = self.dcache.forward(inputs, 1)[:, -1, : dec.vocab_size]
                hf.sync(dec.draft)
            columns.append(self.dcache.width - 1)
            fed = sum(len(x) for x in inputs)
            for b, r in enumerate(rows):
                if inputs[b]:
                    r.dlen += len(inputs[b])
                    r.stats.draft_forwards += 1
                    r.stats.draft_time_s += t.seconds * len(inputs[b]) / fed
                    tok, q = r.pick(logits[b])
                    drafts[b].append(tok)
                    if q is not None:
                        qs[b].append(q)
            if j and observe:  # one-token steps: the steady-state draft cost
                dec.costs[sum(1 for x in inputs if x)].observe_draft(t.seconds)

        inputs = [[r.seq[-1]] + drafts[b] for b, r in enumerate(rows)]
        with Timer() as t:
            logits = self.tcache.forward(inputs, big_k + 1)[..., : dec.vocab_size]
            hf.sync(dec.target)
        if observe:
            dec.costs[len(rows)].observe_verify(big_k, t.seconds)
        start = self.tcache.width - (big_k + 1)
        fed = sum(len(x) for x in inputs)
        for b, r in enumerate(rows):
            k = ks[b]
            r.stats.target_time_s += t.seconds * (k + 1) / fed
            r.rows_seen += len(rows)
            n, nxt = r.accept(drafts[b], qs[b], logits[b, big_k - k :])
            # roll back: the target keeps [last] + accepted drafts; the draft keeps the drafts it
            # was fed (d_0..d_{k-2}, at steps 1..k-1) that were accepted
            self.tcache.drop(b, range(start + big_k - k + 1 + n, start + big_k + 1))
            if k > 1 and n < k - 1:
                self.dcache.drop(b, [columns[j] for j in range(n + 1, k)])
                r.dlen -= k - 1 - n
            r.advance(k, n, drafts[b][:n] + [nxt])

        done = [r for r in rows if r.finish_reason]
        self.keep([b for b, r in enumerate(rows) if not r.finish_reason])
        return done

    def keep(self, index: list[int]) -> None:
        """Keep only the rows at ``index`` (the others leave the batch and its caches).
        Survivors keep their places; a place that empties is taken by a row from the end, so
        the caches copy only the rows that move."""
        self.merge()
        n, alive = len(index), set(index)
        tail = iter(b for b in index if b >= n)
        order = [b if b in alive else next(tail) for b in range(n)]
        for cache in (self.tcache, self.dcache):
            if cache is not None:
                if order != list(range(cache.rows)):
                    cache.keep_rows(order)
                cache.tidy()
        self.rows = [self.rows[b] for b in order]
