"""Tool calls and structured output for ``ChatSpecDec``: what a call asks of the reply (``plan``),
and the tool calls read back from the generated text (``parse``, ``CallStream``).

The engine generates text; everything here happens on the LangChain side, so a call in this
process and a call through the workers share it. The tools, the turns of a tool
conversation and an optional ``prefill`` (the start of the assistant's answer) travel with
the request and are rendered by the model's own chat template (``engine.chat.render_chat``).

Reading calls, JSON only (``json.loads``, nothing evaluated):

- the Hermes / Qwen2.5 form, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  any number of them, text around them as the content (whitespace next to a call belongs to
  it; text on both sides of a call is joined by a newline); a ``<tool_call>`` left open at
  the end of the reply is read as a call too when its JSON is complete; a call's JSON is
  decoded before its closing tag is looked for, so a ``</tool_call>`` inside a string is text;
- when tools are bound, a reply that is nothing but such an object in JSON (or a list of
  them, or one in a `````json`` fence) naming a bound tool: Qwen2.5-Coder answers so.

A block whose JSON does not parse, or is not ``{"name": text, "arguments": object}``, is an
invalid call (``invalid_tool_calls``, with the reason). Streamed, the same rules run on the
text accumulated so far (``CallStream``), never on one step's tokens: content is released
once no ``<tool_call>`` can start in it, a call once its closing tag has come, and the end of
the stream settles the rest, so a stream gives the same content and calls however its text
was split.

``tool_choice="any"`` or a named tool prefills ``<tool_call>\\n`` (rendering only the named
tool), and ``Reply.response_format`` is the JSON schema the text after the prefill satisfies,
enforced by the engine; structured output adds a system instruction and its schema. Tools
and a structured answer under "auto" (an agent's) constrain the reply to calls or the answer.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import InvalidToolCall, ToolCall, ToolCallChunk
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk

from specdec_llm.engine import RequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```json"
PREFILL = OPEN + "\n"  # the forced start of a reply that must call a tool
JSON_ONLY = "Reply with a single JSON {} and nothing else (no code fence, no explanation)"  # {}: object, array...
CALL_OR_ANSWER = "To call a tool, reply with the call and nothing else; to give your answer, "
JSON_TYPES = ("object", "array", "string", "number", "integer")  # a schema's type, named in the instruction
_FENCED = re.compile(r"\A```json\s*(.*?)\s*```\Z", re.S)
_DECODER = json.JSONDecoder()


# -- what a call asks for ---------------------------------------------------------------------------
@dataclass
class Reply:
    """What one chat call asks of the reply: the tools to render, the calls to read back, a
    prefill, an instruction for the system turn, and the format the engine should enforce."""

    tools: list[dict[str, Any]] | None = None  # rendered by the chat template (OpenAI tool schemas)
    names: tuple[str, ...] = ()  # the bound tools: calls are read from the reply when there are any
    prefill: str = ""  # the start of the assistant's turn, rendered after the generation prompt
    instruction: str | None = None  # appended to the system turn (structured output)
    response_format: dict[str, Any] | None = None  # OpenAI's form; the engine enforces it (engine.grammar)


def tool_name(tool: dict[str, Any]) -> str:
    return str(tool["function"]["name"])


def choose(tool_choice: Any, tools: Sequence[dict[str, Any]]) -> str:
    """``tool_choice`` in one spelling: "auto", "none", "any", or a bound tool's name (OpenAI's
    "required" and ``True`` are "any"; ``{"type": "function", "function": {"name": ...}}`` a name)."""
    names = [tool_name(t) for t in tools]
    if isinstance(tool_choice, dict) and tool_choice.get("type") in ("auto", "any", "none", "required"):
        tool_choice = tool_choice["type"]  # (Anthropic's spelling)
    if tool_choice is None or tool_choice == "auto":
        return "auto"
    if tool_choice == "none" or tool_choice is False:
        return "none"
    if not names:
        raise RequestError("tool_choice", f"{tool_choice!r} needs tools; bind some with bind_tools(tools)")
    if tool_choice in ("any", "required", True):
        return "any"
    if isinstance(tool_choice, dict):  # (OpenAI's {"type": "function", "function": {"name"}}, Anthropic's {"name"})
        tool_choice = (tool_choice.get("function") or {}).get("name", tool_choice.get("name"))
    if isinstance(tool_choice, str) and tool_choice in names:
        return tool_choice
    raise RequestError(
        "tool_choice",
        f"{tool_choice!r} is not one of the bound tools ({', '.join(names)}); use "
        '"auto", "none", "any" (or "required") or a bound tool\'s name',
    )


def plan(tools: list[dict[str, Any]] | None, tool_choice: Any, response_format: dict[str, Any] | None) -> Reply:
    """The ``Reply`` a call's ``tools``, ``tool_choice`` and ``response_format`` ask for."""
    reply = Reply()
    if response_format is not None:
        reply.response_format = response_format
        reply.instruction = format_instruction(response_format)
    choice = choose(tool_choice, tools or [])
    if not tools or choice == "none":  # not shown, not read: the model answers in text
        return reply
    reply.names = tuple(tool_name(t) for t in tools)
    reply.tools = tools if choice in ("auto", "any") else [t for t in tools if tool_name(t) == choice]
    if choice == "auto" and response_format is not None:  # (an agent's tools and its structured answer)
        reply.response_format = calls_or_answer(tools, response_format)
        answer = format_instruction(response_format)
        reply.instruction = f"{CALL_OR_ANSWER}{answer[0].lower()}{answer[1:]}"
    if choice != "auto":
        if response_format is not None:
            raise RequestError(
                "tool_choice", f"{tool_choice!r} forces a tool call, which cannot also be a response_format reply"
            )
        reply.prefill = PREFILL
        reply.response_format = call_format(reply.tools)
    return reply


def format_instruction(response_format: dict[str, Any]) -> str:
    """The system instruction for an OpenAI ``response_format`` (json_schema or json_object)."""
    kind = response_format.get("type")
    if kind == "json_object":
        return JSON_ONLY.format("object") + "."
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if isinstance(schema, dict):
            kind_of = schema.get("type")
            what = kind_of if kind_of in JSON_TYPES else "value"
            return f"{JSON_ONLY.format(what)}, matching this JSON schema:\n{json.dumps(schema)}"
    raise RequestError(
        "response_format",
        f"{response_format!r}: use {{'type': 'json_object'}} or "
        "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
    )


def call_format(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of the text after ``PREFILL`` when one of ``tools`` must be called."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool_name(t)},
                "arguments": closed(t["function"].get("parameters") or {"type": "object"}),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}


def calls_or_answer(tools: list[dict[str, Any]], response_format: dict[str, Any]) -> dict[str, Any]:
    """The grammar of a reply that is either calls of ``tools`` (in their tags, one or more)
    or the answer ``response_format`` asks for: what an agent with tools and a structured
    answer needs (a Lark grammar with llguidance's JSON schemas in it)."""
    from specdec_llm.engine.types import JSON_STYLE, response_schema

    def json_rule(schema: dict[str, Any]) -> str:
        return f"%json {json.dumps({**schema, 'x-guidance': JSON_STYLE})}"

    answer = response_schema(response_format) if response_format.get("type") == "json_schema" else {"type": "object"}
    call = call_format(tools)["json_schema"]["schema"]
    lark = (
        "start: calls | answer\n"
        'calls: call ("\\n" call)*\n'
        f'call: "{OPEN}\\n" call_json "\\n{CLOSE}"\n'
        f"call_json: {json_rule(call)}\n"
        f"answer: {json_rule(answer)}\n"
    )
    return {"type": "grammar", "grammar": lark}


def closed(parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters with no arguments beyond the ones it names, unless it says otherwise
    (JSON schema allows any extra key by default; a function takes none)."""
    return {"additionalProperties": False, **parameters}


# -- reading calls from text ------------------------------------------------------------------------
@dataclass(frozen=True)
class Found:
    """One call read from the text: ``args`` is None when it is invalid (``error`` says why)."""

    raw: str  # the text the call was read from
    name: str | None
    args: dict[str, Any] | None
    error: str | None = None


@dataclass
class Parsed:
    content: str
    calls: list[Found] = field(default_factory=list)


def loads(text: str) -> Any:
    """JSON, or the same with the doubled braces Qwen2.5's template shows its call format in
    (``{{"name": ..., "arguments": ...}}``, Jinja's escaping printed as it is), which a model
    may copy: the first brace dropped, or the first and the last."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        if not text.startswith("{{"):
            raise
    for candidate in (text[1:], text[1:-1] if text.endswith("}}") else None):
        try:
            return json.loads(candidate) if candidate else None
        except (ValueError, RecursionError):
            pass
    return json.loads(text)  # (the original error)


def read_call(raw: str) -> Found:
    """One call's JSON text -> a valid or an invalid call."""
    try:
        obj = loads(raw)
    except (ValueError, RecursionError) as e:
        return Found(raw, None, None, f"not JSON: {e}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Found(raw, None, None, 'not a call: expected {"name": text, "arguments": object}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI's spelling: the arguments as JSON text
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            pass
    if not isinstance(args, dict):
        return Found(raw, obj["name"], None, f"arguments of {obj['name']!r} are not a JSON object")
    return Found(raw, obj["name"], args)


def parse(text: str, names: Sequence[str], *, final: bool = True) -> Parsed:
    """The content and calls of ``text``. With ``final=False`` (a stream so far) only what more
    text cannot change: no content that may still open a call, no call without its closing tag."""
    if names and _may_be_json(text, final):
        if not final:
            return Parsed("")  # held until the end: a bare JSON call, or text after all
        plain = _plain_calls(text, names)
        if plain is not None:
            return Parsed("", plain)
    segments: list[str] = []
    calls: list[Found] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            segments.append(text[pos:] if final else _settled(text[pos:]))
            break
        segments.append(text[pos:start].rstrip())
        end = _call_end(text, start + len(OPEN), final)
        if end < 0:  # still open: a call only if the reply ended here
            if final:
                calls.append(read_call(text[start + len(OPEN) :].strip()))
            break
        calls.append(read_call(text[start + len(OPEN) : end].strip()))
        pos = _skip_space(text, end + len(CLOSE))
    return Parsed("\n".join(s for s in segments if s), calls)


def _call_end(text: str, body: int, final: bool) -> int:
    """Where the closing tag of the call whose text starts at ``body`` is (-1: not yet). Its
    JSON is decoded first, so a closing tag inside a JSON string is part of the arguments."""
    start = _skip_space(text, body)
    try:
        end = _skip_space(text, _DECODER.raw_decode(text, start)[1])
    except (ValueError, RecursionError):  # malformed JSON, or JSON still to come: the first closing tag
        end = text.find(CLOSE, body)
        # (streamed: a tag inside what may still be an open JSON string waits for more text)
        return -1 if not final and end >= 0 and _in_string(text, start, end) else end
    return end if text.startswith(CLOSE, end) else text.find(CLOSE, end)  # (text after the JSON: invalid)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _in_string(text: str, start: int, end: int) -> bool:
    """Whether ``end`` falls inside a JSON string opened in ``text[start:end]``."""
    inside = escaped = False
    for ch in text[start:end]:
        if escaped:
            escaped = False
        elif inside and ch == "\\":
            escaped = True
        elif ch == '"':
            inside = not inside
    return inside


def _settled(tail: str) -> str:
    """``tail`` less what may still become the start of a call (a partial ``<tool_call>`` and
    the whitespace before it)."""
    for n in range(min(len(OPEN) - 1, len(tail)), 0, -1):
        if OPEN.startswith(tail[-n:]):
            tail = tail[:-n]
            break
    return tail.rstrip()


def _may_be_json(text: str, final: bool) -> bool:
    start = text.lstrip()
    return start.startswith(("{", "[", FENCE)) or (not final and FENCE.startswith(start))


def _plain_calls(text: str, names: Sequence[str]) -> list[Found] | None:
    """The calls of a reply that is only JSON naming bound tools; None when it is not one."""
    body = text.strip()
    fenced = _FENCED.match(body)
    if fenced:
        body = fenced.group(1)
    try:
        obj = loads(body)
    except (ValueError, RecursionError):
        return None
    items = obj if isinstance(obj, list) and obj else [obj]
    calls = [read_call(json.dumps(item)) for item in items]
    if all(c.args is not None and c.name in names for c in calls):
        return calls
    return None


class CallStream:
    """A stream's content and calls, from its text accumulated so far: ``feed`` returns
    what became certain since the last call, ``finish`` the rest."""

    def __init__(self, names: Sequence[str], prefix: str = "") -> None:
        self.names, self.text = names, prefix
        self.sent_content, self.sent_calls = 0, 0

    def feed(self, delta: str) -> Parsed:
        self.text += delta
        return self._new(parse(self.text, self.names, final=False))

    def finish(self) -> Parsed:
        return self._new(parse(self.text, self.names, final=True))

    def _new(self, parsed: Parsed) -> Parsed:
        new = Parsed(parsed.content[self.sent_content :], parsed.calls[self.sent_calls :])
        self.sent_content, self.sent_calls = len(parsed.content), len(parsed.calls)
        return new


# -- LangChain's forms ------------------------------------------------------------------------------
def new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_calls(calls: list[Found]) -> tuple[list[ToolCall], list[InvalidToolCall]]:
    """``AIMessage.tool_calls`` and ``invalid_tool_calls``, each with a fresh id."""
    valid: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    for c in calls:
        if c.args is not None:
            valid.append(tool_call(name=c.name or "", args=c.args, id=new_id()))
        else:
            invalid.append(invalid_tool_call(name=c.name, args=c.raw, id=new_id(), error=c.error))
    return valid, invalid


def chunk_calls(calls: list[Found], first_index: int) -> list[ToolCallChunk]:
    """``tool_call_chunks`` for calls that arrived whole, indexed from ``first_index``. An
    invalid call's text is sent as a JSON string, so that LangChain's merging of partial JSON
    cannot read it as a call (its ``invalid_tool_calls`` entry then holds that string)."""
    return [
        tool_call_chunk(
            name=c.name,
            args=json.dumps(c.args) if c.args is not None else json.dumps(c.raw),
            id=new_id(),
            index=first_index + i,
        )
        for i, c in enumerate(calls)
    ]
