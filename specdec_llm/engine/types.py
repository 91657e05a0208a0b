"""Plain data at the engine's boundary: requests, results, per-request telemetry.

Everything here is JSON-able (``dataclasses.asdict``) so workers, the store and the
LangChain integration pass it around without touching tensors or ORM objects.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..errors import SpecDecError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# "cancelled": the caller stopped the row mid-way (BatchServer.submit's stop); its text is partial
FinishReason = Literal["eos", "stop", "length", "context", "cancelled"]

SCHEMES = ("int4", "int8", "fp8")  # a quantized draft's schemes: draft = "quantized:SCHEME" (quant.py)
AUTO = "auto"  # max_batch: the batch size with the most tokens/s on this machine, up to AUTO_CAP
AUTO_CAP = 32


def parse_max_batch(value: int | str) -> int | str:
    """A batch size as given (an integer >= 1, "auto" or "auto:N"), normalized: an int, "auto"
    or "auto:N". ValueError saying what is accepted otherwise."""
    text = str(value).strip().lower()
    name, colon, cap = text.partition(":")
    try:
        n = int(text if name != AUTO else cap if colon else AUTO_CAP)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(
            f"{value!r} is not a batch size; use an integer >= 1, {AUTO!r} (the fastest size up to "
            f"{AUTO_CAP}) or '{AUTO}:N' (the fastest up to N)"
        )
    return n if name != AUTO else f"{AUTO}:{n}" if colon else AUTO


def auto_cap(max_batch: int | str) -> int | None:
    """The most rows an automatic batch size may take ("auto": AUTO_CAP, "auto:N": N); None
    for a fixed size."""
    value = parse_max_batch(max_batch)
    return None if isinstance(value, int) else int(value.partition(":")[2] or AUTO_CAP)


class RequestError(SpecDecError, ValueError):
    """Bad input. ``field`` names the offending parameter; the message says the fix."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class GenerationRequest:
    """One generation. ``prompt`` is text (or token ids); ``chat`` wraps text as a user turn."""

    prompt: str | list[int]
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    k: int | Literal["auto"] = "auto"
    stop: list[str] = field(default_factory=list)
    chat: bool = False
    mode: Literal["speculative", "baseline"] = "speculative"
    drafter: str = "auto"  # "auto": the pair's drafters, chosen per iteration; or one drafter's name
    scope: str | None = None  # requests of one scope share what the suffix drafter learns (a job id)
    # a grammar every emitted token satisfies (grammar.py): {"type": "json_schema", "json_schema":
    # {"schema": {...}}}, {"type": "json_object"}, {"type": "regex", ...} or {"type": "grammar", ...}
    response_format: dict[str, Any] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise RequestError naming the first bad field (context length is checked by the engine)."""
        p = self.prompt
        if isinstance(p, str):
            if not p.strip():
                raise RequestError("prompt", "is empty; pass some text to continue")
            check_unicode(p, "prompt")
        elif isinstance(p, (list, tuple)):
            if not p:
                raise RequestError("prompt", "has no tokens; pass at least one token id")
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
                raise RequestError("prompt", "token ids must be non-negative integers")
        else:
            raise RequestError("prompt", f"must be text or a list of token ids, not {type(p).__name__}")
        _int(self.max_new_tokens, "max_new_tokens", lo=1, hint="ask for at least 1 new token")
        _float(self.temperature, "temperature", "must be >= 0 (0 = greedy)", lambda x: x >= 0)
        _float(self.top_p, "top_p", "must be in (0, 1] (1 = off)", lambda x: 0 < x <= 1)
        _int(self.top_k, "top_k", lo=0, hint="use 0 to turn top-k off")
        if self.seed is not None:
            _int(self.seed, "seed", lo=0, hint="use a non-negative integer or leave it unset")
            check_seed(self.seed)
        if self.k != "auto":
            _int(self.k, "k", lo=0, hint='use 0 (target only), a positive draft length, or "auto"')
            if self.k > 64:
                raise RequestError("k", f'{self.k} is too large; use at most 64 or "auto"')
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("stop", "must be a list of non-empty strings")
        for s in self.stop:
            check_unicode(s, "stop")
        if self.mode not in ("speculative", "baseline"):
            raise RequestError("mode", f"unknown mode {self.mode!r}; use 'speculative' or 'baseline'")
        if not isinstance(self.drafter, str) or not self.drafter:
            raise RequestError("drafter", f'must be a drafter\'s name or "auto", got {self.drafter!r}')
        if self.scope is not None and (not isinstance(self.scope, str) or len(self.scope) > 200):
            raise RequestError("scope", "must be a string of at most 200 characters, or unset")
        if not isinstance(self.chat, bool):
            raise RequestError("chat", f"must be true or false, got {self.chat!r}")
        if self.chat and not isinstance(p, str):
            raise RequestError("chat", "needs a text prompt, not token ids")
        if self.response_format is not None:
            check_response_format(self.response_format)


FORMAT_FIELD = "response_format"
FORMAT_KINDS = ("json_schema", "json_object", "regex", "grammar")


def check_response_format(fmt: object) -> None:
    """``response_format``'s shape, and that its grammar is valid (no tokenizer needed: a job
    refuses a bad schema at submit instead of failing every row; grammar.py compiles it)."""
    if not isinstance(fmt, dict):
        raise RequestError(FORMAT_FIELD, f'must be an object such as {{"type": "json_object"}}, got {fmt!r}')
    kind = fmt.get("type")
    if kind not in FORMAT_KINDS:
        raise RequestError(FORMAT_FIELD, f"unknown type {kind!r}; use one of {', '.join(FORMAT_KINDS)}")
    if kind == "json_schema":
        response_schema(fmt)
    elif kind in ("regex", "grammar") and not (isinstance(fmt.get(kind), str) and fmt[kind]):
        raise RequestError(FORMAT_FIELD, f'type {kind!r} needs a non-empty string "{kind}"')
    try:
        problem = _grammar_problem(json.dumps(fmt))
    except (TypeError, ValueError) as e:  # (a value JSON cannot hold: NaN is refused elsewhere)
        problem = str(e)
    if problem:
        raise RequestError(FORMAT_FIELD, f"{kind} does not compile: {' '.join(problem.split())[:400]}")  # one line


# JSON as json.dumps writes it (", " and ": ", no other whitespace): what models write most, and
# every separator a forced token; a schema's "x-guidance" object overrides these
JSON_STYLE: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(key: str) -> str:
    """The llguidance grammar of a format (its JSON text: ``key``); the grammar engine is llguidance's."""
    from llguidance import LLMatcher

    fmt = json.loads(key)
    kind = fmt["type"]
    if kind in ("json_schema", "json_object"):
        schema = response_schema(fmt) if kind == "json_schema" else {"type": "object"}
        return str(LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE))
    if kind == "regex":
        return str(LLMatcher.grammar_from_regex(fmt["regex"]))
    return str(LLMatcher.grammar_from_lark(fmt["grammar"]))


@functools.lru_cache(maxsize=256)  # a job's rows share their format
def _grammar_problem(key: str) -> str:
    """Why a format's grammar is invalid; "" when it is valid."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.validate_grammar(grammar_text(key))
    except (ValueError, RuntimeError) as e:
        return str(e)


def response_schema(fmt: dict[str, Any]) -> dict[str, Any]:
    inner = fmt.get("json_schema", fmt)
    schema = inner.get("schema") if isinstance(inner, dict) else None
    if not isinstance(schema, dict):
        raise RequestError(
            FORMAT_FIELD, 'json_schema needs {"json_schema": {"schema": {...}}} with the schema as an object'
        )
    return schema


def check_unicode(text: str, name: str) -> None:
    """Text a tokenizer (and every store) can take: valid Unicode, no unpaired surrogate
    such as "\\ud800". The one such check: prompts, stop strings, job rows, chat turns."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            name,
            f"is not valid Unicode: an unpaired surrogate (\\u{ord(text[e.start]):04x}) at "
            f"character {e.start}; remove it",
        ) from None


MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 0 .. 2**64 - 1


def check_seed(seed: object, field: str = "seed") -> None:
    """A seed torch can take (else a raw ``ValueError: Overflow when unpacking long long`` deep
    in generation); checked where a request is made, and where only its parameters are."""
    if isinstance(seed, int) and not isinstance(seed, bool) and seed > MAX_SEED:
        raise RequestError(
            field, f"{seed} is above {MAX_SEED} (2**64 - 1, the largest seed there is); use a smaller one"
        )


def _int(value: object, name: str, lo: int, hint: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(name, f"must be an integer, got {value!r}")
    if value < lo:
        raise RequestError(name, f"{value} is below {lo}; {hint}")


def _float(value: object, name: str, rule: str, ok: Callable[[float], bool]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(name, f"must be a number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer past a float's range
        finite = False
    if not finite:
        shown = repr(value) if len(repr(value)) <= 24 else f"{repr(value)[:12]}... ({len(repr(value))} digits)"
        raise RequestError(name, f"{shown} is not a finite number; it {rule}")
    if not ok(value):
        raise RequestError(name, f"{value!r} {rule}")


@dataclass
class Stats:
    """Per-request telemetry. vLLM's metric names in parentheses where they differ."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    draft_tokens_proposed: int = 0  # (num_draft_tokens)
    draft_tokens_accepted: int = 0  # (num_accepted_tokens)
    acceptance_rate: float = 0.0  # accepted / proposed
    mean_accepted_length: float = 0.0  # tokens emitted per target forward, bonus included
    per_position_acceptance: list[float] = field(default_factory=list)  # P(accept at draft position i)
    target_forwards: int = 0
    draft_forwards: int = 0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    wall_time_s: float = 0.0
    time_to_first_token_s: float = 0.0
    tokens_per_s: float = 0.0
    k_values: list[int] = field(default_factory=list)  # tokens proposed at each iteration
    # drafter -> {"proposed", "accepted", "drafts" (iterations it drafted in), "accepted_per_position"}
    drafter_tokens: dict[str, dict[str, Any]] = field(default_factory=dict)
    drafter: str = "none"  # the drafter that proposed the most tokens ("none": plain decoding)
    batch_rows: float = 1.0  # mean number of requests decoding beside it (itself included) per iteration
    # Seconds the request would have taken decoding target-only in the same process: its time
    # outside its iterations as it was, plus each token at the target-only step cost this
    # process measured at the same batch size (costs.CostModel, kept current by k = 0
    # iterations and probes). The basis of ``speedup`` (SPEEDUP_BASIS).
    baseline_s: float = 0.0
    finish_reason: FinishReason = "length"

    @property
    def speedup(self) -> float | None:
        """Target-only time over the time taken (``baseline_s / wall_time_s``)."""
        return self.baseline_s / self.wall_time_s if self.wall_time_s > 0 and self.baseline_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SPEEDUP_BASIS = "same-process target-only step cost at the same batch size"


@dataclass
class GenerationResult:
    """``complete``: for a row with a ``response_format``, whether its text is a whole sentence
    of the grammar (False: it ran out of tokens first); None without one."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: Stats
    complete: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
            **({} if self.complete is None else {"complete": self.complete}),
        }

    def incomplete(self) -> str | None:
        """Why a constrained row's output cannot be used (None: it can), said of ``response_format``."""
        if self.complete is not False:
            return None
        why = CUT_SHORT.get(self.finish_reason or "", f"it ended ({self.finish_reason}); raise max_new_tokens")
        return f"the output is not complete after {len(self.token_ids)} tokens: {why}"


# why an output ended before it was whole, by its finish reason, and the fix: a constrained
# row's error (``GenerationResult.incomplete``), and a structured reply's that does not parse
CUT_SHORT = {
    "length": "max_new_tokens cut it short; raise max_new_tokens",
    "context": "the prompt and output filled the pair's context; shorten the prompt or ask for a shorter output",
    "stop": "a stop string cut it short; drop that stop string",
}


def expected_tokens_per_iteration(acceptance: float, k: int) -> float:
    """E = (1 - a^(k+1)) / (1 - a): tokens emitted per target forward (Leviathan et al., eq. 1)."""
    if k <= 0:
        return 1.0
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def expected_speedup(acceptance: float, k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Closed-form speedup over target-only decoding.

    ``cost_ratio`` c = draft step time / target step time; ``verify_cost`` T(k) = time of one
    target forward over k+1 tokens / time of a 1-token target forward (1 on a GPU; measure it
    on a CPU). speedup = E / (k*c + T(k)).
    """
    return expected_tokens_per_iteration(acceptance, k) / (k * cost_ratio + verify_cost)
