"""The measured decoding costs of one decoder, per batch-size bucket (autok.BatchCosts):
loaded from the on-disk cost cache (costcache.py) when it holds this machine's figures,
else measured once (a few seconds per bucket on a CPU) and cached; written back with the
live figures as requests finish, so the cache follows the machine's current speed."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import costcache, hf
from .autok import BatchCosts, Timer, best_batch, calibrate
from .ragged import RaggedCache

if TYPE_CHECKING:
    from .decoder import SpeculativeDecoder


class Calibration:
    def __init__(self, dec: SpeculativeDecoder, cache: Path | None) -> None:
        self.dec, self.cache = dec, cache
        self.costs = BatchCosts(max_k=dec.max_k)
        self._key: str | None = None

    def ensure(self, rows: int) -> None:
        """The cost model of a batch of ``rows`` ready: loaded from the cache, else measured."""
        cost = self.costs[rows]
        if cost.calibrated:
            return
        entry = costcache.load(self.cache).get(self.key(rows)) if self.cache else None
        if entry:
            try:
                cost.load(entry)
                if cost.calibrated:
                    return
            except (KeyError, TypeError, ValueError):  # a damaged entry: measure again
                pass
        self.measure(rows)
        self.save(rows)

    def up_to(self, max_batch: int) -> None:
        """Every batch-size bucket up to ``max_batch``, so that no running batch stalls the
        first time it reaches a size."""
        if self.dec.drafters:
            for rows in sorted({BatchCosts.bucket(r) for r in range(1, max_batch + 1)}):
                self.ensure(rows)

    def best_batch(self, cap: int) -> int:
        """The batch size up to ``cap`` that decodes a bulk job fastest on this machine
        (autok.best_batch), from every bucket's costs and the model drafters' acceptance so far."""
        buckets = sorted({BatchCosts.bucket(r) for r in range(1, cap + 1)})
        for rows in buckets:
            self.ensure(rows)
        rates = {d.name: d.prior for d in self.dec.drafters if not d.free}
        return min(cap, best_batch({b: self.costs[b] for b in buckets}, rates))

    def key(self, rows: int) -> str:
        if self._key is None:
            self._key = costcache.decoder_key(self.dec)
        return f"{self._key}|rows {BatchCosts.bucket(rows)}"

    def save(self, rows: int | None = None) -> None:
        """Write the calibrated buckets' live figures (or bucket ``rows``'s) to the cache."""
        if self.cache is None:
            return
        models = self.costs.models
        buckets = [BatchCosts.bucket(rows)] if rows is not None else list(models)
        costcache.save(self.cache, {self.key(b): models[b].to_dict() for b in buckets if models[b].calibrated})

    def measure(self, rows: int = 1, context: int = 64) -> None:
        """Time verify(k) at every k and each model drafter's step at a batch of ``rows``."""
        dec = self.dec
        cost = self.costs[rows]
        rows = BatchCosts.bucket(rows)
        ids = [t % dec.vocab_size for t in range(1, context + 1)]
        tcache = RaggedCache(dec.target, rows)
        tcache.forward([ids] * rows, 1)
        for b in range(rows):  # holes, as rolled-back drafts leave them: the masked path real iterations take
            tcache.drop(b, range(context // 2, context // 2 + 3))

        def time_verify(k: int) -> float:
            with Timer() as t:
                tcache.forward([ids[: k + 1]] * rows, k + 1)
                hf.sync(dec.target)
            tcache.crop(context)
            return t.seconds

        steps = {d.name: step for d in dec.drafters if (step := d.time_step(rows, ids)) is not None}
        # a drafter that drafts in two levels: its forward over w tokens (its own and w - 1 to check)
        forwards = {
            d.name: timer(rows, ids)
            for d in dec.drafters
            if getattr(d, "levels", 1) > 1 and (timer := getattr(d, "time_forward", None))
        }
        time_verify(0), [fn() for fn in steps.values()]  # warm up
        # every k for small batches; wide batches at a few (drafting seldom pays there, and each
        # point costs a forward of rows * (k + 1) tokens): the others are interpolated
        points = range(dec.max_k + 1) if rows <= 4 else sorted({0, 1, 2, 4, dec.max_k})
        widths = range(2, dec.max_k + 1) if rows <= 4 else sorted({2, 4})
        calibrate(cost, time_verify, steps, [p for p in points if p <= dec.max_k], time_widths=forwards, widths=widths)
