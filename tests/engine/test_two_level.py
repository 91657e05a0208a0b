"""Two-level drafting (drafters.ModelDrafter): a draft model checks the free drafters'
cheaper proposals in multi-token forwards instead of drafting one token per forward.
Greedy: its proposals are the draft's own greedy tokens and the output the target's,
caches checked after every step, in one row and in a batch that rows join and leave.
Sampled: every draft token follows the draft's own distribution (a draft identical to the
target must give the target's distribution exactly: its tokens are all accepted), and the
target's distribution survives a draft that differs from it (10,000 seeded samples each).
The plan: what a forward checks follows the measured costs of wide draft forwards."""

from __future__ import annotations

import pytest
from conftest import check_caches, exact_two_token_distribution, greedy_reference, perturbed, tiny_llama
from helpers import N, V, assert_distinct, assert_target_distribution, sharpen

from specdec_llm.engine import GenerationRequest, SpeculativeDecoder
from specdec_llm.engine.costs import CostModel
from specdec_llm.engine.decoder import Batch
from specdec_llm.engine.drafting.base import Proposal
from specdec_llm.engine.drafting.two_level import inner_plan
from specdec_llm.engine.plan import RowOptions, plan
from specdec_llm.engine.quant import quantized_copy

# prompts that repeat themselves, so prompt lookup proposes from the first token
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 9, 9, 9], [30, 31, 32, 30, 31], [100, 3, 100, 3, 100], [7, 8, 7, 8, 7]]


def cheap_widths(dec: SpeculativeDecoder, rows: int = 1) -> None:
    """Calibrate, then make a wide draft forward cost what a one-token one does: every
    proposal the free drafters make is worth checking (the schedule's choice, made certain)."""
    dec.calibrate_batches(rows)
    for cost in dec.costs.models.values():
        for name, step in cost.draft_s.items():
            cost.draft_width_s[name] = dict.fromkeys(range(2, dec.max_k + 2), step)


def two_level(results) -> tuple[int, int]:
    """(draft tokens proposed, draft forwards) over ``results``: fewer forwards than tokens
    means forwards drafted several tokens."""
    proposed = sum(
        d["proposed"] for r in results for n, d in r.stats.drafter_tokens.items() if n in ("model", "quantized")
    )
    return proposed, sum(r.stats.draft_forwards for r in results)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


@pytest.mark.parametrize("kind", ["model", "quantized"])
def test_greedy_two_levels_are_identical_to_the_target_and_keep_the_caches(target, kind):
    draft = perturbed(target, 0.05, seed=3) if kind == "model" else quantized_copy(target, "int4")
    # a fixed k takes the first drafter that proposes: the model, which checks the others' proposals
    dec = SpeculativeDecoder(target, draft, drafters=[kind, "lookup", "suffix"], default_k=6)
    cheap_widths(dec)
    results = []
    for prompt in PROMPTS:
        batch = Batch(dec)
        row = batch.add(GenerationRequest(prompt=prompt, max_new_tokens=40))
        while batch.rows:
            batch.step()
            check_caches(batch)
        assert row.result.token_ids == greedy_reference(target, prompt, 40)
        results.append(row.result)
    proposed, forwards = two_level(results)
    assert forwards < proposed, "no forward checked a proposal"


@pytest.mark.drafter_fails
def test_a_free_drafter_that_raises_offering_to_a_model_is_blamed_not_the_model(target, caplog):
    """Two levels: the model drafter asks the free drafters what follows its drafts; a free
    drafter's fault there was the model's (logged as the model's, the model dropped)."""
    dec = SpeculativeDecoder(target, perturbed(target, 0.05, seed=3), drafters=["model", "lookup"], default_k=6)
    cheap_widths(dec)

    lookup = dec.drafter("lookup")
    follow = lookup.follow

    def broken(row, drafts, k):  # (after the model's drafts only: its own proposals are fine)
        if drafts:
            raise RuntimeError("follow broke")
        return follow(row, drafts, k)

    lookup.follow = broken
    results = dec.generate_many([GenerationRequest(prompt=p, max_new_tokens=24) for p in PROMPTS[:2]])
    assert [r.token_ids for r in results] == [greedy_reference(target, p, 24) for p in PROMPTS[:2]]
    blamed = {m for r in caplog.records if (m := r.getMessage()).startswith("drafter ")}
    assert blamed and all(m.startswith("drafter 'lookup' raised") for m in blamed), blamed
    assert all(r.stats.drafter_tokens.get("model", {}).get("proposed") for r in results)


def test_greedy_proposals_are_the_drafts_own_greedy_tokens(target):
    draft = perturbed(target, 0.3, seed=5)  # far from the target: many proposals rejected, rolled back
    dec = SpeculativeDecoder(target, draft, drafters=["model", "lookup"], default_k=5)
    cheap_widths(dec)
    session_propose = None
    seen = []

    def checked_propose(rows, ks):
        drafts = session_propose(rows, ks)
        for b, prop in drafts.proposals.items():
            assert prop.tokens == greedy_reference(draft, rows[b].tokens, len(prop.tokens))
            seen.append(len(prop.tokens))
        return drafts

    for prompt in PROMPTS:
        batch = Batch(dec)
        session_propose = batch.sessions["model"].propose
        batch.sessions["model"].propose = checked_propose
        row = batch.add(GenerationRequest(prompt=prompt, max_new_tokens=30))
        while batch.rows:
            batch.step()
        assert row.result.token_ids == greedy_reference(target, prompt, 30)
    assert sum(seen) > 50


def test_a_batch_with_rows_joining_and_leaving_drafts_in_two_levels(target):
    draft = perturbed(target, 0.05, seed=3)
    dec = SpeculativeDecoder(target, draft, drafters=["model", "lookup", "suffix"], default_k=5)
    dec.generate_many([GenerationRequest(prompt=p, max_new_tokens=20) for p in PROMPTS], max_batch=5)  # suffix index
    cheap_widths(dec, 8)
    batch = Batch(dec)
    rows = [batch.add(GenerationRequest(prompt=PROMPTS[i], max_new_tokens=30, k=5)) for i in (0, 1)]
    for step in range(80):
        if step in (2, 5):
            rows += [batch.add(GenerationRequest(prompt=PROMPTS[j], max_new_tokens=20, k=4)) for j in (2, 3, 4)]
        if not batch.rows:
            break
        batch.step()
        check_caches(batch)
    assert not batch.rows
    for row in rows:
        assert row.result.token_ids == greedy_reference(target, row.prompt, row.req.max_new_tokens)
    proposed, forwards = two_level([r.result for r in rows])
    assert forwards < proposed


def sampled_two_level(target, draft, prompt) -> list:
    """N seeded samples, each drafting 2 tokens (the second can come from checking lookup's)."""
    dec = SpeculativeDecoder(target, draft, drafters=["model", "lookup"])
    cheap_widths(dec, 256)
    requests = [GenerationRequest(prompt=prompt, max_new_tokens=3, k=2, seed=i, temperature=1.0) for i in range(N)]
    return dec.generate_many(requests, max_batch=256)


def test_sampled_draft_tokens_follow_the_drafts_distribution(target):
    """A draft identical to the target: the target accepts every draft token it samples with
    probability min(1, p/q) = 1, so the output is the draft's tokens, and it follows the
    target's exact distribution only if two levels keep the draft's distribution. Prompt
    lookup proposes [1, 1] here, a plausible but not certain continuation: a level that
    kept lookup's tokens too often would drift toward (1, 1)."""
    prompt = [1, 1, 1]
    model = tiny_llama(11, vocab=V, hidden=32)
    sharpen(model)
    exact = exact_two_token_distribution(model, prompt, 1.0, 0, 1.0)
    assert 0.05 < exact[1, 1] < 0.7
    out = sampled_two_level(model, perturbed(model, 0.0, seed=0), prompt)
    assert_target_distribution(out, exact)
    proposed, forwards = two_level(out)
    assert proposed - forwards > N * 0.02, "lookup's token seldom kept: the test has no power"


def test_sampled_two_levels_keep_the_target_distribution():
    prompt = [1, 1, 1]
    target = tiny_llama(11, vocab=V, hidden=32)
    draft = perturbed(target, 0.6, seed=4)
    sharpen(target, draft)
    exact = exact_two_token_distribution(target, prompt, 1.0, 0, 1.0)
    assert_distinct(exact, exact_two_token_distribution(draft, prompt, 1.0, 0, 1.0))
    out = sampled_two_level(target, draft, prompt)
    assert_target_distribution(out, exact)
    proposed, forwards = two_level(out)
    assert proposed - forwards > N * 0.02


def test_the_inner_plan_checks_what_its_measured_costs_pay_for():
    cost = CostModel(max_k=8, draft_s={"model": 0.010})
    sure = Proposal("lookup", [1, 2, 3, 4], None, [0.9, 0.9, 0.9, 0.9])
    unsure = Proposal("suffix", [5, 6], None, [0.05, 0.05])

    def seconds(w):
        return cost.draft("model", w)

    assert inner_plan(seconds, [sure]) is None  # wide forwards never measured: one token per forward
    cost.draft_width_s["model"] = {2: 0.011, 3: 0.012, 5: 0.014}
    choice = inner_plan(seconds, [unsure, sure])
    assert choice is not None and choice.drafter == "lookup" and choice.tokens == [1, 2, 3, 4]
    assert inner_plan(seconds, [unsure]) is None  # 1.05 tokens for 10% more time: not worth it
    cost.draft_width_s["model"] = {2: 0.030, 5: 0.060}  # a wide forward as dear as three narrow ones
    assert inner_plan(seconds, [sure]) is None


def test_the_target_plan_drafts_longer_when_two_levels_make_draft_tokens_cheaper():
    cost = CostModel(max_k=8, draft_s={"model": 0.030}, verify_s={k: 0.040 + 0.002 * k for k in range(9)})
    before = plan(cost, [RowOptions(models={"model": 0.9})]).choices[0]
    for _ in range(10):
        cost.observe_drafting("model", 0.030 * 4 / 3, 4)  # 4 tokens for the price of 1.33 one-token steps
    assert cost.draft_token_ratio["model"] == pytest.approx(1 / 3)
    after = plan(cost, [RowOptions(models={"model": 0.9})]).choices[0]
    assert after[0] == "model" and after[1] > before[1]


def test_the_costs_of_wide_draft_forwards_survive_the_cost_cache():
    cost = CostModel(max_k=8, draft_s={"model": 0.010}, verify_s={0: 0.04})
    cost.draft_width_s["model"] = {2: 0.012, 4: 0.016}
    cost.observe_drafting("model", 0.02, 4)
    again = CostModel(max_k=8)
    again.load(cost.to_dict())
    assert again.draft("model", 3) == pytest.approx(0.014)
    assert again.draft_per_token("model") == pytest.approx(cost.draft_per_token("model"))
