"""The quantized self-draft (engine/quant.py): the target's own weights in 4 or 8 bits (int4, int8, fp8).

Greedy output stays token-identical with it, alone and mixed with the free drafters in one
batch (caches checked after every step); the sampled distribution stays the target's; a
GGUF target's draft is built from the file's own Q4_1 blocks, equal to the target's weights
bit for bit; a pair naming an unknown quantization is refused with the known ones."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import pytest
import torch
from conftest import check_caches, exact_two_token_distribution, greedy_reference, tiny_llama
from helpers import N, V, assert_target_distribution, sampled_requests, sharpen
from typer.testing import CliRunner

from specdec_llm.engine import GenerationRequest, SpeculativeDecoder, compiled, hf, quant
from specdec_llm.engine.decoder import Batch
from specdec_llm.engine.quant import (
    SMOOTH_ALPHA,
    CastHead,
    DynamicInt8Linear,
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    choose_head,
    model_bytes,
    quantize4,
    quantized_copy,
)
from specdec_llm.engine.ragged import RaggedCache

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 9, 9, 9], [30, 31, 32, 30, 31], [100, 3, 100, 3, 100], [7]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def test_int4_blocks_round_trip_and_the_kernel_multiplies_by_them():
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    b = quantize4(w)
    assert b.q.max() <= 15 and (b.dequantize() - w).abs().max() <= (b.scale.max() / 2) * 1.001
    lin = Int4Linear(b, None, torch.device("cpu"))
    x = torch.randn(3, 5, 64)
    ref = x @ b.dequantize().t()
    y = lin(x)
    assert y.shape == (3, 5, 96) and y.dtype == x.dtype
    assert (y - ref).abs().max() < 0.05 * ref.abs().max()  # bf16 activations and scales inside the kernel
    lin8 = Int8Linear(w, None)
    assert (lin8(x) - x @ w.t()).abs().max() < 0.02 * (x @ w.t()).abs().max()
    dyn8 = DynamicInt8Linear(w, None)  # int8 weights and int8 activations (quantized per call)
    assert dyn8(x).shape == (3, 5, 96) and dyn8(x).dtype == x.dtype and dyn8.held_bytes >= 96 * 64
    assert (dyn8(x) - x @ w.t()).abs().max() < 0.05 * (x @ w.t()).abs().max()
    x[..., 3] *= 60  # an outlier channel, as LLM hidden states have: smoothing moves it into the weight scales
    ref = x @ w.t()
    s = x.abs().flatten(0, -2).amax(0) ** SMOOTH_ALPHA / w.abs().amax(0) ** (1 - SMOOTH_ALPHA)
    plain, smoothed = ((m(x) - ref).norm() / ref.norm() for m in (dyn8, DynamicInt8Linear(w, None, s)))
    assert smoothed < 0.5 * plain, (smoothed, plain)
    fp8 = Fp8Linear(w, None)  # e4m3 weights and activations: 3 mantissa bits each
    assert fp8.q.dtype == torch.float8_e4m3fn and fp8(x).dtype == x.dtype
    assert (fp8(x) - x @ w.t()).abs().max() < 0.1 * (x @ w.t()).abs().max()


@pytest.mark.parametrize(
    "scheme,head,body",
    [
        ("int4", "target", "int4"),
        ("int4", "bf16", "int4"),
        ("int4", "int8", "int4"),
        ("int4", "int4", "int4"),
        ("int4", "target", "mixed"),
        ("int8", "target", "int4"),
        ("fp8", "target", "int4"),
    ],
)
def test_quantized_drafter_alone_and_mixed_is_greedy_identical(target, scheme, head, body):
    draft = quantized_copy(target, scheme, head, body=body)
    assert not any(isinstance(m, torch.nn.Linear) for n, m in draft.model.layers.named_modules())
    assert draft.model.embed_tokens is target.model.embed_tokens  # shared, not copied
    dec = SpeculativeDecoder(target, draft, drafters=["lookup", "suffix", "quantized"])
    reqs = [
        GenerationRequest(prompt=p, max_new_tokens=n, k=k, drafter=d)
        for p, n, k, d in zip(
            PROMPTS * 3,
            (30, 12, 25, 40, 9) * 3,
            (3, "auto", 5, 2) * 4,
            ("quantized", "quantized", "auto", "lookup", "quantized") * 3,
        )
    ]
    for max_batch in (1, 4):
        out = dec.generate_many(reqs, max_batch=max_batch)
        for req, res in zip(reqs, out):
            assert res.token_ids == greedy_reference(target, req.prompt, req.max_new_tokens), (req, max_batch)
    q = [
        r.stats.drafter_tokens["quantized"]
        for req, r in zip(reqs, out)
        if req.drafter == "quantized" and req.k != "auto"
    ]
    proposed, accepted = sum(c["proposed"] for c in q), sum(c["accepted"] for c in q)
    assert accepted > 0.6 * proposed, (accepted, proposed)  # a faithful copy of the target agrees with it


def test_auto_head_follows_this_machines_measured_timings(target, tmp_path, monkeypatch):
    """ "auto" takes the faster of a bf16 and an int8 copy of the LM head only where the kernel
    timings (measured on the real weights, cached per machine in kernels.json) make it faster by
    AUTO_MARGIN, and an int8 one only where it agrees with the full head (INT8_AGREEMENT)."""
    cache = tmp_path / "kernels.json"
    head = target.get_output_embeddings()
    choose_head(head, cache)  # measured now and cached, as quantized_copy does at load
    timings = json.loads(cache.read_text())
    kind = {key: "int8" if key.endswith("|int8") else key.split("|")[-2] for key in timings}
    assert sorted(kind.values()) == ["bfloat16", "float32", "int8"]
    # (only the copies' one-row times are read: a bf16 head chosen is timed at the rest when tuned)
    assert sorted(e["points"] == [1] for e in timings.values()) == [False, True, True]

    def cached(**ms: float) -> None:
        for key, entry in timings.items():
            entry["ms"] = {k: [ms[kind[key]]] * len(v) for k, v in entry["ms"].items()}
        cache.write_text(json.dumps(timings))

    cached(float32=2.0, bfloat16=1.0, int8=1.5)
    assert choose_head(head, cache) == ("bf16", {"target": 2.0, "bf16": 1.0, "int8": 1.5})
    draft = quantized_copy(target, head="auto", kernel_cache=cache)
    assert isinstance(draft.lm_head, CastHead) and draft.lm_head.weight.dtype == torch.bfloat16
    assert draft.quantization["head"] == "bf16"
    cached(float32=2.0, bfloat16=1.5, int8=1.0)
    monkeypatch.setattr(quant, "INT8_AGREEMENT", 1.01)  # no int8 head agrees that well: the best float one
    assert quantized_copy(target, head="auto", kernel_cache=cache).quantization["head"] == "bf16"
    monkeypatch.setattr(quant, "INT8_AGREEMENT", 0.0)
    # the smoothing and its agreement were kept (per machine and head): no forward of the target again
    head_inputs = quant.head_inputs
    monkeypatch.setattr(quant, "head_inputs", lambda *a: pytest.fail("the kept smoothing was not used"))
    draft = quantized_copy(target, head="auto", kernel_cache=cache)
    assert isinstance(draft.lm_head, DynamicInt8Linear) and draft.quantization["head"] == "int8"
    assert 0 < draft.quantization["head_agreement"] < 1
    monkeypatch.setattr(quant, "head_inputs", head_inputs)
    fresh = quant.smoothed_int8(target, head)[0]()  # (measured again: no cache)
    x = torch.randn(5, head.in_features)
    torch.testing.assert_close(draft.lm_head(x), fresh(x))
    own = model_bytes(draft, target)  # its own bytes count the packed int8 head (not a tensor) and its smoothing
    extra = draft.lm_head.held_bytes + 4 * draft.lm_head.inv.numel()
    assert own - model_bytes(quantized_copy(target, head="target"), target) == extra
    cached(float32=1.0, bfloat16=0.9, int8=0.85)  # faster, but not by the margin a copy of the head must earn
    assert choose_head(head, cache)[0] == "target"
    assert quantized_copy(target, head="auto", kernel_cache=cache).lm_head is target.lm_head


def test_a_bf16_targets_int8_head_is_checked_against_its_bf16_head():
    """The int8 head's agreement is measured against the full head in the target's own dtype (a
    bf16 target's first load failed there: fp32 inputs into its bf16 head)."""
    target = tiny_llama(0).to(torch.bfloat16)
    build, agreement = quant.smoothed_int8(target, target.get_output_embeddings())
    assert 0 < agreement <= 1
    assert isinstance(build(), DynamicInt8Linear)


@pytest.mark.parametrize(("head", "fuse"), [("target", True), ("int8", True), ("int4", False)])
def test_a_stored_draft_maps_the_kernels_own_bytes_and_runs_as_built(target, tmp_path, monkeypatch, head, fuse):
    """A CPU int4 draft is kept per machine and weights (``packed_cache``): a later load maps
    what the kernels read (fused projections fused, an int8 head's rows) instead of quantizing
    and packing again, and computes what the built one did; a damaged file is built again."""
    x = torch.tensor([PROMPTS[0]])
    built = quantized_copy(target, head=head, fuse=fuse, packed_cache=tmp_path)
    (file,) = tmp_path.glob("int4-draft-*.safetensors")
    real = quant._quantize_layers
    monkeypatch.setattr(quant, "_quantize_layers", lambda *a: pytest.fail("the stored draft was not used"))
    again = quantized_copy(target, head=head, fuse=fuse, packed_cache=tmp_path)
    with torch.inference_mode():
        assert torch.equal(again(x).logits, built(x).logits)
    assert [type(m).__name__ for m in again.modules()] == [type(m).__name__ for m in built.modules()]
    assert model_bytes(again, target) == model_bytes(built, target)
    monkeypatch.setattr(quant, "_quantize_layers", real)
    other = tiny_llama(1)  # other weights: another file
    quantized_copy(other, head=head, fuse=fuse, packed_cache=tmp_path)
    assert len(list(tmp_path.glob("int4-draft-*.safetensors"))) == 2
    file.write_bytes(file.read_bytes()[:100])  # damaged: built again, and kept again
    rebuilt = quantized_copy(target, head=head, fuse=fuse, packed_cache=tmp_path)
    with torch.inference_mode():
        assert torch.equal(rebuilt(x).logits, built(x).logits)
    assert file.stat().st_size > 100


def test_a_mixed_body_holds_its_projections_in_int8_and_is_kept_as_built(tmp_path, monkeypatch):
    """A "mixed" body: each layer's q/k/v (fused, with Qwen2's biases), o and gate/up (fused) in
    smoothed dynamic int8, down_proj in int4; its stored draft maps back to the same logits
    without quantizing again; a draft holding every projection in int8 would lose agreement."""
    from families import tiny_family

    qwen = tiny_family("qwen2", seed=0)
    layers = qwen.config.num_hidden_layers
    x = torch.tensor([PROMPTS[0]])
    built = quantized_copy(qwen, body="mixed", packed_cache=tmp_path)
    kinds = [type(getattr(m, "part_of", m)).__name__ for n, m in built.named_modules() if n.endswith("_proj")]
    assert kinds.count("DynamicInt8Linear") == 6 * layers and kinds.count("Int4Linear") == layers  # (down_proj)
    attn = built.model.layers[0].self_attn
    assert attn.q_proj.part_of is attn.v_proj.part_of and attn.q_proj.part_of.float_bias is not None
    monkeypatch.setattr(quant, "_quantize_layers", lambda *a: pytest.fail("the stored draft was not used"))
    again = quantized_copy(qwen, body="mixed", packed_cache=tmp_path)
    with torch.inference_mode():
        assert torch.equal(again(x).logits, built(x).logits)
        agree = (built(x).logits.argmax(-1) == qwen(x).logits.argmax(-1)).float().mean()
    assert agree >= 0.8 and model_bytes(again, qwen) == model_bytes(built, qwen)
    assert len(list(tmp_path.glob("int4-draft-*.safetensors"))) == 1


def test_auto_body_takes_mixed_only_where_measured_faster_and_as_faithful(target, tmp_path, monkeypatch):
    """ "auto" measures both bodies on this machine once (kept in the kernel cache): mixed where
    its projections take at most AUTO_MARGIN of int4's time and it agrees at least BODY_AGREEMENT
    of int4's agreement; otherwise the draft is the int4 one, exactly."""
    x = torch.tensor([PROMPTS[2]])
    int4 = quantized_copy(target, body="int4")
    monkeypatch.setattr(quant, "BODY_AGREEMENT", 2.0)  # (no body agrees twice as often)
    cache = tmp_path / "kernels.json"
    refused = quantized_copy(target, body="auto", kernel_cache=cache)
    assert refused.quantization["body"] == "int4" and set(refused.quantization["body_agreement"]) == {"int4", "mixed"}
    with torch.inference_mode():
        assert torch.equal(refused(x).logits, int4(x).logits)
    monkeypatch.setattr(quant, "BODY_AGREEMENT", 0.0)
    assert quantized_copy(target, body="auto", kernel_cache=cache).quantization["body"] == "int4"  # (kept)
    monkeypatch.setattr(quant, "AUTO_MARGIN", 1e9)  # (any time is fast enough)
    taken = quantized_copy(target, body="auto", kernel_cache=tmp_path / "other.json")
    assert taken.quantization["body"] == "mixed"
    assert any(isinstance(m, DynamicInt8Linear) for m in taken.model.layers.modules())
    calls: list[int] = []  # an int8 head and the body measured on one forward of the target
    hook = target.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        both = quantized_copy(target, head="int8", body="auto", kernel_cache=tmp_path / "third.json")
    finally:
        hook.remove()
    assert both.quantization["head"] == "int8" and both.quantization["body"] == "mixed" and len(calls) == 1
    with pytest.raises(ValueError, match="unknown draft body 'int3'; known: int4, mixed, auto"):
        quantized_copy(target, body="int3")


def test_a_stored_draft_is_the_targets_dtypes_own(tmp_path):
    """The same weights in fp32 and in bf16 keep two stored drafts: a bf16 Qwen2 draft mapped
    from the fp32 one's file had fp32 biases and failed at its bf16 head."""
    from families import tiny_family

    t32 = tiny_family("qwen2", seed=0)
    with torch.no_grad():  # (a bf16 checkpoint loaded as fp32)
        for p in t32.parameters():
            p.copy_(p.bfloat16().float())
    t16 = copy.deepcopy(t32).to(torch.bfloat16)
    quantized_copy(t32, head="target", packed_cache=tmp_path)
    stored = quantized_copy(t16, head="target", packed_cache=tmp_path)
    assert len(list(tmp_path.glob("int4-draft-*.safetensors"))) == 2
    assert {b.dtype for n, b in stored.named_buffers() if n.endswith("bias")} == {torch.bfloat16}
    with torch.inference_mode():
        assert stored(torch.tensor([[5, 6, 7, 8]])).logits.dtype == torch.bfloat16


def test_storing_a_draft_deletes_the_ones_no_load_used_for_a_month(target, tmp_path):
    """Stored drafts of old weights, recipes or torch versions do not pile up (~1 GB each at
    1.5B): a draft stored deletes those beside it unused for STORED_UNUSED_DAYS and dead writers'
    temporary files; a load marks its file used."""
    quantized_copy(target, head="target", packed_cache=tmp_path)
    (used,) = tmp_path.glob("int4-draft-*.safetensors")
    month = time.time() - (quant.STORED_UNUSED_DAYS + 1) * 86400
    stale, recent, dead = (
        tmp_path / "int4-draft-0.safetensors",
        tmp_path / "int4-draft-1.safetensors",
        tmp_path / ".int4-draft-2.safetensors.9.tmp",
    )
    for f in (stale, recent, dead):
        f.write_bytes(b"x")
    for f in (used, stale, dead):
        os.utime(f, (month, month))
    quantized_copy(target, head="target", packed_cache=tmp_path)  # a load: marks `used`
    assert used.stat().st_mtime > month + 86400
    assert stale.exists()  # (nothing stored yet)
    quantized_copy(tiny_llama(1), head="target", packed_cache=tmp_path)  # another draft stored
    assert not stale.exists() and not dead.exists()
    assert used.exists() and recent.exists()
    assert len(list(tmp_path.glob("int4-draft-*.safetensors"))) == 3


def test_quantized_rows_join_and_leave_caches_exact(target):
    dec = SpeculativeDecoder(target, quantized_copy(target), drafters=["lookup", "quantized"])
    batch = Batch(dec)
    rows = [batch.add(GenerationRequest(prompt=PROMPTS[0], max_new_tokens=25, k=3, drafter="quantized"))]
    for step in range(60):
        if step in (1, 5):
            rows.append(
                batch.add(GenerationRequest(prompt=PROMPTS[step % 5], max_new_tokens=15, k=4, drafter="quantized"))
            )
            rows.append(batch.add(GenerationRequest(prompt=PROMPTS[(step + 2) % 5], max_new_tokens=18)))
        if not batch.rows:
            break
        batch.step()
        check_caches(batch)
    for row in rows:
        assert row.result.token_ids == greedy_reference(target, row.prompt, row.req.max_new_tokens)


def test_sampling_with_the_quantized_drafter_keeps_the_target_distribution():
    """As test_engine's sampled test (same bound and N), the draft being the target's int4 copy
    (its head stays the target's: 8 rows are too few for the int4 kernel)."""
    prompt = [1, 2, 3]
    target = tiny_llama(11, vocab=V, hidden=32)
    sharpen(target)
    draft = quantized_copy(target, "int4", "int4")  # the head stays fp32 (8 rows)
    exact = exact_two_token_distribution(target, prompt, 1.0, 0, 1.0)
    dec = SpeculativeDecoder(target, draft, drafters=["quantized"])
    out = dec.generate_many(sampled_requests(prompt), max_batch=256)
    assert_target_distribution(out, exact)
    assert sum(r.stats.draft_tokens_accepted for r in out) > N * 0.3


def test_gguf_draft_weights_equal_the_targets_bit_for_bit():
    """Every Linear weight of the demo target is a Q4_1 block in its GGUF: the draft takes
    those blocks as they are (scale, minimum, nibbles), and they dequantize to exactly the
    target's fp32 weights (the loader's row permutation of query and key heads included).
    (Matched at load, on the target as loaded: not one a decoder has prepared.)"""
    from specdec_llm.pairs import get_spec, gguf_blocks, load_model, local_ref

    target = load_model(get_spec("smollm2-135m").target, "float32", "cpu")
    blocks = gguf_blocks(Path(local_ref(get_spec("smollm2-135m").target)), target)
    linears = [n for n, m in target.model.layers.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(blocks) == len(linears) == 7 * target.config.num_hidden_layers
    params = dict(target.named_parameters())
    for name, b in blocks.items():
        assert torch.equal(b.dequantize(), params[name].detach().float()), name
    # kept beside the converted model after the first match; read back, the same blocks
    from specdec_llm.pairs import cached_gguf_blocks

    path = Path(local_ref(get_spec("smollm2-135m").target))
    for _ in range(2):  # (the first call may write the file, the second reads it)
        cached = cached_gguf_blocks(path, target)
        assert cached.keys() == blocks.keys()
        assert all(
            torch.equal(getattr(cached[n], f), getattr(b, f)) for n, b in blocks.items() for f in ("q", "scale", "low")
        )


def test_unknown_quantization_exits_2_naming_the_known_ones(tmp_path, monkeypatch, tiny_pair_dir):
    from specdec_llm.cli import app
    from specdec_llm.pairs import get_spec
    from specdec_llm.settings import reload_settings

    path = tmp_path / "pairs.toml"
    monkeypatch.setenv("SPECDEC_CONFIG_FILE", str(path))
    cases = {
        'draft = "quantized:int3"': "unknown quantization 'quantized:int3'; known: quantized:int4, quantized:int8, quantized:fp8",
        'draft = "quantized:int4"\ncompile_draft = "yes"': "compile_draft must be true or false",
        "compile_draft = true": 'compile_draft must be true or false, and needs draft = "quantized:int4"',
    }
    try:
        path.write_text(f'[pairs.q]\ntarget = "{tiny_pair_dir}/target"\ncompile_draft = false\n')
        reload_settings()
        assert get_spec("q").compile_draft is False  # false is fine on any pair
        for fields, message in cases.items():
            path.write_text(f'[pairs.q]\ntarget = "{tiny_pair_dir}/target"\n{fields}\n')
            reload_settings()
            res = CliRunner().invoke(app, ["generate", "hello", "--pair", "q", "--max-new-tokens", "2"])
            assert res.exit_code == 2, fields
            assert message in " ".join(res.output.split()), (fields, res.output)
    finally:
        monkeypatch.delenv("SPECDEC_CONFIG_FILE")
        reload_settings()


def test_compiled_draft_step_equals_the_lean_step_and_keeps_greedy_output(target):
    """The compiled one-token step (engine/compiled.py) writes the same keys and values and
    gives the lean step's logits on a row whose cache has holes; decoding with it (batch 1
    compiled, several rows not) stays identical to greedy."""
    draft = quantized_copy(target)
    hf.prepare(draft)
    report = compiled.attach(draft, force=True, context=16, reps=2)
    assert report["kept"] and report["compiled_ms"] > 0, report
    step = draft.__dict__[hf.COMPILED_STEP]
    caches = [RaggedCache(draft, 1) for _ in range(2)]
    for cache in caches:
        cache.forward([[5, 6, 7, 8, 9, 10, 11]], 1)
        cache.drop(0, [2, 4])  # holes: a mask and positions of their own
    compiled.ENABLED = False
    try:
        want = caches[0].forward([[12]], 1)
    finally:
        compiled.ENABLED = True
    calls = step.calls
    got = caches[1].forward([[12]], 1)
    assert step.calls == calls + 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(hf.layers(caches[0].cache), hf.layers(caches[1].cache)):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
    dec = SpeculativeDecoder(target, draft, drafters=["lookup", "quantized"], compile_draft=True)
    reqs = [GenerationRequest(prompt=p, max_new_tokens=20, k=3, drafter="quantized") for p in PROMPTS]
    for max_batch in (1, 3):
        for req, res in zip(reqs, dec.generate_many(reqs, max_batch=max_batch)):
            assert res.token_ids == greedy_reference(target, req.prompt, req.max_new_tokens), (req, max_batch)
    assert step.calls > calls + 20 and not step.failed  # (no recompile: it would have failed over to lean)
    # a cache whose buffers are exactly full (the new column is their last): no recompile either
    cache = RaggedCache(draft, 1)
    cache.forward([[5, 6, 7, 8]], 1)
    for layer in hf.layers(cache.cache):
        kbuf, vbuf = layer.bufs
        layer.kbuf, layer.vbuf = kbuf[:, :, : layer.width + 1].clone(), vbuf[:, :, : layer.width + 1].clone()
        layer.view(1, 4)
    calls = step.calls
    cache.forward([[9]], 1)
    assert step.calls == calls + 1 and not step.failed
    calls = step.calls
    # a new lean forward (as after a cast): the step traced from the old one stands down
    del draft.__dict__["_specdec_lean"]
    cache = RaggedCache(draft, 1)
    cache.forward([[5, 6, 7]], 1)
    assert cache.forward([[8]], 1).shape[-1] == target.config.vocab_size and step.calls == calls


def test_quantizing_a_prepared_target_says_to_quantize_first(tmp_path):
    """A target whose weights a kernel holds packed (oneDNN's layout) cannot be quantized: a
    clear error, not an index error from deep inside the head's timing."""
    from specdec_llm.engine import kernels

    model = tiny_llama(0)
    kernels.tune(model, tmp_path / "k.json", force=kernels.kinds(torch.float32)[0])
    for head in ("auto", "target"):
        with pytest.raises(ValueError, match="quantize it before preparing it"):
            quantized_copy(model, head=head, kernel_cache=tmp_path / "k.json")


@pytest.mark.parametrize("head", ["bf16", "int8"])
def test_a_draft_head_keeps_the_targets_head_bias(tmp_path, head):
    """A head with a bias (Phi-2's) keeps it in its bf16 and int8 copies, built and stored."""
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    config = PhiConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    target = PhiForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.bias.zero_()
        target.lm_head.bias[7] = 1e3  # every position's argmax, if the bias is there
    x = torch.tensor([PROMPTS[0]])
    for _ in range(2):  # built, then mapped from the stored draft
        draft = quantized_copy(target, head=head, packed_cache=tmp_path)
        with torch.inference_mode():
            assert (draft(x).logits.argmax(-1) == 7).all()
