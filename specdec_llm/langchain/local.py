"""Local mode: the engine in this process (notebooks, tests), no broker, no Celery.

The pair comes from the project's one cache of loaded pairs (``specdec_llm.loaded``) and
its ``BatchServer`` runs every request, as in a worker; the request is built from the row
by the client's own ``build_request`` (chat messages through the same chat template), so
greedy results equal remote mode's. With ``record`` the rows, outputs and telemetry are
written to the store too, under the call's job.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from specdec_llm import store
from specdec_llm.engine import RequestError

from .backend import PROMPT_ERRORS, Call, Item, mark


class LocalBackend:
    def generate(self, items: list[Item], call: Call) -> list[dict[str, Any] | Exception]:
        """A result per item, or the error of that item alone (its row failed); an error of
        the whole call (the deadline, the pair) is raised and the rows not run are cancelled."""
        rows = self._rows(items, call)
        out: list[dict[str, Any] | Exception] = []
        try:
            for row in rows:
                try:
                    out.append(self._finish(row, call, *self._submit(row, call)))
                except PROMPT_ERRORS as e:  # this prompt alone (over the context...): the others run
                    out.append(e)
        except BaseException:
            for row in rows[len(out) + 1 :] if call.record else ():  # the rest of the batch will not run
                mark(row["id"], "cancelled", "cancelled: an earlier prompt of the call failed")
            raise
        return out

    def stream(self, item: Item, call: Call, cancel: threading.Event) -> Iterator[tuple[str, Any]]:
        """The server's thread calls back with text; this generator hands it over."""
        [row] = self._rows([item], call)
        events: queue.Queue[str | None] = queue.Queue()
        pair, fut = self._submit(row, call, on_text=events.put)
        fut.add_done_callback(lambda _: events.put(None))
        finished = False
        try:
            while True:
                try:
                    text = events.get(timeout=call.remaining())
                except queue.Empty:  # past the call's deadline: _finish says so
                    break
                if text is None:
                    break
                yield "text", text
                if cancel.is_set():
                    return
            finished = True
            yield "result", self._finish(row, call, pair, fut)
        finally:
            if not finished:  # a consumer that stops early stops the generation at its next step
                pair.server.cancel(fut)
                if call.record:
                    mark(row["id"], "cancelled", "cancelled: the stream's consumer stopped reading")

    # -------------------------------------------------------------------------------------------
    def _rows(self, items: list[Item], call: Call) -> list[dict[str, Any]]:
        rows = call.rows(items)
        if call.record:
            call.save(rows)
        return rows

    def _submit(
        self, row: dict[str, Any], call: Call, on_text: Callable[[str], None] | None = None
    ) -> tuple[Any, Future[Any]]:
        """(the loaded pair, the Future of the row's request on its server); a row that
        cannot start is failed and the error raised."""
        from specdec_llm import loaded
        from specdec_llm.client.rows import build_request

        try:
            pair = loaded.get(call.pair)
            request = build_request(row, pair.tokenizer)  # its params: call.gen and bookkeeping
            return pair, pair.server.submit(request, on_text=on_text, deadline=call.deadline)
        except BaseException as e:
            self._failed(row, call, e)
            raise

    def _finish(self, row: dict[str, Any], call: Call, pair: Any, fut: Future[Any]) -> dict[str, Any]:
        """The Future's result, recorded; or the row failed (timed out...) and the error raised."""
        rid = row["id"]
        try:
            while True:  # (the caller may go away: looked at between waits)
                try:
                    res = fut.result(timeout=call.poll())
                    break
                except TimeoutError:
                    if call.expired():
                        raise
            # (a forced call or a structured answer out of tokens is returned as it is: LangChain's
            # parsers report it, and include_raw keeps the reply; a job's row fails instead)
            result: dict[str, Any] = res.to_dict()
        except TimeoutError:  # still waiting for the server, or dropped by it at the deadline
            pair.server.cancel(fut)
            error = call.timeout_error(f"request {rid}")
            if call.record:
                mark(rid, "cancelled", call.ending())
            raise error from None
        except BaseException as e:
            self._failed(row, call, e)
            raise
        result.update(request_id=rid, status="ok", job_id=call.job_id)
        if call.record:
            spec = pair.spec
            stored = {k: result[k] for k in ("text", "token_ids", "finish_reason", "stats")}
            store.record_result(
                rid,
                stored,
                worker=store.worker_info(spec.device),
                device=spec.device,
                queue_wait_s=0.0,
                pair=call.pair,
                job_id=call.job_id,
                price_per_hour=store.price_for(None, spec.device),
                dtype=spec.dtype,
                category=call.category,
            )
        return result

    def _failed(self, row: dict[str, Any], call: Call, e: BaseException) -> None:
        if call.record:
            mark(row["id"], "failed", str(e) if isinstance(e, RequestError) else f"{type(e).__name__}: {e}")
