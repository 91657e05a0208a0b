"""A bulk job as a user runs it, against plain transformers on the same rows, in one run.

    .venv/bin/python benchmarks/bench_job.py data/chat_heldout.jsonl --rows 32 --max-new-tokens 96

(a) ``specdec-llm run FILE --chat --max-new-tokens N`` with no tuning flags, in a fresh data
folder (its own store and embedded queue): output tokens over the wall clock of the whole
command, worker start included; and the job's tokens per second over its decoding as
``status`` reports it. (b) plain transformers: the target as a fresh ``from_pretrained`` of
the same weights, ``generate`` one row at a time, greedy, the same rows and token budget.
Prints both, their ratio, and the CPU model and flags first. A file with fewer rows than
``--rows`` is repeated with a row number added to each prompt (no two rows are the same text);
without ``--rows`` the file runs as it is (``make demo``: ``bench_job.py examples/demo_prompts.jsonl
--max-new-tokens 48``).

``--max-batch 1 --in-process`` (issue #31: a request in a worker as fast as in-process) adds
(c): the same rows through the engine in this process, one request at a time, as
``generate`` runs them, and prints the mean per-request tokens/s (output tokens over the
request's own wall time) and acceptance of the worker's rows (their telemetry in the job's
results) beside those of (c).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from machine import cpu_info

from specdec_llm.pairs import get_spec, quiet_loading, resolve


def rows_of(path: Path, n: int | None) -> list[dict]:
    """The file's rows (``prompt`` or chat ``messages``) as they are, or ``n`` of them: the file
    repeated, each repeat's text numbered."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for r in rows:
        if "prompt" not in r and "messages" not in r:
            r["prompt"] = r["turns"][0]  # (Spec-Bench rows)
    out = []
    for i in range(n or len(rows)):
        r = dict(rows[i % len(rows)], id=f"r{i}")
        if i >= len(rows):  # no two rows the same text
            if "prompt" in r:
                r["prompt"] = f"{r['prompt']} (#{i + 1})"
            else:
                r["messages"] = r["messages"][:-1] + [
                    dict(r["messages"][-1], content=f"{r['messages'][-1]['content']} (#{i + 1})")
                ]
        out.append({k: r[k] for k in ("id", "prompt", "messages") if k in r})
    return out


def run_job(prompts: list[dict], tokens: int, pair: str | None, max_batch: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "job.jsonl"
        path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
        env = dict(os.environ, SPECDEC_DATA_DIR=folder)
        cmd = [sys.executable, "-m", "specdec_llm", "run", str(path), "--chat", "--max-new-tokens", str(tokens)]
        cmd += ["--out", str(Path(folder) / "out.jsonl")] + (["--pair", pair] if pair else [])
        cmd += ["--max-batch", max_batch] if max_batch else []
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            sys.exit(f"run failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        results = [json.loads(line) for line in (Path(folder) / "out.jsonl").read_text().splitlines()]
        summary = proc.stdout.strip()
    out_tokens = sum(r.get("output_tokens") or 0 for r in results)
    stats = [r for r in results if r.get("status") == "ok"]
    return {"wall_s": wall, "tokens": out_tokens, "summary": summary, "stats": stats}


def per_request(stats: list[dict]) -> str:
    """Mean tokens/s per request (output tokens over its own wall time) and mean acceptance."""
    rates = [s["output_tokens"] / s["wall_time_s"] for s in stats if s.get("wall_time_s")]
    accept = [s["acceptance_rate"] for s in stats if s.get("acceptance_rate") is not None]
    mean = sum(rates) / max(1, len(rates))
    return f"{mean:.1f} tok/s per request, acceptance {sum(accept) / max(1, len(accept)):.2f} ({len(rates)} rows)"


def in_process(prompts: list[dict], tokens: int, pair: str | None) -> dict[str, dict]:
    """The rows through the engine in this process, one request at a time (``generate``'s
    path): each row's telemetry and text, by row id."""
    from specdec_llm import loaded
    from specdec_llm.engine import GenerationRequest
    from specdec_llm.settings import get_settings

    server = loaded.get(pair or get_settings().default_pair).server
    out = {}
    for p in prompts:
        prompt = p.get("prompt") or p["messages"][-1]["content"]
        result = server.submit(GenerationRequest(prompt, max_new_tokens=tokens, chat=True)).result()
        out[p["id"]] = {**result.stats.to_dict(), "text": result.text}
    return out


def paired(worker: list[dict], local: dict[str, dict]) -> str:
    """Each row's tokens/s in the worker over the same row's in-process, geometric mean (rows
    differ far more from each other than the two paths do), and how many texts are the same."""
    ratios, same = [], 0
    for w in worker:
        mine = local.get(w["id"])
        if mine and w.get("wall_time_s") and mine["wall_time_s"]:
            ratios.append((w["output_tokens"] / w["wall_time_s"]) / (mine["output_tokens"] / mine["wall_time_s"]))
            same += w["text"] == mine["text"]
    gmean = statistics.geometric_mean(ratios) if ratios else float("nan")
    return (
        f"worker / in-process, same rows: {gmean:.2f}x (geometric mean of {len(ratios)} rows); {same} texts identical"
    )


def plain_generate(prompts: list[dict], tokens: int, pair: str | None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec_llm.settings import get_settings

    spec = get_spec(pair or get_settings().default_pair)
    ref = resolve(spec.target)
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=getattr(torch, spec.dtype)).eval()
    tok = AutoTokenizer.from_pretrained(ref)
    n, seconds, texts = 0, 0.0, {}
    for p in prompts:
        messages = p.get("messages") or [{"role": "user", "content": p["prompt"]}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        x = tok(text, return_tensors="pt", add_special_tokens=False)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**x, max_new_tokens=tokens, do_sample=False)
        seconds += time.perf_counter() - t0
        new = out[0, x["input_ids"].shape[1] :].tolist()
        eos = (
            set(model.generation_config.eos_token_id or [])
            if isinstance(model.generation_config.eos_token_id, list)
            else {model.generation_config.eos_token_id}
        )
        end = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        n += end
        texts[p["id"]] = tok.decode(new[:end], skip_special_tokens=True)
    return {"seconds": seconds, "tokens": n, "texts": texts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("prompts", type=Path)
    ap.add_argument("--rows", type=int, default=None, help="default: the file's rows, as they are")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--pair", default=None, help="default: the default pair")
    ap.add_argument("--max-batch", default=None, help="passed to run (default: run's default, auto)")
    ap.add_argument("--in-process", action="store_true", help="also the rows in-process, one at a time")
    args = ap.parse_args()
    quiet_loading()
    prompts = rows_of(args.prompts, args.rows)
    print(f"CPU: {cpu_info()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    job = run_job(prompts, args.max_new_tokens, args.pair, args.max_batch)
    print(job["summary"], flush=True)
    if args.in_process:
        print(f"worker: {per_request(job['stats'])}", flush=True)
        local = in_process(prompts, args.max_new_tokens, args.pair)
        print(f"in-process: {per_request(list(local.values()))}", flush=True)
        print(paired(job["stats"], local), flush=True)
    plain = plain_generate(prompts, args.max_new_tokens, args.pair)
    job_rate, plain_rate = job["tokens"] / job["wall_s"], plain["tokens"] / plain["seconds"]
    print(
        f"{len(prompts)} rows, {args.max_new_tokens} tokens: run {job['tokens']} tokens in {job['wall_s']:.1f} s "
        f"(whole command) = {job_rate:.1f} tok/s; plain transformers generate one row at a time "
        f"{plain['tokens']} tokens in {plain['seconds']:.1f} s = {plain_rate:.1f} tok/s; "
        f"ratio {job_rate / plain_rate:.2f}x"
    )
    same = sum(r["text"].strip() == plain["texts"].get(r["id"], "").strip() for r in job["stats"])
    print(f"greedy: {same} of {len(prompts)} rows' texts identical to plain transformers generate")


if __name__ == "__main__":
    main()
