"""Input files -> rows, rows -> store requests, and a stored request -> ``GenerationRequest``.

Formats (by file suffix):
- ``.jsonl`` / ``.ndjson`` / ``.json``: one object per line:
  ``{"id"?, "prompt" | "messages", "params"?, "metadata"?, "category"?}`` where generation
  parameters may also sit at the top level (``"max_new_tokens": 64``); or an OpenAI Batch
  input line ``{"custom_id", "method", "url", "body"}`` for ``/v1/chat/completions`` or
  ``/v1/completions`` (see ``openai_batch``; a file may mix both kinds of line);
- ``.csv``: a header with a ``prompt`` column; ``id`` and ``category`` columns are used,
  any other column becomes metadata;
- anything else: plain text, one prompt per line.
Blank lines are skipped. A bad row (invalid JSON, no prompt or an empty one, a message role
other than system, user or assistant, bad parameters, a duplicate id) gets ``error`` set and
fails alone; only an unreadable file (UTF-16, or a JSON array where JSON Lines are expected)
fails the whole command. A row without an id gets its
position ("3"), or "row-3" when another row of the file names "3" itself: ids never collide.

A request row in the store: ``prompt`` or ``messages``, and ``params`` = the generation
parameters (``GenerationRequest`` field names, job-level ones merged under the row's) plus
bookkeeping under keys starting with "_": ``_row`` (position in the file), ``_id`` (the
row's id), ``_metadata``, ``_input_error`` (why it was refused at submit time), for an OpenAI
Batch line ``_endpoint`` (its url) and ``_spelled`` (its own name of a parameter, e.g.
``{"max_new_tokens": "max_completion_tokens"}``: its errors name that), and for chat
turns from LangChain ``_tools`` (tool schemas for the chat template) and ``_prefill`` (text
after the generation prompt: the start of the answer).
``build_request`` turns such a row into the engine's request: the worker does it for each
task, LangChain's local mode for each prompt.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, BinaryIO

from specdec_llm.checks import check_messages, check_text
from specdec_llm.engine import GenerationRequest, RequestError
from specdec_llm.errors import SpecDecError
from specdec_llm.store import MAX_CATEGORY_CHARS

from . import openai_batch

PARAMS = tuple(f.name for f in fields(GenerationRequest) if f.name != "prompt")
ROW_KEYS = ("id", "prompt", "messages", "params", "metadata", "category")
ROLES = ("system", "user", "assistant")  # a message's roles (as an OpenAI Batch line's, "developer" aside)


class InputError(SpecDecError, ValueError):
    """The file as a whole cannot be read; the message says why."""


@dataclass
class Row:
    index: int  # position among the file's rows, from 0: the export order
    line: int  # where it is in the file, from 1 (for messages)
    id: str
    prompt: str | None = None
    messages: list[Any] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    metadata: Any = None
    category: str | None = None
    error: str | None = None
    endpoint: str | None = None  # an OpenAI Batch line's url (its results can be written in that format)
    spelled: dict[str, str] | None = None  # an OpenAI Batch line's names for parameters ours name otherwise


MAX_LINE_BYTES = 8 * 2**20  # a longer line fails its row unread (memory stays bounded whatever the file)
PREVIEW_CHARS = 200  # what a bad row keeps of its line, to show in results


def reader_of(path: Path) -> str:
    """How a file's rows are read, by its suffix: "jsonl", "csv" or "text" (a prompt a line)."""
    suffix = Path(path).suffix.lower()
    return "jsonl" if suffix in (".jsonl", ".ndjson", ".json") else "csv" if suffix == ".csv" else "text"


def read_rows(path: Path) -> list[Row]:
    """Rows of ``path``, read line by line in bounded memory. Only a file that cannot be
    opened, has no rows at all, is UTF-16, (JSON Lines) a JSON array, or OpenAI Batch lines
    sharing a ``custom_id`` fails as a whole (InputError); a line that is not valid UTF-8, not valid JSON or longer than
    ``MAX_LINE_BYTES`` fails alone."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except OSError as e:
        raise InputError(f"{path}: cannot open it ({e.strerror})") from None
    reader = reader_of(path)
    with f:
        try:
            if f.peek(2)[:2] in (b"\xff\xfe", b"\xfe\xff"):  # (a UTF-16 byte order mark)
                raise InputError(f"{path}: the file is UTF-16 text; save it as UTF-8 (without a byte order mark)")
            if reader == "jsonl":
                rows = _jsonl(_lines(f), path)
            elif reader == "csv":
                rows = _csv(_lines(f, keep_ends=True), path)
            else:
                rows = []
                for n, line in _lines(f):
                    if isinstance(line, _Bad):
                        rows.append(Row(len(rows), n, "", prompt=line.preview, error=line.error))
                    elif line.strip():
                        rows.append(Row(len(rows), n, "", prompt=line))
        except OSError as e:
            raise InputError(f"{path}: cannot read it ({e.strerror})") from None
    if not rows:
        raise InputError(f"{path}: no prompts in it")
    given = {r.id for r in rows if r.id}
    seen: dict[str, int] = {}
    for r in rows:
        r.id = r.id or _auto_id(r.index + 1, given)
        if r.id in seen and r.error is None and r.endpoint is not None:  # (results keyed by custom_id)
            raise InputError(
                f"{path}: custom_id {r.id!r} is on lines {seen[r.id]} and {r.line}; give each request its "
                "own custom_id (OpenAI's Batch API refuses such a file too: its results are found by it)"
            )
        if r.id in seen and r.error is None:
            r.error = f"duplicate id {r.id!r}: line {seen[r.id]} already uses it"
        seen.setdefault(r.id, r.line)
    return rows


def _auto_id(position: int, taken: set[str]) -> str:
    """The id of a row that names none: its position ("3"), or "row-3" (then "row-3-2", ...)
    when a row of the file names that id itself; added to ``taken``, so no two rows share one."""
    auto, n = str(position), 1
    while auto in taken:
        n += 1
        auto = f"row-{position}" if n == 2 else f"row-{position}-{n - 1}"
    taken.add(auto)
    return auto


@dataclass
class _Bad:
    """A line that cannot be a row: its error and a short preview."""

    error: str
    preview: str


def _lines(f: BinaryIO, keep_ends: bool = False) -> Iterator[tuple[int, str | _Bad]]:
    """``(line number, text)`` for each line of binary file ``f`` (line ending dropped unless
    ``keep_ends``: a CSV field's own line breaks are its text), never holding more than
    ``MAX_LINE_BYTES`` of one line: an over-long line, or one that is not UTF-8, comes as a
    ``_Bad`` instead of its text."""
    n = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        n += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            size, head = len(raw), raw[:PREVIEW_CHARS]
            while raw and not raw.endswith(b"\n"):  # skip the rest of it, a bounded piece at a time
                raw = f.readline(MAX_LINE_BYTES)
                size += len(raw)
            yield (
                n,
                _Bad(
                    f"line is {size:,} bytes, over the {MAX_LINE_BYTES:,}-byte limit for one row",
                    head.decode("utf-8", "replace"),
                ),
            )
            continue
        if not keep_ends:
            raw = raw.rstrip(b"\r\n")
        if n == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
            raw = raw[3:]
        try:
            yield n, raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield (
                n,
                _Bad(
                    f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)",
                    raw[:PREVIEW_CHARS].decode("utf-8", "replace"),
                ),
            )


def _json_document(line: str) -> tuple[str, str] | None:
    """What a file's first line opens where it is one JSON document, not JSON Lines: (what it
    is, the jq filter that writes it as lines), or None. An array: ``[`` alone (pretty-printed),
    ``[{`` or ``[ {`` (an array of objects), or a whole array on one line; an object over
    several lines: ``{`` alone. Any other line, ``[[[[`` say, is a bad row."""
    head = line.strip()
    if head == "{":
        return "an object over several lines", "."
    if not head.startswith("["):
        return None
    if head == "[" or head[1:].lstrip().startswith("{"):
        return "a JSON array", ".[]"
    try:
        return ("a JSON array", ".[]") if isinstance(json.loads(head), list) else None
    except (ValueError, RecursionError):
        return None


def _jsonl(lines: Iterable[tuple[int, str | _Bad]], path: Path) -> list[Row]:
    rows: list[Row] = []
    for n, line in lines:
        if isinstance(line, _Bad):
            rows.append(Row(len(rows), n, "", prompt=line.preview, error=line.error))
            continue
        if not line.strip():
            continue
        if not rows and (document := _json_document(line)):  # a .json file: no row would read
            out = f"{path.stem}.jsonl" if path.suffix.lower() != ".jsonl" else f"{path.stem}-lines.jsonl"
            what, jq = document
            raise InputError(
                f"{path}: line {n} starts {what}; JSON Lines expected: one object per line; "
                f"convert with `jq -c '{jq}' {path.name} > {out}`"
            )
        row = Row(len(rows), n, "")
        rows.append(row)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            # (some messages end in "at" already: "Invalid control character at")
            where = f"{e.msg.removesuffix(' at')} at column {e.colno}"
            row.prompt, row.error = line[:PREVIEW_CHARS], f"invalid JSON ({where})"
            continue
        except (ValueError, RecursionError) as e:  # an integer of over 4,300 digits; nesting too deep
            row.prompt, row.error = line[:PREVIEW_CHARS], f"invalid JSON ({type(e).__name__}: {str(e)[:120]})"
            continue
        if not isinstance(obj, dict):
            row.prompt, row.error = line[:PREVIEW_CHARS], f"expected a JSON object, got {type(obj).__name__}"
            continue
        key = "custom_id" if openai_batch.is_batch_line(obj) else "id"
        if obj.get(key) is not None:
            row.id = obj[key] if isinstance(obj[key], str) else _dumps_safe(obj[key])
        fill = openai_batch.fill if key == "custom_id" else _fill
        row.error = fill(row, obj) or _unstorable(obj)
    return rows


def _unstorable(value: Any, where: str = "") -> str | None:
    """What in a parsed row cannot be stored (NaN or infinity: not JSON; a lone surrogate such
    as "\\ud800": not UTF-8; a NUL character: not PostgreSQL text, nor usable in its JSON),
    else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where or 'value'}: {json.dumps(value)} is not a JSON number (NaN and Infinity cannot be stored)"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{where or 'value'}: text with an unpaired surrogate (\\u{ord(value[_bad_at(value)]):04x}) is not valid Unicode"
        return _nul_problem(value, where or "value")
    if isinstance(value, dict):
        for k, v in value.items():
            problem = _unstorable(k, where or "key") or _unstorable(v, f"{where}.{k}" if where else str(k))
            if problem:
                return problem
    elif isinstance(value, list):
        for i, v in enumerate(value):
            problem = _unstorable(v, f"{where}[{i}]")
            if problem:
                return problem
    return None


def _nul_problem(text: str, where: str) -> str | None:
    """The error of text holding a NUL character (as ``checks.check_text`` words it), else None."""
    nul = text.find("\x00")
    if nul < 0:
        return None
    return (
        f"{where}: contains a NUL character (\\x00) at character {nul}; remove it "
        "(PostgreSQL cannot store NUL, so no store accepts it)"
    )


def _category_problem(category: Any) -> str | None:
    """Why ``category`` cannot be a row's category (not text, too long for the store), else None."""
    if category is not None and not isinstance(category, str):
        return '"category" must be text'
    if category is not None and len(category) > MAX_CATEGORY_CHARS:
        return (
            f'"category" is {len(category):,} characters, over the {MAX_CATEGORY_CHARS}-character limit; '
            'shorten it (a longer label belongs under "metadata")'
        )
    return None


def _bad_at(text: str) -> int:
    return next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)


def _sanitize(value: Any) -> Any:
    """A JSON-safe, UTF-8-safe copy of ``value`` (for storing a bad row as it came)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value).replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_sanitize(str(k)): _sanitize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_sanitize(v) for v in value]
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def _dumps_safe(value: Any) -> str:
    return json.dumps(_sanitize(value))[:PREVIEW_CHARS]


def _fill(row: Row, obj: dict[str, Any]) -> str | None:
    """Copy a JSON object's fields into ``row``; the first problem as text, else None."""
    unknown = sorted(set(obj) - set(ROW_KEYS) - set(PARAMS))
    row.prompt, row.messages = obj.get("prompt"), obj.get("messages")
    row.metadata, row.category = obj.get("metadata"), obj.get("category")
    if unknown:
        return f'unknown field {unknown[0]!r}; use {", ".join(ROW_KEYS)} or a parameter ({", ".join(PARAMS)}); put anything else under "metadata"'
    if (row.prompt is None) == (row.messages is None):
        return 'needs exactly one of "prompt" (text) or "messages" (chat turns)'
    if row.prompt is not None and not isinstance(row.prompt, str):
        return f'"prompt" must be text, not {type(row.prompt).__name__}'
    if row.prompt is not None and not row.prompt.strip():
        return '"prompt" is empty; give the text to continue (or drop the row)'
    if row.messages is not None and not _valid_messages(row.messages):
        return '"messages" must be a non-empty list of {"role": text, "content": text}'
    if row.messages is not None:
        unknown_role = next((i for i, m in enumerate(row.messages) if m["role"] not in ROLES), None)
        if unknown_role is not None:
            role = row.messages[unknown_role]["role"]
            return f"messages[{unknown_role}].role: {role!r} is not a chat role; use one of {', '.join(ROLES)}"
    params = obj.get("params") or {}
    if not isinstance(params, dict):
        return '"params" must be an object of generation parameters'
    row.params = stop_as_list({**{k: obj[k] for k in PARAMS if k in obj}, **params})
    if row.params.get("response_format") == openai_batch.PLAIN_TEXT:  # (OpenAI's "no constraint": over the job's too)
        row.params["response_format"] = None
    return _category_problem(row.category)


def _valid_messages(messages: Any) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )


CSV_BAD_LINE = (
    "\x00specdec: bad line\x00"  # stands for an unreadable line (over-long, not UTF-8) in the CSV reader's input
)


def _csv(lines: Iterable[tuple[int, str | _Bad]], path: Path) -> list[Row]:
    bad_lines: dict[int, _Bad] = {}

    def text() -> Iterator[str]:
        for n, line in lines:
            if isinstance(line, _Bad):  # keep the line count; the record that holds it fails
                bad_lines[n] = line
                yield CSV_BAD_LINE + "\n"
            else:
                yield line

    csv.field_size_limit(MAX_LINE_BYTES)  # (the default, 131,072 characters, would refuse long prompts)
    reader = csv.DictReader(text(), strict=True)  # strict: a quote never closed is an error, not the rest of the file
    try:
        fieldnames = reader.fieldnames
    except csv.Error as e:
        raise InputError(f"{path}: cannot read the CSV header ({e})") from None
    if not fieldnames or "prompt" not in fieldnames:
        raise InputError(f"{path}: a CSV file needs a header with a 'prompt' column (found: {fieldnames})")
    rows: list[Row] = []
    lines_read = reader.reader  # (its count is current after an error too; the DictReader's is not)
    start = lines_read.line_num + 1
    while True:
        try:
            record = next(reader)
        except StopIteration:
            break
        except csv.Error as e:  # a broken record fails alone
            if "unexpected end of data" in str(e):  # every line after the quote would be one prompt
                raise InputError(
                    f"{path}: line {start}: a quoted field opens in this record and is never closed, so every "
                    "line after it would become part of one prompt; close the quote (a quote inside a quoted "
                    'field is written "")'
                ) from None
            if "field larger than field limit" in str(e):  # the reader would go on from inside that field
                raise InputError(
                    f"{path}: line {start}: a field of this record is over {MAX_LINE_BYTES:,} characters, more "
                    "than one row may hold, and the lines after it cannot be told apart from it; shorten it"
                ) from None
            rows.append(Row(len(rows), start, "", prompt="", error=f"bad CSV ({e})"))
            start = lines_read.line_num + 1
            continue
        line, start = start, lines_read.line_num + 1
        bad = [bad_lines[n] for n in range(line, start) if n in bad_lines]
        row = _csv_row(record, len(rows), line, len(fieldnames), bad)
        rows.append(row)
    return rows


def _csv_row(record: dict[str | None, Any], index: int, line: int, header: int, bad: list[_Bad]) -> Row:
    """One CSV record as a row: ``line`` its first line, ``header`` the number of fields the
    header names, ``bad`` its lines that could not be read. A record with such a line, more
    fields than the header or no prompt fails alone (``error``)."""
    extra = {k: v for k, v in record.items() if k not in ("id", "prompt", "category") and k is not None}
    surplus = record.get(None)  # more fields than the header names: never dropped silently
    row = Row(
        index,
        line,
        record.get("id") or "",
        prompt=record.get("prompt"),
        metadata=extra or None,
        category=record.get("category") or None,
    )
    values = [v for v in record.values() if isinstance(v, str)]
    if bad or any(CSV_BAD_LINE in v for v in values):
        problem = bad[0] if bad else _Bad("a line of this record cannot be read", "")
        row.id, row.prompt, row.metadata, row.category, row.error = "", problem.preview, None, None, problem.error
    elif surplus:
        row.error = (
            f"{header + len(surplus)} fields, but the header names {header}; "
            'quote a prompt that holds commas ("like, this"), or name the extra columns in the header'
        )
    elif not (row.prompt or "").strip():
        row.error = "empty prompt"
    else:
        row.error = _category_problem(row.category) or next(
            filter(None, (_unstorable(v, str(k)) or _unstorable(k, "header") for k, v in record.items())), None
        )
    return row


# -- checks and ids ------------------------------------------------------------------------
def stop_as_list(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with one stop string as a list of it (as OpenAI's API takes it): a row's
    parameters and a job's."""
    stop = params.get("stop")
    return {**params, "stop": [stop]} if isinstance(stop, str) else params


def check_params(params: dict[str, Any], *, messages: bool = False) -> None:
    """RequestError naming the first bad generation parameter."""
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise RequestError(unknown[0], f"unknown parameter; known: {', '.join(PARAMS)}")
    gen = {**params, "chat": False} if messages else params
    GenerationRequest(prompt="x", **gen).validate()


def check_rows(rows: list[Row], job_params: dict[str, Any]) -> None:
    """Set ``error`` on each row whose merged parameters are bad (context length is the
    worker's check: it needs the tokenizer)."""
    for r in rows:
        if r.error is None:
            try:
                check_params({**job_params, **r.params}, messages=r.messages is not None)
                check_text(r.prompt, "prompt")
                check_messages(r.messages)
            except RequestError as e:
                r.error = str(e)


def job_id_for(path: Path, pair: str, params: dict[str, Any]) -> str:
    """Same file content read the same way, pair and parameters -> same job: running it again
    resumes it. (The same bytes as CSV and as text are other rows: other jobs. JSON Lines, the
    first reader, adds nothing to the hash: its jobs keep their ids.)"""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            h.update(chunk)
    reader = reader_of(path)
    h.update(
        json.dumps(
            {"pair": pair, "params": params, **({"reader": reader} if reader != "jsonl" else {})}, sort_keys=True
        ).encode()
    )
    return h.hexdigest()[:16]


def request_id(job_id: str, row: Row) -> str:
    return f"{job_id}-{row.index + 1}"


def to_request(job_id: str, row: Row, job_params: dict[str, Any]) -> dict[str, Any]:
    """The ``store.create_job`` item for ``row``. A bad row is stored as it came, made safe to
    store (NaN as text, unpaired surrogates replaced), with its error."""
    params = {**job_params, **row.params, "_row": row.index, "_id": row.id}
    if row.endpoint is not None:
        params["_endpoint"] = row.endpoint
    if row.spelled:
        params["_spelled"] = row.spelled
    if row.metadata is not None:
        params["_metadata"] = row.metadata
    if row.error is not None:
        params["_input_error"] = f"line {row.line}: {row.error}"
    prompt = row.prompt if isinstance(row.prompt, str) or row.prompt is None else json.dumps(_sanitize(row.prompt))
    if prompt is None and row.messages is None:  # a bad row still needs something to show
        prompt = ""
    category = row.category if isinstance(row.category, str) else None
    item = {
        "id": request_id(job_id, row),
        "messages": row.messages,
        "params": params,
        "prompt": prompt,
        # (a bad row's: as much of it as a store holds)
        "category": category if category is None or row.error is None else category[:MAX_CATEGORY_CHARS],
    }
    if row.error is not None:
        item = {
            **item,
            "messages": _sanitize(row.messages) if _valid_messages(row.messages) else None,
            "params": _sanitize(params),
            "prompt": _sanitize(prompt) if prompt is not None else None,
            "category": _sanitize(item["category"]),
        }
        if item["prompt"] is None and item["messages"] is None:
            item["prompt"] = ""
    return item


def generation_params(params: dict[str, Any] | None) -> dict[str, Any]:
    """The ``GenerationRequest`` fields of a stored row's params."""
    return {k: v for k, v in (params or {}).items() if not k.startswith("_")}


def build_request(row: dict[str, Any], tokenizer: Any) -> GenerationRequest:
    """A stored request row -> GenerationRequest (chat messages rendered to token ids here,
    with the pair's chat template, so the engine needs no notion of turns)."""
    from specdec_llm.engine.chat import render_chat, render_user_prompt

    params = row.get("params") or {}
    if params.get("_input_error"):
        raise RequestError("input", params["_input_error"])
    gen = generation_params(params)
    prompt = row["prompt"]
    if row.get("messages") is not None:  # with the tools and prefill of a LangChain chat call
        prompt = render_chat(tokenizer, row["messages"], tools=params.get("_tools"), prefill=params.get("_prefill"))
        gen["chat"] = False
    elif gen.get("chat") is True and isinstance(prompt, str) and prompt.strip():
        # a text prompt as one user turn, rendered here (special-token text refused), not by the engine
        prompt, gen["chat"] = render_user_prompt(tokenizer, prompt), False
    if row.get("job_id") and "scope" not in gen:  # the suffix drafter learns within the job's rows
        gen["scope"] = row["job_id"]
    try:
        request = GenerationRequest(prompt=prompt, **gen)
    except TypeError as e:  # an unknown parameter name
        raise RequestError("params", str(e)) from None
    request.validate()  # (a row stored by another path: its error is the row's, before it decodes)
    return request
