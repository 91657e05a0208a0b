"""LangChain integration: ``SpecDecLLM`` (an ``LLM``) and ``ChatSpecDec`` (a chat model).

Both are thin adapters over what already exists; there is no second decode path.

- **remote** (the default when ``SPECDEC_BROKER_URL`` is set): a call persists its prompts
  as request rows of a store job (``store.create_job``) and enqueues them all in one
  submission on the pair's queue (``workers.client.enqueue(..., keep_results=True)``); the
  Celery workers generate and record them, and the call waits on the task results.
  ``.stream`` marks its row ``"_stream": true``: the worker publishes accepted text as it
  is generated (Redis stream, or files with the embedded broker) and the call yields it
  from there (``workers.client.follow_stream``), not replayed at the end.
- **local** (the default otherwise: notebooks, tests): the pair is loaded once in this
  process and ``SpeculativeDecoder.generate`` runs here, on the request built by the
  worker's own ``build_request`` (chat messages through the same chat template). Results
  are recorded in the store too (``record=True``), so both modes show up in reports.

Greedy results are identical in both modes (same engine, same request). Every call's rows
belong to the store job named ``job_name`` for its pair (a stable id), carrying
``job_metadata`` and ``category``, so ``specdec-llm report --group-by job`` shows
LangChain traffic per job.

Per prompt, ``generation_info`` holds finish_reason, prompt/output tokens, acceptance
rate, mean accepted length, tokens/s, time to first token, wall time, the speedup over
target-only decoding with its counterfactual seconds (``baseline_s``) and basis
(``speedup_basis``: each output token at the target-only step cost the decoding process
measured at the same batch size), request and job ids; ``llm_output`` holds ``token_usage`` and ``model_name``. Streamed chunks carry text
only; the last chunk (empty text) carries all of those fields, so LangChain's chunk
addition (which sums integers and refuses to merge differing floats) gives the totals.

Errors are raised, never waited out: ``RequestError`` (a ``ValueError``: bad parameters,
unknown pair), ``GenerationTimeout`` (``timeout`` seconds for the whole call; queued rows
are cancelled), ``BrokerUnavailable`` (the rows are marked failed) and
``GenerationFailed`` (the worker failed the row, e.g. a prompt longer than the context).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, BaseLLM, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import (
    ChatGeneration,
    ChatGenerationChunk,
    ChatResult,
    Generation,
    GenerationChunk,
    LLMResult,
)
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from .checks import check_seed
from .engine import SPEEDUP_BASIS, GenerationRequest, RequestError
from .settings import get_settings

__all__ = [
    "BrokerUnavailable", "ChatSpecDec", "GenerationFailed", "GenerationTimeout", "RequestError",
    "SpecDecError", "SpecDecLLM", "job_id", "to_turns",
]  # fmt: skip

PROVIDER = "specdec"
# generation_info keys, from the result and its stats
INFO_FIELDS = ("prompt_tokens", "output_tokens", "draft_tokens_proposed", "draft_tokens_accepted",
               "acceptance_rate", "mean_accepted_length", "tokens_per_s", "time_to_first_token_s",
               "wall_time_s", "baseline_s", "drafter", "drafter_tokens")  # fmt: skip
CALL_OPTIONS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "k", "drafter", "chat", "decoding", "timeout",
                "job_name", "job_metadata", "category")  # fmt: skip


class SpecDecError(RuntimeError):
    """A generation that could not be done; the message says why and what to do."""


class GenerationTimeout(SpecDecError, TimeoutError):
    pass


class BrokerUnavailable(SpecDecError, ConnectionError):
    pass


class GenerationFailed(SpecDecError):
    pass


class _Cancelled(BaseException):
    """Raised inside a local generation whose consumer went away."""


# -- one call, resolved ------------------------------------------------------------------------
@dataclass
class _Item:
    prompt: str | None = None
    messages: list[dict] | None = None


@dataclass
class _Call:
    pair: str
    backend: str  # "remote" | "local"
    gen: dict  # GenerationRequest fields
    job_name: str
    job_metadata: dict | None
    category: str | None
    timeout: float | None
    record: bool
    started: float

    @property
    def deadline(self) -> float | None:
        return None if self.timeout is None else self.started + self.timeout

    def remaining(self) -> float | None:
        return None if self.timeout is None else max(0.0, self.deadline - time.monotonic())

    def expired(self) -> bool:
        return self.timeout is not None and time.monotonic() > self.deadline

    @property
    def job_id(self) -> str:
        return job_id(self.job_name, self.pair)

    def row_params(self, index: int, stream: bool = False) -> dict:
        params = {**self.gen, "_row": time.time_ns() // 1000 + index, "_source": "langchain"}
        if self.job_metadata is not None:
            params["_metadata"] = self.job_metadata
        if stream:
            params["_stream"] = True
        return params


def job_id(job_name: str, pair: str) -> str:
    """The store job of LangChain calls named ``job_name`` for ``pair`` (one stable id, so
    reports and ``specdec-llm status/results`` see each job name's traffic together)."""
    return "lc-" + hashlib.sha256(f"{job_name}\0{pair}".encode()).hexdigest()[:16]


def _timeout_error(call: _Call, what: str) -> GenerationTimeout:
    return GenerationTimeout(
        f"{what} not finished within timeout={call.timeout} s ({call.backend} mode, pair {call.pair}); "
        + ("is a worker for this pair running (specdec-llm worker --pair "
           f"{call.pair})? Raise `timeout` for long generations" if call.backend == "remote"
           else "raise `timeout` or lower max_new_tokens")
    )  # fmt: skip


# -- the local backend: one loaded pair per process and pair -----------------------------------
@dataclass
class _Loaded:
    pair: object  # specdec_llm.pairs.Pair
    decoder: object  # SpeculativeDecoder
    lock: threading.Lock


_loaded: dict[tuple, _Loaded] = {}
_load_lock = threading.Lock()


def _local_pair(name: str) -> _Loaded:
    from .pairs import get_spec, load_pair

    spec = get_spec(name)
    key = (spec.name, spec.target, spec.draft, spec.dtype, spec.device, spec.k)
    with _load_lock:
        if key not in _loaded:
            threads = get_settings().threads
            if threads:
                import torch

                torch.set_num_threads(threads)
            pair = load_pair(spec)
            _loaded[key] = _Loaded(pair, pair.decoder(), threading.Lock())
        return _loaded[key]


def _price(device: str) -> float | None:
    from .store.reports import price_for

    return price_for(get_settings().price_per_hour, device)


# -- the shared part of both models -----------------------------------------------------------------
class _SpecDecBase(BaseModel):
    """Fields and plumbing shared by ``SpecDecLLM`` and ``ChatSpecDec``."""

    pair: str = Field(default_factory=lambda: get_settings().default_pair)
    """Pair name from the registry (``specdec-llm pairs list``); ``model=`` also sets it."""
    backend: Literal["auto", "remote", "local"] = "auto"
    """remote: the Celery pool; local: this process; auto: remote iff SPECDEC_BROKER_URL is set."""
    max_new_tokens: int = 128
    """Tokens to generate at most (``max_tokens=`` also sets it)."""
    temperature: float = 0.0
    """0 = greedy (token-identical to the target's own greedy decoding)."""
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    k: int | Literal["auto"] = "auto"
    """Draft length: an integer (0 = target only) or "auto" (chosen per iteration)."""
    drafter: str = "auto"
    """Who drafts: "auto" (the pair's drafters, chosen per row and iteration) or one of them
    ("lookup", "suffix", "model"; ``specdec-llm pairs show PAIR`` lists a pair's)."""
    stop: list[str] | None = None
    """Stop strings; a call's ``stop`` replaces these. Text is cut before the first one."""
    chat: bool = False
    """LLM: wrap the prompt as a user turn with the target's chat template."""
    decoding: Literal["speculative", "baseline"] = "speculative"
    """baseline = target-only decoding (for comparisons)."""
    timeout: float | None = 600.0
    """Seconds for a whole call (all its prompts); None waits forever."""
    job_name: str = "langchain"
    """Store job (per pair) the requests belong to: reports group by it."""
    job_metadata: dict[str, Any] | None = None
    """JSON metadata stored with each request (``results`` exports it)."""
    category: str | None = None
    """A label reports can group by (``--group-by category``)."""
    record: bool = True
    """Local mode: record requests, outputs and telemetry in the store (remote always does)."""
    streaming: bool = False
    """invoke/generate stream internally, so callbacks get each token (one prompt at a time)."""
    max_retries: int = 0
    """Remote mode: submissions retried after a broker fault before BrokerUnavailable."""
    api_key: SecretStr | None = None
    """Not used (the pool needs no key); accepted as one of LangChain's standard parameters."""

    @model_validator(mode="before")
    @classmethod
    def _standard_names(cls, values: Any) -> Any:
        """LangChain's standard names: ``model`` for ``pair``, ``max_tokens`` for
        ``max_new_tokens`` (the project's own name wins when both are given)."""
        if isinstance(values, dict):
            values = dict(values)
            for alias, name in (("model", "pair"), ("max_tokens", "max_new_tokens")):
                if alias in values:
                    value = values.pop(alias)
                    values.setdefault(name, value)
        return values

    # -- LangChain plumbing ---------------------------------------------------------------------
    def _spec_fields(self) -> dict:
        try:
            from .pairs import get_spec

            spec = get_spec(self.pair)
            return {"target": spec.target, "draft": spec.draft, "dtype": spec.dtype, "device": spec.device}
        except Exception:  # noqa: BLE001 - identifying params never fail; a call says what is wrong
            return {"target": None, "draft": None}

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "pair": self.pair, **self._spec_fields(), "backend": self.effective_backend(),
            "max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "seed": self.seed, "k": self.k, "drafter": self.drafter, "decoding": self.decoding,
            "chat": self.chat,
        }  # fmt: skip

    def _ls(self, model_type: str, stop: list[str] | None, kwargs: dict) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider=PROVIDER, ls_model_type=model_type,
            ls_model_name=kwargs.get("model") or kwargs.get("pair") or self.pair,
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_new_tokens", kwargs.get("max_tokens", self.max_new_tokens)),
        )  # fmt: skip
        stop = stop if stop is not None else self.stop
        if stop:
            params["ls_stop"] = stop
        return params

    def effective_backend(self) -> str:
        """"remote" or "local": what this model uses now (``backend``, or for "auto" the settings)."""
        if self.backend != "auto":
            return self.backend
        return "remote" if get_settings().broker_url else "local"

    def _resolve(self, stop: list[str] | None, kwargs: dict, *, messages: bool) -> _Call:
        """This call's settings: fields, overridden by the call's keyword arguments."""
        kwargs = dict(kwargs)
        kwargs.pop("stream", None)  # a chat model's stream flag: not a generation parameter
        model, pair = kwargs.pop("model", None), kwargs.pop("pair", None)
        pair = pair or model or self.pair  # a per-call pair (``model=`` is LangChain's name for it)
        if "max_tokens" in kwargs:  # LangChain's usual name
            kwargs.setdefault("max_new_tokens", kwargs.pop("max_tokens"))
        unknown = sorted(set(kwargs) - set(CALL_OPTIONS))
        if unknown:
            raise RequestError(unknown[0], f"unknown option; use one of {', '.join(CALL_OPTIONS)}")
        opt = {name: kwargs.get(name, getattr(self, name)) for name in CALL_OPTIONS}
        stop = list(stop) if stop is not None else list(self.stop or [])
        gen = dict(max_new_tokens=opt["max_new_tokens"], temperature=opt["temperature"], top_p=opt["top_p"],
                   top_k=opt["top_k"], seed=opt["seed"], k=opt["k"], drafter=opt["drafter"], stop=stop,
                   chat=bool(opt["chat"]) and not messages, mode=opt["decoding"])  # fmt: skip
        GenerationRequest(prompt="x", **gen).validate()  # RequestError naming the bad field
        check_seed(gen["seed"])
        if opt["job_metadata"] is not None:
            try:
                json.dumps(opt["job_metadata"])
            except (TypeError, ValueError) as e:
                raise RequestError("job_metadata", f"must be JSON-serialisable ({e})") from None
        timeout = opt["timeout"]
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise RequestError("timeout", f"{timeout!r}: use a number of seconds > 0, or None")
        from .pairs import get_spec

        get_spec(pair)  # unknown pair: RequestError now, not in a worker
        return _Call(pair=pair, backend=self.effective_backend(), gen=gen, job_name=str(opt["job_name"]),
                     job_metadata=opt["job_metadata"], category=opt["category"], timeout=timeout,
                     record=self.record, started=time.monotonic())  # fmt: skip

    # -- running a call: a list of results (plain dicts) --------------------------------------------
    def _run(self, items: list[_Item], call: _Call) -> list[dict]:
        for item in items:
            _check_item(item)
        results = self._remote(items, call) if call.backend == "remote" else self._local(items, call)
        return [{**r, "text": _clean(r["text"]), "pair": call.pair} for r in results]

    def _events(self, item: _Item, call: _Call, cancel: threading.Event) -> Iterator[tuple[str, Any]]:
        """("text", delta)... then ("result", result): one prompt, streamed."""
        _check_item(item)
        events = self._remote_events(item, call) if call.backend == "remote" else self._local_events(item, call, cancel)
        for kind, value in events:
            yield kind, (_clean(value) if kind == "text" else {**value, "text": _clean(value["text"]), "pair": call.pair})

    # -- remote ---------------------------------------------------------------------------------------
    def _submit(self, items: list[_Item], call: _Call, *, stream: bool = False) -> list[tuple[str, Any]]:
        """Persist every item as a request row of the call's job, then enqueue them all at
        once; returns (request id, AsyncResult) per item."""
        from kombu.exceptions import OperationalError
        from redis.exceptions import RedisError

        from workers import client

        from . import store

        rows = [{"id": str(uuid.uuid4()), "prompt": it.prompt, "messages": it.messages,
                 "params": call.row_params(i, stream), "category": call.category}
                for i, it in enumerate(items)]  # fmt: skip
        ids = [r["id"] for r in rows]
        store.create_job(rows, name=call.job_name, pair=call.pair, params={"source": "langchain"}, job_id=call.job_id)
        for attempt in range(self.max_retries + 1):
            try:
                client.check_broker()  # fails in well under a second; a publish to a dead Redis takes ~20 s
                return list(zip(ids, client.enqueue(ids, call.pair, keep_results=True)))
            except (OperationalError, ConnectionError, OSError, RedisError, RuntimeError) as e:
                fault = e
                if attempt < self.max_retries and not call.expired():
                    time.sleep(min(0.5 * 2**attempt, 5.0))
        from workers.app import broker_display

        error = f"the broker at {broker_display()} is unreachable ({fault})"
        for rid in ids:
            store.mark_request(rid, "failed", error=error)
        raise BrokerUnavailable(f"{error}; check SPECDEC_BROKER_URL and that the broker is running")

    def _wait(self, rid: str, result, call: _Call) -> dict:
        from celery.exceptions import TimeoutError as CeleryTimeout

        from . import store

        while True:  # the task's result; or the row finished by another delivery (its first worker was lost)
            remaining = call.remaining()
            try:
                out = result.get(timeout=5.0 if remaining is None else max(0.01, min(5.0, remaining)),
                                 propagate=False, interval=0.05)  # fmt: skip
                break
            except CeleryTimeout:
                row = store.get_request(rid)
                if row and row["status"] in ("ok", "failed", "cancelled"):
                    return self._from_store(rid, call)
                if call.expired():
                    raise _timeout_error(call, f"request {rid}") from None
        if result.failed():
            raise GenerationFailed(f"request {rid} failed in the worker: {out!r}")
        try:
            result.forget()  # read once: no need to keep it in the result backend
        except Exception:  # noqa: BLE001
            pass
        status = out.get("status") if isinstance(out, dict) else None
        if status == "ok" and "stats" in out:
            return {**out, "job_id": call.job_id}
        if status in ("forwarded", "ok"):  # another worker has it, or a redelivery: read the store
            return self._from_store(rid, call)
        why = (out.get("error") or status) if isinstance(out, dict) else out
        raise GenerationFailed(f"request {rid} failed: {why}")

    def _from_store(self, rid: str, call: _Call) -> dict:
        from sqlalchemy import select

        from . import store
        from .store.models import STATS_FIELDS, Telemetry

        while True:
            row = store.get_request(rid)
            if row and row["status"] == "ok" and row["output"]:
                with store.session_scope() as s:
                    tel = s.execute(select(Telemetry).where(Telemetry.request_id == rid)).scalar_one_or_none()
                    stats = {f: getattr(tel, f) for f in STATS_FIELDS} if tel is not None else {}
                out = row["output"]
                return {"request_id": rid, "status": "ok", "text": out["text"], "token_ids": out["token_ids"],
                        "finish_reason": out["finish_reason"], "stats": stats, "job_id": call.job_id}  # fmt: skip
            if row and row["status"] in ("failed", "cancelled"):
                raise GenerationFailed(f"request {rid} {row['status']}: {row['error']}")
            if call.expired():
                raise _timeout_error(call, f"request {rid}")
            time.sleep(0.1)

    def _cancel_queued(self, ids: list[str]) -> None:
        from . import store

        for rid in ids:
            try:
                row = store.get_request(rid)
                if row and row["status"] == "queued":
                    store.mark_request(rid, "cancelled", error="cancelled: the LangChain call timed out")
            except Exception:  # noqa: BLE001 - best effort
                pass

    def _remote(self, items: list[_Item], call: _Call) -> list[dict]:
        sent = self._submit(items, call)
        out = []
        try:
            for rid, result in sent:
                out.append(self._wait(rid, result, call))
        except GenerationTimeout:
            self._cancel_queued([rid for rid, _ in sent])
            raise
        return out

    def _remote_events(self, item: _Item, call: _Call) -> Iterator[tuple[str, Any]]:
        from workers import client

        [(rid, result)] = self._submit([item], call, stream=True)
        streamed = []
        try:
            for delta in client.follow_stream(rid, result.ready, timeout_s=call.remaining()):
                streamed.append(delta)
                yield "text", delta
        except TimeoutError:
            self._cancel_queued([rid])
            raise _timeout_error(call, f"request {rid}") from None
        final = self._wait(rid, result, call)
        sent = _clean("".join(streamed))
        if final["text"] != sent and final["text"].startswith(sent):  # a stream cut short: the rest
            yield "text", final["text"][len(sent) :]
        yield "result", final

    # -- local --------------------------------------------------------------------------------------
    def _local(self, items: list[_Item], call: _Call) -> list[dict]:
        rids = self._local_rows(items, call)
        out = []
        try:
            for item, rid in zip(items, rids):
                out.append(self._local_one(item, rid, call))
        except BaseException:
            for rid in rids[len(out) + 1 :] if call.record else ():  # the rest of the batch will not run
                self._local_mark(rid, "cancelled", "cancelled: an earlier prompt of the call failed")
            raise
        return out

    def _local_rows(self, items: list[_Item], call: _Call) -> list[str]:
        rids = [str(uuid.uuid4()) for _ in items]
        if call.record:
            from . import store

            store.create_job(
                [{"id": rid, "prompt": it.prompt, "messages": it.messages, "params": call.row_params(i),
                  "category": call.category} for i, (rid, it) in enumerate(zip(rids, items))],
                name=call.job_name, pair=call.pair, params={"source": "langchain"}, job_id=call.job_id,
            )  # fmt: skip
        return rids

    def _local_one(self, item: _Item, rid: str, call: _Call, on_text=None, cancel=None) -> dict:
        from workers.tasks import build_request  # the worker's own row -> request (chat template...)

        def text(delta: str) -> None:
            if cancel is not None and cancel.is_set():
                raise _Cancelled()
            if call.expired():
                raise _timeout_error(call, f"request {rid}")
            if on_text is not None:
                on_text(delta)

        try:
            loaded = _local_pair(call.pair)
            request = build_request({"prompt": item.prompt, "messages": item.messages, "params": call.gen},
                                    loaded.pair.tokenizer)  # fmt: skip
            remaining = call.remaining()
            if not loaded.lock.acquire(timeout=-1 if remaining is None else remaining):
                raise _timeout_error(call, f"request {rid} (waiting for the local model)")
            try:
                result = loaded.decoder.generate(request, on_text=text).to_dict()
            finally:
                loaded.lock.release()
        except _Cancelled:
            if call.record:
                self._local_mark(rid, "cancelled", "cancelled: the stream's consumer stopped reading")
            raise
        except BaseException as e:
            if call.record:
                self._local_mark(rid, "failed", str(e) if isinstance(e, RequestError) else f"{type(e).__name__}: {e}")
            raise
        result.update(request_id=rid, status="ok", job_id=call.job_id)
        if call.record:
            self._local_record(rid, result, call, loaded)
        return result

    def _local_mark(self, rid: str, status: str, error: str) -> None:
        from . import store

        try:
            store.mark_request(rid, status, error=error)
        except Exception:  # noqa: BLE001 - the error itself is what the caller needs
            pass

    def _local_record(self, rid: str, result: dict, call: _Call, loaded: _Loaded) -> None:
        from . import store

        spec = loaded.pair.spec
        stored = {k: result[k] for k in ("text", "token_ids", "finish_reason", "stats")}
        store.record_result(
            rid, stored, worker=store.worker_info(spec.device), device=spec.device, queue_wait_s=0.0, pair=call.pair,
            job_id=call.job_id, price_per_hour=_price(spec.device), dtype=spec.dtype, category=call.category,
        )  # fmt: skip

    def _local_events(self, item: _Item, call: _Call, cancel: threading.Event) -> Iterator[tuple[str, Any]]:
        """The engine calls back with text; a thread runs it and hands the deltas over."""
        [rid] = self._local_rows([item], call)
        events: queue.Queue = queue.Queue()

        def run() -> None:
            try:
                events.put(("result", self._local_one(item, rid, call, lambda t: events.put(("text", t)), cancel)))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                events.put(("error", e))

        ctx = contextvars.copy_context()
        threading.Thread(target=ctx.run, args=(run,), daemon=True, name=f"specdec-{rid[:8]}").start()
        try:
            while True:
                kind, value = events.get()
                if kind == "error":
                    raise value
                yield kind, value
                if kind == "result":
                    return
        finally:
            cancel.set()  # a consumer that stops early stops the generation at its next step


def _clean(text: str) -> str:
    """What the store keeps (a NUL cannot be stored in PostgreSQL text), in both modes."""
    return text.replace("\x00", "\ufffd")


def _check_item(item: _Item) -> None:
    from .checks import check_messages, check_text

    if item.prompt is not None:
        if not isinstance(item.prompt, str) or not item.prompt.strip():
            raise RequestError("prompt", "is empty; pass some text")
        check_text(item.prompt, "prompt")  # unpaired surrogates, NUL: RequestError, as ChatSpecDec
    elif not item.messages:
        raise RequestError("messages", "is empty; pass at least one message")
    else:
        check_messages(item.messages)


async def _aiter_in_thread(make: Callable[[threading.Event], Iterator]) -> AsyncIterator:
    """Run a blocking iterator in a thread and yield its items here: the event loop never
    waits on a worker, a socket or the model."""
    loop = asyncio.get_running_loop()
    items: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()

    def post(kind: str, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(items.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening
            cancel.set()

    def pump() -> None:
        source = make(cancel)
        try:
            for item in source:
                if cancel.is_set():
                    break
                post("item", item)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            post("error", e)
        else:
            post("done", None)
        finally:
            source.close()  # a consumer that stopped early: the source cleans up now

    ctx = contextvars.copy_context()
    threading.Thread(target=ctx.run, args=(pump,), daemon=True, name="specdec-async").start()
    try:
        while True:
            kind, value = await items.get()
            if kind == "error":
                raise value
            if kind == "done":
                return
            yield value
    finally:
        cancel.set()


def _info(result: dict) -> dict:
    stats = result.get("stats") or {}
    info = {"finish_reason": result.get("finish_reason") or stats.get("finish_reason")}
    info.update({name: stats.get(name) for name in INFO_FIELDS})
    base, wall = stats.get("baseline_s"), stats.get("wall_time_s")
    speedup = base / wall if base and wall else None  # a row recorded before baseline_s existed has none
    info.update(speedup=speedup, speedup_basis=SPEEDUP_BASIS if speedup is not None else None)
    info.update(request_id=result.get("request_id"), job_id=result.get("job_id"), pair=result.get("pair"))
    return info


def _usage(results: list[dict]) -> dict:
    prompt = sum(int((r.get("stats") or {}).get("prompt_tokens") or 0) for r in results)
    output = sum(int((r.get("stats") or {}).get("output_tokens") or 0) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}


# -- the LLM ----------------------------------------------------------------------------------------
class SpecDecLLM(_SpecDecBase, BaseLLM):
    """A LangChain LLM over specdec-llm: speculative decoding on the Celery worker pool
    (remote) or in this process (local). ``batch`` sends all prompts in one submission.

    >>> llm = SpecDecLLM(pair="smollm2-135m", chat=True, max_new_tokens=64)
    >>> llm.invoke("What is the capital of France?")
    """

    model_config = ConfigDict(extra="forbid")  # a misspelt option fails, not ignored

    @property
    def _llm_type(self) -> str:
        return "specdec"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls("llm", stop, kwargs)

    def _result(self, results: list[dict]) -> LLMResult:
        return LLMResult(
            generations=[[Generation(text=r["text"], generation_info=_info(r))] for r in results],
            llm_output={"token_usage": _usage(results), "model_name": results[0]["pair"] if results else self.pair},
        )

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:  # fmt: skip
        if self.streaming and len(prompts) == 1:  # callbacks get every token
            final = None
            for chunk in self._stream(prompts[0], stop, run_manager, **kwargs):
                final = chunk if final is None else final + chunk
            info = final.generation_info or {}
            usage = {"prompt_tokens": info.get("prompt_tokens") or 0, "completion_tokens": info.get("output_tokens") or 0}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            return LLMResult(generations=[[Generation(text=final.text, generation_info=info)]],
                             llm_output={"token_usage": usage, "model_name": info.get("pair") or self.pair})  # fmt: skip
        call = self._resolve(stop, kwargs, messages=False)
        return self._result(self._run([_Item(prompt=p) for p in prompts], call))

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:  # fmt: skip
        call = self._resolve(stop, kwargs, messages=False)
        items = [_Item(prompt=p) for p in prompts]
        return self._result(await asyncio.to_thread(self._run, items, call))

    def _chunks(self, prompt: str, call: _Call, cancel: threading.Event) -> Iterator[GenerationChunk]:
        for kind, value in self._events(_Item(prompt=prompt), call, cancel):
            if kind == "text":
                yield GenerationChunk(text=value)
            else:  # the last chunk: no text, every figure (see the module's docstring)
                yield GenerationChunk(text="", generation_info=_info(value))

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:  # fmt: skip
        call = self._resolve(stop, kwargs, messages=False)
        cancel = threading.Event()
        try:
            for chunk in self._chunks(prompt, call, cancel):
                if run_manager and chunk.text:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            cancel.set()

    async def _astream(self, prompt: str, stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:  # fmt: skip
        call = self._resolve(stop, kwargs, messages=False)
        async for chunk in _aiter_in_thread(lambda cancel: self._chunks(prompt, call, cancel)):
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


# -- the chat model ------------------------------------------------------------------------------------
_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}


def to_turns(messages: list[BaseMessage]) -> list[dict]:
    """LangChain messages -> ``[{"role", "content"}]`` for the target's chat template
    (text only: an image or other non-text block is refused with a clear error)."""
    turns = []
    for m in messages:
        if isinstance(m, ChatMessage):
            role = m.role
        elif m.type in _ROLES:
            role = _ROLES[m.type]
        else:
            raise RequestError("messages", f"message type {m.type!r} is not supported; use system, human, ai or tool")
        content = m.content
        if isinstance(content, list):
            parts = []
            for block in content:
                if isinstance(block, str):
                    parts.append(block)
                elif isinstance(block, dict) and block.get("type") == "text":
                    parts.append(block.get("text", ""))
                else:
                    kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                    raise RequestError("messages", f"content of type {kind!r} is not supported: this model reads text only")
            content = "".join(parts)
        turns.append({"role": role, "content": content})
    return turns


class ChatSpecDec(_SpecDecBase, BaseChatModel):
    """The chat-model twin of ``SpecDecLLM``: messages go through the target tokenizer's chat
    template (in the worker, or here in local mode); ``usage_metadata`` on every answer and
    on the last streamed chunk. Text in, text out: no tool calling or structured output."""

    model_config = ConfigDict(extra="forbid")

    @property
    def _llm_type(self) -> str:
        return "specdec-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls("chat", stop, kwargs)

    def _message_fields(self, result: dict) -> dict:
        stats = result.get("stats") or {}
        prompt, output = int(stats.get("prompt_tokens") or 0), int(stats.get("output_tokens") or 0)
        return {
            "usage_metadata": UsageMetadata(input_tokens=prompt, output_tokens=output, total_tokens=prompt + output),
            "response_metadata": {"model_name": result["pair"], "model_provider": PROVIDER, **_info(result)},
        }

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:  # fmt: skip
        call = self._resolve(stop, kwargs, messages=True)
        [result] = self._run([_Item(messages=to_turns(messages))], call)
        return self._chat_result(result)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:  # fmt: skip
        call = self._resolve(stop, kwargs, messages=True)
        items = [_Item(messages=to_turns(messages))]
        [result] = await asyncio.to_thread(self._run, items, call)
        return self._chat_result(result)

    def _chat_result(self, result: dict) -> ChatResult:
        message = AIMessage(content=result["text"], **self._message_fields(result))
        return ChatResult(
            generations=[ChatGeneration(message=message, generation_info=_info(result))],
            llm_output={"token_usage": _usage([result]), "model_name": result["pair"]},
        )

    def _chunks(self, messages: list[BaseMessage], call: _Call, cancel) -> Iterator[ChatGenerationChunk]:
        for kind, value in self._events(_Item(messages=to_turns(messages)), call, cancel):
            if kind == "text":
                yield ChatGenerationChunk(message=AIMessageChunk(content=value))
            else:
                message = AIMessageChunk(content="", chunk_position="last", **self._message_fields(value))
                yield ChatGenerationChunk(message=message, generation_info=_info(value))

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:  # fmt: skip
        # (BaseChatModel.stream calls on_llm_new_token itself, for every chunk yielded here)
        call = self._resolve(stop, kwargs, messages=True)
        cancel = threading.Event()
        try:
            yield from self._chunks(messages, call, cancel)
        finally:
            cancel.set()

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:  # fmt: skip
        call = self._resolve(stop, kwargs, messages=True)
        async for chunk in _aiter_in_thread(lambda cancel: self._chunks(messages, call, cancel)):
            yield chunk

