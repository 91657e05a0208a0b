"""CPU matmul kernels for the Linear layers, chosen per row count from timings on this machine.

A decode step multiplies one row per sequence by every weight matrix; a verification
multiplies k+1 rows. On a CPU both are memory-bound, so verifying k tokens should cost
little more than one step, but which kernel streams the weights well depends on the row
count, the layout and the CPU (measured on one 2-core Xeon without AMX, 60 cold
1536x576 matrices, one thread):

| rows | row-major (``x @ W.T``) | column-major | oneDNN, pre-packed |
|---|---|---|---|
| 1 | 26.7 ms | 24.8 ms | 32.8 ms |
| 2 | 28.5 | 46.3 | 40.3 |
| 5 | 52.4 | 46.9 | 37.5 |
| 9 | 72.8 | 58.5 | 44.1 |

No layout wins everywhere, and another CPU (AMX, bf16 hardware) ranks them differently.
So ``tune`` times each available kernel on the model's own weights (enough matrices of a
shape to overflow the last-level cache several times, so the weights come from memory) at
``POINTS`` row counts and gives every Linear of that shape the one kernel with the least time
over all of them, relative to the fastest at each. One: each kernel kept would hold another
copy of the weights, and at the sizes users run (a 1.5B target is 7 GB in fp32) memory is the
limit; the weight takes that kernel's layout in place of its own. The timings are cached in a JSON file keyed by CPU model and
flags, torch version, threads, dtype and shape, so a later load on the same machine does
not measure again. The math is the same whichever kernel runs (fp32 results may differ
in the last bits between kernels; greedy outputs are checked token for token in tests).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import time
import types
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch

from . import jsoncache

log = logging.getLogger(__name__)

POINTS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 48, 64)
GIVE_UP = 3.0  # a kernel this many times slower than another at a row count is not timed at larger counts
TABLE = 1024  # row counts with a precomputed choice (larger counts use the last point's)
COLD = 2  # the matrices timed stream at least this many times the last-level cache
TIMINGS = "t2"  # what a cached timing is (t2: milliseconds per matrix; t1 summed the matrices timed)


def _onednn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


ROWS_AT_ONCE = 8192  # rows of a weight quantized to int8 at a time


def absmax(t: torch.Tensor, dim: int) -> torch.Tensor:
    """max |t| along ``dim`` without an |t| copy of ``t`` (a 151,936-row head: 0.9 GB, ~1 s)."""
    return torch.maximum(t.amax(dim), t.amin(dim).neg())


class DynamicInt8Linear(torch.nn.Module):
    """y = x @ W.T (+ b) on CPU with W in symmetric per-row int8, packed for torch's quantized
    engine (fbgemm on x86), and x quantized to 7 bits at each call (a "dynamic" linear; 7, not
    8: AVX2's u8 x s8 pairs saturate int16, 18% error on random inputs): int8 dot products over
    a quarter of fp32's bytes. On an AVX2-only AMD EPYC, 2 threads, Qwen2.5's 151,936x1536 head
    multiplies one row in 7 ms against 44 ms in fp32 and 17-33 ms in int4 (``_weight_int8pack_mm``:
    189 ms). Quantizing x costs agreement where activations have outlier channels, so x is
    divided per channel by ``smooth`` and W's columns multiplied by it (SmoothQuant: the outliers
    move into the per-row weight scales): on Qwen2.5-Coder-1.5B's final hidden states over 688
    code-answer positions, argmax agreement with the fp32 head 0.942 unsmoothed, 0.981 smoothed
    from 64 arbitrary tokens (``quant.head_inputs``), 0.996 in bf16. Every layer of that draft so
    quantized (unsmoothed) agreed 0.885, so it serves the head only. The packed weight is not a
    tensor: ``held_bytes`` counts it (``quant.model_bytes``)."""

    inv: torch.Tensor | None  # buffer
    sizes: list[int]  # the widths of the projections it computes at once (a draft's fused ones: quant)

    def __init__(
        self,
        w: torch.Tensor | None,
        bias: torch.Tensor | None,
        smooth: torch.Tensor | None = None,
        stored: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    ):
        """From ``w`` (smoothed by ``smooth``), or as ``stored`` gives it: (int8 rows, fp64 row
        scales, 1 / smooth or None) from ``int8_rows`` (packed only)."""
        super().__init__()
        if stored is not None:
            q, scale, inv = stored
        else:
            q, scale = _int8_rows(cast(torch.Tensor, w), smooth)
            inv = None if smooth is None else (1 / smooth).float()
        n, k = q.shape
        self.float_bias = None if bias is None else bias.detach().float()  # (inside ``packed``; kept to store it)
        with warnings.catch_warnings():  # torch's quantized tensors are deprecated, not yet replaced on CPU
            warnings.simplefilter("ignore")  # (here: warnings' filters are no thread's to change)
            qt = torch._make_per_channel_quantized_tensor(q, scale, torch.zeros(n, dtype=torch.long), 0)
        self._packing: Future[Any] = _packer().submit(torch.ops.quantized.linear_prepack, qt, self.float_bias)
        self._packed: Any = None
        self.register_buffer("inv", inv)
        self.in_features, self.out_features, self.sizes = k, n, [n]
        self.held_bytes = n * k + n * 8 + (0 if bias is None else n * 4)

    @property
    def packed(self) -> Any:
        """fbgemm's packed weight. Packing runs at ~0.2 GB/s on one core (2.6 s for a 151,936-row
        head): it is done on ``_packer``'s threads while the load goes on, and awaited here."""
        if self._packed is None:
            self._packed = self._packing.result()
        return self._packed

    def int8_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What ``stored`` takes: the weight's int8 rows, fp64 row scales, ``inv`` (to keep them)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qt, _ = torch.ops.quantized.linear_unpack(self.packed)
            return qt.int_repr(), qt.q_per_channel_scales().double(), self.inv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        flat = flat if self.inv is None else flat * self.inv
        y: torch.Tensor = torch.ops.quantized.linear_dynamic(flat, self.packed, True)  # (reduce_range: 7-bit x)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


_PACKERS: dict[int, ThreadPoolExecutor] = {}


def _packer() -> ThreadPoolExecutor:
    """This process's threads that pack int8 weights (torch's op leaves the GIL: as many at once as
    cores, beside the rest of a load). Per process: a forked worker does not inherit threads."""
    pid = os.getpid()
    if pid not in _PACKERS:
        _PACKERS[pid] = ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="int8-pack")
    return _PACKERS[pid]


def int8_engine() -> bool:
    """Whether this torch build has a quantized CPU engine for DynamicInt8Linear."""
    return torch.backends.quantized.engine not in ("none", "")


def _int8_rows(w: torch.Tensor, smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (times ``smooth`` per column) in symmetric per-row int8: the rows and their scales,
    ROWS_AT_ONCE rows at a time (no fp32 copy of a 0.9 GB head)."""
    w = w.detach().float()
    n, k = w.shape
    ints, scale = torch.empty(n, k, dtype=torch.int8), torch.empty(n, dtype=torch.float64)
    for i in range(0, n, ROWS_AT_ONCE):
        part = w[i : i + ROWS_AT_ONCE] * smooth[None, :] if smooth is not None else w[i : i + ROWS_AT_ONCE]
        s = (absmax(part, -1) / 127).clamp(min=1e-10)
        ints[i : i + ROWS_AT_ONCE] = (part / s[:, None]).round().clamp(-128, 127).to(torch.int8)
        scale[i : i + ROWS_AT_ONCE] = s
    return ints, scale


def _copy(kind: str, w: torch.Tensor) -> torch.Tensor:
    """The weight as ``kind``'s kernel reads it."""
    if kind == "row":
        return w.contiguous()
    if kind == "col":
        return w.t().contiguous().t()
    if kind == "onednn":
        return cast(torch.Tensor, torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None))
    if kind == "int8":  # an int8 copy of the weight (a draft's head: DynamicInt8Linear), timed for fastest_ms
        return cast(torch.Tensor, DynamicInt8Linear(w, None))
    raise ValueError(kind)


Kernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _fn(kind: str) -> Kernel:
    """y2d = fn(x2d, copy)."""
    if kind == "onednn":
        return lambda x, p: torch.ops.mkldnn._linear_pointwise(x.contiguous(), p, None, "none", [], "")
    if kind == "int8":
        return lambda x, m: cast(Callable[[torch.Tensor], torch.Tensor], m)(x)  # (the module: _copy)
    return torch.nn.functional.linear


def kinds(dtype: torch.dtype) -> list[str]:
    """The kernels timed for ``dtype``, oneDNN's first where it runs: it is the fastest for a
    model's matrices on every CPU measured, so the others stop at the first row count where
    they fall GIVE_UP behind it (timed after it, they had no rival: a first Qwen2.5-1.5B load
    timed its 0.93 GB head in 28 s, ~23 s of it plain matmuls 3-9x behind oneDNN's)."""
    out = ["row", "col"]
    if _onednn_ok() and dtype in (torch.float32, torch.bfloat16):
        out.insert(0, "onednn")
    return out


def machine_key() -> str:
    """CPU model and flags, torch version and threads: what the timings depend on."""
    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    digest = hashlib.sha256(flags.encode()).hexdigest()[:10]
    return f"{model}|flags {digest}|torch {torch.__version__}|threads {torch.get_num_threads()}"


def _time(fn: Kernel, weights: list[torch.Tensor], x: torch.Tensor, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in weights:
            fn(x, w)
        best = min(best, time.perf_counter() - t0)
    return best


def last_level_cache() -> int:
    """Bytes of this CPU's last-level cache (Linux sysfs), 32 MiB where it cannot be read."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"), reverse=True):
        try:
            size = (index / "size").read_text().strip()
            return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError):
            continue
    return 32 << 20


def sample(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The matrices of a shape that are timed: enough to stream ``COLD`` times the last-level
    cache from memory (so a kernel is timed as a decode step runs it, weights not in cache),
    not all of them (a 1.5B model's 28 gate/up matrices are 3 GB a pass: minutes to time)."""
    each = weights[0].numel() * weights[0].element_size()
    return weights[: max(2, math.ceil(COLD * last_level_cache() / each))]


def _copies(kind: str, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The timed copies: one per matrix, or for an int8 copy (a quarter of fp32's bytes) enough of
    them to stream ``COLD`` times the last-level cache too (a head timed from cache would flatter it)."""
    n = len(weights)
    if kind == "int8" and weights[0].numel() >= 1 << 20:  # (a model's; a tiny test model's stays in cache either way)
        n = max(n, math.ceil(COLD * last_level_cache() / weights[0].numel()))
    return [_copy(kind, weights[i % len(weights)]) for i in range(n)]


@torch.inference_mode()
def measure(weights: list[torch.Tensor], kinds_: list[str], points: tuple[int, ...] = POINTS) -> dict[str, list[float]]:
    """Seconds per kernel to multiply ``points`` rows by one matrix of ``weights`` (one shape):
    the mean over the matrices ``sample`` picks, streamed from memory."""
    weights = sample(weights)
    out: dict[str, list[float]] = {}
    for kind in kinds_:
        try:
            copies, fn = _copies(kind, weights), _fn(kind)
            fn(torch.zeros(1, weights[0].shape[1], dtype=weights[0].dtype), copies[0])
        except RuntimeError as e:  # a kernel this build or dtype lacks
            log.info("kernel %s unavailable for %s: %s", kind, tuple(weights[0].shape), e)
            continue
        times: list[float] = []
        for i, m in enumerate(points):
            rival = min((t[i - 1] for t in out.values()), default=float("inf")) if i else float("inf")
            if times and times[-1] > GIVE_UP * rival:
                times.append(float("inf"))  # far behind another kernel: not timed at larger counts
                continue
            x = torch.randn(m, weights[0].shape[1], dtype=weights[0].dtype)
            _time(fn, copies[:2], x, 1)  # warm up
            times.append(_time(fn, copies, x) / len(copies))  # (per matrix: an int8 copy is timed over more)
        out[kind] = times
        del copies
    return out


def choose(times: dict[str, list[float]]) -> list[str]:
    """The kernel for each of POINTS: one for all of them (each kernel kept costs a copy of the
    weights), the one whose time relative to the fastest at each row count has the least
    geometric mean over POINTS; on a tie the first in ``times``' order."""
    best = [min(t[i] for t in times.values()) for i in range(len(POINTS))]

    def cost(kind: str) -> float:
        return math.fsum(
            math.log((t + 1e-9) / (b + 1e-9)) if math.isfinite(t) else math.inf for t, b in zip(times[kind], best)
        )

    one = min(times, key=cost)
    return [one] * len(POINTS)


def table(choice: list[str]) -> list[str]:
    """Row count -> kernel, for 0..TABLE-1: the choice at the nearest point at or above it."""
    out = []
    for m in range(TABLE):
        i = next((i for i, p in enumerate(POINTS) if p >= m), len(POINTS) - 1)
        out.append(choice[i])
    return out


def untune(model: torch.nn.Module) -> None:
    """Undo ``tune``: every Linear back to its own forward and a row-major weight."""
    for m in model.modules():
        if getattr(m, "_kernels", None) is not None:
            weight = cast(torch.Tensor, m.weight)
            if weight.numel() == 0:
                raise ValueError(
                    "this model's weights were handed to oneDNN's packed layout (kernels.tune): copy or "
                    "untune a model before preparing it for decoding"
                )
            m.__dict__.pop(getattr(m, "linear_method", None) or "forward", None)
            weight.data = weight.data.contiguous()
            vars(m).update(_kernels=None, _kernel_weights=None)  # plain attributes, as _install set them


def tied(module: torch.nn.Module, model: torch.nn.Module) -> bool:
    """Whether ``module``'s weight is also another module's (a head tied to the embedding,
    which looks rows up in it): it keeps its row-major data."""
    weight = getattr(module, "weight", None)
    return any(p is weight for m in model.modules() if m is not module for p in m.parameters(recurse=False))


def _linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules that multiply by a 2-D ``weight``: nn.Linear, and modules that declare
    ``linear_method`` (the draft's SubsetHead: its ``subset_logits``)."""
    out = []
    for m in model.modules():
        w = getattr(m, "weight", None)
        if (isinstance(m, torch.nn.Linear) or getattr(m, "linear_method", None)) and isinstance(w, torch.Tensor):
            if w.dim() == 2 and min(w.shape) > 1 and getattr(m, "_kernels", None) is None:
                out.append(m)
    return out


def _install(module: torch.nn.Module, table_: list[str], copies: dict[str, torch.Tensor]) -> None:
    vars(module).update(_kernels=table_, _kernel_weights=copies)  # plain attributes (not buffers: no state_dict)
    fns = {kind: _fn(kind) for kind in copies}
    bias = getattr(module, "bias", None)

    def linear(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        m = x.numel() // x.shape[-1] if x.dim() else 1
        kind = table_[m] if m < TABLE else table_[-1]
        y = fns[kind](x.reshape(-1, x.shape[-1]), copies[kind])
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    setattr(module, getattr(module, "linear_method", None) or "forward", types.MethodType(linear, module))


_load = jsoncache.load


def _save(cache_file: Path | None, data: dict[str, Any]) -> None:
    if cache_file is None:
        return
    try:
        jsoncache.update(cache_file, data)
    except OSError as e:  # a read-only cache costs a re-measure next time, nothing else
        log.info("could not save kernel timings to %s: %s", cache_file, e)


def _usable(entry: Any, points: tuple[int, ...], kinds_: list[str]) -> bool:
    """Whether a cached entry holds timings of known kernels at ``points`` (at least) rows: a
    damaged or hand-edited one is measured again, not a crash at every load."""
    if not isinstance(entry, dict) or not isinstance(entry.get("ms"), dict) or not entry["ms"]:
        return False
    n = len(points)
    return entry.get("points", [])[:n] == list(points) and all(
        kind in kinds_
        and isinstance(ms, list)
        and len(ms) >= n
        and all(isinstance(t, (int, float)) and t >= 0 for t in ms[:n])
        for kind, ms in entry["ms"].items()
    )


def remembered(cache_file: Path | None, key: str) -> Any:
    """A figure measured once on this machine and kept under ``key`` in ``cache_file`` (None:
    not yet; ``remember`` keeps one)."""
    return _load(cache_file).get(f"{machine_key()}|{key}")


def remember(cache_file: Path | None, key: str, value: Any) -> None:
    cached = _load(cache_file)
    cached[f"{machine_key()}|{key}"] = value
    _save(cache_file, cached)


def _entry(
    cached: dict[str, Any],
    machine: str,
    weights: list[torch.Tensor],
    kind: str | None = None,
    points: tuple[int, ...] = POINTS,
) -> tuple[dict[str, Any], bool]:
    """The timings of ``weights`` (one shape and dtype) at ``points`` rows from ``cached``,
    else measured now and added to it; and whether they were measured. ``kind``: that kernel
    only (its own entry)."""
    shape, dtype = tuple(weights[0].shape), weights[0].dtype
    key = f"{machine}|{TIMINGS}|{str(dtype).removeprefix('torch.')}|{shape[0]}x{shape[1]}x{len(weights)}"
    key += f"|{kind}" if kind else ""
    entry, kinds_ = cached.get(key), [kind] if kind else kinds(dtype)
    if entry is not None and _usable(entry, points, kinds_):
        n = len(points)  # (an entry timed at more points serves the first of them)
        return {"points": list(points), "ms": {k: v[:n] for k, v in entry["ms"].items()}}, False
    logging.getLogger("specdec_llm.load").info(f"timing matmul kernels for {key.split('|', 5)[-1]} (once per machine)")
    times = measure(weights, kinds_, points)
    entry = {"points": list(points), "ms": {k: [round(t * 1e3, 4) for t in v] for k, v in times.items()}}
    cached[key] = entry
    return entry, True


def fastest_ms(
    weight: torch.Tensor, rows: int = 1, cache_file: Path | None = None, kind: str | None = None, every: bool = True
) -> float:
    """Milliseconds of the fastest kernel multiplying ``rows`` rows by ``weight`` on this
    machine (the timings ``tune`` uses, from the same cache): for load-time choices between
    copies of a weight in different dtypes. ``kind``: that kernel's time only (``"int8"``: an
    int8 copy of the weight, timed up to ``rows`` rows only: no Linear is tuned with it);
    infinite where this build lacks it. ``every=False``: timed up to ``rows`` rows only (a copy
    that may never be built; ``tune`` times the rest if it is)."""
    upto = next((i for i, p in enumerate(POINTS) if p >= rows), len(POINTS) - 1)
    points = POINTS if kind is None and every else POINTS[: upto + 1]
    cached = _load(cache_file)
    entry, new = _entry(cached, machine_key(), [weight.detach()], kind, points)
    if new:
        _save(cache_file, cached)
    return min((float(v[upto]) for v in entry["ms"].values()), default=math.inf)


@torch.no_grad()
def tune(model: torch.nn.Module, cache_file: Path | None = None, force: str | None = None) -> dict[str, Any]:
    """Give every Linear of ``model`` (on CPU) the fastest kernel per row count; returns
    {shape: {"choice": {rows: kernel}, "ms": {kernel: [ms at POINTS]}}}. Idempotent.
    ``force``: one kernel for every row count, unmeasured (benchmarks compare them)."""
    groups: dict[tuple[tuple[int, ...], torch.dtype], list[torch.nn.Module]] = {}
    for m in _linears(model):
        w = cast(torch.Tensor, m.weight)
        groups.setdefault((tuple(w.shape), w.dtype), []).append(m)
    if not groups:
        return {}
    machine = machine_key()
    cached = _load(cache_file)
    report: dict[str, Any] = {}
    dirty = False
    for (shape, _dtype), mods in groups.items():
        # one matrix per module (a tied LM head shares the embedding's tensor: counted once)
        weights = list({w.data_ptr(): w.detach() for w in (cast(torch.Tensor, m.weight) for m in mods)}.values())
        if force is not None:
            entry: dict[str, Any] = {"points": list(POINTS), "ms": {force: [0.0] * len(POINTS)}}
        else:
            entry, new = _entry(cached, machine, weights)
            dirty = dirty or new
        del weights  # (the originals go as their copies are made: not the whole group at once)
        choice = choose(entry["ms"])
        tab = table(choice)
        for m in mods:
            kind = choice[0]
            weight = cast(torch.Tensor, m.weight)
            w = weight.detach()
            copy = w if kind == "row" and w.is_contiguous() else _copy(kind, w)
            if kind in ("row", "col"):  # a layout a Linear's weight may have: the parameter takes it
                weight.data = copy
            elif not tied(m, model):  # (oneDNN's packed blob is no weight: the row-major one goes)
                weight.data = weight.data.new_empty(0)
            _install(m, tab, {kind: copy})
        report[f"{shape[0]}x{shape[1]}"] = {"choice": dict(zip(POINTS, choice)), "ms": entry["ms"]}
    if dirty:
        _save(cache_file, cached)
    return report
