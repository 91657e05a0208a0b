"""Shared fixtures: tiny random Llama models (speed) and the real SmolLM2 pair (truth)."""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)  # tiny models gain nothing from more; CI machines are small and shared

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# conftest's module fixtures below: a private redis-server (each test its own database number),
# a pairs file, an upgraded SQLite file copied per test, a PostgreSQL database emptied per test
SHARED_CHEAPLY = {"redis_url", "pairs_toml", "sqlite_template", "postgres_db"}


class _DrafterFaults(logging.Handler):
    """What the loop logs when a drafter raises (decoder.Guarded): the rows go on without it,
    so a drafter's bug would pass every exactness test unseen. Each test fails on one unless
    it is marked ``drafter_fails`` (it makes a drafter raise on purpose)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


DRAFTER_FAULTS = _DrafterFaults()
logging.getLogger("specdec_llm.engine.decoder").addHandler(DRAFTER_FAULTS)


@pytest.fixture(autouse=True)
def no_drafter_raises(request):
    DRAFTER_FAULTS.seen.clear()
    yield
    if not request.node.get_closest_marker("drafter_fails"):
        assert not DRAFTER_FAULTS.seen, f"a drafter raised: {DRAFTER_FAULTS.seen}"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """`make test` runs the tests on several processes (pytest-xdist, ``--dist loadgroup``):
    - a test that uses a module- or class-scoped fixture (a fleet of workers, a model, a
      database) runs in one process with the rest of its module, in the module's order, so that
      fixture is built once and sees what it saw in a serial run; every other test goes to
      whichever process is free (``SHARED_CHEAPLY``: module fixtures that each process may
      build for itself, none keeping one test's state for the next);
    - the long ones are handed out first, so none of them starts last and alone: the tests
      marked ``slow`` (minutes of waiting: fleets, faults, the GPU-check dry run), then the
      10,000-sample distribution tests (helpers.py; named ``*distribution*``), each with its
      group (``--no-loadscope-reorder`` keeps this order; a serial run gets it too)."""
    unit, rank = {}, {}
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        unit[item] = item.nodeid
        if any(
            d.scope in ("module", "class", "package") and d.argname not in SHARED_CHEAPLY
            for fd in defs.values()
            for d in fd
        ):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
            unit[item] = item.path.stem
        own = 0 if item.get_closest_marker("slow") else 1 if "distribution" in item.name else 2
        rank[unit[item]] = min(own, rank.get(unit[item], own))
    first = {}
    for i, item in enumerate(items):
        first.setdefault(unit[item], i)
    order = {item: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank[unit[item]], first[unit[item]], order[item]))


def tiny_llama(seed: int, vocab: int = 256, layers: int = 2, hidden: int = 64, eos: int | None = None, ctx: int = 512):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=ctx,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = eos
    return model


def perturbed(model, scale: float, seed: int):
    """A copy of ``model`` with noise on every weight: a partially aligned draft."""
    torch.manual_seed(seed)
    out = type(model)(model.config).eval()  # not a deepcopy: a kernel-tuned model holds oneDNN tensors
    out.load_state_dict({k: v.contiguous() for k, v in model.state_dict().items()})
    out.generation_config = copy.deepcopy(model.generation_config)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn_like(p) * scale * p.std())
    return out


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def exact_two_token_distribution(model, prompt, temperature, top_k, top_p):
    """P(t1, t2) for the processed target distribution, computed exhaustively."""
    from specdec_llm.engine import sampling

    with torch.no_grad():
        p1 = sampling.probs(model(torch.tensor([prompt])).logits[0, -1:], temperature, top_k, top_p)[0]
        V = p1.shape[0]
        batch = torch.tensor([prompt + [t] for t in range(V)])
        p2 = sampling.probs(model(batch).logits[:, -1], temperature, top_k, top_p)
    return p1[:, None] * p2  # [V, V]


@torch.inference_mode()
def prefill(model, token_ids: list[int], cache) -> None:
    """``token_ids`` (one sequence) into ``cache`` by transformers' own forward: a reference
    with no engine code on the path (not ``hf.forward_rows``, which may take engine/lean.py)."""
    from specdec_llm.engine import hf

    ids = torch.tensor([token_ids], device=model.device)
    model(input_ids=ids, use_cache=True, logits_to_keep=1, **{hf.cache_kwarg(type(model)): cache})


def check_caches(batch) -> None:
    """Every row's valid cache columns equal a fresh prefill of exactly its emitted prefix:
    the target holds seq[:-1], each draft model's ragged cache seq[:held] (holes and padding
    are invisible)."""
    from specdec_llm.engine.drafting.eagle import EagleBackend
    from specdec_llm.engine.drafting.model import RaggedBackend
    from specdec_llm.engine.drafting.selfdraft import SelfBackend

    dec = batch.dec
    checks = [(batch.tcache, dec.target, lambda r: len(r.seq) - 1)]
    for name, s in batch.sessions.items():
        backend = getattr(s, "backend", None)
        if isinstance(backend, RaggedBackend) and not isinstance(backend, EagleBackend):
            # a self-draft (the target quantized) holds the target's own keys and values
            model = dec.target if isinstance(backend, SelfBackend) else backend.model
            checks.append((backend.cache, model, lambda r, name=name: r.view(name).state[name].held))
    for cache, model, length in checks:
        assert cache.rows == len(batch.rows)
        for b, r in enumerate(batch.rows):
            n = length(r)
            cols = cache.valid[b].nonzero()[:, 0]
            assert len(cols) == n
            if n:
                from specdec_llm.engine import hf

                fresh = hf.new_cache(model)
                prefill(model, r.seq[:n], fresh)
                for layer, ref in zip(cache.cache.layers, fresh.layers):
                    assert torch.allclose(layer.keys[b][:, cols], ref.keys[0], atol=1e-5)
                    assert torch.allclose(layer.values[b][:, cols], ref.values[0], atol=1e-5)


def tiny_tokenizer(vocab: int = 512):
    """A byte-level BPE trained in-process, with a ChatML-style template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["The quick brown fox jumps over the lazy dog. Speculative decoding drafts and verifies."] * 20
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory) -> Path:
    """A tiny target and a tiny unrelated draft saved as HF dirs with one tokenizer."""
    root = tmp_path_factory.mktemp("tiny_pair")
    tok = tiny_tokenizer()
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        model = tiny_llama(seed, vocab=len(tok), layers=layers, eos=tok.eos_token_id)
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


@pytest.fixture(scope="session")
def tiny_tools_pair_dir(tmp_path_factory) -> Path:
    """The tiny pair for tools: no chat template of its own (its pair names the built-in
    "chatml-tools" template: ChatML with tools in Qwen2.5's layout; without tools it renders as
    the tiny tokenizer's own) and a 4096-token context (tool schemas are long in its 512-token
    BPE); ``tools_pair`` writes its pairs-file entry."""
    return tools_pair_dir(tmp_path_factory.mktemp("tiny_tools_pair"), lambda model, tok: model)


@pytest.fixture(scope="session")
def closing_tools_pair_dir(tmp_path_factory) -> Path:
    """``tiny_tools_pair_dir`` with models that close what they open (``closing``): under a
    grammar, their calls and JSON end within a few tokens."""
    return tools_pair_dir(tmp_path_factory.mktemp("closing_tools_pair"), closing)


def tools_pair_dir(root: Path, taste) -> Path:
    tok = tiny_tokenizer()
    target = taste(tiny_llama(0, vocab=len(tok), eos=tok.eos_token_id, ctx=4096), tok)
    for name, model in (("target", target), ("draft", taste(perturbed(target, 0.3, seed=1), tok))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        (root / name / "chat_template.jinja").unlink()
    return root


def closing(model, tok):
    """A random model with a fixed taste: every input embedding carries a large constant on
    one dimension, which the output layer reads as a preference for closing JSON ('"', "}",
    "]", then "0" and ","), far above what the random weights add. Unconstrained it writes
    quotes; under a JSON grammar every string, array and object closes at once."""
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 8.0
        head = model.get_output_embeddings().weight
        head[:, 0] = 0.0
        for rank, text in enumerate(['"', "}", "]", "0", ","]):
            head[tok.convert_tokens_to_ids(text), 0] = 5.0 - rank
    return model


def tools_pair(name: str, root: Path) -> str:
    """A pairs-file entry for the pair in ``root`` (``tiny_tools_pair_dir``) with the tools template."""
    return f'[pairs.{name}]\ntarget = "{root / "target"}"\ndraft = "{root / "draft"}"\nchat_template = "chatml-tools"\n'


@pytest.fixture()
def pairs_file(tmp_path, tiny_pair_dir, monkeypatch):
    """A user pairs file with the tiny pair, installed through SPECDEC_CONFIG_FILE."""
    from specdec_llm.settings import reload_settings

    path = tmp_path / "pairs.toml"
    path.write_text(
        f'[pairs.tiny]\ntarget = "{tiny_pair_dir / "target"}"\ndraft = "{tiny_pair_dir / "draft"}"\n'
        f'[pairs.tiny-shared]\ntarget = "{tiny_pair_dir / "target"}"\ndraft = "layers:0"\n'
    )
    monkeypatch.setenv("SPECDEC_CONFIG_FILE", str(path))
    reload_settings()
    yield path
    monkeypatch.delenv("SPECDEC_CONFIG_FILE")
    reload_settings()


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target (fp32) with the built-in distilled draft."""
    from specdec_llm.pairs import load_pair

    return load_pair("smollm2-135m")


# -- stores for the store's own tests (SQLite and PostgreSQL) ---------------------------------
STORE_TABLES = ("telemetry", "outputs", "requests", "jobs", "baselines", "workers", "pairs")


@pytest.fixture(scope="module")
def sqlite_template(tmp_path_factory):
    """An upgraded SQLite file, copied for each test (upgrading each time is slower)."""
    from specdec_llm.store import db
    from specdec_llm.store.testing import sqlite_url

    url = sqlite_url(tmp_path_factory.mktemp("template"))
    db.upgrade(url)
    db.dispose_engine(url)
    return db.sqlite_path(url)


@pytest.fixture(scope="module")
def postgres_db():
    from specdec_llm.store import db
    from specdec_llm.store.testing import require_postgres, temporary_postgres

    require_postgres()
    with temporary_postgres() as url:
        db.upgrade(url)
        yield url


def empty_store(request, tmp_path: Path, sqlite_template: Path) -> str:
    """An empty store at head for ``request.param`` ("sqlite": a fresh copy of the template
    in ``tmp_path``; "postgresql": the module's database, emptied); its URL."""
    import shutil

    from sqlalchemy import text

    from specdec_llm.store import db
    from specdec_llm.store.testing import sqlite_url

    if request.param == "sqlite":
        shutil.copy(sqlite_template, tmp_path / "store.db")
        return sqlite_url(tmp_path, "store.db")
    url = request.getfixturevalue("postgres_db")
    with db.get_engine(url).begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(STORE_TABLES)} RESTART IDENTITY CASCADE"))
    return url


def process_store(request, tmp_path: Path, sqlite_template: Path, monkeypatch) -> Iterator[str]:
    """For a fixture: ``empty_store`` made this process's SPECDEC_DATABASE_URL, with an
    embedded broker in ``tmp_path``; the settings restored after."""
    from specdec_llm.settings import reload_settings
    from specdec_llm.store import db

    u = empty_store(request, tmp_path, sqlite_template)
    for var in ("SPECDEC_BROKER_URL", "SPECDEC_RESULT_BACKEND", "SPECDEC_CELERY_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPECDEC_DATABASE_URL", u)
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / "data"))
    reload_settings()
    yield u
    monkeypatch.undo()
    reload_settings()
    if request.param == "sqlite":
        db.dispose_engine(u)


# -- the job client and the worker fleets (test_jobs, test_workers and the tests beside them) ---
@pytest.fixture
def embedded(pairs_file, tmp_path, monkeypatch):
    """Settings for embedded mode in a fresh data dir: no broker URL, default SQLite store."""
    from specdec_llm.settings import reload_settings

    for var in (
        "SPECDEC_BROKER_URL",
        "SPECDEC_RESULT_BACKEND",
        "SPECDEC_DATABASE_URL",
        "SPECDEC_CELERY_CONFIG",
        "SPECDEC_PRICE_PER_HOUR",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SPECDEC_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reload_settings()
    yield tmp_path / "data"
    monkeypatch.delenv("SPECDEC_DATA_DIR")
    reload_settings()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A private redis-server on its own port: no shared keys, gone afterwards."""
    import shutil
    import socket
    import subprocess
    import time

    from helpers import free_port, unavailable

    exe = shutil.which("redis-server")
    if exe is None:
        unavailable("redis-server is not installed")
    port, folder = free_port(), tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def pairs_toml(tiny_pair_dir, tmp_path_factory) -> Path:
    """A pairs file with the tiny pair, for worker fleets (``fleet.make_fleet``)."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.toml"
    path.write_text(f'[pairs.tiny]\ntarget = "{tiny_pair_dir / "target"}"\ndraft = "{tiny_pair_dir / "draft"}"\n')
    return path


@pytest.fixture
def use(monkeypatch):
    """Point this process's settings at a fleet (its env), restored afterwards."""
    from specdec_llm.settings import reload_settings

    def apply(fleet, **overrides):
        for k, v in {**fleet.env, **overrides}.items():
            monkeypatch.setenv(k, v)
        reload_settings()

    yield apply
    monkeypatch.undo()
    reload_settings()
