"""The loop's pieces alone: acceptance, costs, plan, schedule, accounting, row, cost cache."""

from __future__ import annotations

import pytest

from specdec_llm.engine import costcache, jsoncache
from specdec_llm.engine.accounting import Ledger
from specdec_llm.engine.costs import CostModel, interpolate
from specdec_llm.engine.drafting.acceptance import CAP, Acceptance
from specdec_llm.engine.plan import MARGIN, RowOptions, plan
from specdec_llm.engine.row import Row
from specdec_llm.engine.schedule import PLAIN_FIRST, PLAIN_RUN, PlainIterations
from specdec_llm.engine.text import TextStream
from specdec_llm.engine.types import GenerationRequest, GenerationResult, Stats


def test_acceptance_is_accepted_over_examined_behind_its_prior():
    a = Acceptance(prior=0.5, weight=4.0)
    assert a.rate() == 0.5
    a.update([None] * 4, 2)  # 2 accepted, the third rejected: 3 examined
    assert a.rate() == pytest.approx((2 + 2) / (3 + 4))
    a.update([None] * 3, 3)  # all accepted: nothing rejected, 3 examined
    assert a.rate() == pytest.approx((5 + 2) / (6 + 4))
    for _ in range(5000):
        a.update([None], 1)
    assert a.rate() == CAP  # (5007 / 5010 uncapped)
    buckets = Acceptance(0.3)
    buckets.update(["x", "y"], 0)  # x rejected; y never examined
    assert buckets.rate("x") < 0.3 and buckets.rate("y") == 0.3


def test_costs_interpolate_and_a_wider_verification_never_costs_less():
    assert interpolate({1: 1.0, 3: 3.0}, 2) == 2.0
    assert interpolate({1: 1.0, 3: 3.0}, 5) == 5.0  # the last slope extended
    cost = CostModel(max_k=4, verify_s={0: 1.0, 1: 1.2, 2: 1.1, 4: 2.0})
    assert [cost.verify(k) for k in range(5)] == sorted(cost.verify(k) for k in range(5))
    cost.observe_verify(0, 2.0)  # the machine got twice as slow: every width moves
    assert cost.verify(4) == pytest.approx(4.0)


def test_the_plan_drafts_only_past_its_margin():
    cost = CostModel(max_k=4, draft_s={"model": 0.01}, verify_s=dict.fromkeys(range(5), 0.1))
    assert plan(cost, [RowOptions(models={"model": 0.9})]).choices[0][0] == "model"
    # a draft whose gain is just under the margin: not worth the model's small errors
    a = 0.005 * MARGIN
    assert plan(cost, [RowOptions(models={"model": a})]).choices == [(None, 0)]


def test_plain_iterations_come_first_after_plain_first_then_run_in_pairs():
    plain, cost = PlainIterations(), CostModel(max_k=4)
    drafting = [("model", 3)]
    seen = [plain.apply(cost, 1, drafting, may_force=True) for _ in range(PLAIN_FIRST + 1 + PLAIN_RUN)]
    assert seen[:PLAIN_FIRST] == [drafting] * PLAIN_FIRST
    assert seen[PLAIN_FIRST : PLAIN_FIRST + PLAIN_RUN] == [[(None, 0)]] * PLAIN_RUN
    assert plain.apply(cost, 1, drafting, may_force=False) == drafting  # a fixed-k row or a probe: never forced


def test_the_ledger_charges_the_counterfactual_and_derives_the_stats():
    ledger, st = Ledger(), Stats(prompt_tokens=3)
    ledger.iteration(st, "model", 3, 2, 1)
    ledger.emitted = 3
    ledger.charge(0.5, 3, 0.4)  # 3 tokens in 0.5 s; target-only each would cost 0.4 s
    ledger.close(st, wall=1.0, output_tokens=3, stopped=False)
    assert st.baseline_s == pytest.approx(1.0 - 0.5 + 1.2)
    assert st.acceptance_rate == pytest.approx(2 / 3) and st.per_position_acceptance == [1.0, 1.0, 0.0]
    assert st.drafter == "model" and st.mean_accepted_length == 3.0


def test_a_row_ends_at_eos_length_or_its_context_and_its_view_follows_its_tokens():
    def row(**kw):
        req = GenerationRequest(prompt=[1, 2], **kw)
        return Row(req, [1, 2], ["lookup"], None, TextStream(None, [], None), {9}, 8)

    r = row(max_new_tokens=10)
    view = r.view("lookup")  # (a drafter's view, made before the row grows, follows it)
    r.advance([3, 9, 4])  # cut after the end-of-sequence token
    assert r.out == [3, 9] and r.finish_reason == "eos" and view.tokens == [1, 2, 3, 9]
    assert r.view("lookup") is view and r.view("suffix") is not view and Row.of(view) is r
    r = row(max_new_tokens=2)
    r.advance([3, 4])
    assert r.finish_reason == "length" and r.room() == 0
    r = row(max_new_tokens=10)
    r.advance([3, 4, 5, 6, 7, 8])
    assert r.finish_reason == "context"


def test_the_cost_cache_merges_entries_and_survives_damage(tmp_path):
    path = tmp_path / costcache.FILE
    costcache.save(path, {"a": {"verify_s": {"0": 1.0}}})
    costcache.save(path, {"b": {"verify_s": {"0": 2.0}}})  # another process's entry is kept
    data = jsoncache.load(path)
    assert set(data) == {"a", "b"} and data["a"]["verify_s"] == {"0": 1.0} and "updated_at" in data["b"]
    path.write_text("{not json")
    assert jsoncache.load(path) == {}
    cost = CostModel(max_k=2)
    cost.load({"verify_s": {"0": 1.0, "1": 1.5, "5": 9.0}})  # widths past max_k are dropped
    assert cost.calibrated and cost.verify_s == {0: 1.0, 1: 1.5}


def test_an_incomplete_constrained_output_says_what_would_complete_it():
    def why(reason: str) -> str:
        return GenerationResult("{", [1, 2, 3], reason, Stats(), complete=False).incomplete() or ""

    assert why("length").endswith("raise max_new_tokens")
    assert "filled the pair's context" in why("context") and "max_new_tokens" not in why("context")
