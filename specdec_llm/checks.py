"""Request checks made outside the engine, for every path into it (CLI ``generate``, job
rows, the worker, LangChain): a seed torch can take, and text that every store keeps the
same. (Candidates for ``GenerationRequest.validate``.)

- ``seed`` above 2**64 - 1: torch cannot seed with it (a raw ``ValueError: Overflow when
  unpacking long long`` deep in generation otherwise).
- Text with a NUL character: PostgreSQL text cannot hold NUL, so a stored prompt would
  become U+FFFD there while SQLite keeps it, and the same job would generate different
  text on the two stores. Refused, naming where it is.
- Text with an unpaired surrogate ("\\ud800"): not valid Unicode, no store or tokenizer takes it.
"""

from __future__ import annotations

from .engine.types import RequestError, check_unicode

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 0 .. 2**64 - 1


def check_seed(seed, field: str = "seed") -> None:
    if isinstance(seed, int) and not isinstance(seed, bool) and seed > MAX_SEED:
        raise RequestError(
            field, f"{seed} is above {MAX_SEED} (2**64 - 1, the largest seed there is); use a smaller one"
        )


def check_text(text, field: str) -> None:
    """RequestError when ``text`` (if it is text) has an unpaired surrogate or a NUL."""
    if not isinstance(text, str):
        return
    check_unicode(text, field)
    nul = text.find("\x00")
    if nul >= 0:
        raise RequestError(
            field,
            f"contains a NUL character (\\x00) at character {nul}; remove it "
            "(PostgreSQL cannot store NUL, so no store accepts it)",
        )


def check_messages(messages) -> None:
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(m, dict):
            for key in ("role", "content"):
                check_text(m.get(key), f"messages[{i}].{key}")
