"""A draft that is llama.cpp decoding the target's own GGUF file (optional: ``llama-cpp-python``).

Why: where PyTorch has no fast int4 kernel for the CPU (avx2 without avx512), the target's
own int4 copy steps at 0.7 of the fp32 target's step, and speculation with it barely pays.
llama.cpp decodes the same quantized weights with int8 activations several times faster.
Its text is not the fp32 target's, but a draft's text never reaches the output: the target
verifies every token (greedy identical; sampled, the rejection rule with this draft's own
distribution), so only its speed and how often it agrees matter.

One llama.cpp context per row, from a pool the drafter keeps (rows come and go, contexts are
reused); a context holds a prefix of its row's tokens, and a rollback removes positions from
its memory. Drafting is the model drafter's, in two levels: each decode feeds the row's
pending token and the cheaper proposal it checks (``drafters.to_check``), all their logits
kept, and the draft keeps what it agrees with plus its own next token. Rows draft one after
the other (a context per row): this drafter is for small batches, as speculation is on CPUs.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .autok import Timer
from .drafters import ModelDrafter, ModelRow, accept_checked, to_check
from .protocol import Proposal

if TYPE_CHECKING:
    from .decoder import Batch, Row

MAX_CONTEXT = 4096  # tokens per context (its memory is allocated up front)
CHUNK = 512  # tokens per decode call

# a child process decodes a few tokens with llama.cpp before this process does (``probe``)
PROBE = """import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
llm.eval([llm.token_bos()] * 4)
"""
FIX = (
    "rebuild llama-cpp-python without the kernels that crash; on a CPU with AMX: "
    "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
    "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF' "
    "pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python (docs/pairs.md), "
    "or drop 'llamacpp' from drafters"
)
probed: set[str] = set()  # the files llama.cpp decoded in a child process


def probe(path: str) -> None:
    """Decode with llama.cpp in a child process first (``PROBE`` run on ``path``), once per
    file and process: a build of llama.cpp can crash on a CPU it detects wrongly (its AMX kernels on
    some virtual machines), and a crash here would kill the worker with no word; refused at
    load instead, with the fix."""
    if path in probed:
        return
    r = subprocess.run([sys.executable, "-c", PROBE, path], capture_output=True, text=True, timeout=600)
    if r.returncode < 0:
        raise ValueError(f"llama.cpp crashed decoding {path} on this CPU ({signal.Signals(-r.returncode).name}): {FIX}")
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise ValueError(f"llama.cpp could not decode {path}: {last}")
    probed.add(path)


class Context:
    """One llama.cpp context over ``path``: ``feed`` tokens after those it holds and get the
    logits of the last ``keep`` of them; ``truncate`` to a prefix."""

    def __init__(self, path: str, n_ctx: int, threads: int) -> None:
        from llama_cpp import Llama
        from llama_cpp import llama_cpp as lib

        self.lib = lib
        self.llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=CHUNK, n_threads=threads, verbose=False)
        self.n_ctx, self.vocab = n_ctx, self.llm.n_vocab()
        self.batch = lib.llama_batch_init(CHUNK, 0, 1)
        self.tokens: list[int] = []

    def __del__(self) -> None:
        if getattr(self, "batch", None) is not None:
            self.lib.llama_batch_free(self.batch)

    def truncate(self, n: int) -> None:
        if n < len(self.tokens):
            self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.llm.ctx), 0, n, -1)
            del self.tokens[n:]

    def feed(self, tokens: list[int], keep: int) -> np.ndarray:
        """Logits [keep, V] (float32) at the last ``keep`` of ``tokens``, fed after ``self.tokens``."""
        out: list[np.ndarray] = []
        for start in range(0, len(tokens), CHUNK):
            chunk = tokens[start : start + CHUNK]
            last = start + len(chunk) == len(tokens)
            b, n_past = self.batch, len(self.tokens)
            b.n_tokens = len(chunk)
            for i, tok in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i] = tok, n_past + i, 1
                b.seq_id[i][0] = 0
                b.logits[i] = last and i >= len(chunk) - keep
            if self.lib.llama_decode(self.llm.ctx, b) != 0:
                raise RuntimeError(f"llama.cpp could not decode {len(chunk)} tokens at position {n_past}")
            self.tokens += chunk
            if last:
                for i in range(len(chunk) - keep, len(chunk)):
                    row = self.lib.llama_get_logits_ith(self.llm.ctx, i)
                    out.append(np.ctypeslib.as_array(row, shape=(self.vocab,)).copy())
        return np.stack(out)


@dataclass
class LlamaRow(ModelRow):
    context: Context | None = None


class LlamaCppDrafter(ModelDrafter):
    """The ``llamacpp`` drafter: llama.cpp running ``path`` (the pair's target GGUF), on this
    process's torch threads. Its acceptance is tracked per row as a model drafter's."""

    row_state = LlamaRow

    def __init__(self, path: str, vocab_size: int, context_length: int, name: str = "llamacpp", prior: float = 0.8):
        super().__init__(None, vocab_size, name, prior)  # type: ignore[arg-type]  # (no transformers model)
        self.path, self.n_ctx = path, min(context_length, MAX_CONTEXT)
        self.pool: list[Context] = []
        self.pool.append(self.context())  # a missing package or a file llama.cpp cannot read fails at load
        probe(path)  # and so does a llama.cpp that crashes decoding on this CPU
        self.timing: Context | None = None  # calibration's

    def context(self) -> Context:
        return self.pool.pop() if self.pool else Context(self.path, self.n_ctx, torch.get_num_threads())

    def session(self, batch: Batch) -> LlamaCppSession:  # type: ignore[override]  # (not a model cache)
        return LlamaCppSession(self, batch)

    def finish(self, row: Row) -> None:
        super().finish(row)
        st: LlamaRow | None = row.state.get(self.name)
        if st is not None and st.context is not None:
            self.pool.append(st.context)
            st.context = None

    def time_forward(self, rows: int, ids: list[int]) -> Callable[[int], float]:
        """A decode of ``w`` tokens for each of ``rows`` rows (one after the other), logits kept."""
        ctx = self.timing = self.timing or self.context()
        ctx.truncate(0)
        ctx.feed(ids, 1)
        width = len(ctx.tokens)

        def forward(w: int) -> float:
            with Timer() as t:
                for _ in range(rows):
                    ctx.feed(ids[:w], w)
                    ctx.truncate(width)
            return t.seconds

        return forward


class LlamaCppSession:
    """Its state is in each row (``row.state[name]``: the row's context and how many of the
    row's tokens it holds, ``dlen``), so rows joining, leaving or moving need nothing here."""

    free = False

    def __init__(self, drafter: LlamaCppDrafter, batch: Batch) -> None:
        self.d, self.batch = drafter, batch

    def add(self, row: Row) -> None:
        self.d.tracker(row)

    def merge(self) -> None:
        pass

    def keep(self, order: list[int]) -> None:
        pass

    def behind(self, row: Row) -> int:
        return len(row.seq) - int(row.state[self.d.name].dlen)

    def shadow(self, row: Row, prop: Proposal, emitted: list[int]) -> None:
        pass

    def observe(self, row: Row, features: torch.Tensor) -> None:
        pass

    def propose(self, rows: list[Row], ks: dict[int, int]) -> dict[int, Proposal]:
        out: dict[int, Proposal] = {}
        name, costs = self.d.name, self.batch.dec.costs
        spent, steady = 0.0, True  # (rows draft one after the other: the batch's drafting is their sum)
        for b, k in ks.items():
            r, st = rows[b], rows[b].state[name]
            if k <= 0 or len(r.seq) + k > self.d.n_ctx:
                continue
            if st.context is None:
                st.context = self.d.context()
            ctx: Context = st.context
            same = next((i for i, (a, t) in enumerate(zip(ctx.tokens, r.seq)) if a != t), len(ctx.tokens))
            ctx.truncate(min(same, len(r.seq) - 1))  # what it holds of the row (the last token is fed)
            head, drafts, qs = r.seq[len(ctx.tokens) :], list[int](), list[Any]()
            steady = steady and len(head) == 1
            while len(drafts) < k:
                checked = to_check(self.batch, name, r, drafts, k - len(drafts), len(head), 1)
                with Timer() as t:
                    logits = torch.from_numpy(ctx.feed(head + checked, len(checked) + 1))
                spent += t.seconds
                r.stats.draft_forwards += 1
                r.stats.draft_time_s += t.seconds
                if len(head) == 1:
                    costs[1].observe_draft(name, t.seconds, 1 + len(checked))
                a, nxt, q = accept_checked(r, checked, logits[:, : self.d.vocab_size])
                ctx.truncate(len(ctx.tokens) - (len(checked) - a))
                drafts += checked[:a] + [nxt]
                qs += q
                head = [nxt]
            st.dlen, st.used = len(ctx.tokens), True
            out[b] = Proposal(name, drafts, qs or None, [st.tracker.rate] * k, [None] * k)
        if out and steady:
            costs[len(rows)].observe_drafting(name, spent, max(len(p.tokens) for p in out.values()))
        return out

    def commit(self, b: int, row: Row, prop: Proposal, n: int) -> None:
        """The context holds the row's tokens and the drafts but the last; the rejected ones go
        at the next ``propose`` (it keeps the longest prefix it shares with the row)."""
        st = row.state[self.d.name]
        st.tracker.update(len(prop.tokens), n)
        st.dlen = len(row.seq) + min(n, len(prop.tokens) - 1)  # row.seq is not yet advanced
