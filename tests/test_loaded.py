"""The process's cache of loaded pairs (``specdec_llm/loaded.py``)."""

from __future__ import annotations

import threading

from specdec_llm import loaded
from specdec_llm.engine import GenerationRequest
from specdec_llm.engine.drafting import register_drafter, unregister_drafter
from specdec_llm.engine.drafting.lookup import Lookup
from specdec_llm.pairs import PairSpec


def test_a_pair_loads_on_a_thread_that_ends_and_its_server_decodes_on_its_own(tiny_pair_dir):
    """``get`` loads a pair (``load_pair``, ``decoder()``) on a thread of its own, joined: the
    caller's thread (a worker's main thread) holds no OpenMP pool beside the server thread's,
    with which the server's forwards ran 25-50% slower on 2 vCPUs."""
    seen: list[threading.Thread] = []

    def build(context):  # (a drafter is built inside decoder(): on the loading thread)
        seen.append(threading.current_thread())
        drafter = Lookup()
        drafter.name = "where"
        return drafter

    register_drafter("where", build)
    try:
        entry = loaded.get(PairSpec(name="where", target=str(tiny_pair_dir / "target"), drafters=["lookup", "where"]))
        result = entry.server.submit(GenerationRequest([1, 2, 3], max_new_tokens=4)).result(60)
        entry.server.close(30)
    finally:
        unregister_drafter("where")
    assert len(result.token_ids) == 4
    [loader] = seen
    assert loader is not threading.current_thread() and loader is not entry.server.thread
    assert not loader.is_alive()
