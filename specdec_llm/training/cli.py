"""``specdec-llm distill | eval-pair | corpus grow | show | import | teacher | widen``: the
training room's commands, added to the main app by ``register(app)`` (``specdec_llm/cli.py``).

Thin: options checked and printed here, the work in ``specdec_llm.training`` (``distill``,
``eagle``, ``corpus``, ``evaluate``). Every failure a person can fix prints one line
(``error: ...``) on stderr and exits 2 (``specdec_llm.cli_common``).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..cli_common import fail, user_errors
from ..settings import DTYPE_NAMES, get_settings

console = Console()
err = Console(stderr=True)

# -- distill ---------------------------------------------------------------------------------
PairOpt = Annotated[str | None, typer.Option(help="Take the target of this pair")]
TargetOpt = Annotated[str | None, typer.Option(help="Or a target model reference (dir, hub id, .gguf, pkg:)")]
SeedsOpt = Annotated[str, typer.Option(help="Seed prompts (JSONL with a 'prompt' field)")]
PoolOpt = Annotated[str | None, typer.Option(help="A ready prompt pool (JSONL 'prompt'): skips the expansion")]
SubsetOpt = Annotated[int, typer.Option(help="Draft head over this many most frequent tokens (0: full vocabulary)")]
InitFromOpt = Annotated[
    str | None,
    typer.Option(
        help="Warm start from a distilled draft (dir or pkg:...): its layers and vocabulary subset, not --layers"
    ),
]
KindOpt = Annotated[str, typer.Option(help="model (a draft of target layers) | eagle (a feature-level EAGLE draft)")]
CorpusOpt = Annotated[
    str | None,
    typer.Option(help="eagle: token corpus root (default data/corpus/<target fingerprint>), or a distill data dir"),
]
FeatureLayersOpt = Annotated[
    str | None, typer.Option(help="eagle: target layers whose outputs are fused, e.g. 1,15,29 (default 1,N/2,N-1)")
]


def _target_ref(pair: str | None, target: str | None) -> str:
    from ..pairs import get_spec

    if (pair is None) == (target is None):
        fail("give exactly one of --pair NAME or --target REF")
    return get_spec(pair).target if pair else target


def _load_target(ref: str, device: str = "cpu"):
    from ..pairs import load_model, load_tokenizer, use_threads

    use_threads()
    return load_model(ref, "float32", device), load_tokenizer(ref)


def _int_list(name: str, value: str, example: str) -> list[int]:
    """A comma-separated list of distinct integers, or the one-line error naming ``name``."""
    try:
        out = [int(x) for x in value.split(",")]
    except ValueError:
        fail(f"{name}: {value!r} is not a comma-separated list of integers, e.g. {example}")
        raise  # unreachable: fail exits
    if len(set(out)) < len(out):
        fail(f"{name}: {value!r} names a layer twice; name each once, e.g. {example}")
    return out


def read_prompt_file(name: str, value: str, example: str, limit: int | None = None) -> list[dict]:
    """The rows of the JSONL prompt file ``value`` (``evaluate.read_prompts``), or the one-line
    error naming option ``name``: a missing file, a bad line (``path:line``) or no prompts."""
    from .evaluate import read_prompts

    path = Path(value)
    fix = f"pass an existing JSONL file with a 'prompt' per line, e.g. the repository's {example}"
    if not path.is_file():
        fail(f"{name}: {value} is not a file (relative to {Path.cwd()}); {fix}")
    try:
        rows = read_prompts(path, limit)
    except (ValueError, UnicodeDecodeError) as e:
        fail(f"{name}: {e}")
    if not rows:
        fail(f"{name}: {value} holds no prompts; {fix}")
    return rows


# distill's numeric options: (smallest value, what the error suggests)
DISTILL_RANGES = {
    "steps": (1, "an integer >= 1"),
    "batch_size": (1, "an integer >= 1"),
    "gen_batch": (1, "an integer >= 1"),
    "max_new_tokens": (1, "an integer >= 1"),
    "ttt_steps": (1, "an integer >= 1"),
    "max_len": (1, "an integer >= 1"),
    "samples": (0, "0 or more"),
    "expand_per_seed": (0, "0 or more"),
    "vocab_subset": (0, "0 (the full vocabulary) or more"),
}


def _check_numbers(options: dict) -> None:
    """distill's numbers, dtype and device, each refused with the option's name."""
    from ..cli_common import check_device

    for name, (least, use) in DISTILL_RANGES.items():
        if options[name] < least:
            fail(f"{name.replace('_', '-')}: {options[name]} is below {least}; use {use}")
    if not (math.isfinite(options["lr"]) and options["lr"] > 0):
        fail(f"lr: {options['lr']} is not a positive learning rate; use e.g. 1e-3")
    _check_hours(options["hours"])
    if options["gen_dtype"] not in DTYPE_NAMES:
        fail(f"gen-dtype: {options['gen_dtype']!r} unknown; use float32, bfloat16 or float16")
    check_device(options["device"])
    init = options.get("init_from")
    if init and not init.startswith("pkg:") and not Path(init).is_dir():
        fail(f"init-from: {init} is not a folder; give a distilled draft's folder (distill --out) or pkg:DIST/PATH")


def _check_hours(hours: float | None) -> None:
    """``--hours``: unset, or a positive number (distill and corpus grow)."""
    if hours is not None and not (math.isfinite(hours) and hours > 0):
        fail(f"hours: {hours} is not a positive number of hours; use e.g. 0.5, or leave it out for no limit")


def _check_distill(options: dict):
    """The command line's checks, before any model loads: the layer lists it names, its numbers,
    the device, and (for a data phase) the seed prompts read and the pool checked."""
    phase, kind = options["phase"], options["kind"]
    if phase not in ("data", "train", "all"):
        fail(f"phase: {phase!r} unknown; use data, train or all")
    if kind not in ("model", "eagle"):
        fail(f"kind: {kind!r} unknown; use model or eagle")
    if kind == "eagle" and phase == "data":
        fail("kind eagle has no data phase: it trains on a token corpus (--corpus); use --phase train")
    features = options["feature_layers"]
    feature_list = _int_list("feature-layers", features, "1,15,29") if features else None
    layer_list = _int_list("layers", options["layers"], "0,1")
    if (options["pair"] is None) == (options["target"] is None):
        fail("give exactly one of --pair NAME or --target REF")
    _check_numbers(options)
    if phase in ("train", "all"):
        _check_checkpoint(Path(options["work"]) / ("eagle-ckpt" if kind == "eagle" else "ckpt"), options["resume"])
    seeds = None
    for name in ("prompts", "prompt_pool"):  # (what we measure on is never trained on)
        if options.get(name) and "spec_bench" in Path(options[name]).name and phase in ("data", "all"):
            fail(f"{name.replace('_', '-')}: {options[name]}: Spec-Bench is for evaluation only; use the seed prompts")
    if kind == "model" and phase in ("data", "all"):
        seeds = [
            r["prompt"] for r in read_prompt_file("prompts", options["prompts"], "data/distill_seed_prompts.jsonl")
        ]
        if options["prompt_pool"] is not None:
            read_prompt_file("prompt-pool", options["prompt_pool"], "data/distill_prompts_smollm2-135m.jsonl")
    return feature_list, layer_list, seeds


def _check_checkpoint(ckpt: Path, resume: bool) -> None:
    """A checkpoint in ``ckpt`` is continued with --resume, never written over without it (a
    rerun without the flag lost a long run); --resume with none says it starts afresh."""
    state = ckpt / "state.json"
    if resume and not state.exists():
        err.print(f"resume: no checkpoint in {ckpt} yet: training starts at step 0", markup=False)
    elif not resume and state.exists():
        try:
            step = json.loads(state.read_text()).get("step", "?")
        except (OSError, ValueError, AttributeError):
            step = "?"
        fail(
            f"resume: {ckpt} holds a checkpoint (step {step}); pass --resume to continue it, or start over "
            f"with another --work (or delete {ckpt})"
        )


def _distill_data(model, tok, work: Path, seeds: list[str], pool: Path | None, cfg, progress, deadline) -> None:
    """The data phase: the target's answers to the seed prompts (``seeds``) or a ready ``pool``."""
    from .distill import build_data

    manifest = build_data(model, tok, seeds, work, cfg, progress, deadline, pool)
    err.print(f"data: {manifest.get('tokens', 0):,} answer tokens in {manifest.get('shards', 0)} shards")


def _run_distill(ref: str, device: str, hours: float | None, work: Path, out: Path, resume: bool, phases) -> None:
    """Load the target and run ``phases`` in order: ``("data", DataConfig, prompts, pool)``,
    ``("train", TrainConfig)`` or ``("eagle", EagleConfig, corpus)``, with one progress display
    and one deadline (``hours`` from now; None: none)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .distill import train
    from .eagle import corpus_examples, train_eagle

    model, tok = _load_target(ref, device)
    deadline = time.time() + hours * 3600 if hours else None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err) as progress:
        for name, cfg, *paths in phases:
            if name == "data":
                _distill_data(model, tok, work, *paths, cfg, progress, deadline)
                continue
            if name == "eagle":
                summary = train_eagle(model, corpus_examples(model, *paths), work, out, cfg, resume, progress, deadline)
            else:
                summary = train(model, work, out, cfg, resume, progress, deadline)
            err.print(f"train: {json.dumps(summary)}")


def distill(
    out: Annotated[str, typer.Option(help="Where to write the draft (a directory the pair registry loads)")],
    pair: PairOpt = None,
    target: TargetOpt = None,
    work: Annotated[str, typer.Option(help="Working directory for data shards and checkpoints")] = "runs/distill",
    phase: Annotated[str, typer.Option(help="data | train | all")] = "all",
    layers: Annotated[str, typer.Option(help="Target layers the draft starts from, e.g. 0,1")] = "0,1",
    prompts: SeedsOpt = "data/distill_seed_prompts.jsonl",
    prompt_pool: PoolOpt = None,
    expand_per_seed: int = 4,
    samples: Annotated[int, typer.Option(help="Sampled answers per prompt besides the greedy one")] = 1,
    max_new_tokens: int = 256,
    gen_batch: int = 32,
    gen_dtype: str = "bfloat16",
    device: Annotated[str, typer.Option(help="cpu or cuda:N")] = "cpu",
    steps: int = 2000,
    batch_size: int = 16,
    lr: float = 1e-3,
    vocab_subset: SubsetOpt = 16384,
    resume: Annotated[bool, typer.Option(help="Continue from the last checkpoint in --work")] = False,
    init_from: InitFromOpt = None,
    hours: Annotated[float | None, typer.Option(help="Stop each phase after this many hours (resumable)")] = None,
    kind: KindOpt = "model",
    corpus: CorpusOpt = None,
    feature_layers: FeatureLayersOpt = None,
    ttt_steps: Annotated[int, typer.Option(help="eagle: training-time-test steps (draft positions trained)")] = 3,
    max_len: Annotated[int, typer.Option(help="eagle: tokens per training sequence")] = 256,
) -> None:
    """Distil a draft from a target (resumable: data shards and checkpoints live in --work).

    ``--kind eagle`` trains an EAGLE draft on a token corpus (--corpus) instead: no data phase."""
    options = dict(locals())
    from .distill import DataConfig, TrainConfig
    from .eagle import EagleConfig

    feature_list, layer_list, seeds = _check_distill(options)
    trained = dict(steps=steps, batch_size=batch_size, lr=lr, vocab_subset=vocab_subset)  # both kinds of draft
    phases: list[tuple] = []
    if kind == "eagle":
        eagle = EagleConfig(feature_layers=feature_list, ttt_steps=ttt_steps, max_len=max_len, **trained)
        phases.append(("eagle", eagle, Path(corpus) if corpus else None))
    if kind == "model" and phase in ("data", "all"):
        data = DataConfig(
            max_new_tokens=max_new_tokens,
            batch_size=gen_batch,
            dtype=gen_dtype,
            expand_per_seed=expand_per_seed,
            samples=samples,
        )
        phases.append(("data", data, seeds, Path(prompt_pool) if prompt_pool else None))
    if kind == "model" and phase in ("train", "all"):
        phases.append(("train", TrainConfig(layers=layer_list, init_from=init_from, **trained)))
    with user_errors():
        _run_distill(_target_ref(pair, target), device, hours, Path(work), Path(out), resume, phases)


def eval_pair(
    prompts: Annotated[str, typer.Option(help="JSONL with 'prompt' (or Spec-Bench 'turns') and optional 'category'")],
    pair: Annotated[str | None, typer.Option(help="Pair name (default: SPECDEC_DEFAULT_PAIR)")] = None,
    limit: Annotated[int | None, typer.Option(help="First N prompts of each category")] = None,
    max_new_tokens: int = 128,
    k: Annotated[int, typer.Option("--k", help="Fixed draft length")] = 4,
    drafter: Annotated[
        str,
        typer.Option(
            help="The drafter measured (default: the draft model, distilled or "
            "quantized, if the pair has one, else auto)"
        ),
    ] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Greedy acceptance rate, mean accepted length and per-position acceptance of a pair's drafter."""
    from ..engine import GenerationRequest
    from ..pairs import get_spec, load_pair, use_threads
    from .evaluate import evaluate

    if k < 1:
        fail(f"k: {k} is below 1; eval-pair measures drafts, use k >= 1")
    if limit is not None and limit < 1:
        fail(f"limit: {limit} is below 1; use --limit N >= 1 prompts per category, or leave it out for all")
    rows = read_prompt_file("prompts", prompts, "data/spec_bench_dev.jsonl", limit)
    with user_errors():
        GenerationRequest("x", max_new_tokens=max_new_tokens, k=k).validate()  # (before the load, not after)
        spec = get_spec(pair or get_settings().default_pair)
        drafter = drafter or next((d for d in spec.drafter_names() if d in ("model", "quantized")), "auto")
        spec.check_drafter(drafter)
        use_threads()
        decoder = load_pair(spec).decoder()
        done = 0

        def show(row, res) -> None:
            nonlocal done
            done += 1
            if not as_json:
                err.print(
                    f"[dim]{done}/{len(rows)} {row['category']}: acceptance {res.stats.acceptance_rate:.2f}[/dim]"
                )

        report = evaluate(decoder, rows, max_new_tokens, k, on_row=show, drafter=drafter)
    if as_json:
        print(json.dumps(report))
        return
    table = Table("category", "prompts", "acceptance", "tokens/target fwd", "per-position acceptance", "tok/s")
    for name, s in [*report.get("categories", {}).items(), ("overall", report["overall"])]:
        table.add_row(
            name,
            str(s["prompts"]),
            f"{s['acceptance_rate']:.3f}",
            f"{s['mean_accepted_length']:.2f}",
            " ".join(f"{x:.2f}" for x in s["per_position_acceptance"]),
            f"{s['tokens_per_s']:.1f}",
        )
    console.print(table)
    for line in report.get("skipped", []):
        err.print(f"skipped {line}", markup=False, highlight=False)


# -- corpus ----------------------------------------------------------------------------------
RootOpt = Annotated[str, typer.Option(help="Corpus root; each target's shards are under ROOT/<fingerprint>")]


def _print_stats(title: str, stats: dict) -> None:
    table = Table(title, "value")
    for k, v in stats.items():
        table.add_row(k, f"{v:,}" if isinstance(v, int) else str(v))
    console.print(table)


def corpus_grow(
    prompts: Annotated[list[str], typer.Option(help="Prompt files (JSONL, a 'prompt' field per line); repeatable")],
    pair: PairOpt = None,
    target: TargetOpt = None,
    samples: Annotated[int, typer.Option(help="Sampled answers per prompt besides the greedy one")] = 0,
    hours: Annotated[float | None, typer.Option(help="Stop after this many hours (a rerun continues)")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda:N")] = "cpu",
    batch: Annotated[int, typer.Option(help="Prompts per generate call (one shard each)")] = 32,
    max_new_tokens: int = 256,
    max_prompt_tokens: Annotated[int, typer.Option(help="Skip longer prompts (chat-encoded)")] = 1024,
    dtype: Annotated[str, typer.Option(help="Generation dtype: bfloat16, float16 or float32")] = "bfloat16",
    temperature: Annotated[float, typer.Option(help="Of the sampled answers")] = 0.8,
    seed: Annotated[int, typer.Option(help="Sampled answers follow from it, the prompt and the variant")] = 0,
    root: RootOpt = "data/corpus",
) -> None:
    """Generate the target's answers the corpus lacks (greedy, plus --samples sampled), a shard per batch."""
    from ..cli_common import check_device
    from . import corpus as C

    check_device(device)
    if samples < 0 or min(batch, max_new_tokens, max_prompt_tokens) < 1:
        fail("samples must be >= 0; batch, max-new-tokens and max-prompt-tokens >= 1")
    if samples and not (math.isfinite(temperature) and temperature > 0):  # (-1 sampled the least likely tokens)
        fail(f"temperature: {temperature} is not a positive temperature; use e.g. 0.8")
    _check_hours(hours)
    if dtype not in DTYPE_NAMES:
        fail(f"dtype: {dtype!r} unknown; use bfloat16, float16 or float32")
    with user_errors():
        texts = C.read_prompts(prompts)  # checked before any model loads
        ref = _target_ref(pair, target)
        model, tok = _load_target(ref, device)
        deadline = time.time() + hours * 3600 if hours else None

        def show(s: dict) -> None:
            err.print(
                f"corpus: {s['written']:,}/{s['todo']:,} answers, {s['answer_tokens']:,} tokens, {s['shards']} shards"
            )

        stats = C.grow(
            model,
            tok,
            texts,
            root,
            samples=samples,
            batch_size=batch,
            max_new_tokens=max_new_tokens,
            max_prompt_tokens=max_prompt_tokens,
            dtype=dtype,
            temperature=temperature,
            seed=seed,
            deadline=deadline,
            target_ref=ref,
            progress=show,
        )
    _print_stats("corpus grow", stats)


def corpus_show(root: RootOpt = "data/corpus") -> None:
    """One table per target: shards, records, tokens, greedy and sampled answers, size on disk."""
    from .corpus import Corpus

    dirs = sorted(d for d in Path(root).glob("*") if d.is_dir() and Corpus(d).shards())
    if not dirs:
        err.print(f"no corpus shards under {root}; grow one with `specdec-llm corpus grow`")
        return
    for d in dirs:
        s = Corpus(d).summary()
        table = Table(f"target {d.name}", "value")
        table.add_row("target", ", ".join(s["targets"]))
        for key in ("shards", "records", "prompt_tokens", "answer_tokens"):
            table.add_row(key.replace("_", " "), f"{s[key]:,}")
        for mode in ("greedy", "sampled"):
            table.add_row(f"{mode} answers", f"{s['by_mode'].get(mode, 0):,}")
        table.add_row("size on disk", f"{s['bytes'] / 1e6:.2f} MB")
        table.add_row("directory", str(d))
        console.print(table)


def corpus_import(
    work: Annotated[str, typer.Option(help="A distill --work directory (its data/ is read, never changed)")],
    pair: PairOpt = None,
    target: TargetOpt = None,
    gen_device: Annotated[
        str, typer.Option(help="Where the data phase ran (distill does not record it)")
    ] = "not recorded",
    root: RootOpt = "data/corpus",
) -> None:
    """Copy a distill data phase's answers into the corpus (only those it lacks)."""
    from ..pairs import fingerprint
    from . import corpus as C

    data = Path(work) / "data"
    if not (data / "manifest.json").is_file():
        fail(f"work: {data / 'manifest.json'} not found; give the --work DIR of a distill data phase")
    with user_errors():
        ref = _target_ref(pair, target)
        model, tok = _load_target(ref)
        provenance = {
            "target": ref,
            "target_fingerprint": fingerprint(model),
            "vocab_size": model.config.vocab_size,
            "device": gen_device,
        }
        stats = C.import_datastore(data, root, provenance, tok)
    _print_stats("corpus import", stats)


def corpus_teacher(
    work: Annotated[str, typer.Option(help="Distill work directory: writes WORK/data (train with --phase train)")],
    pair: PairOpt = None,
    target: TargetOpt = None,
    topk: Annotated[int, typer.Option(help="Teacher log-probs kept per answer position")] = 8,
    batch: Annotated[int, typer.Option(help="Records per teacher-forced forward")] = 8,
    max_len: Annotated[int | None, typer.Option(help="Cut records to this many tokens")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda:N")] = "cpu",
    root: RootOpt = "data/corpus",
) -> None:
    """The target's top-k log-probs over the corpus (fp32 teacher-forced forwards), cached in WORK/data."""
    from ..cli_common import check_device
    from ..pairs import fingerprint
    from . import corpus as C

    check_device(device)
    if topk < 1 or batch < 1:
        fail("topk and batch must be >= 1")
    with user_errors():
        ref = _target_ref(pair, target)
        model, _ = _load_target(ref, device)
        corpus = C.Corpus(C.corpus_dir(root, fingerprint(model)))
        if not corpus.shards():
            fail(f"no corpus for this target under {corpus.root}; grow or import one first")

        def show(s: dict) -> None:
            err.print(f"teacher: {s['shards']} shards, {s['records']:,} records, {s['answer_tokens']:,} tokens")

        stats = C.teacher_topk(model, corpus, Path(work), topk=topk, batch_size=batch, max_len=max_len, progress=show)
    _print_stats("corpus teacher", stats)


def corpus_widen(
    pair: PairOpt = None,
    target: TargetOpt = None,
    prompts: Annotated[
        list[str] | None, typer.Option(help="Prompt files that name the corpus's prompts (JSONL 'prompt')")
    ] = None,
    seeds: Annotated[str, typer.Option(help="Seed prompts, also used as passages")] = "data/distill_seed_prompts.jsonl",
    out: Annotated[
        str, typer.Option(help="Where to write the new prompts (JSONL)")
    ] = "data/corpus_prompts_extra.jsonl",
    translate: Annotated[int, typer.Option(help="Translation prompts")] = 400,
    summarize: Annotated[int, typer.Option(help="Long-input summarization prompts")] = 200,
    rag: Annotated[int, typer.Option(help="RAG-style prompts")] = 400,
    seed: int = 0,
    root: RootOpt = "data/corpus",
) -> None:
    """Translation, long-input summarization and RAG prompts, templated from the corpus's answers."""
    from ..pairs import fingerprint
    from . import corpus as C

    files = list(prompts or ["data/distill_prompts_smollm2-135m.jsonl"])
    for f in [*files, seeds]:
        if "spec_bench" in Path(f).name:
            fail(f"{f}: Spec-Bench is for evaluation only; widen from the seed prompts and the corpus")
    with user_errors():
        known = {C.prompt_key(p): p for p in C.read_prompts([*files, seeds])}
        seed_texts = C.read_prompts([seeds])
        ref = _target_ref(pair, target)
        model, tok = _load_target(ref)
        corpus = C.Corpus(C.corpus_dir(root, fingerprint(model)))
        answers = C.corpus_answers(corpus, tok, known)
        rows = C.widen(tok, answers, seed_texts, n_translate=translate, n_summarize=summarize, n_rag=rag, seed=seed)
    Path(out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    err.print(f"widen: {len(rows)} prompts from {len(answers)} answers ({json.dumps(kinds)}) -> {out}")


def register(app: typer.Typer) -> None:
    """Add ``distill``, ``eval-pair`` and the ``corpus`` command group to ``app``."""
    app.command()(distill)
    app.command("eval-pair")(eval_pair)
    corpus_app = typer.Typer(
        help="The on-policy corpus (data/corpus): the target's own answers, only ever grown.", no_args_is_help=True
    )
    for name, command in (
        ("grow", corpus_grow),
        ("show", corpus_show),
        ("import", corpus_import),
        ("teacher", corpus_teacher),
        ("widen", corpus_widen),
    ):
        corpus_app.command(name)(command)
    app.add_typer(corpus_app, name="corpus")
