"""OpenAI Batch files in and out: the reader (lines -> job rows, a bad line fails its row
naming the field), the writer (checked with the ``openai`` package's own types; no network),
and a 20-row chat file with 2 bad rows through the real job path (`run`, embedded broker,
a local worker, the tiny pair)."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from helpers import invoke, jsonl

from specdec_llm import client
from specdec_llm.client.openai_batch import CHAT, COMPLETIONS, output_line
from specdec_llm.client.rows import InputError, check_rows, read_rows, to_request

openai_types = pytest.importorskip("openai.types", reason="the openai package checks the output lines")
from openai.types import BatchError, Completion  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402


def chat_line(custom_id: str, content="Say hello", **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], **body},
    }


def completion_line(custom_id: str, prompt="The quick brown fox", **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": COMPLETIONS,
        "body": {"model": "gpt-3.5-turbo-instruct", "prompt": prompt, **body},
    }


# -- in ----------------------------------------------------------------------------------------------
def test_lines_become_rows(tmp_path):
    rows = read_rows(
        jsonl(
            tmp_path / "batch.jsonl",
            chat_line(
                "c1",
                max_tokens=7,
                temperature=0.5,
                top_p=0.9,
                seed=3,
                stop="\n",
                n=1,
                logprobs=False,
                presence_penalty=0.0,
                user="u-1",
                metadata={"team": "a"},
                parallel_tool_calls=False,  # (asks nothing without tools)
            ),
            {
                "custom_id": "c2",
                "method": "POST",
                "url": CHAT,
                "body": {
                    "messages": [
                        {"role": "developer", "content": "Be brief."},
                        {
                            "role": "user",
                            "name": "ann",
                            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
                        },
                    ],
                    "max_completion_tokens": 9,
                    "max_tokens": 100,
                    "stop": ["a", "b"],
                },
            },
            completion_line("p1", max_tokens=5),
            completion_line("p2", prompt=["one prompt in a list"]),
            {"id": "ours", "prompt": "our own format, in the same file"},
        )
    )
    assert [(r.id, r.error, r.endpoint) for r in rows] == [
        ("c1", None, CHAT),
        ("c2", None, CHAT),
        ("p1", None, COMPLETIONS),
        ("p2", None, COMPLETIONS),
        ("ours", None, None),
    ]
    c1, c2, p1, p2, _ = rows
    assert c1.messages == [{"role": "user", "content": "Say hello"}] and c1.prompt is None
    assert c1.params == {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["\n"]}
    assert c2.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    assert c2.params == {"max_new_tokens": 9, "stop": ["a", "b"]}  # max_completion_tokens wins
    assert (p1.prompt, p1.params) == ("The quick brown fox", {"max_new_tokens": 5, "chat": False})
    assert p2.prompt == "one prompt in a list"
    stored = to_request("job", c1, {"max_new_tokens": 64})
    assert stored["params"]["_endpoint"] == CHAT and stored["params"]["max_new_tokens"] == 7


@pytest.mark.parametrize(
    "line, error",
    [
        (chat_line("x", tools=[{"type": "function", "function": {"name": "f"}}]), "body.tools: [{"),
        (chat_line("x", n=2), "body.n: 2 is not supported by specdec-llm; use 1 or leave it out"),
        (chat_line("x", n=True), "body.n: true is not supported"),
        (chat_line("x", logprobs=True, top_logprobs=2), "body.logprobs: true is not supported"),
        (
            chat_line("x", response_format={"type": "xml"}),
            "body.response_format: unknown type 'xml'",
        ),
        (chat_line("x", stream=True), "body.stream: true is not supported"),
        (chat_line("x", frequency_penalty=0.5), "body.frequency_penalty: 0.5 is not supported"),
        (
            chat_line("x", logit_bias={"50256": -100}),
            'body.logit_bias: {"50256": -100} is not supported by specdec-llm; use {}',
        ),
        (chat_line("x", temperature=-1), "body.temperature: -1 must be >= 0"),
        (chat_line("x", max_tokens=0), "body.max_tokens: "),
        (chat_line("x", max_completion_tokens="many"), "body.max_completion_tokens: "),
        (chat_line("x", seed=2**64), "body.seed: "),
        (chat_line("x", stop=[""]), "body.stop: "),
        (chat_line("x", prompt="also a prompt"), "body.prompt: not a field of /v1/chat/completions; use body.messages"),
        (
            chat_line("x", content=[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
            "body.messages[0].content[0]: 'image_url' parts are not supported",
        ),
        (chat_line("x", content="a\x00b"), "body.messages[0].content: contains a NUL character"),
        (
            {**chat_line("x"), "body": {"messages": [{"role": "tool", "content": "42", "tool_call_id": "t"}]}},
            "body.messages[0].tool_call_id: not supported",
        ),
        ({**chat_line("x"), "body": {"messages": []}}, "body.messages: must be a non-empty list"),
        (completion_line("x", prompt=["a", "b"]), "body.prompt: a list of 2 prompts is not supported"),
        (completion_line("x", prompt=[1, 2, 3]), "body.prompt: must be text"),
        (completion_line("x", echo=True), "body.echo: true is not supported"),
        (completion_line("x", suffix="end"), "body.suffix: not supported"),
        ({**chat_line("x"), "url": "/v1/embeddings"}, "url: '/v1/embeddings' is not supported"),
        ({**chat_line("x"), "method": "GET"}, "method: 'GET' is not supported; use POST"),
        ({**chat_line("x"), "body": "hello"}, "body: must be an object"),
        ({**chat_line("x"), "extra": 1}, "unknown field 'extra' in an OpenAI Batch line"),
        ({**chat_line("x"), "custom_id": 5}, "custom_id: must be non-empty text"),
    ],
)
def test_a_bad_line_fails_its_row_naming_the_field(tmp_path, line, error):
    rows = read_rows(jsonl(tmp_path / "batch.jsonl", chat_line("good"), line, chat_line("good too")))
    check_rows(rows, {})
    assert [r.error for r in rows[::2]] == [None, None]
    assert rows[1].error.startswith(error), rows[1].error


def test_a_custom_id_used_twice_refuses_the_file_naming_both_lines(tmp_path):
    """As OpenAI's Batch API does: its results are found by custom_id, and two output lines of
    one id (an answer and the duplicate's error) let a consumer's dict keep the error alone."""
    lines = [chat_line("q1"), chat_line("q2"), completion_line("q1")]
    with pytest.raises(InputError, match=r"batch.jsonl: custom_id 'q1' is on lines 1 and 3; give each request"):
        read_rows(jsonl(tmp_path / "batch.jsonl", *lines))


def test_one_stop_string_is_a_stop_in_our_own_rows_as_in_openai_lines(tmp_path):
    rows = read_rows(
        jsonl(tmp_path / "in.jsonl", {"prompt": "x", "stop": "o"}, {"prompt": "y", "params": {"stop": "."}})
    )
    check_rows(rows, {})
    assert [(r.error, r.params["stop"]) for r in rows] == [(None, ["o"]), (None, ["."])]


def test_fields_at_the_value_that_asks_for_nothing_are_accepted(tmp_path):
    """What SDKs send by default: no tools, tool_choice none, no logit bias, text only."""
    line = chat_line("x", tools=[], tool_choice="none", logit_bias={}, modalities=["text"])
    [row] = read_rows(jsonl(tmp_path / "batch.jsonl", line))
    check_rows([row], {})
    assert row.error is None


# -- out ---------------------------------------------------------------------------------------------
ITEM = {
    "id": "c1",
    "request_id": "job-1",
    "pair": "tiny",
    "status": "ok",
    "text": "Hello!",
    "finish_reason": "eos",
    "error": None,
    "prompt_tokens": 12,
    "output_tokens": 3,
    "tokens_per_s": 30.0,
    "acceptance_rate": 0.5,
    "mean_accepted_length": 2.0,
    "draft_tokens_proposed": 4,
    "draft_tokens_accepted": 2,
    "drafter": "model",
    "wall_time_s": 0.1,
    "time_to_first_token_s": 0.02,
    "endpoint": CHAT,
    "chat": None,
    "refused": False,
    "finished_at": datetime(2026, 5, 4, 9, 0),
    "metadata": None,
}


def check_line(line: dict, endpoint: str = CHAT):
    """An OpenAI Batch output line, as the openai package's types read it."""
    assert set(line) == {"id", "custom_id", "response", "error"}
    response = line["response"]
    if line["error"] is None:
        assert response["status_code"] == 200 and response["request_id"]
        model = ChatCompletion if endpoint == CHAT else Completion
        body = model.model_validate(response["body"])
        assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens
        return body
    error = BatchError.model_validate(line["error"])
    assert error.code and error.message
    if response is not None:
        assert response["status_code"] in (400, 500)
        assert response["body"]["error"]["message"] == error.message
    return error


def test_output_lines_read_as_openai_types():
    chat = check_line(output_line(ITEM))
    assert (chat.id, chat.object, chat.model, chat.created) == ("chatcmpl-job-1", "chat.completion", "tiny", 1777885200)
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == ("Hello!", "stop")
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (12, 3)
    assert chat.model_extra["specdec"]["acceptance_rate"] == 0.5 and chat.model_extra["specdec"]["drafter"] == "model"

    done = output_line({**ITEM, "endpoint": COMPLETIONS, "finish_reason": "context"})
    text = check_line(done, COMPLETIONS)
    assert (text.object, text.choices[0].text, text.choices[0].finish_reason) == ("text_completion", "Hello!", "length")

    refused = output_line(
        {
            **ITEM,
            "status": "failed",
            "refused": True,
            "text": None,
            "error": "line 7: body.tools: not supported by specdec-llm",
        }
    )
    error = check_line(refused)
    assert (error.code, error.param, error.line) == ("invalid_request", "tools", 7)
    assert refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["type"] == "invalid_request_error"

    too_long = output_line({**ITEM, "status": "failed", "text": None, "error": "prompt: context is 512 tokens"})
    assert (check_line(too_long).param, too_long["response"]["status_code"]) == ("prompt", 400)  # the worker's check
    crashed = output_line({**ITEM, "status": "failed", "text": None, "error": "timed out: generation took too long"})
    assert check_line(crashed).code == "generation_failed" and crashed["response"]["status_code"] == 500
    cancelled = output_line({**ITEM, "status": "cancelled", "text": None, "error": "cancelled"})
    assert check_line(cancelled).code == "batch_cancelled" and cancelled["response"] is None
    with pytest.raises(
        ValueError
    ):  # the types can fail (pydantic's ValidationError is a ValueError): a finish reason OpenAI does not have
        ChatCompletion.model_validate(
            {**chat.model_dump(), "choices": [{**chat.choices[0].model_dump(), "finish_reason": "eos"}]}
        )


# -- the whole job path ------------------------------------------------------------------------------
def test_a_20_row_batch_file_with_2_bad_rows_round_trips(embedded, tmp_path):
    """OpenAI Batch input -> `run` (the real job path: store, filesystem broker, a local worker
    process, the tiny pair) -> OpenAI Batch output: 18 completions and 2 errors, one line per
    input line, in order, each readable by the openai package's types."""
    lines = [
        chat_line(f"request-{i}", f"Say hello number {i}", max_tokens=4 + i % 3, **({"seed": i} if i % 2 else {}))
        for i in range(20)
    ]
    lines[5] = chat_line("request-5", tools=[{"type": "function", "function": {"name": "lookup"}}])
    lines[13] = chat_line("request-13", n=3)
    path = jsonl(tmp_path / "batch.jsonl", *lines)
    out = tmp_path / "batch.out.jsonl"
    res = invoke("run", path, "--pair", "tiny", "--format", "openai", "--out", out)
    assert res.exit_code == 0, res.output
    assert "18 ok, 2 failed" in res.output
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == [f"request-{i}" for i in range(20)]
    for i, line in enumerate(got):
        checked = check_line(line)
        if i in (5, 13):
            assert (checked.code, checked.param, checked.line) == ("invalid_request", "tools" if i == 5 else "n", i + 1)
            continue
        assert checked.choices[0].message.role == "assistant" and checked.model == "tiny"
        assert 1 <= checked.usage.completion_tokens <= 4 + i % 3  # max_tokens honoured
        assert checked.choices[0].finish_reason in ("stop", "length")
        specdec = checked.model_extra["specdec"]
        assert specdec["tokens_per_s"] > 0 and specdec["wall_time_s"] > 0
        assert specdec["speedup"] > 0 and specdec["speedup_basis"].startswith("same-process target-only")
    job = got[0]["response"]["request_id"].rsplit("-", 1)[0]
    again = invoke("results", job, "--format", "openai")  # the same lines from the store
    assert again.exit_code == 0 and [json.loads(line) for line in again.stdout.splitlines()] == got
    assert client.job_counts(job) == {"queued": 0, "running": 0, "ok": 18, "failed": 2, "cancelled": 0}


def test_a_messages_row_of_a_jsonl_job_is_a_chat_completion(embedded, tmp_path):
    """A JSON Lines row of chat messages (not an OpenAI Batch line) comes out as a chat
    completion in the openai format, a prompt row as a text completion (it was one too)."""
    path = jsonl(
        tmp_path / "in.jsonl", {"id": "m", "messages": [{"role": "user", "content": "hi"}]}, {"id": "p", "prompt": "hi"}
    )
    out = tmp_path / "out.jsonl"
    res = invoke("run", path, "--pair", "tiny", "--max-new-tokens", "4", "--format", "openai", "--out", out)
    assert res.exit_code == 0, res.output
    m, p = (json.loads(line) for line in out.read_text().splitlines())
    assert m["response"]["body"]["object"] == "chat.completion" and "message" in m["response"]["body"]["choices"][0]
    assert p["response"]["body"]["object"] == "text_completion"


def test_a_row_asking_for_plain_text_is_not_held_to_the_jobs_schema(tmp_path):
    """`response_format: {"type": "text"}` is OpenAI's "no constraint": a Batch line or one of
    our rows asking for it is decoded free, over the job's `--json-schema` (the Batch line got
    the job's schema; our row was refused as an unknown type)."""
    text = {"type": "text"}
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": text}
    path = jsonl(
        tmp_path / "b.jsonl",
        {"custom_id": "batch", "method": "POST", "url": CHAT, "body": body},
        {"id": "ours", "prompt": "hi", "response_format": text},
        {"id": "plain", "prompt": "hi"},
    )
    schema = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
    rows = read_rows(path)
    check_rows(rows, {"response_format": schema})
    assert [r.error for r in rows] == [None, None, None]
    formats = [to_request("j", r, {"response_format": schema})["params"]["response_format"] for r in rows]
    assert formats == [None, None, schema]


def test_a_worker_error_names_the_field_the_line_wrote(embedded, tmp_path):
    """A constrained row out of tokens fails in its worker with "...; raise max_new_tokens" (our
    name, not the line's): its result names the field the line wrote (body.max_tokens or
    body.max_completion_tokens, else body.max_tokens) and the fix, as errors found at submit do."""
    from specdec_llm import store
    from specdec_llm.engine import GenerationResult, Stats

    fmt = {"type": "json_object"}
    path = jsonl(
        tmp_path / "b.jsonl",
        chat_line("a", max_tokens=3, response_format=fmt),
        chat_line("b", max_completion_tokens=3, response_format=fmt),
        completion_line("c", response_format=fmt),
        completion_line("d"),
    )
    job = client.submit(path, "tiny")["job_id"]
    why = GenerationResult("{", [1, 2, 3], "length", Stats(), complete=False).incomplete()
    for i in (1, 2, 3):
        store.mark_request(f"{job}-{i}", "failed", error=f"response_format: {why}")  # (as its worker does)
    store.mark_request(f"{job}-4", "failed", error="prompt: is 600 tokens but the model's context is 512; shorten it")
    items = client.results(job)
    assert [i["error"].rsplit("; ", 1)[1] for i in items[:3]] == [
        "raise body.max_tokens",
        "raise body.max_completion_tokens",
        "raise body.max_tokens",  # (the job's max_new_tokens: the line's own field would raise it)
    ]
    assert items[0]["error"].startswith("body.response_format: the output is not complete after 3 tokens")
    assert items[3]["error"] == "body.prompt: is 600 tokens but the model's context is 512; shorten it"
    lines = [output_line(i) for i in items]
    assert [line["error"]["param"] for line in lines] == ["response_format"] * 3 + ["prompt"]
    assert "max_new_tokens" not in json.dumps(lines)
