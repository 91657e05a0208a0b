"""Choosing the speculation length k from measured costs and the live acceptance rate.

Expected tokens per iteration with per-token acceptance a and k drafts is
E(a, k) = (1 - a^(k+1)) / (1 - a); an iteration costs k * draft_step + verify(k).
``choose`` picks the k in 0..max_k with the most expected tokens per second. k = 0 is
plain target-only decoding, so a useless draft drives k to 0; every ``probe_every``
iterations at k = 0 one k = 1 iteration refreshes the acceptance estimate (about 1% of
the time, at the cost of one draft step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .types import expected_tokens_per_iteration

EMA = 0.2  # weight of a new timing sample
PRIOR_WEIGHT = 4.0  # pseudo-observations behind the acceptance prior
MARGIN = 1.1  # k > 0 only when it promises at least 10% more tokens/s than k = 0


@dataclass
class CostModel:
    """Seconds per draft step and per verify forward of k+1 tokens, measured on this device.

    A calibration measures the shape (verify time at a few k, made non-decreasing in k, and
    the draft step); live iterations only rescale it (EMA of observed / predicted), so load
    on a shared machine moves every k's cost together and no stale point can mislead.
    """

    max_k: int
    draft_step_s: float = 0.0
    verify_s: dict[int, float] = field(default_factory=dict)  # k -> seconds at calibration
    verify_scale: float = 1.0
    draft_scale: float = 1.0

    @property
    def calibrated(self) -> bool:
        return self.draft_step_s > 0 and 0 in self.verify_s

    def _calibrated_verify(self, k: int) -> float:
        pts = sorted(self.verify_s)
        lo = max((p for p in pts if p <= k), default=pts[0])
        hi = min((p for p in pts if p >= k), default=None)
        if hi is None:  # beyond the last point: extend the last slope
            prev = max((p for p in pts if p < lo), default=None)
            slope = 0.0 if prev is None else (self.verify_s[lo] - self.verify_s[prev]) / (lo - prev)
            return self.verify_s[lo] + slope * (k - lo)
        if hi == lo:
            return self.verify_s[lo]
        w = (k - lo) / (hi - lo)
        return self.verify_s[lo] * (1 - w) + self.verify_s[hi] * w

    def verify(self, k: int) -> float:
        return self.verify_scale * self._calibrated_verify(k)

    def draft(self) -> float:
        return self.draft_scale * self.draft_step_s

    def observe_verify(self, k: int, seconds: float) -> None:
        if not self.calibrated:
            return
        ratio = seconds / self._calibrated_verify(k)
        self.verify_scale = (1 - EMA) * self.verify_scale + EMA * ratio

    def observe_draft(self, seconds: float) -> None:
        if not self.calibrated:
            return
        self.draft_scale = (1 - EMA) * self.draft_scale + EMA * seconds / self.draft_step_s

    def best_k(self, acceptance: float | list[float]) -> int:
        """The k with the most expected tokens per second; ``acceptance`` per row of a batch
        (all rows verified in one forward, so a step's tokens are summed over rows)."""
        rates = [acceptance] if isinstance(acceptance, (int, float)) else list(acceptance)

        def rate(k: int) -> float:
            return sum(expected_tokens_per_iteration(a, k) for a in rates) / (k * self.draft() + self.verify(k))

        best = max(range(self.max_k + 1), key=rate)
        # drafting must promise a clear gain: the model's small errors (calibrated without the
        # masks and per-row work of a real batch) must not make a marginal k a loss
        return best if rate(best) >= MARGIN * rate(0) else 0


class BatchCosts:
    """One CostModel per batch-size bucket (powers of two), calibrated when first needed:
    as a batch grows, verifying k+1 tokens per row stops being nearly free, and the best
    k falls toward 0 (plain batched decoding)."""

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.models: dict[int, CostModel] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def __getitem__(self, rows: int) -> CostModel:
        return self.models.setdefault(self.bucket(rows), CostModel(max_k=self.max_k))


def calibrate(cost: CostModel, time_verify, time_draft, points=(0, 1, 2, 4, 8), repeats: int = 3) -> None:
    """Fill ``cost`` from timing callbacks: ``time_verify(k)`` and ``time_draft()`` return seconds.

    The minimum of a few repeats is the least disturbed by other load; verify times are
    made non-decreasing in k (a longer verify never costs less).
    """
    best = 0.0
    for k in points:
        if k <= cost.max_k:
            best = max(best, min(time_verify(k) for _ in range(repeats)))
            cost.verify_s[k] = best
    cost.draft_step_s = min(time_draft() for _ in range(repeats))
    cost.verify_scale = cost.draft_scale = 1.0


class AcceptanceTracker:
    """Per-token acceptance a, estimated as accepted / examined draft positions.

    Under the geometric model an iteration examines drafts until the first rejection, so
    a = accepted / (accepted + rejections) is the maximum-likelihood estimate. A request
    starts from ``prior`` (the decoder's running estimate over past requests).
    """

    def __init__(self, prior: float):
        self.accepted = PRIOR_WEIGHT * prior
        self.examined = PRIOR_WEIGHT

    def update(self, proposed: int, accepted: int) -> None:
        self.accepted += accepted
        self.examined += accepted + (1 if accepted < proposed else 0)

    @property
    def rate(self) -> float:
        return min(self.accepted / self.examined, 0.999)


class KSchedule:
    """The k of each iteration of a batch, from the rows' acceptance and the costs at its size.

    When k = 0 wins, one k = 1 iteration every ``probe_every`` keeps the acceptance estimates
    fresh (``probing`` is then True: the batch drafts on one row only, see decoder.py); the
    interval doubles (up to ``max_probe_every``) while probes keep confirming k = 0.
    """

    def __init__(self, probe_every: int = 32, max_probe_every: int = 1024):
        self.first_probe, self.max_probe = probe_every, max_probe_every
        self.probe_every = probe_every
        self.zero_run = 0
        self.probing = False

    def next_k(self, cost: CostModel, acceptance: list[float]) -> int:
        k = cost.best_k(acceptance)
        self.probing = False
        if k == 0:
            self.zero_run += 1
            if self.zero_run >= self.probe_every:
                self.zero_run = 0
                self.probe_every = min(2 * self.probe_every, self.max_probe)
                self.probing = True
                return 1
        else:
            self.zero_run = 0
            self.probe_every = self.first_probe
        return k


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
