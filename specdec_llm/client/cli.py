"""``specdec-llm submit | status | results | retry | cancel | run`` (and, from ``ops_cli``,
``jobs | workers | prune``).

``register(app)`` adds them to a Typer app: each command is a function of its own here.
Thin: parsing and printing here, the work in ``specdec_llm.client`` (jobs). ``worker`` is the
workers' own command (``workers/cli.py``, found through the ``specdec_llm.commands`` entry
point group): it shares the options defined here (``PairOpt``, ``DeviceOpt``, ...). Every
failure a person can fix prints one line (``error: ...``) on stderr and exits 2
(``specdec_llm.cli_common``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .local import LocalWorker

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from specdec_llm.cli_common import (
    DrafterHelp,
    DrafterOpt,
    check_batching,
    check_device,
    fail,
    parse_k,
    request_options,
    user_errors,
)

PairOpt = Annotated[str | None, typer.Option("--pair", help="Pair name (default: SPECDEC_DEFAULT_PAIR)")]
NameOpt = Annotated[str | None, typer.Option(help="A label for the job (default: the file name)")]
ChatOpt = Annotated[bool, typer.Option("--chat", help="Wrap each text prompt as a user turn (chat template)")]
MaxNewOpt = Annotated[int | None, typer.Option(help="Tokens to generate per row (default 128)")]
TempOpt = Annotated[float | None, typer.Option(help="0 = greedy (default)")]
TopPOpt = Annotated[float | None, typer.Option(help="Nucleus sampling (1 = off)")]
TopKOpt = Annotated[int | None, typer.Option(help="Top-k sampling (0 = off)")]
SeedOpt = Annotated[int | None, typer.Option(help="Sampling seed")]
KOpt = Annotated[str | None, typer.Option("--k", help="Draft length: an integer or 'auto'")]
StopOpt = Annotated[list[str] | None, typer.Option(help="Stop string (repeatable)")]
ModeOpt = Annotated[str | None, typer.Option(help="speculative | baseline (target only)")]
PriceOpt = Annotated[list[str], typer.Option("--price-per-hour", help="USD per device-hour: 2.5, or cuda=2.5 (repeat)")]
JsonSchemaOpt = Annotated[
    Path | None,
    typer.Option(
        "--json-schema",
        help="A JSON schema file: every row's output is JSON that satisfies it (constrained decoding); "
        "a row's own response_format wins",
    ),
]
DeviceOpt = Annotated[str | None, typer.Option(help="cpu, cuda or cuda:N (default: the pair's device)")]
FormatOpt = Annotated[str, typer.Option("--format", "-f", help="jsonl, csv or openai (OpenAI Batch output lines)")]
MaxBatchOpt = Annotated[
    str | None,
    typer.Option(
        "--max-batch",
        help="Requests decoded together as one batch: an integer, 'auto' or 'auto:N' (default: SPECDEC_MAX_BATCH "
        "or auto: the size with the most tokens/s on this machine up to 32, or N, chosen from measured costs); "
        "> 1 or auto runs one process with that many task threads (threads pool)",
    ),
]


def _params(options: dict[str, Any]) -> dict[str, Any]:
    """A job's generation parameters: those of a command's ``options`` (its ``locals()``) the
    command line gave, by ``GenerationRequest``'s field names (``request_options``)."""
    params = request_options(options)
    if options.get("json_schema") is not None:
        params["response_format"] = json_schema_format(options["json_schema"])
    params["k"] = parse_k(params.get("k"))
    params["stop"] = list(params.get("stop") or []) or None
    params["chat"] = params.get("chat") or None  # a flag: off is no parameter
    # a value the engine takes anyway (k auto, temperature 0, ...) is the same job as without it
    # (a job's id hashes its parameters: spelled out, a default made a new job of every row)
    return {key: v for key, v in params.items() if v is not None and not _is_default(key, v)}


def _is_default(name: str, value: Any) -> bool:
    import dataclasses

    from specdec_llm.engine import GenerationRequest

    fields = {f.name: f for f in dataclasses.fields(GenerationRequest)}
    f = fields.get(name)
    if f is None or f.default is dataclasses.MISSING:
        return False
    return bool(type(value) is type(f.default) and value == f.default)


def json_schema_format(path: Path) -> dict[str, Any]:
    """``--json-schema FILE`` as a response_format (OpenAI's json_schema form)."""
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        fail(f"json-schema: cannot read {path} ({e.strerror})")
    except ValueError as e:
        fail(f"json-schema: {path} is not JSON ({e}); give a JSON schema file")
    if not isinstance(schema, dict):
        fail(f"json-schema: {path} holds {type(schema).__name__}, not a JSON schema object")
    return {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema}}


def _usd(cost: float | None, none: str) -> str:
    """A cost in dollars: four decimals, two significant digits below a cent (never $0.0000 for a cost)."""
    if cost is None:
        return none
    return f"${cost:,.4f}" if cost >= 0.01 or cost == 0 else f"${cost:.2g}"


def _fmt(v: object, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


InputArg = Annotated[
    Path,
    typer.Argument(help="JSONL (our rows or OpenAI Batch lines), CSV (a prompt column) or text (one prompt per line)"),
]


def submit(
    file: InputArg,
    pair: PairOpt = None,
    name: NameOpt = None,
    chat: ChatOpt = False,
    max_new_tokens: MaxNewOpt = None,
    temperature: TempOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    seed: SeedOpt = None,
    k: KOpt = None,
    stop: StopOpt = None,
    mode: ModeOpt = None,
    drafter: DrafterOpt = None,
    json_schema: JsonSchemaOpt = None,
) -> None:
    """Persist every row as a job, enqueue them, print the job id."""
    params = _params(locals())
    from specdec_llm import client
    from specdec_llm.settings import get_settings

    pair = pair or get_settings().default_pair
    with user_errors():
        sub = client.submit(file, pair, params, name=name)
    print(
        f"job {sub['job_id']}: {sub['rows']} rows, {sub['bad']} refused, {sub['enqueued']} enqueued for "
        f"pair {pair} via {client.broker_display()}{_cancelled_note(sub['job_id'], sub['cancelled'])}"
        f"{_name_note(sub, name)}",
        file=sys.stderr,
    )
    print(sub["job_id"])


def status(
    job: str,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (--watch: one per look)")] = False,
    price_per_hour: PriceOpt = [],  # noqa: B006 - typer needs a literal
    watch: Annotated[
        bool,
        typer.Option("--watch", "-w", help="A live view until the job ends (Ctrl-C stops watching; the job goes on)"),
    ] = False,
    interval: Annotated[float | None, typer.Option("--interval", help="Seconds between looks with --watch")] = None,
) -> None:
    """Counts by state, progress, tokens/s, acceptance so far, ETA."""
    from specdec_llm import client

    if interval is not None and not watch:
        fail(
            f"interval: {interval:g} s between looks asks for --watch; add it (status JOB --watch --interval {interval:g})"
        )
    interval = 2.0 if interval is None else interval
    if watch:
        from .ops_cli import watch_status

        watch_status(job, interval=interval, as_json=as_json, price_per_hour=price_per_hour or None)
        return
    with user_errors():
        st = client.status(job, price_per_hour=price_per_hour or None)
    if as_json:
        print(json.dumps(st, default=str))
        return
    c = st["counts"]
    cost = _usd(st["cost_usd"], "-")
    print(f"job {st['job_id']} ({st['name']}): {st['status']}, {st['progress']:.0%} of {st['total']} rows")
    print("  " + ", ".join(f"{k} {v}" for k, v in c.items()))
    if st["lost"] or st["requeued"]:  # rows whose worker is gone: back on the queue by themselves
        parts = [f"{st['lost']} lost, being requeued"] if st["lost"] else []
        parts += [f"{st['requeued']} lost, requeued"] if st["requeued"] else []
        print("  " + "; ".join(parts) + " (their worker stopped; they run again on their own)")
    print(
        f"  {st['output_tokens']} tokens, {_fmt(st['throughput_tokens_per_s'], '.1f')} tok/s overall, "
        f"{_fmt(st['tokens_per_s_mean'], '.1f')} tok/s per request; acceptance "
        f"{_fmt(st['acceptance_rate'], '.1%')}, speedup {_fmt(st['speedup'], '.2f')}{'x' if st['speedup'] is not None else ''} "
        f"(basis: {st['speedup_basis'] or '-'}), cost {cost}"
    )
    print(f"  elapsed {st['elapsed_s']:.0f} s, ETA {_fmt(st['eta_s'], '.0f')} s")


def results(
    job: str,
    fmt: FormatOpt = "jsonl",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write here instead of stdout")] = None,
    failed_only: Annotated[
        bool, typer.Option("--failed-only", help="Only the failed rows (their error says why), in input order")
    ] = False,
) -> None:
    """Export a job's rows in input order: id, text, finish reason, error, key stats
    (--format openai: OpenAI Batch output lines, telemetry under response.body.specdec)."""
    from specdec_llm import client

    if out is not None:
        _check_output(fmt, out)  # (a folder given: a file name to give instead)
    with user_errors():
        items = client.results(job, failed_only=failed_only)
    _export(items, fmt, out)


def retry(
    job: str,
    cancelled: Annotated[bool, typer.Option("--cancelled", help="Run the cancelled rows again too")] = False,
) -> None:
    """Re-enqueue a job's failed rows and lost ones (queued or running with no worker);
    --cancelled: its cancelled rows too (else they stay cancelled)."""
    from specdec_llm import client

    with user_errors():
        r = client.retry(job, cancelled=cancelled)
    print(
        f"job {job}: {r['enqueued']} rows enqueued again"
        + (f"; {r['bad_input']} refused at submit (fix the input and submit it again)" if r["bad_input"] else "")
        + _cancelled_note(job, r["cancelled"])
    )


def cancel(
    job: str,
    now: Annotated[
        bool,
        typer.Option(
            "--now", help="Also stop the rows being generated, at their next iteration (their partial text is kept)"
        ),
    ] = False,
) -> None:
    """Cancel a job's rows not started yet (rows being generated finish, unless --now)."""
    from specdec_llm import client

    with user_errors():
        r = client.cancel(job, now=now)
    if r["finished"]:
        c = client.job_counts(job)
        print(
            f"job {job} is already finished ({c['ok']} ok, {c['failed']} failed, {c['cancelled']} cancelled): "
            "nothing to cancel"
        )
        return
    line = f"job {job}: {r['cancelled']} rows cancelled"
    if now:
        line += f"; {r['stopping']} running rows stop at their next iteration (partial text kept)"
    print(line + f"; `specdec-llm retry {job} --cancelled` runs them again")


def run(
    file: InputArg,
    pair: PairOpt = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="Results file (default: beside FILE, its stem + .results.jsonl, or .results.csv)"
        ),
    ] = None,
    fmt: FormatOpt = "jsonl",
    name: NameOpt = None,
    chat: ChatOpt = False,
    max_new_tokens: MaxNewOpt = None,
    temperature: TempOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    seed: SeedOpt = None,
    k: KOpt = None,
    stop: StopOpt = None,
    mode: ModeOpt = None,
    drafter: DrafterOpt = None,
    json_schema: JsonSchemaOpt = None,
    device: DeviceOpt = None,
    concurrency: Annotated[int, typer.Option(help="Processes of a local worker, if one is started")] = 1,
    max_batch: MaxBatchOpt = None,
    price_per_hour: PriceOpt = [],  # noqa: B006
) -> None:
    """Submit FILE, run it to the end, export the results and print a summary.

    Starts a local worker when none is reachable (always with the embedded broker) and
    stops it at the end. Run the same command again after an interruption: it resumes."""
    params = _params(locals())
    from specdec_llm import client, store
    from specdec_llm.settings import get_settings

    pair = pair or get_settings().default_pair
    device = check_device(device)
    batching = check_batching(get_settings().max_batch if max_batch is None else max_batch, concurrency)
    out = out or file.with_name(f"{file.stem}.results.{'csv' if fmt == 'csv' else 'jsonl'}")
    _check_output(fmt, out, source=file)  # before generating anything, not after
    with user_errors():  # the price (the flag, else SPECDEC_PRICE_PER_HOUR): now, not after the job
        store.price_for(price_per_hour or None, device or "cpu")
        if (
            device is None
        ):  # the pair's own device (or SPECDEC_DEVICE): one this machine has, before anything is enqueued
            from specdec_llm.pairs import check_pair_device, get_spec

            check_pair_device(get_spec(pair))
    t0 = time.time()
    with user_errors():  # held from its submission until its results file is written: no prune takes it meanwhile
        sub = client.submit(file, pair, params, name=name, hold_s=client.JOB_HOLD_S)
        job = sub["job_id"]
        if note := _name_note(sub, name):
            print(f"job {job}{note}", file=sys.stderr)
        with client.holding(job):
            _run_to_the_end(sub, pair, device=device, concurrency=concurrency, max_batch=batching)
            _export(client.results(job), fmt, out, job=job)
            st = client.status(job, price_per_hour=price_per_hour or None)
    _print_run_summary(st, out, wall=time.time() - t0)


def _run_to_the_end(
    sub: dict[str, Any], pair: str, *, device: str | None, concurrency: int, max_batch: int | str
) -> None:
    """`run`'s middle: a worker (a reachable one, or a local one started and stopped here)
    takes the submitted job's rows; a progress bar on stderr until none is pending."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specdec_llm import client
    from specdec_llm.engine.types import auto_cap

    err, job, procs = Console(stderr=True), sub["job_id"], []
    err.print(
        f"job {job}: {sub['rows']} rows, {sub['bad']} refused, {sub['enqueued']} to generate "
        f"({sub['done']} done before); broker {client.broker_display()}{_cancelled_note(job, sub['cancelled'])}"
    )

    cap = auto_cap(max_batch)
    if cap is not None and 0 < sub["enqueued"] < cap:  # its batch sizes above the job's rows are never reached:
        max_batch = f"auto:{sub['enqueued']}"  # not measured (a first start's calibration of 32 rows: 4-5 s on 2 cores)

    def start() -> LocalWorker:  # also for a local worker killed (SIGKILL, OOM killer): its rows come back by lease
        return client.start_local_worker(pair, device=device, concurrency=concurrency, max_batch=max_batch)

    try:
        if sub["enqueued"]:
            client.check_broker()
            found = client.live_workers(pair)
            if found:
                err.print(f"workers for {pair}: {', '.join(found)}")
            else:
                procs.append(start())
                err.print(f"started a local worker for {pair} (log: {procs[0].log_path})")
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[detail]}"),
        )
        with Progress(*columns, console=err) as progress:
            bar = progress.add_task(f"{pair}", total=sub["rows"], detail="")

            def show(c: dict[str, int]) -> None:
                done = c["ok"] + c["failed"] + c["cancelled"]
                progress.update(bar, completed=done, detail=f"ok {c['ok']} failed {c['failed']}")

            client.wait(job, workers=procs, on_progress=show, requeue_lost_after_s=60, restart=lambda dead: start())
        if procs:  # a resumed job's rows were enqueued twice: let our worker take the no-ops too
            client.wait_for_empty_queue(pair, timeout_s=15)
    except RuntimeError as e:  # the local worker stopped
        fail(e)
    except KeyboardInterrupt:
        err.print(f"interrupted; run the same command again to resume job {job}")
        raise typer.Exit(130) from None
    finally:
        for p in procs:
            client.stop_local_worker(p)


def _print_run_summary(st: dict[str, Any], out: Path, *, wall: float) -> None:
    job, c = st["job_id"], st["counts"]
    print(
        f"job {job}: {c['ok']} ok, {c['failed']} failed, {c['cancelled']} cancelled; results in {out}"
        + _cancelled_note(job, c["cancelled"])
    )
    print(
        f"  {st['output_tokens']} output tokens; {_fmt(st['throughput_tokens_per_s'], '.1f')} tok/s over its "
        f"decoding ({st['elapsed_s']:.1f} s, first row started to last finished, a resumed job's pauses "
        "included); this command took "
        f"{wall:.1f} s (worker start included); {_fmt(st['tokens_per_s_mean'], '.1f')} tok/s per request"
    )
    speedup = "unknown (no counterfactual recorded)" if st["speedup"] is None else f"{st['speedup']:.2f}x"
    cost = _usd(st["cost_usd"], "unknown (give --price-per-hour)")
    print(
        f"  acceptance {_fmt(st['acceptance_rate'], '.1%')}, {_fmt(st['mean_accepted_length'], '.2f')} tokens "
        f"per target forward; speedup vs target-only {speedup}; cost {cost}"
    )
    if st["speedup"] is not None:
        print(
            f"  (speedup basis: {st['speedup_basis']}: each request's output tokens at the target-only step "
            "time its worker measured at the same batch size, over the time it took)"
        )
    if c["failed"]:
        print(f"  {c['failed']} rows failed: see their 'error' in {out}; `specdec-llm retry {job}` runs them again")


COMMANDS = (submit, status, results, retry, cancel, run)


def register(app: typer.Typer) -> None:
    """Add the job commands (``COMMANDS``, then ``jobs``, ``workers``, ``prune``: ``ops_cli``) to ``app``."""
    from . import ops_cli

    for command in COMMANDS:
        app.command(cls=DrafterHelp)(command)  # (the help of a --drafter names the registered drafters)
    ops_cli.register(app)


def _name_note(sub: dict[str, Any], name: str | None) -> str:
    """What a command says when the job it named existed already under another name ("" else)."""
    if name is None or sub["name"] == name:
        return ""
    return (
        f"; the job exists already as {sub['name']!r} (the same file, pair and parameters), its rows "
        f"reused and its name kept, not {name!r}"
    )


def _cancelled_note(job: str, cancelled: int) -> str:
    """What a command that skips a job's cancelled rows says about them ("" when none)."""
    if not cancelled:
        return ""
    return (
        f"; {cancelled} cancelled rows skipped (they stay cancelled; "
        f"`specdec-llm retry {job} --cancelled` runs them again)"
    )


def _check_output(fmt: str, out: Path, source: Path | None = None) -> None:
    """Refuse a format or an output file that cannot work, before a job runs; ``source``: the
    input file, which the results must not overwrite."""
    from .jobs import FORMATS

    if fmt not in FORMATS:
        fail(f"format: {fmt!r} unknown; use --format {', '.join(FORMATS)}")
    if out.is_dir():
        fail(f"out: {out} is a folder; give a file name, e.g. --out {out / 'results.jsonl'}")
    if source is not None and out.exists() and source.exists() and out.samefile(source):
        fail(f"out: {out} is the input file; the results would overwrite it: choose another --out")
    problem = _cannot_write(out)
    if problem:
        fail(f"out: cannot write {out} ({problem}); choose another --out, in a folder you can write")


def _cannot_write(out: Path) -> str | None:
    """Why ``out`` cannot be written, found by trying (permission bits do not say it for root,
    nor for /proc or a read-only mount), changing nothing; None when it can be."""
    import tempfile

    try:
        if out.exists():
            open(out, "ab").close()  # opened for writing, not truncated
            return None
        folder = out.parent
        while not folder.exists() and folder != folder.parent:  # the nearest existing folder gets the new ones
            folder = folder.parent
        if not folder.is_dir():
            return f"{folder} is not a folder"
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".specdec-check-"):  # a file there (gone on close)
            return None
    except OSError as e:
        return e.strerror or str(e)


def _export(items: list[dict[str, Any]], fmt: str, out: Path | None, job: str | None = None) -> None:
    from specdec_llm import client

    if fmt not in client.FORMATS:
        fail(f"format: {fmt!r} unknown; use {', '.join(client.FORMATS)}")
    if out is None:
        client.write_results(items, fmt, sys.stdout)
        return
    # a file is written whole, then renamed: a failed export clobbers nothing (a pipe or a device: as it is);
    # its temporary file is this process's own, so two exports to one file at once each write theirs whole
    regular = not out.exists() or (out.is_file() and not out.is_symlink())
    part = out.with_name(f".{out.name}.{os.getpid()}.part") if regular else out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(part, "w", encoding="utf-8", newline="") as f:
            client.write_results(items, fmt, f)
        if part != out:
            part.replace(out)
    except OSError as e:
        again = f"; the results are in the store: `specdec-llm results {job} --out FILE` writes them" if job else ""
        fail(f"cannot write {out}: {e.strerror}{again}")
    finally:  # (whatever stopped it, an interrupt too: no temporary file is left behind)
        if part != out:
            with contextlib.suppress(OSError):
                part.unlink(missing_ok=True)
