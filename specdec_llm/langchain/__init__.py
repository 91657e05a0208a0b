"""LangChain integration: ``SpecDecLLM`` (an ``LLM``) and ``ChatSpecDec`` (a chat model).

Thin adapters, laid out as langchain-ollama's are: ``llms.py`` and ``chat_models.py`` turn
LangChain calls into plain items and results; ``base.py`` holds their shared fields and
resolves a call; both call one interface (``backend.Backend``) with two implementations.
There is no second decode path:

- **remote** (``remote.py``; the default when ``SPECDEC_BROKER_URL`` is set): a call
  persists its prompts as request rows of a store job and enqueues them all in one
  submission on the pair's queue (``specdec_llm.client.enqueue(..., keep_results=True)``);
  the Celery workers generate and record them, and the call waits on the task results.
  ``.stream`` marks its row ``"_stream": true``: the worker publishes accepted text as it
  is generated (Redis stream, or files with the embedded broker) and the call yields it
  from there (``specdec_llm.client.follow_stream``), not replayed at the end.
- **local** (``local.py``; the default otherwise: notebooks, tests): the pair is loaded
  once in this process (``specdec_llm.loaded``, the cache the workers use too) and its
  ``BatchServer`` runs the request built by the client's own ``build_request`` (chat
  messages through the same chat template). No Celery is imported. Results are recorded in
  the store too (``record=True``), so both modes show up in reports.

``ChatSpecDec.bind_tools`` and ``with_structured_output`` (``tools.py``): tools rendered by the
pair's chat template (they, the tool turns and a prefill travel with the row), calls read back
from the generated text on this side, streamed from the text accumulated so far.

Greedy results are identical in both modes (same engine, same request). Every call's rows
belong to the store job named ``job_name`` for its pair (a stable id), carrying
``job_metadata`` and ``category``, so ``specdec-llm report --group-by job`` shows
LangChain traffic per job.

Per prompt, ``generation_info`` holds finish_reason, prompt/output tokens, acceptance
rate, mean accepted length, tokens/s, time to first token, wall time, the speedup over
target-only decoding with its counterfactual seconds (``baseline_s``) and basis
(``speedup_basis``: each output token at the target-only step cost the decoding process
measured at the same batch size), request and job ids; ``llm_output`` holds
``token_usage`` and ``model_name``. Streamed chunks carry text only; the last chunk (empty
text) carries all of those fields, so LangChain's chunk addition (which sums integers and
refuses to merge differing floats) gives the totals.

Errors are raised, never waited out, and all are ``SpecDecError``: ``RequestError`` (a
``ValueError``: bad parameters, unknown pair), ``GenerationTimeout`` (a ``TimeoutError``:
``timeout`` seconds for the whole call; its rows are cancelled, running ones at their next
step, as a stream's row is when its consumer stops reading), ``BrokerUnavailable``
(a ``ConnectionError``; the rows are marked failed) and ``GenerationFailed`` (a
``RuntimeError``: the worker failed the row, e.g. a prompt longer than the context).
"""

from specdec_llm.engine import RequestError
from specdec_llm.errors import SpecDecError

from .backend import BrokerUnavailable, GenerationFailed, GenerationTimeout, job_id
from .chat_models import ChatSpecDec, to_turns
from .llms import SpecDecLLM

__all__ = [
    "BrokerUnavailable",
    "ChatSpecDec",
    "GenerationFailed",
    "GenerationTimeout",
    "RequestError",
    "SpecDecError",
    "SpecDecLLM",
    "job_id",
    "to_turns",
]
