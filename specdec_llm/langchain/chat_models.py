"""``ChatSpecDec``: a LangChain chat model over specdec-llm (messages through the target
tokenizer's chat template)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict

from specdec_llm.engine import RequestError

from .backend import Call, Item
from .base import PROVIDER, SpecDecBase, aiter_in_thread, info, usage

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
                    raise RequestError(
                        "messages", f"content of type {kind!r} is not supported: this model reads text only"
                    )
            content = "".join(parts)
        turns.append({"role": role, "content": content})
    return turns


class ChatSpecDec(SpecDecBase, BaseChatModel):
    """The chat-model twin of ``SpecDecLLM``: messages go through the target tokenizer's chat
    template (in the worker, or here in local mode); ``usage_metadata`` on every answer and
    on the last streamed chunk. Text in, text out: no tool calling or structured output."""

    model_config = ConfigDict(extra="forbid")

    @property
    def _llm_type(self) -> str:
        return "specdec-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls("chat", stop, kwargs)

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        """Not yet: ChatSpecDec decodes text only (tool calls and structured output come with
        constrained decoding). Says so, instead of LangChain's bare NotImplementedError."""
        raise NotImplementedError(
            "ChatSpecDec does not call tools yet (text in, text out), so bind_tools, "
            "with_structured_output and tool-calling agents cannot use it; ask for JSON in the prompt "
            "and parse the text, or use a chat model with tool calling for the agent"
        )

    def _message_fields(self, result: dict) -> dict:
        stats = result.get("stats") or {}
        prompt, output = int(stats.get("prompt_tokens") or 0), int(stats.get("output_tokens") or 0)
        return {
            "usage_metadata": UsageMetadata(input_tokens=prompt, output_tokens=output, total_tokens=prompt + output),
            "response_metadata": {"model_name": result["pair"], "model_provider": PROVIDER, **info(result)},
        }

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        call = self._resolve(stop, kwargs, messages=True)
        return self._chat_result(self._run_one(Item(messages=to_turns(messages)), call))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        call = self._resolve(stop, kwargs, messages=True)
        item = Item(messages=to_turns(messages))
        return self._chat_result(await asyncio.to_thread(self._run_one, item, call))

    def _chat_result(self, result: dict) -> ChatResult:
        message = AIMessage(content=result["text"], **self._message_fields(result))
        return ChatResult(
            generations=[ChatGeneration(message=message, generation_info=info(result))],
            llm_output={"token_usage": usage([result]), "model_name": result["pair"]},
        )

    def _chunks(self, messages: list[BaseMessage], call: Call, cancel) -> Iterator[ChatGenerationChunk]:
        for kind, value in self._events(Item(messages=to_turns(messages)), call, cancel):
            if kind == "text":
                yield ChatGenerationChunk(message=AIMessageChunk(content=value))
            else:
                message = AIMessageChunk(content="", chunk_position="last", **self._message_fields(value))
                yield ChatGenerationChunk(message=message, generation_info=info(value))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # (BaseChatModel.stream calls on_llm_new_token itself, for every chunk yielded here)
        call = self._resolve(stop, kwargs, messages=True)
        cancel = threading.Event()
        try:
            yield from self._chunks(messages, call, cancel)
        finally:
            cancel.set()

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        call = self._resolve(stop, kwargs, messages=True)
        async for chunk in aiter_in_thread(lambda cancel: self._chunks(messages, call, cancel)):
            yield chunk
