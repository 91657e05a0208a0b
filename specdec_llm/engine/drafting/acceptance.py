"""The one acceptance estimator: per-token acceptance by bucket, learnt from verifications.

Under the geometric model an iteration examines drafted tokens until the first rejection,
so accepted / examined is the maximum-likelihood estimate of a token's acceptance. A free
drafter's buckets are its tokens' kinds (match length, position...); a model drafter keeps
one estimator per row, one bucket. Greedy and sampled rows are apart where it matters (a
deterministic draft is accepted with the target's probability of it when sampling): a
free drafter's buckets include whether the row is greedy.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

# a bucket starts at its prior with the weight of this many observations: a free drafter's
# prior is a guess (0.3), so two tokens of evidence outweigh it; a model drafter's prior is
# its running estimate over past rows, worth four
GUESS_WEIGHT = 2.0
RUNNING_WEIGHT = 4.0
# the estimate never reaches 1: at 1 the plan would take every drafted token as certain
# (E(a, k) = k + 1), and a draft that agreed on every token so far still errs sometimes
CAP = 0.999


class Acceptance:
    """Per-token acceptance by bucket. A bucket starts at ``prior`` with ``weight`` observations."""

    def __init__(self, prior: float, weight: float = GUESS_WEIGHT):
        self.prior, self.weight = prior, weight
        self.counts: dict[Hashable, list[float]] = defaultdict(lambda: [0.0, 0.0])  # bucket -> [accepted, examined]

    def rate(self, bucket: Hashable = None) -> float:
        acc, seen = self.counts.get(bucket, (0.0, 0.0))
        return min((acc + self.weight * self.prior) / (seen + self.weight), CAP)

    def update(self, buckets: Sequence[Hashable], n: int) -> None:
        """Tokens up to the first rejection were examined; the first ``n`` were accepted."""
        for i, bucket in enumerate(buckets[: n + 1]):
            c = self.counts[bucket]
            c[0] += i < n
            c[1] += 1
