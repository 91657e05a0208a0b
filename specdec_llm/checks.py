"""Request checks made outside the engine, for every path into it (CLI ``generate``, job
rows, the worker, LangChain), on parameters before a request is made of them:

- Text with a NUL character: PostgreSQL text cannot hold NUL, so a stored prompt would
  become U+FFFD there while SQLite keeps it, and the same job would generate different
  text on the two stores. Refused, naming where it is.
- Text with an unpaired surrogate ("\\ud800"): not valid Unicode, no store or tokenizer takes it.
"""

from __future__ import annotations

from .engine.types import RequestError, check_unicode

__all__ = ["check_messages", "check_text"]


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
