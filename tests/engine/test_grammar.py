"""Constrained decoding (engine/grammar.py): every emitted token satisfies the row's grammar,
greedy rows equal the target's own constrained greedy decoding (k = 0 with the same mask), and
sampled rows keep the target's masked, renormalised distribution (the 10,000-sample test)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import perturbed, tiny_llama, tiny_tokenizer
from helpers import N, V, assert_target_distribution, sampled_requests, sharpen

from specdec_llm.engine import GenerationRequest, RequestError, SpeculativeDecoder, sampling
from specdec_llm.engine.drafting.base import Proposal
from specdec_llm.engine.grammar import cut

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["fox", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def pair():
    tok = tiny_tokenizer()
    target = tiny_llama(0, vocab=len(tok), eos=tok.eos_token_id)
    return target, perturbed(target, 0.3, seed=5), tok


def test_greedy_constrained_rows_equal_k0_with_the_same_mask_and_parse(pair):
    target, draft, tok = pair
    dec = SpeculativeDecoder(target, draft, tok, drafters=["model", "lookup", "suffix"])
    base = dict(prompt="The quick brown fox", max_new_tokens=96, response_format=FORMAT)
    plain = dec.generate(GenerationRequest(**base, k=0))
    for k in (2, 4, "auto"):
        out = dec.generate(GenerationRequest(**base, k=k))
        assert out.token_ids == plain.token_ids, k
    forced = out.stats.drafter_tokens["grammar"]  # the plan's pick: keys and separators, proposed free
    assert forced["proposed"] == forced["accepted"] > 0
    # each forced token accepted is a forward saved, whatever else drafted: k = "auto" drafts by
    # timings (7-8 forwards of 50 on a quiet machine, the suffix index drafting too; 38 with the
    # grammar's 12 alone under make test's load), so a share of the forwards would be a timed check
    assert out.stats.target_forwards <= plain.stats.target_forwards - forced["accepted"]
    obj = json.loads(plain.text)
    assert list(obj) == ["name", "age", "tags"]  # the schema's order (not sorted: "age" first)
    assert len(obj["name"]) <= 6 and 0 <= obj["age"] <= 120
    assert plain.finish_reason == "eos"  # the grammar allows only the end once the object closes
    free = dec.generate(GenerationRequest(prompt="The quick brown fox", max_new_tokens=32, k=0))
    assert free.token_ids != plain.token_ids  # the mask changed what the random model writes


def test_a_regex_row_and_a_free_row_decode_side_by_side(pair):
    target, draft, tok = pair
    dec = SpeculativeDecoder(target, draft, tok)
    rows = [
        GenerationRequest(
            prompt="fox", max_new_tokens=24, k=3, response_format={"type": "regex", "regex": "(fox|dog) [0-9]{2,4}"}
        ),
        GenerationRequest(prompt="fox", max_new_tokens=24, k=3),
        GenerationRequest(prompt="dog", max_new_tokens=48, k=3, response_format={"type": "json_object"}),
    ]
    out = dec.generate_many(rows)
    assert out[0].text.split(" ")[0] in ("fox", "dog") and out[0].text.split(" ")[1].isdigit()
    assert out[1].token_ids == dec.generate(GenerationRequest(prompt="fox", max_new_tokens=24, k=0)).token_ids
    assert out[2].text.startswith("{")


@pytest.mark.parametrize(
    "fmt, words",
    [
        ({"type": "yaml"}, "unknown type 'yaml'"),
        ({"type": "json_schema"}, '{"json_schema": {"schema": {...}}}'),
        ({"type": "regex", "regex": ""}, 'needs a non-empty string "regex"'),
        ({"type": "regex", "regex": "(ab"}, "does not compile"),
        ({"type": "grammar", "grammar": "start: missing"}, "does not compile"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "objet"}}}, "Invalid type: objet"),
        ("json", "must be an object"),
    ],
)
def test_a_bad_response_format_is_a_request_error_naming_the_field(pair, fmt, words):
    target, draft, tok = pair
    dec = SpeculativeDecoder(target, draft, tok)
    with pytest.raises(RequestError, match="response_format") as e:
        dec.generate(GenerationRequest(prompt="fox", max_new_tokens=4, response_format=fmt))
    assert e.value.field == "response_format" and words in str(e.value)


def test_a_proposal_is_cut_before_the_first_token_the_grammar_rejects(pair):
    target, draft, tok = pair
    dec = SpeculativeDecoder(target, draft, tok)
    g = dec.grammar({"type": "regex", "regex": "fox jumps"})
    ids = tok.encode("fox jumps")
    bad = tok.encode("fox lumps")
    q = [torch.full((dec.vocab_size,), 1 / dec.vocab_size) for _ in bad]
    short = cut(Proposal("model", bad, q, [0.5] * len(bad)), g)
    n = len(short.tokens)
    assert n < len(bad) and short.tokens == bad[:n] and "fox jumps".startswith(tok.decode(short.tokens))
    assert short.q is not None and len(short.q) == n + 1  # the cut token's q: its residual is sampled
    assert cut(Proposal("lookup", ids), g).tokens == ids
    assert g.forced() == ids  # a regex with one sentence: every token is forced (free drafts)


# -- the distribution test: 8 tokens, a grammar that allows 2 or 3 first tokens, then depends on the first
LETTERS = "abcdefgh"
REGEX = "(a|b)(c|d|e)|f(a|g)"


def letters_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(LETTERS)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="h")


def exact_masked(model, prompt: list[int]) -> torch.Tensor:
    """P(t1, t2) of the target's distribution masked by REGEX and renormalised, exhaustively."""
    first = {0: "cde", 1: "cde", 5: "ag"}
    with torch.no_grad():
        p = torch.zeros(V, V)
        l1 = model(torch.tensor([prompt])).logits[0, -1].clone()
        l1[[t for t in range(V) if t not in first]] = float("-inf")
        p1 = sampling.probs(l1[None], 1.0, 0, 1.0)[0]
        for t1, nexts in first.items():
            l2 = model(torch.tensor([prompt + [t1]])).logits[0, -1].clone()
            l2[[t for t in range(V) if LETTERS[t] not in nexts]] = float("-inf")
            p[t1] = p1[t1] * sampling.probs(l2[None], 1.0, 0, 1.0)[0]
    return p


def test_sampled_constrained_rows_keep_the_masked_target_distribution():
    prompt = [2, 3, 4]
    target = tiny_llama(21, vocab=V, hidden=32, eos=7)
    draft = perturbed(target, 0.6, seed=8)  # a sampled draft: cut proposals keep the cut token's q
    sharpen(target, draft)
    dec = SpeculativeDecoder(target, draft, letters_tokenizer(), eos_token_ids=[7])
    fmt = {"type": "regex", "regex": REGEX}
    requests = sampled_requests(prompt, N)
    for r in requests:
        r.response_format = fmt
    out = dec.generate_many(requests)
    assert sum(r.stats.draft_tokens_proposed for r in out) > N // 50  # it did speculate
    assert_target_distribution(out, exact_masked(target, prompt))


def test_checking_drafts_past_the_grammars_end_leaves_the_matcher_where_it_was(pair):
    """A proposal may run past a finished grammar into an end-of-sequence token (a suffix
    index learns outputs with their end): the masks are computed and the matcher is back where
    it was, not a token short (a finished matcher takes the end without a push)."""
    target, draft, tok = pair
    dec = SpeculativeDecoder(target, draft, tok)
    g = dec.grammar({"type": "regex", "regex": "fox jumps"})
    ids, eos = tok.encode("fox jumps"), tok.eos_token_id
    g.advance(ids[:2])
    logits = torch.zeros(len(ids) - 2 + 2, dec.vocab_size)
    masked = g.mask(logits, ids[2:] + [eos])
    assert g.valid(ids[2:]) == len(ids) - 2 and not g.complete(2)  # unchanged
    assert torch.isfinite(masked[-1, eos]) and int(torch.isfinite(masked[-1]).sum()) == 1  # only the end after it
    assert g.forced_after(ids[2:] + [eos]) == [] and g.valid(ids[2:]) == len(ids) - 2


def test_a_stop_string_cuts_a_constrained_row_as_at_k0_and_its_completeness_is_the_kept_texts(pair):
    """A stop string that comes in the same step as the end-of-sequence token (the grammar forces
    the end right after the object closes) cuts the text as k = 0 does; ``complete`` is that of
    the tokens kept, and a stop before the end makes the row incomplete, saying so."""
    target, draft, tok = pair
    dec = SpeculativeDecoder(target, draft, tok, drafters=["model", "lookup", "suffix"])
    base = dict(prompt="The quick brown fox", max_new_tokens=96, response_format=FORMAT)
    whole = dec.generate(GenerationRequest(**base, k=0))
    assert whole.complete and whole.text.endswith("}")
    for stop in ("}", whole.text[len(whole.text) // 2 : len(whole.text) // 2 + 3]):
        results = [dec.generate(GenerationRequest(**base, k=k, stop=[stop])) for k in (0, 4)]
        for res in results:
            assert (res.text, res.token_ids, res.finish_reason) == (
                results[0].text,
                results[0].token_ids,
                "stop",
            ), stop
            assert res.text == whole.text[: whole.text.index(stop)] and res.complete is False
            assert "stop string" in res.incomplete()


def test_drafts_a_grammar_cuts_to_nothing_are_not_timed_as_target_only_steps(pair):
    """A model drafter whose every draft the grammar cuts to nothing (an unrelated draft under a
    digits-only regex) ran its forwards for nothing: those iterations are speculation's cost,
    not target-only steps (they were timed as such, and the row reported no loss: 1.0x)."""
    target, _, tok = pair
    unrelated = tiny_llama(7, vocab=len(tok), layers=2, hidden=128)
    dec = SpeculativeDecoder(target, unrelated, tok, drafters=["model"])
    fmt = {"type": "regex", "regex": "[0-9]{40}"}
    plain = dec.generate(GenerationRequest(prompt="The quick brown fox", max_new_tokens=40, response_format=fmt, k=0))
    res = dec.generate(GenerationRequest(prompt="The quick brown fox", max_new_tokens=40, response_format=fmt, k=4))
    assert res.token_ids == plain.token_ids and res.stats.draft_forwards > 0
    assert res.stats.draft_tokens_proposed == 0  # (every draft cut)
    assert res.stats.speedup < 0.9, res.stats.speedup  # slower than target-only, and it says so


def test_a_model_draft_the_grammar_cuts_learns_the_rejection(pair):
    """A draft token the grammar rejects is a rejected draft: the model's acceptance learns it
    (a draft cut to nothing taught it nothing, and a plan where drafting is cheap, as on a GPU,
    kept paying for draft forwards thrown away)."""
    from specdec_llm.engine.drafting.model import DISTILLED_PRIOR

    target, _, tok = pair
    dec = SpeculativeDecoder(target, tiny_llama(7, vocab=len(tok), layers=1), tok, drafters=["model"])
    dec.calibrate_batches(1)
    for cost in dec.costs.models.values():  # verifying k nearly free, a draft step cheap
        cost.verify_s = {k: 0.010 + 0.0005 * k for k in cost.verify_s}
        cost.draft_s = dict.fromkeys(cost.draft_s, 0.001)
        cost.draft_width_s = {n: dict.fromkeys(shape, 0.001) for n, shape in cost.draft_width_s.items()}
        cost.verify_scale, cost.width_ratio, cost.draft_scale, cost.draft_token_ratio = 1.0, {}, {}, {}
        for name in ("observe_verify", "observe_draft", "observe_drafting", "observe_plain"):
            setattr(cost, name, lambda *a, **k: None)
    fmt = {"type": "regex", "regex": "[0-9]{80}"}
    res = dec.generate(GenerationRequest(prompt="The quick brown fox", max_new_tokens=80, response_format=fmt))
    assert dec.drafter("model").prior < DISTILLED_PRIOR
    assert res.stats.draft_forwards < 20, res.stats.draft_forwards  # (63 before: drafts for nothing)
