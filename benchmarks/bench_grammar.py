"""Constrained decoding's speed, side by side in one run, batch 1: k = 0 and the default
drafters, each with and without the row's JSON schema, methods interleaved per task:

    .venv/bin/python benchmarks/bench_grammar.py --pair smollm2-135m-q4 --max-new-tokens 160

Each task (``data/extraction_heldout.jsonl``: a text, a JSON schema) is a chat prompt that
shows its schema. Prints tokens/s per method, the two ratios the grammar's goals are about
(default drafters with the grammar over k = 0 with the grammar; k = 0 with the grammar over
k = 0 without), how many outputs parse and satisfy their schema's required keys, and whether
the constrained default matched constrained k = 0 token for token; the CPU model and flags first.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from machine import cpu_info
from rich.console import Console
from rich.table import Table

from specdec_llm.engine import GenerationRequest, SpeculativeDecoder
from specdec_llm.pairs import load_pair, quiet_loading

TASKS = Path(__file__).resolve().parent.parent / "data" / "extraction_heldout.jsonl"
METHODS = ("k=0", "k=0 grammar", "default", "default grammar")


def tasks(path: Path, n: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows[:n] if n else rows


def request(task: dict, method: str, tokens: int) -> GenerationRequest:
    fmt = task["response_format"]
    schema = fmt["json_schema"]["schema"]
    prompt = f"{task['prompt']}\n\nAnswer with JSON only, matching this schema:\n{json.dumps(schema)}"
    return GenerationRequest(
        prompt=prompt,
        chat=True,
        max_new_tokens=tokens,
        k=0 if method.startswith("k=0") else "auto",
        response_format=fmt if method.endswith("grammar") else None,
    )


def parses(text: str, task: dict) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    required = task["response_format"]["json_schema"]["schema"].get("required", [])
    return isinstance(obj, dict) and all(k in obj for k in required)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="smollm2-135m-q4")
    ap.add_argument("--tasks", type=Path, default=TASKS)
    ap.add_argument("--n", type=int, default=None, help="the first N tasks (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    args = ap.parse_args()
    console = Console()
    console.print(cpu_info())
    quiet_loading()
    dec: SpeculativeDecoder = load_pair(args.pair).decoder()
    rows = tasks(args.tasks, args.n)
    dec.generate(request(rows[0], "default grammar", 16))  # warm-up: calibration, the grammar's tokenizer
    seconds = dict.fromkeys(METHODS, 0.0)
    tokens = dict.fromkeys(METHODS, 0)
    ok = dict.fromkeys(METHODS, 0)
    same = 0
    for task in rows:
        out = {}
        for method in METHODS:
            t = time.perf_counter()
            out[method] = dec.generate(request(task, method, args.max_new_tokens))
            seconds[method] += time.perf_counter() - t
            tokens[method] += len(out[method].token_ids)
            ok[method] += parses(out[method].text, task)
        same += out["default grammar"].token_ids == out["k=0 grammar"].token_ids
    rate = {m: tokens[m] / seconds[m] for m in METHODS}
    table = Table(title=f"{args.pair}, {len(rows)} tasks, batch 1, greedy, up to {args.max_new_tokens} tokens")
    for col in ("method", "tok/s", "tokens", "parse + required keys"):
        table.add_column(col)
    for m in METHODS:
        table.add_row(m, f"{rate[m]:.1f}", str(tokens[m]), f"{ok[m]}/{len(rows)}")
    console.print(table)
    console.print(
        f"default grammar / k=0 grammar: [bold]{rate['default grammar'] / rate['k=0 grammar']:.2f}x[/] (goal >= 1.5x); "
        f"k=0 grammar / k=0: [bold]{rate['k=0 grammar'] / rate['k=0']:.2f}[/] (goal >= 0.90); "
        f"constrained default identical to constrained k=0: {same}/{len(rows)}"
    )


if __name__ == "__main__":
    main()
