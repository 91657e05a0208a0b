"""Local worker processes: ``specdec-llm worker`` as a child of this one (``run``, the
examples, tests), stopped warm, and the tail of its log when it stopped on its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from specdec_llm.settings import get_settings


def start_local_worker(
    pair: str,
    *,
    device: str | None = None,
    concurrency: int = 1,
    max_batch: int | None = None,
    log_path: Path | None = None,
    extra: list[str] | None = None,
) -> subprocess.Popen:
    """``specdec-llm worker`` for ``pair`` as a child process with this environment; its
    output goes to ``log_path`` (default: ``<data_dir>/logs/worker-<pair>-<time>.log``).
    ``max_batch`` > 1: one batching process (``--max-batch``; None: the settings' default)."""
    if log_path is None:
        log_path = (
            get_settings().data_dir / "logs" / f"worker-{pair}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "specdec_llm",
        "worker",
        "--pair",
        pair,
        "--concurrency",
        str(concurrency),
        *(extra or []),
    ]
    if device:
        cmd += ["--device", device]
    if max_batch is not None:
        cmd += ["--max-batch", str(max_batch)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    proc.log_path = log_path
    return proc


def stop_local_worker(proc: subprocess.Popen, timeout: float = 30.0) -> int | None:
    """Warm shutdown (SIGTERM: the running task finishes, unacknowledged messages go back to
    the queue); SIGKILL to its process group after ``timeout`` s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def log_tail(proc: subprocess.Popen, lines: int = 12) -> str:
    """The worker's last critical message if it logged one (why it stopped), else its last lines."""
    try:
        text = Path(proc.log_path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    critical = [line for line in text if "CRITICAL/" in line]
    return critical[-1] if critical else "\n".join(text[-lines:])
