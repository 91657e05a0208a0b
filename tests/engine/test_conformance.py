"""Every registered drafter, built-in or from examples/, passes the same checks: greedy output
identical to the target's own (k = 0 and fixed k, rows joining and leaving, caches checked
against a fresh prefill after every step), every row that leaves for any reason (finished,
cancelled, timed out, a failed step) reaches every session as ``Left``, and seeded sampling
is reproducible with the acceptance invariants. A drafter registered is tested without a
test written for it; one that needs an optional package is listed and skipped without it."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest
from conftest import check_caches, greedy_reference, perturbed, tiny_llama, tiny_tokenizer

from specdec_llm.engine import GenerationRequest, SpeculativeDecoder
from specdec_llm.engine import decoder as decoder_mod
from specdec_llm.engine.decoder import Batch
from specdec_llm.engine.drafting import registry
from specdec_llm.engine.drafting.base import Left
from specdec_llm.engine.serve import BatchServer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4], [9, 9, 8, 9, 9, 8, 9], [3], [20, 21, 22, 23, 24, 20, 21]]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


load_example("custom_model_drafter")  # registers "plain-cache" at import
_phrases = load_example("custom_drafter").PhraseDrafter
registry.register_drafter("phrases", lambda c: _phrases([[5, 6, 7, 5, 6, 7], [9, 8, 9, 9, 8]]), replace=True)


def quantized(target):
    from specdec_llm.engine.quant import quantized_copy

    return quantized_copy(target)


def eagle(target):
    import torch

    from specdec_llm.pairs import build_eagle

    torch.manual_seed(7)
    return build_eagle(target, [0, 1], torch.randperm(256)[:96].sort().values, init="random")


DRAFTS = {"model": lambda t: perturbed(t, 0.1, 3), "plain-cache": lambda t: perturbed(t, 0.1, 3)}
DRAFTS |= {"quantized": quantized, "eagle": eagle}
NEEDS = {"llamacpp": "llama.cpp drafts from a GGUF target (tests/engine/test_llamacpp.py runs it on one)"}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def decoder(target, name: str, tokenizer=None) -> SpeculativeDecoder:
    """A decoder drafting with ``name`` alone, with a tokenizer (a drafter's factory may read
    it, as the grammar drafter and examples/custom_drafter.py do; its end of turn is not an end
    here: outputs are compared with transformers' generate, which has none) and, for a drafter
    registered for a draft model (``draft_kinds``), a draft: a perturbed copy of the target
    unless ``DRAFTS`` names another. So a drafter from a plugin needs no test of its own."""
    if name in NEEDS:
        pytest.skip(NEEDS[name])
    make = DRAFTS.get(name)
    if make is None and "model" in registry.registered()[name].draft_kinds:
        make = DRAFTS["model"]
    return SpeculativeDecoder(
        target, make(target) if make else None, tokenizer or tiny_tokenizer(), drafters=[name], eos_token_ids=[]
    )


def known() -> list[str]:
    return registry.known()


@pytest.mark.parametrize("name", known())
def test_greedy_identical_with_caches_exact_as_rows_join_and_leave(target, name):
    dec = decoder(target, name)
    batch = Batch(dec)
    asks = [(0, 3, 14), (1, "auto", 20), (2, 0, 9)]
    rows = [batch.add(GenerationRequest(prompt=PROMPTS[i], k=k, max_new_tokens=n)) for i, k, n in asks]
    for step in range(80):
        if step in (1, 4):  # rows join mid-flight, with the pair's k and a fixed one
            rows.append(batch.add(GenerationRequest(prompt=PROMPTS[3 + step // 4], k=4, max_new_tokens=12)))
        if not batch.rows:
            break
        batch.step()
        check_caches(batch)
    assert not batch.rows
    for row in rows:
        assert row.result.token_ids == greedy_reference(target, row.prompt, row.req.max_new_tokens)


def record_lefts(monkeypatch, name: str) -> list[tuple[int, Left]]:
    """Every Left event drafter ``name``'s sessions hear, with the id of its view of the row."""
    seen: list[tuple[int, Left]] = []
    update = decoder_mod.Guarded.update

    def recording(self, events):
        if self.name == name:
            seen.extend((id(e.row), e) for e in events if isinstance(e, Left))
        update(self, events)

    monkeypatch.setattr(decoder_mod.Guarded, "update", recording)
    return seen


@pytest.mark.parametrize("name", known())
def test_every_row_that_leaves_reaches_its_drafters(target, name, monkeypatch):
    """Finished, cancelled (dropped unfinished), and every row of a batch closed after a
    failed step: each reaches the sessions once, ``finished`` as it is."""
    dec = decoder(target, name)
    seen = record_lefts(monkeypatch, name)
    batch = Batch(dec)
    rows = [batch.add(GenerationRequest(prompt=p, k=2, max_new_tokens=n)) for p, n in zip(PROMPTS, (3, 30, 30, 30))]
    for _ in range(3):
        batch.step()
    assert rows[0].result is not None  # finished
    batch.keep([b for b, r in enumerate(batch.rows) if r is not rows[1]])  # cancelled
    batch.close()  # a failed step: the rest leave unfinished
    assert sorted(i for i, _ in seen) == sorted(id(r.view(name)) for r in rows)
    assert {i: e.finished for i, e in seen} == {id(r.view(name)): r is rows[0] for r in rows}


@pytest.mark.parametrize("name", known())
def test_rows_that_time_out_in_a_server_reach_their_drafters(target, name, monkeypatch):
    dec = decoder(target, name)
    seen = record_lefts(monkeypatch, name)
    server = BatchServer(dec, max_batch=4, max_wait_ms=50)
    try:
        late = server.submit(GenerationRequest(prompt=PROMPTS[1], max_new_tokens=40), deadline=time.monotonic() - 1)
        ok = server.submit(GenerationRequest(prompt=PROMPTS[0], max_new_tokens=8))
        assert ok.result(timeout=120).token_ids == greedy_reference(target, PROMPTS[0], 8)
        with pytest.raises(TimeoutError):
            late.result(timeout=120)
    finally:
        server.close(timeout=60)
    assert sorted(e.finished for _, e in seen) == [False, True]


@pytest.mark.parametrize("name", known())
def test_seeded_sampling_is_reproducible_and_accounted(target, name):
    dec = decoder(target, name)
    ask = {"prompt": PROMPTS[0], "max_new_tokens": 16, "temperature": 0.8, "top_k": 40, "seed": 5}
    a, b = dec.generate(GenerationRequest(**ask)), dec.generate(GenerationRequest(**ask))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16
    s = a.stats
    assert s.draft_tokens_accepted <= s.draft_tokens_proposed
    assert s.output_tokens == s.draft_tokens_accepted + s.target_forwards


@pytest.fixture(scope="module")
def worded():
    """A target whose vocabulary is a tokenizer's, for rows with a grammar."""
    tok = tiny_tokenizer()
    return tiny_llama(0, vocab=len(tok), eos=tok.eos_token_id), tok


PERSON = {
    "type": "json_schema",
    "json_schema": {
        "schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "tags": {"type": "array", "items": {"enum": ["fox", "dog"]}, "maxItems": 2},
            },
            "required": ["name", "tags"],
            "additionalProperties": False,
        }
    },
}


@pytest.mark.parametrize("name", known())
def test_constrained_rows_are_identical_to_constrained_k0(worded, name):
    """With a row's grammar (engine/grammar.py), every drafter's output is the target's own
    constrained greedy output: proposals cut where the grammar rejects them, forced tokens free."""
    target, tok = worded
    dec = decoder(target, name, tok)
    for prompt in ("The quick brown fox", "Speculative decoding drafts"):
        ask = {"prompt": prompt, "max_new_tokens": 64, "response_format": PERSON}
        ref = dec.generate(GenerationRequest(**ask, k=0))
        for k in (3, "auto"):
            assert dec.generate(GenerationRequest(**ask, k=k)).token_ids == ref.token_ids, (name, k)
