"""Any Hugging Face causal LM: tiny random models of many families (configs built here, nothing
downloaded), each greedy-identical to transformers' ``generate`` with a draft model, its own
int4 copy and lookup only, at a fixed k, k = auto and batched with rows joining and leaving."""

from __future__ import annotations

import pytest
import torch
from conftest import check_caches, exact_two_token_distribution, greedy_reference, perturbed
from families import CONFIGS, WINDOW, tiny_family
from helpers import N as SAMPLES
from helpers import V, assert_distinct, assert_target_distribution, sampled_requests, sharpen

from specdec_llm.engine import GenerationRequest, SpeculativeDecoder
from specdec_llm.engine.decoder import Batch
from specdec_llm.engine.quant import quantized_copy

# longer than the window (8): the sliding layers' masks matter; a repeated span gives lookup work
PROMPTS = [[5, 6, 7], list(range(40, 61)) + list(range(40, 50)), [17, 3, 99, 4, 8, 120, 33, 1, 2, 250, 7, 7]]
N = 3 * WINDOW


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request):
    target = tiny_family(request.param)
    return request.param, target, {r: greedy_reference(target, p, N) for r, p in enumerate(PROMPTS)}


def drafts(target):
    return {
        "draft model": (perturbed(target, 0.1, seed=3), ["model"]),
        "int4 self-draft": (quantized_copy(target, head="target"), ["lookup", "quantized"]),
        "lookup only": (None, ["lookup"]),
    }


def test_greedy_identical_in_every_mode(family):
    name, target, refs = family
    for mode, (draft, names) in drafts(target).items():
        dec = SpeculativeDecoder(target, draft, drafters=names)
        for k in (4, "auto"):
            for r, prompt in enumerate(PROMPTS):
                res = dec.generate(GenerationRequest(prompt=prompt, max_new_tokens=N, k=k))
                assert res.token_ids == refs[r], (name, mode, k, r)
        # rows joining and leaving, caches checked after every iteration
        batch = Batch(dec)
        rows = [batch.add(GenerationRequest(prompt=PROMPTS[0], max_new_tokens=N, k=3))]
        for step in range(4 * N):
            if step in (1, 4):
                rows.append(batch.add(GenerationRequest(prompt=PROMPTS[step % 3], max_new_tokens=N - step, k="auto")))
                rows.append(batch.add(GenerationRequest(prompt=PROMPTS[2], max_new_tokens=5, k=2)))
            if not batch.rows:
                break
            batch.step()
            check_caches(batch)
        for row in rows:
            ref = refs[PROMPTS.index(row.prompt)][: row.req.max_new_tokens]
            assert row.result.token_ids == ref, (name, mode, "batched", row.prompt)


@pytest.mark.parametrize("name", ["qwen3", "gpt-neox"])
def test_sampling_keeps_the_target_distribution_beyond_llama(name):
    """As test_engine's sampled test (same bound and N: 10,000 seeded samples of the first two
    tokens against the exact target distribution), on two other families (Qwen3's q/k norms,
    GPT-NeoX's layers under ``gpt_neox``)."""
    prompt = [1, 2, 3]
    target = tiny_family(name, seed=11, vocab=V)
    sharpen(target)
    draft = perturbed(target, 0.5, seed=12)  # partly aligned: drafts are accepted and rejected
    exact = exact_two_token_distribution(target, prompt, 1.0, 0, 1.0)
    assert_distinct(exact, exact_two_token_distribution(draft, prompt, 1.0, 0, 1.0))
    dec = SpeculativeDecoder(target, draft)
    out = dec.generate_many(sampled_requests(prompt), max_batch=256)
    assert_target_distribution(out, exact)
    assert sum(r.stats.draft_tokens_accepted for r in out) > SAMPLES * 0.1


LEAN = ["llama", "mistral", "mistral-sliding", "qwen2", "qwen2-sliding", "qwen3", "phi3", "gemma3"]


@pytest.mark.parametrize("name", LEAN + ["phi3-partial-rotary"])
@pytest.mark.parametrize("tuned", [False, True])
def test_lean_forward_equals_transformers_beyond_llama(name, tuned, monkeypatch):
    """engine/lean.py serves these families with the same logits as transformers' forward (up
    to the last bits a fused matmul's kernel moves, as for Llama in test_kernels) and the same
    argmax: one row, a ragged batch with holes and padding, prefill and verification past the
    sliding window, on plain and kernel-tuned weights, and on the int4 copy."""
    from specdec_llm.engine import hf, lean
    from specdec_llm.engine.ragged import RaggedCache

    if name == "phi3-partial-rotary":  # (Phi-4-mini's layout: a rotary over part of each head)
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        cfg = CONFIGS["phi3"](512)
        cfg.rope_parameters["partial_rotary_factor"] = 0.5
        target = AutoModelForCausalLM.from_config(cfg).eval()
    else:
        target = tiny_family(name)
    for model in (target, quantized_copy(target, head="target")):
        hf.prepare(model, None) if tuned else model.set_attn_implementation(hf.ATTENTION)

        def run(enabled: bool, model=model) -> list[torch.Tensor]:
            monkeypatch.setattr(lean, "ENABLED", enabled)
            out = []
            one = RaggedCache(model, 1)
            out.append(one.forward([list(range(3, 40))], 5))  # prefill past the window
            out.append(one.forward([[7]], 1))
            out.append(one.forward([[9, 10, 11, 12, 13]], 5))
            batch = RaggedCache(model, 2)
            out.append(batch.forward([list(range(1, 15)), [8, 9]], 1))  # padded rows: masked
            batch.drop(0, [batch.width - 2])  # a hole
            out.append(batch.forward([[20, 21, 22], [23]], 3))
            out.append(batch.forward([[24], [25]], 1))
            return out

        ref, got = run(False), run(True)
        assert lean.runner(model) is not None, name
        for r, g in zip(ref, got):
            assert torch.allclose(r, g, atol=1e-5, rtol=0), (name, (r - g).abs().max())
            assert torch.equal(r.argmax(-1), g.argmax(-1)), name


@pytest.mark.parametrize("name", ["gemma2", "olmo2", "cohere", "gpt2", "falcon"])
def test_lean_forward_leaves_other_families_to_transformers(name):
    """Layouts the lean forward does not repeat (Gemma 2's attention soft-capping, OLMo 2's
    norms after the blocks only, Cohere's parallel block, other layer classes) decode through
    transformers' own forward (the matrix above proves them identical)."""
    from specdec_llm.engine import lean

    assert lean.runner(tiny_family(name)) is None


def test_a_family_the_engine_cannot_decode_is_refused_at_load(tmp_path):
    """Mamba's cache holds recurrent states, not attention keys and values: load_pair says so
    with a PairError naming the family and the reason (no traceback in a request), while
    every family of the matrix passes the same check."""
    from conftest import tiny_tokenizer
    from transformers import AutoModelForCausalLM, MambaConfig

    from specdec_llm.engine.ragged import unservable
    from specdec_llm.pairs import PairError, PairSpec, load_pair

    tok = tiny_tokenizer()
    cfg = MambaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, state_size=8)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "mamba")
    tok.save_pretrained(tmp_path / "mamba")
    with pytest.raises(PairError, match=r"pair m: the target \(mamba, MambaForCausalLM\) cannot be decoded"):
        load_pair(PairSpec(name="m", target=str(tmp_path / "mamba")))
    assert [n for n in sorted(CONFIGS) if unservable(tiny_family(n))] == []


def test_int4_copy_runs_projections_with_biases_as_one_matmul():
    """Qwen2's q/k/v carry biases: its int4 copy still multiplies them as one matmul (the
    biases concatenated), with the logits of a copy that keeps them apart."""
    from specdec_llm.engine import lean

    target = tiny_family("qwen2")
    with torch.no_grad():
        for layer in target.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    fused, apart = (quantized_copy(target, head="target", fuse=f) for f in (True, False))
    assert lean.runner(fused).layers[0].qkv is not None
    assert lean.runner(apart).layers[0].qkv is None
    ids = torch.tensor([list(range(3, 30))])
    with torch.no_grad():
        got, want = fused(ids).logits, apart(ids).logits
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
