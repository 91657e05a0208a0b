"""Drafters behind one seam: prompt lookup, the suffix index and the draft model, alone and
mixed in one batch, keep every row token-identical to the target's greedy output (caches
checked after every step); a deterministic drafter keeps the sampled distribution; the suffix
index stays under its bound and never lets one scope read another's text."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import check_caches, exact_two_token_distribution, greedy_reference, perturbed, tiny_llama
from helpers import N, V, assert_target_distribution, sampled_requests, sharpen

from specdec_llm.engine import GenerationRequest, RequestError, SpeculativeDecoder
from specdec_llm.engine.decoder import Batch
from specdec_llm.engine.drafting.base import Accepted, DraftContext, Forward, Proposal, RowView, Sampling
from specdec_llm.engine.drafting.lookup import Lookup
from specdec_llm.engine.drafting.model import Backend, ModelDrafter
from specdec_llm.engine.drafting.suffix import SuffixIndex

# prompts that repeat themselves, so prompt lookup has matches from the first token
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 9, 9, 9], [30, 31, 32, 30, 31], [100, 3, 100, 3, 100], [7]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def decoder(target, **kw):
    return SpeculativeDecoder(target, perturbed(target, 0.2, seed=3), drafters=["lookup", "suffix", "model"], **kw)


def test_lookup_proposes_the_continuation_of_the_longest_match():
    lookup = Lookup(max_n=3)
    row = RowView([1, 2, 3, 4, 9, 2, 3, 4, 7, 3, 4])
    tokens, feats = lookup.continuation(row, 3)  # "3 4" (longest: "7 3 4" is new) last seen before "7"
    assert tokens == [7, 3, 4] and feats[0] == (2, 0)
    row.tokens += [7]  # the index follows the sequence as it grows
    assert lookup.continuation(row, 2)[0] == [3, 4]
    assert lookup.continuation(RowView([5, 6]), 4) == ([], [])


def test_each_drafter_alone_and_mixed_in_one_batch_is_greedy_identical(target):
    dec = decoder(target)
    reqs = [
        GenerationRequest(prompt=p, max_new_tokens=n, k=k, drafter=d)
        for p, n, k, d in zip(
            PROMPTS * 4,
            (30, 12, 25, 40, 9) * 4,
            (3, "auto", 5, 2) * 5,
            ("lookup", "suffix", "model", "auto", "lookup") * 4,
        )
    ]
    dec.generate_many(reqs[:5], max_batch=2)  # the suffix index learns these texts
    for max_batch in (1, 3, 8):
        out = dec.generate_many(reqs, max_batch=max_batch)
        for req, res in zip(reqs, out):
            assert res.token_ids == greedy_reference(target, req.prompt, req.max_new_tokens), (req, max_batch)
            s = res.stats
            assert set(s.drafter_tokens) <= ({"lookup", "suffix", "model"} if req.drafter == "auto" else {req.drafter})
            assert sum(c["proposed"] for c in s.drafter_tokens.values()) == s.draft_tokens_proposed == sum(s.k_values)
            assert sum(c["accepted"] for c in s.drafter_tokens.values()) == s.draft_tokens_accepted
            assert s.output_tokens == s.draft_tokens_accepted + s.target_forwards
    used = {
        d: sum(r.stats.drafter_tokens.get(d, {}).get("accepted", 0) for r in out) for d in ("lookup", "suffix", "model")
    }
    assert all(used.values()), used  # every drafter's tokens were accepted somewhere


class Faulty:
    """A drafter that raises at its ``at``-th call of ``where`` ("open", "propose", "update"),
    otherwise the drafter it wraps."""

    def __init__(self, drafter, where: str, at: int):
        self.drafter, self.where, self.left = drafter, where, at

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def fault(self, where: str) -> None:
        if where == self.where:
            self.left -= 1
            if self.left == 0:
                raise RuntimeError(f"a bug in {self.drafter.name}'s {where}")

    def open(self, target):
        self.fault("open")
        session, fault = self.drafter.open(target), self.fault

        class Session:
            def propose(self, rows, ks):
                fault("propose")
                return session.propose(rows, ks)

            def update(self, events):
                fault("update")
                session.update(events)

        return Session()


@pytest.mark.drafter_fails
@pytest.mark.parametrize("name", ["lookup", "model"])
@pytest.mark.parametrize("where, at", [("open", 1), ("propose", 3), ("update", 5)])
def test_a_drafter_that_raises_fails_no_row(target, name, where, at, caplog):
    """A drafter's fault (opening its session, proposing, hearing events) is logged once and
    its batch goes on without it: every row finishes, greedy identical, caches exact; the
    other drafters keep drafting, and the next batch tries it again."""
    dec = decoder(target)
    i = dec.drafter_names.index(name)
    dec.drafters[i] = Faulty(dec.drafters[i], where, at)
    for attempt in range(2):
        batch = Batch(dec)
        rows = [batch.add(GenerationRequest(prompt=p, max_new_tokens=16, k=3)) for p in PROMPTS[:3]]
        rows.append(batch.add(GenerationRequest(prompt=PROMPTS[3], max_new_tokens=16, k=3, drafter=name)))
        for _ in range(40):
            if batch.rows:
                batch.step()
                check_caches(batch)
        for r in rows:
            assert r.result.token_ids == greedy_reference(target, r.prompt, 16)
        if attempt == 0:
            assert sum(r.result.stats.draft_tokens_accepted for r in rows) > 0
            assert batch.failed == {name}
            faults = [rec for rec in caplog.records if rec.levelname == "ERROR"]
            assert len(faults) == 1 and f"drafter '{name}' raised" in faults[0].getMessage()
            assert faults[0].exc_info[1].args == (f"a bug in {name}'s {where}",)
    assert not batch.failed  # (its fault was once: the next batch drafts with it)


class Meddling(Faulty):
    """A drafter that proposes as the one it wraps, and meddles with every view it hears of
    once it has heard: grows its tokens in place, clears every state slot it can reach, draws
    from its generator."""

    def __init__(self, drafter):
        super().__init__(drafter, "nowhere", 0)

    def open(self, target):
        session = self.drafter.open(target)

        def meddle(event):
            row = event.row
            if isinstance(event, Accepted):  # (its own tokens are replaced before it proposes again)
                seq = row.tokens
                seq += [0]
            row.state.clear()
            torch.rand(8, generator=row.gen)

        class Session:
            def propose(self, rows, ks):
                return session.propose(rows, ks)

            def update(self, events):
                session.update(events)
                for e in events:
                    if getattr(e, "row", None) is not None:
                        meddle(e)

        return Session()


def test_what_a_drafter_does_to_its_view_changes_no_row_and_no_other_drafter(target):
    """A drafter sees its own copy of each row: growing its tokens, clearing state, drawing
    from its generator change neither the row's output (greedy identical; a seeded sampled
    row's text as without it) nor another drafter's state (the model drafter keeps drafting)."""
    dec, plain = decoder(target), decoder(target)
    i = dec.drafter_names.index("lookup")
    dec.drafters[i] = Meddling(dec.drafters[i])
    batch = Batch(dec)
    rows = [batch.add(GenerationRequest(prompt=p, max_new_tokens=16, k=3)) for p in PROMPTS]
    while batch.rows:
        batch.step()
        for r in batch.rows:  # (the row's tokens are its own, and so are another drafter's views)
            assert r.seq == r.prompt + r.out and r.view("model").tokens == r.seq
    out = [r.result for r in rows]
    for r in rows:
        assert r.result.token_ids == greedy_reference(target, r.prompt, 16)
    assert sum(r.stats.drafter_tokens.get("model", {}).get("accepted", 0) for r in out) > 0
    assert sum(r.stats.drafter_tokens.get("lookup", {}).get("proposed", 0) for r in out) > 0
    seeded = [
        GenerationRequest(prompt=p, max_new_tokens=16, k=3, drafter="lookup", temperature=1.0, seed=7) for p in PROMPTS
    ]
    assert [r.token_ids for r in dec.generate_many(seeded)] == [r.token_ids for r in plain.generate_many(seeded)]


class TableBackend(Backend):
    """A draft with no model: its logits at a token are a fixed table's row for that token."""

    def __init__(self, name, table):
        super().__init__(name, table.shape[0])
        self.table, self.fed, self.left = table, [], []

    def feed(self, rows, inputs, keep):
        for b, x in inputs.items():
            rows[b].state[self.name].held += len(x)
            self.fed.append(len(x))
        logits = {b: self.table[torch.tensor(x[-keep[b] :])] for b, x in inputs.items()}
        return logits, [Forward({b: len(x)}, len(x), 1e-4) for b, x in inputs.items()]

    def truncate(self, b, row, n):
        st = row.state[self.name]
        st.held = min(st.held, n)

    def leave(self, b, row):
        self.left.append(b)


class TableDrafter(ModelDrafter):
    def __init__(self, table):
        super().__init__(None, DraftContext(None, table.shape[0]), "table")
        self.table, self.made = table, []

    def backend(self, target):
        self.made.append(TableBackend(self.name, self.table))
        return self.made[-1]


def test_a_model_drafter_with_a_backend_of_its_own_is_timed_through_it(target):
    """Calibration times a model drafter's forwards through its own backend (here one with no
    model at all), and its rows stay greedy identical."""
    n = target.config.vocab_size
    drafter = TableDrafter(torch.randn(n, n, generator=torch.Generator().manual_seed(0)))
    dec = SpeculativeDecoder(target, drafters=[drafter])
    out = dec.generate_many([GenerationRequest(prompt=p, max_new_tokens=12) for p in PROMPTS], max_batch=2)
    for p, res in zip(PROMPTS, out):
        assert res.token_ids == greedy_reference(target, p, 12)
    forward = drafter.timer(2, [1, 2, 3, 4])
    assert forward(3) > 0 and drafter.made[-1].fed[-2:] == [3, 3]
    del forward  # (the timer gone, its rows leave its backend)
    assert drafter.made[-1].left == [0, 1]


class Misbehaving(Faulty):
    """A drafter whose proposals ``spoil`` changes (after the drafter it wraps made them)."""

    def __init__(self, drafter, spoil):
        super().__init__(drafter, "nowhere", 0)
        self.spoil = spoil

    def open(self, target):
        session, spoil = self.drafter.open(target), self.spoil

        class Session:
            def propose(self, rows, ks):
                drafts = session.propose(rows, ks)
                drafts.proposals = {b: spoil(p, rows) for b, p in drafts.proposals.items()}
                return drafts

            def update(self, events):
                session.update(events)

        return Session()


SPOILS = {
    "a token past the vocabulary": lambda p, rows: replace(p, tokens=[*p.tokens[:-1], 10**6]),
    "a negative token": lambda p, rows: replace(p, tokens=[-1, *p.tokens[1:]]),
    "a float token": lambda p, rows: replace(p, tokens=[float(t) for t in p.tokens]),
    "another drafter's name": lambda p, rows: replace(p, drafter="lookup" if p.drafter != "lookup" else "model"),
    "a node its own parent": lambda p, rows: replace(p, parents=list(range(len(p.tokens)))),
    "parents short of tokens": lambda p, rows: replace(p, parents=[-1] * (len(p.tokens) - 1)),
}


@pytest.mark.drafter_fails
@pytest.mark.parametrize("name", ["lookup", "model"])
@pytest.mark.parametrize("spoil", SPOILS)
def test_what_is_not_a_proposal_fails_its_drafter_not_its_batch(target, name, spoil, caplog):
    """Token ids outside the vocabulary, a name not its own, a tree that is not one: an
    IndexError failed every row of the batch (or, taken, an output changed). The drafter is
    failed as one that raised; the rows go on, greedy identical."""
    dec = decoder(target)
    i = dec.drafter_names.index(name)
    dec.drafters[i] = Misbehaving(dec.drafters[i], lambda p, rows: SPOILS[spoil](p, rows) if len(p.tokens) > 1 else p)
    reqs = [GenerationRequest(prompt=p, max_new_tokens=16, k=3, drafter=d) for p in PROMPTS[:3] for d in (name, "auto")]
    for req, res in zip(reqs, dec.generate_many(reqs, max_batch=6)):
        assert res.token_ids == greedy_reference(target, req.prompt, 16)
    assert any(
        f"drafter {name!r} propose" in r.getMessage() or f"drafter {name!r} raised" in r.getMessage()
        for r in caplog.records
    )


def test_a_model_drafters_proposal_is_cut_to_the_k_its_row_asked(target):
    """A model drafter proposing past its k (and for rows not asked): a row ran past its
    max_new_tokens (43 tokens for 5) and its context."""
    dec = decoder(target)
    i = dec.drafter_names.index("model")

    def oracle(p, rows):  # the target's own continuation, 40 tokens past what was asked
        b = next(b for b, r in enumerate(rows) if r.tokens and p.tokens)  # (any row: a proposal for it)
        return replace(
            p, tokens=greedy_reference(target, list(rows[b].tokens), len(p.tokens) + 40), accept=[], buckets=[]
        )

    dec.drafters[i] = Misbehaving(dec.drafters[i], oracle)
    res = dec.generate(GenerationRequest(prompt=PROMPTS[0], max_new_tokens=5, k=2, drafter="model"))
    assert res.token_ids == greedy_reference(target, PROMPTS[0], 5) and max(res.stats.k_values) <= 2


def test_a_free_proposal_not_verified_still_teaches_its_drafter(target):
    """Counterfactual learning on greedy rows: the lookup proposals a fixed-k row made but
    did not verify (the draft model comes first) are scored against the target's tokens."""

    lookup = Lookup()
    for tokens, emitted, counts in (
        ([4, 5, 6], [4, 5, 9], (2, 3)),  # rejected at the third: 2 accepted of 3 examined
        ([4, 5, 6], [4, 5], (4, 5)),  # the target said nothing past 2 tokens: both accepted, none rejected
        ([4, 5, 6], [4, 5, 6, 7], (7, 8)),  # all accepted
    ):
        prop = Proposal("lookup", tokens, None, [0.3] * 3, [(True, (1, i)) for i in range(3)])
        lookup.shadow(RowView([1]), prop, emitted)
        c = lookup.acceptance.counts
        assert (sum(v[0] for v in c.values()), sum(v[1] for v in c.values())) == counts
    lookup.shadow(
        RowView([1], Sampling(greedy=False, temperature=1.0)), prop, [4]
    )  # sampled: a token's acceptance is not seen from the output
    assert sum(v[1] for v in lookup.acceptance.counts.values()) == 8

    dec = SpeculativeDecoder(target, perturbed(target, 0.2, seed=3), drafters=["model", "lookup"])
    res = dec.generate(GenerationRequest(prompt=PROMPTS[0], max_new_tokens=40, k=3))
    assert set(res.stats.drafter_tokens) == {"model"}  # lookup never verified...
    learned = dec.drafter("lookup").acceptance.counts
    # ...but it learned from the iterations it proposed in (most: the prompt repeats itself)
    assert sum(v[1] for v in learned.values()) >= res.stats.target_forwards // 2 >= 5


def test_rows_join_and_leave_with_mixed_drafters_caches_exact(target):
    dec = decoder(target)
    dec.generate_many([GenerationRequest(prompt=p, max_new_tokens=20) for p in PROMPTS], max_batch=5)
    batch = Batch(dec)
    rows = [
        batch.add(GenerationRequest(prompt=PROMPTS[i], max_new_tokens=25, k=k, drafter=d))
        for i, k, d in ((0, 3, "lookup"), (1, "auto", "auto"))
    ]
    for step in range(60):
        if step in (2, 6):
            rows.append(batch.add(GenerationRequest(prompt=PROMPTS[step % 5], max_new_tokens=15, k=4, drafter="model")))
            rows.append(
                batch.add(GenerationRequest(prompt=PROMPTS[(step + 1) % 5], max_new_tokens=18, k=2, drafter="suffix"))
            )
        if not batch.rows:
            break
        batch.step()
        check_caches(batch)
    assert not batch.rows and batch.tcache.rows == 0
    for row in rows:
        assert row.result.token_ids == greedy_reference(target, row.prompt, row.req.max_new_tokens)


def test_sampling_with_a_deterministic_drafter_keeps_the_target_distribution():
    """Prompt lookup proposes the same tokens every time ([1, 1] after this prompt): the
    rejection rule with a one-hot draft must still give the target's exact distribution
    (same bound and N as test_engine's sampled tests)."""
    prompt = [1, 1, 1]
    target = tiny_llama(11, vocab=V, hidden=32)
    sharpen(target)
    exact = exact_two_token_distribution(target, prompt, 1.0, 0, 1.0)
    assert 0.05 < exact[1, 1] and exact[1].sum() < 0.9, (
        "the lookup draft must be plausible but not certain for the test to have power"
    )
    dec = SpeculativeDecoder(target, drafters=["lookup"])
    out = dec.generate_many(sampled_requests(prompt), max_batch=256)
    assert_target_distribution(out, exact)
    accepted = sum(r.stats.drafter_tokens.get("lookup", {}).get("accepted", 0) for r in out)
    assert accepted > N * 0.05  # the draft really was accepted, not only resampled


def test_suffix_index_stays_under_its_bound_and_forgets_the_oldest():
    index = SuffixIndex(max_tokens=100, orders=(2, 3))
    docs = [[i % 7, (i * 3) % 11, i % 5] * 10 + [i] for i in range(12)]  # 31 tokens each
    for d in docs:
        index.add("job", d)
        assert index.tokens <= 100
    kept = [d for (_, _), d in index.docs.items()]
    assert kept == docs[-3:]  # oldest first out
    fresh = SuffixIndex(max_tokens=100, orders=(2, 3))
    for d in kept:
        fresh.add("job", d)
    assert index.counts == fresh.counts  # evicted sequences left nothing behind
    index.add("other", list(range(200)))  # one sequence longer than the bound keeps its tail
    assert index.tokens == 100 and list(index.counts) == ["other"]
    index.add("short", list(range(40)))
    index.add("short", [5, 6])  # (a 1-token prompt and its token: no context of order 2)
    index.add("later", list(range(300, 399)))  # forgets both of "short"'s, the last after its counts went
    assert index.tokens <= 100 and list(index.counts) == ["later"]


def test_suffix_drafter_never_reads_another_scope(target):
    dec = decoder(target)
    text = dec.generate(GenerationRequest(prompt=[40, 41, 42], max_new_tokens=30, k=0, scope="job-a")).token_ids
    assert text == greedy_reference(target, [40, 41, 42], 30)
    mine = dec.generate(GenerationRequest(prompt=[40, 41, 42], max_new_tokens=30, k=4, drafter="suffix", scope="job-a"))
    theirs = dec.generate(
        GenerationRequest(prompt=[40, 41, 42], max_new_tokens=30, k=4, drafter="suffix", scope="job-b")
    )
    assert mine.stats.drafter_tokens["suffix"]["accepted"] >= 20  # its own scope: the whole answer is known
    assert "suffix" not in theirs.stats.drafter_tokens  # another scope: nothing to read
    assert mine.token_ids == theirs.token_ids == text


def test_seeded_sampling_does_not_depend_on_other_requests(target):
    """A seeded sampled row never reads the suffix index: the same seed gives the same text
    before and after other requests taught the index."""
    dec = decoder(target)
    req = GenerationRequest(prompt=[12, 13, 14], max_new_tokens=25, temperature=0.8, seed=7)
    first = dec.generate(req).token_ids
    dec.generate_many([GenerationRequest(prompt=[12, 13, 14], max_new_tokens=40) for _ in range(3)])
    again = dec.generate(req)
    assert again.token_ids == first and "suffix" not in again.stats.drafter_tokens


def test_unknown_drafter_is_a_clear_error(target):
    dec = decoder(target)
    with pytest.raises(
        RequestError, match="unknown drafter 'bogus' for this pair; use one of: auto, lookup, suffix, model"
    ):
        dec.generate(GenerationRequest(prompt=[1, 2], drafter="bogus"))
    with pytest.raises(ValueError, match="known drafters: lookup, suffix, model"):
        SpeculativeDecoder(target, drafters=["lookup", "medusa"])
    plain = SpeculativeDecoder(target, drafters=["lookup"])
    with pytest.raises(RequestError, match="use one of: auto, lookup"):
        plain.generate(GenerationRequest(prompt=[1, 2], drafter="model"))
