"""The speculative decoding loop over a batch of rows: propose -> verify -> accept -> commit.

Every request is a row of a ``Batch`` (a single ``generate`` is a batch of one). An
iteration asks the drafters (drafting/: prompt lookup, a suffix index, a draft model)
for each row's proposal, then ONE target forward verifies every row's ``[last token] +
proposal``; each row accepts its own longest agreeing prefix (greedy) or applies the
rejection rule (sampling), and every drafter's session hears the outcome (drafting/base.py)
and rolls back its own state. The loop owns time and lifecycle: it charges the forwards
drafters report to the rows and the cost model, and tells every session when a row leaves,
whatever the reason. Rows advance by
different amounts (ragged), finish at different times and leave, and new rows join between
iterations after their own prefill (continuous batching). Nothing already in a cache is
ever recomputed.

Invariant after every iteration, per row: the target's cache holds ``seq[:-1]`` (the last
emitted token is pending, its logits not yet computed). Rolled-back positions become holes
(see ragged.py). k = 0 is plain target-only decoding through the same loop; which drafter
and k each row uses is chosen per iteration from measured costs and live acceptance
(plan.py), or fixed per request.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import branches, compiled, costcache, grammar, hf, requests, schedule
from .accounting import PlainClock
from .calibration import Calibration
from .costs import CostModel
from .drafting import registry
from .drafting.base import (
    Accepted,
    DraftContext,
    Drafter,
    Drafts,
    Event,
    Joined,
    Left,
    Moved,
    Proposal,
    RowView,
    Session,
)
from .drafting.free import FreeDrafter
from .plan import Choice
from .ragged import RaggedCache, prefill
from .row import Row
from .schedule import PlainIterations
from .text import TextCallback, TextStream
from .timing import Timer
from .types import GenerationRequest, GenerationResult, RequestError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["Batch", "Row", "SpeculativeDecoder", "TextCallback"]

log = logging.getLogger(__name__)


def end_tokens(target: PreTrainedModel, tokenizer: Any) -> list[int]:
    """The generation config's end-of-sequence tokens, plus the tokenizer's (chat end-of-turn)."""
    eos = target.generation_config.eos_token_id if target.generation_config else None
    out = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        out.append(tokenizer.eos_token_id)
    return out


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
    ``target_file``: the file the target was loaded from, for a drafter that runs it another
    way (``llamacpp``: llama.cpp on the target's GGUF); ``draft_file``: the pair's draft as a
    GGUF file, for one that runs that instead (``llamacpp`` then runs the draft's).
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
        target_file: str | None = None,
        trees: bool = True,
        draft_file: str | None = None,
    ) -> None:
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        # verify trees of the drafters' proposals where they pay (tree.py); not under ALiBi, whose
        # key positions are read off one mask row (hf.alibi_from_masks), which a tree's leaf lacks
        self.trees = trees and not hf.uses_alibi(target)
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
        self.context_length = context_length or getattr(target.config, "max_position_embeddings", None) or 2048
        self.drafters: list[Drafter] = self._build(drafters, draft, tokenizer, target_file, draft_file, max_k)
        self.offers_failed: set[str] = set()  # free drafters that raised offering to two-level drafting
        # the target layers whose outputs a feature-level drafter reads (eagle.py): every
        # target forward returns them (a pair has one draft, so at most one such drafter)
        self.feature_layers: tuple[int, ...] = next((d.feature_layers for d in self.drafters if d.feature_layers), ())
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else end_tokens(target, tokenizer))
        self.max_k = max_k if self.drafters else 0
        self.default_k, self.seeded_k = default_k, seeded_k
        if cost_cache is None and kernel_cache is not None:
            cost_cache = Path(kernel_cache).with_name(costcache.FILE)
        self.cost_cache = None if cost_cache is None else Path(cost_cache)
        self.calibration = Calibration(target, self.drafters, self.vocab_size, self.max_k, self.cost_cache)
        self.costs = self.calibration.costs
        self.plain = PlainIterations()  # forced plain iterations, per batch-size bucket (schedule.py)

    def _build(
        self,
        drafters: list[str | Drafter],
        draft: Any,
        tokenizer: Any,
        target_file: str | None,
        draft_file: str | None,
        max_k: int,
    ) -> list[Drafter]:
        """The drafters by name (or given built); with a tokenizer, the grammar's too (forced
        tokens of constrained rows, free: drafting/forced.py) when there is any drafting."""
        if drafters and tokenizer is not None and "grammar" not in drafters:
            drafters = [*drafters, "grammar"]
        names = [d for d in drafters if isinstance(d, str)]
        grammar = self.grammar if tokenizer is not None else None
        context = DraftContext(
            draft,
            self.vocab_size,
            tokenizer,
            target_file,
            self.context_length,
            self.offers,
            self.draft_seconds,
            grammar,
            self.trees,
            max_k,
            draft_file=draft_file,
        )
        built = iter(registry.build(names, context))
        return [next(built) if isinstance(d, str) else d for d in drafters]

    @property
    def cost(self) -> CostModel:
        """The cost model of single-request decoding."""
        return self.costs[1]

    @cached_property
    def grammar_tokens(self) -> grammar.Tokens:
        """The tokenizer as the grammar engine sees it (built at the first constrained row)."""
        return grammar.Tokens(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def grammar(self, response_format: dict[str, Any]) -> grammar.RowGrammar:
        """A row's matcher for its ``response_format`` (RequestError if it does not compile)."""
        return self.grammar_tokens.matcher(response_format)

    @property
    def drafter_names(self) -> list[str]:
        return [d.name for d in self.drafters]

    def drafter(self, name: str) -> Drafter:
        return next(d for d in self.drafters if d.name == name)

    def offers(self, row: RowView, drafts: list[int], k: int) -> list[Proposal]:
        """Two-level drafting: what the row's free drafters offer after its tokens and ``drafts``
        (a free drafter that raises here is logged and asked no more: the model drafter asking
        is not at fault)."""
        out, owner = [], Row.of(row)  # (each free drafter is asked with its own view of the row)
        for d in self.drafters:
            if isinstance(d, FreeDrafter) and d.name in row.drafters and d.name not in self.offers_failed:
                try:
                    p = d.offer(owner.view(d.name) if owner is not None else row, k, drafts)
                    out += [checked(p, k, d.name, self.vocab_size)] if p is not None else []
                except Exception as e:  # the row goes on with the other drafters' offers (logged once)
                    self.offers_failed.add(d.name)
                    log.error("drafter %r raised offering after drafts; it is asked no more: %r", d.name, e, exc_info=e)
        return out

    def draft_seconds(self, name: str, rows: int, width: int) -> float:
        """Seconds of one forward of model drafter ``name``, ``width`` tokens per row, at ``rows`` rows."""
        return self.costs[rows].draft(name, width)

    # -- public -----------------------------------------------------------------------
    def encode(self, request: GenerationRequest) -> list[int]:
        return requests.encode(self.tokenizer, request)

    def prepare(self, request: GenerationRequest) -> list[int]:
        """Validate and encode; RequestError names the field at fault."""
        return requests.prepare(request, self.tokenizer, self.drafter_names, self.context_length, self.vocab_size)

    def generate(self, request: GenerationRequest, on_text: TextCallback | None = None) -> GenerationResult:
        if self.row_drafters(request):  # before the request's clock starts (cached on disk: no time)
            self.ensure_calibrated(1)
        batch = Batch(self)
        try:
            row = batch.add(request, on_text)
            while batch.rows:
                batch.step()
        finally:
            batch.close()
        self.save_costs()
        if row.text_stream.error is not None:  # what on_text raised
            raise row.text_stream.error
        assert row.result is not None  # a row leaves the batch finished
        return row.result

    def generate_many(
        self, requests: Iterable[GenerationRequest], max_batch: int = 8
    ) -> list[GenerationResult | RequestError]:
        """Continuous batching over ``requests``: up to ``max_batch`` rows decode together, a
        finished row's place goes to the next request at once. A bad request's entry is its
        RequestError; the others are unaffected. Results in request order."""
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch: {max_batch!r}; use at least 1")
        pending = deque(enumerate(requests))
        results: list[Any] = [None] * len(pending)
        self.calibrate_batches(min(max_batch, len(pending)))
        batch = Batch(self)
        try:
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
        finally:
            batch.close()
        self.save_costs()
        return results

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

    # -- measured costs (calibration.py) ----------------------------------------------
    def ensure_calibrated(self, rows: int) -> None:
        self.calibration.ensure(rows)

    def calibrate_batches(self, max_batch: int) -> None:
        """Calibrate every batch-size bucket up to ``max_batch`` now (from the cost cache
        when it has this machine's figures). Also with a fixed k: a drafting iteration's
        target-only counterfactual reads the costs."""
        self.calibration.up_to(max_batch)

    def best_batch(self, cap: int = 32) -> int:
        """The batch size up to ``cap`` that decodes a bulk job fastest on this machine."""
        return self.calibration.best_batch(cap)

    def save_costs(self, rows: int | None = None) -> None:
        self.calibration.save(rows)


class Batch:
    """Rows decoding together. ``add`` a request (prefilled alone, then merged), ``step``
    until ``rows`` is empty; ``step`` returns the rows that finished in it. ``keep`` lets
    rows go and ``close`` lets every row go: the drafters hear of each (``Left``)."""

    def __init__(self, dec: SpeculativeDecoder):
        self.dec = dec
        self.rows: list[Row] = []
        self.tcache = RaggedCache(dec.target, 0, dec.feature_layers)
        self.sessions = {d.name: Guarded(d, self.tcache, self.fail, dec.vocab_size) for d in dec.drafters}
        self.free = {d.name: self.sessions[d.name] for d in dec.drafters if d.free}
        self.chooser = schedule.Chooser({d.name: d for d in dec.drafters}, dec.plain)
        self.clock = PlainClock()
        self.joining: list[RaggedCache] = []  # the target caches of rows that joined since the last step
        self.chains: dict[int, Proposal] = {}  # this iteration's proposals as drafted (before trees)
        self.uncut: dict[int, Proposal] = {}  # ... and before a row's grammar cut them (where it did)

    def add(self, request: GenerationRequest, on_text: TextCallback | None = None, tag: Any = None) -> Row:
        """Join the batch (validates first: a RequestError leaves the batch untouched). The
        row is prefilled alone now and merged into the batch's caches at the next step, with
        every other row that joined meanwhile (one copy for a burst of joins)."""
        dec = self.dec
        prompt = dec.prepare(request)
        names = [d.name for d in dec.row_drafters(request)]
        text = TextStream(dec.tokenizer, request.stop, on_text)
        fmt = request.response_format
        g = dec.grammar(fmt) if fmt is not None else None
        row = Row(request, prompt, names, dec.fixed_k(request), text, dec.eos_token_ids, dec.context_length, tag, g)
        own, row.stats.target_time_s = prefill(dec.target, prompt, dec.feature_layers)
        self.joining.append(own)
        features = own.last_features[0] if own.last_features is not None else None
        self.tell(lambda name: [Joined(len(self.rows), row.view(name), features)])
        self.rows.append(row)
        for name in self.failed:
            row.forget(name)
        return row

    def merge(self) -> None:
        """Move the caches of rows that joined since the last step into the batch's cache."""
        if self.joining:
            self.tcache.extend(self.joining)
            self.joining = []

    def step(self) -> list[Row]:
        """One iteration: propose -> verify -> accept -> commit, for every row at once."""
        if not self.rows:  # (a row that joined is one of them)
            return []
        self.merge()
        rows, cost = self.rows, self.dec.costs[len(self.rows)]
        may_draft = any(r.drafters and r.k != 0 for r in rows)
        if not cost.calibrated and may_draft:
            self.dec.ensure_calibrated(len(rows))  # outside the iteration's clock
        t_start = time.perf_counter()
        if may_draft:
            offers = schedule.offers(rows, self.free, self.dec.max_k)
            choices = self.chooser.choose(rows, offers, cost)
        else:  # no row may draft (k = 0 asked): nothing to offer or pick, as target-only decoding
            offers, choices = {b: {} for b in range(len(rows))}, [(None, 0)] * len(rows)
        t_chosen = time.perf_counter()
        props = self.propose(choices, offers)
        widths = [len(props[b].tokens) if b in props else 0 for b in range(len(rows))]
        logits, verify_s = self.verify(props, widths)
        big_k, emitted = max(widths), [r.ledger.emitted for r in rows]
        outcomes = []
        for b, r in enumerate(rows):
            k, prop = widths[b], props.get(b)
            r.stats.target_time_s += verify_s * (k + 1) / (len(rows) + sum(widths))
            path, nxt = r.accept(prop, logits[b, big_k - k :])
            outcomes.append((path, [prop.tokens[i] for i in path] + [nxt] if prop else [nxt]))
            # a tree counts as its chain, or as the branch accepted deeper: the drafter proposed the
            # chain, and a branch that lost costs the loop width, not the drafter acceptance
            line = max(len(self.chains[b].tokens), len(path)) if prop else 0
            r.ledger.iteration(r.stats, prop.drafter if prop else None, line, len(path), len(rows))
        self.commit(props, offers, outcomes, big_k)
        for r, (_, new) in zip(rows, outcomes):
            r.advance(new)
        end = time.perf_counter()
        plain = self.clock.step(cost, not any(k for _, k in choices), end - t_chosen, verify_s)
        for r, before in zip(rows, emitted):
            r.ledger.charge(end - t_start, r.ledger.emitted - before, plain)
        done = [r for r in rows if r.finish_reason]
        for r in done:
            r.finish()
        self.keep([b for b, r in enumerate(rows) if not r.finish_reason])
        return done

    def propose(self, choices: list[Choice], offers: schedule.Offers) -> dict[int, Proposal]:
        """The chosen proposals: free drafters' offers cut to k, model drafters' drafted now."""
        props: dict[int, Proposal] = {}
        for name, session in self.sessions.items():
            ks = {b: k for b, (d, k) in enumerate(choices) if d == name and k}
            if ks and name in self.free:
                props.update({b: offers[b][name].cut(k) for b, k in ks.items()})
            elif ks:
                drafts = session.propose([r.view(name) for r in self.rows], ks)
                self.charge(name, drafts)
                props.update(drafts.proposals)
        self.uncut = {}
        for b, prop in props.items():  # a row's grammar cuts its proposal before a token it rejects
            if (g := self.rows[b].grammar) is not None and (short := grammar.cut(prop, g)) is not prop:
                props[b], self.uncut[b] = short, prop
        self.chains = dict(props)  # what each drafter proposed (trees widen them below)
        return self.widen(props, offers) if self.dec.trees else props

    def widen(self, props: dict[int, Proposal], offers: schedule.Offers) -> dict[int, Proposal]:
        """Each chain with the other drafters' offers for its row, and its own drafter's
        alternatives, as branches where they pay (branches.grow): one target forward verifies them
        all. A row with a grammar, or sampled with a draft distribution, keeps its chain
        (tree.py's exact rules are for deterministic drafts), and so does a seeded sampled row
        (whether a branch pays depends on timings and the other rows; a tree draws differently)."""
        cost, rows = self.dec.costs[len(self.rows)], self.rows
        if not props or not cost.calibrated:  # (unmeasured: nothing says a wider forward pays)
            return props
        big_k = max(len(p.tokens) for p in props.values())
        token_s = cost.verify(big_k) / sum(branches.expected(props[b]) if b in props else 1.0 for b in range(len(rows)))

        def price(w: int) -> float:  # rows are padded to the widest: within it, width is free
            return cost.verify(max(w, big_k))

        for b, prop in props.items():
            r = rows[b]
            others = [o for name, o in offers[b].items() if name != prop.drafter] + (prop.branches or [])
            if others and r.grammar is None and (r.req.greedy or (prop.q is None and not r.seeded)):
                props[b] = branches.grow(prop, others, price, token_s, self.dec.max_k)
        return props

    def charge(self, name: str, drafts: Drafts) -> None:
        """The forwards a drafter ran: their seconds to the rows they fed, and to the cost
        model (a draft forward's, and the proposal's whole when it only drafted)."""
        costs = self.dec.costs
        for f in drafts.forwards:
            fed = sum(f.rows.values())
            for b, n in f.rows.items():
                self.rows[b].stats.draft_time_s += f.seconds * n / fed
                self.rows[b].stats.draft_forwards += f.kind != "prefill"
            if f.kind == "draft":
                costs[len(f.rows)].observe_draft(name, f.seconds, f.width)
        steps = [f for f in drafts.forwards if f.kind != "prefill"]
        if drafts.proposals and steps and all(f.kind == "draft" for f in steps):
            longest = max(len(p.tokens) for p in drafts.proposals.values())
            cost = costs[len(self.rows)]  # (a forward's seconds at its chains' own width: branches are not their cost)
            chains = sum(
                f.seconds * (cost.draft(name, f.width - f.branches) / cost.draft(name, f.width) if f.branches else 1.0)
                for f in steps
            )
            cost.observe_drafting(name, chains, longest)

    def verify(self, props: dict[int, Proposal], widths: list[int]) -> tuple[Any, float]:
        """ONE target forward over every row's [last token] + proposal (right-aligned to the
        widest; a tree's nodes each see their ancestors only)."""
        dec, big_k = self.dec, max(widths)
        inputs = [[r.seq[-1]] + (props[b].tokens if b in props else []) for b, r in enumerate(self.rows)]
        trees = {b: p.parents for b, p in props.items() if p.parents is not None}
        with Timer() as t:
            logits = self.tcache.forward(inputs, big_k + 1, trees=trees or None)[..., : dec.vocab_size]
            hf.sync(dec.target)
        dec.costs[len(self.rows)].observe_verify(big_k, t.seconds)
        return logits, t.seconds

    def commit(
        self,
        props: dict[int, Proposal],
        offers: schedule.Offers,
        outcomes: list[tuple[list[int], list[int]]],
        big_k: int,
    ) -> None:
        """Row ``b`` accepted the drafts at ``path`` (``new``: its tokens of this iteration):
        the target's cache keeps [last] + those, and every session hears it (``Accepted``): the
        drafter verified (with how many of its own chain's tokens were accepted) rolls back,
        free drafters whose proposals were not verified learn what they would have got, a
        feature-level one gets the target's features."""
        events: dict[str, list[Event]] = {name: [] for name in self.sessions}
        start, features = self.tcache.width - (big_k + 1), self.tcache.last_features
        for b, (r, (path, new)) in enumerate(zip(self.rows, outcomes)):
            prop, chain = props.get(b), self.chains.get(b)
            width = len(prop.tokens) if prop else 0
            lo = big_k - width  # the row's [last] + proposal is right-aligned
            kept = set(path)
            self.tcache.drop(b, [start + lo + 1 + i for i in range(width) if i not in kept])
            n = sum(1 for i, node in enumerate(path) if node == i and chain and i < len(chain.tokens))
            f = features[b, [lo] + [lo + 1 + i for i in path]] if features is not None else None
            for name, out in events.items():
                verified = chain is not None and chain.drafter == name
                # (a chain the grammar cut: its drafter learns the rejection of the token cut at)
                mine = self.uncut.get(b, chain) if verified else offers[b].get(name)
                out.append(Accepted(b, r.view(name), mine, n if verified else None, new, f))
        for name, session in self.sessions.items():
            session.update(events[name])

    def keep(self, index: list[int]) -> None:
        """Keep only the rows at ``index``; the others leave the batch, its caches and every
        drafter's session. Survivors keep their places; a place that empties is taken by a
        row from the end, so the caches copy only the rows that move."""
        self.merge()
        n, alive = len(index), set(index)
        gone = [(b, r) for b, r in enumerate(self.rows) if b not in alive]
        tail = iter(b for b in index if b >= n)
        order = [b if b in alive else next(tail) for b in range(n)]
        if order != list(range(self.tcache.rows)):
            self.tcache.keep_rows(order)
        self.tcache.tidy()
        self.tell(lambda name: [*(Left(b, r.view(name), r.finish_reason is not None) for b, r in gone), Moved(order)])
        self.rows = [self.rows[b] for b in order]

    def close(self) -> None:
        """Every row leaves (finished only where it has its result), whatever state the batch
        is in (a failed step): their drafters' resources come back. The batch is done."""
        self.tell(lambda name: [Left(b, r.view(name), r.finish_reason is not None) for b, r in enumerate(self.rows)])
        self.rows = []

    def tell(self, events: Callable[[str], list[Event]]) -> None:
        """``events(name)``: what drafter ``name`` hears (its own views of the rows)."""
        for name, session in self.sessions.items():
            session.update(events(name))

    @property
    def failed(self) -> set[str]:
        """The drafters that raised: the batch goes on without them."""
        return {name for name, s in self.sessions.items() if s.session is None}

    def fail(self, name: str, error: Exception) -> None:
        """Drafter ``name`` raised: it drafts no more for this batch's rows, which go on without
        it (drafts are only proposals: no output changes). Logged with its traceback."""
        log.error("drafter %r raised; this batch goes on without it: %r", name, error, exc_info=error)
        for r in self.rows:
            r.forget(name)


def checked(p: Proposal, k: int, name: str, vocab_size: int) -> Proposal:
    """``p`` cut to ``k`` tokens, as the loop takes drafter ``name``'s proposal; ValueError where
    it is not one: another drafter's name, a token that is not an id of the vocabulary (in its
    chain or a branch), a tree whose parents are not earlier nodes, fewer draft distributions
    than tokens."""

    def bad(tokens: list[Any]) -> Any:
        return next((t for t in tokens if type(t) is not int or not 0 <= t < vocab_size), None)

    if p.drafter != name:
        raise ValueError(f"drafter {name!r} proposed under the name {p.drafter!r}")
    p = p.cut(k) if len(p.tokens) > k else p
    if (t := bad(p.tokens)) is not None or (
        t := next((x for b in p.branches or () if (x := bad(b.tokens)) is not None), None)
    ) is not None:
        raise ValueError(f"drafter {name!r} proposed {t!r}, not a token id (an int from 0 to {vocab_size - 1})")
    if p.parents is not None and (
        len(p.parents) != len(p.tokens) or any(type(q) is not int or not -1 <= q < i for i, q in enumerate(p.parents))
    ):
        raise ValueError(
            f"drafter {name!r} proposed a tree whose parents {p.parents} are not one earlier node each (or -1)"
        )
    if p.q is not None and len(p.q) < len(p.tokens):
        raise ValueError(f"drafter {name!r} proposed {len(p.tokens)} tokens with {len(p.q)} draft distributions")
    return p


class Guarded:
    """A drafter's session for a batch, as the loop holds it: a drafter that raises (opening,
    proposing or hearing events), or proposes what is not a proposal (``checked``), is reported
    to ``fail`` once and is silent from then on, so one drafter's fault does not fail every row
    of its batch, nor change an output. What it proposes is cut to the ``k`` each row asked."""

    def __init__(
        self, drafter: Drafter, target: RaggedCache, fail: Callable[[str, Exception], None], vocab_size: int
    ) -> None:
        self.name, self.fail, self.vocab_size = drafter.name, fail, vocab_size
        self.session: Session | None = self.guard(drafter.open, target)

    def propose(self, rows: Any, ks: dict[int, int]) -> Drafts:
        drafts = (self.guard(self.session.propose, rows, ks) if self.session else None) or Drafts()
        asked = {b: p for b, p in drafts.proposals.items() if b in ks}  # (only the rows asked)
        proposals = self.guard(lambda: {b: checked(p, ks[b], self.name, self.vocab_size) for b, p in asked.items()})
        return Drafts(proposals, drafts.forwards) if proposals is not None else Drafts()

    def update(self, events: list[Event]) -> None:
        if self.session is not None:
            self.guard(self.session.update, events)

    def guard(self, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except Exception as e:  # noqa: BLE001 - whatever a drafter's fault, its rows go on without it
            self.session = None
            self.fail(self.name, e)
            return None
