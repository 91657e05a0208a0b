"""The speculative decoding loop: draft -> verify -> accept -> roll back.

Invariant after every iteration: the target's KV cache holds ``seq[:-1]`` (the last
emitted token is pending, its logits not yet computed) and the draft's cache holds a
prefix of ``seq``. An iteration feeds the target ``seq[cached:] + drafts`` in ONE
forward, accepts the longest agreeing prefix (greedy) or applies the rejection rule
(sampling), and crops both caches back to what was emitted. Nothing already in a cache
is ever recomputed. k = 0 is plain target-only decoding through the same loop.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from . import hf
from .autok import CostModel, KPolicy, Timer, calibrate
from .sampling import accept_greedy, accept_sampled, probs, sample
from .types import GenerationRequest, GenerationResult, RequestError, Stats

TextCallback = Callable[[str], None]


class SpeculativeDecoder:
    """Holds a target, an optional draft and a tokenizer; ``generate`` serves one request.

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
        self.cost = CostModel(max_k=self.max_k)
        self.acceptance_prior = 0.5  # running estimate over finished requests

    # -- public -----------------------------------------------------------------------
    def encode(self, request: GenerationRequest) -> list[int]:
        if not isinstance(request.prompt, str):
            return list(request.prompt)
        if self.tokenizer is None:
            raise RequestError("prompt", "this decoder has no tokenizer; pass token ids")
        if request.chat:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": request.prompt}], tokenize=False, add_generation_prompt=True
            )
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(request.prompt)["input_ids"]

    def generate(self, request: GenerationRequest, on_text: TextCallback | None = None) -> GenerationResult:
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
        return _Run(self, request, prompt, on_text).loop()

    # -- speed model ------------------------------------------------------------------
    def policy_for(self, request: GenerationRequest) -> KPolicy | int:
        """A fixed k (int) or a KPolicy choosing k per iteration."""
        if request.mode == "baseline" or self.draft is None:
            return 0
        k = request.k if request.k != "auto" else self.default_k
        if k != "auto":
            return k
        if request.seed is not None and not request.greedy:
            return self.seeded_k
        if not self.cost.calibrated:
            self.calibrate()
        return KPolicy(self.cost, self.acceptance_prior)

    def calibrate(self, context: int = 64) -> None:
        """Measure draft step and verify(k) times on this device (once per decoder)."""
        ids = [t % self.vocab_size for t in range(1, context + 1)]
        tcache, dcache = hf.new_cache(self.target), hf.new_cache(self.draft)
        hf.forward(self.target, ids, tcache, 1)
        hf.forward(self.draft, ids, dcache, 1)

        def time_verify(k: int) -> float:
            with Timer() as t:
                hf.forward(self.target, ids[: k + 1], tcache, k + 1)
                hf.sync(self.target)
            hf.crop(tcache, context)
            return t.seconds

        def time_draft() -> float:
            with Timer() as t:
                hf.forward(self.draft, ids[:1], dcache, 1)
                hf.sync(self.draft)
            hf.crop(dcache, context)
            return t.seconds

        time_verify(0), time_draft()  # warm up
        calibrate(self.cost, time_verify, time_draft)


class _Run:
    """State of one request while it decodes."""

    def __init__(self, dec: SpeculativeDecoder, req: GenerationRequest, prompt: list[int], on_text):
        self.dec, self.req, self.on_text = dec, req, on_text
        self.prompt = prompt
        self.seq = list(prompt)
        self.out: list[int] = []
        self.tcache = hf.new_cache(dec.target)
        self.dcache = hf.new_cache(dec.draft) if dec.draft is not None else None
        self.dlen = 0  # tokens of seq in the draft cache
        seed = req.seed if req.seed is not None else random.getrandbits(63)
        self.gen = torch.Generator().manual_seed(seed)
        self.stats = Stats(prompt_tokens=len(prompt))
        self.pos_proposed: list[int] = []
        self.pos_accepted: list[int] = []
        self.text = ""
        self.emitted_chars = 0

    # -- one iteration ------------------------------------------------------------------
    def propose(self, k: int) -> tuple[list[int], torch.Tensor | None]:
        """k draft tokens (and their processed probabilities when sampling)."""
        dec, req = self.dec, self.req
        drafts: list[int] = []
        qs = []
        inp = self.seq[self.dlen :]
        catch_up = len(inp)  # > 1 after k = 0 iterations: the draft first catches up in one forward
        with Timer() as t:
            for _ in range(k):
                logits = hf.forward(dec.draft, inp, self.dcache, 1)[0, : dec.vocab_size]
                self.dlen += len(inp)
                self.stats.draft_forwards += 1
                if req.greedy:
                    tok = int(logits.argmax())
                else:
                    q = probs(logits[None], req.temperature, req.top_k, req.top_p)[0]
                    qs.append(q)
                    tok = sample(q, self.gen)
                drafts.append(tok)
                inp = [tok]
        self.stats.draft_time_s += t.seconds
        if k and catch_up == 1 and isinstance(self.policy, KPolicy):  # steady state: k one-token steps
            dec.cost.observe_draft(t.seconds / k)
        return drafts, (torch.stack(qs) if qs else None)

    def verify(self, drafts: list[int], q) -> tuple[int, int]:
        dec, req = self.dec, self.req
        k = len(drafts)
        cached = hf.cache_len(self.tcache)
        inp = self.seq[cached:] + drafts
        with Timer() as t:
            logits = hf.forward(dec.target, inp, self.tcache, k + 1)[:, : dec.vocab_size]
            if req.greedy:
                n, nxt = accept_greedy(drafts, logits)
            else:
                p = probs(logits, req.temperature, req.top_k, req.top_p)
                n, nxt = accept_sampled(drafts, q, p, self.gen)
        self.stats.target_forwards += 1
        self.stats.target_time_s += t.seconds
        if cached and isinstance(self.policy, KPolicy):  # skip the prefill: it is not a verify cost
            dec.cost.observe_verify(k, t.seconds)
        return n, nxt

    def loop(self) -> GenerationResult:
        dec, req, st = self.dec, self.req, self.stats
        self.policy = dec.policy_for(req)
        t0 = time.perf_counter()
        finish = None
        while finish is None:
            room = min(req.max_new_tokens - len(self.out), dec.context_length - len(self.seq))
            k = self.policy if isinstance(self.policy, int) else self.policy.next_k()
            k = max(0, min(k, room - 1))
            drafts, q = self.propose(k)
            n, nxt = self.verify(drafts, q)
            new = drafts[:n] + [nxt]
            self.account(k, n)
            # roll back: target keeps seq[:-1]; draft keeps what still agrees with seq
            before = len(self.seq)
            cut = next((i + 1 for i, tok in enumerate(new) if tok in dec.eos_token_ids), None)
            new = new[:cut] if cut else new
            self.seq += new
            self.out += new
            hf.crop(self.tcache, len(self.seq) - 1)
            if self.dcache is not None:
                self.dlen = min(self.dlen, before + n)
                hf.crop(self.dcache, self.dlen)
            if not st.time_to_first_token_s:
                st.time_to_first_token_s = time.perf_counter() - t0
            self.text = self.decode(self.out)
            if cut:
                finish = "eos"
            elif self.find_stop():
                finish = "stop"
            elif len(self.out) >= req.max_new_tokens:
                finish = "length"
            elif len(self.seq) >= dec.context_length:
                finish = "context"
            self.stream(final=finish is not None)
        return self.finish(finish, time.perf_counter() - t0)

    # -- bookkeeping --------------------------------------------------------------------
    def account(self, k: int, n: int) -> None:
        st = self.stats
        st.k_values.append(k)
        st.draft_tokens_proposed += k
        st.draft_tokens_accepted += n
        while len(self.pos_proposed) < k:
            self.pos_proposed.append(0)
            self.pos_accepted.append(0)
        for i in range(k):
            self.pos_proposed[i] += 1
            self.pos_accepted[i] += i < n
        if k and isinstance(self.policy, KPolicy):
            self.policy.tracker.update(k, n)

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

    def finish(self, reason: str, wall: float) -> GenerationResult:
        st, dec = self.stats, self.dec
        st.finish_reason = reason
        st.output_tokens = len(self.out)
        st.wall_time_s = wall
        st.tokens_per_s = st.output_tokens / wall if wall > 0 else 0.0
        st.acceptance_rate = st.draft_tokens_accepted / st.draft_tokens_proposed if st.draft_tokens_proposed else 0.0
        st.mean_accepted_length = st.output_tokens / st.target_forwards if st.target_forwards else 0.0
        st.per_position_acceptance = [a / p for a, p in zip(self.pos_accepted, self.pos_proposed)]
        if isinstance(self.policy, KPolicy):
            dec.acceptance_prior = 0.7 * dec.acceptance_prior + 0.3 * self.policy.tracker.rate
        return GenerationResult(text=self.text, token_ids=list(self.out), finish_reason=reason, stats=st)
