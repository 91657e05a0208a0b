"""The measured decoding costs of one decoder, per batch-size bucket (costs.BatchCosts):
loaded from the on-disk cost cache (costcache.py) when it holds this machine's figures,
else measured once (a few seconds per bucket on a CPU) and cached; written back with the
live figures as requests finish, so the cache follows the machine's current speed."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from . import costcache, hf, jsoncache
from .costs import BatchCosts, calibrate
from .plan import best_batch
from .ragged import RaggedCache
from .timing import Timer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .drafting.base import Drafter

# calibration's forwards run on a context of 64 tokens: short enough to measure in seconds,
# long enough to hold the holes real iterations leave (a forward's cost at these sizes is
# its weights' bytes, not its context: docs/ARCHITECTURE's measured physics)
CONTEXT = 64
# up to this many rows most k (and draft widths) are timed; wider batches a few points; the rest
# interpolated (live iterations correct each width's error: costs.py). Drafting seldom pays in
# wide batches, and each point costs rows * (k + 1) tokens; every point timed made make demo's
# first run spend 27 s calibrating for 3 s of decoding (and 21 s of a 49 s first run on an
# AVX2-only EPYC before k = 3 and a third repeat beyond one row went)
MOST_K_UP_TO = 4


class Calibration:
    def __init__(
        self, target: PreTrainedModel, drafters: list[Drafter], vocab_size: int, max_k: int, cache: Path | None
    ) -> None:
        self.target, self.drafters, self.vocab_size, self.max_k = target, drafters, vocab_size, max_k
        self.cache = cache
        self.costs = BatchCosts(max_k=max_k)
        self._key: str | None = None

    def ensure(self, rows: int) -> None:
        """The cost model of a batch of ``rows`` ready: loaded from the cache, else measured."""
        cost = self.costs[rows]
        if cost.calibrated:
            return
        entry = jsoncache.load(self.cache).get(self.key(rows)) if self.cache else None
        if entry:
            try:
                cost.load(entry)
                if cost.calibrated:
                    return
            except (AttributeError, KeyError, TypeError, ValueError):  # a damaged entry: measure again
                pass
        self.measure(rows)
        self.save(rows)

    def up_to(self, max_batch: int) -> None:
        """Every batch-size bucket up to ``max_batch``, so that no running batch stalls the
        first time it reaches a size."""
        if self.drafters:
            for rows in sorted({BatchCosts.bucket(r) for r in range(1, max_batch + 1)}):
                self.ensure(rows)

    def best_batch(self, cap: int) -> int:
        """The batch size up to ``cap`` that decodes a bulk job fastest on this machine
        (plan.best_batch), from every bucket's costs and the model drafters' acceptance so far."""
        buckets = sorted({BatchCosts.bucket(r) for r in range(1, cap + 1)})
        for rows in buckets:
            self.ensure(rows)
        rates = {d.name: d.prior for d in self.drafters if not d.free}
        return min(cap, best_batch({b: self.costs[b] for b in buckets}, rates))

    def key(self, rows: int) -> str:
        if self._key is None:
            self._key = costcache.decoder_key(self.target, self.drafters, self.vocab_size, self.max_k)
        return f"{self._key}|rows {BatchCosts.bucket(rows)}"

    def save(self, rows: int | None = None) -> None:
        """Write the calibrated buckets' live figures (or bucket ``rows``'s) to the cache."""
        if self.cache is None:
            return
        models = self.costs.models
        buckets = [BatchCosts.bucket(rows)] if rows is not None else list(models)
        costcache.save(self.cache, {self.key(b): models[b].to_dict() for b in buckets if models[b].calibrated})

    def measure(self, rows: int = 1, context: int = CONTEXT) -> None:
        """Time verify(k) at every k and each model drafter's forwards at a batch of ``rows``."""
        cost = self.costs[rows]
        rows = BatchCosts.bucket(rows)
        ids = [t % self.vocab_size for t in range(1, context + 1)]
        tcache = RaggedCache.filled(self.target, rows, ids)
        for b in range(rows):  # holes, as rolled-back drafts leave them: the masked path real iterations take
            tcache.drop(b, range(context // 2, context // 2 + 3))

        def time_verify(k: int) -> float:
            with Timer() as t:
                tcache.forward([ids[: k + 1]] * rows, k + 1)
                hf.sync(self.target)
            tcache.crop(context)
            return t.seconds

        timers = {d.name: (d, timer) for d in self.drafters if (timer := d.timer(rows, ids)) is not None}
        steps: dict[str, Callable[[], float]] = {name: partial(timer, 1) for name, (_, timer) in timers.items()}
        forwards = {name: timer for name, (d, timer) in timers.items() if d.levels > 1}  # two levels: w tokens
        time_verify(0), [fn() for fn in steps.values()]  # warm up
        small = rows <= MOST_K_UP_TO
        # a wide batch's verification is compute-bound (its cost linear in k): wider k are the
        # slope from 2 to 4 extended (costs.interpolate), not timed (at 32 rows of a 1.5B on 2
        # cores, k = 8 alone was a third of the bucket's calibration)
        points = sorted({0, 1, 2, 4, 6, self.max_k} if small else {0, 1, 2, 4})
        widths = sorted({2, 4, 6, self.max_k} if small else {2, 4})
        calibrate(
            cost,
            time_verify,
            steps,
            [p for p in points if p <= self.max_k],
            # the least of 3 at one row (what serving one request at a time chooses k by), of 2 in
            # wider batches (their forwards are longer: less disturbed)
            repeats=3 if rows == 1 else 2,
            time_widths=forwards,
            widths=widths,
        )
