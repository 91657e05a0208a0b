"""A row's output text: decoded from its tokens, cut before the first stop string, and
streamed as it becomes safe (never text that could still turn into a stop string, never a
partial UTF-8 character)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TextCallback = Callable[[str], None]


class TextStream:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, stop: list[str], on_text: TextCallback | None):
        self.tokenizer, self.stop, self.on_text = tokenizer, stop, on_text
        self.text = ""
        self.emitted_chars = 0
        self.error: Exception | None = None  # what the caller's on_text raised (its row then fails alone)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def update(self, out: list[int]) -> int | None:
        """The text of ``out``. When a stop string appears in it, the text is cut before the
        first one and the number of tokens to keep is returned (those whose text fits)."""
        self.text = self.decode(out)
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if not hits:
            return None
        cut = min(hits)
        self.text = self.text[:cut]
        keep = len(out)
        while keep and len(self.decode(out[:keep])) > cut:
            keep -= 1
        return keep

    def send(self, final: bool) -> None:
        """Send newly safe text: hold back what could still become a stop string."""
        if self.on_text is None:
            return
        safe = len(self.text)
        if not final:  # a partial UTF-8 character is not text yet: the hold-back counts from before it
            while safe > self.emitted_chars and self.text[safe - 1] == "\ufffd":
                safe -= 1
            safe -= max((len(s) for s in self.stop), default=1) - 1
        if safe > self.emitted_chars:
            try:
                self.on_text(self.text[self.emitted_chars : safe])
            except Exception as e:  # noqa: BLE001 - the caller's callback: its row ends with this error, the batch goes on
                self.error, self.on_text = e, None
            self.emitted_chars = safe
