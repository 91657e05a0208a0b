"""``eval-pair``'s evaluation (``training/evaluate.py``) on the tiny pair."""

from __future__ import annotations

from specdec_llm.pairs import PairSpec, load_pair
from specdec_llm.training.evaluate import evaluate


def test_a_prompt_over_the_context_is_skipped_and_the_others_still_count(tiny_pair_dir):
    """It aborted the whole evaluation after the earlier prompts were decoded."""
    pair = load_pair(PairSpec(name="tiny", target=str(tiny_pair_dir / "target"), draft=str(tiny_pair_dir / "draft")))
    rows = [
        {"prompt": "The quick brown fox", "category": "a"},
        {"prompt": " ".join(f"zq{i}" for i in range(600)), "category": "a"},
        {"prompt": "The lazy dog", "category": "b"},
    ]
    report = evaluate(pair.decoder(), rows, max_new_tokens=4, k=2)
    assert report["overall"]["prompts"] == 2 and set(report["categories"]) == {"a", "b"}
    [skipped] = report["skipped"]
    assert skipped.startswith("prompt 2: prompt: is ") and "context is 512" in skipped
