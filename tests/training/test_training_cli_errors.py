"""``distill`` and ``eval-pair`` refuse bad input with one ``error: <option>: ...`` line and exit
code 2, before any model loads (the loaders are replaced by ones that fail the test)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import specdec_llm.pairs as pairs

DISTILL = ["distill", "--target", "nowhere", "--out", "draft", "--work", "work"]
EVAL = ["eval-pair", "--pair", "smollm2-135m"]


def _files(root):
    (root / "seeds.jsonl").write_text(json.dumps({"prompt": "Write a haiku."}) + "\n")
    (root / "array.jsonl").write_text("[1]\n")
    (root / "bad.jsonl").write_text('{"prompt": "fine"}\n{not json\n')
    (root / "empty.jsonl").write_text("\n")
    (root / "spec_bench_dev.jsonl").write_text(json.dumps({"turns": ["Write a haiku."]}) + "\n")
    (root / "trained" / "ckpt").mkdir(parents=True)
    (root / "trained" / "ckpt" / "state.json").write_text(json.dumps({"step": 2000}))


CASES = [
    ("prompts", [*DISTILL]),  # the default data/distill_seed_prompts.jsonl, run away from the repo root
    ("prompts", [*DISTILL, "--prompts", "missing.jsonl"]),
    ("prompts", [*DISTILL, "--prompts", "array.jsonl"]),
    ("prompt-pool", [*DISTILL, "--prompts", "seeds.jsonl", "--prompt-pool", "missing.jsonl"]),
    ("gen-batch", [*DISTILL, "--prompts", "seeds.jsonl", "--gen-batch", "0"]),
    ("gen-dtype", [*DISTILL, "--prompts", "seeds.jsonl", "--gen-dtype", "float99"]),
    ("device", [*DISTILL, "--prompts", "seeds.jsonl", "--device", "tpu"]),
    ("steps", [*DISTILL, "--prompts", "seeds.jsonl", "--steps", "-1"]),
    ("lr", [*DISTILL, "--prompts", "seeds.jsonl", "--lr", "-1"]),
    ("batch-size", [*DISTILL, "--prompts", "seeds.jsonl", "--batch-size", "0"]),
    ("samples", [*DISTILL, "--prompts", "seeds.jsonl", "--samples", "-1"]),
    ("vocab-subset", [*DISTILL, "--prompts", "seeds.jsonl", "--vocab-subset", "-5"]),
    ("hours", [*DISTILL, "--prompts", "seeds.jsonl", "--hours", "-1"]),
    ("init-from", [*DISTILL, "--prompts", "seeds.jsonl", "--init-from", "no-such-draft"]),
    ("prompts", [*DISTILL, "--prompts", "spec_bench_dev.jsonl"]),  # the benchmark: never trained on
    ("layers", [*DISTILL, "--prompts", "seeds.jsonl", "--layers", "0,0"]),
    ("resume", [*DISTILL[:-1], "trained", "--phase", "train"]),  # a checkpoint, written over without --resume
    ("prompts", [*EVAL, "--prompts", "array.jsonl"]),
    ("prompts", [*EVAL, "--prompts", "bad.jsonl"]),
    ("prompts", [*EVAL, "--prompts", "empty.jsonl"]),
    ("limit", [*EVAL, "--prompts", "seeds.jsonl", "--limit", "0"]),
    ("limit", [*EVAL, "--prompts", "seeds.jsonl", "--limit", "-1"]),
    ("k", [*EVAL, "--prompts", "seeds.jsonl", "--k", "100"]),  # (every row's refusal, after a load)
    ("max_new_tokens", [*EVAL, "--prompts", "seeds.jsonl", "--max-new-tokens", "0"]),
]


@pytest.mark.parametrize("option,args", CASES, ids=[f"{a[0]}-{o}-{i}" for i, (o, a) in enumerate(CASES)])
def test_bad_training_options_are_one_clear_error_before_any_model_loads(option, args, tmp_path, monkeypatch):
    from specdec_llm.cli import app

    def no_model(*_, **__):
        raise AssertionError("a model was loaded before the command line was checked")

    monkeypatch.setattr(pairs, "load_model", no_model)
    monkeypatch.setattr(pairs, "load_pair", no_model)
    monkeypatch.chdir(tmp_path)
    _files(tmp_path)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {option}: "), result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
    if args[-1] == "bad.jsonl":
        assert "bad.jsonl:2: " in result.stderr  # the file's line, not the JSON error's own
