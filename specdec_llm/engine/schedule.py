"""Who drafts how much in an iteration: each row's (drafter, k).

The free drafters (no forward) propose first, for every row that may use them; a row with
a fixed k takes the first of its drafters that proposes anything (a model drafter always
can); rows with k = "auto" follow the batch's plan (autok.plan: measured costs, live
acceptance). Now and then the plan is overridden by plain (k = 0) iterations
(``PlainIterations``): the target-only step they measure is the basis of the reported speedup.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .autok import BatchCosts, CostModel, RowOptions, plan

if TYPE_CHECKING:
    from .decoder import Batch
    from .protocol import Proposal

Pick = tuple[str | None, int]  # (drafter, k) of one row; (None, 0) is a plain step
Offers = dict[int, dict[str, "Proposal"]]  # row -> the free drafters' proposals of this iteration

# after this many drafting iterations in a row, one plain (k = 0) iteration: the target-only
# step it measures keeps the speedup's counterfactual honest (~1% of a drafting job's tokens)
PLAIN_EVERY = 64
# the first one comes sooner: until a batch size has seen a plain iteration, its k = 0 cost
# is the calibration's shape scaled by drafting iterations, which can be off by 10-20%
PLAIN_FIRST = 8
# plain iterations in a row each time: only one that follows a plain iteration is measured. The
# first forward after drafting runs with the draft's weights in the CPU's caches instead of the
# target's (measured 8% slower on a Xeon): target-only decoding never pays that
PLAIN_RUN = 2


class PlainIterations:
    """Per batch-size bucket, across batches and requests of one decoder (a request alone
    seldom reaches PLAIN_EVERY iterations): drafting iterations in a row, and forced plain
    iterations still to run."""

    def __init__(self) -> None:
        self.drafting_runs: dict[int, int] = {}
        self.plain_left: dict[int, int] = {}

    def apply(self, cost: CostModel, rows: int, chosen: list[Pick], may_force: bool) -> list[Pick]:
        """The plan's picks, or a plain iteration when one is due (only when ``may_force``:
        no fixed-k row and no probe in the batch)."""
        drafted = any(k for _, k in chosen)
        bucket = BatchCosts.bucket(rows)
        run = self.drafting_runs[bucket] = self.drafting_runs.get(bucket, 0) + 1 if drafted else 0
        if not (drafted and may_force):
            return chosen
        if run > (PLAIN_EVERY if cost.samples.get("plain") else PLAIN_FIRST):
            self.plain_left[bucket], self.drafting_runs[bucket] = PLAIN_RUN, 0
        if self.plain_left.get(bucket, 0) > 0:
            self.plain_left[bucket] -= 1
            return [(None, 0)] * len(chosen)
        return chosen


def offers(batch: Batch) -> Offers:
    """Every free drafter's proposal for each row that may use it, as long as the row allows."""
    dec, rows = batch.dec, batch.rows
    out: Offers = {b: {} for b in range(len(rows))}
    for d in dec.drafters:
        if not d.free:
            continue
        ks = {
            b: min(r.k if r.k is not None else dec.max_k, r.room() - 1)
            for b, r in enumerate(rows)
            if d.name in r.drafters
        }
        for b, prop in batch.sessions[d.name].propose(rows, {b: k for b, k in ks.items() if k > 0}).items():
            out[b][d.name] = prop
    return out


def choose(batch: Batch, offered: Offers) -> list[Pick]:
    """Each row's (drafter, k) for this iteration."""
    picks: list[Pick] = [(None, 0)] * len(batch.rows)
    fixed_width, fixed_steps, n_fixed = fixed(batch, offered, picks)
    auto = [b for b, r in enumerate(batch.rows) if r.k is None and r.room() > 1]
    if auto:
        for b, pick in zip(auto, planned(batch, offered, auto, n_fixed, fixed_width, fixed_steps)):
            picks[b] = pick
    return picks


def fixed(batch: Batch, offered: Offers, picks: list[Pick]) -> tuple[int, dict[str, int], int]:
    """The fixed-k rows' picks (into ``picks``): the first of a row's drafters that proposes.
    Returns their widest k, each model drafter's steps and how many rows have a fixed k."""
    dec = batch.dec
    width, steps, n = 0, dict[str, int](), 0
    for b, r in enumerate(batch.rows):
        if r.k is None:
            continue
        n += 1
        k = max(0, min(r.k, r.room() - 1))
        name = next((d for d in r.drafters if d in offered[b] or not dec.drafter(d).free), None) if k else None
        if name is not None:
            k = min(k, len(offered[b][name].tokens)) if name in offered[b] else k
            picks[b] = (name, k)
            width = max(width, k)
            if name not in offered[b]:
                steps[name] = max(steps.get(name, 0), k)
    return width, steps, n


def planned(
    batch: Batch, offered: Offers, auto: list[int], n_fixed: int, fixed_width: int, fixed_steps: dict[str, int]
) -> list[Pick]:
    """The auto rows' picks from the batch's plan (autok.plan), probes and plain iterations included."""
    dec, rows = batch.dec, batch.rows
    cost = dec.costs[len(rows)]  # calibrated by the step
    options = [
        RowOptions(
            free=list(offered[b].values()),
            models={d: m.rate(rows[b]) for d in rows[b].drafters if not (m := dec.drafter(d)).free},
            limit=rows[b].room() - 1,
        )
        for b in auto
    ]
    probe = None
    if batch.probes.due:  # refresh the estimates; a model drafts on the row cheapest to bring up to date
        probe = min(
            range(len(auto)),
            key=lambda i: min((batch.sessions[d].behind(rows[auto[i]]) for d in options[i].models), default=0),
        )
    chosen = plan(cost, options, n_fixed, fixed_width, fixed_steps, probe_row=probe)
    chosen = dec.plain.apply(cost, len(rows), chosen, may_force=not n_fixed and probe is None)
    batch.probes.record(drafted=any(k for _, k in chosen), probed=probe is not None)
    return chosen
