"""Each example runs as a person would run it (a fresh data directory, the embedded broker,
no server), with the tiny pair and few tokens so it is quick; plus the agent's tools."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tools_pair

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def tiny_long(tiny_pair_dir, tmp_path_factory) -> Path:
    """The tiny pair with a 4096-token context: the agent's instructions alone are ~630
    tokens for its 512-token BPE (the real pair's context is 8192)."""
    root = tmp_path_factory.mktemp("tiny_long")
    for name in ("target", "draft"):
        shutil.copytree(tiny_pair_dir / name, root / name)
        config = json.loads((root / name / "config.json").read_text())
        config["max_position_embeddings"] = 4096
        (root / name / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture
def run_example(tiny_long, closing_tools_pair_dir, tmp_path):
    pairs = tmp_path / "pairs.toml"
    pairs.write_text(
        f'[pairs.tiny]\ntarget = "{tiny_long / "target"}"\ndraft = "{tiny_long / "draft"}"\n'
        # its chat template renders tools, and its models close the JSON they open (agent.py)
        + tools_pair("tiny-tools", closing_tools_pair_dir)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    env.update(
        SPECDEC_DATA_DIR=str(tmp_path / "data"),
        SPECDEC_CONFIG_FILE=str(pairs),
        SPECDEC_DEFAULT_PAIR="tiny",
        SPECDEC_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    )

    def run(name: str, *args: str, timeout: float = 180) -> str:
        proc = subprocess.run(
            [sys.executable, str(EXAMPLES / name), *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout + proc.stderr

    return run


def test_chain(run_example):
    out = run_example("chain.py", "--max-new-tokens", "8")  # the pair from SPECDEC_DEFAULT_PAIR
    assert "# pair tiny, local mode" in out
    assert "## invoke" in out and "## batch" in out and "## stream" in out
    assert out.count("\n- ") >= 3  # one answer per topic of the batch


def test_chain_through_a_local_worker(run_example):
    # remote mode over the embedded broker: the stream comes from the worker through files
    out = run_example("chain.py", "--worker", "--max-new-tokens", "16")
    assert "started a local worker for tiny" in out and "# pair tiny, remote mode" in out
    pieces = int(re.search(r"\((\d+) pieces", out).group(1))
    assert pieces > 1


def test_bulk_documents_job_and_export(run_example, tmp_path):
    out = run_example("bulk_documents.py", "--pair", "tiny", "--max-new-tokens", "8", "--out", "docs")
    docs = tmp_path / "docs"
    results = [json.loads(line) for line in (docs / "results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in results] == ["kv-cache", "speculative", "tokenizers", "quantization", "batching"]
    assert all(r["status"] == "ok" and r["output_tokens"] > 0 for r in results)
    assert all(0 < r["time_to_first_token_s"] <= r["wall_time_s"] for r in results)  # stats a user sees per row
    assert results[1]["metadata"]["topic"] == "speculative decoding"
    assert sorted(p.name for p in docs.glob("*.md")) == sorted(f"{r['id']}.md" for r in results)
    assert (docs / "speculative.md").read_text().startswith("# speculative decoding\n")
    assert "started a local worker for tiny" in out and "5 documents" in out
    again = run_example("bulk_documents.py", "--pair", "tiny", "--max-new-tokens", "8", "--out", "docs")
    assert "0 to generate, 5 done before" in again and "started a local worker" not in again  # resumed


def test_agent_runs_to_completion_and_every_call_parses(run_example):
    """examples/agent.py: create_agent over ChatSpecDec with two tools, on the tiny pair whose
    template renders them (a random model: the first model call must call a tool, and the
    grammar makes it a valid one; what it does after that is its own)."""
    out = run_example(
        "agent.py", "What is 6 * 7?", "--pair", "tiny-tools", "--max-new-tokens", "96", "--max-steps", "2"
    )
    assert "# pair tiny-tools, local mode" in out and "--- model" in out
    summary = re.search(r"(\d+) model calls, (\d+) tool calls \((\d+) parsed, (\d+) invalid\)", out)
    assert summary, out
    model_calls, calls, parsed, invalid = map(int, summary.groups())
    assert 1 <= model_calls <= 2 and calls == parsed >= 1 and invalid == 0, out


def test_agent_on_a_pair_whose_template_has_no_tools_says_so(run_example):
    with pytest.raises(AssertionError, match="exited 2") as failed:
        run_example("agent.py", "--pair", "tiny", "--max-new-tokens", "4")
    assert "chat template does not render tools" in str(failed.value)


def test_report_on_a_fresh_store(run_example):
    out = run_example("report.py", "--max-new-tokens", "8")
    assert "running 2 prompts through SpecDecLLM (tiny) first" in out
    assert "(example-report): 2 ok / 0 failed" in out


def test_custom_drafter(run_example):
    """A drafter defined outside the package, registered and run through a pair: it
    proposes (each prompt ends with a phrase's start) and the outputs are the target's."""
    out = run_example("custom_drafter.py", "--max-new-tokens", "12")
    assert "3/3 outputs token-identical to the target decoding alone" in out, out
    proposed = [int(n) for n in re.findall(r"phrases proposed +(\d+)", out)]
    assert len(proposed) == 3 and all(proposed), out


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agent_tools():
    agent = _load("agent")
    assert agent.calculator.invoke({"expression": " 17 * 23 + 4"}) == "17 * 23 + 4 = 395"  # (what it computed)
    assert agent.calculator.invoke({"expression": "2 ** 10"}) == "2 ** 10 = 1024"
    assert agent.calculator.invoke({"expression": "2^10"}) == "2^10 = 1024"  # a power, as models write it
    assert agent.calculator.invoke({"expression": "7 / 2"}) == "7 / 2 = 3.5"
    assert agent.calculator.invoke({"expression": "__import__('os')"}).startswith("error")
    assert agent.calculator.invoke({"expression": "True + 1"}).startswith("error")
    assert agent.lookup.invoke({"term": " KV Cache "}).startswith("kv cache: the keys and values")
    assert agent.lookup.invoke({"term": "nope"}).startswith("no entry for 'nope'")
    draft = "draft: " + agent.GLOSSARY["draft"]
    sd = "speculative decoding: " + agent.GLOSSARY["speculative decoding"]
    assert agent.lookup.invoke({"term": "Speculative-Decoding"}) == sd
    assert agent.lookup.invoke({"term": "the draft"}) == agent.lookup.invoke({"term": "drafts"}) == draft
    assert agent.lookup.invoke({"term": "small model"}).startswith("no entry")


@pytest.mark.parametrize("after_result", ["repeat", "empty"])
def test_agent_asks_for_an_answer_instead_of_a_repeated_call_or_an_empty_reply(after_result):
    """A model that, once it has a result, calls the calculator again (Qwen2.5-Coder 1.5B did)
    or replies with nothing (it did that too) is asked once more with no tools shown: the
    repeat is not run, and that answer ends the loop; and its first call is forced (it is
    shown tools with tool_choice "any"). A scripted model stands in: no real model repeats a
    call or falls silent on demand."""
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.outputs import ChatGeneration, ChatResult

    agent = _load("agent")
    choices = []

    class Scripted(BaseChatModel):
        """Shown tools: calls the calculator, or after a result does ``after_result``; shown
        none: answers from the last result."""

        @property
        def _llm_type(self) -> str:
            return "scripted"

        def bind_tools(self, tools, tool_choice=None, **kwargs):
            choices.append(tool_choice)
            return self.bind(shown=[t.name for t in tools])

        def _generate(self, messages, stop=None, run_manager=None, shown=None, **kwargs):
            call = {"name": "calculator", "args": {"expression": "2^20"}, "id": f"c{len(messages)}"}
            if not shown:  # (asked in words to answer)
                result = next(m for m in reversed(messages) if isinstance(m, ToolMessage))
                assert messages[-1].type == "human" and "Answer the question now" in messages[-1].content
                reply = AIMessage(f"So {result.content}.")
            elif after_result == "empty" and isinstance(messages[-1], ToolMessage):
                reply = AIMessage("")
            else:
                reply = AIMessage("", tool_calls=[call])
            return ChatResult(generations=[ChatGeneration(message=reply)])

    result = agent.run(Scripted(), "What is 2 to the power of 20?", max_steps=4, log=lambda *_: None)
    assert [c["args"] for c in result["calls"]] == [{"expression": "2^20"}]
    assert result["answer"] == "So 2^20 = 1048576." and result["model_calls"] == 2 and result["stopped"] is None
    assert choices[0] == "any" and choices[1:] == [None]
