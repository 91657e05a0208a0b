"""Batched speculative decoding: every row keeps the single-request guarantees."""

from __future__ import annotations

import itertools

import pytest
from conftest import check_caches, exact_two_token_distribution, greedy_reference, perturbed, tiny_llama
from helpers import N, V, assert_target_distribution, sampled_requests, sharpen

from specdec_llm.engine import GenerationRequest, RequestError, SpeculativeDecoder, schedule
from specdec_llm.engine.costs import ENOUGH_S, BatchCosts, CostModel, calibrate
from specdec_llm.engine.decoder import Batch
from specdec_llm.engine.plan import Plan, best_k

PROMPTS = [[5], [5, 6, 7], [17, 3, 99, 4, 8, 120, 33, 1, 2, 250, 7, 7], list(range(40, 71)), [200, 201]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


@pytest.mark.parametrize("draft_kind", ["same", "partial", "unrelated"])
def test_batched_greedy_equals_one_at_a_time(target, draft_kind):
    """Mixed prompt lengths, mixed k, rows finishing early (length and EOS): each row equals
    the target's own greedy output, exactly as when it decodes alone."""
    draft = {"same": target, "partial": perturbed(target, 0.2, seed=3), "unrelated": tiny_llama(7, layers=1)}[
        draft_kind
    ]
    eos_model = tiny_llama(0, eos=greedy_reference(target, PROMPTS[1], 30)[9])  # same weights, an EOS the output hits
    for model in (target, eos_model):
        dec = SpeculativeDecoder(model, draft if model is target else model)
        reqs = [
            GenerationRequest(prompt=p, max_new_tokens=n, k=k)
            for p, n, k in zip(
                itertools.cycle(PROMPTS), (40, 7, 33, 1, 25, 40, 12, 30), (0, 1, 3, 6, "auto", 4, 2, "auto")
            )
        ]
        single = [dec.generate(r) for r in reqs]
        for max_batch in (3, 8):
            batched = dec.generate_many(reqs, max_batch=max_batch)
            for req, one, many in zip(reqs, single, batched):
                assert many.token_ids == one.token_ids, (draft_kind, req.prompt, req.k, max_batch)
                assert many.finish_reason == one.finish_reason
                if model is target:
                    assert many.token_ids == greedy_reference(target, req.prompt, req.max_new_tokens)
        assert {r.finish_reason for r in single} == ({"length"} if model is target else {"length", "eos"})


def test_rows_join_between_iterations(target):
    """Continuous batching: rows added while others run, caches checked after every step."""
    dec = SpeculativeDecoder(target, perturbed(target, 0.2, seed=3))
    batch = Batch(dec)
    rows = [batch.add(GenerationRequest(prompt=PROMPTS[i], max_new_tokens=20, k=k)) for i, k in ((1, 3), (3, "auto"))]
    for step in range(30):
        if step in (2, 5):
            rows.append(batch.add(GenerationRequest(prompt=PROMPTS[step % 5], max_new_tokens=15, k=2)))
        if step == 5:
            rows.append(
                batch.add(GenerationRequest(prompt=PROMPTS[0], max_new_tokens=10, temperature=0.8, seed=4, k=3))
            )
        if not batch.rows:
            break
        batch.step()
        check_caches(batch)
    assert not batch.rows and batch.tcache.width == 0 and batch.tcache.rows == 0
    for row in rows[:4]:
        assert row.result.token_ids == greedy_reference(target, row.prompt, row.req.max_new_tokens)
    assert len(rows[4].result.token_ids) == 10


def test_sampled_rows_keep_the_target_distribution():
    """Seeded sampled rows decoded in batches (beside greedy rows): the first two tokens'
    empirical distribution matches the exact target one (same bound as test_engine)."""
    prompt = [1, 2, 3]
    target = tiny_llama(11, vocab=V, hidden=32)
    draft = tiny_llama(12, vocab=V, hidden=32, layers=1)
    sharpen(target, draft)
    exact = exact_two_token_distribution(target, prompt, 1.0, 0, 1.0)
    dec = SpeculativeDecoder(target, draft)
    greedy = GenerationRequest(prompt=[4, 5], max_new_tokens=2, k=2)
    reqs = []
    for i, req in enumerate(sampled_requests(prompt)):
        reqs.append(req)
        if i % 16 == 0:
            reqs.append(greedy)
    out = dec.generate_many(reqs, max_batch=16)
    ref = greedy_reference(target, [4, 5], 2)
    assert all(res.token_ids == ref for req, res in zip(reqs, out) if req is greedy)
    assert_target_distribution([res for req, res in zip(reqs, out) if req is not greedy], exact)
    assert sum(r.stats.draft_tokens_accepted for r in out) > N * 0.1


def test_per_request_stats_and_bad_rows(target):
    dec = SpeculativeDecoder(target, perturbed(target, 0.2, seed=3))
    reqs = [GenerationRequest(prompt=[1, 2, 3, 4], max_new_tokens=30, k=k) for k in (0, 3, "auto", 5)]
    reqs.insert(2, GenerationRequest(prompt=[1, 999], max_new_tokens=5))  # outside the vocabulary
    reqs.insert(3, GenerationRequest(prompt=[1, 2], max_new_tokens=0))
    out = dec.generate_many(reqs, max_batch=8)
    assert isinstance(out[2], RequestError) and out[2].field == "prompt"
    assert isinstance(out[3], RequestError) and out[3].field == "max_new_tokens"
    for res in (out[0], out[1], out[4], out[5]):
        s = res.stats
        assert s.output_tokens == 30 == s.draft_tokens_accepted + s.target_forwards
        assert s.target_forwards == len(s.k_values)
        assert s.draft_tokens_proposed == sum(s.k_values)
        assert 0 < s.draft_time_s + s.target_time_s <= s.wall_time_s
    assert out[0].stats.draft_tokens_proposed == 0 and out[0].stats.draft_time_s == 0
    assert out[5].stats.k_values[:3] == [5, 5, 5] and max(out[5].stats.k_values) == 5  # clipped only by the room left


def scripted(ks):
    """A plan whose auto rows all draft with the model at the next k of ``ks`` (instead of
    from timings: to reach every catch-up case)."""
    script = iter(ks)

    def plan(cost, options, *args, **kw):
        k = next(script, 1)
        return Plan(0.0, [("model", min(k, o.limit)) if k else (None, 0) for o in options])

    return plan


def test_auto_rows_fill_the_draft_lazily_and_catch_up(target, monkeypatch):
    """An auto row gets no draft prefill while k = 0; when drafting starts, a row far behind
    is refilled alone (fill_row) and a row slightly behind is fed its missed tokens in the
    batch. Caches stay exact after every step and outputs equal the target's greedy ones."""
    dec = SpeculativeDecoder(target, perturbed(target, 0.2, seed=3))
    batch = Batch(dec)
    monkeypatch.setattr(schedule, "plan", scripted([0, 0, 0, 3] + [0] * 14 + [4, 0, 1, 2]))
    dcache = batch.sessions["model"].session.backend.cache
    fills = []  # (row, valid columns it had): a row never drafted has none
    real_fill = dcache.fill_row
    monkeypatch.setattr(
        dcache, "fill_row", lambda b, own: (fills.append((b, int(dcache.valid[b].sum()))), real_fill(b, own))
    )
    rows = [batch.add(GenerationRequest(prompt=PROMPTS[i], max_new_tokens=40)) for i in (4, 1)]
    assert not dcache.valid.any()  # auto rows: no draft prefill yet
    for step in range(80):
        if step == 1:  # fixed-k rows draft every step: the auto rows fall behind them
            rows += [batch.add(GenerationRequest(prompt=PROMPTS[i], max_new_tokens=60, k=2)) for i in (2, 3, 0)]
        if not batch.rows:
            break
        batch.step()
        check_caches(batch)
    assert not batch.rows
    # first drafting, auto and fixed-k rows alike (no row's draft is prefilled at join): refilled alone
    assert sorted(b for b, had in fills if not had) == [0, 1, 2, 3]
    assert any(had for _, had in fills)  # far behind later: refilled alone again
    for row in rows:
        assert row.result.token_ids == greedy_reference(target, row.prompt, row.req.max_new_tokens)


def test_speculation_length_falls_to_zero_as_the_batch_grows():
    """CPU-like costs: at one row verifying 5 tokens costs ~1.1x one token, so a 0.6-acceptance
    draft pays; at 16 rows the forward is mostly compute (cost ~ tokens) and k = 0 wins
    unless the draft is very good."""
    costs = BatchCosts(max_k=8)
    per_token = 0.0006
    for rows in (1, 16):
        fixed = 0.03 if rows == 1 else 0.008
        calibrate(
            costs[rows],
            lambda k, r=rows, f=fixed: f + per_token * r * (k + 1) + 0.002,
            lambda r=rows: 0.002 + 0.0001 * r,
            repeats=1,
        )
    assert best_k(costs[1], 0.6) >= 2
    assert best_k(costs[16], [0.6] * 16) == 0
    assert best_k(costs[16], [0.98] * 16) >= 4  # a near-perfect draft still pays
    assert costs[9] is costs[16] and costs[3] is costs[4]


@pytest.mark.parametrize(("seconds", "repeats"), [(0.001, 3), (0.6 * ENOUGH_S, 2), (ENOUGH_S, 1)])
def test_a_calibration_times_a_long_forward_fewer_times(seconds, repeats):
    """Each point is the least of 3 timings, or of fewer once they add up to ENOUGH_S: a 1.5B
    model's forwards (0.25-3 s on 2 cores) are not each timed three times over."""
    timed: list[int] = []
    cost = CostModel(max_k=2)
    calibrate(cost, lambda k: timed.append(k) or seconds, points=[0, 1, 2], repeats=3)
    assert timed == [k for _ in range(repeats) for k in (0, 1, 2)]  # in rounds
    assert cost.verify(2) == seconds


def test_a_burst_of_load_during_calibration_slows_no_point_alone():
    """The repeats run in rounds over every point, so a burst of other load that slows three
    timings in a row cannot leave one point (here the plain forward, timed first) 10x its cost
    beside the others: the ratios the speedup figure and the plan rest on stay the machine's."""
    calls: list[int] = []

    def time_verify(k: int) -> float:
        calls.append(k)
        return (0.01 + 0.001 * k) * (10 if len(calls) <= 3 else 1)

    cost = CostModel(max_k=2)
    calibrate(cost, time_verify, lambda: 0.001 * (10 if len(calls) <= 3 else 1), points=[0, 1, 2], repeats=3)
    assert [cost.verify(k) for k in (0, 1, 2)] == pytest.approx([0.01, 0.011, 0.012])
    assert cost.draft_per_token("model") == pytest.approx(0.001)


@pytest.mark.quiet  # (the plan's costs are measured: under make test's load a probe's noise drafted 6 times)
def test_auto_k_batched_with_a_useless_draft_stays_target_only(target):
    dec = SpeculativeDecoder(target, tiny_llama(7, layers=1))
    reqs = [GenerationRequest(prompt=p, max_new_tokens=60) for p in PROMPTS * 2]
    dec.generate_many(reqs[:4], max_batch=4)  # learns a ~ 0
    out = dec.generate_many(reqs, max_batch=8)
    for req, res in zip(reqs, out):
        assert res.token_ids == greedy_reference(target, req.prompt, 60)
        assert sum(k > 0 for k in res.stats.k_values[10:]) <= 2, res.stats.k_values  # probes only


def test_batch_server_joins_callers_from_threads(target):
    """Requests from many threads share batches; each gets its own result or error."""
    from concurrent.futures import ThreadPoolExecutor

    from specdec_llm.engine.serve import BatchServer

    dec = SpeculativeDecoder(target, perturbed(target, 0.2, seed=3))
    server = BatchServer(dec, max_batch=4, max_wait_ms=50)
    reqs = [
        GenerationRequest(prompt=PROMPTS[i % 5], max_new_tokens=10 + 3 * i, k=(0, 2, "auto")[i % 3]) for i in range(10)
    ]
    reqs[6] = GenerationRequest(prompt=[1, 9999], max_new_tokens=5)
    seen = []
    try:
        with ThreadPoolExecutor(10) as pool:
            futures = list(pool.map(lambda r: server.submit(r, on_text=None), reqs))
            results = []
            for f in futures:
                try:
                    results.append(f.result(timeout=60))
                except RequestError as e:
                    results.append(e)
        late = server.submit(GenerationRequest(prompt=[3, 4], max_new_tokens=500, k=0), deadline=0.0)
        with pytest.raises(TimeoutError):
            late.result(timeout=60)
        seen = [r.stats.batch_rows for r in results if not isinstance(r, RequestError)]
    finally:
        server.close(timeout=10)
    assert isinstance(results[6], RequestError) and results[6].field == "prompt"
    for i, (req, res) in enumerate(zip(reqs, results)):
        if i != 6:
            assert res.token_ids == greedy_reference(target, req.prompt, req.max_new_tokens)
    assert len(seen) == 9 and max(seen) > 2  # callers really shared batches
    assert not server.thread.is_alive()


def test_a_bulk_job_batch_size_is_the_one_with_the_most_tokens_per_second():
    """plan.best_batch: from the measured cost of each batch-size bucket, the size whose rows
    decode the most tokens per second (drafting where it pays at that size), the smallest within
    5% of the best; a draft that pays alone does not make batch 1 win over cheap batching."""
    from specdec_llm.engine.plan import best_batch

    def cost(v0: float, per_k: float, draft: float) -> CostModel:
        return CostModel(max_k=4, verify_s={k: v0 + per_k * k for k in range(5)}, draft_s={"model": draft})

    # plain: 100, 182, 333, 267 tok/s; drafting at 0.9 acceptance is worth ~1.6x at batch 1 only
    costs = {1: cost(0.010, 0.0005, 0.002), 2: cost(0.011, 0.004, 0.004), 4: cost(0.012, 0.01, 0.008)}
    costs[8] = cost(0.030, 0.03, 0.02)
    assert best_batch(costs, {"model": 0.9}) == 4
    assert best_batch({1: costs[1]}, {"model": 0.9}) == 1
    # nearly flat beyond 2 rows: the smaller size (lower latency and memory for the same speed)
    flat = {1: cost(0.010, 0.01, 1.0), 2: cost(0.0100, 0.01, 1.0), 4: cost(0.0199, 0.01, 1.0)}
    assert best_batch(flat, {}) == 2


def test_an_auto_batch_server_chooses_its_size_before_serving(target):
    """BatchServer(max_batch="auto") measures (or reads) the buckets' costs and takes the best
    size before the first request; its rows decode exactly as one at a time."""
    from specdec_llm.engine.serve import BatchServer
    from specdec_llm.engine.types import AUTO_CAP

    dec = SpeculativeDecoder(target, perturbed(target, 0.05, seed=1))
    server = BatchServer(dec, max_batch="auto")
    try:
        assert server.ready.wait(120)
        assert 1 <= server.max_batch <= AUTO_CAP
        assert set(dec.costs.models) >= {1, 2, 4, 8, 16, 32}  # every bucket was measured
        reqs = [GenerationRequest(prompt=[1, 2, i], max_new_tokens=12) for i in range(6)]
        futures = [server.submit(r) for r in reqs]
        got = [f.result(120).token_ids for f in futures]
    finally:
        server.close(30)
    assert got == [dec.generate(r).token_ids for r in reqs]
    with pytest.raises(ValueError, match="max_batch: 'big' is not a batch size; use an integer >= 1, 'auto'"):
        BatchServer(dec, max_batch="big")


def test_an_auto_batch_server_with_a_cap_measures_no_wider_batch(target):
    """max_batch="auto:3" (a job of 3 rows): the size is chosen among 1-3 rows, and no bucket
    above the one 3 rows fall in is measured."""
    from specdec_llm.engine.serve import BatchServer

    dec = SpeculativeDecoder(target, perturbed(target, 0.05, seed=1))
    server = BatchServer(dec, max_batch="auto:3")
    try:
        assert server.ready.wait(120)
        assert 1 <= server.max_batch <= 3
        assert set(dec.costs.models) == {1, 2, 4}
    finally:
        server.close(30)


def test_a_callers_failing_callback_fails_its_row_alone_and_a_closed_server_answers_every_request(target):
    """A caller's on_text that raises (while streaming, or on a stopped row's last flush) fails
    that row with its error; the other rows and the server go on. Closing the server fails the
    requests still waiting; an empty step and a batch size below 1 are clear."""
    from conftest import tiny_tokenizer

    from specdec_llm.engine.serve import BatchServer

    def broken(text: str) -> None:
        raise ValueError("the caller's callback broke")

    dec = SpeculativeDecoder(target, perturbed(target, 0.2, seed=3), tiny_tokenizer())
    server, steps = BatchServer(dec, max_batch=4, max_wait_ms=200), itertools.count()
    try:
        good = [server.submit(GenerationRequest(prompt=PROMPTS[i], max_new_tokens=20, k=2)) for i in range(3)]
        bad = server.submit(GenerationRequest(prompt=PROMPTS[3], max_new_tokens=20, k=2), on_text=broken)
        stopped = server.submit(
            GenerationRequest(prompt=PROMPTS[4], max_new_tokens=400, k=0, stop=["never-" * 10]),  # (its text held back)
            on_text=broken,
            stop=lambda: next(steps) > 3,  # stops after some steps: its last flush raises
        )
        for f, req in zip(good, range(3)):
            assert f.result(timeout=60).token_ids == greedy_reference(target, PROMPTS[req], 20)
        for f in (bad, stopped):
            with pytest.raises(ValueError, match="callback broke"):
                f.result(timeout=60)
        assert server.submit(GenerationRequest(prompt=PROMPTS[0], max_new_tokens=5)).result(timeout=60).token_ids
    finally:
        server.close(timeout=10)
    assert not server.thread.is_alive()
    with pytest.raises(ValueError, match="callback broke"):  # one request alone: the caller gets its error
        dec.generate(GenerationRequest(prompt=PROMPTS[0], max_new_tokens=20, k=2), on_text=broken)
    one = BatchServer(dec, max_batch=1, max_wait_ms=0)
    waiting = [one.submit(GenerationRequest(prompt=PROMPTS[i], max_new_tokens=300, k=0)) for i in range(4)]
    one.close(timeout=30)
    for f in waiting:
        assert f.done() and (f.exception() is None or "closed" in str(f.exception()))
    assert Batch(dec).step() == []
    with pytest.raises(ValueError, match="max_batch"):
        dec.generate_many([GenerationRequest(prompt=[1, 2], max_new_tokens=3)], max_batch=0)
