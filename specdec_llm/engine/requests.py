"""A request made ready to decode: validated, and its prompt encoded to token ids.

A ``RequestError`` names the field at fault and the fix; nothing else is touched (a bad
row of a batch fails alone). Chat prompts go through chat.py (the template, and refusing
special-token text that could end the turn and inject another).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .chat import render_user_prompt
from .types import GenerationRequest, RequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def encode(tokenizer: PreTrainedTokenizerBase | None, request: GenerationRequest) -> list[int]:
    """The prompt's token ids: as given, a chat turn (``chat=True``) or plain text."""
    if not isinstance(request.prompt, str):
        return list(request.prompt)
    if tokenizer is None:
        raise RequestError("prompt", "this decoder has no tokenizer; pass token ids")
    if request.chat:
        return render_user_prompt(tokenizer, request.prompt)
    return list(tokenizer(request.prompt)["input_ids"])


def prepare(
    request: GenerationRequest,
    tokenizer: PreTrainedTokenizerBase | None,
    drafters: list[str],
    context_length: int,
    vocab_size: int,
) -> list[int]:
    """Validate ``request`` for a decoder with these drafters, context and vocabulary; encode it."""
    request.validate()
    if request.drafter != "auto" and request.drafter not in drafters:
        known = ", ".join(["auto", *drafters])
        raise RequestError("drafter", f"unknown drafter {request.drafter!r} for this pair; use one of: {known}")
    if request.stop and tokenizer is None:  # (stop strings are found in the decoded text)
        raise RequestError("stop", "this decoder has no tokenizer to find stop strings with; leave stop unset")
    prompt = encode(tokenizer, request)
    if len(prompt) >= context_length:
        raise RequestError(
            "prompt",
            f"is {len(prompt)} tokens but the model's context is {context_length}; "
            f"shorten it by at least {len(prompt) - context_length + 1} tokens",
        )
    if any(t >= vocab_size for t in prompt):
        raise RequestError("prompt", f"has token ids outside the vocabulary (size {vocab_size})")
    return prompt
