"""Prometheus metrics of a worker: ``specdec-llm worker --metrics-port N``.

prometheus_client in its multiprocess mode: each process that decodes (a prefork pool
child, or the one batching process) writes its samples to files in a folder
(``PROMETHEUS_MULTIPROC_DIR``: given, or a fresh temporary one), and the worker's main
process serves their sum on ``http://HOST:N/metrics``. Metrics are recorded here, from the
engine's per-request ``Stats``; the engine knows nothing of Prometheus.

Names follow vLLM's (``vllm:spec_decode_*``, ``vllm:time_to_first_token_seconds``...) with
the prefix ``specdec_``; every series has the label ``pair``:

- counters: ``specdec_spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total`` (label ``drafter``),
  ``..._num_accepted_tokens_per_pos_total`` (labels ``drafter``, ``position``: drafts whose
  token at that position was accepted), ``specdec_prompt_tokens_total``,
  ``specdec_generation_tokens_total``, ``specdec_request_success_total`` (label
  ``finished_reason``), ``specdec_request_failure_total`` (label ``reason``);
- histograms: ``specdec_e2e_request_latency_seconds`` (decoding, prefill included),
  ``specdec_request_queue_time_seconds``, ``specdec_time_to_first_token_seconds``,
  ``specdec_request_tokens_per_second``, ``specdec_request_acceptance_rate`` (requests that
  drafted), ``specdec_request_speedup`` (over target-only, Stats.baseline_s);
- gauges: ``specdec_num_requests_running`` (tasks generating now), ``specdec_batch_size``
  (rows in the batches decoding now, summed over the worker's processes),
  ``specdec_num_requests_waiting`` (requests handed to a process but not in its batch yet)
  and ``specdec_queue_depth`` (messages in the pair's broker queue, read at each scrape).

Mean acceptance length (vLLM's) = 1 + accepted / drafts.
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec_llm.engine.serve import BatchServer

log = logging.getLogger(__name__)

ENV = "PROMETHEUS_MULTIPROC_DIR"
SAMPLE_S = 0.5  # how often a decoding process writes its batch-size gauges

_enabled = False  # set in the worker's main process; pool children inherit it (fork)
_metrics: dict[str, Any] | None = None
_sampler: threading.Thread | None = None


def enabled() -> bool:
    return _enabled


def serve(port: int, pair: str, queue: str, addr: str = "0.0.0.0") -> str:
    """In the worker's main process, before any pool process starts: a clean multiprocess
    folder and an HTTP server for ``/metrics`` on ``port``. Returns the folder."""
    global _enabled
    folder = os.environ.get(ENV)
    if folder:
        os.makedirs(folder, exist_ok=True)
        for f in glob.glob(os.path.join(folder, "*.db")):  # samples of an earlier run
            os.remove(f)
    else:
        folder = tempfile.mkdtemp(prefix="specdec-metrics-")
        os.environ[ENV] = folder
        owner = os.getpid()  # (a forked pool process inherits the handler: only the creator removes it)

        def remove() -> None:
            if os.getpid() == owner:
                shutil.rmtree(folder, True)

        atexit.register(remove)
    # prometheus_client picks its multiprocess storage when first imported: only now
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=folder)
    registry.register(_QueueDepth(pair, queue))
    start_http_server(port, addr=addr, registry=registry)
    _enabled = True
    return folder


class _QueueDepth:
    """``specdec_queue_depth``: messages waiting in the pair's broker queue, read at each scrape."""

    def __init__(self, pair: str, queue: str):
        self.pair, self.queue = pair, queue

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            "specdec_queue_depth", "Messages waiting in the pair's broker queue", labels=["pair", "queue"]
        )
        try:
            from specdec_llm.client.broker import get_app

            with get_app().connection_for_read() as conn:
                conn.ensure_connection(max_retries=1, timeout=2)
                depth = conn.default_channel.queue_declare(queue=self.queue, passive=False).message_count
            family.add_metric([self.pair, self.queue], depth)
        except Exception as e:  # noqa: BLE001 - a scrape never fails over the broker; the sample is left out
            log.debug("queue depth of %s unavailable: %s", self.queue, e)
        yield family


def _get() -> dict[str, Any]:
    """The metrics by key, made on first use (prometheus_client is imported then)."""
    global _metrics
    if _metrics is None:
        _metrics = {**_counters(), **_histograms(), **_gauges()}
    return _metrics


def _counters() -> dict[str, Any]:
    from prometheus_client import Counter

    def counter(name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, ["pair", *labels])

    return {
        "drafts": counter("specdec_spec_decode_num_drafts", "Iterations in which a drafter proposed tokens", "drafter"),
        "draft_tokens": counter("specdec_spec_decode_num_draft_tokens", "Draft tokens proposed", "drafter"),
        "accepted": counter("specdec_spec_decode_num_accepted_tokens", "Draft tokens accepted", "drafter"),
        "per_pos": counter(
            "specdec_spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was accepted",
            "drafter",
            "position",
        ),
        "prompt_tokens": counter("specdec_prompt_tokens", "Prompt tokens of finished requests"),
        "generation_tokens": counter("specdec_generation_tokens", "Tokens generated by finished requests"),
        "success": counter("specdec_request_success", "Requests finished", "finished_reason"),
        "failure": counter("specdec_request_failure", "Requests failed (bad input, time-out)", "reason"),
    }


def _histograms() -> dict[str, Any]:
    from prometheus_client import Histogram

    def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ["pair"], buckets=buckets)

    latency = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)
    return {
        "latency": histogram(
            "specdec_e2e_request_latency_seconds",
            "Seconds from a request's start in its worker to its last token",
            latency,
        ),
        "queue": histogram(
            "specdec_request_queue_time_seconds", "Seconds from enqueueing to a worker's start on the request", latency
        ),
        "ttft": histogram(
            "specdec_time_to_first_token_seconds",
            "Seconds to a request's first token",
            (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        ),
        "tps": histogram(
            "specdec_request_tokens_per_second",
            "Output tokens per second of a request",
            (1, 2, 5, 10, 15, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000),
        ),
        "acceptance": histogram(
            "specdec_request_acceptance_rate",
            "Accepted / proposed draft tokens of a request that drafted",
            tuple(i / 10 for i in range(1, 11)),
        ),
        "speedup": histogram(
            "specdec_request_speedup",
            "Target-only counterfactual seconds / seconds taken, per request",
            (0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 3, 4, 6),
        ),
    }


def _gauges() -> dict[str, Any]:
    from prometheus_client import Gauge

    def gauge(name: str, doc: str) -> Gauge:  # summed over the live processes
        return Gauge(name, doc, ["pair"], multiprocess_mode="livesum")

    return {
        "running": gauge("specdec_num_requests_running", "Requests being generated now"),
        "batch": gauge("specdec_batch_size", "Rows in the batches decoding now"),
        "waiting": gauge("specdec_num_requests_waiting", "Requests handed to a decoding process, not in its batch yet"),
    }


def record(pair: str, stats: dict[str, Any], queue_wait_s: float | None = None) -> None:
    """One finished request's ``Stats`` (as a dict)."""
    if not _enabled:
        return
    m = _get()
    for drafter, c in (stats.get("drafter_tokens") or {}).items():
        m["drafts"].labels(pair, drafter).inc(c.get("drafts", 0))
        m["draft_tokens"].labels(pair, drafter).inc(c.get("proposed", 0))
        m["accepted"].labels(pair, drafter).inc(c.get("accepted", 0))
        for pos, n in enumerate(c.get("accepted_per_position") or []):
            m["per_pos"].labels(pair, drafter, str(pos)).inc(n)
    m["prompt_tokens"].labels(pair).inc(stats.get("prompt_tokens") or 0)
    m["generation_tokens"].labels(pair).inc(stats.get("output_tokens") or 0)
    m["success"].labels(pair, stats.get("finish_reason") or "length").inc()
    m["latency"].labels(pair).observe(stats.get("wall_time_s") or 0.0)
    if queue_wait_s is not None and queue_wait_s >= 0:
        m["queue"].labels(pair).observe(queue_wait_s)
    m["ttft"].labels(pair).observe(stats.get("time_to_first_token_s") or 0.0)
    m["tps"].labels(pair).observe(stats.get("tokens_per_s") or 0.0)
    if stats.get("draft_tokens_proposed"):
        m["acceptance"].labels(pair).observe(stats.get("acceptance_rate") or 0.0)
    base, wall = stats.get("baseline_s"), stats.get("wall_time_s")
    if base and wall:
        m["speedup"].labels(pair).observe(base / wall)


def failed(pair: str, reason: str) -> None:
    if _enabled:
        _get()["failure"].labels(pair, reason).inc()


class running:
    """``with metrics.running(pair):`` around a request's generation (the running gauge)."""

    def __init__(self, pair: str):
        self.gauge = _get()["running"].labels(pair) if _enabled else None

    def __enter__(self) -> running:
        if self.gauge is not None:
            self.gauge.inc()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.gauge is not None:
            self.gauge.dec()


def watch(pair: str, server: BatchServer) -> None:
    """In a decoding process: write its ``BatchServer``'s batch size and waiting requests
    to the gauges every ``SAMPLE_S`` seconds (a daemon thread)."""
    global _sampler
    if not _enabled or _sampler is not None:
        return
    m = _get()
    batch, waiting = m["batch"].labels(pair), m["waiting"].labels(pair)

    def loop() -> None:
        stop = threading.Event()
        while not stop.wait(SAMPLE_S):
            batch.set(server.rows)
            waiting.set(server.waiting)

    _sampler = threading.Thread(target=loop, name="specdec-metrics", daemon=True)
    _sampler.start()


def process_exit(pid: int | None = None) -> None:
    """A decoding process ends: its live gauges leave the sums."""
    if _enabled and os.environ.get(ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid or os.getpid())
