"""Helpers test modules share (plain functions; the shared fixtures are in conftest.py, the
worker fleets in fleet.py, the model families in families.py). A test module imports helpers
from these modules only, never from another test module.

The distribution tests (test_engine, test_batch, test_drafters, test_families,
test_quantized): ``N`` seeded samples of the first two tokens over a vocabulary of ``V``,
against the exact target distribution (conftest's ``exact_two_token_distribution``). With
V = 8 there are 64 outcomes; the expected total variation of an empirical distribution of N
samples is at most sum_x sqrt(p_x / (2 pi N)) <= 8 / sqrt(2 pi N) ~ 0.032 for N = 10,000, and
far less on the sharpened models these tests sample (0.003-0.016 measured on five of them,
2026-12-07), so ``TV_BOUND`` = 0.035 leaves noise room while a sampler that drifts toward a
draft at least 0.2 away (``assert_distinct``) fails it. (N was 20,000: twice the suite's
slowest tests' time for noise these bounds never came near.)
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from specdec_llm.engine import GenerationRequest

V, N = 8, 10_000  # the sampled models' vocabulary; seeded samples per distribution test
TV_BOUND = 0.035


# -- the N-sample distribution tests ---------------------------------------------------------
def sharpen(*models, factor: float = 40.0) -> None:
    """Scale each model's output embeddings so its random next-token distribution is sharp
    (distinct models give distinct distributions)."""
    with torch.no_grad():
        for model in models:
            model.get_output_embeddings().weight.mul_(factor)


def sampled_requests(prompt: list[int], n: int = N, **sampling) -> list[GenerationRequest]:
    """``n`` seeded requests (seed i) for the first two tokens after ``prompt``, k alternating
    1 and 2; ``sampling``: temperature (default 1.0), top_k, top_p."""
    sampling = {"temperature": 1.0, **sampling}
    return [GenerationRequest(prompt=prompt, max_new_tokens=2, k=1 + i % 2, seed=i, **sampling) for i in range(n)]


def two_token_tv(results, exact: torch.Tensor) -> float:
    """Total variation between the results' empirical distribution of (first, second) token
    and ``exact`` (a V x V tensor)."""
    counts = torch.zeros_like(exact)
    for res in results:
        counts[res.token_ids[0], res.token_ids[1]] += 1
    return float(0.5 * (counts / len(results) - exact).abs().sum())


def assert_target_distribution(results, exact: torch.Tensor, bound: float = TV_BOUND) -> None:
    """The results' first two tokens follow ``exact`` within ``bound`` (total variation)."""
    tv = two_token_tv(results, exact)
    assert tv < bound, f"TV {tv:.4f} over {len(results)} samples"


def assert_distinct(exact: torch.Tensor, drafty: torch.Tensor, gap: float = 0.2) -> None:
    """The draft's distribution is far enough from the target's for the test to have power."""
    assert 0.5 * (exact - drafty).abs().sum() > gap, "draft too close to target for the test to have power"


# -- services, files, waiting ---------------------------------------------------------------------
def unavailable(why: str):
    """Skip the test for a missing service (fail it on CI, where every service is required)."""
    if os.environ.get("CI"):
        pytest.fail(f"{why} (required on CI)")
    pytest.skip(why)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(poll)


def jsonl(path: Path, *objects) -> Path:
    """Write ``objects`` (dicts, or lines as they are) as a JSONL file."""
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objects))
    return path


_job_cli = None


def invoke(*args: str):
    """The job commands (``client.cli`` and the workers' ``worker``) on a Typer app of their
    own, run with ``CliRunner``."""
    global _job_cli
    import typer
    from typer.testing import CliRunner

    from specdec_llm.client.cli import register
    from workers.cli import register as register_worker

    if _job_cli is None:
        _job_cli = typer.Typer()
        register(_job_cli)
        register_worker(_job_cli)  # the real CLI finds it by its entry point
    return CliRunner().invoke(_job_cli, [str(a) for a in args])
