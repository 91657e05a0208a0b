"""What one target forward over q new tokens costs, per kernel choice: the price of verifying
q-1 drafted tokens, relative to a one-token decoding step (the verify ratio).

    .venv/bin/python benchmarks/bench_forward.py                 # table: fp32 and bf16, batch 1 and 4
    .venv/bin/python benchmarks/bench_forward.py --json          # one JSON object (engine path, pair dtype, batch 1)
    .venv/bin/python benchmarks/bench_forward.py --families      # k = 0 step per family: lean vs transformers

Paths: the engine's (``RaggedCache.forward``: one row per sequence, no holes; for a Llama
model on the CPU that is engine/lean.py, with q/k/v and gate/up fused) and plain transformers
(``DynamicCache``, the model's own forward), on a ``--context``-token cache, median of ``--repeats``.
``--families``: random models of SmolLM2-135M's shape (576 hidden, 30 layers, 9 heads, 3 KV heads,
a 49k vocabulary) in each family's own config class, fp32, tuned kernels: the one-token step
(k = 0) through the engine with its lean forward, through the engine on transformers' forward
(lean off), and plain transformers, in 5 interleaved rounds (medians); "lean": whether the family
has the lean forward.
Kernels: ``tuned`` (engine/kernels.py: the fastest measured per row count on this machine,
what the engine uses), and each single kernel for every row count (``col``: what the engine
used before; ``row``: transformers' default layout; ``onednn``). Prints the CPU model and flags.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from machine import cpu_info

from specdec_llm.engine import hf, kernels, lean
from specdec_llm.engine.ragged import RaggedCache
from specdec_llm.pairs import load_pair

WIDTHS = (1, 2, 3, 4, 5, 6, 9, 17)


def median_ms(fn, repeats: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)  # GPU work is asynchronous
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def engine_path(model, rows: int, context: list[int], w: int, repeats: int) -> float:
    cache = RaggedCache(model, rows)
    cache.forward([context] * rows, 1)
    width = cache.width

    def run():
        cache.forward([context[:w]] * rows, w)
        cache.crop(width)

    return median_ms(run, repeats)


@torch.inference_mode()
def plain_path(model, rows: int, context: list[int], w: int, repeats: int) -> float:
    cache = hf.new_cache(model)
    ids = torch.tensor([context] * rows, device=model.device)
    model(input_ids=ids, **{hf.cache_kwarg(type(model)): cache}, use_cache=True, logits_to_keep=1)
    n = len(context)
    new = torch.tensor([context[:w]] * rows, device=model.device)

    def run():
        model(input_ids=new, **{hf.cache_kwarg(type(model)): cache}, use_cache=True, logits_to_keep=w)
        cache.crop(-w)

    return median_ms(run, repeats) if cache.get_seq_length() == n else float("nan")


FAMILIES = {  # family -> (config class, extra keywords): llama-like layouts at SmolLM2-135M's shape
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 4096}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 64}),
    "phi3": ("Phi3Config", {}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 64, "sliding_window": 512}),
    "gemma2": ("Gemma2Config", {"head_dim": 64, "sliding_window": 512}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {}),
}


def family_model(name: str):
    import transformers

    cls, extra = FAMILIES[name]
    cfg = getattr(transformers, cls)(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        **extra,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def families(names: list[str], context: list[int], repeats: int) -> None:
    print(f"{'family':10} {'lean':5} {'engine ms':>10} {'no lean ms':>11} {'plain ms':>9} {'vs plain':>9}")
    for name in names:
        model = family_model(name)
        hf.prepare(model)
        served = lean.runner(model) is not None

        def no_lean(*args):
            lean.ENABLED = False
            try:
                return engine_path(*args)
            finally:
                lean.ENABLED = True

        paths = {"lean": engine_path, "no lean": no_lean, "plain": plain_path}
        rounds: dict[str, list[float]] = {n: [] for n in paths}
        for _ in range(5):  # interleaved rounds: a slow spell of the machine hits every path alike
            for n, path in paths.items():
                rounds[n].append(path(model, 1, context, 1, repeats))
        fast, slow, plain = (statistics.median(rounds[n]) for n in paths)
        print(
            f"{name:10} {'yes' if served else 'no':5} {fast:10.1f} {slow:11.1f} {plain:9.1f} {plain / fast:8.2f}x",
            flush=True,
        )
        del model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--kernels", default="tuned,col,row,onednn", help="kernel choices to compare")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--families", nargs="?", const=",".join(FAMILIES), help="k = 0 step per family (default: all)")
    ap.add_argument(
        "--json", action="store_true", help="print one JSON object: engine path, pair dtype, batch 1, tuned"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    context = [t % 4000 + 10 for t in range(1, args.context + 1)]
    cpu = cpu_info()
    if args.families:
        print(f"CPU: {cpu}; torch {torch.__version__}, {torch.get_num_threads()} threads; {args.context}-token cache")
        families(args.families.split(","), context, args.repeats)
        return
    pair = load_pair(args.pair)
    if args.json:
        model = pair.target
        hf.prepare(model)
        ms = {str(w): engine_path(model, 1, context, w, args.repeats) for w in WIDTHS}
        print(
            json.dumps(
                {
                    "cpu": cpu,
                    "dtype": pair.spec.dtype,
                    "threads": torch.get_num_threads(),
                    "ms": ms,
                    "verify_ratio": {w: v / ms["1"] for w, v in ms.items()},
                }
            )
        )
        return
    print(
        f"CPU: {cpu}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{args.pair}, {args.context}-token cache, median of {args.repeats}"
    )
    for dtype in args.dtypes.split(","):
        model = pair.target if dtype == pair.spec.dtype else pair.target.to(getattr(torch, dtype))
        hf.prepare(model)
        kernels.untune(model)
        for choice in args.kernels.split(","):
            if choice != "onednn" or "onednn" in kernels.kinds(model.dtype):
                kernels.tune(model, None, force=None if choice == "tuned" else choice)
                lean.build(model, None, force=None if choice == "tuned" else choice)  # its fused q/k/v, gate/up alike
            else:
                continue
            for rows in [int(b) for b in args.batches.split(",")]:
                for name, path in (("engine", engine_path), ("plain", plain_path)):
                    if name == "plain" and choice != "tuned":
                        continue
                    ms = [path(model, rows, context, w, args.repeats) for w in WIDTHS]
                    cells = "  ".join(f"{w}:{m:6.1f}" for w, m in zip(WIDTHS, ms))
                    ratios = "  ".join(f"{w}:{m / ms[0]:.2f}" for w, m in zip(WIDTHS, ms))
                    print(f"{dtype:8} {choice:6} batch {rows} {name:6} ms   {cells}")
                    print(f"{'':8} {'':6} {'':7} {'':6} ratio {ratios}", flush=True)
            kernels.untune(model)


if __name__ == "__main__":
    main()
