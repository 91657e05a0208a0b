"""The engine: pure torch + transformers. Knows nothing of Celery, SQL or LangChain."""

from .decoder import SpeculativeDecoder
from .types import (
    GenerationRequest,
    GenerationResult,
    RequestError,
    Stats,
    expected_speedup,
    expected_tokens_per_iteration,
)

__all__ = [
    "GenerationRequest",
    "GenerationResult",
    "RequestError",
    "SpeculativeDecoder",
    "Stats",
    "expected_speedup",
    "expected_tokens_per_iteration",
]
