"""Per-request overhead of the queue + store path versus calling the engine directly.

One run, same requests, same pair: (1) the engine in this process, N requests one after
another; (2) the same N requests through the whole path, one at a time: persist the row,
enqueue, a real worker subprocess reads the row, generates, records output and
telemetry, and this process sees the row done in the store. Per request:

    overhead = round trip (submit -> done in the store) - the engine's own wall time in the worker

and, for the direct comparison, median(round trip) - median(direct engine call). Then (3)
the N requests submitted at once (a bulk job): wall time vs the sum of engine times.

    .venv/bin/python benchmarks/bench_queue.py                      # embedded broker, tiny pair
    .venv/bin/python benchmarks/bench_queue.py --broker redis       # a private redis-server
    .venv/bin/python benchmarks/bench_queue.py --pair smollm2-135m --max-new-tokens 4

The default pair is a tiny random Llama built in a temp dir: the overhead does not depend
on the model, and the engine's time then stays small next to it. The machine's load
average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiny_pair(folder: Path, ctx: int = 512) -> Path:
    """A 2-layer random Llama target and a 1-layer draft with a small byte-level BPE (a context
    of ``ctx`` tokens); a pairs file."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog."] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    for name, layers in (("target", 2), ("draft", 1)):
        torch.manual_seed(layers)
        cfg = LlamaConfig(
            vocab_size=len(fast),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=ctx,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=0,
        )
        LlamaForCausalLM(cfg).save_pretrained(folder / name)
        fast.save_pretrained(folder / name)
    pairs = folder / "pairs.toml"
    pairs.write_text(f'[pairs.tiny]\ntarget = "{folder / "target"}"\ndraft = "{folder / "draft"}"\n')
    return pairs


def private_redis(folder: Path) -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed; use --broker embedded or --redis-url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.3)
    return proc, f"redis://127.0.0.1:{port}/0"


def wait_done(request_ids: list[str], poll_s: float) -> dict[str, float]:
    """When each request was first seen finished in the store (monotonic time)."""
    from specdec_llm import store

    seen: dict[str, float] = {}
    pending = list(request_ids)
    while pending:
        for rid in list(pending):
            if store.get_request(rid)["status"] in ("ok", "failed"):
                seen[rid] = time.monotonic()
                pending.remove(rid)
        if pending:
            time.sleep(poll_s)
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default=None, help="a registered pair (default: a tiny random pair)")
    ap.add_argument("-n", type=int, default=50, help="requests per path")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--broker", choices=["embedded", "redis"], default="embedded")
    ap.add_argument("--redis-url", help="use this Redis instead of starting a private redis-server")
    ap.add_argument("--database-url", help="default: a SQLite file in a temp dir")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, here and in the worker")
    ap.add_argument("--poll-ms", type=float, default=1.0, help="how often the client looks at the store")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench_queue_"))
    redis_proc = None
    env = {
        "SPECDEC_DATA_DIR": str(tmp / "data"),
        "SPECDEC_THREADS": str(args.threads),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if args.pair is None:
        env["SPECDEC_CONFIG_FILE"] = str(tiny_pair(tmp / "pair"))
    pair = args.pair or "tiny"
    if args.database_url:
        env["SPECDEC_DATABASE_URL"] = args.database_url
    if args.broker == "redis":
        url = args.redis_url
        if url is None:
            redis_proc, url = private_redis(tmp)
        env["SPECDEC_BROKER_URL"] = url
    else:
        os.environ.pop("SPECDEC_BROKER_URL", None)
    os.environ.update(env)

    import torch

    from specdec_llm import client, store
    from specdec_llm.client import broker_display
    from specdec_llm.engine import GenerationRequest
    from specdec_llm.pairs import load_pair
    from specdec_llm.settings import reload_settings

    reload_settings()
    torch.set_num_threads(args.threads)
    prompts = [f"The quick brown fox jumps over the lazy dog, request {i}." for i in range(args.n)]
    load_before = os.getloadavg()

    # (1) the engine, directly
    dec = load_pair(pair).decoder()
    for p in prompts[:3]:  # warm up
        dec.generate(GenerationRequest(p, max_new_tokens=args.max_new_tokens))
    direct = []
    for p in prompts:
        t = time.perf_counter()
        dec.generate(GenerationRequest(p, max_new_tokens=args.max_new_tokens))
        direct.append(time.perf_counter() - t)
    del dec

    # (2) through the queue and the store, one request at a time
    worker = client.start_local_worker(pair, log_path=tmp / "worker.log", extra=["--no-calibrate"])
    try:

        def one_job(tag: str, rows: list[str]) -> tuple[str, list[str]]:
            path = tmp / f"{tag}.jsonl"
            path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
            sub = client.submit(path, pair, {"max_new_tokens": args.max_new_tokens})
            return sub["job_id"], [f"{sub['job_id']}-{i + 1}" for i in range(len(rows))]

        for i in range(3):  # warm up: worker loaded, connections open, caches hot
            _, ids = one_job(f"warm{i}", [prompts[i]])
            wait_done(ids, args.poll_ms / 1000)
        trips, overheads, waits = [], [], []
        for i, p in enumerate(prompts):
            t = time.monotonic()
            _, ids = one_job(f"seq{i}", [p])
            done = wait_done(ids, args.poll_ms / 1000)[ids[0]]
            trip = done - t
            with store.session_scope() as s:
                from specdec_llm.store.models import Telemetry

                tel = s.get(Telemetry, ids[0])
                engine, wait = tel.wall_time_s, tel.queue_wait_s
            trips.append(trip)
            overheads.append(trip - engine)
            waits.append(wait or 0.0)

        # (3) all at once, as a bulk job
        t = time.monotonic()
        job, ids = one_job("bulk", [p + " (bulk)" for p in prompts])
        submit_s = time.monotonic() - t
        wait_done(ids, 0.01)
        bulk_wall = time.monotonic() - t
        with store.session_scope() as s:
            from sqlalchemy import func, select

            from specdec_llm.store.models import Telemetry

            engine_sum = s.scalar(select(func.sum(Telemetry.wall_time_s)).where(Telemetry.job_id == job))
    finally:
        client.stop_local_worker(worker)
        if redis_proc:
            redis_proc.terminate()

    med = statistics.median
    figures = {
        "broker": broker_display(),
        "database": store.mask_url(store.db.resolve_url()),
        "pair": pair,
        "requests": args.n,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "direct_median_ms": med(direct) * 1e3,
        "queue_round_trip_median_ms": med(trips) * 1e3,
        "overhead_median_ms": med(overheads) * 1e3,
        "overhead_p90_ms": statistics.quantiles(overheads, n=10)[-1] * 1e3,
        "round_trip_minus_direct_median_ms": (med(trips) - med(direct)) * 1e3,
        "queue_wait_median_ms": med(waits) * 1e3,
        "bulk_submit_s": submit_s,
        "bulk_wall_s": bulk_wall,
        "bulk_engine_sum_s": engine_sum,
        "bulk_overhead_per_request_ms": (bulk_wall - engine_sum) / args.n * 1e3,
    }
    for k, v in figures.items():
        print(f"{k:36s} {v:.2f}" if isinstance(v, float) else f"{k:36s} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
