"""A model drafter from outside the package: the pair's draft run by transformers' own forward
and a ``DynamicCache`` per row. It writes a backend only (feed, crop); the propose loop
(two-level checking, sampling, rollback) is ``specdec_llm.engine.drafting.model``'s. Importing
this registers ``plain-cache``. Run: ``python examples/custom_model_drafter.py [PAIR]``.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from specdec_llm.engine import GenerationRequest
from specdec_llm.engine.drafting import Backend, Forward, ModelDrafter, ModelRow, register_drafter
from specdec_llm.engine.timing import Timer


@dataclass
class PlainRow(ModelRow):
    cache: Any = None  # this row's DynamicCache: its tokens (then drafts) the draft has seen


class PlainCacheBackend(Backend):
    def __init__(self, drafter: ModelDrafter) -> None:
        super().__init__(drafter.name, drafter.context.vocab_size)
        self.model = drafter.model

    @torch.inference_mode()
    def feed(self, rows, inputs, keep):
        logits, forwards = {}, []
        for b, tokens in inputs.items():
            st = rows[b].state[self.name]
            st.cache = st.cache if st.cache is not None else DynamicCache(config=self.model.config)
            with Timer() as t:
                out = self.model(input_ids=torch.tensor([tokens]), cache=st.cache, use_cache=True)
            logits[b] = out.logits[0, -keep[b] :, : self.vocab_size].float()
            st.held += len(tokens)
            forwards.append(Forward({b: len(tokens)}, len(tokens), t.seconds))
        return logits, forwards

    def truncate(self, b, row, n):
        st = row.state[self.name]
        if st.cache is not None and st.held > n:
            st.cache.crop(n - st.held)  # (a negative count: tokens to remove)
        st.held = min(st.held, n)

    def leave(self, b, row):  # its memory goes with it
        row.state[self.name].cache = None


class PlainCacheDrafter(ModelDrafter):
    row_state = PlainRow

    def backend(self, target):
        return PlainCacheBackend(self)


KINDS = ("model", "distilled", "placeholder", "quantized")  # pair drafts that are a causal LM
register_drafter("plain-cache", lambda c: PlainCacheDrafter(c.draft, c, "plain-cache"), draft_kinds=KINDS, replace=True)


def main(pair: str | None = None) -> int:
    from specdec_llm.pairs import get_spec, load_pair
    from specdec_llm.settings import get_settings

    spec = get_spec(pair or get_settings().default_pair)
    dec = load_pair(dataclasses.replace(spec, drafters=["plain-cache", "lookup"])).decoder()
    ask = {"prompt": "Speculative decoding is", "max_new_tokens": 24}
    ours = dec.generate(GenerationRequest(**ask, drafter="plain-cache", k=3))
    same = ours.token_ids == dec.generate(GenerationRequest(**ask, mode="baseline")).token_ids
    print(ours.text, "\n", "identical to" if same else "DIFFERS from", "target-only")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
