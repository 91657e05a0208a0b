"""The engine's guarantees: lossless greedy, distribution-preserving sampling, stats, stops, bad input."""

from __future__ import annotations

import itertools

import pytest
from conftest import check_caches, exact_two_token_distribution, greedy_reference, perturbed, tiny_llama
from helpers import N, V, assert_distinct, assert_target_distribution, sampled_requests, sharpen

from specdec_llm.engine import GenerationRequest, RequestError, SpeculativeDecoder, expected_speedup
from specdec_llm.engine import decoder as decoder_mod

PROMPTS = [[5, 6, 7], [17, 3, 99, 4, 8, 120, 33, 1, 2, 250, 7, 7], list(range(40, 71))]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


@pytest.mark.parametrize("draft_kind", ["same", "unrelated", "partial"])
def test_greedy_is_token_identical_to_generate(target, draft_kind):
    draft = {"same": target, "unrelated": tiny_llama(7, layers=1), "partial": perturbed(target, 0.2, seed=3)}[
        draft_kind
    ]
    dec = SpeculativeDecoder(target, draft)
    acceptance = []
    for prompt, n, k in itertools.product(PROMPTS, (1, 17, 48), (0, 1, 3, 6, "auto")):
        ref = greedy_reference(target, prompt, n)
        res = dec.generate(GenerationRequest(prompt=prompt, max_new_tokens=n, k=k))
        assert res.token_ids == ref, (draft_kind, prompt, n, k)
        assert res.finish_reason == "length"
        if k not in (0, "auto") and n > 1:
            acceptance.append(res.stats.acceptance_rate)
    mean = sum(acceptance) / len(acceptance)
    if draft_kind == "same":
        assert mean == 1.0
    elif draft_kind == "unrelated":
        assert mean < 0.15
    else:
        assert 0.15 < mean < 0.98  # partially aligned: the rollback path really runs


def test_bf16_greedy_emits_the_targets_argmax_within_bf16_rounding():
    """In bf16 a forward over k + 1 tokens rounds differently from k + 1 one-token forwards
    (oneDNN's bf16 matmul at 9 rows differs from 9 one-row products in ~2 of 10,000 outputs, by one
    bf16 step), and top-2 logits tie exactly at ~1% of a real model's positions: greedy output then
    leaves the k = 0 output at such a position (here 4 of 6 prompts; fp32 stays token-identical,
    above). What holds, and fails for any wrong token (the top two are 6-13 bf16 steps apart at
    the median): every emitted token is the target's argmax at its position, teacher-forced,
    within 2 bf16 steps of the top logit."""
    import copy

    import torch

    from specdec_llm.engine.quant import quantized_copy

    target = tiny_llama(0, vocab=2048, layers=4, hidden=256).to(torch.bfloat16)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(8)  # (sharper: top-2 spacing well above rounding)
    reference = copy.deepcopy(target)
    dec = SpeculativeDecoder(target, quantized_copy(target), drafters=["lookup", "quantized"], eos_token_ids=[])
    for prompt in [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4], [3], list(range(100, 140))]:
        out = dec.generate(GenerationRequest(prompt=prompt, max_new_tokens=64, k=4)).token_ids
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
        top = logits.max(-1).values
        step = torch.exp2(torch.floor(torch.log2(top.abs())) - 7)  # one bf16 step at the top logit
        gap = (top - logits.gather(1, torch.tensor(out)[:, None])[:, 0]) / step
        assert gap.max() <= 2, (prompt, gap.argmax().item(), gap.max().item())


@pytest.mark.smollm2
def test_greedy_identical_on_real_smollm2(smollm2):
    dec = smollm2.decoder()
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly."]
    for text, k in zip(prompts, (4, "auto", 2)):
        ids = dec.encode(GenerationRequest(prompt=text, chat=True))
        ref = greedy_reference(smollm2.target, ids, 32)
        res = dec.generate(GenerationRequest(prompt=text, chat=True, max_new_tokens=32, k=k))
        eos = ref.index(2) + 1 if 2 in ref else len(ref)
        assert res.token_ids == ref[:eos], text


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 6, 0.9)])
def test_sampling_preserves_target_distribution(temperature, top_k, top_p):
    """10,000 seeded samples of the first two tokens vs the exact target distribution, within
    ``helpers.TV_BOUND`` (its derivation in helpers.py), the draft at least 0.2 away."""
    prompt = [1, 2, 3]
    target = tiny_llama(11, vocab=V, hidden=32)
    draft = tiny_llama(12, vocab=V, hidden=32, layers=1)
    sharpen(target, draft)  # the random models into distinct distributions
    exact = exact_two_token_distribution(target, prompt, temperature, top_k, top_p)
    assert_distinct(exact, exact_two_token_distribution(draft, prompt, temperature, top_k, top_p))
    dec = SpeculativeDecoder(target, draft)
    # rows decode independently (each its own seeded generator; test_batch shows batched rows
    # equal one-at-a-time rows): a wide batch runs the same rule twice as fast as N one-row calls
    out = dec.generate_many(sampled_requests(prompt, temperature=temperature, top_k=top_k, top_p=top_p), max_batch=256)
    assert_target_distribution(out, exact)
    assert sum(r.stats.draft_tokens_accepted for r in out) > N * 0.1  # accepted, not only resampled


def test_seed_reproducible_and_auto_k_seeded(target):
    dec = SpeculativeDecoder(target, perturbed(target, 0.5, seed=1))
    req = dict(prompt=[3, 4, 5], max_new_tokens=30, temperature=0.9, top_p=0.95, seed=123)
    a = dec.generate(GenerationRequest(**req))
    b = dec.generate(GenerationRequest(**req))
    c = dec.generate(GenerationRequest(**{**req, "seed": 124}))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    # seeded + auto: a fixed, machine-independent k (only clipped by the room left at the end)
    assert a.stats.k_values[:4] == [dec.seeded_k] * 4


def test_a_top_p_below_float32s_least_number_keeps_the_top_token_and_its_batch(target):
    """top_p = 1e-300 is valid (0 < top_p <= 1) but compares as 0 in float32: it dropped every
    token, and the NaN failed every row of its batch. It is the top token alone now."""
    dec = SpeculativeDecoder(target, perturbed(target, 0.5, seed=1))
    greedy = GenerationRequest(prompt=[3, 4, 5], max_new_tokens=12, k=2)
    tiny = GenerationRequest(prompt=[3, 4, 5], max_new_tokens=12, k=2, temperature=1.0, top_p=1e-300, seed=3)
    a, b = dec.generate_many([greedy, tiny], max_batch=2)
    assert b.token_ids == a.token_ids == dec.generate(greedy).token_ids  # the top token: greedy's


def test_a_temperature_past_float32s_largest_number_samples_nearly_uniformly_among_the_allowed():
    """temperature = 1e39 is valid (finite, >= 0) but inf in float32: a masked token's -inf / inf
    was NaN, and multinomial failed every row of the batch (a grammar's mask, a subset head)."""
    import torch

    from specdec_llm.engine.sampling import probs

    p = probs(torch.tensor([[1.0, 2.0, float("-inf")]]), 1e39, 0, 1.0)
    assert torch.allclose(p, torch.tensor([[0.5, 0.5, 0.0]]))


def test_stop_strings_on_a_decoder_without_a_tokenizer_are_refused(target):
    """A decoder of token ids alone cannot find a stop string in text it never decodes: it was
    accepted and ignored (finish reason "length")."""
    dec = SpeculativeDecoder(target, perturbed(target, 0.5, seed=1))
    with pytest.raises(RequestError, match=r"^stop: this decoder has no tokenizer"):
        dec.generate(GenerationRequest(prompt=[3, 4, 5], max_new_tokens=4, stop=["a"]))


def test_a_draft_with_fewer_positions_than_the_target_drafts_only_where_it_reaches():
    """A GPT-2 draft of 128 learned positions for a target of 512: a row past 128 tokens is
    decoded by the target alone (exact), not an IndexError that failed its batch."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    def gpt2(positions: int, seed: int) -> GPT2LMHeadModel:
        torch.manual_seed(seed)
        config = GPT2Config(vocab_size=256, n_embd=64, n_layer=1, n_head=4, n_positions=positions, eos_token_id=None)
        return GPT2LMHeadModel(config).eval()

    dec = SpeculativeDecoder(gpt2(512, 0), gpt2(128, 1), drafters=["model"])
    rows = [
        GenerationRequest(prompt=p, max_new_tokens=10, k=4) for p in ([5, 6, 7], list(range(120)), list(range(200)))
    ]
    out = dec.generate_many(rows, max_batch=3)
    for r, o in zip(rows, out):
        assert o.token_ids == dec.generate(GenerationRequest(r.prompt, max_new_tokens=10, mode="baseline")).token_ids
    assert out[0].stats.draft_tokens_proposed > 0 and out[2].stats.draft_tokens_proposed == 0


class CheckedBatch(decoder_mod.Batch):
    def step(self):
        done = super().step()
        check_caches(self)
        return done


def test_kv_caches_hold_exactly_the_emitted_prefix(target, monkeypatch):
    monkeypatch.setattr(decoder_mod, "Batch", CheckedBatch)
    dec = SpeculativeDecoder(target, perturbed(target, 0.2, seed=3))
    for k in (2, 5, "auto"):
        for temperature in (0.0, 1.0):
            res = dec.generate(
                GenerationRequest(prompt=[9, 8, 7, 6], max_new_tokens=25, k=k, temperature=temperature, seed=1)
            )
            assert res.stats.output_tokens == 25


def test_stats_invariants(target):
    dec = SpeculativeDecoder(target, perturbed(target, 0.2, seed=3))
    for k in (0, 3, "auto"):
        res = dec.generate(GenerationRequest(prompt=[1, 2, 3, 4], max_new_tokens=40, k=k))
        s = res.stats
        assert s.output_tokens == len(res.token_ids) == 40
        assert s.prompt_tokens == 4
        assert 0 <= s.draft_tokens_accepted <= s.draft_tokens_proposed == sum(s.k_values)
        assert s.target_forwards == len(s.k_values)
        # emitted = accepted + one target token per iteration (nothing cut here)
        assert s.output_tokens == s.draft_tokens_accepted + s.target_forwards
        assert s.mean_accepted_length == pytest.approx(s.output_tokens / s.target_forwards)
        assert s.acceptance_rate == (
            s.draft_tokens_accepted / s.draft_tokens_proposed if s.draft_tokens_proposed else 0
        )
        assert all(0 <= a <= 1 for a in s.per_position_acceptance)
        assert len(s.per_position_acceptance) == max(s.k_values)
        assert 0 < s.time_to_first_token_s <= s.wall_time_s
        assert s.draft_time_s + s.target_time_s <= s.wall_time_s
        assert s.tokens_per_s == pytest.approx(s.output_tokens / s.wall_time_s)
        if k == 0:
            assert s.draft_forwards == 0 and s.draft_tokens_proposed == 0
        assert res.to_dict()["stats"]["k_values"] == s.k_values  # JSON-able


def test_baseline_mode_never_drafts(target):
    dec = SpeculativeDecoder(target, target)
    res = dec.generate(GenerationRequest(prompt=[1, 2], max_new_tokens=10, k=4, mode="baseline"))
    assert res.stats.draft_forwards == 0 and set(res.stats.k_values) == {0}
    assert res.token_ids == greedy_reference(target, [1, 2], 10)


def test_eos_stops_inside_an_accepted_block(target):
    ref = greedy_reference(target, [5, 6, 7], 30)
    eos = ref[12]
    first = ref.index(eos)
    model = tiny_llama(0, eos=eos)  # same weights (seed 0), EOS set to a token the output hits
    dec = SpeculativeDecoder(model, model)  # draft == target: EOS arrives inside a fully accepted block
    res = dec.generate(GenerationRequest(prompt=[5, 6, 7], max_new_tokens=30, k=5))
    assert res.finish_reason == "eos"
    assert res.token_ids == ref[: first + 1]
    assert res.stats.output_tokens == first + 1


def test_context_limit():
    model = tiny_llama(0, ctx=32)
    dec = SpeculativeDecoder(model, model)
    res = dec.generate(GenerationRequest(prompt=list(range(1, 21)), max_new_tokens=50, k=4))
    assert res.finish_reason == "context"
    assert len(res.token_ids) == 12
    with pytest.raises(RequestError, match="prompt: is 40 tokens but the model's context is 32"):
        dec.generate(GenerationRequest(prompt=list(range(1, 41)), max_new_tokens=5))


def test_stop_strings_cut_text_and_stream(tiny_pair_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair_dir / "target")
    model = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "target").eval()
    dec = SpeculativeDecoder(model, model, tok)
    full = dec.generate(GenerationRequest(prompt="The quick brown", max_new_tokens=40, k=3))
    assert len(full.text) > 12
    stop = full.text[8:11]
    chunks = []
    res = dec.generate(
        GenerationRequest(prompt="The quick brown", max_new_tokens=40, k=3, stop=[stop]), on_text=chunks.append
    )
    cut = full.text.index(stop)
    assert res.finish_reason == "stop"
    assert res.text == full.text[:cut]
    assert "".join(chunks) == res.text
    assert stop not in "".join(chunks)
    assert tok.decode(res.token_ids).startswith(res.text[: max(0, cut - 4)])


def test_a_stop_string_after_a_partial_character_is_never_streamed(tiny_pair_dir):
    """One token at a time, "ok 日本語" passes through text ending in a partial UTF-8 character
    ("\ufffd"): the hold-back for the stop string counts from before it, so no part of the stop
    string is sent before the stop is found."""
    from transformers import AutoTokenizer

    from specdec_llm.engine.text import TextStream

    tok = AutoTokenizer.from_pretrained(tiny_pair_dir / "target")
    ids = tok("ok 日本語")["input_ids"]
    assert any(tok.decode(ids[:n]).endswith("\ufffd") for n in range(len(ids)))  # it does split a character
    sent: list[str] = []
    stream = TextStream(tok, ["日本"], sent.append)
    for n in range(1, len(ids) + 1):
        keep = stream.update(ids[:n])
        stream.send(final=keep is not None)
        assert stream.text.startswith("".join(sent)), (sent, stream.text)
        if keep is not None:
            break
    assert stream.text == "ok " and "".join(sent) == "ok "


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("prompt", "", "prompt: is empty"),
        ("prompt", "   ", "prompt: is empty"),
        ("prompt", [], "prompt: has no tokens"),
        ("max_new_tokens", 0, "max_new_tokens: 0 is below 1"),
        ("temperature", -0.1, "temperature: -0.1 must be >= 0"),
        ("temperature", float("nan"), "temperature: nan is not a finite number; it must be >= 0"),
        ("temperature", float("inf"), "temperature: inf is not a finite number; it must be >= 0"),
        pytest.param(
            "temperature",
            10**400,  # (an int past a float's range: hypothesis found an OverflowError)
            r"temperature: 100000000000\.\.\. \(401 digits\) is not a finite number",
            id="temperature-past-floats",
        ),
        ("top_p", float("nan"), "top_p: nan is not a finite number; it must be in \\(0, 1\\]"),
        ("top_p", 0.0, "top_p: 0.0 must be in \\(0, 1\\]"),
        ("top_p", 1.5, "top_p: 1.5 must be in \\(0, 1\\]"),
        ("top_k", -1, "top_k: -1 is below 0"),
        ("k", -1, "k: -1 is below 0"),
        ("k", "four", "k: must be an integer"),
        ("stop", [""], "stop: must be a list of non-empty strings"),
        ("mode", "fast", "mode: unknown mode"),
    ],
)
def test_bad_input_names_the_field(target, field, value, message):
    dec = SpeculativeDecoder(target, target)
    kwargs = {"prompt": [1, 2, 3], field: value}
    with pytest.raises(RequestError, match=message) as info:
        dec.generate(GenerationRequest(**kwargs))
    assert info.value.field == field


def test_unknown_pair_is_a_clear_error(pairs_file):
    from specdec_llm.pairs import get_spec

    with pytest.raises(RequestError, match=r"pair: unknown pair 'nope'; known pairs: .*tiny"):
        get_spec("nope")


def test_expected_speedup_closed_form():
    assert expected_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)
    assert expected_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    # a = 0.8, k = 4: E = (1 - 0.8^5) / 0.2 = 3.3616; cost 4 * 0.05 + 1.2
    assert expected_speedup(0.8, 4, 0.05, verify_cost=1.2) == pytest.approx(3.3616 / 1.4)


def test_cost_model_chooses_k_from_acceptance_and_costs():
    from specdec_llm.engine.costs import CostModel, calibrate
    from specdec_llm.engine.plan import best_k

    cost = CostModel(max_k=8)
    # CPU-like fp32 shape (ARCHITECTURE.md): verify grows with k; noisy point at k=2 is made monotone
    times = {0: 0.0386, 1: 0.045, 2: 0.040, 4: 0.0657, 8: 0.0771}
    calibrate(cost, lambda k: times[k], lambda: 0.0061, points=sorted(times), repeats=1)
    assert cost.verify_s[2] == cost.verify_s[1] == 0.045
    assert best_k(cost, 0.02) == 0  # useless draft: target only
    assert best_k(cost, 0.95) >= 4  # excellent draft: long blocks
    k_mid = best_k(cost, 0.7)
    for _ in range(30):  # the machine gets 3x slower for everything: same choice
        cost.observe_verify(0, 3 * times[0])
        cost.observe_draft("model", 3 * 0.0061)
    assert best_k(cost, 0.7) == k_mid
    assert cost.verify(0) == pytest.approx(3 * times[0], rel=0.05)


def test_a_few_disturbed_iterations_cannot_stop_drafting():
    """A drafter the plan stops using is not observed again until a probe: a few draft
    forwards or verifications another process slowed down (10x, even in a row) must not move
    the costs that decide k at all; the machine's own lasting change of speed is followed."""
    from specdec_llm.engine.costs import WINDOW, CostModel, calibrate
    from specdec_llm.engine.plan import best_k

    cost = CostModel(max_k=8)
    times = {0: 0.0386, 1: 0.045, 2: 0.050, 4: 0.0657, 8: 0.0771}
    calibrate(cost, lambda k: times[k], lambda: 0.0061, points=sorted(times), repeats=1)
    for _ in range(WINDOW):
        cost.observe_verify(4, times[4])
        cost.observe_draft("model", 0.0061)
        cost.observe_drafting("model", 4 * 0.0061, 4)
    k, costs = best_k(cost, 0.9), (cost.draft("model"), cost.draft_per_token("model"), cost.verify(4))
    assert k >= 2
    for _ in range(WINDOW // 2):  # disturbed, in a row
        cost.observe_verify(4, 10 * times[4])
        cost.observe_draft("model", 10 * 0.0061)
        cost.observe_drafting("model", 40 * 0.0061, 4)
        assert (cost.draft("model"), cost.draft_per_token("model"), cost.verify(4)) == costs
        assert best_k(cost, 0.9) == k
    for _ in range(WINDOW):  # the draft itself got 10x slower (and stays so): followed
        cost.observe_draft("model", 10 * 0.0061)
        cost.observe_drafting("model", 40 * 0.0061, 4)
    assert cost.draft("model") == pytest.approx(10 * 0.0061)
    assert best_k(cost, 0.9) == 0


def test_auto_k_settles_at_zero_with_a_useless_draft(target):
    """Acceptance decides it: the costs are fixed where a good draft would pay (a draft step 0.3
    of a verification), so no timing of a busy test machine can (make test once saw 4 drafting
    iterations where the probes account for 3, beside 3 other test processes)."""
    dec = SpeculativeDecoder(target, tiny_llama(7, layers=1))
    dec.ensure_calibrated(1)
    cost = dec.costs[1]
    cost.verify_s = {k: 0.010 * (1 + 0.02 * k) for k in cost.verify_s}
    cost.draft_s = dict.fromkeys(cost.draft_s, 0.003)
    for observe in ("observe_verify", "observe_draft", "observe_drafting", "observe_plain"):
        setattr(cost, observe, lambda *args, **kwargs: None)
    dec.generate(GenerationRequest(prompt=[1, 2, 3], max_new_tokens=40))  # first request: learns a ~ 0
    res = dec.generate(GenerationRequest(prompt=[4, 5, 6], max_new_tokens=100))
    ks = res.stats.k_values
    assert sum(k > 0 for k in ks[10:]) <= 3, ks  # at most the periodic k=1 probes
    assert res.token_ids == greedy_reference(target, [4, 5, 6], 100)
