"""The root of every error specdec-llm raises on purpose.

``except SpecDecError`` catches them all: bad input (``engine.RequestError``), an unknown
or broken pair (``pairs.PairError``), the store (``store.StoreError``), a job file
(``client.rows.InputError``), the broker (``client.QueueError``) and the LangChain calls
(``GenerationTimeout``, ``BrokerUnavailable``, ``GenerationFailed``). Each also keeps its
built-in base (``ValueError``, ``RuntimeError``, ``TimeoutError``...), so existing
``except`` clauses still work. Its message is one line that says what to do.

This module imports nothing: every layer, the engine included, may derive from it.
"""


class SpecDecError(Exception):
    """Something specdec-llm refused or could not do; ``str(e)`` says why and what to do."""
