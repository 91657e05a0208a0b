"""The drafter seam's registration: a drafter from outside the package is one class and one
``register_drafter`` call (or an entry point), known to the decoder and the pairs' checks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import tiny_llama

from specdec_llm.engine import GenerationRequest, SpeculativeDecoder
from specdec_llm.engine.drafting.base import DraftContext
from specdec_llm.engine.drafting.free import FreeDrafter
from specdec_llm.engine.drafting.registry import build, check, defaults, known, register_drafter, unregister_drafter

ROOT = Path(__file__).resolve().parents[1]


class Echo(FreeDrafter):
    """Proposes the row's first tokens again (often wrong: the verification decides)."""

    name = "echo"

    def continuation(self, row, k):
        tokens = row.tokens[:k]
        return tokens, list(range(len(tokens)))


@pytest.fixture
def echo():
    register_drafter("echo", lambda c: Echo(), replace=True)
    yield
    unregister_drafter("echo")


def test_builtin_names_and_defaults():
    assert known()[:5] == ["lookup", "suffix", "model", "quantized", "eagle"]
    assert defaults("none") == ["lookup", "suffix"]
    assert defaults("quantized") == ["lookup", "suffix", "quantized"]
    assert defaults("distilled") == ["lookup", "suffix", "model"]
    assert defaults("eagle") == ["lookup", "suffix", "eagle"]
    assert check(["model"], "quantized") == (
        "drafter 'model' needs a draft model; set draft = ... or drop it "
        "(this draft is of kind quantized: use drafter 'quantized')"
    )
    assert check(["medusa"], "none").startswith("unknown drafter 'medusa'; known drafters: lookup, suffix")


def test_bad_registrations_are_refused():
    with pytest.raises(ValueError, match="registered already"):
        register_drafter("lookup", lambda c: Echo())
    for bad in ("", "auto", "a b", "x/y", "d" * 33):  # (33: longer than the store keeps a drafter name)
        with pytest.raises(ValueError, match="drafter name"):
            register_drafter(bad, lambda c: Echo())


def test_a_drafter_registered_under_another_name_than_its_own_is_refused_when_built():
    register_drafter("echo2", lambda c: Echo(), replace=True)
    try:
        with pytest.raises(
            ValueError, match="drafter 'echo2' is registered with a factory whose drafter is named 'echo'"
        ):
            build(["echo2"], DraftContext(None, 256))
    finally:
        unregister_drafter("echo2")


def test_a_registered_drafter_decodes_greedy_identical(echo):
    target = tiny_llama(1)
    dec = SpeculativeDecoder(target, drafters=["echo", "lookup"])
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    ours = dec.generate(GenerationRequest(prompt=prompt, max_new_tokens=24, drafter="echo", k=3))
    plain = dec.generate(GenerationRequest(prompt=prompt, max_new_tokens=24, mode="baseline"))
    assert ours.token_ids == plain.token_ids
    assert ours.stats.drafter_tokens["echo"]["proposed"] > 0
    assert [d.name for d in build(["echo"], DraftContext(None, 256))] == ["echo"]
    assert check(["echo", "lookup"], "none") is None and "echo" not in defaults("none")


def test_a_pairs_file_names_a_drafter_from_an_entry_point(tmp_path, tiny_pair_dir):
    """A package that declares a ``specdec_llm.drafters`` entry point (a real dist-info on the
    path of a fresh interpreter): its drafter is known before any import of it, so a pairs
    file may list it and a decoder built from the pair uses it."""
    (tmp_path / "echo_drafter.py").write_text(
        textwrap.dedent("""
        from specdec_llm.engine.drafting import FreeDrafter, register_drafter

        class Echo(FreeDrafter):
            name = "echo"

            def continuation(self, row, k):
                return row.tokens[:k], list(range(min(k, len(row.tokens))))

        def register():
            register_drafter("echo", lambda c: Echo())

        def broken():
            raise RuntimeError("a plugin's own bug")
        """)
    )
    info = tmp_path / "echo_drafter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-drafter\nVersion: 0.1\n")
    # (a broken plugin listed first: it took every drafter lookup down, then hid the plugins after it)
    (info / "entry_points.txt").write_text(
        "[specdec_llm.drafters]\nbroken = echo_drafter:broken\necho = echo_drafter:register\n"
    )
    pairs = tmp_path / "pairs.toml"
    pairs.write_text(f'[pairs.tiny-echo]\ntarget = "{tiny_pair_dir / "target"}"\ndrafters = ["echo", "lookup"]\n')
    script = textwrap.dedent("""
        import sys
        from specdec_llm.engine import GenerationRequest
        from specdec_llm.pairs import load_pair
        assert "echo_drafter" not in sys.modules
        dec = load_pair("tiny-echo").decoder()
        ours = dec.generate(GenerationRequest(prompt=[5, 6, 7, 5, 6], max_new_tokens=12, drafter="echo", k=2))
        plain = dec.generate(GenerationRequest(prompt=[5, 6, 7, 5, 6], max_new_tokens=12, mode="baseline"))
        assert ours.token_ids == plain.token_ids
        print("ok", dec.drafter_names, ours.stats.drafter_tokens["echo"]["proposed"])
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]),
        SPECDEC_CONFIG_FILE=str(pairs),
        SPECDEC_DATA_DIR=str(tmp_path / "data"),
        SPECDEC_THREADS="1",
    )
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "the drafter entry point 'broken' (echo_drafter:broken) failed" in res.stderr
    assert res.stdout.startswith("ok ['echo', 'lookup', 'grammar']"), (
        res.stdout
    )  # (every speculative decoder has 'grammar')
