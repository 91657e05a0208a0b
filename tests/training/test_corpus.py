"""Issue 20 (part 1), the corpus that grows: an interrupted run resumes without duplicating
or rewriting shards; records are the target's real greedy answers and reproducible samples;
teacher signals recomputed from the corpus are what distill trains on; a distill data phase
imports; shards hold no pickles; widened prompts share nothing with Spec-Bench; bad prompt
files are one clear error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import greedy_reference, tiny_llama, tiny_tokenizer
from typer.testing import CliRunner

from specdec_llm.pairs import fingerprint
from specdec_llm.training import corpus as C
from specdec_llm.training import distill as D

DATA = Path(__file__).resolve().parents[2] / "data"
PROMPTS = [
    "Tell me about the quick brown fox.",
    "Why do dogs sleep?",
    "Explain decoding.",
    "Write a short poem about a lazy dog.",
    "What is speculative decoding?",
    "List three brown things.",
    "Describe the fox in one sentence.",
]
GEN = dict(samples=1, batch_size=3, max_new_tokens=10, dtype="float32", seed=7)


@pytest.fixture(scope="module")
def tiny():
    tok = tiny_tokenizer()
    return tiny_llama(5, vocab=len(tok), layers=2, eos=tok.eos_token_id), tok


@pytest.fixture(scope="module")
def grown(tiny, tmp_path_factory):
    """One uninterrupted run: every prompt greedy and one sample."""
    target, tok = tiny
    root = tmp_path_factory.mktemp("corpus")
    stats = C.grow(target, tok, PROMPTS, root, **GEN)
    assert stats["written"] == 2 * len(PROMPTS)
    return C.Corpus(C.corpus_dir(root, fingerprint(target)))


def by_item(corpus) -> dict:
    return {(r.prompt_key, r.variant): r.tokens for r in corpus.records()}


def test_an_interrupted_run_resumes_without_duplicating_shards(tiny, grown, tmp_path):
    target, tok = tiny
    first = C.grow(target, tok, PROMPTS, tmp_path, max_batches=1, **GEN)  # interrupted after one batch
    corpus = C.Corpus(C.corpus_dir(tmp_path, first["fingerprint"]))
    assert first["shards"] == 1 and len(corpus.done()) == 3
    kept = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in corpus.shards()}
    (corpus.root / ".20990101T000000000000Z-deadbeef.npz.tmp").write_bytes(b"half written")  # a crash mid-write
    again = C.grow(target, tok, PROMPTS, tmp_path, **GEN)
    assert (again["present"], again["written"]) == (3, 2 * len(PROMPTS) - 3)
    keys = [(r.prompt_key, r.variant) for r in corpus.records()]
    assert len(keys) == len(set(keys)) == 2 * len(PROMPTS)
    assert set(keys) == {(C.prompt_key(p), v) for p in PROMPTS for v in (0, 1)}
    for name, (mtime, data) in kept.items():  # never rewritten
        assert (corpus.root / name).stat().st_mtime_ns == mtime and (corpus.root / name).read_bytes() == data
    # the same answers as the run that was never stopped (per-record seeds: batching does not matter)
    assert by_item(corpus) == by_item(grown)
    assert C.grow(target, tok, PROMPTS, tmp_path, **GEN)["written"] == 0  # complete: nothing more
    assert len(corpus.shards()) == 1 + again["shards"]


def test_greedy_records_are_the_targets_greedy_answers(tiny, grown):
    target, _ = tiny
    greedy = [r for r in grown.records() if r.variant == 0]
    assert len(greedy) == len(PROMPTS)
    for r in greedy:
        ref = greedy_reference(target, r.tokens[: r.prompt_len], GEN["max_new_tokens"])
        assert r.answer == ref[: len(r.answer)] and len(r.answer) >= 1
        assert len(r.answer) == GEN["max_new_tokens"] or r.answer[-1] == target.generation_config.eos_token_id


def test_sampled_records_are_reproducible(tiny, grown, tmp_path):
    target, tok = tiny
    C.grow(target, tok, PROMPTS, tmp_path / "same", **GEN)
    C.grow(target, tok, PROMPTS, tmp_path / "other", **{**GEN, "seed": 8})
    fp = fingerprint(target)
    a, b = by_item(grown), by_item(C.Corpus(C.corpus_dir(tmp_path / "same", fp)))
    c = by_item(C.Corpus(C.corpus_dir(tmp_path / "other", fp)))
    sampled = [k for k in a if k[1] == 1]
    assert len(sampled) == len(PROMPTS)
    assert all(a[k] == b[k] for k in sampled)
    assert sum(a[k] != c[k] for k in sampled) >= len(PROMPTS) // 2  # another seed, other samples
    assert sum(a[k] != a[(k[0], 0)] for k in sampled) >= len(PROMPTS) // 2  # samples are not the greedy answer


def test_shards_are_plain_arrays_with_provenance(tiny, grown):
    target, _ = tiny
    for path in grown.shards():
        assert re.fullmatch(r"\d{8}T\d{12}Z-[0-9a-f]{8}\.npz", path.name)
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        assert set(arrays) == {"tokens", "starts", "prompt_len", "variant", "prompt_key", "meta"}
        assert arrays["tokens"].dtype == np.uint16 and arrays["starts"].dtype == np.int64
        assert arrays["prompt_key"].dtype == np.dtype("U16") and arrays["variant"].dtype == np.uint16
        assert len(arrays["starts"]) == len(arrays["prompt_len"]) + 1 == len(arrays["variant"]) + 1
        meta = json.loads(arrays["meta"].tobytes())
        for k in ("target", "target_fingerprint", "dtype", "device", "mode", "temperature", "seed", "created"):
            assert k in meta
        assert meta["target_fingerprint"] == fingerprint(target) == grown.root.name
        assert meta["max_new_tokens"] == GEN["max_new_tokens"] and "version" in meta
    s = grown.summary()
    assert s["records"] == 2 * len(PROMPTS) and s["by_mode"] == {"greedy": len(PROMPTS), "sampled": len(PROMPTS)}
    assert s["answer_tokens"] == sum(len(r.answer) for r in grown.records())


def test_teacher_signals_are_what_distill_trains_on(tiny, grown, tmp_path):
    target, tok = tiny
    work = tmp_path / "work"
    stats = C.teacher_topk(target, grown, work, topk=4, batch_size=4)
    assert stats["shards"] == len(grown.shards())
    examples = list(D.DataStore(work / "data").examples())
    records = list(grown.records())
    assert len(examples) == len(records)
    with torch.no_grad():
        for (seq, plen, top, logp), r in zip(examples, records):
            assert seq.tolist() == r.tokens and plen == r.prompt_len and top.shape == (len(r.answer), 4)
            logits = target(input_ids=seq[None]).logits[0, plen - 1 : len(seq) - 1]
            assert torch.equal(top[:, 0], logits.argmax(-1))
            assert torch.allclose(logp[:, 0], torch.log_softmax(logits, -1).max(-1).values, atol=2e-3)
    assert C.teacher_topk(target, grown, work, topk=4)["shards"] == 0  # cached: nothing recomputed
    # a grown corpus: only its new shard is converted
    C.grow(target, tok, [*PROMPTS, "One more prompt here."], grown.root.parent, **GEN)
    assert C.teacher_topk(target, grown, work, topk=4)["shards"] == 1
    assert len(list(D.DataStore(work / "data").examples())) == len(records) + 2
    cfg = D.TrainConfig(layers=[0], steps=2, batch_size=2, warmup=1, vocab_subset=0, checkpoint_every=10, holdout=0)
    assert D.train(target, work, tmp_path / "draft", cfg, resume=False)["steps"] == 2


def test_teacher_refuses_another_targets_corpus(tiny, grown, tmp_path):
    other = tiny_llama(6, vocab=len(tiny[1]), layers=2)
    with pytest.raises(C.CorpusError, match="fingerprint"):
        C.teacher_topk(other, grown, tmp_path / "w")


def test_a_distill_data_phase_imports(tiny, tmp_path):
    target, tok = tiny
    pool = tmp_path / "pool.jsonl"
    # Spec-Bench rows ('turns') and a blank line, as the CLI's check accepts them
    pool.write_text("\n".join(json.dumps({"turns": [p]} if i % 2 else {"prompt": p}) for i, p in enumerate(PROMPTS)))
    pool.write_text(pool.read_text() + "\n\n")
    cfg = D.DataConfig(max_new_tokens=8, batch_size=3, dtype="float32", samples=1, topk=2)
    D.build_data(target, tok, [], tmp_path / "w", cfg, pool=pool)
    fp = fingerprint(target)
    prov = {"target": "tiny", "target_fingerprint": fp, "vocab_size": target.config.vocab_size, "device": "cpu"}
    stats = C.import_datastore(tmp_path / "w" / "data", tmp_path / "c", prov, tok)
    store = D.DataStore(tmp_path / "w" / "data")
    assert stats["written"] == 2 * len(PROMPTS) and stats["shards"] == store.manifest["shards"]
    corpus = C.Corpus(C.corpus_dir(tmp_path / "c", fp))
    records = list(corpus.records())
    assert [(r.tokens, r.prompt_len) for r in records] == [(s.tolist(), p) for s, p, _, _ in store.examples()]
    assert {(r.prompt_key, r.variant) for r in records} == {(C.prompt_key(p), v) for p in PROMPTS for v in (0, 1)}
    greedy = {r.prompt_key: r.answer for r in records if r.variant == 0}
    for p in PROMPTS:  # the variants are right: greedy rows are the greedy answers
        ids = D.chat_ids(tok, p)
        assert greedy[C.prompt_key(p)] == greedy_reference(target, ids, 8)[: len(greedy[C.prompt_key(p)])]
    names = [p.name for p in corpus.shards()]
    assert C.import_datastore(tmp_path / "w" / "data", tmp_path / "c", prov, tok)["written"] == 0
    assert [p.name for p in corpus.shards()] == names
    # grow knows them too: nothing left to generate
    assert C.grow(target, tok, PROMPTS, tmp_path / "c", **{**GEN, "max_new_tokens": 8})["written"] == 0


def spans(text: str, n: int = 12) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@pytest.fixture(scope="module")
def spec_bench_spans() -> set:
    out: set = set()
    for line in (DATA / "spec_bench_dev.jsonl").read_text().splitlines():
        for turn in json.loads(line)["turns"]:
            out |= spans(turn)
    return out


def test_widened_prompts_share_nothing_with_spec_bench(tiny, spec_bench_spans):
    _, tok = tiny
    seeds = C.read_prompts([DATA / "distill_seed_prompts.jsonl"])
    answers = [(p, f"{p} The first idea is simple. It has many parts, and each part matters here.") for p in seeds]
    rows = C.widen(tok, answers, seeds, n_translate=60, n_summarize=20, n_rag=40)
    assert {r["kind"] for r in rows} == {"translation", "summarization", "rag"}
    files = [DATA / "corpus_prompts_extra.jsonl"]
    committed = [json.loads(line) for f in files if f.exists() for line in f.read_text().splitlines()]
    for row in rows + committed:
        assert set(row) == {"prompt", "kind", "source"}
        assert not spans(row["prompt"]) & spec_bench_spans, row["prompt"][:200]
    for row in rows:
        if row["kind"] == "summarization":
            assert 300 <= len(tok(row["prompt"])["input_ids"]) <= 1000


def test_spec_bench_text_would_be_caught(spec_bench_spans):
    """The check above can fail: a prompt quoting Spec-Bench has a 12-word span in common."""
    turn = json.loads((DATA / "spec_bench_dev.jsonl").read_text().splitlines()[100])["turns"][0]
    assert spans(f"Translate the following text into French:\n\n{turn}") & spec_bench_spans


def test_bad_prompt_files_are_one_clear_error(tmp_path):
    from specdec_llm.cli import app

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt field"}\n')
    runner = CliRunner()
    for path, fragment in ((tmp_path / "missing.jsonl", "is not a file"), (bad, "line 2 has no 'prompt' field")):
        result = runner.invoke(app, ["corpus", "grow", "--target", "nowhere", "--prompts", str(path)])
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith("error: prompts: ") and fragment in result.stderr
        assert "Traceback" not in result.output
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "fine"}\n')
    for args, fragment in (
        (["--samples", "1", "--temperature", "-1"], "temperature: -1.0 is not a positive temperature"),
        (["--hours", "-1"], "hours: -1.0 is not a positive number of hours"),
    ):
        result = runner.invoke(app, ["corpus", "grow", "--target", "nowhere", "--prompts", str(good), *args])
        assert result.exit_code == 2 and result.stderr.startswith(f"error: {fragment}"), result.output


def test_the_cli_grows_shows_teaches_and_widens(pairs_file, tmp_path):
    from specdec_llm.cli import app

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    root, work, out = tmp_path / "corpus", tmp_path / "work", tmp_path / "extra.jsonl"
    runner = CliRunner()
    common = ["--pair", "tiny", "--root", str(root)]
    grow = ["corpus", "grow", *common, "--prompts", str(prompts), "--max-new-tokens", "4", "--dtype", "float32"]
    result = runner.invoke(app, [*grow, "--batch", "4"])
    assert result.exit_code == 0, result.output
    (fp,) = [d.name for d in root.iterdir()]
    assert len(C.Corpus(root / fp).shards()) == 2 and len(C.Corpus(root / fp).done()) == len(PROMPTS)
    result = runner.invoke(app, [*grow, "--samples", "1"])  # only the samples are new
    assert result.exit_code == 0 and len(C.Corpus(root / fp).shards()) == 3, result.output
    result = runner.invoke(app, ["corpus", "show", "--root", str(root)])
    assert result.exit_code == 0 and fp in result.output and "14" in result.output, result.output
    result = runner.invoke(app, ["corpus", "teacher", *common, "--work", str(work), "--topk", "3"])
    assert result.exit_code == 0, result.output
    assert D.DataStore(work / "data").manifest["shards"] == 3
    seeds = ["--seeds", str(DATA / "distill_seed_prompts.jsonl")]
    result = runner.invoke(app, ["corpus", "widen", *common, "--prompts", str(prompts), *seeds, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert {json.loads(line)["kind"] for line in out.read_text().splitlines()} >= {"translation"}
    spec = ["--seeds", str(DATA / "spec_bench_dev.jsonl")]
    result = runner.invoke(app, ["corpus", "widen", *common, "--prompts", str(prompts), *spec, "--out", str(out)])
    assert result.exit_code == 2 and "Spec-Bench" in result.stderr
