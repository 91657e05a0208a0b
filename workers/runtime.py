"""The worker runtime: each worker process holds ONE loaded pair and ONE ``BatchServer``.

Every task hands its request to the process's server (``rt.server.submit(...)``) and waits
for its Future, whatever the pool:

- prefork (``--max-batch 1``): ``specdec-llm worker`` calls
  ``configure(WorkerOptions(...))`` in the parent, which never loads a model (so CUDA is
  never initialised before the fork). Each pool child loads the pair in
  ``worker_process_init`` and keeps it for every task; its server never has more than one
  row (a child runs one task at a time). With ``--calibrate`` child 0 also runs a short
  calibration (target-only and speculative tokens/s), logs it and stores the target-only
  figure as the pair's baseline (reports read it only for rows recorded before 0005: a request's speedup
  is its own counterfactual, Stats.baseline_s). The decoder's cost model comes from the
  on-disk cache when this machine has measured it before (``engine/costcache.py``).
- threads (``--max-batch B`` > 1, or ``auto``, the default: the server chooses B from the
  measured costs, up to ``AUTO_CAP`` task threads): one process, no fork. The pair is
  loaded (and its batch costs measured, or read from the cache) once in ``celeryd_after_setup`` (logging is set up, the pool and
  the consumer not started yet), so no message is taken before the pair is ready; the B
  task threads share the one server, which decodes their requests as one batch.

A process started another way (``celery -A workers.app worker``) loads the pair of its
first task instead (under a lock: task threads wait for the one load), and writes no
heartbeat. A configured worker's process writes one (``heartbeat``: ``specdec-llm workers``)
from the moment its pair is loaded, and its last one when it stops cleanly (a pool child at
its exit, the threads pool's process after its warm shutdown): stopped, with its final counts.

The pair, its decoder and its server come from the project's one cache of loaded pairs
(``specdec_llm.loaded``), as in LangChain's local mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec_llm.engine.serve import BatchServer

import copy
import gc
import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

from celery.signals import celeryd_after_setup, worker_process_init, worker_process_shutdown, worker_shutdown

from specdec_llm import loaded as loaded_pairs
from specdec_llm import store
from specdec_llm.engine import GenerationRequest
from specdec_llm.engine.types import auto_cap
from specdec_llm.settings import get_settings

from . import heartbeat, metrics

log = logging.getLogger(__name__)

CALIBRATION_PROMPT = "The quick brown fox jumps over the lazy dog. Speculative decoding drafts and verifies."


@dataclass
class WorkerOptions:
    pair: str
    device: str | None = None  # None: the pair's own device
    price_per_hour: float | None = None  # USD per device-hour, for each row's cost estimate
    threads: int | None = None  # torch threads on CPU (None: SPECDEC_THREADS or torch's default)
    calibrate: bool = False  # the legacy start-up calibration run (--calibrate)
    calibration_tokens: int = 32
    # rows decoded together; > 1, "auto" or "auto:N" (chosen from measured costs, up to N): the threads pool,
    # one process per device
    max_batch: int | str = 1
    max_wait_ms: float = 20.0  # an idle server waits this long for a burst to start as one batch
    metrics_port: int | None = None  # Prometheus metrics on this port (workers/metrics.py)

    @property
    def pool(self) -> str:
        """The Celery pool this worker runs: ``threads`` when it batches, else ``prefork``."""
        return "threads" if auto_cap(self.max_batch) is not None or int(self.max_batch) > 1 else "prefork"


@dataclass
class Runtime:
    pair: str
    device: str
    dtype: str
    loaded: loaded_pairs.Loaded  # the pair, its decoder, and the BatchServer every task's request goes through
    worker: dict[str, Any]  # store.worker_info(...)
    price_per_hour: float | None

    @property
    def server(self) -> BatchServer:
        server: BatchServer = self.loaded.server
        return server


_options: WorkerOptions | None = None  # set in the parent; forked children inherit it
_runtime: Runtime | None = None  # this process's pair, once loaded
_loading = threading.Lock()  # task threads (threads pool) wait for one load
_load_failed = None  # multiprocessing.Value in shared memory: a pool child that cannot load sets it
LOAD_FAILED_EXIT = 3  # `specdec-llm worker`'s exit status when its pair could not be loaded


def configure(options: WorkerOptions) -> None:
    global _options, _load_failed
    import multiprocessing

    _options = options
    _load_failed = multiprocessing.get_context("fork").Value("b", 0, lock=False)  # forked children share it


def load_failed() -> bool:
    """Whether this worker (its own process or one of its pool children) could not load its pair."""
    return bool(_load_failed is not None and _load_failed.value)


def load_error_text(pair: str, e: BaseException) -> str:
    """One line that says why ``pair`` did not load, with a hint for running out of memory."""
    text = f"could not load pair {pair}: {type(e).__name__}: {e}"
    if isinstance(e, MemoryError) or "OutOfMemoryError" in type(e).__name__ or "out of memory" in str(e).lower():
        text += (
            " (out of memory while loading: free memory on the device, use a smaller dtype or model, "
            "or a device with more memory)"
        )
    return text


def configured_pair() -> str | None:
    """The pair this worker serves (None before ``configure``)."""
    return _options.pair if _options is not None else None


def serves(pair: str) -> bool:
    """Whether this process is (or will be) the one for ``pair``."""
    if _runtime is not None:
        return _runtime.pair == pair
    return _options is None or _options.pair == pair


def get(pair: str) -> Runtime:
    """This process's runtime, loading ``pair`` on first use."""
    global _runtime
    if _runtime is None:
        with _loading:
            if _runtime is None:
                options = _options if _options is not None and _options.pair == pair else WorkerOptions(pair)
                _runtime = load(options)
    return _runtime


def load(options: WorkerOptions) -> Runtime:
    import torch

    from specdec_llm.pairs import get_spec

    spec = copy.copy(get_spec(options.pair))
    spec.device = options.device or spec.device
    if spec.device.startswith("cuda:"):
        torch.cuda.set_device(torch.device(spec.device))  # this process's default GPU (kernels, caches)
    loaded = loaded_pairs.get(
        spec, threads=options.threads, max_batch=options.max_batch, max_wait_ms=options.max_wait_ms
    )
    rt = Runtime(
        pair=spec.name,
        device=spec.device,
        dtype=spec.dtype,
        loaded=loaded,
        worker=store.worker_info(spec.device),
        price_per_hour=store.price_for(options.price_per_hour, spec.device),
    )
    log.info(
        "worker %s: pair %s on %s (%s), %s; batches of up to %s (max wait %g ms); store %s",
        os.getpid(),
        spec.name,
        spec.device,
        spec.dtype,
        memory_text(rt),
        options.max_batch,
        options.max_wait_ms,
        store.mask_url(get_settings().effective_database_url),
    )
    try:
        store.upsert_pair(
            spec.name,
            target=spec.target,
            draft=spec.draft,
            target_fingerprint=loaded.pair.target_fingerprint,
            draft_fingerprint=loaded.pair.draft_info.get("fingerprint"),
            dtype=spec.dtype,
            device=spec.device,
        )
        store.upsert_worker(rt.worker)
    except store.StoreError as e:  # tasks retry their own writes; don't die over bookkeeping
        log.warning("could not register the pair and worker in the store: %s", e)
    metrics.watch(spec.name, rt.server)  # (a no-op without --metrics-port)
    return rt


def memory_text(rt: Runtime) -> str:
    """Weights held (shared tensors once), process RSS, and CUDA memory when on a GPU."""
    import torch

    parts = [f"weights {rt.loaded.pair.held_bytes() / 2**20:.1f} MiB"]  # (as `pairs show --load` counts them)
    try:
        with open("/proc/self/status") as f:
            rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        parts.append(f"RSS {rss_kib / 1024:.0f} MiB")
    except (OSError, StopIteration):
        pass
    if rt.device.startswith("cuda"):
        parts.append(f"CUDA allocated {torch.cuda.memory_allocated(torch.device(rt.device)) / 2**20:.0f} MiB")
    return ", ".join(parts)


def calibrate(rt: Runtime, tokens: int = 32) -> dict[str, Any]:
    """Target-only and speculative tokens/s on a short greedy prompt, one request at a time
    (through the server, which owns the decoder); the target-only figure becomes the
    pair's baseline on this device kind and dtype. Run it before tasks arrive."""
    speeds = {}
    for mode in ("baseline", "speculative"):
        rt.server.submit(GenerationRequest(CALIBRATION_PROMPT, max_new_tokens=4, mode=mode)).result()  # warm up
        stats = rt.server.submit(GenerationRequest(CALIBRATION_PROMPT, max_new_tokens=tokens, mode=mode)).result().stats
        speeds[mode] = stats
    base, spec = speeds["baseline"], speeds["speculative"]
    log.info(
        "calibration %s on %s: target-only %.1f tok/s, speculative %.1f tok/s (acceptance %.2f, %.2f tokens/target forward)",
        rt.pair,
        rt.device,
        base.tokens_per_s,
        spec.tokens_per_s,
        spec.acceptance_rate,
        spec.mean_accepted_length,
    )
    if base.tokens_per_s > 0:
        try:
            store.record_baseline(rt.pair, device=rt.device, dtype=rt.dtype, tokens_per_s=base.tokens_per_s)
        except store.StoreError as e:
            log.warning("could not store the calibration baseline: %s", e)
    return {"baseline_tokens_per_s": base.tokens_per_s, "speculative_tokens_per_s": spec.tokens_per_s}


def stop_worker(reason: str) -> None:
    """This process cannot hold its pair: stop the whole worker rather than take messages
    it cannot serve (they go back to the queue: acks are late)."""
    from billiard.process import current_process

    log.critical("%s; stopping the worker", reason)
    if _load_failed is not None and reason.startswith("could not load"):
        _load_failed.value = 1  # the worker's exit status says so (shared memory: seen by the parent)
    if current_process().name != "MainProcess":  # a pool child: its parent is the worker
        os.kill(os.getppid(), signal.SIGTERM)
    elif _options is not None and _options.pool == "threads":  # a task thread: this process is the worker
        os.kill(os.getpid(), signal.SIGTERM)  # warm shutdown


@worker_process_init.connect
def _load_after_fork(**_: Any) -> None:
    if _options is None or _options.pool != "prefork":
        return
    try:
        rt = get(_options.pair)
    except Exception as e:  # noqa: BLE001 - whatever it is, this worker cannot serve
        stop_worker(load_error_text(_options.pair, e))
        return
    heartbeat.start(rt)  # `specdec-llm workers` lists this process from now on
    if _options.calibrate and _process_index() == 0:
        calibrate(rt, _options.calibration_tokens)


@worker_process_shutdown.connect
def _metrics_process_exit(pid: int | None = None, **_: Any) -> None:
    metrics.process_exit(pid)
    if _runtime is not None:  # a prefork pool child that beat: it stops cleanly
        heartbeat.stop(_runtime)


@worker_shutdown.connect
def _stopped(**_: Any) -> None:
    """The worker's warm shutdown is over: the threads pool's process (the one that beat)
    says it stopped (``specdec-llm workers``). The process exits next: its objects are frozen
    out of the garbage collector, whose last pass would walk them all for nothing (~1 s with
    a model loaded, after every task is done)."""
    if _runtime is not None and _options is not None and _options.pool == "threads":
        heartbeat.stop(_runtime)
    if _options is not None:  # (our worker command's process, not a worker run inside another program)
        gc.freeze()


@celeryd_after_setup.connect
def _load_before_threads(**_: Any) -> None:
    """The threads pool has no fork: load (and calibrate) once in the worker process itself,
    before its pool and consumer start. A failure stops the worker before it takes a message.
    With ``--max-batch auto`` the server chooses the batch size from the measured costs (the
    pool has ``AUTO_CAP`` task threads: the requests beyond that size wait for a place)."""
    if _options is None or _options.pool != "threads":
        return
    try:
        rt = get(_options.pair)
    except Exception as e:  # noqa: BLE001 - whatever it is, this worker cannot serve
        log.critical("%s; stopping the worker", load_error_text(_options.pair, e))
        if _load_failed is not None:
            _load_failed.value = 1
        raise SystemExit(
            LOAD_FAILED_EXIT
        ) from None  # not an Exception: Celery's signal dispatch lets it through to the worker
    rt.server.ready.wait()
    heartbeat.start(rt)  # `specdec-llm workers` lists this process from now on (its batch size chosen)
    if isinstance(_options.max_batch, str):  # auto, auto:N
        log.info(
            "batches of up to %d rows: the most tokens/s on this machine by its measured costs", rt.server.max_batch
        )
    if _options.calibrate:
        calibrate(rt, _options.calibration_tokens)


def _process_index() -> int:
    from billiard.process import current_process

    return getattr(current_process(), "index", 0) or 0
