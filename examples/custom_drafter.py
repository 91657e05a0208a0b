"""A drafter from outside the package: it proposes the rest of a phrase from a list you give it.

    python examples/custom_drafter.py [--pair NAME] [--max-new-tokens N] [PHRASE ...]

When the text so far ends with the first tokens of one of the phrases, the drafter proposes
the phrase's next tokens; the target verifies them as it verifies any drafter's, so the
output is the target's own greedy text whatever the phrases say (checked below against
the same pair decoding target-only). Good phrases only make it faster.

A drafter is one class behind the seam of ``specdec_llm/engine/drafting/base.py`` plus one
``register_drafter`` call; then a pair may list it (``drafters = ["phrases", "lookup"]``)
and a request may ask for it (``drafter="phrases"``). To make it known to worker processes
and the CLI too, register it from an entry point of your package (group
``specdec_llm.drafters``; see ``specdec_llm/engine/drafting/registry.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Hashable

from specdec_llm.engine import GenerationRequest
from specdec_llm.engine.drafting import FreeDrafter, register_drafter
from specdec_llm.pairs import get_spec, load_pair, quiet_loading
from specdec_llm.settings import get_settings

PHRASES = [
    "speculative decoding",
    "the draft model proposes tokens and the target model verifies them",
    "Once upon a time",
    "in a single forward pass",
]
PROMPTS = [  # each ends with the start of a phrase, so the drafter has something to propose at once
    "In one sentence: with speculative decoding, the draft model",
    "A children's story. Once upon",
    "Why is it fast? The target checks all the drafted tokens in a single",
]


class PhraseDrafter(FreeDrafter):
    """Proposes the continuation of a known phrase: reads token ids only (no model), so its
    proposals cost nothing but their verification. Each token's acceptance is learned per
    bucket (here: how many phrase tokens matched, and the token's place in the proposal)."""

    name = "phrases"

    def __init__(self, phrases: list[list[int]], min_match: int = 2):
        super().__init__(prior=0.5)
        self.phrases = [p for p in phrases if len(p) > min_match]
        self.min_match = min_match

    @classmethod
    def from_text(cls, tokenizer, phrases: list[str]) -> PhraseDrafter:
        """Each phrase tokenized as it appears mid-text (after a space) and at the start."""
        ids = [tokenizer(v, add_special_tokens=False)["input_ids"] for p in phrases for v in (p, " " + p)]
        return cls(ids)

    def continuation(self, row, k: int) -> tuple[list[int], list[Hashable]]:
        seq = row.tokens
        for phrase in self.phrases:
            for m in range(min(len(phrase) - 1, len(seq)), self.min_match - 1, -1):
                if seq[-m:] == phrase[:m]:
                    rest = phrase[m : m + k]
                    return rest, [(min(m, 4), i) for i in range(len(rest))]
        return [], []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phrases", nargs="*", help=f"phrases to propose from (default: {len(PHRASES)} built in)")
    ap.add_argument("--pair", default=None, help="pair name (default: SPECDEC_DEFAULT_PAIR)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    quiet_loading()
    phrases = args.phrases or PHRASES

    # one registration: the factory gets the pair's tokenizer, draft and vocabulary size
    register_drafter("phrases", lambda c: PhraseDrafter.from_text(c.tokenizer, phrases), replace=True)

    spec = get_spec(args.pair or get_settings().default_pair)
    pair = load_pair(dataclasses.replace(spec, drafters=["phrases", "lookup"]))
    dec = pair.decoder()
    same, results = 0, []
    for prompt in PROMPTS:
        ask = {"prompt": prompt, "max_new_tokens": args.max_new_tokens}
        ours = dec.generate(GenerationRequest(**ask, drafter="phrases", k=4))
        plain = dec.generate(GenerationRequest(**ask, mode="baseline"))
        counts = ours.stats.drafter_tokens.get("phrases", {"proposed": 0, "accepted": 0})
        same += ours.token_ids == plain.token_ids
        results.append(ours)
        print(
            f"{prompt[:40]!r:44} phrases proposed {counts['proposed']:3d}, accepted {counts['accepted']:3d}; "
            f"{'identical to' if ours.token_ids == plain.token_ids else 'DIFFERS from'} target-only"
        )
        print("   ", ours.text[:100].replace("\n", " "))
    print(f"{same}/{len(PROMPTS)} outputs token-identical to the target decoding alone")
    proposed = sum(r.stats.drafter_tokens.get("phrases", {}).get("proposed", 0) for r in results)
    return 0 if same == len(PROMPTS) and proposed else 1


if __name__ == "__main__":
    sys.exit(main())
