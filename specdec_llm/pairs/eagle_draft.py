"""EAGLE drafts: the model (``EagleDraft``), a new one for a target (``build_eagle``) and a
trained one's directory (``load_eagle_dir``). ``specdec_llm/training/eagle.py`` trains them;
the engine's drafter is ``engine/drafting/eagle.py``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..engine import hf
from .drafts import SubsetHead, refuse_other_target, shared_draft
from .spec import DRAFT_META, VOCAB_SUBSET, PairError

KIND = "eagle"
OWN_PREFIXES = ("model.model.layers.", "fuse.", "fc.")  # the draft's own tensors (all else is the target's)


def default_feature_layers(n_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high target layers: ``[1, N//2, N-1]`` (deduplicated for tiny targets)."""
    return list(dict.fromkeys(min(i, n_layers - 1) for i in (1, n_layers // 2, n_layers - 1)))


class EagleDraft(torch.nn.Module):
    """A feature-level draft: ``fuse``, ``fc`` (through :meth:`inputs`) and a one-layer ``model``."""

    def __init__(self, model, feature_layers: list[int]):
        super().__init__()
        hidden = model.config.hidden_size
        self.model = model
        self.feature_layers = list(feature_layers)
        w = model.model.embed_tokens.weight
        self.fuse = torch.nn.Linear(
            len(self.feature_layers) * hidden, hidden, bias=False, device=w.device, dtype=w.dtype
        )
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False, device=w.device, dtype=w.dtype)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def config(self):
        return self.model.config

    def inputs(self, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``[B, W]`` token ids and ``[B, W, H]`` features -> ``[B, W, H]`` inputs_embeds."""
        return self.fc(torch.cat([self.model.model.embed_tokens(ids).to(g.dtype), g], -1))

    def layer(self, u: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None = None, cache=None):
        """The decoder layer on ``inputs_embeds`` ``u`` -> its output ``h`` (before the final norm).

        ``mask``: a 4-D additive mask over the keys (cached ones first), or None for causal;
        ``cache``: a transformers Cache the new keys and values are appended to."""
        kw = {hf.cache_kwarg(type(self.model.model)): cache} if cache is not None else {}
        with hf.layer_outputs(self.model, (0,)) as got:
            self.model.model(
                inputs_embeds=u, attention_mask=mask, position_ids=position_ids, use_cache=cache is not None, **kw
            )
        return got[0]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (``-inf`` outside a SubsetHead's tokens)."""
        return self.model.lm_head(self.model.model.norm(h))

    def subset_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the head's rows only (the subset's tokens, in ``lm_head.ids`` order)."""
        head = self.model.lm_head
        x = self.model.model.norm(h)
        return head.subset_logits(x) if isinstance(head, SubsetHead) else head(x)

    def own_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k.startswith(OWN_PREFIXES)}

    def own_parameters(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self.named_parameters() if n.startswith(OWN_PREFIXES)]


def build_eagle(
    target, feature_layers=None, vocab_subset: torch.Tensor | None = None, init: str = "last"
) -> EagleDraft:
    """A new EAGLE draft for ``target``.

    ``init="last"``: the decoder layer is a copy of the target's last layer; ``"random"``:
    freshly initialised. ``fuse`` starts as the identity on the last listed feature layer
    (zeros on the others) and ``fc`` as ``embed + g``: the layer starts from the target's own
    top hidden state."""
    n = len(target.model.layers)
    layers = list(feature_layers) if feature_layers else default_feature_layers(n)
    if any(not 0 <= i < n for i in layers):
        raise PairError(f"feature layers {layers} out of range: the target has layers 0..{n - 1}")
    if init not in ("last", "random"):
        raise ValueError(f"init {init!r}: use 'last' or 'random'")
    model = shared_draft(target, [n - 1], vocab_subset)
    draft = EagleDraft(model, layers)
    hidden = model.config.hidden_size
    with torch.no_grad():
        if init == "random":
            std = getattr(model.config, "initializer_range", 0.02)
            for p in model.model.layers[0].parameters():
                if p.dim() == 1:  # norms
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std)
        eye = torch.eye(hidden, device=draft.device, dtype=draft.dtype)
        draft.fuse.weight.zero_()
        draft.fuse.weight[:, -hidden:] = eye
        draft.fc.weight.copy_(torch.cat([eye, eye], 1))
    for p in draft.parameters():
        p.requires_grad_(False)
    return draft.eval()


def load_eagle_dir(path: Path, target, target_fp: str) -> tuple[EagleDraft, dict]:
    """Load an EAGLE draft directory against ``target`` (cast to its dtype, on its device);
    refuse a draft trained for another target."""
    meta = json.loads((path / DRAFT_META).read_text())
    if meta.get("kind") != KIND:
        raise PairError(f"draft {path} is not an EAGLE draft (kind {meta.get('kind', 'distilled')!r})")
    refuse_other_target(
        meta, path, target_fp, "EAGLE draft", "trained", "train a new one (specdec-llm distill --kind eagle)"
    )
    from safetensors.torch import load_file

    own = load_file(str(path / "draft.safetensors"))
    subset = own.pop(VOCAB_SUBSET, None)
    draft = build_eagle(target, meta["feature_layers"], subset)
    missing = draft.load_state_dict({k: v.to(draft.dtype) for k, v in own.items()}, strict=False)
    expected = set(draft.own_state())
    bad = sorted(expected & set(missing.missing_keys))
    if bad or missing.unexpected_keys:
        raise PairError(
            f"EAGLE draft {path}: tensors do not fit the target (missing {bad[:3]}, "
            f"unexpected {missing.unexpected_keys[:3]})"
        )
    return draft.eval(), meta
