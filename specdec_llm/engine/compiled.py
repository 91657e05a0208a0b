"""A quantized self-draft's one-token step, compiled (``torch.compile``, inductor).

Why: a draft model runs k one-token steps per iteration, one after the other, and a step
of the int4 self-draft (quant.py) is mostly not its matmuls. On the demo pair (SmolLM2-135M,
30 layers, AMD EPYC, 2 threads) a 14 ms step spent ~4 ms in int4 matmuls, ~2 ms in the LM
head, ~1 ms in attention, and the rest in ~60 small kernels per layer (norms, RoPE, casts,
residual adds) and the Python that calls them. Inductor fuses those into a few generated
C++ loops per layer, and the whole 30-layer step becomes one graph call: 15.3 -> 12.4 ms
(0.42 -> 0.34 of a target step) in the run that decided to keep it.

What is compiled: one row, one new token, no features, the LM head left out (its
pre-packed oneDNN weight does not trace); everything else (a verification, a catch-up,
several rows) stays on the lean forward (lean.py). The cache's buffers are written in
place inside the graph, as ``GrowingLayer.update`` writes them; the mask is always
materialized so one graph serves every context length (``dynamic=True``).

Cost: compiling the demo draft takes ~80 s on 2 cores the first time in a machine's life,
~30 s once inductor's on-disk cache has it. So it is asked for, per pair
(``compile_draft = true``), not done by default: a worker that decodes for hours pays it
once; a one-off call should not. When asked, ``attach`` then times the compiled step
against the lean one on this machine and keeps it only where it is faster (it may not be
on another CPU, torch or model), and never where compiling fails.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from . import hf, lean

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import DynamicCache, PreTrainedModel

log = logging.getLogger(__name__)

ENABLED = True  # benchmarks compare with and without by flipping this
KEEP_BELOW = 0.95  # kept where its measured step is at most this share of the lean step's


class CompiledStep:
    """``__call__(ids, cache, mask, positions)`` as ``hf.forward_rows`` for one row and one
    token: float32 logits [1, 1, V]."""

    def __init__(self, runner: lean.LeanDecoder) -> None:
        self.lean = runner
        self.calls = 0  # (tests: it served)
        self.traced = False  # the one compile happens on the first call (attach's timing); never again
        self.failed = False
        self.fn: Callable[..., torch.Tensor] = torch.compile(self._layers, dynamic=True, fullgraph=True)

    def _layers(
        self,
        ids: torch.Tensor,
        kbufs: list[torch.Tensor],
        vbufs: list[torch.Tensor],
        width: int,
        mask: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """lean.LeanDecoder's layers for ids [1, 1], writing each layer's key and value into
        column ``width`` of its buffers; the final-normed hidden state [1, 1, H]."""
        m = self.lean
        h = m.embed_ids(ids)
        for i, entry in enumerate(m.layers):

            def kv(k: torch.Tensor, v: torch.Tensor, i: int = i) -> tuple[torch.Tensor, torch.Tensor]:
                kbufs[i][:, :, width : width + 1].copy_(k)
                vbufs[i][:, :, width : width + 1].copy_(v)
                return kbufs[i][:, :, : width + 1], vbufs[i][:, :, : width + 1]

            h = lean.layer(entry, h, cos, sin, mask, m.head_dim, kv)
        return m.final_norm(h)

    def takes(self, ids: torch.Tensor, keep: int, embeds: torch.Tensor | None, features: tuple[int, ...]) -> bool:
        return ENABLED and not self.failed and ids.shape == (1, 1) and keep == 1 and embeds is None and not features

    def __call__(
        self, ids: torch.Tensor, cache: DynamicCache, mask: torch.Tensor | None, positions: torch.Tensor | None
    ) -> torch.Tensor:
        layers = hf.layers(cache)
        width = layers[0].width
        if not width:  # an empty cache (a one-token prompt): nothing to attend to but itself
            return self.lean(ids, cache, 1, mask, positions)[0]
        self.calls += 1
        for layer in layers:  # room for the new column and one spare (GrowingLayer.update's reserve): a
            # buffer exactly full (width + 1 columns) failed the graph's guard and would have recompiled
            layer.reserve(1, width + 2, layer.keys, layer.values)
        if positions is None:
            positions = torch.tensor([[width]])
        if mask is None:  # one graph for both: every cached column is valid
            mask = torch.ones(1, 1, 1, width + 1, dtype=torch.bool)
        with torch.inference_mode():  # every input an inference tensor, as when it was traced (else: a recompile)
            ids, mask = ids.clone(), mask.clone()
            cos, sin = self.lean.rotary_of(positions, self.lean.embed.weight.dtype)
        args = (ids, [lay.bufs[0][:1] for lay in layers], [lay.bufs[1][:1] for lay in layers], width, mask, cos, sin)
        try:  # a guard that fails later would recompile for a minute in the middle of a request: refused
            with torch.compiler.set_stance("fail_on_recompile" if self.traced else "default"):
                h = self.fn(*args)
        except Exception as e:  # (re-raised on the first call) the lean step serves from now on
            if not self.traced:
                raise
            log.warning("the compiled draft step would recompile (%s); the uncompiled step serves from now on", e)
            self.failed = True
            return self.lean(ids, cache, 1, mask, positions)[0]
        self.traced = True
        for layer in layers:
            layer.view(1, width + 1)
        return self.lean.logits(h)


def supported(runner: lean.LeanDecoder | None) -> bool:
    """Every layer's projections are the int4 self-draft's (fused q/k/v and gate/up) on the CPU."""
    from .quant import Int4Linear

    if runner is None or not runner.layers or len(runner.kinds) > 1:  # (one rotary table and mask)
        return False
    for entry in runner.layers:
        mats = (entry.qkv, entry.attn.o_proj, entry.gate_up, entry.mlp.down_proj)
        if not all(isinstance(p, Int4Linear) and p.packed.device.type == "cpu" for p in mats):
            return False
    return True


def attach(model: PreTrainedModel, force: bool = False, context: int = 96, reps: int = 15) -> dict[str, Any]:
    """Compile ``model``'s one-token step (a prepared int4 self-draft: ``hf.prepare`` first)
    and keep it where it is measured faster than the lean step on this machine (``force``:
    keep it regardless, for tests). Returns what was decided and the two timings (ms); once
    per model."""
    if hf.COMPILED_STEP in model.__dict__:
        return dict(model.__dict__[hf.COMPILED_STEP + "_report"])
    runner = lean.runner(model)
    report: dict[str, Any] = {"kept": False}
    step = None
    if not supported(runner):
        report["why"] = "not an int4 self-draft on the CPU with the lean forward"
    else:
        assert runner is not None
        step = CompiledStep(runner)
        try:
            report.update(_time(model, step, context, reps))
        except Exception as e:  # noqa: BLE001  # inductor/dynamo failures: the lean step serves
            log.warning("compiling the draft step failed, the uncompiled step serves: %s", e)
            report["why"] = f"compile failed: {type(e).__name__}"
        else:
            report["kept"] = force or report["compiled_ms"] <= KEEP_BELOW * report["lean_ms"]
    model.__dict__[hf.COMPILED_STEP] = step if report["kept"] else None
    model.__dict__[hf.COMPILED_STEP + "_report"] = report
    log.info("compiled draft step: %s", report)
    return dict(report)


@torch.inference_mode()
def _time(model: PreTrainedModel, step: CompiledStep, context: int, reps: int) -> dict[str, float]:
    """Both steps on one row over ``context`` tokens, interleaved medians (ms); the first
    compiled call (the compile itself) is timed apart."""
    caches = []
    for _ in range(2):
        cache = hf.new_cache(model)
        hf.forward_rows(model, torch.arange(context)[None] + 100, cache, 1)
        caches.append(cache)
    t = time.perf_counter()
    step(torch.tensor([[7]]), caches[1], None, None)
    compile_s = time.perf_counter() - t
    width = hf.layers(caches[0])[0].width
    times: dict[str, list[float]] = {"lean": [], "compiled": []}
    for _ in range(reps):
        for name, cache in zip(times, caches):
            t = time.perf_counter()
            if name == "lean":
                step.lean(torch.tensor([[7]]), cache, 1)
            else:
                step(torch.tensor([[7]]), cache, None, None)
            times[name].append(time.perf_counter() - t)
            for layer in hf.layers(cache):
                layer.view(1, width)
    return {
        "compile_s": round(compile_s, 1),
        **{f"{n}_ms": round(statistics.median(v) * 1e3, 2) for n, v in times.items()},
    }
