"""Local worker processes: ``specdec-llm worker`` as a child of this one (``run``, the
examples, tests) that dies with it, stopped warm, and the tail of its log when it stopped on
its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from specdec_llm.settings import get_settings


class LocalWorker(subprocess.Popen[bytes]):
    """A local worker's process, and the file its output goes to."""

    log_path: Path


def start_local_worker(
    pair: str,
    *,
    device: str | None = None,
    concurrency: int = 1,
    max_batch: int | str | None = None,
    log_path: Path | None = None,
    extra: list[str] | None = None,
) -> LocalWorker:
    """``specdec-llm worker`` for ``pair`` as a child process with this environment; its
    output goes to ``log_path`` (default: ``<data_dir>/logs/worker-<pair>-<time>.log``).
    ``max_batch`` > 1: one batching process (``--max-batch``; None: the settings' default).
    It dies with this process (Linux: SIGTERM, a warm shutdown, when the thread that called
    this dies, killed or not): a killed ``run`` leaves no worker behind."""
    if log_path is None:
        log_path = (
            get_settings().data_dir / "logs" / f"worker-{pair}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        *_dying_with_this_process(),
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
        proc = LocalWorker(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    proc.log_path = log_path
    return proc


# Run in the child before it becomes the worker (Linux): the kernel sends it SIGTERM when the
# thread that started it dies, however it dies (SIGKILL included); a warm shutdown follows, as
# stop_local_worker's. The setting survives exec. A parent already gone: the child stops here.
_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def _dying_with_this_process() -> list[str]:
    """The start of a child's command line that stops the child when this process dies (the
    parent's death signal, on Linux; elsewhere, plain ``python``)."""
    if not sys.platform.startswith("linux"):
        return [sys.executable]
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid())]


def stop_local_worker(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int | None:
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


def log_tail(proc: LocalWorker, lines: int = 12) -> str:
    """The worker's last critical message if it logged one (why it stopped), else its last lines."""
    try:
        text = Path(proc.log_path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    critical = [line for line in text if "CRITICAL/" in line]
    return critical[-1] if critical else "\n".join(text[-lines:])
