"""Moved to ``specdec_llm.engine.chat`` (rendering a chat prompt is the engine's work); this
name stays for existing imports (``engine/decoder.py`` still uses it)."""

from .engine.chat import check_turn_text, render_chat, render_user_prompt, special_tokens

__all__ = ["check_turn_text", "render_chat", "render_user_prompt", "special_tokens"]
