"""``ChatSpecDec``: a LangChain chat model over specdec-llm (messages through the target
tokenizer's chat template)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    InvalidToolCall,
    ToolMessage,
    message_chunk_to_message,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, Generation
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict

from specdec_llm.engine import CUT_SHORT, RequestError

from .backend import Call, Item
from .base import ENGINE_FIELDS, PROVIDER, SpecDecBase, abandoned_if_cancelled, aiter_in_thread, info, usage
from .tools import CLOSE, OPEN, CallStream, Reply, chunk_calls, message_calls, parse, plan

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}
_CALL_BLOCKS = ("tool_use", "tool_call", "function_call")  # content blocks that repeat an AIMessage's tool_calls


def to_turns(messages: list[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages -> ``[{"role", "content"}]`` for the target's chat template (text
    only: an image or other non-text block is refused with a clear error). An AIMessage's
    tool calls become the turn's ``tool_calls`` (``{"type": "function", "id", "function":
    {"name", "arguments": object}}``, as chat templates read them); a ToolMessage is a
    ``tool`` turn with its ``tool_call_id`` and ``name``."""
    turns = []
    for m in map(message_chunk_to_message, messages):  # (a streamed reply, summed, is a message too)
        if isinstance(m, ChatMessage):
            role = m.role
        elif m.type in _ROLES:
            role = _ROLES[m.type]
        else:
            raise RequestError("messages", f"message type {m.type!r} is not supported; use system, human, ai or tool")
        calls = m.tool_calls if isinstance(m, AIMessage) else []
        content = _text(m.content, skip=_CALL_BLOCKS if calls else ())
        if isinstance(m, AIMessage) and m.invalid_tool_calls:  # what the model wrote, back in its place
            content = "\n".join([content, *map(written_call, m.invalid_tool_calls)]).lstrip("\n")
        turn: dict[str, Any] = {"role": role, "content": content}
        if calls:
            turn["tool_calls"] = [
                {"type": "function", "id": c["id"], "function": {"name": c["name"], "arguments": c["args"]}}
                for c in calls
            ]
        if isinstance(m, ToolMessage):
            turn["tool_call_id"] = m.tool_call_id
            if m.name:
                turn["name"] = m.name
        turns.append(turn)
    return turns


def written_call(call: InvalidToolCall) -> str:
    """An invalid call as the model wrote it, in its tags (a streamed one's text came as a
    JSON string: ``tools.chunk_calls``)."""
    raw = call.get("args") or ""
    with contextlib.suppress(ValueError):
        if isinstance(decoded := json.loads(raw), str):
            raw = decoded
    return f"{OPEN}\n{raw}\n{CLOSE}"


def _text(content: str | list[str | dict[str, Any]], skip: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif not (isinstance(block, dict) and block.get("type") in skip):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise RequestError("messages", f"content of type {kind!r} is not supported: this model reads text only")
    return "".join(parts)


class ChatSpecDec(SpecDecBase, BaseChatModel):
    """The chat-model twin of ``SpecDecLLM``: messages go through the target tokenizer's chat
    template (in the worker, or here in local mode); ``usage_metadata`` on every answer and
    on the last streamed chunk. Tools (``bind_tools``) are rendered by the same template and
    the calls read back from the text (``tools.py``), in this process in both modes;
    ``with_structured_output`` builds on them and on a JSON reply."""

    model_config = ConfigDict(extra="forbid")

    @property
    def _llm_type(self) -> str:
        return "specdec-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls("chat", stop, kwargs)

    # -- tools and structured output --------------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | dict[str, Any] | bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """The model with ``tools`` (LangChain tools, functions, pydantic models, TypedDicts or
        OpenAI schemas) shown to it through its chat template. ``tool_choice``: "auto" (or
        None: the model decides), "none" (tools not shown, no calls read), "any" or "required"
        (a call must be made), or a tool's name (that tool must be called). A forced call starts
        the answer with ``<tool_call>`` and its JSON is constrained to the tools' schemas; with
        a ``response_format`` too (an agent's structured answer), each reply is calls or that
        answer. Under "auto" alone the model's calls are read as written: a malformed one is
        in ``invalid_tool_calls``."""
        schemas = [convert_to_openai_tool(t, strict=strict) for t in tools]
        for t in schemas:
            if "function" not in t:  # (a provider's own tool: {"type": "web_search_preview"})
                raise RequestError("tools", f"{t!r} is not a function; this model calls functions only")
        plan(schemas, tool_choice, None)  # a bad tool_choice fails here, not at the first call
        return self.bind(tools=schemas, tool_choice=tool_choice, **kwargs)

    def get_num_tokens_from_messages(
        self,
        messages: list[BaseMessage],
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool] | None = None,
    ) -> int:
        """The prompt tokens ``messages`` (with ``tools``' schemas) take as the pair's chat
        template renders them, the generation prompt included: what a call's prompt costs, and
        what ``trim_messages(token_counter=chat)`` budgets. LangChain's default counts each
        message's text alone, by another tokenizer."""
        from specdec_llm.engine.chat import render_chat

        schemas = [convert_to_openai_tool(t) for t in tools] if tools else None
        return len(render_chat(self.tokenizer(), to_turns(messages), tools=schemas))

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Replies parsed into ``schema`` (a pydantic model: instances; a TypedDict or JSON
        schema: dicts). ``method``: "json_schema" (the schema in the system turn, a JSON reply),
        "function_calling" (a forced call of a tool named after the schema), "json_mode" (a JSON
        reply; the schema only parses it). With ``include_raw`` a dict of ``raw`` (the
        AIMessage), ``parsed`` and ``parsing_error``, instead of raising on a reply that does
        not parse. json_schema and function_calling constrain the reply to the schema."""
        if kwargs:
            raise RequestError(sorted(kwargs)[0], "unknown argument of with_structured_output")
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        traced = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        llm: Runnable[LanguageModelInput, AIMessage]
        parser: Runnable[Any, Any]
        if method == "json_mode":
            llm = self.bind(response_format={"type": "json_object"}, ls_structured_output_format=traced)
            parser = WholePydantic(pydantic_object=schema) if pydantic else WholeJson()  # type: ignore[arg-type]
        elif schema is None:
            raise RequestError("schema", f"method={method!r} needs a schema (only json_mode reads any JSON)")
        elif method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, strict=strict, ls_structured_output_format=traced)
            parser = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                if pydantic
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        elif method == "json_schema":
            fmt = {"type": "json_schema", "json_schema": _json_schema(schema, strict)}
            llm = self.bind(response_format=fmt, ls_structured_output_format=traced)
            parser = WholePydantic(pydantic_object=schema) if pydantic else WholeJson()  # type: ignore[arg-type]
        else:
            raise RequestError("method", f"{method!r}: use 'json_schema', 'function_calling' or 'json_mode'")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")

    # -- a call -----------------------------------------------------------------------------------
    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> Prepared:
        """The call's settings, its item (turns, tools, prefill) and what its reply should be."""
        kwargs = dict(kwargs)
        reply = plan(kwargs.pop("tools", None), kwargs.pop("tool_choice", None), kwargs.pop("response_format", None))
        call = self._resolve(stop, kwargs, messages=True)
        if reply.response_format is not None and "response_format" in ENGINE_FIELDS:
            # the hook for constrained decoding: once the engine's request has this field, the
            # engine makes the reply satisfy it (a JSON schema, OpenAI's response_format form)
            call.gen["response_format"] = reply.response_format
        turns = to_turns(messages)
        if reply.instruction:
            turns = with_instruction(turns, reply.instruction)
        return Prepared(call, Item(messages=turns, tools=reply.tools, prefill=reply.prefill), reply)

    def _message_fields(self, result: dict[str, Any]) -> dict[str, Any]:
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
        prepared = self._prepare(messages, stop, kwargs)
        return self._chat_result(self._run_one(prepared.item, prepared.call), prepared.reply)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prepared = self._prepare(messages, stop, kwargs)
        result = await abandoned_if_cancelled(
            prepared.call, asyncio.to_thread(self._run_one, prepared.item, prepared.call)
        )
        return self._chat_result(result, prepared.reply)

    def _chat_result(self, result: dict[str, Any], reply: Reply) -> ChatResult:
        if reply.names:
            parsed = parse(reply.prefill + result["text"], reply.names)
            calls, invalid = message_calls(parsed.calls)
            message = AIMessage(
                content=parsed.content, tool_calls=calls, invalid_tool_calls=invalid, **self._message_fields(result)
            )
        else:
            message = AIMessage(content=result["text"], **self._message_fields(result))
        return ChatResult(
            generations=[ChatGeneration(message=message, generation_info=info(result))],
            llm_output={"token_usage": usage([result]), "model_name": result["pair"]},
        )

    def _chunks(self, prepared: Prepared, cancel: threading.Event) -> Generator[ChatGenerationChunk, None, None]:
        """Text as it comes; with tools, content and calls as they become certain (``CallStream``)."""
        reply = prepared.reply
        calls = CallStream(reply.names, reply.prefill) if reply.names else None
        sent = 0  # tool calls sent so far: their chunks' indexes
        for kind, value in self._events(prepared.item, prepared.call, cancel):
            if kind == "text" and calls is None:
                yield ChatGenerationChunk(message=AIMessageChunk(content=value))
                continue
            if calls is not None:
                new = calls.feed(value) if kind == "text" else calls.finish()
                if new.content or new.calls:
                    chunks = chunk_calls(new.calls, sent)
                    sent += len(chunks)
                    yield ChatGenerationChunk(message=AIMessageChunk(content=new.content, tool_call_chunks=chunks))
            if kind == "result":
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
        prepared = self._prepare(messages, stop, kwargs)
        cancel = threading.Event()
        try:
            yield from self._chunks(prepared, cancel)
        finally:
            cancel.set()

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        prepared = self._prepare(messages, stop, kwargs)
        async for chunk in aiter_in_thread(lambda cancel: self._chunks(prepared, cancel)):
            yield chunk


class WholeJson(JsonOutputParser):
    """A reply's JSON, whole: a reply cut short raises (saying why, where LangChain's parser
    returns what parses of it: '{"total": 1' of 12 as {"total": 1}). Partial values while
    streaming are LangChain's, as before."""

    def parse_result(self, result: list[Generation], *, partial: bool = False) -> Any:
        if partial:
            return super().parse_result(result, partial=True)
        text = result[0].text
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            gen = result[0]
            finish = gen.message.response_metadata.get("finish_reason") if isinstance(gen, ChatGeneration) else None
            why = CUT_SHORT.get(finish or "", f"not one JSON value ({e})")
            raise OutputParserException(f"the reply does not parse: {why}", llm_output=text) from e


class WholePydantic(PydanticOutputParser[Any], WholeJson):
    """``WholeJson`` then the model's validation (PydanticOutputParser's, reading WholeJson's parse)."""


def _json_schema(schema: dict[str, Any] | type, strict: bool | None) -> dict[str, Any]:
    """OpenAI's ``json_schema`` entry for a structured-output schema. A dict is a JSON schema
    already, used as it is (an array, enum or map has no properties for convert_to_json_schema
    to keep), unless it is an OpenAI function (``{"name", "parameters"}``) or tool (``{"type":
    "function", "function": ...}``): its parameters are the schema. A class or function is converted."""
    if isinstance(schema, dict) and ({"name", "parameters"} <= set(schema) or schema.get("type") == "function"):
        function = convert_to_openai_tool(schema, strict=strict)["function"]
        json_schema, name = function.get("parameters") or {"type": "object"}, function["name"]
    else:
        json_schema = schema if isinstance(schema, dict) else convert_to_json_schema(schema, strict=strict)
        name = json_schema.get("title", "response")
    return {"name": name, "schema": json_schema, "strict": bool(strict)}


@dataclass
class Prepared:
    call: Call
    item: Item
    reply: Reply


def with_instruction(turns: list[dict[str, Any]], instruction: str) -> list[dict[str, Any]]:
    """``instruction`` at the end of the system turn (one is added first when there is none)."""
    if turns and turns[0]["role"] == "system":
        return [{**turns[0], "content": f"{turns[0]['content']}\n\n{instruction}"}, *turns[1:]]
    return [{"role": "system", "content": instruction}, *turns]
