"""The job client: everything a process that *sends* work does, over the store.

It knows the task's name, the queues and the message (``protocol.py``) and sends by name:
it imports no task code (``workers/``), and Celery only when it sends. Plain dicts in and out.

- ``jobs.py``: submit a file as a job, enqueue rows, status, results, retry, cancel (a job, or
  one row: ``cancel_request``), wait; hold a job against ``prune`` while a command still uses it
  (``holding``);
- ``rows.py`` / ``openai_batch.py``: input files -> rows -> store requests -> ``GenerationRequest``;
  OpenAI Batch lines in and out;
- ``streams.py``: text from the worker to the caller while it generates (both ends use it);
- ``local.py``: local worker processes (``specdec-llm worker`` as a child process);
- ``protocol.py``: the job protocol both ends share: the task's name, its queues, its message;
- ``broker.py`` / ``embedded.py``: the Celery configuration both ends share, the embedded broker;
- ``cli.py``: ``specdec-llm submit | status | results | retry | cancel | run``;
  ``ops_cli.py``: ``specdec-llm jobs | workers | prune`` and ``status --watch``.

    from specdec_llm import client
    job = client.submit("prompts.jsonl", "smollm2-135m", {"max_new_tokens": 64})
    client.wait(job["job_id"]); client.results(job["job_id"])
"""

from .broker import (
    QueueError,
    broker_display,
    check_broker,
    check_broker_url,
    is_embedded,
    live_workers,
    queue_size,
)
from .jobs import (
    FORMATS,
    JOB_HOLD_S,
    PENDING,
    RESULT_FIELDS,
    cancel,
    cancel_request,
    enqueue,
    get_job,
    holding,
    job_counts,
    job_requests,
    reclaim_and_enqueue,
    requeue_lost,
    results,
    retry,
    status,
    submit,
    wait,
    wait_for_empty_queue,
    write_results,
)
from .local import log_tail, start_local_worker, stop_local_worker
from .protocol import FINISHED, MAX_ATTEMPTS, TASK, queue_name, task_message
from .rows import InputError, build_request
from .streams import StreamDiverged, StreamWriter, follow_stream

__all__ = [
    "FINISHED",
    "FORMATS",
    "JOB_HOLD_S",
    "MAX_ATTEMPTS",
    "PENDING",
    "RESULT_FIELDS",
    "TASK",
    "InputError",
    "QueueError",
    "StreamDiverged",
    "StreamWriter",
    "broker_display",
    "build_request",
    "cancel",
    "cancel_request",
    "check_broker",
    "check_broker_url",
    "enqueue",
    "follow_stream",
    "get_job",
    "holding",
    "is_embedded",
    "job_counts",
    "job_requests",
    "live_workers",
    "log_tail",
    "queue_name",
    "queue_size",
    "reclaim_and_enqueue",
    "requeue_lost",
    "results",
    "retry",
    "start_local_worker",
    "status",
    "stop_local_worker",
    "submit",
    "task_message",
    "wait",
    "wait_for_empty_queue",
    "write_results",
]
