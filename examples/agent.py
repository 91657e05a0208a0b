"""An agent with two tools: LangChain's ``create_agent`` over ``ChatSpecDec``.

    python examples/agent.py ["What is 17 * 23 + 4?"] [--pair NAME] [--max-new-tokens N] [--max-steps N]

The tools are a calculator (arithmetic only: the expression is parsed, never evaluated as
Python) and a glossary lookup. ``ChatSpecDec.bind_tools`` shows them to the model through its
own chat template, and reads its tool calls back from the text it generates; the agent runs
them and hands the results back as tool turns, until the model answers without a call or
``--max-steps`` model calls have been made. Two middlewares make a small model usable: until
a tool has answered, the model must call one (``call_a_tool_first``); a reply that only repeats
calls already run, or says nothing, is not run but asked again, without tools, for an answer
from the results (``answer_from_the_results``).

The pair's chat template must render tools: Qwen2.5's does (``specdec-llm pairs install
qwen2.5-coder-1.5b``, then ``--pair qwen2.5-coder-1.5b``); a ChatML pair whose tokenizer has no
template can name the built-in one (``chat_template = "chatml-tools"``). A small model may
still write a malformed call: it is printed as invalid, never run. A tiny random model runs
the loop and calls nothing useful. The last line sums up: model calls, tool calls (parsed,
invalid), the answer.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import operator
import sys

from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, ModelResponse, wrap_model_call
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.errors import GraphRecursionError

from specdec_llm.langchain import ChatSpecDec, RequestError
from specdec_llm.pairs import quiet_loading
from specdec_llm.settings import get_settings

SYSTEM = (
    "You are a careful assistant. Use the calculator for arithmetic (keep the question's parentheses in its "
    "expression) and the glossary for terms; then answer briefly."
)

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.BitXor: operator.pow,  # 2^20: arithmetic's power, as models write it (not Python's xor)
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, (ast.Pow, ast.BitXor)) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers and + - * / // % ** ^ ( ) are allowed")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / ^ and parentheses."""
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError, OverflowError) as e:
        return f"error: {e}"
    return f"{expression.strip()} = {int(value) if isinstance(value, float) and value.is_integer() else value}"


GLOSSARY = {
    "speculative decoding": "a small draft proposes tokens and the large target verifies them all in one pass",
    "kv cache": "the keys and values of past tokens, kept so each new token attends without recomputing them",
    "draft": "the small model (or lookup) that proposes tokens for the target to verify",
    "acceptance rate": "the share of drafted tokens the target keeps",
}


@tool
def lookup(term: str) -> str:
    """Look a term up in the speculative-decoding glossary."""
    key = " ".join(term.lower().replace("-", " ").replace("_", " ").strip(" \"'?.").split())
    # as written, else a known term the words hold ("the KV cache"), else a near spelling
    found = [key] if key in GLOSSARY else [t for t in GLOSSARY if f" {t} " in f" {key} "]
    found = found or difflib.get_close_matches(key, GLOSSARY, n=1, cutoff=0.8)
    if not found:
        return f"no entry for {term!r}; known terms: {', '.join(GLOSSARY)}"
    entry = max(found, key=len)
    return f"{entry}: {GLOSSARY[entry]}"


TOOLS = [calculator, lookup]


def _key(call: dict) -> tuple[str, str]:
    return call["name"], json.dumps(call["args"], sort_keys=True)


@wrap_model_call
def answer_from_the_results(request: ModelRequest, handler) -> ModelResponse:
    """A reply that only repeats calls the agent has already run (they would give the same
    results), or says nothing at all, is not the model's last word: it is asked once more,
    with no tools shown, to answer from the results it has (that request only: the
    conversation keeps its own turns). (Qwen2.5-Coder 1.5B called
    ``calculator("2^20")`` three times after its result, and after a lookup that found nothing
    it replied with an empty message.)"""
    response = handler(request)
    done = {_key(c) for m in request.messages if isinstance(m, AIMessage) for c in m.tool_calls}
    reply = response.result[-1]
    if isinstance(reply, AIMessage) and not reply.invalid_tool_calls:
        repeats = reply.tool_calls and all(_key(c) in done for c in reply.tool_calls)
        empty = not reply.tool_calls and not str(reply.content).strip()
        if (repeats or empty) and done:
            ask = HumanMessage("Answer the question now, in words, from the tool results above.")
            response = handler(request.override(tools=[], tool_choice=None, messages=[*request.messages, ask]))
    return response


@wrap_model_call
def call_a_tool_first(request: ModelRequest, handler) -> ModelResponse:
    """Until a tool has answered, the model must call one (``tool_choice="any"``: the engine's
    grammar makes the call well-formed). A small model otherwise answers from memory what
    the tools are there to answer, or writes its call in a form of its own: Qwen2.5-Coder
    1.5B defined "KV cache" without looking it up, and wrote ``<tools>{...}</tools>``."""
    if not any(isinstance(m, ToolMessage) for m in request.messages):
        request = request.override(tool_choice="any")
    return handler(request)


def run(chat: ChatSpecDec, question: str, max_steps: int = 4, log=print) -> dict:
    """The agent on ``question``: {"messages", "model_calls", "calls", "invalid", "answer", "stopped"}."""
    agent = create_agent(chat, TOOLS, system_prompt=SYSTEM, middleware=[call_a_tool_first, answer_from_the_results])
    state: dict = {"messages": []}
    stopped = None
    try:  # a model call and its tools' turn are two steps of the graph
        for state in agent.stream(
            {"messages": [("user", question)]}, {"recursion_limit": 2 * max_steps}, stream_mode="values"
        ):
            last = state["messages"][-1]
            if isinstance(last, AIMessage):
                log(f"--- model: {last.content.strip()!r}" if last.content else "--- model")
                for call in last.tool_calls:
                    log(f"    call {call['name']}({call['args']})")
                for bad in last.invalid_tool_calls:
                    log(f"    invalid call {bad['name']!r}: {bad['error']} in {bad['args']!r}")
            elif isinstance(last, ToolMessage):
                log(f"    {last.name} -> {last.content}")
    except GraphRecursionError:
        stopped = f"no answer after {max_steps} model calls"
    replies = [m for m in state["messages"] if isinstance(m, AIMessage)]
    answer = None if stopped or not replies or replies[-1].tool_calls else replies[-1].content
    return {
        "messages": state["messages"],
        "model_calls": len(replies),
        "calls": [c for m in replies for c in m.tool_calls],
        "invalid": [c for m in replies for c in m.invalid_tool_calls],
        "answer": answer,
        "stopped": stopped,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("question", nargs="?", default="What is 17 * 23 + 4?")
    ap.add_argument("--pair", default=None, help="pair name (default: SPECDEC_DEFAULT_PAIR)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-steps", type=int, default=4, help="model calls at most")
    ap.add_argument("--backend", choices=["auto", "local", "remote"], default="auto")
    args = ap.parse_args(argv)
    quiet_loading()
    chat = ChatSpecDec(
        pair=args.pair or get_settings().default_pair,
        max_new_tokens=args.max_new_tokens,
        backend=args.backend,
        job_name="example-agent",
    )
    print(f"# pair {chat.pair}, {chat.effective_backend()} mode\nQuestion: {args.question}")
    try:
        result = run(chat, args.question, max_steps=args.max_steps)
    except RequestError as e:  # e.g. a pair whose chat template does not render tools
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"\n{result['model_calls']} model calls, {len(result['calls']) + len(result['invalid'])} tool calls "
        f"({len(result['calls'])} parsed, {len(result['invalid'])} invalid); "
        f"answer: {result['answer'] if result['answer'] is not None else result['stopped'] or 'none'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
