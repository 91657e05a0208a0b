"""Token trees (engine/tree.py): one forward over every branch of every row gives each node the
logits a plain forward of its own path gives, and tree acceptance keeps the target's output."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import check_caches, exact_two_token_distribution, greedy_reference, perturbed, tiny_llama
from helpers import TV_BOUND, N, V, assert_target_distribution, sampled_requests, sharpen

from specdec_llm.engine import GenerationRequest, SpeculativeDecoder, tree
from specdec_llm.engine.decoder import Batch
from specdec_llm.engine.drafting import FreeDrafter
from specdec_llm.engine.ragged import RaggedCache
from specdec_llm.engine.sampling import accept_greedy

# [root] + 6 nodes: two branches from the root, one of them forking again
TOKENS = [7, 8, 9, 10, 11, 12]
PARENTS = [-1, 0, 0, -1, 3, 1]


def test_depths_and_ancestry():
    assert tree.depths(PARENTS) == [1, 2, 2, 1, 2, 3]
    seen = tree.ancestry(PARENTS)
    assert seen[6].nonzero().flatten().tolist() == [0, 1, 2, 6]  # node 5: root, node 0, node 1, itself
    assert seen[4].nonzero().flatten().tolist() == [0, 4]
    assert tree.ancestry(tree.chain_parents(4)).equal(torch.ones(5, 5, dtype=torch.bool).tril())


def path_to(node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = PARENTS[node]
    return out[::-1]


@torch.inference_mode()
def test_one_forward_over_a_tree_gives_every_node_its_own_paths_logits():
    model = tiny_llama(3, vocab=64)
    prompts = [[1, 2, 3, 4, 5], [6, 5, 4]]  # rows of different lengths: ragged
    cache = RaggedCache(model, 0)
    cache.extend([one(model, p) for p in prompts])
    cache.drop(0, [4])  # a hole in row 0 (a rolled-back token): its logical positions skip it
    seqs = [[1, 2, 3, 4], [6, 5, 4]]
    last = [20, 21]
    logits = cache.forward([[last[b]] + TOKENS for b in range(2)], 1 + len(TOKENS), trees={0: PARENTS, 1: PARENTS})
    for b in range(2):
        plain = model(torch.tensor([seqs[b] + [last[b]]])).logits[0, -1]
        assert torch.allclose(logits[b, 0], plain, atol=1e-4)
        for node in range(len(TOKENS)):
            ids = seqs[b] + [last[b]] + [TOKENS[i] for i in path_to(node)]
            ref = model(torch.tensor([ids])).logits[0, -1]
            assert torch.allclose(logits[b, node + 1], ref, atol=1e-4), (b, node)
    # keep the path to node 5, drop the other branches: the next step sees exactly that path
    start = cache.width - len(TOKENS)
    for b in range(2):
        cache.drop(b, [start + i for i in range(len(TOKENS)) if i not in path_to(5)])
    nxt = cache.forward([[30], [31]], 1)
    for b in range(2):
        ids = seqs[b] + [last[b]] + [TOKENS[i] for i in path_to(5)] + [30 + b]
        assert torch.allclose(nxt[b, 0], model(torch.tensor([ids])).logits[0, -1], atol=1e-4)


def one(model, prompt: list[int]) -> RaggedCache:
    c = RaggedCache(model, 1)
    c.forward([prompt], 1)
    return c


def test_greedy_tree_acceptance_follows_the_targets_argmax():
    logits = torch.full((7, 16), -1.0)
    for row, best in enumerate([7, 9, 0, 0, 0, 0, 0]):  # root -> 7 (node 0) -> 9 (node 2) -> 0: no child
        logits[row, best] = 1.0
    assert tree.accept_greedy(TOKENS, PARENTS, logits) == ([0, 2], 0)
    chain_logits = logits[[0, 1, 2]]
    assert tree.accept_greedy([7, 8], tree.chain_parents(2), chain_logits) == (
        [0],
        accept_greedy([7, 8], chain_logits)[1],
    )


@pytest.mark.parametrize("siblings", [[3], [3, 5], [5, 3, 6]])
def test_sampled_tree_acceptance_keeps_the_targets_distribution(siblings):
    V, n = 8, 40_000
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, V, generator=gen) * 1.5, -1)
    parents = [-1] * len(siblings)
    counts = torch.zeros(V)
    for _ in range(n):
        path, nxt = tree.accept_sampled(siblings, parents, p[[0] * (1 + len(siblings))], gen)
        counts[siblings[path[0]] if path else nxt] += 1
    tv = float(0.5 * (counts / n - p[0]).abs().sum())
    assert tv < TV_BOUND / 2, tv


# -- trees in the decode loop -----------------------------------------------------------------------
class Fixed(FreeDrafter):
    """A free drafter that always offers the same continuation (deterministic, not shared)."""

    def __init__(self, name: str, tokens: list[int]):
        super().__init__(prior=0.5)
        self.name, self.tokens = name, tokens

    def continuation(self, row, k):
        out = self.tokens[:k]
        return out, list(range(len(out)))


def flat(dec: SpeculativeDecoder, max_batch: int = 1) -> None:
    """Fixed costs for every batch size up to ``max_batch``, flat in width: trees always pay
    (as on a GPU). Kept fixed: live iterations would reshape them per width, so how many
    trees pay would depend on this machine's load (under make test's, a few noisy wide
    verifications were enough to stop them: 8 of 20,000 rows)."""
    dec.calibrate_batches(max_batch)
    for cost in dec.costs.models.values():
        cost.verify_s = dict.fromkeys(cost.verify_s, 0.010)
        cost.draft_s = dict.fromkeys(cost.draft_s, 0.002)
        cost.draft_width_s = {n: dict.fromkeys(shape, 0.002) for n, shape in cost.draft_width_s.items()}
        cost.verify_scale, cost.width_ratio, cost.draft_scale, cost.draft_token_ratio = 1.0, {}, {}, {}
        cost.plain_ratio, cost.plain_overhead_s = 1.0, 0.0
        for observe in ("observe_verify", "observe_draft", "observe_drafting", "observe_plain"):
            setattr(cost, observe, lambda *args, **kwargs: None)


def count_trees(monkeypatch) -> list[int]:
    seen = [0]
    verify = Batch.verify

    def counting(self, props, widths):
        seen[0] += sum(1 for p in props.values() if p.parents is not None)
        return verify(self, props, widths)

    monkeypatch.setattr(Batch, "verify", counting)
    return seen


def test_trees_in_the_loop_stay_greedy_identical_with_exact_caches(monkeypatch):
    target = tiny_llama(0)
    dec = SpeculativeDecoder(target, perturbed(target, 0.2, 3), drafters=["model", "lookup", "suffix"])
    dec.drafters.append(Fixed("fixed", [9, 8, 9, 8]))
    flat(dec, 2)
    trees = count_trees(monkeypatch)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 8, 9, 9, 8, 9], [20, 21, 22, 23, 24, 20, 21]]
    for i in range(2):  # one row alone, then rows side by side
        batch = Batch(dec)
        rows = [batch.add(GenerationRequest(prompt=p, max_new_tokens=30)) for p in (prompts if i else prompts[:1])]
        while batch.rows:
            batch.step()
            check_caches(batch)
        for row in rows:
            assert row.result.token_ids == greedy_reference(target, row.prompt, 30)
    assert trees[0] >= 5  # (21-28 on a quiet 2-core host, 9 under make test's load: the count is not exact)


def test_a_model_drafters_second_choices_join_its_chain_as_branches(monkeypatch):
    """A draft model alone (no free drafter to offer branches): where its first choice is in
    doubt, its second joins the chain as a one-token branch, and some are the target's
    token: more tokens per target forward than the chains alone, greedy identical."""
    target = tiny_llama(0)
    draft = perturbed(target, 0.3, 3)
    per_forward = {}
    for trees in (False, True):
        dec = SpeculativeDecoder(target, draft, drafters=["model"], trees=trees)
        flat(dec, 1)
        seen = count_trees(monkeypatch)
        tokens = forwards = 0
        for p in ([5, 6, 7, 5, 6, 7, 5, 6], [20, 21, 22, 23, 24, 20, 21], [3, 1, 4, 1, 5, 9, 2, 6]):
            batch = Batch(dec)
            row = batch.add(GenerationRequest(prompt=p, max_new_tokens=40, k=4))
            while batch.rows:
                batch.step()
                check_caches(batch)
            assert row.result.token_ids == greedy_reference(target, p, 40)
            tokens, forwards = tokens + len(row.result.token_ids), forwards + row.result.stats.target_forwards
        assert (seen[0] > 10) == trees
        per_forward[trees] = tokens / forwards
    assert per_forward[True] > per_forward[False]


@torch.inference_mode()
def test_a_draft_drafts_on_its_branches_as_it_would_on_their_paths(monkeypatch):
    """A draft model's branches are drafted on in the chain's forwards (each token seeing only
    its own path): every token after a branch's second choice is the draft's greedy token
    after that path, as a plain forward of the path gives it; rows side by side, greedy
    identical, caches exact."""
    target = tiny_llama(0)
    drafter = "model"  # (the self-draft's cache holds the target's keys: no plain forward to compare)
    dec = SpeculativeDecoder(target, perturbed(target, 0.3, 3), drafters=[drafter])
    flat(dec, 3)
    model = dec.drafter(drafter).model
    session_type = type(Batch(dec).sessions[drafter].session)  # (the drafter's own, inside the loop's guard)
    propose, seen = session_type.propose, []

    def checking(self, rows, ks):
        drafts = propose(self, rows, ks)
        for b, prop in drafts.proposals.items():
            for path in prop.branches or ():
                fork = prop.fork(path)
                for i in range(fork + 1, len(path.tokens)):
                    ids = torch.tensor([rows[b].tokens + path.tokens[:i]])
                    assert path.tokens[i] == int(model(ids).logits[0, -1].argmax()), (b, path.tokens, i)
                    seen.append(i - fork)
        return drafts

    monkeypatch.setattr(session_type, "propose", checking)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [20, 21, 22, 23, 24, 20, 21], [3, 1, 4, 1, 5, 9, 2, 6]]
    batch = Batch(dec)
    rows = [batch.add(GenerationRequest(prompt=p, max_new_tokens=30, k=4)) for p in prompts]
    while batch.rows:
        batch.step()
        check_caches(batch)
    for row in rows:
        assert row.result.token_ids == greedy_reference(target, row.prompt, 30)
    assert len(seen) > 10 and max(seen) >= 2  # branches drafted on, some more than once


def test_sampled_rows_verified_as_trees_keep_the_target_distribution(monkeypatch):
    prompt = [1, 2, 1, 2, 1]
    target = tiny_llama(11, vocab=V, hidden=32)
    sharpen(target)
    exact = exact_two_token_distribution(target, prompt, 1.0, 0, 1.0)
    dec = SpeculativeDecoder(target, None, drafters=["lookup"])
    dec.drafters += [Fixed("fixed", [3, 4]), Fixed("other", [5, 6])]
    flat(dec, 8)  # (generate_many's batches)
    trees = count_trees(monkeypatch)
    random.seed(0)  # unseeded rows (a seeded row keeps its chain: its text depends on its seed alone)
    out = dec.generate_many([dataclasses.replace(r, seed=None) for r in sampled_requests(prompt, N)])
    assert trees[0] > N // 10
    assert_target_distribution(out, exact)


def test_a_seeded_sampled_rows_text_does_not_depend_on_whether_trees_pay():
    """A seeded sampled row's text depends on its seed alone: with two deterministic drafters
    (lookup and one of the user's own), whether their offers would pay as a tree depends on the
    machine's verify costs, and a tree draws differently, so such a row keeps its chain."""

    class Repeat(FreeDrafter):
        name = "repeat"

        def continuation(self, row, k):
            return [row.tokens[-1]] * k, list(range(k))

    def texts(wide: bool) -> list[list[int]]:
        dec = SpeculativeDecoder(tiny_llama(0), None, drafters=["lookup", Repeat()], seeded_k=4)
        dec.calibrate_batches(1)
        for cost in dec.costs.models.values():  # flat: a wide verification is free (trees pay); steep: never
            cost.verify_s = {k: 0.010 * (1 + (0 if wide else 9 * k)) for k in cost.verify_s}
            for name in ("observe_verify", "observe_draft", "observe_drafting", "observe_plain"):
                setattr(cost, name, lambda *a, **k: None)
        prompt = [5, 6, 7, 5, 6, 7, 7]
        return [
            dec.generate(GenerationRequest(prompt=prompt, max_new_tokens=30, temperature=1.0, seed=s)).token_ids
            for s in range(6)
        ]

    assert texts(False) == texts(True)
