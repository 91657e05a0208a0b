"""The quantized self-draft: how often it agrees with its target, and what its step costs.

    .venv/bin/python benchmarks/bench_quantized.py --pair smollm2-135m --prompts 24 --tokens 48

Agreement: the target's greedy answers to Spec-Bench dev prompts (chat template), then every
draft variant teacher-forced on them; the share of positions where the draft's argmax is the
target's. Variants: int4 from the GGUF's own blocks (a GGUF target) or re-quantized from the
fp32 weights, with the target's LM head, a bf16 or an int4 one; and the engine's draft (head
chosen by "auto") with its one-token step compiled (engine/compiled.py: the same weights as
a row above, so only its step is timed). Step: one new token on a 100-token context through
the engine's cache (RaggedCache), batch 1, interleaved medians; the ratio to the target's
step is what the schedule weighs against acceptance. Prints the CPU first.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from machine import cpu_info

from specdec_llm.engine import compiled, hf
from specdec_llm.engine.quant import model_bytes, quantized_copy
from specdec_llm.engine.ragged import RaggedCache
from specdec_llm.pairs import get_spec, gguf_blocks, load_pair, local_ref, quiet_loading
from specdec_llm.settings import get_settings
from specdec_llm.training.evaluate import read_prompts

SPEC_BENCH = Path(__file__).resolve().parent.parent / "data" / "spec_bench_dev.jsonl"


def step_ms(models: dict, reps: int) -> dict[str, float]:
    """Milliseconds of each model's one-token step on a 100-token context through the engine's
    cache (RaggedCache), batch 1: the median of ``reps``, the models interleaved."""
    ids = list(range(1000, 1100))
    caches = {}
    for name, m in models.items():
        cache = RaggedCache(m, 1)
        cache.forward([ids], 1)
        caches[name] = (cache, cache.width)
    times: dict[str, list[float]] = {n: [] for n in models}
    for _ in range(reps):
        for name, (cache, width) in caches.items():
            t = time.perf_counter()
            cache.forward([ids[:1]], 1)
            times[name].append(time.perf_counter() - t)
            cache.crop(width)
    return {n: statistics.median(v) * 1e3 for n, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pair", default="smollm2-135m", help="its target is quantized (its own draft is ignored)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_loading()
    spec = get_spec(args.pair)
    spec.draft = None
    pair = load_pair(spec)
    target, tok = pair.target, pair.tokenizer
    ref = local_ref(spec.target)
    blocks = gguf_blocks(Path(ref), target) if ref.endswith(".gguf") else {}
    variants = {}
    if blocks:
        variants["int4 (GGUF blocks), target head"] = quantized_copy(target, "int4", "target", blocks)
    variants["int4 (GGUF blocks or re-quantized), bf16 head"] = quantized_copy(target, "int4", "bf16", blocks)
    variants["int4 (re-quantized), target head"] = quantized_copy(target, "int4", "target")
    variants["int4 (GGUF blocks or re-quantized), int4 head"] = quantized_copy(target, "int4", "int4", blocks)
    variants["int8, target head"] = quantized_copy(target, "int8", "target")
    variants["fp8, target head"] = quantized_copy(target, "fp8", "target")
    print(
        f"CPU: {cpu_info()}; torch {torch.__version__}, {torch.get_num_threads()} threads; {args.pair} "
        f"{spec.dtype}; target {model_bytes(target) / 1e6:.0f} MB",
        flush=True,
    )

    rows = read_prompts(SPEC_BENCH)
    rows = rows[:: max(1, len(rows) // args.prompts)][: args.prompts]
    agree = {n: [0, 0] for n in variants}
    with torch.inference_mode():
        for row in rows:
            text = tok.apply_chat_template(
                [{"role": "user", "content": row["prompt"][:1500]}], tokenize=False, add_generation_prompt=True
            )
            x = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
            full = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.tokens, do_sample=False)
            want = target(full).logits[0, x.shape[1] - 1 : -1].argmax(-1)
            for name, draft in variants.items():
                got = draft(full).logits[0, x.shape[1] - 1 : -1].argmax(-1)
                agree[name][0] += int((got == want).sum())
                agree[name][1] += len(want)

    kernels = get_settings().cache_dir / "kernels.json"
    models = {"target": target, **variants}
    for m in models.values():
        hf.prepare(m, kernels)
    # the engine's draft (auto head) with its one-token step compiled (engine/compiled.py):
    # the same weights and head as a row above, so its agreement is that row's
    fast = quantized_copy(target, "int4", "auto", blocks, kernel_cache=kernels)
    hf.prepare(fast, kernels)
    report = compiled.attach(fast, force=True)
    print(f"compiled step: {report}", flush=True)
    models[f"int4, {fast.quantization['head']} head, step compiled"] = fast
    step = step_ms(models, args.reps)
    print(f"{'variant':48s} {'agreement':>9s} {'step ms':>8s} {'/ target':>8s} {'own MB':>7s}")
    for name in models:
        a, n = agree.get(name, (0, 0))
        own = model_bytes(models[name], target if name != "target" else None) / 1e6
        share = f"{a / n:9.3f}" if n else f"{'-':>9s}"
        print(f"{name:48s} {share} {step[name]:8.2f} {step[name] / step['target']:8.3f} {own:7.0f}")
    print(
        f"({sum(v[1] for v in agree.values()) // len(agree)} positions from {len(rows)} prompts, {args.tokens} tokens each)"
    )


if __name__ == "__main__":
    main()
