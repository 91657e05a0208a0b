"""EAGLE drafts on tiny random targets: the TTT mask is what inference sees, training raises
held-out agreement, drafts save, reload and resume, and refuse another target."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama

from specdec_llm.pairs import (
    DRAFT_META,
    PairError,
    SubsetHead,
    build_eagle,
    default_feature_layers,
    fingerprint,
    load_eagle_dir,
)
from specdec_llm.training import eagle as E


def sampled_examples(target, n: int, prompt_len: int = 6, new: int = 40, seed: int = 0, sample: bool = True):
    """The target's own continuations of random prompts: (tokens, prompt_len). Sampled by
    default: a tiny random model's greedy text is a loop of one or two tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, target.config.vocab_size, (n, prompt_len), generator=g)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = target.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=sample,
            top_k=None,
            top_p=None,
        )
    return [(row.tolist(), prompt_len) for row in out]


def scrambled(draft, seed: int = 0):
    """Random weights in the draft's own tensors (so every path carries signal in tests)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in draft.own_parameters():
            p.add_(torch.randn_like(p) * 0.3 * (p.std() + 0.02))
    return draft


V = 64  # a small vocabulary: the target's next-token function is learnable from a few thousand labels


@pytest.fixture(scope="module")
def target():
    return tiny_llama(31, vocab=V, layers=4, hidden=64)


def test_default_feature_layers():
    assert default_feature_layers(30) == [1, 15, 29]
    assert default_feature_layers(4) == [1, 2, 3]
    assert default_feature_layers(2) == [1]


def test_ttt_mask_shape():
    m = E.ttt_mask(5, 3)  # step 3, keys: step 1 | step 2 | step 3
    assert m.shape == (5, 15)
    j = 4
    assert m[j, :5].tolist() == [True, True, True, False, False]  # real pairs <= j-2
    assert m[j, 5:10].tolist() == [False, False, False, True, False]  # step 2 at j-1
    assert m[j, 10:].tolist() == [False, False, False, False, True]  # itself
    assert E.ttt_mask(4, 1).equal(torch.ones(4, 4, dtype=torch.bool).tril())


def test_ttt_matches_sequential_drafting_and_does_not_leak(target):
    """Step s at position j equals drafting with a KV cache (real pairs 0..j-s+1, then one
    drafted pair per step), and does not change when later tokens or features change."""
    from transformers import DynamicCache

    torch.manual_seed(0)
    draft = scrambled(build_eagle(target, [1, 3]))
    ids = torch.randint(0, V, (2, 12))
    feats, _ = E.teacher_signals(target, ids, torch.ones_like(ids), draft.feature_layers)
    steps = 3
    with torch.no_grad():
        outs = E.ttt_forward(draft, ids, feats, steps)
        for j in (2, 5, 9):
            for s in range(1, steps + 1):
                if j < s - 1:
                    continue
                # sequential: prefill real pairs 0..j-s+1, then drafted pairs one at a time
                r = j - s + 1
                cache = DynamicCache(config=draft.model.config)
                u = draft.inputs(ids[:, 1 : r + 2], draft.fuse(feats[:, : r + 1]))
                h = draft.layer(u, torch.arange(r + 1)[None], None, cache)[:, -1:]
                for p in range(r + 1, j + 1):
                    u = draft.inputs(ids[:, p + 1 : p + 2], h)
                    h = draft.layer(u, torch.tensor([[p]]), None, cache)
                assert torch.allclose(outs[s - 1][:, j], h[:, 0], atol=1e-5), (j, s)
        # changing tokens after j+1 and features after j leaves positions <= j unchanged
        j = 6
        ids2, feats2 = ids.clone(), feats.clone()
        ids2[:, j + 2 :] = torch.randint(0, V, ids2[:, j + 2 :].shape)
        feats2[:, j + 1 :] = torch.randn_like(feats2[:, j + 1 :])
        outs2 = E.ttt_forward(draft, ids2, feats2, steps)
        for a, b in zip(outs, outs2):
            assert torch.allclose(a[:, : j + 1], b[:, : j + 1], atol=1e-6)
            assert not torch.allclose(a[:, j + 1 :], b[:, j + 1 :], atol=1e-3)


def test_features_are_layer_outputs(target):
    """f_j is the residual stream after the listed layers; the last one is the pre-norm state."""
    ids = torch.randint(0, V, (1, 7))
    feats, argmax = E.teacher_signals(target, ids, torch.ones_like(ids), [1, 3])
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True)
    assert torch.allclose(feats[..., :64], hs.hidden_states[2], atol=1e-5)  # after layer 1
    assert torch.equal(argmax, hs.logits.argmax(-1))
    assert torch.allclose(target.model.norm(feats[..., 64:]), hs.hidden_states[-1], atol=1e-5)


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    work = tmp_path_factory.mktemp("eagle")
    examples = sampled_examples(target, 200)
    cfg = E.EagleConfig(
        feature_layers=None, steps=300, batch_size=8, lr=3e-3, warmup=5, max_len=64, checkpoint_every=150,
        vocab_subset=48, holdout=20, ttt_steps=3,
    )  # fmt: skip
    out = work / "draft"
    summary = E.train_eagle(target, examples, work, out, cfg, resume=False)
    return work, out, examples, summary


def test_training_raises_heldout_agreement(target, trained):
    work, out, _, summary = trained
    meta = json.loads((out / DRAFT_META).read_text())
    assert meta["kind"] == "eagle" and meta["feature_layers"] == [1, 2, 3] and meta["vocab_subset"] == 48
    curve = meta["train"]["heldout_curve"]
    assert [c["step"] for c in curve] == [150, 300]
    assert all(0 < c["tokens_seen"] for c in curve)
    # the untrained draft on the same held-out records
    draft0 = build_eagle(target, [1, 2, 3], load_eagle_dir(out, target, fingerprint(target))[0].model.lm_head.ids)
    cache, records, held, subset_pos = _heldout(target, work, trained[2], draft0)
    before = E.heldout_agreement(draft0, records, cache, held, 3, subset_pos)
    after = curve[-1]["heldout_agreement"]
    # measured: before ~[0.36, 0.29, 0.23], after ~[0.53, 0.46, 0.45]
    assert after[0] > before[0] + 0.1 and after[1] > before[1] + 0.1 and after[2] > before[2] + 0.1, (before, after)
    assert summary["steps"] == 300


def _heldout(target, work, examples, draft):
    """The training run's teacher cache, records and held-out slice, and the head's row map."""
    records = E.as_records(examples, 64)
    tc = E.TeacherCache(next(iter((work / "eagle-teacher").iterdir())))
    assert tc.build(target, records, [1, 2, 3]) == 0  # all cached: nothing recomputed
    held = E.heldout_indices(records, min(20, len(records) // 10))
    ids = draft.model.lm_head.ids
    pos = torch.full((V,), -1, dtype=torch.long)
    pos[ids] = torch.arange(len(ids))
    return tc, records, held, pos


def test_save_load_round_trip(target, trained, tmp_path):
    _, out, _, _ = trained
    draft, meta = load_eagle_dir(out, target, fingerprint(target))
    assert meta["kind"] == "eagle" and meta["ttt_steps"] == 3
    assert isinstance(draft.model.lm_head, SubsetHead) and len(draft.model.lm_head.ids) == 48
    assert draft.model.model.embed_tokens is target.model.embed_tokens  # shared, not copied
    assert draft.model.model.norm is target.model.norm and draft.model.config.num_hidden_layers == 1
    from safetensors.torch import load_file

    names = set(load_file(str(out / "draft.safetensors")))
    assert names - {"vocab_subset"} == set(draft.own_state())
    # save again (fp32) and reload: identical logits
    E.save_eagle(draft, tmp_path / "again", target, {"ttt_steps": 3}, dtype="float32")
    again, _ = load_eagle_dir(tmp_path / "again", target, fingerprint(target))
    ids = torch.randint(0, V, (1, 10))
    feats, _ = E.teacher_signals(target, ids, torch.ones_like(ids), draft.feature_layers)
    with torch.no_grad():
        a = [draft.logits(h) for h in E.ttt_forward(draft, ids, feats, 2)]
        b = [again.logits(h) for h in E.ttt_forward(again, ids, feats, 2)]
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_refused_against_another_target(trained):
    _, out, _, _ = trained
    other = tiny_llama(99, vocab=V, layers=4, hidden=64)
    with pytest.raises(PairError, match=r"trained for target .*; this target is .*distill --kind eagle"):
        load_eagle_dir(out, other, fingerprint(other))


def test_resume_continues_from_checkpoint(target, trained, tmp_path):
    import shutil

    work, _, examples, _ = trained
    w2 = tmp_path / "w"
    shutil.copytree(work / "eagle-ckpt", w2 / "eagle-ckpt")
    shutil.copytree(work / "eagle-teacher", w2 / "eagle-teacher")
    cfg = E.EagleConfig(steps=305, batch_size=8, lr=3e-3, warmup=5, max_len=64, checkpoint_every=30)
    summary = E.train_eagle(target, examples, w2, tmp_path / "d2", cfg, resume=True)
    assert summary["steps"] == 305 and summary["teacher_shards_computed"] == 0
    meta = json.loads((tmp_path / "d2" / DRAFT_META).read_text())
    assert meta["vocab_subset"] == 48 and meta["train"]["steps"] == 305  # the checkpoint's shape, not cfg's
    assert [c["step"] for c in meta["train"]["heldout_curve"]] == [150, 300, 305]


def test_cli_trains_an_eagle_draft_the_registry_loads(tiny_pair_dir, tmp_path, monkeypatch):
    """``distill --kind eagle`` on a distill data directory writes a draft; a pair naming it
    loads an EagleDraft, lists the eagle drafter by default and shows its kind."""
    from typer.testing import CliRunner

    from specdec_llm.cli import app
    from specdec_llm.pairs import EagleDraft, load_model, load_pair, registry
    from specdec_llm.settings import reload_settings
    from specdec_llm.training.distill import DataStore

    target_dir = tiny_pair_dir / "target"
    target = load_model(str(target_dir), "float32", "cpu")
    store = DataStore(tmp_path / "data")  # records as a distill data phase writes them
    rows = []
    for tokens, plen in sampled_examples(target, 12, new=16):
        n = len(tokens) - plen
        rows.append((tokens[:plen], tokens[plen:], torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, 1)))
    store.write_shard(rows)
    store.save_manifest()
    out = tmp_path / "eagle-draft"
    args = ["distill", "--kind", "eagle", "--target", str(target_dir), "--corpus", str(store.root)]
    args += ["--work", str(tmp_path / "work"), "--out", str(out), "--steps", "4", "--batch-size", "4"]
    r = CliRunner().invoke(app, [*args, "--feature-layers", "0,1", "--ttt-steps", "2", "--max-len", "32"])
    assert r.exit_code == 0, r.output
    meta = json.loads((out / DRAFT_META).read_text())
    assert meta["kind"] == "eagle" and meta["feature_layers"] == [0, 1] and meta["train"]["steps"] == 4
    r = CliRunner().invoke(app, [*args, "--phase", "data"])
    assert r.exit_code == 2 and "no data phase" in r.stderr

    path = tmp_path / "pairs.toml"
    path.write_text(f'[pairs.tiny-eagle]\ntarget = "{target_dir}"\ndraft = "{out}"\n')
    monkeypatch.setenv("SPECDEC_CONFIG_FILE", str(path))
    reload_settings()
    try:
        spec = registry()["tiny-eagle"]
        assert spec.draft_kind() == "eagle" and spec.drafter_names() == ["lookup", "suffix", "eagle"]
        pair = load_pair("tiny-eagle")
        assert isinstance(pair.draft, EagleDraft) and pair.draft_info["kind"] == "eagle"
        assert pair.draft.model.model.embed_tokens is pair.target.model.embed_tokens
        r = CliRunner().invoke(app, ["pairs", "show", "tiny-eagle"])
        info = json.loads(r.stdout)
        assert info["draft_kind"] == "eagle" and info["drafters"] == ["lookup", "suffix", "eagle"]
        path.write_text(f'[pairs.x]\ntarget = "{target_dir}"\ndraft = "{out}"\ndrafters = ["model"]\n')
        with pytest.raises(PairError, match="draft is of kind eagle: use drafter 'eagle'"):
            registry()
    finally:
        monkeypatch.delenv("SPECDEC_CONFIG_FILE")
        reload_settings()
