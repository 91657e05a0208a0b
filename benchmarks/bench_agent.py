"""Agent tasks with a calculator and a glossary lookup (``examples/agent.py``), each run with
speculation (the pair's default drafters) and without (k = 0), side by side in one process:

    .venv/bin/python benchmarks/bench_agent.py --pair qwen2.5-coder-1.5b

A task (``data/agent_heldout.jsonl``: a question, the tools it is meant for, strings one of
which the answer must contain) is complete when the agent answered within ``--max-steps``
model calls, wrote no invalid call, and its answer holds an expected string; it also says
whether the agent called the tools the task is meant for (a model may know the answer).
Prints per task: complete or not with each method, the calls, and whether the calls (names
and arguments, in order) and the answers are identical with and without speculation; then
the totals and the wall time of each method; ``--out FILE`` keeps every answer and call as
JSON. CPU model and flags first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from machine import cpu_info
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from agent import run  # noqa: E402

from specdec_llm.langchain import ChatSpecDec  # noqa: E402
from specdec_llm.pairs import quiet_loading  # noqa: E402

TASKS = ROOT / "data" / "agent_heldout.jsonl"
METHODS = {"speculative": "auto", "k=0": 0}


def complete(task: dict, result: dict) -> bool:
    answer = (result["answer"] or "").lower()
    return result["answer"] is not None and not result["invalid"] and any(e.lower() in answer for e in task["expect"])


def used_tools(task: dict, result: dict) -> bool:
    return set(task["tools"]) <= {c["name"] for c in result["calls"]}


def calls(result: dict) -> list[tuple[str, str]]:
    return [(c["name"], json.dumps(c["args"], sort_keys=True)) for c in result["calls"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tasks", type=Path, default=TASKS)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="every task's answers and calls, as JSON")
    args = ap.parse_args()
    console = Console()
    console.print(cpu_info())
    quiet_loading()
    tasks = [json.loads(line) for line in args.tasks.read_text(encoding="utf-8").splitlines() if line.strip()]
    chats = {
        m: ChatSpecDec(pair=args.pair, k=k, max_new_tokens=args.max_new_tokens, backend="local", record=False)
        for m, k in METHODS.items()
    }
    chats["k=0"].invoke("Hi")  # load the pair and calibrate outside the timings
    seconds = dict.fromkeys(METHODS, 0.0)
    done = dict.fromkeys(METHODS, 0)
    tooled = dict.fromkeys(METHODS, 0)
    kept: list[dict] = []
    same_calls = same_answers = 0
    table = Table("task", *(f"{m} complete" for m in METHODS), "calls (speculative)", "same calls", "same answer")
    for task in tasks:
        out = {}
        for m, chat in chats.items():
            t = time.perf_counter()
            out[m] = run(chat, task["question"], max_steps=args.max_steps, log=lambda *_: None)
            seconds[m] += time.perf_counter() - t
            done[m] += complete(task, out[m])
            tooled[m] += used_tools(task, out[m])
        kept.append(
            {"id": task["id"], **{m: {k: out[m][k] for k in ("answer", "calls", "invalid", "stopped")} for m in out}}
        )
        spec, plain = out["speculative"], out["k=0"]
        same_c, same_a = calls(spec) == calls(plain), spec["answer"] == plain["answer"]
        same_calls += same_c
        same_answers += same_a
        shown = "; ".join(f"{n}({a})" for n, a in calls(spec)) + (
            f" +{len(spec['invalid'])} invalid" if spec["invalid"] else ""
        )
        table.add_row(task["id"], *(str(complete(task, out[m])) for m in METHODS), shown, str(same_c), str(same_a))
    console.print(table)
    n = len(tasks)
    for m in METHODS:
        console.print(
            f"{m}: {done[m]}/{n} complete with valid calls ({tooled[m]}/{n} called the tools they are meant for), "
            f"{seconds[m]:.1f} s"
        )
    console.print(
        f"tool calls identical with and without speculation: {same_calls}/{n}; answers identical: {same_answers}/{n}"
    )
    if args.out:
        args.out.write_text(json.dumps(kept, indent=1, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()
