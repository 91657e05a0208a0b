"""The feature-level (EAGLE) drafter behind the drafter seam: greedy output stays identical to
the target's alone and mixed with the other drafters in one batch, rows joining and
leaving; every proposal equals a from-scratch recomputation (the target's features of the
row's whole sequence, the draft run causally over its pairs), so features stay aligned
with positions and drafted pairs never outlive their iteration; the target's features come
back the same from the lean forward and from transformers' forward."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import greedy_reference, tiny_llama

from specdec_llm.engine import GenerationRequest, SpeculativeDecoder, hf, lean
from specdec_llm.engine.decoder import Batch
from specdec_llm.engine.drafting.eagle import EagleDrafter
from specdec_llm.engine.ragged import RaggedCache

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 9, 9, 9], [30, 31, 32, 30, 31], [100, 3, 100, 3, 100], [7], [40, 41]]


class TinyEagle(torch.nn.Module):
    """A feature-level draft of the shape specdec_llm.pairs.build_eagle builds: one decoder layer over
    inputs(x, fuse(f)). ``echo``: the layer is a no-op and the inputs pass the last feature
    layer's output through, so the draft predicts what the target predicted one position
    earlier (it proposes repeats of the last token: often accepted on a tiny random target)."""

    def __init__(self, target, layers: list[int], seed: int, echo: bool = False):
        super().__init__()
        from transformers import LlamaForCausalLM

        cfg = copy.deepcopy(target.config)
        cfg.num_hidden_layers = 1
        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(cfg).eval()
        self.feature_layers = layers
        h = cfg.hidden_size
        self.fc_fuse = torch.nn.Linear(len(layers) * h, h, bias=False)
        self.fc_in = torch.nn.Linear(2 * h, h, bias=False)
        if echo:
            with torch.no_grad():
                self.model.lm_head.weight.copy_(target.lm_head.weight)
                self.model.model.norm.weight.copy_(target.model.norm.weight)
                layer = self.model.model.layers[0]
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
                self.fc_fuse.weight.zero_()
                self.fc_fuse.weight[:, -h:] = torch.eye(h)
                self.fc_in.weight.zero_()
                self.fc_in.weight[:, h:] = torch.eye(h)
        self.requires_grad_(False)

    def fuse(self, f):
        return self.fc_fuse(f)

    def inputs(self, ids, g):
        return self.fc_in(torch.cat([self.model.model.embed_tokens(ids), g], -1))


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, layers=3)


@torch.inference_mode()
def reference_proposal(target, draft, seq: list[int], k: int) -> list[int]:
    """The draft's greedy proposal after ``seq``, recomputed from scratch with transformers'
    own forwards: the target's features of seq, the draft causal over (f_j, seq[j+1]), then
    over its own drafted pairs."""
    with hf.layer_outputs(target, tuple(draft.feature_layers)) as outs:
        target(input_ids=torch.tensor([seq]))
    feats = torch.cat(outs, -1)[0, : len(seq) - 1]
    u = draft.inputs(torch.tensor([seq[1:]]), draft.fuse(feats)[None])
    out: list[int] = []
    for _ in range(k):
        with hf.layer_outputs(draft.model, (0,)) as own:
            logits = draft.model(inputs_embeds=u).logits
        out.append(int(logits[0, -1].argmax()))
        nxt = draft.inputs(torch.tensor([[out[-1]]]), own[0][:, -1:])
        u = torch.cat([u, nxt], 1)
    return out


def recorder(dec: SpeculativeDecoder, batch: Batch, seen: list):
    session = batch.sessions["eagle"]
    propose = session.propose

    def wrapped(rows, ks):
        drafts = propose(rows, ks)
        seen.extend((list(rows[b].tokens), p.tokens) for b, p in drafts.proposals.items())
        return drafts

    session.propose = wrapped


def make_draft(target, kind: str):
    if kind == "built":  # what specdec_llm/training/eagle.py trains (a vocabulary-subset head)
        from specdec_llm.pairs import build_eagle

        torch.manual_seed(7)
        draft = build_eagle(target, [0, 2], torch.randperm(256)[:96].sort().values, init="random")
        return draft
    return TinyEagle(target, [0, 2], seed=5, echo=kind == "echo")


@pytest.mark.parametrize("kind", ["echo", "random", "built"])
def test_eagle_alone_and_mixed_is_greedy_identical_and_proposes_what_a_recomputation_does(kind):
    target = tiny_llama(0, layers=3)  # untuned: a draft copies a layer of it before the decoder tunes kernels
    draft = make_draft(target, kind)
    dec = SpeculativeDecoder(target, draft, drafters=["lookup", "suffix", "eagle"])
    assert dec.feature_layers == (0, 2)
    batch = Batch(dec)
    seen: list = []
    recorder(dec, batch, seen)
    rows = [
        batch.add(GenerationRequest(prompt=p, max_new_tokens=n, k=k, drafter=d))
        for p, n, k, d in zip(
            PROMPTS, (30, 12, 25, 40, 9, 20), (3, 4, "auto", 2, 3, "auto"), ["eagle"] * 2 + ["auto"] * 4
        )
    ]
    for step in range(200):
        if step in (3, 7):  # rows join mid-flight
            rows.append(batch.add(GenerationRequest(prompt=PROMPTS[step % 6], max_new_tokens=15, k=3, drafter="eagle")))
        if not batch.rows:
            break
        batch.step()
        for b, r in enumerate(batch.rows):  # the draft cache holds exactly the real pairs fed
            st = r.view("eagle").state["eagle"]  # (the first token is never an input: held counts it)
            assert int(batch.sessions["eagle"].session.backend.cache.valid[b].sum()) == st.held - 1
            assert st.held + sum(len(f) for f in st.pending) == len(r.seq)
    assert not batch.rows
    for row in rows:
        assert row.result.token_ids == greedy_reference(target, row.prompt, row.req.max_new_tokens), row.prompt
    assert len(seen) > 20
    for seq, tokens in seen:
        assert tokens == reference_proposal(target, draft, seq, len(tokens)), seq
    accepted = sum(r.result.stats.drafter_tokens.get("eagle", {}).get("accepted", 0) for r in rows)
    if kind == "echo":  # the echo draft's repeats are accepted: the accept-and-keep path ran
        assert accepted >= 5, accepted


def test_eagle_with_generate_many_and_sampling(target):
    draft = TinyEagle(target, [2], seed=6, echo=True)
    dec = SpeculativeDecoder(target, draft, drafters=["eagle"])
    reqs = [GenerationRequest(prompt=p, max_new_tokens=16, k=3) for p in PROMPTS]
    for max_batch in (1, 4):
        out = dec.generate_many(reqs, max_batch=max_batch)
        for req, res in zip(reqs, out):
            assert res.token_ids == greedy_reference(target, req.prompt, 16)
    sampled = dec.generate_many(
        [GenerationRequest(prompt=p, max_new_tokens=16, k=3, temperature=0.8, seed=i) for i, p in enumerate(PROMPTS)],
        max_batch=3,
    )
    again = dec.generate_many(
        [GenerationRequest(prompt=p, max_new_tokens=16, k=3, temperature=0.8, seed=i) for i, p in enumerate(PROMPTS)],
        max_batch=1,
    )
    assert [r.token_ids for r in sampled] == [r.token_ids for r in again]  # a seed decides the text
    assert all(len(r.token_ids) == 16 for r in sampled)


def test_target_features_agree_between_the_lean_and_transformers_forwards(target):
    hf.prepare(target)
    ids = list(range(3, 20))
    got = {}
    for enabled in (True, False):
        lean.ENABLED = enabled
        try:
            cache = RaggedCache(target, 1, (0, 2))
            cache.forward([ids[:10]], 1)
            first = cache.last_features
            cache.forward([ids[10:]], 7)
            got[enabled] = torch.cat([first, cache.last_features], 1)
        finally:
            lean.ENABLED = True
    with hf.layer_outputs(target, (0, 2)) as outs:
        target(input_ids=torch.tensor([ids]))
    ref = torch.cat(outs, -1)
    assert got[True].shape == ref.shape == (1, len(ids), 2 * target.config.hidden_size)
    assert torch.allclose(got[True], ref, atol=1e-5) and torch.allclose(got[False], ref, atol=1e-5)


def test_eagle_needs_a_feature_draft(target):
    with pytest.raises(ValueError, match="feature-level draft"):
        SpeculativeDecoder(target, tiny_llama(1, layers=1), drafters=["eagle"])
    draft = TinyEagle(target, [2], seed=6)
    assert isinstance(SpeculativeDecoder(target, draft, drafters=["eagle"]).drafters[0], EagleDrafter)
