"""The speculative decoding loop over a batch of rows: propose -> verify -> accept -> commit.

Every request is a row of a ``Batch`` (a single ``generate`` is a batch of one). An
iteration asks the drafters (drafters.py: prompt lookup, a suffix index, a draft model)
for each row's proposal, then ONE target forward verifies every row's ``[last token] +
proposal``; each row accepts its own longest agreeing prefix (greedy) or applies the
rejection rule (sampling), and each drafter rolls back its own state. Rows advance by
different amounts (ragged), finish at different times and leave, and new rows join between
iterations after their own prefill (continuous batching). Nothing already in a cache is
ever recomputed.

Invariant after every iteration, per row: the target's cache holds ``seq[:-1]`` (the last
emitted token is pending, its logits not yet computed). Rolled-back positions become holes
(see ragged.py). k = 0 is plain target-only decoding through the same loop; which drafter
and k each row uses is chosen per iteration from measured costs and live acceptance
(autok.plan), or fixed per request.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import compiled, costcache, hf, registry
from . import drafters as drafting
from .autok import BatchCosts, CostModel, Probes, RowOptions, Timer, best_batch, calibrate, plan
from .protocol import DraftContext, Proposal
from .ragged import RaggedCache
from .sampling import accept_greedy, accept_sampled, probs
from .types import FinishReason, GenerationRequest, GenerationResult, RequestError, Stats

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from .protocol import Drafter, Session

TextCallback = Callable[[str], None]
# after this many drafting iterations in a row, one plain (k = 0) iteration: the target-only
# step it measures keeps the speedup's counterfactual honest (~1% of a drafting job's tokens)
PLAIN_EVERY = 64
# the first one comes sooner: until a batch size has seen a plain iteration, its k = 0 cost
# is the calibration's shape scaled by drafting iterations, which can be off by 10-20%
PLAIN_FIRST = 8
# plain iterations in a row each time: only one that follows a plain iteration is measured. The
# first forward after drafting runs with the draft's weights in the CPU's caches instead of the
# target's (measured 8% slower on a Xeon): target-only decoding never pays that
PLAIN_RUN = 2


class SpeculativeDecoder:
    """Holds a target, its drafters and a tokenizer; serves requests one at a time
    (``generate``) or batched (``generate_many``, or a ``Batch`` driven step by step).

    ``drafters``: names (``"lookup"``, ``"suffix"``, ``"model"``: the ``draft`` model) or
    drafter objects, in the order a fixed k tries them; default ``["model"]`` when a draft
    is given, else none. ``vocab_size`` is the vocabulary both models share (a padded
    embedding beyond it is ignored). ``kernel_cache``: a JSON file where the matmul kernel
    timings of this machine are kept (kernels.py; None measures at every load); the measured
    decoding costs (costcache.py) are kept beside it, in ``costs.json`` (or ``cost_cache``).
    ``compile_draft``: compile an int4 self-draft's one-token step (compiled.py: ~30-80 s
    once, kept only where it is measured faster on this machine).
    ``default_k`` is what a request's k="auto" means: "auto"
    (choose per iteration from measured costs) or a fixed integer. A seeded sampling request
    never uses the timing-driven schedule (the same seed must give the same text whatever
    the machine's timings): it uses ``default_k`` when that is an integer, else ``seeded_k``.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        drafters: list[str | Drafter] | None = None,
        vocab_size: int | None = None,
        eos_token_ids: list[int] | None = None,
        max_k: int = 8,
        default_k: int | str = "auto",
        seeded_k: int = 4,
        context_length: int | None = None,
        kernel_cache: Path | None = None,
        cost_cache: Path | str | None = None,
        compile_draft: bool = False,
    ) -> None:
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.kernels: dict[str, Any] = {}  # the matmul kernel chosen per weight shape and row count (CPU)
        models = [target] + ([registry.runnable(draft)] if draft is not None else [])
        for model in models:
            self.kernels.update(hf.prepare(model, kernel_cache))
        if compile_draft and draft is not None:  # kept where measured faster (compiled.py)
            self.kernels["compiled draft step"] = compiled.attach(models[-1])
        sizes = [m.config.vocab_size for m in models]
        self.vocab_size = vocab_size or min(sizes)
        if drafters is None:
            drafters = ["model"] if draft is not None else []
        names = [d for d in drafters if isinstance(d, str)]
        built = iter(registry.build(names, DraftContext(draft, self.vocab_size, tokenizer)))
        self.drafters: list[Drafter] = [next(built) if isinstance(d, str) else d for d in drafters]
        # the target layers whose outputs a feature-level drafter reads (eagle.py): every
        # target forward returns them (a pair has one draft, so at most one such drafter)
        self.feature_layers: tuple[int, ...] = next((d.features for d in self.drafters if d.features), ())
        if eos_token_ids is None:  # the generation config's, plus the tokenizer's (chat end-of-turn)
            eos = target.generation_config.eos_token_id if target.generation_config else None
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
            if tokenizer is not None and tokenizer.eos_token_id is not None:
                eos_token_ids.append(tokenizer.eos_token_id)
        self.eos_token_ids = set(eos_token_ids)
        self.context_length = context_length or getattr(target.config, "max_position_embeddings", None) or 2048
        self.max_k = max_k if self.drafters else 0
        self.default_k, self.seeded_k = default_k, seeded_k
        self.costs = BatchCosts(max_k=self.max_k)
        # per batch-size bucket: iterations in a row in which auto rows drafted, across batches
        # and requests (a request alone seldom reaches PLAIN_EVERY iterations)
        self.drafting_runs: dict[int, int] = {}
        self.plain_left: dict[int, int] = {}  # per bucket: forced plain iterations still to run
        if cost_cache is None and kernel_cache is not None:
            cost_cache = Path(kernel_cache).with_name(costcache.FILE)
        self.cost_cache = None if cost_cache is None else Path(cost_cache)
        self._cost_key: str | None = None

    @property
    def cost(self) -> CostModel:
        """The cost model of single-request decoding."""
        return self.costs[1]

    @property
    def drafter_names(self) -> list[str]:
        return [d.name for d in self.drafters]

    def drafter(self, name: str) -> Drafter:
        return next(d for d in self.drafters if d.name == name)

    # -- public -----------------------------------------------------------------------
    def encode(self, request: GenerationRequest) -> list[int]:
        if not isinstance(request.prompt, str):
            return list(request.prompt)
        if self.tokenizer is None:
            raise RequestError("prompt", "this decoder has no tokenizer; pass token ids")
        if request.chat:  # special-token text in a chat prompt could end the turn and inject another: refused
            from .chat import check_turn_text

            check_turn_text(self.tokenizer, request.prompt, "prompt")
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": request.prompt}], tokenize=False, add_generation_prompt=True
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(request.prompt)["input_ids"])

    def prepare(self, request: GenerationRequest) -> list[int]:
        """Validate and encode; RequestError names the field at fault."""
        request.validate()
        if request.drafter != "auto" and request.drafter not in self.drafter_names:
            known = ", ".join(["auto", *self.drafter_names])
            raise RequestError("drafter", f"unknown drafter {request.drafter!r} for this pair; use one of: {known}")
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
        if self.row_drafters(request):  # before the request's clock starts (cached on disk: no time)
            self.ensure_calibrated(1)
        batch = Batch(self)
        row = batch.add(request, on_text)
        while batch.rows:
            batch.step()
        self.save_costs()
        assert row.result is not None  # a row leaves the batch finished
        return row.result

    def generate_many(
        self, requests: Iterable[GenerationRequest], max_batch: int = 8
    ) -> list[GenerationResult | RequestError]:
        """Continuous batching over ``requests``: up to ``max_batch`` rows decode together, a
        finished row's place goes to the next request at once. A bad request's entry is its
        RequestError; the others are unaffected. Results in request order."""
        pending = deque(enumerate(requests))
        results: list[Any] = [None] * len(pending)
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
        self.save_costs()
        return results

    # -- speed model ------------------------------------------------------------------
    def row_drafters(self, request: GenerationRequest) -> list[Drafter]:
        """The drafters a request may use, in order. A seeded sampled row skips drafters that
        learn from other requests: its text must depend on its seed alone."""
        if request.mode == "baseline":
            return []
        ds = self.drafters if request.drafter == "auto" else [d for d in self.drafters if d.name == request.drafter]
        if request.seed is not None and not request.greedy:
            ds = [d for d in ds if not d.shared]
        return ds

    def fixed_k(self, request: GenerationRequest) -> int | None:
        """The request's fixed k, or None when the batch's plan chooses it."""
        if not self.row_drafters(request):
            return 0
        k = request.k if request.k != "auto" else self.default_k
        if isinstance(k, int):
            return k
        if request.seed is not None and not request.greedy:
            return self.seeded_k
        return None

    def calibrate_batches(self, max_batch: int) -> None:
        """Calibrate every batch-size bucket up to ``max_batch`` now, instead of stalling a
        running batch the first time it reaches a size: from the on-disk cache when it has
        this machine's figures, else measured (a few seconds each on a CPU) and cached. Also
        with a fixed k: a drafting iteration's target-only counterfactual reads the costs."""
        if not self.drafters:
            return
        for rows in sorted({BatchCosts.bucket(r) for r in range(1, max_batch + 1)}):
            self.ensure_calibrated(rows)

    def best_batch(self, cap: int = 32) -> int:
        """The batch size up to ``cap`` that decodes a bulk job fastest on this machine, from
        the measured costs of every batch-size bucket (cached on disk: a second process
        measures nothing) and the model drafters' acceptance so far (autok.best_batch)."""
        buckets = sorted({BatchCosts.bucket(r) for r in range(1, cap + 1)})
        for rows in buckets:
            self.ensure_calibrated(rows)
        rates = {d.name: d.prior for d in self.drafters if not d.free}
        return min(cap, best_batch({b: self.costs[b] for b in buckets}, rates))

    def ensure_calibrated(self, rows: int) -> None:
        """The cost model of a batch of ``rows`` ready: loaded from the cache, else measured."""
        cost = self.costs[rows]
        if cost.calibrated:
            return
        entry = costcache.load(self.cost_cache).get(self._cache_key(rows)) if self.cost_cache else None
        if entry:
            try:
                cost.load(entry)
                if cost.calibrated:
                    return
            except (KeyError, TypeError, ValueError):  # a damaged entry: measure again
                pass
        self.calibrate(rows)
        self.save_costs(rows)

    def _cache_key(self, rows: int) -> str:
        if self._cost_key is None:
            self._cost_key = costcache.decoder_key(self)
        return f"{self._cost_key}|rows {BatchCosts.bucket(rows)}"

    def save_costs(self, rows: int | None = None) -> None:
        """Write the calibrated buckets' live figures (or bucket ``rows``'s) to the cache."""
        if self.cost_cache is None:
            return
        buckets = [BatchCosts.bucket(rows)] if rows is not None else list(self.costs.models)
        entries = {
            self._cache_key(b): self.costs.models[b].to_dict() for b in buckets if self.costs.models[b].calibrated
        }
        costcache.save(self.cost_cache, entries)

    def calibrate(self, rows: int = 1, context: int = 64) -> None:
        """Measure verify(k) at every k and each model drafter's step at a batch of ``rows``."""
        cost = self.costs[rows]
        rows = BatchCosts.bucket(rows)
        ids = [t % self.vocab_size for t in range(1, context + 1)]
        tcache = RaggedCache(self.target, rows)
        tcache.forward([ids] * rows, 1)
        for b in range(rows):  # holes, as rolled-back drafts leave them: the masked path real iterations take
            tcache.drop(b, range(context // 2, context // 2 + 3))

        def time_verify(k: int) -> float:
            with Timer() as t:
                tcache.forward([ids[: k + 1]] * rows, k + 1)
                hf.sync(self.target)
            tcache.crop(context)
            return t.seconds

        steps = {d.name: step for d in self.drafters if (step := d.time_step(rows, ids)) is not None}
        time_verify(0), [fn() for fn in steps.values()]  # warm up
        # every k for small batches; wide batches at a few (drafting seldom pays there, and each
        # point costs a forward of rows * (k + 1) tokens): the others are interpolated
        points = range(self.max_k + 1) if rows <= 4 else sorted({0, 1, 2, 4, self.max_k})
        calibrate(cost, time_verify, steps, points=[p for p in points if p <= self.max_k])


class Row:
    """One request while it decodes (and its result once finished)."""

    def __init__(
        self, dec: SpeculativeDecoder, req: GenerationRequest, prompt: list[int], on_text: TextCallback | None, tag: Any
    ) -> None:
        self.dec, self.req, self.on_text, self.tag = dec, req, on_text, tag
        self.prompt = prompt
        self.seq = list(prompt)
        self.out: list[int] = []
        seed = req.seed if req.seed is not None else random.getrandbits(63)
        self.gen = torch.Generator().manual_seed(seed)
        self.drafters = [d.name for d in dec.row_drafters(req)]
        self.k = dec.fixed_k(req)  # None: the batch's plan chooses
        self.state: dict[str, Any] = {}  # per drafter: that drafter's state for this row
        self.stats = Stats(prompt_tokens=len(prompt))
        self.pos_proposed: list[int] = []
        self.pos_accepted: list[int] = []
        self.text = ""
        self.emitted_chars = 0
        self.finish_reason: FinishReason | None = None
        self.result: GenerationResult | None = None
        self.t0 = time.perf_counter()
        self.rows_seen = 0  # sum over iterations of the batch's size
        # the target-only counterfactual (Stats.baseline_s): seconds of this row's iterations,
        # and what its tokens would have cost at the target-only step of the same batch sizes
        self.spent_s = 0.0
        self.plain_s = 0.0
        self.plain_step = 0.0  # of the last iteration
        self.emitted = 0  # tokens appended (before a stop string cut them)

    def room(self) -> int:
        return min(self.req.max_new_tokens - len(self.out), self.dec.context_length - len(self.seq))

    def accept(self, prop: Proposal | None, logits: torch.Tensor) -> tuple[int, int]:
        req = self.req
        drafts = prop.tokens if prop else []
        if req.greedy:
            return accept_greedy(drafts, logits)
        p = probs(logits, req.temperature, req.top_k, req.top_p)
        q = torch.stack(prop.q) if prop and prop.q is not None else None
        return accept_sampled(drafts, q, p, self.gen)

    def advance(self, drafter: str | None, k: int, n: int, new: list[int]) -> None:
        """Append the iteration's tokens; decide whether the row is finished; stream."""
        self.account(drafter, k, n)
        cut = next((i + 1 for i, tok in enumerate(new) if tok in self.dec.eos_token_ids), None)
        new = new[:cut] if cut else new
        self.seq += new
        self.out += new
        self.emitted += len(new)
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

    # -- bookkeeping --------------------------------------------------------------------
    def account(self, drafter: str | None, k: int, n: int) -> None:
        st = self.stats
        st.target_forwards += 1
        st.k_values.append(k)
        st.draft_tokens_proposed += k
        st.draft_tokens_accepted += n
        if drafter is not None and k:
            counts = st.drafter_tokens.setdefault(
                drafter, {"proposed": 0, "accepted": 0, "drafts": 0, "accepted_per_position": []}
            )
            counts["proposed"] += k
            counts["accepted"] += n
            counts["drafts"] += 1
            per_pos = counts["accepted_per_position"]
            per_pos += [0] * (n - len(per_pos))
            for i in range(n):
                per_pos[i] += 1
        while len(self.pos_proposed) < k:
            self.pos_proposed.append(0)
            self.pos_accepted.append(0)
        for i in range(k):
            self.pos_proposed[i] += 1
            self.pos_accepted[i] += i < n

    def decode(self, ids: list[int]) -> str:
        if self.dec.tokenizer is None:
            return ""
        return str(self.dec.tokenizer.decode(ids, skip_special_tokens=True))

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
        assert self.finish_reason is not None
        st = self.stats
        wall = time.perf_counter() - self.t0
        st.finish_reason = self.finish_reason
        st.output_tokens = len(self.out)
        st.wall_time_s = wall
        st.tokens_per_s = st.output_tokens / wall if wall > 0 else 0.0
        # target-only, the request would have spent the same time outside its iterations
        # (prefill, joins, waits) and one plain step per token (plus the one that reveals a
        # stop string) instead of its iterations
        extra = self.emitted - len(self.out) - (self.finish_reason == "stop")
        plain = self.plain_s - max(0, extra) * self.plain_step
        st.baseline_s = max(0.0, wall - self.spent_s + plain)
        st.acceptance_rate = st.draft_tokens_accepted / st.draft_tokens_proposed if st.draft_tokens_proposed else 0.0
        st.mean_accepted_length = st.output_tokens / st.target_forwards if st.target_forwards else 0.0
        st.per_position_acceptance = [a / p for a, p in zip(self.pos_accepted, self.pos_proposed)]
        st.batch_rows = self.rows_seen / st.target_forwards if st.target_forwards else 1.0
        st.drafter = max(st.drafter_tokens, key=lambda d: st.drafter_tokens[d]["proposed"], default="none")
        for d in self.dec.drafters:
            d.finish(self)
        reason = self.finish_reason
        self.result = GenerationResult(text=self.text, token_ids=list(self.out), finish_reason=reason, stats=st)


class Batch:
    """Rows decoding together. ``add`` a request (prefilled alone, then merged), ``step``
    until ``rows`` is empty; ``step`` returns the rows that finished in it."""

    offers: dict[int, dict[str, Proposal]]  # the free drafters' proposals of this iteration

    def __init__(self, dec: SpeculativeDecoder):
        self.dec = dec
        self.rows: list[Row] = []
        self.tcache = RaggedCache(dec.target, 0, dec.feature_layers)
        self.sessions: dict[str, Session] = {d.name: d.session(self) for d in dec.drafters}
        # sessions that read the target's features of each row's new positions (eagle.py)
        self.watchers = [self.sessions[d.name] for d in dec.drafters if d.features]
        self.probes = Probes()
        self.joining: list[RaggedCache] = []  # the target caches of rows that joined since the last step
        self.plain_before = False  # whether the last iteration was a plain one (k = 0 for every row)

    def add(self, request: GenerationRequest, on_text: TextCallback | None = None, tag: Any = None) -> Row:
        """Join the batch (validates first: a RequestError leaves the batch untouched). The
        row is prefilled alone now and merged into the batch's caches at the next step, with
        every other row that joined meanwhile (one copy for a burst of joins)."""
        dec = self.dec
        prompt = dec.prepare(request)
        row = Row(dec, request, prompt, on_text, tag)
        own = drafting.prefill(dec.target, prompt, row.stats, "target_time_s", dec.feature_layers)
        self.joining.append(own)
        for session in self.sessions.values():
            session.add(row)
        if own.last_features is not None:
            for w in self.watchers:
                w.observe(row, own.last_features[0])
        self.rows.append(row)
        return row

    def merge(self) -> None:
        """Move the caches of rows that joined since the last step into the batch's caches."""
        if self.joining:
            self.tcache.extend(self.joining)
            self.joining = []
        for session in self.sessions.values():
            session.merge()

    def choose(self) -> list[tuple[str | None, int]]:
        """Each row's (drafter, k) for this iteration. A fixed k uses the first of the row's
        drafters that proposes anything; auto rows follow the batch's plan (autok.plan)."""
        dec, rows = self.dec, self.rows
        free = {d.name: self.sessions[d.name] for d in dec.drafters if d.free}
        offers: dict[int, dict[str, Proposal]] = {b: {} for b in range(len(rows))}
        for free_name, s in free.items():
            ks = {
                b: min(r.k if r.k is not None else dec.max_k, r.room() - 1)
                for b, r in enumerate(rows)
                if free_name in r.drafters
            }
            for b, prop in s.propose(rows, {b: k for b, k in ks.items() if k > 0}).items():
                offers[b][free_name] = prop
        self.offers = offers
        picks: list[tuple[str | None, int]] = [(None, 0)] * len(rows)
        fixed_steps: dict[str, int]
        fixed_width, fixed_steps, n_fixed = 0, {}, 0
        for b, r in enumerate(rows):
            if r.k is not None:
                n_fixed += 1
                k = max(0, min(r.k, r.room() - 1))
                name = next((d for d in r.drafters if d in offers[b] or not dec.drafter(d).free), None) if k else None
                if name is not None:
                    k = min(k, len(offers[b][name].tokens)) if name in offers[b] else k
                    picks[b] = (name, k)
                    fixed_width = max(fixed_width, k)
                    if name not in offers[b]:
                        fixed_steps[name] = max(fixed_steps.get(name, 0), k)
        auto = [b for b, r in enumerate(rows) if r.k is None and r.room() > 1]
        if auto:
            cost = dec.costs[len(rows)]  # calibrated by step()
            options: list[RowOptions] = []
            for b in auto:
                r = rows[b]
                models = {d: m.rate(r) for d in r.drafters if not (m := dec.drafter(d)).free}
                options.append(RowOptions(free=list(offers[b].values()), models=models, limit=r.room() - 1))
            probe = None
            if self.probes.due:  # refresh the estimates; a model drafts on the row cheapest to bring up to date
                probe = min(
                    range(len(auto)),
                    key=lambda i: min((self.sessions[d].behind(rows[auto[i]]) for d in options[i].models), default=0),
                )
            chosen = plan(cost, options, n_fixed, fixed_width, fixed_steps, probe_row=probe)
            drafted = any(k for _, k in chosen)
            bucket = BatchCosts.bucket(len(rows))
            run = dec.drafting_runs[bucket] = dec.drafting_runs.get(bucket, 0) + 1 if drafted else 0
            every = PLAIN_EVERY if cost.seen.get("plain") else PLAIN_FIRST
            if drafted and not n_fixed and probe is None:
                # plain iterations now and then measure the target-only step in this batch's
                # real conditions: the counterfactual behind the reported speedup
                if run > every:
                    dec.plain_left[bucket], dec.drafting_runs[bucket] = PLAIN_RUN, 0
                if dec.plain_left.get(bucket, 0) > 0:
                    chosen = [(None, 0)] * len(chosen)
                    dec.plain_left[bucket] -= 1
            for b, pick in zip(auto, chosen):
                picks[b] = pick
            self.probes.record(drafted=any(k for _, k in chosen), probed=probe is not None)
        return picks

    def step(self) -> list[Row]:
        self.merge()
        dec, rows = self.dec, self.rows
        cost = dec.costs[len(rows)]
        if not cost.calibrated and any(r.drafters and r.k != 0 for r in rows):
            dec.ensure_calibrated(len(rows))  # outside the iteration's clock
        t_start = time.perf_counter()
        picks = self.choose()
        t_chosen = time.perf_counter()
        props: dict[int, Proposal] = {}
        for name, session in self.sessions.items():
            ks = {b: k for b, (d, k) in enumerate(picks) if d == name and k}
            if not ks:
                continue
            if dec.drafter(name).free:
                props.update({b: self.offers[b][name].cut(k) for b, k in ks.items()})
            else:
                props.update(session.propose(rows, ks))
        widths = [len(props[b].tokens) if b in props else 0 for b in range(len(rows))]
        big_k = max(widths)

        inputs = [[r.seq[-1]] + (props[b].tokens if b in props else []) for b, r in enumerate(rows)]
        with Timer() as t:
            logits = self.tcache.forward(inputs, big_k + 1)[..., : dec.vocab_size]
            hf.sync(dec.target)
        cost.observe_verify(big_k, t.seconds)
        start = self.tcache.width - (big_k + 1)
        fed = sum(len(x) for x in inputs)
        emitted = [r.emitted for r in rows]
        for b, r in enumerate(rows):
            k, prop = widths[b], props.get(b)
            r.stats.target_time_s += t.seconds * (k + 1) / fed
            r.rows_seen += len(rows)
            n, nxt = r.accept(prop, logits[b, big_k - k :])
            if self.watchers:  # the target's features of [last] + the accepted drafts
                assert self.tcache.last_features is not None
                for w in self.watchers:
                    w.observe(r, self.tcache.last_features[b, big_k - k : big_k - k + n + 1])
            # roll back: the target keeps [last] + accepted drafts; the drafter its own state
            self.tcache.drop(b, range(start + big_k - k + 1 + n, start + big_k + 1))
            if prop is not None:
                self.sessions[prop.drafter].commit(b, r, prop, n)
            new = (prop.tokens[:n] if prop else []) + [nxt]
            for name, offer in self.offers[b].items():  # free proposals not verified: what they would have got
                if prop is None or name != prop.drafter:
                    self.sessions[name].shadow(r, offer, new)
            r.advance(prop.drafter if prop else None, k, n, new)

        # the target-only counterfactual: a k = 0 iteration is one (the proposals nobody
        # verified are speculation's own cost); any other costs a plain step per token
        end = time.perf_counter()
        if big_k == 0:
            plain = end - t_chosen
            if self.plain_before:  # warm, as target-only decoding runs (PLAIN_RUN)
                cost.observe_plain(plain, t.seconds)
        else:
            plain = cost.plain_step()  # calibrated above: this iteration drafted
        self.plain_before = big_k == 0
        for r, before in zip(rows, emitted):
            r.spent_s += end - t_start
            r.plain_s += (r.emitted - before) * plain
            r.plain_step = plain
        done = [r for r in rows if r.finish_reason]
        for r in done:
            r.finish()
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
        if order != list(range(self.tcache.rows)):
            self.tcache.keep_rows(order)
        self.tcache.tidy()
        for session in self.sessions.values():
            session.keep(order)
        self.rows = [self.rows[b] for b in order]
