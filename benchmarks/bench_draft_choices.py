"""Which draft to hold: each choice of body (fp32, bf16, int4) and head (full, a vocabulary
subset) measured for agreement with the target and for its step's cost, side by side.

    .venv/bin/python benchmarks/bench_draft_choices.py --pair qwen2.5-coder-1.5b-0.5b \
        --prompts data/code_heldout.jsonl --tokens 64

Variants: the pair's draft model (when it has one of its own) in fp32, bf16 and int4 (its GGUF's
own int4 blocks where exact, else re-quantized: ``draft_quantize``), each with its full head and
with its head over ``--subset`` tokens (``draft_vocab``); and the target's own int4 copy
(``draft = "quantized:int4"``) with its full head in fp32, bf16, int8 and int4, and a subset
head in fp32 and bf16; and its "mixed" body (``quant.BODIES``) with the int8 head.
Agreement: the target's greedy answers to the prompts (chat template), every variant
teacher-forced on them, the share of positions where its argmax is the target's (what
acceptance follows). Step: one new token on a 100-token context through the engine's cache,
batch 1, interleaved medians, as a share of the target's step (what the schedule weighs
against acceptance). Tokens a verification gains per draft token cost: see the last column,
agreement / (1 + step share), a rough figure of merit.
Prints the CPU first.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from bench_quantized import step_ms
from machine import cpu_info

from specdec_llm.engine import hf
from specdec_llm.engine.quant import CastHead, model_bytes, quantized_copy
from specdec_llm.pairs import cached_gguf_blocks, get_spec, load_model, load_pair, local_ref, quiet_loading
from specdec_llm.pairs.drafts import SubsetHead, vocab_subset
from specdec_llm.settings import get_settings
from specdec_llm.training.evaluate import read_prompts


def variants(spec, target, tokenizer, subset: int) -> dict:
    """name -> draft model, every one built from the weights as loaded (nothing prepared yet)."""
    kernels = get_settings().cache_dir / "kernels.json"
    ids = vocab_subset(tokenizer, subset, target.config.vocab_size)

    def headed(model, head):
        out = copy.copy(model)  # (the same modules, but its own head)
        out.__dict__["_modules"] = dict(model._modules)
        out.set_output_embeddings(head)
        return out

    out = {}
    kind = spec.draft_kind()
    if spec.draft and kind == "model":
        ref = local_ref(spec.draft)
        fp32 = load_model(spec.draft, "float32", "cpu")
        blocks = cached_gguf_blocks(Path(ref), fp32) if ref.endswith(".gguf") else {}
        int4 = quantized_copy(fp32, "int4", "target", blocks, kernel_cache=kernels)
        bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
        for name, model in (("draft model fp32", fp32), ("draft model bf16", bf16), ("draft model int4", int4)):
            out[f"{name}, full head"] = model
        out[f"draft model int4, {subset} head"] = headed(int4, SubsetHead(fp32.get_output_embeddings(), ids))
    ref = local_ref(spec.target)
    blocks = cached_gguf_blocks(Path(ref), target) if ref.endswith(".gguf") else {}
    own = quantized_copy(target, "int4", "target", blocks, kernel_cache=kernels)
    full = target.get_output_embeddings()
    out["target int4 copy, full head"] = own
    out["target int4 copy, bf16 head"] = headed(own, CastHead(full, torch.bfloat16))
    out[f"target int4 copy, {subset} head"] = headed(own, SubsetHead(full, ids))
    out[f"target int4 copy, {subset} bf16 head"] = headed(own, SubsetHead(full, ids, torch.bfloat16))
    for head in ("int8", "int4"):
        out[f"target int4 copy, {head} head"] = quantized_copy(target, "int4", head, blocks, kernel_cache=kernels)
    mixed = quantized_copy(target, "int4", "int8", blocks, kernel_cache=kernels, body="mixed")
    out["target mixed copy, int8 head"] = mixed  # (quant.BODIES: its projections in int8, down_proj int4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pair", default="qwen2.5-coder-1.5b-0.5b")
    ap.add_argument("--prompts", default="data/code_heldout.jsonl")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--subset", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--bf16-target", action="store_true", help="also time the target's step in bf16")
    args = ap.parse_args()
    quiet_loading()
    spec = get_spec(args.pair)
    bare = copy.copy(spec)
    bare.draft, bare.draft_quantize, bare.draft_vocab = None, None, None
    pair = load_pair(bare)
    target, tok = pair.target, pair.tokenizer
    models = variants(spec, target, tok, args.subset)
    print(
        f"CPU: {cpu_info()}; torch {torch.__version__}, {torch.get_num_threads()} threads; {args.pair} "
        f"{spec.dtype}; target {model_bytes(target) / 1e9:.2f} GB",
        flush=True,
    )
    rows = read_prompts(Path(args.prompts))[: args.limit]
    agree = {n: [0, 0] for n in models}
    with torch.inference_mode():
        for row in rows:
            text = tok.apply_chat_template(
                [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
            )
            x = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
            full = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.tokens, do_sample=False)
            want = target(full).logits[0, x.shape[1] - 1 : -1].argmax(-1)
            for name, draft in models.items():
                got = draft(full).logits[0, x.shape[1] - 1 : -1].float().argmax(-1)
                agree[name][0] += int((got == want).sum())
                agree[name][1] += len(want)
    kernels = get_settings().cache_dir / "kernels.json"
    timed = {"target": target, **models}
    if args.bf16_target and spec.dtype == "float32":  # the target's step in bf16 (SPECDEC_DTYPE=bfloat16), timed only
        timed["target in bf16 (step only)"] = copy.deepcopy(target).to(torch.bfloat16)
    for m in timed.values():
        hf.prepare(m, kernels)
    step = step_ms(timed, args.reps)
    print(f"{'variant':40s} {'agreement':>9s} {'step ms':>8s} {'/ target':>8s} {'merit':>6s}")
    for name in timed:
        a, n = agree.get(name, (0, 0))
        share = step[name] / step["target"]
        merit = f"{(a / n) / (1 + share):6.3f}" if n else f"{'-':>6s}"
        print(f"{name:40s} {(a / n if n else float('nan')):9.3f} {step[name]:8.1f} {share:8.3f} {merit}")
    print(f"({sum(v[1] for v in agree.values()) // len(agree)} positions from {len(rows)} prompts)")


if __name__ == "__main__":
    main()
