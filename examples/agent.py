"""An agent loop: the LLM decides, a tool acts, the observation goes back to the LLM.

    python examples/agent.py ["What is 17 * 23 + 4?"] [--pair NAME] [--max-new-tokens N] [--max-steps N]

A ReAct-style text protocol (Thought / Action / Action Input / Observation / Final Answer),
which any completion model can follow: no native tool calling needed. The LLM is
``SpecDecLLM`` with the stop string "Observation:" (the agent, not the model, writes
observations); tools are LangChain tools (``@tool``). The transcript is continued as plain
text (a few-shot completion), which SmolLM2-135M follows better than the same text sent as
a chat turn (``--chat``). A 135M model still reasons weakly (it may call the calculator
with the wrong expression); a reply it cannot parse gets a corrective observation, and the
loop ends after ``--max-steps`` either way. The plumbing is the same for a capable pair.
"""

from __future__ import annotations

import argparse
import ast
import operator
import re
import sys

from langchain_core.language_models import BaseLLM
from langchain_core.tools import BaseTool, tool

from specdec_llm.langchain import RequestError, SpecDecLLM
from specdec_llm.pairs import quiet_loading
from specdec_llm.settings import get_settings

INSTRUCTIONS = """Answer the question. You can use these tools:
{tools}

Use exactly this format:
Thought: what to do next
Action: the tool to use, one of [{names}]
Action Input: the input for the tool
Observation: the tool's result (written for you)
... (Thought/Action/Action Input/Observation may repeat)
Thought: I know the answer
Final Answer: the answer to the question

Example:
Question: What is 2 + 3 * 4?
Thought: I should compute it.
Action: calculator
Action Input: 2 + 3 * 4
Observation: 14
Thought: I know the answer
Final Answer: 14

Question: {question}
{scratchpad}"""

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers and + - * / // % ** ( ) are allowed")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 3 * (4 + 5)."""
    try:
        value = _eval(ast.parse(expression.strip().strip("`'\""), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as e:
        return f"error: {e}"
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


@tool
def word_count(text: str) -> str:
    """Count the words in a piece of text."""
    return str(len(text.split()))


TOOLS = [calculator, word_count]
ACTION = re.compile(r"Action\s*:\s*`?([A-Za-z_][\w-]*)`?\s*(?:\[(.*?)\]|\((.*?)\))?", re.S)
ACTION_INPUT = re.compile(r"Action\s*Input\s*:\s*(.+?)\s*(?:\n|$)", re.S)
FINAL = re.compile(r"Final\s*Answer\s*:\s*(.+)", re.S)


def parse(reply: str) -> dict:
    """One model reply -> {"final": text} | {"tool": name, "input": text} | {"error": why}."""
    action = ACTION.search(reply)
    final = FINAL.search(reply)
    if final and (not action or final.start() < action.start()):
        return {"final": final.group(1).strip()}
    if action:
        name = action.group(1)
        arg = action.group(2) or action.group(3)
        if arg is None:
            m = ACTION_INPUT.search(reply, action.end())
            arg = m.group(1) if m else None
        if arg is None:
            return {"error": f"Action {name} has no 'Action Input:' line"}
        return {"tool": name, "input": arg.strip()}
    return {"error": "no 'Action:' or 'Final Answer:' in the reply"}


def run_agent(llm: BaseLLM, question: str, tools: list[BaseTool] = TOOLS, max_steps: int = 4, log=print) -> dict:
    """The loop. Returns {"answer": text or None, "steps": [{"reply", "tool", "input", "observation"}...]}."""
    by_name = {t.name: t for t in tools}
    described = "\n".join(f"{t.name}: {t.description}" for t in tools)
    scratchpad, steps = "Thought:", []
    for n in range(1, max_steps + 1):
        prompt = INSTRUCTIONS.format(
            tools=described, names=", ".join(by_name), question=question, scratchpad=scratchpad
        )
        try:
            reply = llm.invoke(prompt, stop=["Observation:", "\nQuestion:"])
        except RequestError as e:  # e.g. the transcript outgrew the model's context
            log(f"=> stopped: {e}")
            return {"answer": None, "steps": steps, "error": str(e)}
        step = {"reply": reply, **parse(reply)}
        log(f"--- step {n}\n{reply.strip()}")
        if "final" in step:
            steps.append(step)
            log(f"=> final answer: {step['final']}")
            return {"answer": step["final"], "steps": steps}
        if "tool" in step:
            chosen = by_name.get(step["tool"])
            if chosen is None:
                observation = f"unknown tool {step['tool']!r}; use one of {', '.join(by_name)}"
            else:
                observation = str(chosen.invoke(step["input"]))
            log(f"=> {step['tool']}({step['input']!r}) -> {observation}")
        else:
            observation = f"invalid format ({step['error']}); reply with Action and Action Input, or Final Answer"
            log(f"=> {observation}")
        step["observation"] = observation
        steps.append(step)
        scratchpad += f" {reply.strip()}\nObservation: {observation}\nThought:"
    log(f"=> no final answer after {max_steps} steps")
    return {"answer": None, "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("question", nargs="?", default="What is 17 * 23 + 4?")
    ap.add_argument("--pair", default=None, help="pair name (default: SPECDEC_DEFAULT_PAIR)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--backend", choices=["auto", "local", "remote"], default="auto")
    ap.add_argument("--chat", action="store_true", help="send the transcript as a user turn (chat template)")
    args = ap.parse_args(argv)
    quiet_loading()
    llm = SpecDecLLM(
        pair=args.pair or get_settings().default_pair,
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        backend=args.backend,
        job_name="example-agent",
    )
    print(f"Question: {args.question}")
    result = run_agent(llm, args.question, max_steps=args.max_steps)
    tools_used = sum(1 for s in result["steps"] if "tool" in s)
    print(f"\n{len(result['steps'])} steps, {tools_used} tool calls; answer: {result['answer']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
