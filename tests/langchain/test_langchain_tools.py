"""Tool calling and structured output on ``ChatSpecDec``: calls read from generated text (well
formed, malformed, several, text around them, a bare JSON call), the same calls from a
stream however its text is split, what ``tool_choice`` asks for, tool conversations rendered
by the pair's chat template, and the tiny pair end to end in this process (remote mode:
tests/langchain/test_langchain.py). A random tiny model does not write valid calls: the tests check
what was rendered and that what it wrote is read back as the parser reads that text."""

from __future__ import annotations

import json
import random

import pytest
from conftest import tools_pair
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel

from specdec_llm.engine import RequestError
from specdec_llm.langchain import ChatSpecDec, to_turns
from specdec_llm.langchain.base import ENGINE_FIELDS, GENERATION_FIELDS
from specdec_llm.langchain.tools import PREFILL, CallStream, format_instruction, message_calls, parse, plan
from specdec_llm.settings import reload_settings

NAMES = ("add", "lookup")


def call_text(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def calls_of(parsed) -> list[tuple]:
    return [(c.name, c.args) for c in parsed.calls]


# -- reading calls from text ----------------------------------------------------------------------------
def test_well_formed_calls_with_text_around_them():
    text = "Let me add.\n" + call_text("add", {"a": 1, "b": 2}) + "\n" + call_text("lookup", {"key": "x"}) + "\nDone."
    parsed = parse(text, NAMES)
    assert calls_of(parsed) == [("add", {"a": 1, "b": 2}), ("lookup", {"key": "x"})]
    assert parsed.content == "Let me add.\nDone."
    assert parse(call_text("add", {}), NAMES).content == ""
    assert parse("No tools needed: 3.", NAMES).content == "No tools needed: 3."
    # OpenAI's spelling of arguments (JSON text) and "parameters" are read too
    spelled = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call><tool_call>{"name": "add", "parameters": {"b": 2}}</tool_call>'
    assert calls_of(parse(spelled, NAMES)) == [("add", {"a": 1}), ("add", {"b": 2})]


def test_malformed_calls_are_invalid_with_the_reason():
    text = (
        "<tool_call>{not json}</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>' + call_text("add", {"a": 1})
    )
    calls = parse(text, NAMES).calls
    assert [c.args is None for c in calls] == [True, True, True, False]
    assert "not JSON" in calls[0].error and calls[0].raw == "{not json}"
    assert "not a call" in calls[1].error
    assert calls[2].name == "add" and "not a JSON object" in calls[2].error
    # a call left open at the end: read when its JSON is complete, invalid when it was cut short
    assert calls_of(parse('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', NAMES)) == [("add", {"a": 1})]
    [cut] = parse('<tool_call>\n{"name": "add", "arguments": {"a": 1', NAMES).calls
    assert cut.args is None and cut.raw == '{"name": "add", "arguments": {"a": 1'


def test_a_bare_json_call_naming_a_bound_tool():
    assert calls_of(parse('{"name": "add", "arguments": {"a": 1}}', NAMES)) == [("add", {"a": 1})]
    fenced = '```json\n[{"name": "add", "arguments": {"a": 1}}, {"name": "lookup", "arguments": {}}]\n```'
    assert calls_of(parse(fenced, NAMES)) == [("add", {"a": 1}), ("lookup", {})]
    for text in ('{"name": "weather", "arguments": {}}', '{"answer": 3}', "[1] a footnote"):
        parsed = parse(text, NAMES)
        assert parsed.calls == [] and parsed.content == text  # not a bound tool: it is the answer
    assert parse('{"name": "add", "arguments": {}}', ()).calls == []  # no tools bound: never a call


def test_a_call_in_the_doubled_braces_of_qwens_template_is_read():
    """Qwen2.5's template shows its call format as {{"name": ..., "arguments": ...}}; the 1.5B
    model copies it (both ways of closing it were seen), bare and inside the tags."""
    for text in (
        '{{"name": "add", "arguments": {"a": 1}}',
        '{{"name": "add", "arguments": {"a": 1}}}',
        '<tool_call>\n{{"name": "add", "arguments": {"a": 1}}}\n</tool_call>',
    ):
        assert calls_of(parse(text, NAMES)) == [("add", {"a": 1})], text
    assert parse("{{ not json }}", NAMES).calls == []


STREAMED = [
    "Let me add.\n" + call_text("add", {"a": 1, "b": 2}) + "\n" + call_text("lookup", {"key": "<x>"}) + "\nDone.",
    "Plain text with a < sign and <tool_ inside, and a trailing space ",
    "<tool_call>{broken}</tool_call> then text " + call_text("add", {"a": [1, {"b": "}"}]}),
    '```json\n{"name": "add", "arguments": {"a": 1}}\n```',
    "```python\nprint('<tool_call>')\n```",
    PREFILL + '{"name": "add", "arguments": {"a": 1}}',  # a forced call: no closing tag before the end
    PREFILL + '{"name": "add", "arguments": {"a"',
]


def stream(text: str, pieces: list[str]) -> tuple[str, list, list[int]]:
    """Content, calls, and where each call came (the piece it arrived with)."""
    s = CallStream(NAMES)
    content, calls, arrived = "", [], []
    for i, piece in enumerate([*pieces, None]):
        new = s.feed(piece) if piece is not None else s.finish()
        content += new.content
        calls += new.calls
        arrived += [i] * len(new.calls)
    assert "".join(pieces) == text
    return content, calls, arrived


@pytest.mark.parametrize("text", STREAMED)
def test_a_stream_gives_the_same_content_and_calls_however_it_is_split(text):
    whole = parse(text, NAMES)
    rng = random.Random(0)
    cuts = sorted(rng.sample(range(1, len(text)), 4))
    splits = {
        "whole": [text],
        "char by char": list(text),
        "big pieces": [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])],
    }
    for how, pieces in splits.items():
        content, calls, arrived = stream(text, pieces)
        assert (content, calls) == (whole.content, whole.calls), how
    # char by char: a call comes with the character that closes it, never before
    _, calls, arrived = stream(text, list(text))
    closes = [i for i in range(len(text)) if text[: i + 1].endswith("</tool_call>")]
    assert arrived[: len(closes)] == closes[: len(arrived)]


def test_a_closing_tag_inside_a_json_string_is_part_of_the_arguments():
    """A call's JSON is decoded before its closing tag is looked for: a forced call (valid JSON
    by construction) whose string argument holds "</tool_call>" is that call, invoked or
    streamed; malformed JSON still ends at the first closing tag, an invalid call."""
    args = {"key": "end with </tool_call> please"}
    forced = PREFILL + json.dumps({"name": "lookup", "arguments": args})  # no closing tag before the end
    tagged = "Here.\n" + call_text("lookup", args) + "\nDone."
    malformed = '<tool_call>{"name": "add", "arguments": {"a": "x</tool_call>"}, oops}</tool_call> after'
    assert (parse(forced, NAMES).content, calls_of(parse(forced, NAMES))) == ("", [("lookup", args)])
    assert (parse(tagged, NAMES).content, calls_of(parse(tagged, NAMES))) == ("Here.\nDone.", [("lookup", args)])
    [bad] = parse(malformed, NAMES).calls
    assert bad.args is None and "not JSON" in bad.error and bad.raw == '{"name": "add", "arguments": {"a": "x'
    for text in (forced, tagged, malformed):
        whole = parse(text, NAMES)
        for pieces in ([text], list(text)):
            content, calls, _ = stream(text, pieces)
            assert (content, calls) == (whole.content, whole.calls), (text, len(pieces))
    _, _, arrived = stream(tagged, list(tagged))
    assert arrived == [tagged.rindex("</tool_call>") + len("</tool_call>") - 1]  # with its own closing tag


def test_streamed_content_never_shows_a_call_being_written():
    text = STREAMED[0]
    s = CallStream(NAMES)
    seen = ""
    for ch in text:
        seen += s.feed(ch).content
        assert "<" not in seen and "tool_call" not in seen


# -- what tool_choice asks for --------------------------------------------------------------------------
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def test_tool_choice_decides_what_is_rendered_prefilled_and_enforced():
    auto = plan([ADD, LOOKUP], "auto", None)
    assert (auto.tools, auto.names, auto.prefill, auto.response_format) == ([ADD, LOOKUP], NAMES, "", None)
    assert plan([ADD, LOOKUP], None, None) == auto
    none = plan([ADD, LOOKUP], "none", None)
    assert (none.tools, none.names) == (None, ())
    for choice in ("any", "required", True):
        forced = plan([ADD, LOOKUP], choice, None)
        assert forced.tools == [ADD, LOOKUP] and forced.prefill == PREFILL
        names = [o["properties"]["name"]["const"] for o in forced.response_format["json_schema"]["schema"]["anyOf"]]
        assert names == ["add", "lookup"]
    for choice in ("lookup", {"type": "function", "function": {"name": "lookup"}}):
        named = plan([ADD, LOOKUP], choice, None)
        assert named.tools == [LOOKUP] and named.names == NAMES and named.prefill == PREFILL
        assert named.response_format["json_schema"]["schema"]["properties"]["name"] == {"const": "lookup"}
    for spelling in ("any", "auto", "none"):  # (Anthropic's: {"type": ...})
        assert plan([ADD, LOOKUP], {"type": spelling}, None) == plan([ADD, LOOKUP], spelling, None)
    assert plan(None, False, None) == plan(None, {"type": "none"}, None) == plan(None, None, None)
    with pytest.raises(RequestError, match="tool_choice: 'weather' is not one of the bound tools"):
        plan([ADD], "weather", None)
    with pytest.raises(RequestError, match="tool_choice: 'any' needs tools"):
        plan(None, "any", None)
    with pytest.raises(RequestError, match="response_format"):
        plan(None, None, {"type": "text"})


def test_a_providers_own_tool_is_refused_naming_it(closing_local):
    with pytest.raises(RequestError, match=r"^tools: \{'type': 'web_search_preview'\} is not a function"):
        closing_local.bind_tools([{"type": "web_search_preview"}])


def test_generation_parameters_are_the_engine_requests_fields():
    assert GENERATION_FIELDS["decoding"] == "mode" and "stop" in GENERATION_FIELDS
    # every engine field is a model field, or one a call does not take as one (tell these tests
    # when the engine gains one: response_format is set per call by with_structured_output)
    assert set(ENGINE_FIELDS) - set(GENERATION_FIELDS.values()) <= {"prompt", "scope", "response_format"}
    assert ChatSpecDec(max_new_tokens=8)._identifying_params["decoding"] == "speculative"


# -- the tiny pair with a template that renders tools ---------------------------------------------------
@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def lookup(key: str) -> str:
    """Look a word up in the glossary."""
    return key


@pytest.fixture
def tools_local(closing_local):
    """The tiny tools pair in local mode: models that close what they open (conftest's
    ``closing``), and room for a whole call, which a forced call needs (an incomplete one is invalid)."""
    return closing_local


@pytest.fixture
def closing_local(closing_tools_pair_dir, tiny_pair_dir, tmp_path, monkeypatch):
    """The same, with models that close what they open (conftest's ``closing``), and room for
    a whole call (most of its characters are a token each in the tiny BPE)."""
    yield from local_chat(closing_tools_pair_dir, tiny_pair_dir, tmp_path, monkeypatch, max_new_tokens=96)


def local_chat(tools_dir, tiny_pair_dir, tmp_path, monkeypatch, max_new_tokens: int = 24):
    path = tmp_path / "pairs.toml"
    path.write_text(
        tools_pair("tiny-tools", tools_dir)
        + f'[pairs.tiny]\ntarget = "{tiny_pair_dir / "target"}"\ndraft = "{tiny_pair_dir / "draft"}"\n'
    )
    for var in ("SPECDEC_BROKER_URL", "SPECDEC_RESULT_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPECDEC_CONFIG_FILE", str(path))
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / "data"))
    reload_settings()
    yield ChatSpecDec(pair="tiny-tools", max_new_tokens=max_new_tokens, backend="local", record=False)
    monkeypatch.undo()
    reload_settings()


HISTORY = [
    SystemMessage("Be terse."),
    HumanMessage("What is 1 + 2?"),
    AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}]),
    ToolMessage("3", tool_call_id="c1", name="add"),
]


def rendered(chat: ChatSpecDec, messages, **kw) -> str:
    from specdec_llm import loaded
    from specdec_llm.engine.chat import render_chat

    tok = loaded.get(chat.pair).tokenizer
    return tok.decode(render_chat(tok, to_turns(messages), **kw))


def test_a_tool_conversation_is_rendered_as_the_templates_tool_turns(tools_local):
    from langchain_core.utils.function_calling import convert_to_openai_tool

    schemas = [convert_to_openai_tool(t) for t in (add, lookup)]
    text = rendered(tools_local, HISTORY, tools=schemas, prefill=PREFILL)
    assert text.startswith("<|im_start|>system\nBe terse.\n\n# Tools\n")
    assert json.dumps(schemas[1]) in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n" + PREFILL)
    # the model reads that prompt: the call's prompt is exactly it (and Anthropic-style content blocks too)
    msg = tools_local.bind_tools([add, lookup], tool_choice="any").invoke(HISTORY)
    assert msg.usage_metadata["input_tokens"] == len(tools_local_ids(tools_local, HISTORY, schemas, PREFILL))
    blocks = AIMessage(
        [{"type": "text", "text": ""}, {"type": "tool_use", "id": "c1", "name": "add", "input": {"a": 1, "b": 2}}],
        tool_calls=HISTORY[2].tool_calls,
    )
    assert to_turns([blocks]) == to_turns([HISTORY[2]])


def test_a_streamed_reply_summed_goes_back_into_the_conversation(tools_local):
    """``full += chunk`` over a stream is LangChain's way to keep a streamed call: the summed
    AIMessageChunk (and any other message chunk) is a turn like its message, not an error."""
    from langchain_core.messages import AIMessageChunk, HumanMessageChunk

    full = None
    for chunk in tools_local.bind_tools([add, lookup], tool_choice="any").stream(HISTORY[:2]):
        full = chunk if full is None else full + chunk
    assert isinstance(full, AIMessageChunk) and full.tool_calls
    turns = to_turns([HumanMessageChunk("What is 1 + 2?"), full])
    assert turns == to_turns([HISTORY[1], AIMessage(full.content, tool_calls=full.tool_calls)])
    answer = ToolMessage("3", tool_call_id=full.tool_calls[0]["id"], name=full.tool_calls[0]["name"])
    assert tools_local.invoke([*HISTORY[:2], full, answer]).usage_metadata["input_tokens"] > 0


def test_a_malformed_call_goes_back_as_the_model_wrote_it():
    """The model's own malformed call (its AIMessage's ``invalid_tool_calls``, content "") sent
    back with the tool's error: the turn shows the call, or the error answers nothing seen."""
    written = '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>'
    _, invalid = message_calls(parse(written, NAMES).calls)
    streamed = [{**invalid[0], "args": json.dumps(invalid[0]["args"])}]  # (a stream's: a JSON string)
    for calls in (invalid, streamed):
        assert to_turns([AIMessage("", invalid_tool_calls=calls)]) == [{"role": "assistant", "content": written}]
    said = to_turns([AIMessage("Adding.", invalid_tool_calls=invalid)])[0]["content"]
    assert said == "Adding.\n" + written


def test_tokens_are_counted_by_the_pairs_own_tokenizer(tools_local):
    """``get_num_tokens`` (and ``trim_messages(token_counter=chat)``) read the pair's tokenizer,
    in both modes: LangChain's default fetched GPT-2's from the Hub (0 tokens offline)."""
    from specdec_llm import loaded

    text = "The quick brown fox jumps over the lazy dog. " * 20
    ids = loaded.get(tools_local.pair).tokenizer(text)["input_ids"]
    assert tools_local.get_token_ids(text) == ids and tools_local.get_num_tokens(text) == len(ids) > 100
    remote = tools_local.model_copy(update={"backend": "remote"})  # (the tokenizer alone: nothing sent)
    assert remote.get_token_ids(text) == ids
    # a conversation: as the chat template renders it, with the tools' schemas (LangChain's default
    # counted each message's text alone)
    from langchain_core.utils.function_calling import convert_to_openai_tool

    chat = [*HISTORY, HumanMessage(text)]
    as_rendered = tools_local_ids(tools_local, chat, [convert_to_openai_tool(add)], None)
    assert tools_local.get_num_tokens_from_messages(chat, tools=[add]) == len(as_rendered) > len(ids) + 20
    assert remote.get_num_tokens_from_messages(chat, tools=[add]) == len(as_rendered)


def tools_local_ids(chat, messages, tools, prefill) -> list[int]:
    from specdec_llm import loaded
    from specdec_llm.engine.chat import render_chat

    return render_chat(loaded.get(chat.pair).tokenizer, to_turns(messages), tools=tools, prefill=prefill)


def test_what_the_model_wrote_is_read_as_calls_invoke_and_stream_alike(tools_local):
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from specdec_llm import loaded
    from specdec_llm.engine import GenerationRequest

    schemas = [convert_to_openai_tool(t) for t in (add, lookup)]
    question = [HumanMessage("What is 1 + 2?")]
    for choice, prefill in (("auto", ""), ("any", PREFILL), ("lookup", PREFILL)):
        bound = tools_local.bind_tools([add, lookup], tool_choice=choice)
        msg = bound.invoke(question)
        shown = [s for s in schemas if choice != "lookup" or s["function"]["name"] == "lookup"]
        ids = tools_local_ids(tools_local, question, shown, prefill)
        fmt = plan(shown, choice, None).response_format  # a forced call: its JSON schema, enforced
        request = GenerationRequest(ids, max_new_tokens=tools_local.max_new_tokens, response_format=fmt)
        engine = loaded.get("tiny-tools").server.submit(request).result().text
        expected = parse(prefill + engine.replace("\x00", "\ufffd"), NAMES)
        assert msg.content == expected.content
        assert [(c["name"], c["args"]) for c in msg.tool_calls] == [
            (c.name, c.args) for c in expected.calls if c.args is not None
        ]
        assert [c["args"] for c in msg.invalid_tool_calls] == [c.raw for c in expected.calls if c.args is None]
        if prefill:  # a forced call is always a call, valid or not
            assert len(msg.tool_calls) + len(msg.invalid_tool_calls) >= 1
        assert all(c["id"].startswith("call_") for c in msg.tool_calls + msg.invalid_tool_calls)
        full = None
        for chunk in bound.stream(question):
            full = chunk if full is None else full + chunk
        assert full.content == msg.content and full.usage_metadata == msg.usage_metadata
        assert [(c["name"], c["args"]) for c in full.tool_calls] == [(c["name"], c["args"]) for c in msg.tool_calls]
        assert [json.loads(c["args"]) for c in full.invalid_tool_calls] == [c["args"] for c in msg.invalid_tool_calls]
    # "none": the tools are not shown, nothing is read as a call
    plain = tools_local.invoke(question)
    none = tools_local.bind_tools([add, lookup], tool_choice="none").invoke(question)
    assert none.content == plain.content and none.usage_metadata == plain.usage_metadata and not none.tool_calls


def test_tool_errors_name_the_field(tools_local):
    with pytest.raises(RequestError, match="tool_choice: 'weather'"):
        tools_local.bind_tools([add], tool_choice="weather")
    # a template that does not render tools: said, not silently dropped
    plain = ChatSpecDec(pair="tiny", max_new_tokens=4, backend="local", record=False)
    with pytest.raises(RequestError, match="tools: this model's chat template does not render tools"):
        plain.bind_tools([add]).invoke("hi")
    # special-token text in a call's arguments or a tool's schema is refused like a message's
    bad = AIMessage("", tool_calls=[{"name": "add", "args": {"a": "<|im_end|>"}, "id": "c1", "type": "tool_call"}])
    with pytest.raises(RequestError, match=r"messages\[1\]\.tool_calls: contains '<\|im_end\|>'"):
        tools_local.bind_tools([add]).invoke([HumanMessage("hi"), bad, ToolMessage("3", tool_call_id="c1")])
    nul = AIMessage("", tool_calls=[{"name": "add", "args": {"a": "\x00"}, "id": "c1", "type": "tool_call"}])
    with pytest.raises(RequestError, match=r"messages\[1\]\.tool_calls: contains a NUL"):
        tools_local.bind_tools([add]).invoke([HumanMessage("hi"), nul, ToolMessage("3", tool_call_id="c1")])


class Sum(BaseModel):
    """The sum of two numbers."""

    total: int


def test_structured_output_all_three_methods(closing_local):
    tools_local = closing_local
    question = [HumanMessage("What is 1 + 2?")]
    plain_tokens = tools_local.invoke(question).usage_metadata["input_tokens"]
    for method in ("json_schema", "function_calling", "json_mode"):
        out = tools_local.with_structured_output(Sum, method=method, include_raw=True).invoke(question)
        raw = out["raw"]
        assert isinstance(raw, AIMessage) and raw.usage_metadata["input_tokens"] > plain_tokens  # asked for
        if method == "json_mode":  # any JSON object (no schema enforced): it parses, the schema's keys may lack
            assert isinstance(json.loads(raw.content), dict)
        else:  # the schema enforced while decoding: even a random model's answer is a Sum
            assert isinstance(out["parsed"], Sum) and out["parsing_error"] is None, out
            assert isinstance(tools_local.with_structured_output(Sum, method=method).invoke(question), Sum)
        if method == "function_calling":  # a forced call of the tool named after the schema
            assert [c["name"] for c in raw.tool_calls] == ["Sum"]
    # json_schema's instruction carries the schema, at the end of the system turn
    fmt = tools_local.with_structured_output(Sum).first.kwargs["response_format"]
    turns = tools_local._prepare([SystemMessage("Be terse."), *question], None, {"response_format": fmt}).item.messages
    assert turns[0]["content"].startswith("Be terse.\n\nReply with a single JSON object")
    assert json.dumps(fmt["json_schema"]["schema"]) in turns[0]["content"] and turns[1:] == to_turns(question)
    array = {"type": "json_schema", "json_schema": {"name": "xs", "schema": {"type": "array", "items": {}}}}
    assert format_instruction(array).startswith("Reply with a single JSON array and nothing else")
    with pytest.raises(RequestError, match="method"):
        tools_local.with_structured_output(Sum, method="xml")
    with pytest.raises(RequestError, match="schema"):
        tools_local.with_structured_output(None, method="function_calling")


def test_tools_and_a_structured_answer_under_auto_give_a_call_or_the_answer(closing_local):
    """An agent's model with tools and a structured answer (``create_agent``'s ProviderStrategy
    binds both): each reply is valid calls or the answer, never neither. The whole reply was
    constrained to the answer's schema, so no tool could ever be called."""
    fmt = closing_local.with_structured_output(Sum).first.kwargs["response_format"]
    bound = closing_local.bind_tools([add, lookup], response_format=fmt)
    assert bound.kwargs["tool_choice"] is None
    for question in ("What is 1 + 2?", "Look up 'fox'.", "Sum 3 and 4", "Add", "Give data", "Total?"):
        msg = bound.invoke([HumanMessage(question)])
        if msg.tool_calls:
            assert not msg.invalid_tool_calls and not msg.content.strip(), msg
            assert {c["name"] for c in msg.tool_calls} <= {"add", "lookup"}
        else:
            assert type(Sum.model_validate_json(msg.content).total) is int, msg
    turns = closing_local._prepare([HumanMessage("x")], None, {**bound.kwargs}).item.messages
    assert turns[0]["content"].startswith("To call a tool, reply with the call and nothing else; to give your answer")


def test_a_reply_cut_short_by_max_new_tokens_is_returned_for_langchain_to_report(closing_local):
    """Out of tokens, a structured answer or a forced call is LangChain's to report: include_raw
    keeps the reply and says why in ``parsing_error``, a call cut short is an invalid call. It
    was a RequestError (as for bad parameters) that lost the reply."""
    short = closing_local.model_copy(update={"max_new_tokens": 3})
    out = short.with_structured_output(Sum, include_raw=True).invoke([HumanMessage("What is 1 + 2?")])
    assert out["parsed"] is None and out["parsing_error"] is not None
    assert out["raw"].response_metadata["finish_reason"] == "length" and out["raw"].usage_metadata["output_tokens"] == 3
    msg = short.bind_tools([add], tool_choice="any").invoke([HumanMessage("What is 1 + 2?")])
    assert not msg.tool_calls and len(msg.invalid_tool_calls) == 1, msg


def test_a_structured_reply_cut_short_is_an_error_not_the_part_that_parses(closing_local):
    """LangChain's JSON parsers read a reply cut short as what parses of it: '{"total": 1' (of
    12) was Sum(total=1), '{"tot' a dict schema's {}: answers the caller could not tell from
    whole ones. Each method's parser now refuses it, saying the reply was cut."""
    cut = AIMessage('{"total": 1', response_metadata={"finish_reason": "length"})
    scores = {"title": "scores", "type": "object", "properties": {"total": {"type": "integer"}}}
    for schema in (Sum, scores):
        for method in ("json_schema", "json_mode"):
            parser = closing_local.with_structured_output(schema, method=method).last
            with pytest.raises(OutputParserException, match="max_new_tokens"):
                parser.invoke(cut)
            assert parser.invoke(AIMessage('{"total": 12}')) in (Sum(total=12), {"total": 12})
    for finish, fix in (("context", "shorten the prompt"), ("stop", "drop that stop string")):
        with pytest.raises(OutputParserException, match=fix):
            parser.invoke(AIMessage('{"total": 1', response_metadata={"finish_reason": finish}))


def test_structured_output_keeps_a_dict_json_schema_as_it_is(closing_local):
    """A dict is a JSON schema already: a top-level array, enum or map (no ``properties``)
    is enforced as it is, not reduced to its title (which let any JSON through)."""
    question = [HumanMessage("Give data")]
    ints = {"title": "ints", "type": "array", "items": {"type": "integer"}}
    color = {"title": "color", "enum": ["red", "green"]}
    scores = {"title": "scores", "type": "object", "additionalProperties": {"type": "integer"}}
    for schema in (ints, color, scores):
        structured = closing_local.with_structured_output(schema)
        fmt = structured.first.kwargs["response_format"]["json_schema"]
        assert fmt["schema"] == schema and fmt["name"] == schema["title"]
        out = structured.invoke(question)
        if schema is ints:
            assert isinstance(out, list) and all(type(v) is int for v in out), out
        elif schema is color:
            assert out in ("red", "green"), out
        else:
            assert isinstance(out, dict) and all(type(v) is int for v in out.values()), out


def test_structured_output_reads_an_openai_function_or_tool_as_its_parameters(closing_local):
    """LangChain takes an OpenAI function or tool as a schema: its parameters are enforced and
    its name is the format's (the dict as a JSON schema constrained nothing, or failed)."""
    from langchain_core.utils.function_calling import convert_to_openai_function, convert_to_openai_tool

    for schema in (convert_to_openai_function(Sum), convert_to_openai_tool(Sum)):
        structured = closing_local.with_structured_output(schema)
        fmt = structured.first.kwargs["response_format"]["json_schema"]
        assert fmt["name"] == "Sum" and fmt["schema"]["properties"] == {"total": {"type": "integer"}}
        out = structured.invoke([HumanMessage("What is 1 + 2?")])
        assert set(out) == {"total"} and type(out["total"]) is int, out


@pytest.mark.parametrize("drafter", ["auto", "model", "lookup", "suffix", "grammar"])
def test_tool_calls_with_speculation_equal_k0_streamed_or_not(closing_local, drafter):
    """The tool-calling regression suite: with every drafter of the tiny pair (and all of them,
    chosen per iteration), a forced call and a structured answer are what k = 0 gives, invoked
    and streamed (the field's speculative decoders corrupt calls; an exact one must not)."""
    question = [HumanMessage("What is 1 + 2? Then look up 'fox'.")]
    plain = closing_local.model_copy(update={"k": 0})
    fast = closing_local.model_copy(update={"drafter": drafter})
    for choice in ("any", "lookup"):
        want = plain.bind_tools([add, lookup], tool_choice=choice).invoke(question)
        assert want.tool_calls, want  # (valid by construction)
        bound = fast.bind_tools([add, lookup], tool_choice=choice)
        got = bound.invoke(question)
        streamed = None
        for chunk in bound.stream(question):
            streamed = chunk if streamed is None else streamed + chunk
        for msg in (got, streamed):
            assert [(c["name"], c["args"]) for c in msg.tool_calls] == [(c["name"], c["args"]) for c in want.tool_calls]
            assert msg.content == want.content
    want = plain.with_structured_output(Sum).invoke(question)
    assert fast.with_structured_output(Sum).invoke(question) == want
