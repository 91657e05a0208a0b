"""``SpecDecLLM``: a LangChain ``LLM`` (text in, text out) over specdec-llm."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LangSmithParams, LanguageModelInput
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import get_config_list
from pydantic import ConfigDict

from specdec_llm.engine import RequestError

from .backend import Call, Item
from .base import SpecDecBase, abandoned_if_cancelled, aiter_in_thread, info, usage


class SpecDecLLM(SpecDecBase, BaseLLM):
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

    def _result(self, prompts: list[str], outcomes: list[dict[str, Any] | Exception]) -> LLMResult:
        """The call's LLMResult; where a prompt failed, ``failed_prompt``'s error (the
        others' results ride on it, for ``batch(..., return_exceptions=True)``)."""
        if any(isinstance(o, Exception) for o in outcomes):
            raise failed_prompt(prompts, outcomes)
        results = [o for o in outcomes if isinstance(o, dict)]
        return LLMResult(
            generations=[[Generation(text=r["text"], generation_info=info(r))] for r in results],
            llm_output={"token_usage": usage(results), "model_name": results[0]["pair"] if results else self.pair},
        )

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        if self.streaming and len(prompts) == 1:  # callbacks get every token
            final = GenerationChunk(text="")
            for chunk in self._stream(prompts[0], stop, run_manager, **kwargs):
                final += chunk
            return self._streamed_result(final)
        call = self._resolve(stop, kwargs, messages=False)
        return self._result(prompts, self._run([Item(prompt=p) for p in prompts], call))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        if self.streaming and len(prompts) == 1:  # callbacks get every token, as in ``_generate``
            final = GenerationChunk(text="")
            async for chunk in self._astream(prompts[0], stop, run_manager, **kwargs):
                final += chunk
            return self._streamed_result(final)
        call = self._resolve(stop, kwargs, messages=False)
        items = [Item(prompt=p) for p in prompts]
        return self._result(prompts, await abandoned_if_cancelled(call, asyncio.to_thread(self._run, items, call)))

    def _streamed_result(self, final: GenerationChunk) -> LLMResult:
        """The LLMResult of one streamed prompt (its chunks added up)."""
        figures = final.generation_info or {}
        tokens = {
            "prompt_tokens": figures.get("prompt_tokens") or 0,
            "completion_tokens": figures.get("output_tokens") or 0,
        }
        tokens["total_tokens"] = tokens["prompt_tokens"] + tokens["completion_tokens"]
        return LLMResult(
            generations=[[Generation(text=final.text, generation_info=figures)]],
            llm_output={"token_usage": tokens, "model_name": figures.get("pair") or self.pair},
        )

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[str]:
        """LangChain's ``batch``, all prompts in one submission, where a bad prompt fails
        alone: with ``return_exceptions=True`` its place holds its error and every other
        place its text (``BaseLLM.batch`` would put the one error in every place); without,
        the error names the prompt."""
        if not return_exceptions or split(config, len(inputs)):  # (split: BaseLLM.batch calls back here per part)
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        try:
            return super().batch(inputs, config, **kwargs)
        except Exception as e:  # noqa: BLE001 - each prompt's outcome, as LangChain's return_exceptions
            return per_prompt(e, len(inputs))

    async def abatch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[str]:
        """``batch``'s async twin: a bad prompt fails alone."""
        if not return_exceptions or split(config, len(inputs)):
            return await super().abatch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        try:
            return await super().abatch(inputs, config, **kwargs)
        except Exception as e:  # noqa: BLE001
            return per_prompt(e, len(inputs))

    def _chunks(self, prompt: str, call: Call, cancel: threading.Event) -> Generator[GenerationChunk, None, None]:
        for kind, value in self._events(Item(prompt=prompt), call, cancel):
            if kind == "text":
                yield GenerationChunk(text=value)
            else:  # the last chunk: no text, every figure (see ``specdec_llm.langchain``)
                yield GenerationChunk(text="", generation_info=info(value))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        call = self._resolve(stop, kwargs, messages=False)
        cancel = threading.Event()
        try:
            for chunk in self._chunks(prompt, call, cancel):
                if run_manager and chunk.text:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            cancel.set()

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        call = self._resolve(stop, kwargs, messages=False)
        async for chunk in aiter_in_thread(lambda cancel: self._chunks(prompt, call, cancel)):
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


def failed_prompt(prompts: list[str], outcomes: list[dict[str, Any] | Exception]) -> Exception:
    """The error a call raises when some of its prompts failed: the first failed prompt's
    own (its class, e.g. ``RequestError``), its message naming that prompt when the call had
    several (which one, how it begins, how many others failed or were generated). Every
    prompt's outcome rides on it as ``outcomes`` (for ``batch(..., return_exceptions=True)``)."""
    failed = [i for i, o in enumerate(outcomes) if isinstance(o, Exception)]
    first = outcomes[failed[0]]
    assert isinstance(first, Exception)
    error = first
    if len(outcomes) > 1:
        start = prompts[failed[0]]
        others = len(failed) - 1
        done = len(outcomes) - len(failed)
        where = (
            f"prompt {failed[0]} of {len(outcomes)}: {start[:40]!r}{'...' if len(start) > 40 else ''}"
            + (f"; {others} other prompt{'s' if others > 1 else ''} failed too" if others else "")
            + (f"; {done} generated: batch(..., return_exceptions=True) returns their text" if done else "")
        )
        error = reworded(first, where)
    error.outcomes = outcomes  # type: ignore[attr-defined]
    return error


def reworded(error: Exception, where: str) -> Exception:
    """``error`` again, the same class, with ``(where)`` after its message; where the class
    cannot be rebuilt from a message, the original with ``where`` as a note."""
    try:
        if isinstance(error, RequestError):
            again: Exception = RequestError(error.field, f"{str(error).removeprefix(error.field + ': ')} ({where})")
        else:
            again = type(error)(f"{error} ({where})")
    except TypeError:
        error.add_note(where)
        return error
    again.__cause__ = error.__cause__
    return again


def split(config: RunnableConfig | list[RunnableConfig] | None, count: int) -> bool:
    """Whether ``BaseLLM.batch`` runs these inputs in parts (``max_concurrency``)."""
    return get_config_list(config, count)[0].get("max_concurrency") is not None


def per_prompt(error: Exception, count: int) -> list[Any]:  # texts and errors (batch's list[str], typed as LangChain's)
    """``batch(..., return_exceptions=True)``'s answer to ``error``: each prompt's text or
    its own error, from the ``outcomes`` on it; an error of the whole call in every place."""
    outcomes = getattr(error, "outcomes", None)
    if outcomes is None or len(outcomes) != count:
        return [error] * count
    return [o if isinstance(o, Exception) else o["text"] for o in outcomes]
