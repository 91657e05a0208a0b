"""A KV cache for a batch of rows that each hold a different number of valid tokens.

Rows join (their own prefill, merged in), leave, and roll back different numbers of
rejected drafts. Instead of shifting tensors every iteration, a rolled-back position
becomes a *hole*: a cache column that row no longer attends to. ``valid`` [B, L] says
which columns each row sees; a row's logical positions (RoPE) count its valid columns
only, so holes change nothing in what a row computes. Columns that no row uses are
cropped from the end after each iteration, and ``compact`` squeezes holes out when they
outnumber the tokens, so the cache stays close to the longest row. The tensors live in
``hf.GrowingLayer`` buffers with spare columns: a step writes its new columns only, rows
that join are copied in once per burst, and a row that leaves is replaced by a row from
the end (the batch orders them so; only moved rows are copied).

Each forward feeds one chunk of new tokens per row, LEFT-padded to a common width, so
every row's last token sits in the last column. A padding query attends to itself only
and nothing attends to it, so padding never produces NaNs nor leaks into real rows.
With one row and no holes (single-request decoding) the forward is the plain causal one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers import PreTrainedModel

from . import hf, lean, tree
from .attention import Attention
from .timing import Timer


class RaggedCache:
    """``features``: decoder layers whose outputs each forward also returns, in
    ``last_features`` [B, W, n*H] (a feature-level draft reads the target's)."""

    def __init__(self, model: PreTrainedModel, rows: int = 0, features: tuple[int, ...] = ()) -> None:
        self.model = model
        self.cache = hf.new_cache(model)
        self.attention = Attention.of(model)
        hf.alibi_from_masks(model)  # (Bloom: its position bias from this cache's masks)
        self.valid = torch.zeros(rows, 0, dtype=torch.bool)
        self.features = features
        self.last_features: torch.Tensor | None = None

    @classmethod
    def filled(cls, model: PreTrainedModel, rows: int, ids: list[int]) -> RaggedCache:
        """``rows`` identical rows holding ``ids``, from one row's prefill (calibration: a
        batch of 32 prefilled row by row cost more than timing its forwards)."""
        one = cls(model, 1)
        one.forward([ids], 1)
        cache = cls(model, 0)
        cache.extend([one] * rows)
        cache.valid = cache.valid.clone()  # (a normal tensor, as a forward leaves it, not an inference one)
        return cache

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    # -- forward ------------------------------------------------------------------------
    def forward(
        self,
        inputs: list[list[int]],
        keep: int,
        embeds: list[torch.Tensor] | None = None,
        trees: dict[int, list[int]] | None = None,
        sees: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Append one chunk per row (a row may feed nothing); logits of the last ``keep`` columns [B, keep, V].
        ``embeds``: per row [len(chunk), H], the inputs instead of the tokens' embeddings.
        ``trees``: row -> the parents of its chunk's tokens after the first (tree.py): each
        sees its ancestors only, at its depth's position; the rejected branches are dropped after.
        ``sees``: row -> (past [n, width], chunk [n, n]), what each of its n chunk tokens attends
        to among the cache's columns and the chunk (a draft's tree whose branches were fed by
        earlier forwards: each token sees its ancestors and itself); its position is the number
        of keys it sees, less one."""
        assert len(inputs) == self.rows and any(inputs)
        w = max(len(x) for x in inputs)
        ids = torch.tensor([[0] * (w - len(x)) + list(x) for x in inputs], dtype=torch.long)
        padded = None
        if embeds is not None:
            like = next(e for e in embeds if len(e))
            padded = like.new_zeros(len(inputs), w, like.shape[-1])
            for b, e in enumerate(embeds):
                if len(e):
                    padded[b, w - len(e) :] = e
        new = torch.tensor([[False] * (w - len(x)) + [True] * len(x) for x in inputs], dtype=torch.bool)
        mask: Any = None
        positions = None
        if self.attention.window or trees or sees or not bool(new.all()) or not bool(self.valid.all()):
            mask, positions = self._mask(new, trees or {}, sees or {})
        logits, self.last_features = hf.forward_rows(
            self.model, ids, self.cache, keep, mask, positions, padded, self.features
        )
        self.valid = torch.cat([self.valid, new], 1)
        return logits

    def _mask(
        self, new: torch.Tensor, trees: dict[int, list[int]], sees: dict[int, tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[Any, torch.Tensor]:
        """The attention mask and positions of a forward feeding ``new`` [B, W] (forward's args)."""
        w, window = new.shape[1], self.attention.window
        start = self.valid.sum(1, keepdim=True)
        positions = (start + new.long().cumsum(1) - 1).clamp_min(0)
        causal = torch.ones(w, w, dtype=torch.bool).tril()
        eye = torch.eye(w, dtype=torch.bool)
        chunk = (causal[None] & new[:, None, :]) | eye[None]  # [B, W(query), W(key)]
        for b, parents in trees.items():
            lo = w - len(parents) - 1
            chunk[b, lo:, lo:] = tree.ancestry(parents)
            positions[b, lo:] = start[b, 0] + torch.tensor([0, *tree.depths(parents)])
        past = self.valid[:, None, :].expand(-1, w, -1)
        if sees:
            past = past.clone()
            for b, (before, mine) in sees.items():
                n = len(mine)
                past[b, w - n :], chunk[b, w - n :, w - n :] = before, mine
                positions[b, w - n :] = before.sum(-1) + mine.sum(-1) - 1
        mask = torch.cat([past, chunk], -1)[:, None]
        if window:  # a sliding layer's query sees the keys less than `window` positions back
            keys = torch.cat([self.valid.long().cumsum(1) - 1, positions], 1)  # [B, L + W] (holes: masked)
            near = (positions[:, :, None] - keys[:, None, :]) < window
            mask = self.attention.masks(mask.to(self.model.device), (mask & near[:, None]).to(self.model.device))
        else:
            mask = mask.to(self.model.device)
        return mask, positions.to(self.model.device)

    # -- rollback and housekeeping ------------------------------------------------------------
    def drop(self, row: int, columns: Iterable[int]) -> None:
        """Make ``columns`` (absolute indices) holes for ``row``."""
        self.valid[row, list(columns)] = False

    @torch.inference_mode()
    def keep_rows(self, index: list[int]) -> None:
        """Keep the rows at ``index`` (new row i = old row index[i]); only moved rows are copied."""
        moved = [(dst, src) for dst, src in enumerate(index) if dst != src]
        for layer in self._live_layers():
            if moved:
                bufs = layer.bufs
                dst = torch.tensor([d for d, _ in moved], device=bufs[0].device)
                src = torch.tensor([s for _, s in moved], device=bufs[0].device)
                for buf in bufs:
                    region = buf[:, :, : self.width]
                    region.index_copy_(0, dst, region.index_select(0, src))  # the source is read first
            layer.view(len(index), self.width)
        self.valid = self.valid[torch.tensor(index, dtype=torch.long)]

    def trim(self) -> None:
        """Crop columns no row uses from the end (the other columns keep their indices)."""
        used = self.valid.any(0).nonzero()
        end = int(used[-1]) + 1 if len(used) else 0
        if end < self.width:
            self.crop(end)

    def tidy(self) -> None:
        """Crop columns no row uses from the end; squeeze holes out when they dominate."""
        self.trim()
        longest = int(self.valid.sum(1).max()) if self.rows else 0
        if self.width > 32 and self.width > 2 * longest:
            self.compact()

    @torch.inference_mode()
    def crop(self, width: int) -> None:
        for layer in self._live_layers():
            layer.view(self.rows, width)
        self.valid = self.valid[:, :width]

    @torch.inference_mode()
    def compact(self) -> None:
        """Move every row's valid columns to the front (order kept); width = longest row."""
        longest = int(self.valid.sum(1).max())
        order = torch.sort((~self.valid).long(), dim=1, stable=True).indices[:, :longest]  # valid columns first
        for layer in self._live_layers():
            k, v = layer.keys, layer.values
            idx = order.to(k.device)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            k, v = k.gather(2, idx), v.gather(2, idx)
            kbuf, vbuf = layer.bufs
            kbuf[: self.rows, :, :longest] = k
            vbuf[: self.rows, :, :longest] = v
            layer.view(self.rows, longest)
        self.valid = torch.arange(longest)[None, :] < self.valid.sum(1, keepdim=True)

    @torch.inference_mode()
    def extend(self, others: list[RaggedCache]) -> None:
        """Append the rows of ``others`` (newly prefilled requests) below this cache's rows."""
        if not others:
            return
        rows = self.rows + sum(o.rows for o in others)
        width = max(self.width, *(o.width for o in others))
        for i, layer in enumerate(hf.layers(self.cache)):
            theirs = [hf.layers(o.cache)[i] for o in others]
            like = next((x.bufs for x in [layer, *theirs] if x.kbuf is not None), None)
            if like is None:
                continue
            kbuf, vbuf = layer.reserve(rows, width, *like)
            r = self.rows
            for other, x in zip(others, theirs):
                if x.kbuf is not None and other.width:
                    kbuf[r : r + other.rows, :, : other.width] = x.keys
                    vbuf[r : r + other.rows, :, : other.width] = x.values
                r += other.rows
            layer.view(rows, width)

        def pad(v: torch.Tensor) -> torch.Tensor:
            return torch.cat([v, torch.zeros(v.shape[0], width - v.shape[1], dtype=torch.bool)], 1)

        self.valid = torch.cat([pad(v.valid) for v in (self, *others)])

    @torch.inference_mode()
    def fill_row(self, row: int, own: RaggedCache) -> None:
        """Replace ``row``'s content by ``own``'s single row (a fresh prefill), at the front."""
        width = max(self.width, own.width)
        for mine, theirs in zip(hf.layers(self.cache), hf.layers(own.cache)):
            if theirs.kbuf is None:
                continue
            kbuf, vbuf = mine.reserve(self.rows, width, *theirs.bufs)
            kbuf[row, :, : own.width] = theirs.keys[0]
            vbuf[row, :, : own.width] = theirs.values[0]
            mine.view(self.rows, width)
        valid = torch.zeros(self.rows, width, dtype=torch.bool)
        valid[:, : self.width] = self.valid
        valid[row] = False
        valid[row, : own.width] = own.valid[0]
        self.valid = valid

    @torch.inference_mode()
    def append_from(self, src: RaggedCache, spans: dict[int, tuple[int, int]]) -> None:
        """Append to each row ``b`` the keys and values of ``src``'s row ``b`` at its valid
        positions ``spans[b] = (start, end)`` (its logical positions, counted in valid columns),
        as a forward of those tokens would have: new columns, left-padded, holes for the
        other rows. ``src`` must be a cache of a model with this one's layers (a quantized
        copy of it: quant.py), rows aligned with this cache's."""
        spans = {b: s for b, s in spans.items() if s[1] > s[0]}
        if not spans:
            return
        w, width = max(e - s for s, e in spans.values()), self.width
        where = {b: src.valid[b].nonzero()[s:e, 0] for b, (s, e) in spans.items()}  # source columns
        for mine, theirs in zip(hf.layers(self.cache), hf.layers(src.cache)):
            if theirs.kbuf is None:
                continue
            kbuf, vbuf = mine.reserve(self.rows, width + w, *theirs.bufs)
            for b, cols in where.items():
                at = slice(width + w - len(cols), width + w)
                kbuf[b, :, at] = theirs.keys[b].index_select(1, cols.to(kbuf.device))
                vbuf[b, :, at] = theirs.values[b].index_select(1, cols.to(vbuf.device))
            mine.view(self.rows, width + w)
        new = torch.zeros(self.rows, w, dtype=torch.bool)
        for b, cols in where.items():
            new[b, w - len(cols) :] = True
        self.valid = torch.cat([self.valid, new], 1)

    def _live_layers(self) -> list[hf.GrowingLayer]:
        return [layer for layer in hf.layers(self.cache) if layer.kbuf is not None]


def unservable(model: PreTrainedModel) -> str | None:
    """Why this engine cannot decode ``model`` (None: it can), found by doing what decoding
    does on a one-row cache: a prefill, a rollback (a hole) and a masked step. A family whose
    cache is not attention keys and values (Mamba's states, for one) fails here, at load,
    instead of in the middle of a request."""
    if lean.supported(model):  # a family the lean forward serves, each tested against transformers': known to decode
        return (
            None  # (and probing it would build that forward, fusing and tuning, before the decoder asks with its cache)
        )
    try:
        cache = RaggedCache(model, 1)
        cache.forward([[1, 2, 3]], 1)
        cache.drop(0, [2])
        cache.forward([[4, 5]], 2)
    except Exception as e:  # noqa: BLE001 - any failure is the reason, said at load
        return f"{type(e).__name__}: {e}"
    return None


def prefill(model: PreTrainedModel, prompt: list[int], features: tuple[int, ...] = ()) -> tuple[RaggedCache, float]:
    """A one-row cache holding ``prompt[:-1]`` (the last token is fed by the first step), and
    the seconds it took; with ``features``, those layers' outputs at its positions in
    ``last_features``."""
    own = RaggedCache(model, 1, features)
    if len(prompt) <= 1:
        return own, 0.0
    with Timer() as t:
        own.forward([prompt[:-1]], 1)
    return own, t.seconds
