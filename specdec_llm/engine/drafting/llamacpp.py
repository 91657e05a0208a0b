"""A draft that is llama.cpp decoding the target's own GGUF file, or the pair's draft model's
(optional: ``llama-cpp-python``).

Why: where PyTorch has no fast int4 kernel for the CPU (avx2 without avx512), the target's
own int4 copy steps at 0.7 of the fp32 target's step, and speculation with it barely pays.
llama.cpp decodes the same quantized weights with int8 activations several times faster.
Its text is not the fp32 target's, but a draft's text never reaches the output: the target
verifies every token (greedy identical; sampled, the rejection rule with this draft's own
distribution), so only its speed and how often it agrees matter.

One llama.cpp context per row, from a pool the drafter keeps (rows come and go, contexts are
reused; a row that leaves, for any reason, gives its context back); a context holds a prefix
of its row's tokens, and a rollback removes positions from its memory. Drafting is the model
drafter's (model.py), in two levels, over ``LlamaBackend``. Rows draft one after the other (a
context per row): this drafter is for small batches, as speculation is on CPUs.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..timing import Timer
from .base import DraftContext, Forward, RowView
from .model import Backend, ModelDrafter, ModelRow

# its acceptance before any row has shown its own: llama.cpp decodes the target's own weights,
# so it agrees with the target nearly as the int4 self-draft does (0.9), less its int8
# activations' drift: a guess between that and an unknown draft's 0.5, not a measurement
LLAMACPP_PRIOR = 0.8
# tokens per context at most (the decoder's context length if shorter): its KV memory is
# allocated up front (SmolLM2-135M in f16: 30 layers x 2 x 192 x 4,096 x 2 bytes = 94 MB a
# context), and 4,096 covers the built-in pairs' chat requests
MAX_CONTEXT = 4096
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
# text both tokenizers must split alike (code, prose, accents, CJK): a GGUF of another vocabulary
# would only ever draft rejected tokens
SAMPLE = "def add(a, b):\n    return a + b  # naïve café, 你好 - 3.14\nThe quick brown fox."


def check_vocabulary(ctx: Context, path: str, context: DraftContext) -> None:
    """A ValueError where llama.cpp's vocabulary for ``path`` is not the pair's."""
    if ctx.vocab < context.vocab_size:
        raise ValueError(
            f"{path} has {ctx.vocab} tokens, fewer than the pair's {context.vocab_size}: "
            "use a GGUF with the target's tokenizer"
        )
    if context.tokenizer is not None:
        ours = list(context.tokenizer.encode(SAMPLE, add_special_tokens=False))
        theirs = ctx.llm.tokenize(SAMPLE.encode(), add_bos=False, special=False)
        if ours != theirs:
            raise ValueError(
                f"llama.cpp splits text with {path}'s tokenizer otherwise than the pair's "
                f"({theirs[:8]}... against {ours[:8]}...): use a GGUF with the target's tokenizer"
            )


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


class LlamaBackend(Backend):
    """A llama.cpp context per row (``row.state[name].context``), from the drafter's pool."""

    def __init__(self, drafter: LlamaCppDrafter) -> None:
        super().__init__(drafter.name, drafter.context.vocab_size)
        self.d = drafter

    def fits(self, row: RowView, k: int) -> bool:
        return len(row.tokens) + k <= self.d.n_ctx

    def prepare(self, rows: dict[int, RowView]) -> list[Forward]:
        """Each row's context keeps the longest prefix it shares with the row (but its last token)."""
        for r in rows.values():
            st = r.state[self.name]
            ctx = st.context = st.context or self.d.take()
            same = next((i for i, (a, t) in enumerate(zip(ctx.tokens, r.tokens)) if a != t), len(ctx.tokens))
            ctx.truncate(min(same, len(r.tokens) - 1))
            st.held = len(ctx.tokens)
        return []

    def feed(
        self, rows: dict[int, RowView], inputs: dict[int, list[int]], keep: dict[int, int]
    ) -> tuple[dict[int, torch.Tensor], list[Forward]]:
        logits, forwards = {}, []
        for b, x in inputs.items():
            st = rows[b].state[self.name]
            with Timer() as t:
                logits[b] = torch.from_numpy(st.context.feed(x, keep[b]))[:, : self.vocab_size]
            st.held += len(x)
            forwards.append(Forward({b: len(x)}, len(x), t.seconds))
        return logits, forwards

    def truncate(self, b: int, row: RowView, n: int) -> None:
        st = row.state[self.name]
        if st.context is not None:
            st.context.truncate(n)
        st.held = min(st.held, n)

    def leave(self, b: int, row: RowView) -> None:
        st: LlamaRow | None = row.state.get(self.name)
        if st is not None and st.context is not None:
            self.d.pool.append(st.context)
            st.context = None


class LlamaCppDrafter(ModelDrafter):
    """The ``llamacpp`` drafter: llama.cpp running ``path`` (the pair's draft GGUF, else its
    target's), on this process's torch threads. Its acceptance is tracked per row as a model drafter's."""

    row_state = LlamaRow

    def __init__(self, path: str, context: DraftContext, name: str = "llamacpp", prior: float = LLAMACPP_PRIOR):
        super().__init__(None, context, name, prior)
        self.path, self.n_ctx = path, min(context.context_length, MAX_CONTEXT)
        self.pool: list[Context] = []
        self.pool.append(self.take())  # a missing package or a file llama.cpp cannot read fails at load
        check_vocabulary(self.pool[0], path, context)  # and so does another vocabulary
        probe(path)  # and so does a llama.cpp that crashes decoding on this CPU
        self.timing: Context | None = None  # calibration's

    def take(self) -> Context:
        """A context from the pool, or a new one."""
        return self.pool.pop() if self.pool else Context(self.path, self.n_ctx, torch.get_num_threads())

    def backend(self, target: Any) -> LlamaBackend:
        return LlamaBackend(self)

    def timer(self, rows: int, ids: list[int]) -> Callable[[int], float]:
        """A decode of ``w`` tokens for each of ``rows`` rows (one after the other), logits kept."""
        ctx = self.timing = self.timing or self.take()
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
