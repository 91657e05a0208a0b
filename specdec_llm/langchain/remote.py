"""Remote mode: the Celery worker pool, through the job client (``specdec_llm.client``).

A call persists its prompts as request rows of its store job and enqueues them all in one
submission on the pair's queue (``client.enqueue(..., keep_results=True)``); the workers
generate and record them, and the call waits on the task results. A streamed row is marked
``"_stream": true``: the worker publishes accepted text as it is generated, and the call
yields it from there (``client.follow_stream``), not replayed at the end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from specdec_llm import client, store

from .backend import PROMPT_ERRORS, BrokerUnavailable, Call, GenerationFailed, GenerationTimeout, Item, clean

STORE_LOOK_S = 5.0  # a call waiting on a task's result looks at its row in the store this often


class RemoteBackend:
    def generate(self, items: list[Item], call: Call) -> list[dict[str, Any] | Exception]:
        """A result per item, or the error of that item alone (the worker failed its row);
        the call's timeout or an unreachable broker is raised for the whole call."""
        sent = self._submit(items, call)
        out: list[dict[str, Any] | Exception] = []
        try:
            for rid, result in sent:
                try:
                    out.append(self._wait(rid, result, call))
                except PROMPT_ERRORS as e:  # this prompt alone: the others' results still count
                    out.append(e)
        except GenerationTimeout:
            self._cancel([rid for rid, _ in sent], call.ending())
            raise
        except BaseException as e:  # (Ctrl-C, the store gone): no one will read these rows
            self._cancel([rid for rid, _ in sent], f"cancelled: the LangChain call ended ({type(e).__name__})")
            raise
        return out

    def stream(self, item: Item, call: Call, cancel: threading.Event | None = None) -> Iterator[tuple[str, Any]]:
        """The row's text as its worker publishes it. A consumer that stops reading (or a call
        past its deadline) cancels the row: its worker stops it at its next iteration."""
        [(rid, result)] = self._submit([item], call, stream=True)
        streamed, finished = [], False

        def stopped() -> bool:  # (an async consumer gone)
            return cancel is not None and cancel.is_set()

        try:
            for delta in client.follow_stream(rid, lambda: result.ready() or stopped(), timeout_s=call.remaining()):
                streamed.append(delta)
                yield "text", delta
                if stopped():
                    return
            if stopped():  # (gone before any text: the row is still queued, or had not started)
                return
            final = self._wait(rid, result, call)
            finished = True
        except TimeoutError:
            raise call.timeout_error(f"request {rid}") from None
        finally:
            if not finished:
                self._cancel([rid], "cancelled: the stream's consumer stopped reading, or the call timed out")
        sent = clean("".join(streamed))
        if final["text"] != sent and final["text"].startswith(sent):  # a stream cut short: the rest
            yield "text", final["text"][len(sent) :]
        yield "result", final

    # -------------------------------------------------------------------------------------------
    def _submit(self, items: list[Item], call: Call, *, stream: bool = False) -> list[tuple[str, Any]]:
        """Persist every item as a request row of the call's job, then enqueue them all at
        once; returns (request id, AsyncResult) per item."""
        from kombu.exceptions import OperationalError
        from redis.exceptions import RedisError

        rows = call.rows(items, stream=stream)
        ids = [r["id"] for r in rows]
        call.save(rows)
        for attempt in range(call.max_retries + 1):
            try:
                client.check_broker()  # fails in well under a second; a publish to a dead Redis takes ~20 s
                return list(zip(ids, client.enqueue(ids, call.pair, keep_results=True)))
            except (OperationalError, ConnectionError, OSError, RedisError, RuntimeError) as e:  # QueueError too
                fault = e
                if attempt < call.max_retries and not call.expired():
                    time.sleep(min(0.5 * 2**attempt, 5.0))
        error = (
            str(fault)
            if isinstance(fault, client.QueueError)
            else f"the broker at {client.broker_display()} is unreachable ({fault}); check SPECDEC_BROKER_URL "
            "and that the broker is running"
        )
        for rid in ids:
            store.mark_request(rid, "failed", error=error)
        raise BrokerUnavailable(error)

    def _wait(self, rid: str, result: Any, call: Call) -> dict[str, Any]:
        from celery.exceptions import TimeoutError as CeleryTimeout

        looked = time.monotonic()
        while True:  # the task's result; or the row finished by another delivery (its first worker was lost)
            try:
                out = result.get(timeout=call.poll(), propagate=False, interval=0.05)
                break
            except CeleryTimeout:
                if call.expired():
                    raise call.timeout_error(f"request {rid}") from None
                if time.monotonic() - looked < STORE_LOOK_S:
                    continue
                looked = time.monotonic()
                row = store.get_request(rid)
                if row and row["status"] in ("ok", "failed", "cancelled"):
                    return self._from_store(rid, call)
        if result.failed():
            raise GenerationFailed(f"request {rid} failed in the worker: {out!r}")
        try:
            result.forget()  # read once: no need to keep it in the result backend
        except Exception:  # noqa: BLE001
            pass
        status = out.get("status") if isinstance(out, dict) else None
        if status == "ok" and "stats" in out:
            return {**out, "job_id": call.job_id}
        if status in ("forwarded", "ok", "running here", "running elsewhere"):
            # another worker or task has it (a redelivery, a duplicate message): read the store
            return self._from_store(rid, call)
        why = (out.get("error") or status) if isinstance(out, dict) else out
        raise GenerationFailed(f"request {rid} failed: {why}")

    def _from_store(self, rid: str, call: Call) -> dict[str, Any]:
        while True:
            row = store.get_request(rid)
            if row and row["status"] == "ok" and row["output"]:
                out = row["output"]
                return {
                    "request_id": rid,
                    "status": "ok",
                    "text": out["text"],
                    "token_ids": out["token_ids"],
                    "finish_reason": out["finish_reason"],
                    "stats": store.get_stats(rid),
                    "job_id": call.job_id,
                }
            if row and row["status"] in ("failed", "cancelled"):
                raise GenerationFailed(f"request {rid} {row['status']}: {row['error']}")
            if call.expired():
                raise call.timeout_error(f"request {rid}")
            time.sleep(0.1)

    def _cancel(self, ids: list[str], reason: str) -> None:
        """Best effort: the rows of a call that will not read them stop (queued: now; running:
        at their worker's next iteration, ``client.cancel_request``)."""
        for rid in ids:
            try:
                client.cancel_request(rid, reason=reason)
            except Exception:  # noqa: BLE001 - the caller's error is what matters
                pass
