"""Seconds of each forward the loop runs, measured on this device: verify(k) per batch-size
bucket, each model drafter's forward at each width, a plain iteration's overhead
(``CostModel``, ``BatchCosts``); ``calibrate`` fills them from timing callbacks, and live
iterations rescale them. The plan (plan.py) reads them; only the loop feeds them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

# every live timing figure (a scale, a ratio, the target-only forward behind a reported
# speedup) is the median of this many latest observations: a few iterations another process
# slowed down (or sped up) do not move it at all, and lasting load moves it within a few
WINDOW = 9
# a calibration point is timed up to ``repeats`` times (the least disturbed is kept), but
# stops once its timings add up to this many seconds: a long forward is less disturbed for
# its length, and a 1.5B model's (0.25-3 s each on 2 cores) made most of a worker's start
ENOUGH_S = 0.5


def interpolate(points: dict[int, float], x: int) -> float:
    """The value at ``x`` of the piecewise-linear curve through ``points`` (measured at a few
    x), the last slope extended beyond the last point."""
    pts = sorted(points)
    lo = max((p for p in pts if p <= x), default=pts[0])
    hi = min((p for p in pts if p >= x), default=None)
    if hi is None:  # beyond the last point: extend the last slope
        prev = max((p for p in pts if p < lo), default=None)
        slope = 0.0 if prev is None else (points[lo] - points[prev]) / (lo - prev)
        return points[lo] + slope * (x - lo)
    if hi == lo:
        return points[lo]
    w = (x - lo) / (hi - lo)
    return points[lo] * (1 - w) + points[hi] * w


@dataclass
class CostModel:
    """Seconds per draft step of each model drafter and per verify forward of k+1 tokens,
    measured on this device.

    A calibration measures the shape (verify time at every k, made non-decreasing in k, and
    each model drafter's step); live iterations only rescale it (observed / predicted: the
    median of the latest ``WINDOW`` observations), so load on a shared machine moves every
    k's cost together, no stale point can mislead, a calibration (or a cached figure)
    measured under other load is corrected from the first iterations on, and a few disturbed
    iterations cannot stop drafting (a drafter the plan stops using is not observed again
    until a probe).
    Free drafters (prompt lookup, suffix index) cost no forward: only their verification.
    """

    max_k: int
    draft_s: dict[str, float] = field(default_factory=dict)  # model drafter -> seconds per step
    verify_s: dict[int, float] = field(default_factory=dict)  # k -> seconds at calibration
    verify_scale: float = 1.0
    # per width k > 0, observed / predicted after the common scale: corrects the calibrated
    # shape where it is off for real contexts (a too-flat curve made wide proposals look free)
    width_ratio: dict[int, float] = field(default_factory=dict)
    draft_scale: dict[str, float] = field(default_factory=dict)
    # per model drafter that drafts in two levels: seconds of a draft forward feeding w > 1
    # tokens per row (its own token plus a cheaper drafter's proposal to check), at calibration
    draft_width_s: dict[str, dict[int, float]] = field(default_factory=dict)
    # per model drafter: observed seconds per drafted token / its one-token step (two-level
    # drafting drafts several tokens per forward: below 1); absent until observed
    draft_token_ratio: dict[str, float] = field(default_factory=dict)
    # what a plain (k = 0) iteration costs besides its forward (accepting, streaming text...):
    # as observed k = 0 iterations measured it; None until one was seen (or loaded)
    plain_overhead_s: float | None = None
    # a k = 0 forward over the calibrated k = 0 point at the live scale when it ran (the median
    # of the latest WINDOW; None until one is seen, or loaded from the cache): the target-only
    # step is this times the calibrated point at the live scale now. Relative, because a plain
    # forward runs seldom (schedule.PLAIN_EVERY) while a shared CPU's speed changes: one timed
    # in a slow stretch, taken in seconds, would stand for every later iteration's
    # counterfactual
    plain_ratio: float | None = None
    # the latest WINDOW live observations behind each figure above, since calibration or load
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def calibrated(self) -> bool:
        return 0 in self.verify_s

    def plain_forward(self) -> float:
        """Seconds of a k = 0 forward now: the calibrated k = 0 point at the live scale, times
        how this process's plain forwards compared with that scale when they ran
        (``plain_ratio``), or a cached table's figure until one is seen (it was measured under
        the cache's load, as the cached shape was)."""
        return self.verify_scale * self._calibrated_verify(0) * (self.plain_ratio or 1.0)

    def plain_step(self) -> float:
        """Seconds of one target-only iteration at this batch size, as this process measures it:
        the k = 0 forward that k = 0 iterations measured (until one is seen, the calibrated
        shape at the live scale), plus the observed overhead of a plain iteration."""
        return self.plain_forward() + (self.plain_overhead_s or 0.0)

    def observe_plain(self, seconds: float, forward_s: float) -> None:
        """A k = 0 iteration took ``seconds`` in all, ``forward_s`` of it in the target forward."""
        self.plain_overhead_s = self._observe("plain", max(0.0, seconds - forward_s))
        if self.calibrated:  # (the scale includes this forward: observe_verify ran first)
            self.plain_ratio = self._observe(
                "plain forward", forward_s / self._calibrated_verify(0) / self.verify_scale
            )

    def to_dict(self) -> dict[str, Any]:
        """The costs as measured now (live scales folded in), for the on-disk cache."""
        return {
            "verify_s": {str(k): self.verify(k) for k in sorted(self.verify_s)},
            "draft_s": {n: v * self.draft_scale.get(n, 1.0) for n, v in sorted(self.draft_s.items())},
            "draft_width_s": {
                n: {str(w): v * self.draft_scale.get(n, 1.0) for w, v in sorted(shape.items())}
                for n, shape in sorted(self.draft_width_s.items())
            },
            "draft_token_ratio": dict(sorted(self.draft_token_ratio.items())),
            "plain_overhead_s": self.plain_overhead_s,
            "plain_forward_s": self.plain_forward() if self.plain_ratio is not None else None,
        }

    def load(self, data: dict[str, Any]) -> None:
        """Fill from ``to_dict``'s output (scales reset: the figures are the latest measured)."""
        self.verify_s = {int(k): float(v) for k, v in data["verify_s"].items() if int(k) <= self.max_k}
        self.draft_s = {n: float(v) for n, v in data.get("draft_s", {}).items()}
        self.draft_width_s = {
            n: {int(w): float(v) for w, v in shape.items()} for n, shape in data.get("draft_width_s", {}).items()
        }
        self.draft_token_ratio = {n: float(v) for n, v in data.get("draft_token_ratio", {}).items()}
        self.plain_overhead_s = data.get("plain_overhead_s")
        plain = data.get("plain_forward_s")  # (written at the same scale as verify_s)
        self.plain_ratio = float(plain) / self.verify_s[0] if plain is not None and self.verify_s.get(0) else None
        self.verify_scale, self.draft_scale, self.width_ratio = 1.0, {}, {}
        self.samples = {}  # (the first live observation of each figure replaces the cached one)
        widths = [v for shape in self.draft_width_s.values() for v in shape.values()]
        figures = [*self.verify_s.values(), *self.draft_s.values(), *widths, *self.draft_token_ratio.values()]
        if not self.calibrated or not all(math.isfinite(v) and v > 0 for v in figures):
            raise ValueError("a cached cost is missing or not a positive number")  # (measured again)

    def _calibrated_verify(self, k: int) -> float:
        return interpolate(self.verify_s, k)

    def verify(self, k: int) -> float:
        """Seconds to verify k drafts now: the calibrated shape at the live scale, corrected per
        width by what iterations of that width observed, and never less than a narrower width."""
        best = self._calibrated_verify(0)
        for j in range(1, k + 1):  # a wider verification never costs less
            best = max(best, self._calibrated_verify(j) * self.width_ratio.get(j, 1.0))
        return self.verify_scale * best

    def draft(self, name: str = "model", width: int = 1) -> float:
        """Seconds of one forward of the model drafter ``name`` feeding ``width`` tokens per row
        (width > 1: two-level drafting; infinite where that width was never measured)."""
        calibrated = self.draft_s.get(name, float("inf"))
        if width > 1:
            shape = self.draft_width_s.get(name)
            calibrated = interpolate({1: calibrated, **shape}, width) if shape else float("inf")
        return self.draft_scale.get(name, 1.0) * calibrated

    def draft_per_token(self, name: str = "model") -> float:
        """Seconds per token the model drafter ``name`` drafts: its one-token step, times what
        two-level drafting was observed to make of it (``draft_token_ratio``, 1 until seen)."""
        return self.draft(name) * self.draft_token_ratio.get(name, 1.0)

    def _observe(self, figure: str, x: float) -> float:
        """The median of the latest ``WINDOW`` observations of ``figure``, ``x`` the newest."""
        latest = self.samples[figure] = [*self.samples.get(figure, []), x][-WINDOW:]
        return statistics.median(latest)

    def observe_verify(self, k: int, seconds: float) -> None:
        if not self.calibrated:
            return
        # a k = 0 forward against the k = 0 point as plain forwards measured it (plain_ratio): the
        # calibrated point's own error must not move the common scale (it did, and the plain
        # ratio measured against that scale then hid the error it was there to correct)
        ratio = seconds / (self._calibrated_verify(k) * ((self.plain_ratio or 1.0) if k == 0 else 1.0))
        self.verify_scale = self._observe("verify", ratio)
        if k > 0:  # what is left once the common scale moved: this width's own error
            self.width_ratio[k] = self._observe(f"verify:{k}", ratio / self.verify_scale)

    def observe_draft(self, name: str, seconds: float, width: int = 1) -> None:
        """One draft forward of ``width`` tokens per row took ``seconds``."""
        if name not in self.draft_s:
            return
        calibrated = self.draft(name, width) / self.draft_scale.get(name, 1.0)
        if calibrated == float("inf"):
            return
        self.draft_scale[name] = self._observe(f"draft:{name}", seconds / calibrated)

    def observe_drafting(self, name: str, seconds: float, tokens: int) -> None:
        """A model drafter's whole proposal: ``tokens`` tokens (per row, the most any row
        drafted) in ``seconds`` of draft forwards. Against its one-token step this is what
        two-level drafting makes of a drafted token's cost (1: one forward per token)."""
        step = self.draft(name)
        if tokens <= 0 or step == float("inf"):
            return
        self.draft_token_ratio[name] = self._observe(f"ratio:{name}", seconds / tokens / step)


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


def least(timers: dict[Any, Callable[[], float]], repeats: int) -> dict[Any, float]:
    """The least of up to ``repeats`` timings of each of ``timers``, fewer for one whose
    timings add up to ENOUGH_S. The repeats run in rounds (each round times every one once,
    in turn), so every figure's repeats span the same stretch of time: a burst of other load
    slows all of them alike instead of whichever point it fell on, and their ratios (a draft
    step to a verification, a plain forward to a wide one) stay the machine's."""
    times: dict[Any, list[float]] = {key: [] for key in timers}
    for r in range(repeats):
        for key, time_it in timers.items():
            if r == 0 or sum(times[key]) < ENOUGH_S:
                times[key].append(time_it())
    return {key: min(t) for key, t in times.items()}


def calibrate(
    cost: CostModel,
    time_verify: Callable[[int], float],
    time_draft: Callable[[], float] | dict[str, Callable[[], float]] | None = None,
    points: Iterable[int] | None = None,
    repeats: int = 3,
    time_widths: dict[str, Callable[[int], float]] | None = None,
    widths: Iterable[int] = (),
) -> None:
    """Fill ``cost`` from timing callbacks: ``time_verify(k)`` and each model drafter's
    ``time_draft()`` (a dict name -> callback, or one callback for "model") return seconds;
    ``time_widths[name](w)``: a draft forward of ``w`` tokens per row, at each of ``widths``
    (a drafter that drafts in two levels).

    The minimum of a few repeats, taken in rounds over every point (``least``), is the least
    disturbed by other load; verify times are made non-decreasing in k (a longer verify never
    costs less), and so are draft widths.
    ``points``: the k measured (default every k up to max_k).
    """
    drafts = {"model": time_draft} if callable(time_draft) else time_draft or {}
    ks = [k for k in (points if points is not None else range(cost.max_k + 1)) if k <= cost.max_k]
    widths = sorted(widths)
    # two-level widths of the drafters with a step (timed now, or earlier)
    two_level = {n: f for n, f in (time_widths or {}).items() if n in drafts or n in cost.draft_s} if widths else {}
    timers: dict[Any, Callable[[], float]] = {("verify", k): partial(time_verify, k) for k in ks}
    timers |= {("draft", name): fn for name, fn in drafts.items()}
    timers |= {("width", name, w): partial(forward, w) for name, forward in two_level.items() for w in widths}
    least_s = least(timers, repeats)
    best = 0.0
    for k in ks:
        best = cost.verify_s[k] = max(best, least_s["verify", k])
    cost.draft_s.update({name: least_s["draft", name] for name in drafts})
    cost.draft_width_s = {}
    for name in two_level:
        best, shape = cost.draft_s[name], {}
        for w in widths:
            best = shape[w] = max(best, least_s["width", name, w])
        cost.draft_width_s[name] = shape
    cost.verify_scale = 1.0
    cost.width_ratio = {}
    cost.draft_scale = {}
    cost.draft_token_ratio = {}
    cost.samples = {}
    cost.plain_ratio = None
