"""The engine: pure torch + transformers. Knows nothing of Celery, SQL or LangChain."""

from typing import TYPE_CHECKING, Any

from .types import (
    CUT_SHORT,
    SPEEDUP_BASIS,
    GenerationRequest,
    GenerationResult,
    RequestError,
    Stats,
    expected_speedup,
    expected_tokens_per_iteration,
)

if TYPE_CHECKING:
    from .decoder import SpeculativeDecoder


def __getattr__(name: str) -> Any:
    """The decoder (torch, transformers: seconds to import) loads on first use, so a command
    that only reads the store (``specdec-llm status``) starts at once."""
    if name == "SpeculativeDecoder":
        from .decoder import SpeculativeDecoder

        return SpeculativeDecoder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CUT_SHORT",
    "SPEEDUP_BASIS",
    "GenerationRequest",
    "GenerationResult",
    "RequestError",
    "SpeculativeDecoder",
    "Stats",
    "expected_speedup",
    "expected_tokens_per_iteration",
]
