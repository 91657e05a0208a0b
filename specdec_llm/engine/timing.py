"""Wall-clock timing of one block (``with Timer() as t: ...; t.seconds``)."""

from __future__ import annotations

import time


class Timer:
    seconds = 0.0

    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
