"""Distillation on a tiny random target: training raises agreement; drafts reload only against their target."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama, tiny_tokenizer

from specdec_llm.pairs import PairError, fingerprint, load_draft_dir, shared_draft
from specdec_llm.training import distill as D

SEEDS = ["Tell me about the quick brown fox.", "Why do dogs sleep?", "Explain decoding.", "Write a short poem."]


def agreement(draft, examples) -> float:
    """Teacher-forced: the draft's argmax equals the target's top-1 at answer positions."""
    hits = total = 0
    with torch.no_grad():
        for seq, plen, top, _ in examples:
            logits = draft(input_ids=seq[None]).logits[0, plen - 1 : len(seq) - 1]
            hits += int((logits.argmax(-1) == top[:, 0]).sum())
            total += len(top)
    return hits / total


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    torch.manual_seed(0)
    tok = tiny_tokenizer()
    target = tiny_llama(21, vocab=len(tok), layers=4, hidden=64, eos=tok.eos_token_id)
    work = tmp_path_factory.mktemp("distill")
    cfg = D.DataConfig(max_new_tokens=24, batch_size=8, dtype="float32", expand_per_seed=2, samples=1, topk=4)
    manifest = D.build_data(target, tok, SEEDS, work, cfg)
    assert manifest["items_done"] == manifest["items_total"] > 0
    # resuming a finished data phase generates nothing more
    assert D.build_data(target, tok, SEEDS, work, cfg)["tokens"] == manifest["tokens"]
    examples = list(D.DataStore(work / "data").examples())
    before = agreement(shared_draft(target, [0]), examples)
    out = work / "draft"
    D.train(
        target,
        work,
        out,
        D.TrainConfig(layers=[0], steps=80, batch_size=4, lr=3e-3, warmup=5, checkpoint_every=40),
        resume=False,
    )
    return target, out, examples, before


def test_interrupted_data_phase_resumes_at_the_next_batch(distilled, tmp_path):
    """A data phase stopped after its first batch and run again writes the same answers as
    one that was never stopped: whole batches, in one fixed order, seeded by position."""
    import shutil

    target, out, examples, _ = distilled
    cfg = D.DataConfig(max_new_tokens=24, batch_size=8, dtype="float32", expand_per_seed=2, samples=1, topk=4)
    data = tmp_path / "w" / "data"
    shutil.copytree(out.parent / "data", data)
    store = D.DataStore(data)
    full = dict(store.manifest)
    assert full["shards"] > 1
    for n in range(1, full["shards"]):  # as if stopped after the first batch
        (data / f"shard-{n:05d}.safetensors").unlink()
    store.manifest.update(shards=1)
    kept = list(store.examples())
    store.manifest.update(items_done=len(kept), tokens=sum(len(s) - p for s, p, _, _ in kept))
    store.save_manifest()
    other = D.DataConfig(**{**cfg.__dict__, "batch_size": 2})  # another order: refused, nothing written
    with pytest.raises(D.DistillError, match="started with batch_size 8; resume it with the same"):
        D.build_data(target, tiny_tokenizer(), SEEDS, data.parent, other)
    again = D.build_data(target, tiny_tokenizer(), SEEDS, data.parent, cfg)
    assert (again["shards"], again["tokens"], again["items_done"]) == (
        full["shards"],
        full["tokens"],
        full["items_done"],
    )
    resumed = list(D.DataStore(data).examples())
    assert len(resumed) == len(examples)
    for (s1, p1, t1, _), (s2, p2, t2, _) in zip(resumed, examples):
        assert p1 == p2 and torch.equal(s1, s2) and torch.equal(t1, t2)


def test_training_raises_agreement(distilled):
    target, out, examples, before = distilled
    draft, meta = load_draft_dir(out, target, fingerprint(target))
    after = agreement(draft, examples)
    assert after > before + 0.15, (before, after)
    curve = meta["train"]["heldout_curve"]  # agreement on answers kept out of training, per checkpoint
    assert [c["step"] for c in curve] == [40, 80] and all(0 <= c["heldout_agreement"] <= 1 for c in curve)
    assert meta["train"]["steps"] == 80


def test_resume_continues_from_checkpoint(distilled, tmp_path):
    target, out, _, _ = distilled
    work = out.parent
    summary = D.train(
        target, work, out, D.TrainConfig(layers=[0], steps=90, batch_size=4, lr=3e-3, warmup=5), resume=True
    )
    assert summary["steps"] == 90  # 80 from the checkpoint + 10 more


def test_warm_start_continues_from_a_trained_draft(distilled, tmp_path):
    """--init-from: training starts from the draft's own weights and shape (not --layers)."""
    import shutil

    target, out, examples, before = distilled
    trained = agreement(load_draft_dir(out, target, fingerprint(target))[0], examples)
    work = tmp_path / "w"
    shutil.copytree(out.parent / "data", work / "data")
    cfg = D.TrainConfig(layers=[0, 1, 2], steps=1, lr=1e-9, warmup=1, init_from=str(out))
    D.train(target, work, tmp_path / "warm", cfg, resume=False)
    warm, meta = load_draft_dir(tmp_path / "warm", target, fingerprint(target))
    assert meta["init_layers"] == [0] and meta["train"]["config"]["init_from"] == str(out)
    assert abs(agreement(warm, examples) - trained) < 0.03 and trained > before + 0.15, (before, trained)


def test_draft_refused_against_another_target(distilled):
    _, out, _, _ = distilled
    other = tiny_llama(99, vocab=512, layers=4, hidden=64)
    with pytest.raises(PairError, match=r"was distilled for target .*; this target is"):
        load_draft_dir(out, other, fingerprint(other))


def test_saved_draft_holds_only_its_own_tensors(distilled):
    from safetensors.torch import load_file

    _, out, _, _ = distilled
    names = load_file(str(out / "draft.safetensors")).keys()
    assert names and all(n.startswith("model.layers.") for n in names)


def test_subset_head_draft_trains_reloads_and_stays_lossless(distilled, tmp_path):
    """A draft whose head covers half the vocabulary (the most frequent tokens): training
    still raises agreement, the saved draft keeps only its layers and the token ids, it
    never proposes a token outside its subset, and greedy output equals the target's."""
    from conftest import greedy_reference
    from safetensors.torch import load_file

    from specdec_llm.engine import GenerationRequest, SpeculativeDecoder
    from specdec_llm.pairs import SubsetHead

    target, first, examples, before = distilled
    work, out = first.parent, tmp_path / "subset-draft"
    cfg = D.TrainConfig(layers=[0], steps=80, batch_size=4, lr=3e-3, warmup=5, vocab_subset=256)
    D.train(target, work, out, cfg, resume=False)
    names = set(load_file(str(out / "draft.safetensors")))
    assert "vocab_subset" in names and all(n.startswith("model.layers.") for n in names - {"vocab_subset"})
    draft, meta = load_draft_dir(out, target, fingerprint(target))
    assert isinstance(draft.lm_head, SubsetHead) and meta["vocab_subset"] == 256
    assert target.generation_config.eos_token_id in draft.lm_head.ids.tolist()
    assert agreement(draft, examples) > before + 0.15
    inside = set(draft.lm_head.ids.tolist())
    dec = SpeculativeDecoder(target, draft)
    for seq, plen, _, _ in examples[:4]:
        prompt = seq[:plen].tolist()
        res = dec.generate(GenerationRequest(prompt=prompt, max_new_tokens=20, k=3))
        ref = greedy_reference(target, prompt, 20)
        eos = target.generation_config.eos_token_id
        assert res.token_ids == (ref[: ref.index(eos) + 1] if eos in ref else ref)
        logits = draft(input_ids=seq[None]).logits[0]
        assert set(logits.argmax(-1).tolist()) <= inside


def test_a_draft_built_from_a_tuned_target_multiplies_by_its_own_weights():
    """A target whose Linears got this machine's kernels (hf.prepare: they multiply by copies
    of their weights) gives a draft whose layers are its own: training them changes it."""
    from specdec_llm.engine import hf

    tuned, plain = tiny_llama(0), tiny_llama(0)
    hf.prepare(tuned)
    ids = torch.tensor([[5, 6, 7, 8]])
    a, b = shared_draft(tuned, [0, 1]), shared_draft(plain, [0, 1])
    with torch.no_grad():
        torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=1e-4, atol=1e-4)
        before = a(ids).logits
        for d in (a, b):
            d.model.layers[0].mlp.down_proj.weight.mul_(3.0)
        torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(a(ids).logits, before)


def test_the_distill_command_runs_both_phases(tiny_pair_dir, tmp_path):
    """``specdec-llm distill`` (a draft of target layers): the data phase from a seeds file,
    then training, to a draft that loads against its target; a second --phase data run
    resumes the finished data phase and writes nothing more."""
    import json

    from typer.testing import CliRunner

    from specdec_llm.cli import app
    from specdec_llm.pairs import load_model

    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in SEEDS[:2]))
    target_dir, work, out = tiny_pair_dir / "target", tmp_path / "work", tmp_path / "draft"
    args = ["distill", "--target", str(target_dir), "--work", str(work), "--out", str(out), "--prompts", str(seeds)]
    args += ["--max-new-tokens", "6", "--expand-per-seed", "1", "--samples", "0", "--gen-dtype", "float32"]
    r = CliRunner().invoke(app, [*args, "--layers", "0", "--steps", "3", "--batch-size", "2", "--vocab-subset", "0"])
    assert r.exit_code == 0, r.output
    assert "data: " in r.stderr and "train: " in r.stderr
    target = load_model(str(target_dir), "float32", "cpu")
    _, meta = load_draft_dir(out, target, fingerprint(target))
    assert meta["init_layers"] == [0] and meta["train"]["steps"] == 3
    manifest = json.loads((work / "data" / "manifest.json").read_text())
    r = CliRunner().invoke(app, [*args, "--phase", "data"])
    assert r.exit_code == 0, r.output
    assert json.loads((work / "data" / "manifest.json").read_text())["shards"] == manifest["shards"]


def test_fewer_examples_than_a_batch_train_as_one_smaller_batch():
    """A small data phase (or one cut short by --hours) with the default batch size of 16:
    training hung at full CPU, its batch generator yielding nothing."""
    import random

    from specdec_llm.training.distill import _batches

    batches = _batches(["a", "b", "c"], batch_size=16, max_len=64, rng=random.Random(0))
    assert sorted(next(batches)) == ["a", "b", "c"] and sorted(next(batches)) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="no distillation examples"):
        next(_batches([], batch_size=16, max_len=64, rng=random.Random(0)))
