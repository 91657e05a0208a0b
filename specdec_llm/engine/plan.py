"""Who drafts how much, from measured costs (costs.py) and estimated acceptance.

Expected tokens per iteration with per-token acceptance a and k drafts is
E(a, k) = (1 - a^(k+1)) / (1 - a); an iteration costs k * draft_step + verify(k).
``plan`` picks, per row and iteration, the drafter and k in 0..max_k with the most expected
tokens per second for the whole batch. k = 0 is plain target-only decoding, so useless
drafters drive k to 0; after a run of k = 0 iterations a probe drafts once to refresh the
acceptance estimates (``Probes``: about 1% of the time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .costs import CostModel
from .drafting.base import Proposal
from .types import expected_tokens_per_iteration

Choice = tuple[str | None, int]  # (drafter, k) of one row; (None, 0) is a plain step

# k > 0 only when it promises at least 10% more tokens/s than k = 0: the cost model is
# calibrated without the masks and per-row work of a real batch, and its small errors must
# not make a marginal k a loss
MARGIN = 1.1
# a bulk job's batch size is the smallest within 5% of the fastest: lower latency and
# memory for nearly the same throughput (the speeds themselves are estimates of that order)
BATCH_WITHIN = 0.95
# a probe after 32 iterations without drafting (~3% of a k = 0 run's forwards), doubling while
# probes confirm k = 0, up to every 1024 (~0.1%): estimates stay fresh at a negligible cost
PROBE_EVERY, PROBE_MAX_EVERY = 32, 1024


@dataclass
class RowOptions:
    """What one auto row can verify this iteration: the free drafters' proposals (made
    already, at most max_k tokens) and, per model drafter, its per-token acceptance estimate."""

    free: list[Proposal] = field(default_factory=list)
    models: dict[str, float] = field(default_factory=dict)
    limit: int = 1 << 30  # the most tokens the row may draft (its room left)


@dataclass
class Plan:
    """The expected tokens per second of the batch, and each auto row's choice."""

    rate: float
    choices: list[Choice]


def _evaluate(
    cost: CostModel,
    rows: list[RowOptions],
    k_max: int,
    model: str | None,
    fixed: tuple[int, int, dict[str, int]],
    probe_row: int | None,
) -> Plan:
    """The batch's expected tokens per second when each row takes its best proposal of at
    most ``k_max`` tokens from the free drafters or from ``model``."""
    fixed_rows, width, steps = fixed[0], fixed[1], dict(fixed[2])
    tokens, choices = float(fixed_rows), list[Choice]()
    for b, r in enumerate(rows):
        best: tuple[float, str | None, int] = (1.0, None, 0)
        for p in r.free:
            k = min(k_max, len(p.tokens))
            if k and (e := p.expected(k)) > best[0]:
                best = (e, p.drafter, k)
        if model in r.models and k_max and probe_row in (None, b):
            k = min(k_max, r.limit)
            if (e := expected_tokens_per_iteration(r.models[model], k)) > best[0]:
                best = (e, model, k)
        tokens += best[0]
        choices.append(best[1:])
        width = max(width, best[2])
        if best[1] == model and model is not None:
            steps[model] = max(steps.get(model, 0), best[2])
    # not drafting costs the plain forward as measured (per batch-size bucket); drafting
    # never costs less than that
    base = cost.plain_forward()
    seconds = (max(base, cost.verify(width)) if width else base) + sum(
        s * cost.draft_per_token(m) for m, s in steps.items() if s
    )
    return Plan(tokens / seconds, choices)


def plan(
    cost: CostModel,
    rows: list[RowOptions],
    fixed_rows: int = 0,
    fixed_width: int = 0,
    fixed_steps: dict[str, int] | None = None,
    probe_row: int | None = None,
) -> Plan:
    """Each auto row's (drafter, k): the choice with the most expected tokens per second.

    One target forward verifies every row at the width of the longest proposal, so a row
    may propose up to that width at no extra cost; a model drafter costs its k steps once
    for all the rows that use it. Rows with a fixed k (``fixed_rows``) widen the verification
    to ``fixed_width`` and run ``fixed_steps`` model steps whatever is chosen here. The best
    plan that drafts must promise ``MARGIN`` times the tokens per second of not drafting;
    a probe (``probe_row`` given: only that row may draft with a model) drafts regardless.
    """
    fixed = (fixed_rows, fixed_width, fixed_steps or {})
    models = sorted({m for r in rows for m in r.models})
    base = _evaluate(cost, rows, 0, None, fixed, probe_row)
    best = Plan(0.0, base.choices)
    for k_max in range(1, cost.max_k + 1):
        for model in (None, *models):
            if (p := _evaluate(cost, rows, k_max, model, fixed, probe_row)).rate > best.rate:
                best = p
    if probe_row is None and best.rate < MARGIN * base.rate:
        return base
    return best


def best_k(cost: CostModel, acceptance: float | list[float], drafter: str = "model") -> int:
    """The k with the most expected tokens per second when every row drafts with the model
    ``drafter`` at per-token ``acceptance`` (one value, or one per row of a batch)."""
    rates = [acceptance] if isinstance(acceptance, (int, float)) else list(acceptance)
    return max(k for _, k in plan(cost, [RowOptions(models={drafter: a}) for a in rates]).choices)


def best_batch(costs: dict[int, CostModel], rates: dict[str, float]) -> int:
    """The batch size (a bucket of ``costs``) with the most expected tokens per second for a
    bulk job, each row drafting as ``plan`` would at the model drafters' acceptance ``rates``
    (or not at all, where drafting does not pay at that size): the smallest within
    ``BATCH_WITHIN`` of the best."""
    speed = {b: plan(c, [RowOptions(models=dict(rates)) for _ in range(b)]).rate for b, c in costs.items()}
    top = max(speed.values())
    return min(b for b, v in speed.items() if v >= BATCH_WITHIN * top)


class Probes:
    """When auto rows have not drafted for ``every`` iterations, the next iteration is a probe
    (it drafts regardless of the margin: see ``plan``), so acceptance estimates stay fresh;
    the interval doubles (up to ``max_every``) while probes keep confirming k = 0."""

    def __init__(self, every: int = PROBE_EVERY, max_every: int = PROBE_MAX_EVERY):
        self.first, self.max_every = every, max_every
        self.every = every
        self.zero_run = 0

    @property
    def due(self) -> bool:
        return self.zero_run >= self.every

    def record(self, drafted: bool, probed: bool) -> None:
        if probed:
            self.zero_run = 0
            self.every = min(2 * self.every, self.max_every)
        elif drafted:
            self.zero_run = 0
            self.every = self.first
        else:
            self.zero_run += 1
