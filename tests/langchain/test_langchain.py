"""The LangChain LLM and chat model: local mode (engine in this process) on the tiny pair,
and remote mode against a real worker subprocess and a private redis-server: invoke, a
batch of 10 in one submission, streaming from the worker while the request runs, async,
stop strings, callbacks, generation_info against the store's telemetry rows, and errors
(timeout, dead broker, unknown pair, bad parameters) that raise instead of hanging."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from conftest import tools_pair
from fleet import make_fleet
from helpers import free_port, wait_for
from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from sqlalchemy import select

from specdec_llm import client, store
from specdec_llm.engine import GenerationRequest, RequestError
from specdec_llm.langchain import (
    BrokerUnavailable,
    ChatSpecDec,
    GenerationFailed,
    GenerationTimeout,
    SpecDecLLM,
    job_id,
    to_turns,
)
from specdec_llm.settings import get_settings, reload_settings
from specdec_llm.store.models import Output, Request, Telemetry
from specdec_llm.store.testing import sqlite_url

PROMPTS = ["The quick brown fox", "Speculative decoding", "over the lazy dog", "drafts and verifies"]
INFO_KEYS = {
    "finish_reason",
    "prompt_tokens",
    "output_tokens",
    "acceptance_rate",
    "mean_accepted_length",
    "tokens_per_s",
    "time_to_first_token_s",
    "wall_time_s",
    "request_id",
    "job_id",
    "pair",
}


class Recorder(BaseCallbackHandler):
    def __init__(self):
        self.events, self.tokens, self.results = [], [], []

    def on_llm_start(self, serialized, prompts, **kw):
        self.events.append("start")

    def on_chat_model_start(self, serialized, messages, **kw):
        self.events.append("start")

    def on_llm_new_token(self, token, **kw):
        self.tokens.append(token)

    def on_llm_end(self, response, **kw):
        self.events.append("end")
        self.results.append(response)

    def on_llm_error(self, error, **kw):
        self.events.append("error")


class AsyncRecorder(AsyncCallbackHandler):
    def __init__(self):
        self.tokens = []

    async def on_llm_new_token(self, token, **kw):
        self.tokens.append(token)


def engine_text(prompt: str, **gen) -> str:
    """The tiny target's own answer through the engine, for comparison (a NUL is replaced,
    as the store does: a random tiny model does emit them)."""
    from specdec_llm import loaded

    return loaded.get("tiny").server.submit(GenerationRequest(prompt, **gen)).result().text.replace("\x00", "\ufffd")


def cut_point(text: str) -> str:
    """A stop string that occurs in the middle of ``text``."""
    assert len(text) > 12, text
    for i in range(len(text) // 2, len(text) - 3):
        stop = text[i : i + 3]
        if "\ufffd" not in stop and stop.strip():
            return stop
    raise AssertionError(f"no plain text to stop at in {text!r}")


# -- local mode ---------------------------------------------------------------------------------------
@pytest.fixture
def local(pairs_file, tmp_path, monkeypatch):
    for var in ("SPECDEC_BROKER_URL", "SPECDEC_RESULT_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPECDEC_DATABASE_URL", sqlite_url(tmp_path))
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / "data"))
    reload_settings()
    yield
    for var in ("SPECDEC_DATABASE_URL", "SPECDEC_DATA_DIR"):  # pairs_file's teardown reloads the settings
        monkeypatch.delenv(var)


def test_local_invoke_is_the_engine_and_is_recorded(local):
    llm = SpecDecLLM(pair="tiny", max_new_tokens=16, job_name="notebook", job_metadata={"who": "test"})
    assert llm.effective_backend() == "local"  # no broker configured
    res = llm.generate(["The quick brown fox"])
    gen = res.generations[0][0]
    assert gen.text == engine_text("The quick brown fox", max_new_tokens=16)
    info = gen.generation_info
    assert INFO_KEYS <= set(info) and info["pair"] == "tiny" and info["output_tokens"] > 0
    assert res.llm_output["model_name"] == "tiny"
    usage = res.llm_output["token_usage"]
    assert usage == {
        "prompt_tokens": info["prompt_tokens"],
        "completion_tokens": info["output_tokens"],
        "total_tokens": info["prompt_tokens"] + info["output_tokens"],
    }
    assert_matches_store(info, gen.text, metadata={"who": "test"})
    assert store.get_job(info["job_id"])["name"] == "notebook"


def test_local_stream_stop_and_callbacks(local):
    llm = SpecDecLLM(pair="tiny", max_new_tokens=40, record=False)
    full = llm.invoke(PROMPTS[1])
    rec = Recorder()
    chunks = list(llm.stream(PROMPTS[1], config={"callbacks": [rec]}))
    assert "".join(chunks) == full and len([c for c in chunks if c]) > 1
    assert "".join(rec.tokens) == full and rec.events == ["start", "end"]
    info = rec.results[0].generations[0][0].generation_info  # chunks added up: integers summed once
    assert info["output_tokens"] == llm.generate([PROMPTS[1]]).generations[0][0].generation_info["output_tokens"]
    stop = cut_point(full)
    expected = full[: full.find(stop)]
    assert llm.invoke(PROMPTS[1], stop=[stop]) == expected
    assert "".join(llm.stream(PROMPTS[1], stop=[stop])) == expected
    # one string is one stop string, not a list of its characters
    assert llm.invoke(PROMPTS[1], stop=stop) == expected and llm._get_ls_params(stop=stop)["ls_stop"] == [stop]
    assert "".join(llm.stream(PROMPTS[1], stop=stop)) == expected
    assert SpecDecLLM(pair="tiny", max_new_tokens=40, record=False, stop=[stop]).invoke(PROMPTS[1]) == expected
    # a consumer that stops early stops the generation; the model is free for the next call
    recorded = SpecDecLLM(pair="tiny", max_new_tokens=400, job_name="early-stop")
    for _ in recorded.stream(PROMPTS[0]):
        break
    assert llm.invoke(PROMPTS[1]) == full
    rows = lambda: client.job_requests(job_id("early-stop", "tiny"), outputs=False)  # noqa: E731
    wait_for(lambda: rows()[0]["status"] == "cancelled", 10)
    streaming = SpecDecLLM(pair="tiny", max_new_tokens=40, record=False, streaming=True)
    rec = Recorder()
    assert streaming.invoke(PROMPTS[1], config={"callbacks": [rec]}) == full and "".join(rec.tokens) == full
    arec = AsyncRecorder()  # ainvoke too: the same tokens, and the same figures as generate's
    assert asyncio.run(streaming.ainvoke(PROMPTS[1], config={"callbacks": [arec]})) == full
    assert "".join(arec.tokens) == full and len(arec.tokens) > 1
    result = asyncio.run(streaming.agenerate([PROMPTS[1]]))
    assert result.llm_output["token_usage"]["completion_tokens"] == info["output_tokens"]


def test_local_chat_model(local):
    chat = ChatSpecDec(pair="tiny", max_new_tokens=24, record=False)
    messages = [SystemMessage("You are terse."), HumanMessage("The quick brown fox")]
    msg = chat.invoke(messages)
    from specdec_llm import loaded
    from specdec_llm.engine.chat import render_chat

    pair = loaded.get("tiny")
    ids = render_chat(pair.tokenizer, to_turns(messages))
    answer = pair.server.submit(GenerationRequest(ids, max_new_tokens=24)).result().text
    assert msg.content == answer.replace("\x00", "\ufffd")
    assert msg.usage_metadata["input_tokens"] == len(ids)
    assert msg.usage_metadata["total_tokens"] == len(ids) + msg.usage_metadata["output_tokens"]
    assert msg.response_metadata["model_name"] == "tiny" and msg.response_metadata["finish_reason"]
    full = None
    for chunk in chat.stream(messages):
        full = chunk if full is None else full + chunk
    assert full.content == msg.content and full.usage_metadata == msg.usage_metadata
    with pytest.raises(RequestError, match="text only"):
        chat.invoke([HumanMessage(content=[{"type": "image", "url": "http://x/y.png"}])])


def run_counting_loop_ticks(coro):
    """Run ``coro``; return (how often a 1 ms ticker ran meanwhile, its result): a blocked
    event loop would tick about once."""

    async def main():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        try:
            result = await coro
            return ticks, result
        finally:
            done.set()
            await task

    return asyncio.run(main())


def test_a_cancelled_async_call_stops_its_generation(local):
    """``asyncio.wait_for(llm.ainvoke(...), 0.3)``, or a client gone: the thread that ran the call
    could not be cancelled, so the engine decoded on to the end. The call is abandoned now: its
    row is cancelled at the engine's next step, and the server is idle."""
    from specdec_llm import loaded

    for model in (SpecDecLLM, ChatSpecDec):
        llm = model(pair="tiny", max_new_tokens=480, k=0, job_name=f"lc-gone-{model.__name__}")
        llm.invoke(PROMPTS[2], max_new_tokens=1)  # (loaded)
        t = time.perf_counter()  # (the whole call, unrecorded: the abandoned one waits a third of it)
        model(pair="tiny", max_new_tokens=480, k=0, record=False).invoke(PROMPTS[2])
        asyncio.run(leave(llm, (time.perf_counter() - t) / 3))
        jid = job_id(llm.job_name, "tiny")
        statuses = lambda: sorted((r["status"], r["error"] or "") for r in client.job_requests(jid, outputs=False))  # noqa: B023, E731
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: statuses()[0][0] == "cancelled", timeout=5)  # noqa: B023
        assert [s for s, _ in statuses()] == ["cancelled", "ok"] and "the caller stopped waiting" in statuses()[0][1]
        wait_for(lambda: not loaded.get("tiny").server.rows, timeout=2)


async def leave(llm: SpecDecLLM | ChatSpecDec, timeout: float) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(llm.ainvoke(PROMPTS[2]), timeout=timeout)


def test_local_async_does_not_block_the_loop(local):
    llm = SpecDecLLM(pair="tiny", max_new_tokens=200, record=False)

    async def work():
        text = await llm.ainvoke(PROMPTS[0])
        rec = AsyncRecorder()
        streamed = "".join([c async for c in llm.astream(PROMPTS[0], config={"callbacks": [rec]})])
        many = await llm.abatch(PROMPTS[:2])
        return text, streamed, rec.tokens, many

    ticks, (text, streamed, tokens, many) = run_counting_loop_ticks(work())
    assert text == streamed == "".join(tokens) == llm.invoke(PROMPTS[0])
    assert many == [llm.invoke(p) for p in PROMPTS[:2]]
    assert ticks > 5  # the loop kept running while the model generated


def test_bad_input_raises_before_any_work(local):
    llm = SpecDecLLM(pair="tiny", record=False)
    with pytest.raises(RequestError, match="temperature"):
        SpecDecLLM(pair="tiny", temperature=-1).invoke("hi")
    with pytest.raises(RequestError, match="temperature: inf is not a finite number; it must be >= 0"):
        SpecDecLLM(pair="tiny", temperature=float("inf"))
    with pytest.raises(RequestError, match="max_new_tokens"):
        llm.invoke("hi", max_new_tokens=0)
    with pytest.raises(RequestError, match="unknown option"):
        llm.invoke("hi", max_tokenz=3)
    with pytest.raises(RequestError, match="unknown pair 'nope'"):
        SpecDecLLM(pair="nope").invoke("hi")
    with pytest.raises(RequestError, match="prompt"):
        llm.invoke("   ")
    with pytest.raises(ValueError):  # a misspelt field
        SpecDecLLM(pair="tiny", max_tokens_new=3)
    with pytest.raises(GenerationTimeout, match="timeout"):
        SpecDecLLM(pair="tiny", max_new_tokens=400, timeout=1e-4, record=False).invoke(PROMPTS[0])
    params = llm._identifying_params
    assert params["pair"] == "tiny" and params["target"].endswith("target") and params["backend"] == "local"
    ls = llm._get_ls_params(stop=["x"])
    assert ls["ls_provider"] == "specdec" and ls["ls_model_name"] == "tiny" and ls["ls_stop"] == ["x"]


def twenty_with_two_bad() -> list[str]:
    """20 prompts: a NUL character in prompt 7 (no store keeps it), prompt 12 over the tiny
    target's context (512)."""
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(20)]
    prompts[7] = "a NUL \x00 here"
    prompts[12] = " ".join(f"zq{i}" for i in range(400))
    return prompts


def assert_fail_alone(llm: SpecDecLLM, over_context: type[Exception]) -> None:
    """Issue 45, item 2: one bad prompt fails alone in batch, abatch and generate."""
    prompts = twenty_with_two_bad()
    good = [i for i in range(20) if i not in (7, 12)]
    expected = [engine_text(prompts[i], max_new_tokens=llm.max_new_tokens) for i in good]
    out = llm.batch(prompts, return_exceptions=True)
    assert isinstance(out[7], RequestError) and "NUL" in str(out[7]), out[7]
    assert isinstance(out[12], over_context) and "context is 512" in str(out[12]), out[12]
    assert [out[i] for i in good] == expected  # every other prompt its own text
    assert asyncio.run(llm.abatch(prompts, return_exceptions=True))[:7] == out[:7]
    parts = llm.batch(prompts, config={"max_concurrency": 8}, return_exceptions=True)
    assert isinstance(parts[7], RequestError) and isinstance(parts[12], over_context)
    assert [parts[i] for i in good] == expected
    named = r"prompt 7 of 20: 'a NUL \\x00 here'; 1 other prompt failed too; 18 generated"
    with pytest.raises(RequestError, match=named):  # the error names the bad prompt
        llm.batch(prompts)
    with pytest.raises(RequestError, match=named):
        llm.generate(prompts)
    with pytest.raises(over_context, match=r"context is 512.*prompt 0 of 2: 'zq0 zq1"):
        llm.generate([prompts[12], PROMPTS[0]])
    with pytest.raises(RequestError, match="NUL") as one:  # one prompt: its own error, as it was
        llm.invoke(prompts[7])
    assert "of 1" not in str(one.value)


def test_one_bad_prompt_fails_alone_in_process(local):
    assert_fail_alone(SpecDecLLM(pair="tiny", max_new_tokens=4, job_name="lc-alone"), RequestError)
    rows = client.job_requests(job_id("lc-alone", "tiny"), outputs=False)
    assert {r["status"] for r in rows} == {"ok", "failed"}  # the row over the context failed, recorded
    assert all("context is 512" in r["error"] for r in rows if r["status"] == "failed")


# -- remote mode: a real worker -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def lc_pairs(tiny_pair_dir, closing_tools_pair_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lc_pairs") / "pairs.toml"
    target, draft = tiny_pair_dir / "target", tiny_pair_dir / "draft"
    path.write_text(
        f'[pairs.tiny]\ntarget = "{target}"\ndraft = "{draft}"\n'
        f'[pairs.tiny-idle]\ntarget = "{target}"\ndraft = "{draft}"\n'
        + tools_pair("tiny-tools", closing_tools_pair_dir)
    )  # no worker serves tiny-idle
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, redis_url, lc_pairs):
    folder = tmp_path_factory.mktemp("lc_fleet")
    fleet = make_fleet(folder, redis_url, 0, sqlite_url(folder), lc_pairs)
    fleet.start_worker()
    yield fleet
    fleet.stop()


@pytest.fixture
def remote(fleet, use):
    use(fleet)
    # the worker is up once it answers (its first task waits for the pair to load)
    SpecDecLLM(pair="tiny", max_new_tokens=1, timeout=120).invoke("warm up")
    return fleet


def assert_matches_store(info: dict, text: str, metadata=None) -> None:
    with store.session_scope() as s:
        tel = s.execute(select(Telemetry).where(Telemetry.request_id == info["request_id"])).scalar_one()
        out = s.execute(select(Output).where(Output.request_id == info["request_id"])).scalar_one()
        req = s.execute(select(Request).where(Request.id == info["request_id"])).scalar_one()
    assert out.text == text and out.finish_reason == info["finish_reason"] == tel.finish_reason
    for name in ("prompt_tokens", "output_tokens"):
        assert getattr(tel, name) == getattr(out, name) == info[name]
    for name in ("acceptance_rate", "mean_accepted_length", "tokens_per_s", "time_to_first_token_s", "wall_time_s"):
        assert getattr(tel, name) == pytest.approx(info[name])
    assert req.job_id == tel.job_id == info["job_id"] and req.status == "ok"
    if metadata is not None:
        assert req.params["_metadata"] == metadata and req.params["_source"] == "langchain"


def test_remote_invoke_matches_local_and_the_store(remote):
    llm = SpecDecLLM(pair="tiny", max_new_tokens=16, job_name="lc-remote", job_metadata={"team": "search"})
    assert llm.effective_backend() == "remote"  # SPECDEC_BROKER_URL is set
    res = llm.generate([PROMPTS[0]])
    gen = res.generations[0][0]
    assert gen.text == engine_text(PROMPTS[0], max_new_tokens=16)  # the same as local mode
    assert gen.text == SpecDecLLM(pair="tiny", max_new_tokens=16, backend="local", record=False).invoke(PROMPTS[0])
    assert INFO_KEYS <= set(gen.generation_info)
    assert_matches_store(gen.generation_info, gen.text, metadata={"team": "search"})
    rows = store.summary(group_by=("job",), job=gen.generation_info["job_id"])
    assert rows[0]["ok"] >= 1  # LangChain traffic in the report, under its job


def test_remote_batch_of_10_is_one_submission(remote, monkeypatch):
    calls = []
    real = client.enqueue
    monkeypatch.setattr(client, "enqueue", lambda ids, pair, **kw: calls.append(list(ids)) or real(ids, pair, **kw))
    llm = SpecDecLLM(pair="tiny", max_new_tokens=8, job_name="lc-batch")
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(10)]
    texts = llm.batch(prompts)
    assert len(calls) == 1 and len(calls[0]) == 10  # one submission, not one round trip per prompt
    assert texts == [engine_text(p, max_new_tokens=8) for p in prompts]
    res = llm.generate(prompts)
    assert len(calls) == 2
    infos = [g[0].generation_info for g in res.generations]
    assert len({i["request_id"] for i in infos}) == 10 and len({i["job_id"] for i in infos}) == 1
    usage = res.llm_output["token_usage"]
    assert usage["completion_tokens"] == sum(i["output_tokens"] for i in infos)
    for gens in res.generations[:3]:
        assert_matches_store(gens[0].generation_info, gens[0].text)


def test_remote_stream_arrives_while_the_worker_generates(remote):
    llm = SpecDecLLM(pair="tiny", max_new_tokens=400)
    rec = Recorder()
    arrivals, chunks = [], []
    for chunk in llm.stream(PROMPTS[2], config={"callbacks": [rec]}):
        chunks.append(chunk)
        arrivals.append(datetime.now(UTC).replace(tzinfo=None))
    text = "".join(chunks)
    assert text == engine_text(PROMPTS[2], max_new_tokens=400)
    assert "".join(rec.tokens) == text and rec.events == ["start", "end"]
    info = rec.results[0].generations[0][0].generation_info
    assert INFO_KEYS <= set(info)
    assert_matches_store(info, text)
    req = store.get_request(info["request_id"])
    pieces = [i for i, c in enumerate(chunks) if c]
    assert len(pieces) > 3
    # the first text came from the worker before it had finished the request (not a replay)
    assert arrivals[pieces[0]] < req["finished_at"], (arrivals[pieces[0]], req["finished_at"], info["wall_time_s"])


def test_a_remote_stream_whose_consumer_stops_reading_stops_its_row(remote):
    """An agent that has what it needs stops reading: its row alone is cancelled and the worker
    ends it at its next iteration (not at max_new_tokens), keeping what it had."""
    llm = SpecDecLLM(pair="tiny", max_new_tokens=480, job_name="lc-stops")
    stream = llm.stream(PROMPTS[2])
    assert next(c for c in stream if c)
    stream.close()
    jid = job_id("lc-stops", "tiny")
    wait_for(lambda: client.job_requests(jid)[0]["status"] != "running", timeout=60)
    [row] = client.job_requests(jid)
    full = engine_text(PROMPTS[2], max_new_tokens=480)
    assert row["status"] == "cancelled" and "its caller cancelled it" in row["error"], row
    assert full.startswith(row["text"]) and len(row["text"]) < len(full)
    # nothing left in Redis: its stream (the reader deleted it; the worker's writes do not make it
    # again) and its task's result (no one reads it: 7 days of a partial text, per call)
    import redis

    from specdec_llm.client.streams import stream_key

    r = redis.Redis.from_url(get_settings().broker_url)
    assert not r.exists(stream_key(row["id"]))
    assert not [k for k in r.scan_iter("celery-task-meta-*") if row["id"].encode() in (r.get(k) or b"")]
    assert llm.invoke(PROMPTS[2]) == full  # the job's other calls are not stopped


def test_a_remote_call_interrupted_cancels_its_rows(remote, monkeypatch):
    """Ctrl-C (or the store gone) while a remote invoke waits: its rows are cancelled, as a
    timeout's are; they ran on to max_new_tokens, read by no one."""
    from specdec_llm.langchain.remote import RemoteBackend

    def interrupted(self, rid, result, call):
        raise KeyboardInterrupt

    monkeypatch.setattr(RemoteBackend, "_wait", interrupted)
    llm = SpecDecLLM(pair="tiny-idle", max_new_tokens=8, job_name="lc-ctrl-c")  # (no worker: queued)
    with pytest.raises(KeyboardInterrupt):
        llm.batch(["one", "two"])
    rows = client.job_requests(job_id("lc-ctrl-c", "tiny-idle"), outputs=False)
    assert [(r["status"], r["error"]) for r in rows] == [
        ("cancelled", "cancelled: the LangChain call ended (KeyboardInterrupt)")
    ] * 2


def test_an_async_stream_abandoned_before_its_first_text_cancels_its_row(remote):
    """No worker serves the pair yet, so the row waits in the queue; its consumer goes away (a web
    client disconnected): the row is cancelled and the thread that followed its stream ends."""
    import threading

    async def consume_then_leave():
        agen = SpecDecLLM(pair="tiny-idle", max_new_tokens=8, job_name="lc-gone").astream("hi")
        first = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(1.0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await agen.aclose()

    asyncio.run(consume_then_leave())
    rows = lambda: client.job_requests(job_id("lc-gone", "tiny-idle"), outputs=False)  # noqa: E731
    wait_for(lambda: [r["status"] for r in rows()] == ["cancelled"], timeout=10)
    wait_for(lambda: not any(t.name == "specdec-async" for t in threading.enumerate()), timeout=10)


def test_a_remote_reply_cut_short_is_returned_for_langchain_to_report(remote):
    """A structured answer out of tokens, in the worker: the row is a LangChain call's, so its
    reply comes back (``parsing_error`` says why), where a job's row would fail."""
    from pydantic import BaseModel

    class Sum(BaseModel):
        total: int

    chat = ChatSpecDec(pair="tiny", max_new_tokens=2, timeout=120)
    out = chat.with_structured_output(Sum, include_raw=True).invoke("What is 1 + 2?")
    assert out["parsing_error"] is not None and out["raw"].response_metadata["finish_reason"] == "length", out


def test_remote_stop_strings_every_path(remote):
    llm = SpecDecLLM(pair="tiny", max_new_tokens=40)
    full = llm.invoke(PROMPTS[3])
    stop = cut_point(full)
    expected = full[: full.find(stop)]
    assert llm.invoke(PROMPTS[3], stop=[stop]) == expected
    assert llm.batch([PROMPTS[3], PROMPTS[3]], stop=[stop]) == [expected, expected]
    assert "".join(llm.stream(PROMPTS[3], stop=[stop])) == expected
    chat = ChatSpecDec(pair="tiny", max_new_tokens=40)
    answer = chat.invoke(PROMPTS[3]).content
    if len(answer) > 12:
        chat_stop = cut_point(answer)
        assert chat.invoke(PROMPTS[3], stop=[chat_stop]).content == answer[: answer.find(chat_stop)]


def test_remote_async(remote, monkeypatch):
    calls = []
    real = client.enqueue
    monkeypatch.setattr(client, "enqueue", lambda ids, pair, **kw: calls.append(list(ids)) or real(ids, pair, **kw))
    llm = SpecDecLLM(pair="tiny", max_new_tokens=48)

    async def work():
        one = await llm.ainvoke(PROMPTS[0])
        many = await llm.abatch(PROMPTS)
        rec = AsyncRecorder()
        streamed = [c async for c in llm.astream(PROMPTS[1], config={"callbacks": [rec]})]
        return one, many, streamed, rec.tokens

    ticks, (one, many, streamed, tokens) = run_counting_loop_ticks(work())
    assert one == engine_text(PROMPTS[0], max_new_tokens=48)
    assert many == [engine_text(p, max_new_tokens=48) for p in PROMPTS]
    assert "".join(streamed) == "".join(tokens) == engine_text(PROMPTS[1], max_new_tokens=48)
    assert [len(c) for c in calls] == [1, 4, 1]  # abatch: one submission
    assert ticks > 10


def test_remote_chat_model(remote):
    chat = ChatSpecDec(pair="tiny", max_new_tokens=24, job_name="lc-chat")
    messages = [SystemMessage("You are terse."), HumanMessage("over the lazy dog")]
    local = ChatSpecDec(pair="tiny", max_new_tokens=24, backend="local", record=False).invoke(messages)
    msg = chat.invoke(messages)
    assert msg.content == local.content and msg.usage_metadata == local.usage_metadata
    assert_matches_store(msg.response_metadata, msg.content)
    full = None
    for chunk in chat.stream(messages):
        full = chunk if full is None else full + chunk
    assert full.content == msg.content and full.usage_metadata == msg.usage_metadata


def test_remote_one_bad_prompt_fails_alone(remote, monkeypatch):
    calls = []
    real = client.enqueue
    monkeypatch.setattr(client, "enqueue", lambda ids, pair, **kw: calls.append(list(ids)) or real(ids, pair, **kw))
    assert_fail_alone(SpecDecLLM(pair="tiny", max_new_tokens=4, job_name="lc-alone"), GenerationFailed)
    assert len(calls[0]) == 19  # one submission of every prompt but the one no store keeps


def test_remote_errors_are_raised_not_waited_out(remote, use, monkeypatch):
    with pytest.raises(RequestError, match="unknown pair"):
        SpecDecLLM(pair="nope").invoke("hi")
    with pytest.raises(RequestError, match="top_p"):
        SpecDecLLM(pair="tiny", top_p=0).invoke("hi")
    # the worker refuses a prompt longer than the tiny target's context (512)
    with pytest.raises(GenerationFailed, match="context is 512"):
        SpecDecLLM(pair="tiny").invoke(" ".join(f"zq{i}" for i in range(400)))
    # no worker serves this pair: a timeout, and the row is cancelled
    t0 = time.monotonic()
    with pytest.raises(GenerationTimeout, match="worker"):
        SpecDecLLM(pair="tiny-idle", timeout=1.5, job_name="lc-idle").invoke("hi")
    assert time.monotonic() - t0 < 10
    assert [r["status"] for r in client.job_requests(job_id("lc-idle", "tiny-idle"), outputs=False)] == ["cancelled"]
    with pytest.raises(GenerationTimeout):
        list(SpecDecLLM(pair="tiny-idle", timeout=1.0).stream("hi"))
    # a dead broker: a clear error, quickly, and the row is failed
    dead = f"redis://127.0.0.1:{free_port()}/0"
    use(remote, SPECDEC_BROKER_URL=dead)
    t0 = time.monotonic()
    with pytest.raises(BrokerUnavailable, match="unreachable"):
        SpecDecLLM(pair="tiny", job_name="lc-dead").invoke("hi")
    assert time.monotonic() - t0 < 30
    [row] = client.job_requests(job_id("lc-dead", "tiny"), outputs=False)
    assert row["status"] == "failed" and "unreachable" in row["error"]


def test_remote_tool_calls_match_local(remote):
    """Tools, a tool conversation and a prefill travel with the row and are rendered by the
    worker's chat template; the calls are read here, so both modes give the same message."""
    history = [
        HumanMessage("What is 1 + 2?"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}]),
        ToolMessage("3", tool_call_id="c1", name="add"),
    ]

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    remote.start_worker("tools-worker", args=("--pair", "tiny-tools"))  # the last --pair wins
    ChatSpecDec(pair="tiny-tools", max_new_tokens=1, timeout=120).invoke("warm up")
    for choice in ("auto", "any"):
        chat = ChatSpecDec(pair="tiny-tools", max_new_tokens=64, job_name="lc-tools").bind_tools(
            [add], tool_choice=choice
        )
        local = ChatSpecDec(pair="tiny-tools", max_new_tokens=64, backend="local", record=False)
        expected = local.bind_tools([add], tool_choice=choice).invoke(history)
        msg = chat.invoke(history)
        assert msg.usage_metadata == expected.usage_metadata  # the same prompt: tools, tool turns, prefill
        assert msg.content == expected.content
        for got, want in ((msg.tool_calls, expected.tool_calls), (msg.invalid_tool_calls, expected.invalid_tool_calls)):
            assert [(c["name"], c["args"]) for c in got] == [(c["name"], c["args"]) for c in want]
        if choice == "any":
            assert len(msg.tool_calls) + len(msg.invalid_tool_calls) >= 1
        full = None
        for chunk in chat.stream(history):
            full = chunk if full is None else full + chunk
        assert full.content == msg.content and [c["name"] for c in full.tool_calls] == [
            c["name"] for c in msg.tool_calls
        ]
        assert len(full.invalid_tool_calls) == len(msg.invalid_tool_calls)
