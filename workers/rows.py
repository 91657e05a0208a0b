"""Input files -> rows, and rows -> store requests.

Formats (by file suffix):
- ``.jsonl`` / ``.ndjson`` / ``.json``: one object per line:
  ``{"id"?, "prompt" | "messages", "params"?, "metadata"?, "category"?}`` where generation
  parameters may also sit at the top level (``"max_new_tokens": 64``);
- ``.csv``: a header with a ``prompt`` column; ``id`` and ``category`` columns are used,
  any other column becomes metadata;
- anything else: plain text, one prompt per line.
Blank lines are skipped. A bad row (invalid JSON, no prompt, bad parameters, a duplicate
id) gets ``error`` set and fails alone; only an unreadable file fails the whole command.

A request row in the store: ``prompt`` or ``messages``, and ``params`` = the generation
parameters (``GenerationRequest`` field names, job-level ones merged under the row's) plus
bookkeeping under keys starting with "_": ``_row`` (position in the file), ``_id`` (the
row's id), ``_metadata``, ``_input_error`` (why it was refused at submit time).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from specdec_llm.engine import GenerationRequest, RequestError

PARAMS = tuple(f.name for f in fields(GenerationRequest) if f.name != "prompt")
ROW_KEYS = ("id", "prompt", "messages", "params", "metadata", "category")


class InputError(ValueError):
    """The file as a whole cannot be read; the message says why."""


@dataclass
class Row:
    index: int  # position among the file's rows, from 0: the export order
    line: int  # where it is in the file, from 1 (for messages)
    id: str
    prompt: str | None = None
    messages: list | None = None
    params: dict = field(default_factory=dict)
    metadata: Any = None
    category: str | None = None
    error: str | None = None


def read_rows(path: Path) -> list[Row]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read it as UTF-8 text ({e})") from None
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        rows = _jsonl(text)
    elif suffix == ".csv":
        rows = _csv(text, path)
    else:
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                rows.append(Row(len(rows), n, "", prompt=line))
    if not rows:
        raise InputError(f"{path}: no prompts in it")
    seen: dict[str, int] = {}
    for r in rows:
        r.id = r.id or str(r.index + 1)
        if r.id in seen and r.error is None:
            r.error = f"duplicate id {r.id!r}: line {seen[r.id]} already uses it"
        seen.setdefault(r.id, r.line)
    return rows


def _jsonl(text: str) -> list[Row]:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = Row(len(rows), n, "")
        rows.append(row)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            row.prompt, row.error = line, f"invalid JSON ({e.msg} at column {e.colno})"
            continue
        if not isinstance(obj, dict):
            row.prompt, row.error = line, f"expected a JSON object, got {type(obj).__name__}"
            continue
        if obj.get("id") is not None:
            row.id = obj["id"] if isinstance(obj["id"], str) else json.dumps(obj["id"])
        row.error = _fill(row, obj)
    return rows


def _fill(row: Row, obj: dict) -> str | None:
    """Copy a JSON object's fields into ``row``; the first problem as text, else None."""
    unknown = sorted(set(obj) - set(ROW_KEYS) - set(PARAMS))
    row.prompt, row.messages = obj.get("prompt"), obj.get("messages")
    row.metadata, row.category = obj.get("metadata"), obj.get("category")
    if unknown:
        return f"unknown field {unknown[0]!r}; use {', '.join(ROW_KEYS)} or a parameter ({', '.join(PARAMS)}); put anything else under \"metadata\""
    if (row.prompt is None) == (row.messages is None):
        return "needs exactly one of \"prompt\" (text) or \"messages\" (chat turns)"
    if row.prompt is not None and not isinstance(row.prompt, str):
        return f"\"prompt\" must be text, not {type(row.prompt).__name__}"
    if row.messages is not None and not _valid_messages(row.messages):
        return "\"messages\" must be a non-empty list of {\"role\": text, \"content\": text}"
    params = obj.get("params") or {}
    if not isinstance(params, dict):
        return "\"params\" must be an object of generation parameters"
    row.params = {**{k: obj[k] for k in PARAMS if k in obj}, **params}
    if row.category is not None and not isinstance(row.category, str):
        return "\"category\" must be text"
    return None


def _valid_messages(messages) -> bool:
    return (
        isinstance(messages, list) and bool(messages)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)
    )  # fmt: skip


def _csv(text: str, path: Path) -> list[Row]:
    reader = csv.DictReader(io.StringIO(text))
    if not reader.fieldnames or "prompt" not in reader.fieldnames:
        raise InputError(f"{path}: a CSV file needs a header with a 'prompt' column (found: {reader.fieldnames})")
    rows = []
    for record in reader:
        line = reader.line_num
        extra = {k: v for k, v in record.items() if k not in ("id", "prompt", "category") and k is not None}
        row = Row(len(rows), line, record.get("id") or "", prompt=record.get("prompt"),
                  metadata=extra or None, category=record.get("category") or None)  # fmt: skip
        if not (row.prompt or "").strip():
            row.error = "empty prompt"
        rows.append(row)
    return rows


# -- checks and ids ------------------------------------------------------------------------
def check_params(params: dict, *, messages: bool = False) -> None:
    """RequestError naming the first bad generation parameter."""
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise RequestError(unknown[0], f"unknown parameter; known: {', '.join(PARAMS)}")
    gen = {**params, "chat": False} if messages else params
    GenerationRequest(prompt="x", **gen).validate()


def check_rows(rows: list[Row], job_params: dict) -> None:
    """Set ``error`` on each row whose merged parameters are bad (context length is the
    worker's check: it needs the tokenizer)."""
    for r in rows:
        if r.error is None:
            try:
                check_params({**job_params, **r.params}, messages=r.messages is not None)
            except RequestError as e:
                r.error = str(e)


def job_id_for(path: Path, pair: str, params: dict) -> str:
    """Same file content, pair and parameters -> same job: running it again resumes it."""
    h = hashlib.sha256(Path(path).read_bytes())
    h.update(json.dumps({"pair": pair, "params": params}, sort_keys=True).encode())
    return h.hexdigest()[:16]


def request_id(job_id: str, row: Row) -> str:
    return f"{job_id}-{row.index + 1}"


def to_request(job_id: str, row: Row, job_params: dict) -> dict:
    """The ``store.create_job`` item for ``row``."""
    params = {**job_params, **row.params, "_row": row.index, "_id": row.id}
    if row.metadata is not None:
        params["_metadata"] = row.metadata
    if row.error is not None:
        params["_input_error"] = f"line {row.line}: {row.error}"
    prompt = row.prompt if isinstance(row.prompt, str) or row.prompt is None else json.dumps(row.prompt)
    if prompt is None and row.messages is None:  # a bad row still needs something to show
        prompt = ""
    return {
        "id": request_id(job_id, row), "messages": row.messages, "params": params,
        "prompt": prompt,
        "category": row.category if isinstance(row.category, str) else None,
    }  # fmt: skip


def generation_params(params: dict | None) -> dict:
    """The ``GenerationRequest`` fields of a stored row's params."""
    return {k: v for k, v in (params or {}).items() if not k.startswith("_")}
