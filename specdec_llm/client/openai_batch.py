"""OpenAI Batch files in and out: a reader and a writer at the edge of bulk jobs.

In: a JSONL line ``{"custom_id", "method": "POST", "url", "body"}`` for ``/v1/chat/completions``
(``body.messages``) or ``/v1/completions`` (``body.prompt``) becomes an ordinary job row
(``rows.Row``): ``custom_id`` is its id, ``max_tokens`` / ``max_completion_tokens`` its
``max_new_tokens``, and ``temperature``, ``top_p``, ``seed``, ``stop`` keep their names.
``model`` is ignored (the job's pair generates every row). A body field we cannot honour
(``tools``, ``n`` > 1, ``logprobs``, ...) fails that row alone, with an error naming the field.
``response_format`` (json_schema or json_object) is decoded under its grammar (engine/grammar.py).

Out: ``results --format openai`` writes one OpenAI Batch output line per row, in input
order: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``.
A finished row's body is a ``chat.completion`` or ``text_completion`` object (``choices``,
``usage``), plus our telemetry under ``specdec``. A failed row has ``error`` = ``{"code",
"message", "param"}`` and, when it was refused for its input, a 400 response whose body
holds the same error as the OpenAI API would return it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .rows import Row

import calendar
import dataclasses
import json
import re
from typing import Any

from specdec_llm.checks import check_text
from specdec_llm.engine import GenerationRequest, RequestError

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LINE_KEYS = ("custom_id", "method", "url", "body")
# body field -> GenerationRequest field
PARAMS = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "response_format": "response_format",  # json_schema, json_object (text: no constraint)
}
# no effect on the text we generate (parallel_tool_calls: a row with tools fails on `tools` itself)
IGNORED = ("model", "user", "metadata", "store", "service_tier", "parallel_tool_calls")
# fields we do not support, accepted at the value that asks for nothing (null is always accepted)
PLAIN_TEXT = {"type": "text"}  # a response_format that asks for no constraint (OpenAI's default)
NEUTRAL = {
    "n": 1,
    "best_of": 1,
    "stream": False,
    "logprobs": False,
    "top_logprobs": 0,
    "echo": False,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "response_format": PLAIN_TEXT,
    "tools": [],
    "tool_choice": "none",
    "logit_bias": {},
    "modalities": ["text"],
}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
# what the ``specdec`` field of a response body carries (``client.results`` keys; finish_reason
# is ours: eos, stop, length or context, where OpenAI's says stop or length)
TELEMETRY = (
    "finish_reason",
    "tokens_per_s",
    "acceptance_rate",
    "mean_accepted_length",
    "draft_tokens_proposed",
    "draft_tokens_accepted",
    "drafter",
    "wall_time_s",
    "time_to_first_token_s",
)


def is_batch_line(obj: dict[str, Any]) -> bool:
    """An OpenAI Batch input line (our own rows have no ``custom_id``)."""
    return "custom_id" in obj


def fill(row: Row, obj: dict[str, Any]) -> str | None:
    """Copy an OpenAI Batch input line into ``row`` (a ``rows.Row``; its id is already the
    ``custom_id``); the first problem as text (naming the field as the line spells it), else None."""
    unknown = [k for k in obj if k not in LINE_KEYS]
    if unknown:
        return f"unknown field {unknown[0]!r} in an OpenAI Batch line; use {', '.join(LINE_KEYS)}"
    if not isinstance(obj["custom_id"], str) or not obj["custom_id"]:
        return "custom_id: must be non-empty text"
    if str(obj.get("method", "POST")).upper() != "POST":
        return f"method: {obj['method']!r} is not supported; use POST"
    url = obj.get("url")
    if url not in (CHAT, COMPLETIONS):
        return f"url: {url!r} is not supported; use {CHAT} or {COMPLETIONS}"
    row.endpoint = url
    body = obj.get("body")
    if not isinstance(body, dict):
        return "body: must be an object (the request's JSON body)"
    wanted = "messages" if url == CHAT else "prompt"
    problem = _messages(row, body.get("messages")) if url == CHAT else _prompt(row, body.get("prompt"))
    if problem:
        return problem
    for name, value in body.items():
        if value is None or name in PARAMS or name in IGNORED or name == wanted:
            continue
        neutral = NEUTRAL.get(name, ...)
        if value == neutral and isinstance(value, bool) == isinstance(neutral, bool):  # (n: true is not 1)
            continue
        if name in ("messages", "prompt"):
            return f"body.{name}: not a field of {url}; use body.{wanted}"
        if name in NEUTRAL:
            return (
                f"body.{name}: {json.dumps(value)[:40]} is not supported by specdec-llm; use "
                f"{json.dumps(neutral)} or leave it out"
            )
        return f"body.{name}: not supported by specdec-llm; remove it (supported: {wanted}, {', '.join(PARAMS)})"
    params, source = {}, {}
    for name in PARAMS:  # (max_tokens, then max_completion_tokens: the newer name wins where both are given)
        if body.get(name) is not None and body[name] != NEUTRAL.get(name):
            params[PARAMS[name]], source[PARAMS[name]] = body[name], name
    if body.get("response_format") == PLAIN_TEXT:  # asked for plain text: over the job's --json-schema too
        params["response_format"] = None
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    if url == COMPLETIONS:
        params["chat"] = False  # a completion continues the raw text, whatever the job's --chat says
    try:
        GenerationRequest(prompt="x", **params).validate()  # (the seed's range too)
    except RequestError as e:
        return f"body.{source.get(e.field, e.field)}: {str(e).split(': ', 1)[1]}"
    row.params = params
    row.spelled = {ours: theirs for ours, theirs in source.items() if ours != theirs}
    return None


def user_error(message: str, spelled: dict[str, str] | None = None) -> str:
    """A worker's error for an OpenAI Batch row in the line's own terms: the field it names and
    the fix it gives as the line spells them ("response_format: ...; raise max_new_tokens" ->
    "body.response_format: ...; raise body.max_tokens"). ``spelled``: the line's name for a
    parameter it gave under another name (``max_completion_tokens``); an error found at
    submit ("line 3: body.tools: ...") or naming no field (a time-out) is left as it is."""
    max_tokens = f"body.{(spelled or {}).get('max_new_tokens', 'max_tokens')}"
    head, sep, rest = message.partition(": ")
    if head == "max_new_tokens":
        head = max_tokens
    elif head in PARAMS.values() or head in ("prompt", "messages"):
        head = f"body.{head}"
    return head + sep + re.sub(r"\bmax_new_tokens\b", max_tokens, rest)


def _messages(row: Row, messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return 'body.messages: must be a non-empty list of {"role", "content"}'
    turns = []
    for i, m in enumerate(messages):
        where = f"body.messages[{i}]"
        if not isinstance(m, dict):
            return f'{where}: must be an object with "role" and "content"'
        extra = [k for k in m if k not in ("role", "content", "name") and m[k] is not None]
        if extra:
            return f"{where}.{extra[0]}: not supported by specdec-llm (text turns only)"
        if not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            return f"{where}.role: {m.get('role')!r} is not supported; use one of {', '.join(ROLES)}"
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    return f"{where}.content[{j}]: {kind!r} parts are not supported (text only)"
            content = "\n".join(part["text"] for part in content)
        if not isinstance(content, str):
            return f"{where}.content: must be text or a list of text parts"
        try:
            check_text(content, f"{where}.content")
        except RequestError as e:
            return str(e)
        turns.append({"role": ROLES[m["role"]], "content": content})
    row.messages = turns
    return None


def _prompt(row: Row, prompt: Any) -> str | None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return (
            f"body.prompt: a list of {len(prompt)} prompts is not supported; put each prompt on a line of its own"
            if all(isinstance(p, str) for p in prompt)
            else "body.prompt: must be text"
        )
    if not isinstance(prompt, str) or not prompt.strip():
        return "body.prompt: must be non-empty text"
    try:
        check_text(prompt, "body.prompt")
    except RequestError as e:
        return str(e)
    row.prompt = prompt
    return None


# -- out ---------------------------------------------------------------------------------------------
def output_line(item: dict[str, Any]) -> dict[str, Any]:
    """One OpenAI Batch output line for one ``client.results`` item."""
    rid, endpoint = item["request_id"], item.get("endpoint") or (CHAT if item.get("chat") else COMPLETIONS)
    line = {"id": f"batch_req_{rid}", "custom_id": item["id"], "response": None, "error": None}
    if item["status"] != "ok":
        message = item["error"] or f"not finished: the row is {item['status']}"
        param, at = _param(message)
        invalid = item.get("refused") or param is not None  # bad input (found at submit, or by the worker)
        code = {"failed": "invalid_request" if invalid else "generation_failed", "cancelled": "batch_cancelled"}.get(
            item["status"], "not_finished"
        )
        line["error"] = {"code": code, "message": message, "param": param, "line": at}
        if item["status"] == "failed":
            status = 400 if invalid else 500
            kind = "invalid_request_error" if status == 400 else "server_error"
            line["response"] = {
                "status_code": status,
                "request_id": rid,
                "body": {"error": {"message": message, "type": kind, "param": param, "code": code}},
            }
        return line
    finish = FINISH.get(item["finish_reason"], "stop")
    text = item["text"] or ""
    if endpoint == CHAT:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": finish,
        }
        kind, prefix = "chat.completion", "chatcmpl"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind, prefix = "text_completion", "cmpl"
    prompt, output = item["prompt_tokens"] or 0, item["output_tokens"] or 0
    body = {
        "id": f"{prefix}-{rid}",
        "object": kind,
        "created": calendar.timegm(item["finished_at"].timetuple()) if item.get("finished_at") else 0,
        "model": item.get("pair"),
        "choices": [choice],
        "usage": {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output},
        "specdec": {**{k: item.get(k) for k in TELEMETRY}, **_speedup(item)},
    }
    line["response"] = {"status_code": 200, "request_id": rid, "body": body}
    return line


def _speedup(item: dict[str, Any]) -> dict[str, Any]:
    """The row's speedup over target-only decoding and its basis (None for a row recorded
    before per-request counterfactuals)."""
    from specdec_llm.store.reports import SPEEDUP_BASIS

    base, wall = item.get("baseline_s"), item.get("wall_time_s")
    speedup = base / wall if base and wall else None
    return {"speedup": speedup, "speedup_basis": SPEEDUP_BASIS if speedup is not None else None}


def _param(message: str) -> tuple[str | None, int | None]:
    """The field an error names and the input line it gives ("line 3: body.tools: ..." ->
    ("tools", 3); a worker's "prompt: context is 512 tokens..." -> ("prompt", None)), each
    None where it names none (a timeout, a crash)."""
    line = None
    head, _, rest = message.partition(": ")
    if head.startswith("line ") and head[5:].isdigit():
        line, message = int(head[5:]), rest
    head = message.split(": ", 1)[0] if ": " in message else ""
    if head.startswith("body."):
        return head[len("body.") :], line
    if head in LINE_KEYS or head in REQUEST_FIELDS or head == "messages" or head.startswith("messages["):
        return head, line
    return None, line


REQUEST_FIELDS = {f.name for f in dataclasses.fields(GenerationRequest)} | {"messages", "params", "input"}
