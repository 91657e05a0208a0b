"""What ``SpecDecLLM`` and ``ChatSpecDec`` share: their fields, the resolution of one call
(fields overridden by the call's arguments, checked before any work), the choice of the
backend, and the figures every answer carries (``info``, ``usage``).
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from dataclasses import fields
from typing import Any, Literal, TypeVar

from langchain_core.language_models import LangSmithParams
from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator

from specdec_llm.engine import SPEEDUP_BASIS, GenerationRequest, RequestError
from specdec_llm.settings import get_settings

from .backend import Backend, Call, Item, clean

PROVIDER = "specdec"
T = TypeVar("T")
# generation_info keys, from the result and its stats
INFO_FIELDS = (
    "prompt_tokens",
    "output_tokens",
    "draft_tokens_proposed",
    "draft_tokens_accepted",
    "acceptance_rate",
    "mean_accepted_length",
    "tokens_per_s",
    "time_to_first_token_s",
    "wall_time_s",
    "baseline_s",
    "drafter",
    "drafter_tokens",
)


def get_backend(name: str) -> Backend:
    """The implementation of ``name`` ("local" or "remote")."""
    if name == "remote":
        from .remote import RemoteBackend

        return RemoteBackend()
    from .local import LocalBackend

    return LocalBackend()


def check_generation(gen: dict[str, Any]) -> None:
    """``RequestError`` naming the first bad generation parameter in ``gen`` (the engine's
    names, any subset): ``GenerationRequest.validate``'s rules (the seed torch takes included).
    The LangChain field ``decoding`` is named as such, not as the engine's ``mode``."""
    try:
        GenerationRequest(prompt="x", **gen).validate()
    except RequestError as e:
        if e.field != "mode":
            raise
        raise RequestError("decoding", str(e).removeprefix("mode: ")) from None


# -- the shared part of both models -----------------------------------------------------------------
class SpecDecBase(BaseModel):
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

    def __init__(self, **kwargs: Any) -> None:
        """Generation parameters are checked here, by the engine's rules (``RequestError``
        naming the field and the fix), not at the first call; so is a value of the wrong
        type for one of them (pydantic's ``ValidationError`` otherwise)."""
        try:
            super().__init__(**kwargs)
        except ValidationError as e:
            bad = [err for err in e.errors() if err["loc"] and err["loc"][0] in GENERATION_FIELDS]
            if not bad:
                raise
            name, value = str(bad[0]["loc"][0]), bad[0].get("input")
            check_generation({GENERATION_FIELDS[name]: value})  # the engine's message, when its rules refuse it
            raise RequestError(name, f"{value!r}: {bad[0]['msg']}") from None
        self._check({name: getattr(self, name) for name in CALL_OPTIONS}, list(self.stop or []), messages=False)

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

    def get_token_ids(self, text: str) -> list[int]:
        """``text``'s token ids by the pair's own tokenizer, as its prompts are encoded
        (``get_num_tokens``, ``trim_messages``). LangChain's default is GPT-2's tokenizer, from
        the Hub: other counts, and a hang where the Hub cannot be reached."""
        return list(self.tokenizer()(text)["input_ids"])

    def tokenizer(self) -> Any:
        """The pair's tokenizer, with the chat template its prompts are rendered by. Local mode
        reads the loaded pair's; remote mode the target's tokenizer alone (the weights are the
        workers'), with the pair's ``chat_template`` where the model has none (as a load sets it)."""
        from specdec_llm.pairs import CHAT_TEMPLATES, get_spec, tokenizer_only

        if self.effective_backend() == "local":
            from specdec_llm import loaded

            return loaded.get(self.pair).tokenizer
        spec = get_spec(self.pair)
        tokenizer = tokenizer_only(spec.target, spec.trust_remote_code)
        if spec.chat_template and not tokenizer.chat_template:  # (a copy: the cached one serves other pairs)
            tokenizer = copy.copy(tokenizer)
            tokenizer.chat_template = CHAT_TEMPLATES.get(spec.chat_template, spec.chat_template)
        return tokenizer

    # -- LangChain plumbing ---------------------------------------------------------------------
    def _spec_fields(self) -> dict[str, Any]:
        try:
            from specdec_llm.pairs import get_spec

            spec = get_spec(self.pair)
            return {"target": spec.target, "draft": spec.draft, "dtype": spec.dtype, "device": spec.device}
        except Exception:  # noqa: BLE001 - identifying params never fail; a call says what is wrong
            return {"target": None, "draft": None}

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "pair": self.pair,
            **self._spec_fields(),
            "backend": self.effective_backend(),
            **{name: getattr(self, name) for name in GENERATION_FIELDS if name != "stop"},
        }

    def _ls(
        self, model_type: Literal["chat", "llm"], stop: list[str] | str | None, kwargs: dict[str, Any]
    ) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider=PROVIDER,
            ls_model_type=model_type,
            ls_model_name=kwargs.get("model") or kwargs.get("pair") or self.pair,
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_new_tokens", kwargs.get("max_tokens", self.max_new_tokens)),
        )
        stop = stops(stop if stop is not None else self.stop)
        if stop:
            params["ls_stop"] = stop
        return params

    def effective_backend(self) -> str:
        """ "remote" or "local": what this model uses now (``backend``, or for "auto" the settings)."""
        if self.backend != "auto":
            return self.backend
        return "remote" if get_settings().broker_url else "local"

    @staticmethod
    def _check(opt: dict[str, Any], stop: list[str], *, messages: bool) -> dict[str, Any]:
        """The generation parameters of ``opt`` (``CALL_OPTIONS``' values), checked, with
        its job metadata and timeout: ``RequestError`` naming the first bad one."""
        gen = {engine: opt[name] for name, engine in GENERATION_FIELDS.items() if name != "stop"}
        gen.update(stop=stop, chat=bool(opt["chat"]) and not messages)
        check_generation(gen)
        if opt["job_metadata"] is not None:
            try:
                json.dumps(opt["job_metadata"])
            except (TypeError, ValueError) as e:
                raise RequestError("job_metadata", f"must be JSON-serialisable ({e})") from None
        timeout = opt["timeout"]
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise RequestError("timeout", f"{timeout!r}: use a number of seconds > 0, or None")
        return gen

    def _resolve(self, stop: list[str] | str | None, kwargs: dict[str, Any], *, messages: bool) -> Call:
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
        gen = self._check(opt, stops(stop if stop is not None else self.stop) or [], messages=messages)
        timeout = opt["timeout"]
        from specdec_llm.pairs import get_spec

        get_spec(pair)  # unknown pair: RequestError now, not in a worker
        return Call(
            pair=pair,
            backend=self.effective_backend(),
            gen=gen,
            job_name=str(opt["job_name"]),
            job_metadata=opt["job_metadata"],
            category=opt["category"],
            timeout=timeout,
            record=self.record,
            max_retries=self.max_retries,
            started=time.monotonic(),
        )

    # -- running a call: a list of results (plain dicts) --------------------------------------------
    def _run(self, items: list[Item], call: Call) -> list[dict[str, Any] | Exception]:
        """A result per item, or in its place the error of that item alone: text no store
        keeps is refused before any work, a prompt over the context fails its row, and the
        other items run all the same (in one submission). An error of the whole call (its
        timeout, the broker, the pair) is raised."""
        outcomes: list[dict[str, Any] | Exception] = []
        runs = []  # the items that passed their checks, by position
        for i, item in enumerate(items):
            try:
                item.check()
            except RequestError as e:
                outcomes.append(e)
            else:
                outcomes.append({})
                runs.append(i)
        if runs:
            results = get_backend(call.backend).generate([items[i] for i in runs], call)
            for i, r in zip(runs, results, strict=True):
                outcomes[i] = r if isinstance(r, Exception) else {**r, "text": clean(r["text"]), "pair": call.pair}
        return outcomes

    def _run_one(self, item: Item, call: Call) -> dict[str, Any]:
        """One item's result; its error raised."""
        [outcome] = self._run([item], call)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _events(self, item: Item, call: Call, cancel: threading.Event) -> Iterator[tuple[str, Any]]:
        """("text", delta)... then ("result", result): one prompt, streamed."""
        item.check()
        for kind, value in get_backend(call.backend).stream(item, call, cancel):
            yield kind, (clean(value) if kind == "text" else {**value, "text": clean(value["text"]), "pair": call.pair})


# The generation parameters are the engine request's fields that the models above declare under
# the same name (``mode`` as ``decoding``), as ``client.rows.PARAMS`` derives a row's; not
# declared: ``prompt`` (the call's input), ``scope`` (the client's, per job) and a field a call
# sets itself (tests/langchain/test_langchain_tools.py names them, so a new engine field is not missed).
ENGINE_FIELDS = tuple(f.name for f in fields(GenerationRequest))
RENAMED = {"mode": "decoding"}  # engine name -> field name
GENERATION_FIELDS = {
    RENAMED.get(name, name): name for name in ENGINE_FIELDS if RENAMED.get(name, name) in SpecDecBase.model_fields
}


def stops(stop: list[str] | str | None) -> list[str] | None:
    """A call's ``stop`` as a list: one string is one stop string, not a list of its characters."""
    if stop is None:
        return None
    return [stop] if isinstance(stop, str) else list(stop)


# a call's options: the generation parameters (``stop`` is a call argument of its own) and its settings
CALL_OPTIONS = (
    *(name for name in GENERATION_FIELDS if name != "stop"),
    "timeout",
    "job_name",
    "job_metadata",
    "category",
)


async def abandoned_if_cancelled(call: Call, work: Awaitable[T]) -> T:
    """``await work`` (a call run in a thread); a cancelled caller (``asyncio.wait_for``, a
    client gone) marks the call abandoned, so the thread stops waiting and cancels its rows
    (a thread cannot be cancelled: it decoded on to the end)."""
    try:
        return await work
    except asyncio.CancelledError:
        call.abandoned.set()
        raise


async def aiter_in_thread(make: Callable[[threading.Event], Generator[T, None, None]]) -> AsyncIterator[T]:
    """Run a blocking iterator in a thread and yield its items here: the event loop never
    waits on a worker, a socket or the model."""
    loop = asyncio.get_running_loop()
    items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
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


def info(result: dict[str, Any]) -> dict[str, Any]:
    """A result's ``generation_info``: its figures, the speedup and its basis, ids."""
    stats = result.get("stats") or {}
    out = {"finish_reason": result.get("finish_reason") or stats.get("finish_reason")}
    out.update({name: stats.get(name) for name in INFO_FIELDS})
    base, wall = stats.get("baseline_s"), stats.get("wall_time_s")
    speedup = base / wall if base and wall else None  # a row recorded before baseline_s existed has none
    out.update(speedup=speedup, speedup_basis=SPEEDUP_BASIS if speedup is not None else None)
    out.update(request_id=result.get("request_id"), job_id=result.get("job_id"), pair=result.get("pair"))
    return out


def usage(results: list[dict[str, Any]]) -> dict[str, Any]:
    """LangChain's ``token_usage`` over ``results``."""
    prompt = sum(int((r.get("stats") or {}).get("prompt_tokens") or 0) for r in results)
    output = sum(int((r.get("stats") or {}).get("output_tokens") or 0) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}
