"""Who drafts how much in an iteration: each row's (drafter, k).

The free drafters (no forward) propose first, for every row that may use them; a row with
a fixed k takes the first of its drafters that proposes anything (a model drafter always
can); rows with k = "auto" follow the batch's plan (plan.py: measured costs, estimated
acceptance). Now and then the plan is overridden by plain (k = 0) iterations
(``PlainIterations``): the target-only step they measure is the basis of the reported speedup.
"""

from __future__ import annotations

from collections.abc import Mapping

from .costs import BatchCosts, CostModel
from .drafting.base import Drafter, Proposal, Session
from .plan import Choice, Probes, RowOptions, plan
from .row import Row

Offers = dict[int, dict[str, Proposal]]  # row -> the free drafters' proposals of this iteration

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

    def apply(self, cost: CostModel, rows: int, chosen: list[Choice], may_force: bool) -> list[Choice]:
        """The plan's choices, or a plain iteration when one is due (only when ``may_force``:
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


def offers(rows: list[Row], free: Mapping[str, Session], max_k: int) -> Offers:
    """Every free drafter's proposal for each row that may use it, as long as the row allows."""
    out: Offers = {b: {} for b in range(len(rows))}
    for name, session in free.items():
        ks = {b: min(r.k if r.k is not None else max_k, r.room() - 1) for b, r in enumerate(rows) if name in r.drafters}
        views = [r.view(name) for r in rows]
        for b, prop in session.propose(views, {b: k for b, k in ks.items() if k > 0}).proposals.items():
            out[b][name] = prop
    return out


class Chooser:
    """Each row's (drafter, k) for an iteration, for one batch: ``drafters`` by name (the
    decoder's), the decoder's plain iterations, the batch's probes."""

    def __init__(self, drafters: Mapping[str, Drafter], plain: PlainIterations) -> None:
        self.drafters, self.plain, self.probes = drafters, plain, Probes()

    def choose(self, rows: list[Row], offered: Offers, cost: CostModel) -> list[Choice]:
        choices: list[Choice] = [(None, 0)] * len(rows)
        fixed_width, fixed_steps, n_fixed = self.fixed(rows, offered, choices)
        auto = [b for b, r in enumerate(rows) if r.k is None and r.room() > 1]
        if auto:
            for b, choice in zip(auto, self.auto(rows, offered, cost, auto, (n_fixed, fixed_width, fixed_steps))):
                choices[b] = choice
        return choices

    def fixed(self, rows: list[Row], offered: Offers, choices: list[Choice]) -> tuple[int, dict[str, int], int]:
        """The fixed-k rows' choices (into ``choices``): the first of a row's drafters that
        proposes. Returns their widest k, each model drafter's steps and how many rows have a fixed k."""
        width, steps, n = 0, dict[str, int](), 0
        for b, r in enumerate(rows):
            if r.k is None:
                continue
            n += 1
            k = max(0, min(r.k, r.room() - 1))
            name = next((d for d in r.drafters if d in offered[b] or not self.drafters[d].free), None) if k else None
            if name is not None:
                k = min(k, len(offered[b][name].tokens)) if name in offered[b] else k
                choices[b] = (name, k)
                width = max(width, k)
                if name not in offered[b]:
                    steps[name] = max(steps.get(name, 0), k)
        return width, steps, n

    def auto(
        self, rows: list[Row], offered: Offers, cost: CostModel, auto: list[int], fixed: tuple[int, int, dict[str, int]]
    ) -> list[Choice]:
        """The auto rows' choices from the batch's plan, probes and plain iterations included.
        A probe (refreshing the estimates) drafts with a model on the shortest row: the
        cheapest to bring a draft cache up to date."""
        options = [
            RowOptions(
                free=list(offered[b].values()),
                models={d: m.rate(rows[b].view(d)) for d in rows[b].drafters if not (m := self.drafters[d]).free},
                limit=rows[b].room() - 1,
            )
            for b in auto
        ]
        probe = min(range(len(auto)), key=lambda i: len(rows[auto[i]].seq)) if self.probes.due else None
        chosen = plan(cost, options, *fixed, probe_row=probe).choices
        chosen = self.plain.apply(cost, len(rows), chosen, may_force=not fixed[0] and probe is None)
        # a probe is due after a run without a model draft, even where free drafters drafted: a
        # model drafter's cost and acceptance are learnt only when it drafts, and a figure gone
        # stale (a cost measured under other load, cached) would otherwise keep it out for good
        drafted = any(k and d is not None and not self.drafters[d].free for d, k in chosen)
        self.probes.record(drafted=drafted, probed=probe is not None)
        return chosen
