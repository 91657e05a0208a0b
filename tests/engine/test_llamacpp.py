"""The ``llamacpp`` drafter (engine/llamacpp.py): llama.cpp decoding the pair's draft GGUF, or
the target's own, as the draft. Its refusals, and a pair whose draft only llama.cpp runs (not
loaded into torch; its file handed to the drafters), need nothing installed; its decoding needs the optional
``llama-cpp-python`` (skipped where it is not installed): on the real SmolLM2 pair, greedy
outputs identical to target-only decoding, one row and a batch, each row's llama.cpp context
holding a prefix of the row after every step, and the contexts reused."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import tiny_llama

from specdec_llm.engine import GenerationRequest, SpeculativeDecoder
from specdec_llm.engine.decoder import Batch

PROMPTS = [
    "Explain what a KV cache is, in three sentences.",
    "Write a Python function that reverses a string, then test it on 'hello'.",
    "List the planets of the solar system in order.",
]


def test_the_llamacpp_drafter_needs_a_gguf_target():
    with pytest.raises(ValueError, match="needs the pair's draft or target as a GGUF file; drop 'llamacpp'"):
        SpeculativeDecoder(tiny_llama(0), drafters=["lookup", "llamacpp"])


def test_a_draft_no_listed_drafter_runs_as_a_model_is_not_loaded_and_its_file_reaches_the_drafters():
    """A pair whose draft is a GGUF and whose drafters read no draft model (``llamacpp`` on that
    file): the draft is not converted nor held in torch; the drafters get its file."""
    from specdec_llm.engine.drafting import register_drafter, unregister_drafter
    from specdec_llm.engine.drafting.lookup import Lookup
    from specdec_llm.pairs import PairSpec, get_spec, load_pair, local_ref

    seen = []

    def build(c):
        seen.append((c.draft, c.draft_file, c.target_file))
        drafter = Lookup()
        drafter.name = "files"
        return drafter

    register_drafter("files", build)
    try:
        target = get_spec("smollm2-135m-q4").target  # a GGUF (pkg:), as the draft too: only its file is read
        pair = load_pair(PairSpec(name="files", target=target, draft=target, drafters=["lookup", "files"]))
        assert pair.draft is None and pair.draft_info == {"kind": "file", "file": target}
        pair.decoder()
    finally:
        unregister_drafter("files")
    assert seen == [(None, local_ref(target), local_ref(target))]


def test_a_pair_listing_llamacpp_without_its_package_is_refused_by_name(monkeypatch):
    import sys

    from specdec_llm.pairs import PairError, load_pair

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as where it is not installed
    with pytest.raises(PairError, match=r"smollm2-135m-llamacpp.*specdec-llm\[llamacpp\]"):
        load_pair("smollm2-135m-llamacpp").decoder()


@pytest.fixture(scope="module")
def q4():
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (optional: pip install specdec-llm[llamacpp])")
    from specdec_llm.pairs import load_pair

    return load_pair("smollm2-135m-q4")


def decoders(pair):
    from specdec_llm.pairs import local_ref

    dec = SpeculativeDecoder(
        pair.target,
        pair.draft,
        pair.tokenizer,
        drafters=["llamacpp", "lookup", "suffix"],  # a fixed k drafts with llama.cpp, checking the others
        vocab_size=pair.vocab_size,
        default_k=5,
        target_file=local_ref(pair.spec.target),
    )
    plain = SpeculativeDecoder(pair.target, None, pair.tokenizer, drafters=[], vocab_size=pair.vocab_size)
    return dec, plain


def check_contexts(batch) -> None:
    for row in batch.rows:  # a context holds a prefix of its row's tokens, rollbacks undone
        st = row.view("llamacpp").state.get("llamacpp")
        if st is not None and st.context is not None:
            held = st.context.tokens
            assert held == list(row.view("llamacpp").tokens[: len(held)]) and len(held) < len(row.seq)
            assert st.held == len(held)


def test_greedy_with_llamacpp_drafting_is_identical_to_the_target(q4):
    dec, plain = decoders(q4)
    for prompt in PROMPTS[:2]:
        ids = dec.encode(GenerationRequest(prompt=prompt, chat=True))
        batch = Batch(dec)
        row = batch.add(GenerationRequest(prompt=ids, max_new_tokens=40))
        while batch.rows:
            batch.step()
            check_contexts(batch)
        reference = plain.generate(GenerationRequest(prompt=ids, max_new_tokens=40, k=0))
        assert row.result.token_ids == reference.token_ids
        assert row.result.stats.drafter_tokens["llamacpp"]["accepted"] > 10
    assert len(dec.drafter("llamacpp").pool) >= 1  # the finished rows' contexts went back to the pool


def test_a_batch_drafting_with_llamacpp_keeps_every_row_identical(q4):
    dec, plain = decoders(q4)
    requests = [GenerationRequest(prompt=p, chat=True, max_new_tokens=24 + 8 * i) for i, p in enumerate(PROMPTS)]
    results = dec.generate_many(requests, max_batch=2)  # the third row joins when the first leaves
    for req, res in zip(requests, results):
        ids = dec.encode(req)
        assert (
            res.token_ids
            == plain.generate(GenerationRequest(prompt=ids, max_new_tokens=req.max_new_tokens, k=0)).token_ids
        )


CRASH = "import os, signal, sys\nos.kill(os.getpid(), signal.SIGSEGV)\n"


@pytest.mark.parametrize(
    ("code", "match"),
    [
        (
            CRASH,
            r"llama.cpp crashed decoding .*x.gguf on this CPU \(SIGSEGV\): rebuild llama-cpp-python .*AMX_INT8=OFF",
        ),
        ("raise SystemExit('no such model')", r"llama.cpp could not decode .*x.gguf: no such model"),
    ],
)
def test_a_llamacpp_that_cannot_decode_here_is_refused_not_crashed(monkeypatch, tmp_path, code, match):
    """The probe runs llama.cpp in a child process: a crash (as its AMX kernels crash on some
    virtual machines) or an error there is an error here, with the fix, and this process lives."""
    from specdec_llm.engine.drafting import llamacpp

    monkeypatch.setattr(llamacpp, "PROBE", code)
    with pytest.raises(ValueError, match=match):
        llamacpp.probe(str(tmp_path / "x.gguf"))
    assert str(tmp_path / "x.gguf") not in llamacpp.probed  # (a file refused is probed again next time)


def test_a_pair_whose_llamacpp_crashes_is_refused_at_load(q4, monkeypatch):
    from specdec_llm.engine.drafting import llamacpp
    from specdec_llm.pairs import PairError, load_pair

    monkeypatch.setattr(llamacpp, "PROBE", CRASH)
    monkeypatch.setattr(llamacpp, "probed", set())
    with pytest.raises(PairError, match=r"smollm2-135m-llamacpp.*crashed decoding .* \(SIGSEGV\)"):
        load_pair("smollm2-135m-llamacpp").decoder()


def test_a_gguf_whose_tokenizer_is_not_the_pairs_is_refused(q4):
    """llama.cpp must split text as the pair's tokenizer does (a GGUF of another vocabulary
    would draft only tokens the target rejects): refused at load, naming the fix."""
    from specdec_llm.engine.drafting.base import DraftContext
    from specdec_llm.engine.drafting.llamacpp import LlamaCppDrafter
    from specdec_llm.pairs import local_ref

    class Shifted:  # another vocabulary: every id one further
        def encode(self, text, add_special_tokens=False):
            return [i + 1 for i in q4.tokenizer.encode(text, add_special_tokens=add_special_tokens)]

    path = local_ref(q4.spec.target)
    with pytest.raises(ValueError, match=r"otherwise than the pair's .* use a GGUF with the target's tokenizer"):
        LlamaCppDrafter(path, DraftContext(None, q4.vocab_size, Shifted()))
    with pytest.raises(ValueError, match="tokens, fewer than the pair's"):
        LlamaCppDrafter(path, DraftContext(None, q4.vocab_size + 1, q4.tokenizer))
    LlamaCppDrafter(path, DraftContext(None, q4.vocab_size, q4.tokenizer))  # its own tokenizer: taken
