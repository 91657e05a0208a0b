"""What every ``specdec-llm`` command shares: one way to say what went wrong, and the parsing
of options more than one command takes. (``cli.py``, ``training/cli.py``, ``client/cli.py``,
``store/cli.py`` and ``workers/cli.py`` use it.)

Every failure a person can fix prints one line, ``error: ...``, on stderr and exits 2:
``fail(message)``, or ``with user_errors():`` around work that may raise a ``SpecDecError``
(bad input, an unknown pair, the store, the broker, a job file).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import fields
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperOption

from .engine import GenerationRequest
from .errors import SpecDecError

# --drafter, as `generate`, `submit` and `run` take it (checked against the pair's drafters by
# PairSpec.check_drafter: `generate` before loading, `submit`/`run` before a row is written); the
# drafters it names are the registry's, filled in by DrafterHelp when the help is shown
DRAFTER_HELP = (
    "auto (the pair's drafters, chosen per iteration), or one of them: {known} "
    "(`specdec-llm pairs show PAIR` lists a pair's)"
)
DrafterOpt = Annotated[str | None, typer.Option("--drafter", help=DRAFTER_HELP.format(known="a registered drafter"))]


class DrafterHelp(TyperCommand):
    """A command whose ``--drafter`` help names every registered drafter
    (``engine.drafting.registry.known()``). Read when the help is shown, not when the command is built:
    the registry imports torch (seconds), which no other start of a command should pay."""

    def format_help(self, ctx: Any, formatter: Any) -> None:  # (typer's own click's types)
        for param in self.params:
            if param.name == "drafter" and isinstance(param, TyperOption):
                from .engine.drafting.registry import known

                param.help = DRAFTER_HELP.format(known=", ".join(known()))
        super().format_help(ctx, formatter)


def fail(message) -> None:
    """One clear line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(2)


@contextmanager
def user_errors():
    try:
        yield
    except SpecDecError as e:
        fail(e)


def request_options(options: dict[str, Any]) -> dict[str, Any]:
    """The generation parameters among a command's options (its ``locals()``): those named as
    ``GenerationRequest``'s fields, its prompt aside. A command passes them on without listing
    them, so a new field is one option of the command, and nothing else."""
    names = {f.name for f in fields(GenerationRequest)} - {"prompt"}
    return {name: value for name, value in options.items() if name in names}


def parse_k(value: str | None) -> int | str | None:
    """``--k``: an integer or "auto" (None stays None)."""
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        fail(f"k: {value!r} is not a number; use an integer >= 0 or 'auto'")


def check_device(device: str | None, field: str = "device") -> str | None:
    """``device`` when this machine's torch can run it (None stays None: the pair's device);
    else one line naming ``field`` and the devices there are (``engine.devices``)."""
    if device is not None:
        from .engine.devices import device_problem

        why = device_problem(device)
        if why:
            fail(f"{field}: {why}")
    return device


def check_batching(max_batch: int | str, concurrency: int) -> int | str:
    """--max-batch: an integer >= 1, "auto" (the batch size with the most tokens/s on this
    machine, chosen by the worker from measured costs) or "auto:N" (the same, up to N rows); the
    value to use. B > 1 or auto is one process (threads pool) holding the pair: --concurrency
    N > 1 with B > 1 is refused, and with auto it means N one-row processes."""
    from specdec_llm.engine.types import parse_max_batch

    if concurrency < 1:
        fail("concurrency: use at least 1")
    try:
        max_batch = parse_max_batch(max_batch)
    except ValueError as e:
        fail(f"max-batch: {e}")
    if isinstance(max_batch, str):
        return max_batch if concurrency == 1 else 1
    if max_batch > 1 and concurrency > 1:
        fail(
            f"--concurrency {concurrency} with --max-batch {max_batch}: a batching worker is one process per "
            "device (its task threads share one batch); drop --concurrency, and start one worker per device "
            "for more devices"
        )
    return max_batch


SHOW_AFTER_S = 2.0  # a load's stages are printed once it has taken this long (a quick one prints nothing)


def show_load_stages() -> None:
    """Print a load's stages (``specdec_llm.load``: assembling, converting, reading, quantizing,
    tuning) on stderr, each with the milliseconds since the command began: those of the first
    ``SHOW_AFTER_S`` seconds once a later stage starts, the others as they start."""
    import logging
    import time

    started = time.monotonic()

    class Stages(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.held: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.held.append(record)
            if time.monotonic() - started >= SHOW_AFTER_S:
                for r in self.held:
                    print(self.format(r), file=sys.stderr, flush=True)  # (the stderr of the moment)
                self.held = []

    logger = logging.getLogger("specdec_llm.load")
    for old in [h for h in logger.handlers if isinstance(h, logging.Handler) and type(h).__name__ == "Stages"]:
        logger.removeHandler(old)
    handler = Stages()
    handler.setFormatter(logging.Formatter("loading [%(relativeCreated)6.0f ms] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
