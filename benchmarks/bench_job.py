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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_forward import cpu_info

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


def run_job(prompts: list[dict], tokens: int, pair: str | None) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "job.jsonl"
        path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
        env = dict(os.environ, SPECDEC_DATA_DIR=folder)
        cmd = [sys.executable, "-m", "specdec_llm", "run", str(path), "--chat", "--max-new-tokens", str(tokens)]
        cmd += ["--out", str(Path(folder) / "out.jsonl")] + (["--pair", pair] if pair else [])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            sys.exit(f"run failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        results = [json.loads(line) for line in (Path(folder) / "out.jsonl").read_text().splitlines()]
        summary = proc.stdout.strip()
    out_tokens = sum(r.get("output_tokens") or 0 for r in results)
    return {"wall_s": wall, "tokens": out_tokens, "summary": summary}


def plain_generate(prompts: list[dict], tokens: int, pair: str | None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec_llm.settings import get_settings

    spec = get_spec(pair or get_settings().default_pair)
    ref = resolve(spec.target)
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=getattr(torch, spec.dtype)).eval()
    tok = AutoTokenizer.from_pretrained(ref)
    n, seconds = 0, 0.0
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
        n += next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
    return {"seconds": seconds, "tokens": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("prompts", type=Path)
    ap.add_argument("--rows", type=int, default=None, help="default: the file's rows, as they are")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--pair", default=None, help="default: the default pair")
    args = ap.parse_args()
    quiet_loading()
    prompts = rows_of(args.prompts, args.rows)
    print(f"CPU: {cpu_info()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    job = run_job(prompts, args.max_new_tokens, args.pair)
    print(job["summary"], flush=True)
    plain = plain_generate(prompts, args.max_new_tokens, args.pair)
    job_rate, plain_rate = job["tokens"] / job["wall_s"], plain["tokens"] / plain["seconds"]
    print(
        f"{len(prompts)} rows, {args.max_new_tokens} tokens: run {job['tokens']} tokens in {job['wall_s']:.1f} s "
        f"(whole command) = {job_rate:.1f} tok/s; plain transformers generate one row at a time "
        f"{plain['tokens']} tokens in {plain['seconds']:.1f} s = {plain_rate:.1f} tok/s; "
        f"ratio {job_rate / plain_rate:.2f}x"
    )


if __name__ == "__main__":
    main()
