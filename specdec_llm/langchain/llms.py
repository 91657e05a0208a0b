"""``SpecDecLLM``: a LangChain ``LLM`` (text in, text out) over specdec-llm."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict

from .backend import Call, Item
from .base import SpecDecBase, aiter_in_thread, info, usage


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

    def _result(self, results: list[dict]) -> LLMResult:
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
            final = None
            for chunk in self._stream(prompts[0], stop, run_manager, **kwargs):
                final = chunk if final is None else final + chunk
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
        call = self._resolve(stop, kwargs, messages=False)
        return self._result(self._run([Item(prompt=p) for p in prompts], call))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        call = self._resolve(stop, kwargs, messages=False)
        items = [Item(prompt=p) for p in prompts]
        return self._result(await asyncio.to_thread(self._run, items, call))

    def _chunks(self, prompt: str, call: Call, cancel: threading.Event) -> Iterator[GenerationChunk]:
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
