"""The one cache of loaded pairs: each pair is loaded once per process, and one
``BatchServer`` (its own thread) owns its decoder. Every generation in a long-lived process
goes through it: the worker runtime (``workers/runtime.py``: one pair per worker process)
and LangChain's local mode (``specdec_llm/langchain/local.py``: any pair, in this process).

    loaded = get("smollm2-135m")            # a name, or a PairSpec (e.g. another device)
    result = loaded.server.submit(GenerationRequest("Hi")).result()

torch is imported on first use, not with this module.
"""

from __future__ import annotations

import atexit
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

_cache: dict[tuple, Loaded] = {}
_lock = threading.Lock()  # callers on many threads wait for one load
EXIT_WAIT_S = 60.0  # at exit, how long a server may take to end the work in hand (a calibration)


@atexit.register
def _close_servers() -> None:
    """Servers end before the interpreter does: a server thread still inside torch when the
    process finalizes aborts it (std::terminate) instead of exiting with its code."""
    for entry in list(_cache.values()):
        if entry.server is not None:
            entry.server.close(EXIT_WAIT_S)


@dataclass
class Loaded:
    spec: Any  # pairs.PairSpec
    pair: Any  # pairs.Pair
    decoder: Any  # engine SpeculativeDecoder (its server's thread runs it)
    server: Any  # engine.serve.BatchServer over ``decoder``

    @property
    def tokenizer(self):
        return self.pair.tokenizer


def _load_on_a_thread_that_ends(spec: Any) -> tuple[Any, Any]:
    """The pair and its decoder, loaded on a thread of its own, joined: a load's torch work
    leaves no OpenMP threads behind. Loaded on the caller's thread (a worker's main thread),
    that thread kept its OpenMP pool while the server's thread ran every forward with a pool of
    its own: more OpenMP threads than CPUs, so libgomp stops spinning between parallel regions
    and each region waits for its threads to wake. Calibration in the server's thread of a
    2-vCPU worker took 25-50% longer than on the loading thread itself (docs/benchmarks.md).
    The caller's current CUDA device (per thread; a worker sets its own) goes along. A daemon
    thread: a worker told to stop while it loads exits without waiting for the load's end."""
    import torch

    from .pairs import load_pair

    cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    done: Future[tuple[Any, Any]] = Future()

    def load() -> None:
        try:
            if cuda is not None:
                torch.cuda.set_device(cuda)
            pair = load_pair(spec)
            done.set_result((pair, pair.decoder()))
        except BaseException as e:  # noqa: BLE001 - the caller's to raise
            done.set_exception(e)

    thread = threading.Thread(target=load, name="specdec-load", daemon=True)
    thread.start()
    result = done.result()
    thread.join()  # (its OpenMP pool ends with it)
    return result


def get(pair, *, threads: int | None = None, max_batch: int | str = 1, max_wait_ms: float = 20.0) -> Loaded:
    """``pair`` (a name or a ``PairSpec``) loaded, with its server. The first load sets
    torch's threads (``pairs.use_threads(threads)``). A server with other batching settings,
    or a closed one, is replaced (the loaded models are kept)."""
    from .engine.serve import BatchServer
    from .engine.types import parse_max_batch
    from .pairs import get_spec, use_threads

    spec = get_spec(pair) if isinstance(pair, str) else pair
    key = (
        spec.name,
        spec.target,
        spec.draft,
        spec.dtype,
        spec.device,
        spec.k,
        tuple(spec.drafters or ()),
        spec.trust_remote_code,
    )
    with _lock:
        entry = _cache.get(key)
        if entry is None:
            use_threads(threads)
            loaded, decoder = _load_on_a_thread_that_ends(spec)
            entry = _cache[key] = Loaded(spec, loaded, decoder, None)
        server = entry.server
        if (
            server is None
            or server.closed.is_set()
            or (server.setting, server.max_wait) != (parse_max_batch(max_batch), max_wait_ms / 1000)
        ):
            if server is not None:
                server.close()
            entry.server = BatchServer(entry.decoder, max_batch=max_batch, max_wait_ms=max_wait_ms)
        return entry
