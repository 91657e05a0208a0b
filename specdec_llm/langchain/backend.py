"""The one interface both adapters call, and what a call carries to it.

A ``Backend`` runs a resolved ``Call``: ``generate(items, call)`` returns one result per item
(plain dicts: ``text``, ``token_ids``, ``finish_reason``, ``stats``, ``request_id``,
``job_id``), or in its place the error of that item alone (``PROMPT_ERRORS``: a prompt over
the context, one the worker failed), so one bad prompt never fails the others; an error of
the whole call (its timeout, the broker, the pair, the store) is raised.
``stream(item, call, cancel)`` yields ``("text", delta)``... then ``("result", result)``. Two implementations: ``local.LocalBackend`` (the engine in this
process) and ``remote.RemoteBackend`` (rows in the store, messages to the worker pool).
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from specdec_llm.engine import RequestError
from specdec_llm.errors import SpecDecError


class GenerationTimeout(SpecDecError, TimeoutError):
    """A call not finished within its ``timeout``."""


class CallAbandoned(GenerationTimeout):
    """The caller stopped waiting (an async call's task cancelled): the call ends as at its
    deadline, its rows cancelled."""


class BrokerUnavailable(SpecDecError, ConnectionError):
    """Remote mode: the broker cannot be reached (the call's rows are marked failed)."""


class GenerationFailed(SpecDecError, RuntimeError):
    """The worker failed the row (e.g. a prompt longer than the context)."""


# the errors of one prompt alone: a call's other prompts still run
PROMPT_ERRORS = (RequestError, GenerationFailed)
POLL_S = 0.25  # a waiting call looks at its deadline and its caller this often


@dataclass
class Item:
    """One prompt: text, or chat turns (``[{"role", "content"}]``, an assistant turn's
    ``tool_calls``, ``tool`` turns), with the tools the template renders and a prefill
    (the start of the answer, after the generation prompt)."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prefill: str = ""

    def check(self) -> None:
        """RequestError before any work: an empty prompt or conversation, text no store keeps."""
        from specdec_llm.checks import check_messages, check_text

        if self.prompt is not None:
            if not isinstance(self.prompt, str) or not self.prompt.strip():
                raise RequestError("prompt", "is empty; pass some text")
            check_text(self.prompt, "prompt")  # unpaired surrogates, NUL: RequestError, as ChatSpecDec
        elif not self.messages:
            raise RequestError("messages", "is empty; pass at least one message")
        else:
            check_messages(self.messages)
            for i, m in enumerate(self.messages):
                for text in _strings(m.get("tool_calls")):
                    check_text(text, f"messages[{i}].tool_calls")
            for text in _strings(self.tools):
                check_text(text, "tools")

    def render_params(self) -> dict[str, Any]:
        """What the chat template needs besides the turns, as a row's bookkeeping params
        (``client.rows.build_request`` reads them, in a worker or here)."""
        out: dict[str, Any] = {}
        if self.tools:
            out["_tools"] = self.tools
        if self.prefill:
            out["_prefill"] = self.prefill
        return out


def _strings(value: Any) -> Iterator[str]:
    """Every text in a JSON value (keys too)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


@dataclass
class Call:
    """One call's settings, resolved from the model's fields and the call's arguments."""

    pair: str
    backend: str  # "remote" | "local"
    gen: dict[str, Any]  # GenerationRequest fields
    job_name: str
    job_metadata: dict[str, Any] | None
    category: str | None
    timeout: float | None
    record: bool  # local mode: record in the store (remote always does)
    max_retries: int  # remote mode: submissions retried after a broker fault
    started: float
    abandoned: threading.Event = field(default_factory=threading.Event)  # set: the caller went away

    @property
    def deadline(self) -> float | None:
        return None if self.timeout is None else self.started + self.timeout

    def remaining(self) -> float | None:
        deadline = self.deadline
        if self.abandoned.is_set():
            return 0.0
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def expired(self) -> bool:
        deadline = self.deadline
        return self.abandoned.is_set() or (deadline is not None and time.monotonic() > deadline)

    def poll(self) -> float:
        """How long one wait may block before looking at the deadline and the caller again."""
        remaining = self.remaining()
        return POLL_S if remaining is None else max(0.01, min(POLL_S, remaining))

    @property
    def job_id(self) -> str:
        return job_id(self.job_name, self.pair)

    def rows(self, items: list[Item], *, stream: bool = False) -> list[dict[str, Any]]:
        """One store request row per item, with a fresh id (both backends)."""
        now = time.time_ns() // 1000
        rows = []
        for i, item in enumerate(items):
            params = {**self.gen, **item.render_params(), "_row": now + i, "_source": "langchain"}
            if self.job_metadata is not None:
                params["_metadata"] = self.job_metadata
            if stream:
                params["_stream"] = True
            rows.append(
                {
                    "id": str(uuid.uuid4()),
                    "prompt": item.prompt,
                    "messages": item.messages,
                    "params": params,
                    "category": self.category,
                }
            )
        return rows

    def save(self, rows: list[dict[str, Any]]) -> None:
        """The rows, under the call's store job."""
        from specdec_llm import store

        store.create_job(rows, name=self.job_name, pair=self.pair, params={"source": "langchain"}, job_id=self.job_id)

    def ending(self) -> str:
        """Why the rows of a call that ended early are cancelled."""
        return "cancelled: " + (
            "the caller stopped waiting" if self.abandoned.is_set() else "the LangChain call timed out"
        )

    def timeout_error(self, what: str) -> GenerationTimeout:
        if self.abandoned.is_set():
            return CallAbandoned(f"{what} cancelled: the caller stopped waiting for it")
        return GenerationTimeout(
            f"{what} not finished within timeout={self.timeout} s ({self.backend} mode, pair {self.pair}); "
            + (
                "is a worker for this pair running (specdec-llm worker --pair "
                f"{self.pair})? Raise `timeout` for long generations"
                if self.backend == "remote"
                else "raise `timeout` or lower max_new_tokens"
            )
        )


def job_id(job_name: str, pair: str) -> str:
    """The store job of LangChain calls named ``job_name`` for ``pair`` (one stable id, so
    reports and ``specdec-llm status/results`` see each job name's traffic together)."""
    return "lc-" + hashlib.sha256(f"{job_name}\0{pair}".encode()).hexdigest()[:16]


def clean(text: str) -> str:
    """What the store keeps (a NUL cannot be stored in PostgreSQL text), in both modes."""
    return text.replace("\x00", "\ufffd")


def mark(request_id: str, status: str, error: str) -> None:
    """Best effort: the row's end (the error itself is what the caller needs)."""
    from specdec_llm import store

    try:
        store.mark_request(request_id, status, error=error)
    except Exception:  # noqa: BLE001
        pass


class Backend(Protocol):
    def generate(self, items: list[Item], call: Call) -> list[dict[str, Any] | Exception]: ...

    def stream(self, item: Item, call: Call, cancel: threading.Event) -> Iterator[tuple[str, Any]]: ...
