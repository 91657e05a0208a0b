"""What each row's iterations proposed, accepted and cost, and the target-only
counterfactual behind its reported speedup (``Stats.baseline_s``; the basis is
``types.SPEEDUP_BASIS``).

Target-only, a request would have spent the same time outside its iterations (prefill,
joins, waits) and one plain step per token instead of its iterations. The plain step of
an iteration is measured when the iteration is a plain one (k = 0 for every row) and read
from the calibrated cost model otherwise; each row is charged the iteration's wall time
and its tokens' plain steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .costs import CostModel
    from .types import Stats


@dataclass
class Ledger:
    spent_s: float = 0.0  # seconds of this row's iterations
    plain_s: float = 0.0  # what its tokens would have cost at the target-only step of the same batch sizes
    plain_step: float = 0.0  # the target-only step of its last iteration
    emitted: int = 0  # tokens appended (before a stop string cut them)
    rows_seen: int = 0  # sum over iterations of the batch's size
    pos_proposed: list[int] = field(default_factory=list)
    pos_accepted: list[int] = field(default_factory=list)

    def iteration(self, st: Stats, drafter: str | None, k: int, n: int, rows: int) -> None:
        """One verification of ``k`` drafted tokens of which ``n`` were accepted."""
        self.rows_seen += rows
        st.target_forwards += 1
        st.k_values.append(k)
        st.draft_tokens_proposed += k
        st.draft_tokens_accepted += n
        if drafter is not None and k:
            counts = st.drafter_tokens.setdefault(
                drafter, {"proposed": 0, "accepted": 0, "drafts": 0, "accepted_per_position": []}
            )
            counts["proposed"] += k
            counts["accepted"] += n
            counts["drafts"] += 1
            per_pos = counts["accepted_per_position"]
            per_pos += [0] * (n - len(per_pos))
            for i in range(n):
                per_pos[i] += 1
        while len(self.pos_proposed) < k:
            self.pos_proposed.append(0)
            self.pos_accepted.append(0)
        for i in range(k):
            self.pos_proposed[i] += 1
            self.pos_accepted[i] += i < n

    def charge(self, seconds: float, tokens: int, plain_step: float) -> None:
        """An iteration of ``seconds`` gave this row ``tokens`` tokens; target-only, each costs ``plain_step``."""
        self.spent_s += seconds
        self.plain_s += tokens * plain_step
        self.plain_step = plain_step

    def close(self, st: Stats, wall: float, output_tokens: int, stopped: bool) -> None:
        """The finished row's derived figures (``stopped``: a stop string cut its text)."""
        st.output_tokens = output_tokens
        st.wall_time_s = wall
        st.tokens_per_s = output_tokens / wall if wall > 0 else 0.0
        # the tokens a stop string cut would not have been decoded target-only, but the one
        # that revealed the stop string would
        extra = self.emitted - output_tokens - stopped
        plain = self.plain_s - max(0, extra) * self.plain_step
        st.baseline_s = max(0.0, wall - self.spent_s + plain)
        st.acceptance_rate = st.draft_tokens_accepted / st.draft_tokens_proposed if st.draft_tokens_proposed else 0.0
        st.mean_accepted_length = output_tokens / st.target_forwards if st.target_forwards else 0.0
        st.per_position_acceptance = [a / p for a, p in zip(self.pos_accepted, self.pos_proposed)]
        st.batch_rows = self.rows_seen / st.target_forwards if st.target_forwards else 1.0
        st.drafter = max(st.drafter_tokens, key=lambda d: st.drafter_tokens[d]["proposed"], default="none")


class PlainClock:
    """The target-only step of each iteration of one batch."""

    def __init__(self) -> None:
        self.plain_before = False  # whether the last iteration was a plain one (k = 0 for every row)

    def step(self, cost: CostModel, plain_iteration: bool, seconds: float, verify_s: float) -> float:
        """A plain iteration (no drafter ran for any row; ``seconds`` from the picks to its end)
        is one: measured when it follows another (warm, as target-only decoding runs;
        schedule.PLAIN_RUN); any other iteration reads the calibrated plain step (the
        proposals nobody verified, a draft a grammar cut to nothing, are speculation's own cost)."""
        if plain_iteration:
            plain = seconds
            if self.plain_before:
                cost.observe_plain(plain, verify_s)
        else:
            plain = cost.plain_step()
        self.plain_before = plain_iteration
        return plain
