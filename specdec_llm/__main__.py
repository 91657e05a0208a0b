"""``python -m specdec_llm ...``: the ``specdec-llm`` command (how a local worker is started
with the same interpreter)."""

from .cli import app

if __name__ == "__main__":
    app(prog_name="specdec-llm")
