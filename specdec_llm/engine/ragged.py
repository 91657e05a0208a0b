"""A KV cache for a batch of rows that each hold a different number of valid tokens.

Rows join (their own prefill, merged in), leave, and roll back different numbers of
rejected drafts. Instead of shifting tensors every iteration, a rolled-back position
becomes a *hole*: a cache column that row no longer attends to. ``valid`` [B, L] says
which columns each row sees; a row's logical positions (RoPE) count its valid columns
only, so holes change nothing in what a row computes. Columns that no row uses are
cropped from the end after each iteration, and ``compact`` squeezes holes out when they
outnumber the tokens, so the cache stays close to the longest row.

Each forward feeds one chunk of new tokens per row, LEFT-padded to a common width, so
every row's last token sits in the last column. A padding query attends to itself only
and nothing attends to it, so padding never produces NaNs nor leaks into real rows.
With one row and no holes (single-request decoding) the forward is the plain causal one.
"""

from __future__ import annotations

import torch

from . import hf


class RaggedCache:
    def __init__(self, model, rows: int = 0):
        self.model = model
        self.cache = hf.new_cache(model)
        self.valid = torch.zeros(rows, 0, dtype=torch.bool)

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    def lengths(self) -> list[int]:
        """Valid tokens per row."""
        return self.valid.sum(1).tolist()

    # -- forward ------------------------------------------------------------------------
    def forward(self, inputs: list[list[int]], keep: int) -> torch.Tensor:
        """Append one chunk per row (a row may feed nothing); logits of the last ``keep`` columns [B, keep, V]."""
        assert len(inputs) == self.rows and any(inputs)
        w = max(len(x) for x in inputs)
        ids = torch.tensor([[0] * (w - len(x)) + list(x) for x in inputs], dtype=torch.long)
        new = torch.tensor([[False] * (w - len(x)) + [True] * len(x) for x in inputs], dtype=torch.bool)
        mask = positions = None
        if not bool(new.all()) or not bool(self.valid.all()):
            start = self.valid.sum(1, keepdim=True)
            positions = (start + new.long().cumsum(1) - 1).clamp_min(0)
            causal = torch.ones(w, w, dtype=torch.bool).tril()
            eye = torch.eye(w, dtype=torch.bool)
            chunk = (causal[None] & new[:, None, :]) | eye[None]  # [B, W(query), W(key)]
            past = self.valid[:, None, :].expand(-1, w, -1)
            mask = torch.cat([past, chunk], -1)[:, None].to(self.model.device)
            positions = positions.to(self.model.device)
        logits = hf.forward_rows(self.model, ids, self.cache, keep, mask, positions)
        self.valid = torch.cat([self.valid, new], 1)
        return logits

    # -- rollback and housekeeping ------------------------------------------------------------
    def drop(self, row: int, columns) -> None:
        """Make ``columns`` (absolute indices) holes for ``row``."""
        self.valid[row, list(columns)] = False

    def keep_rows(self, index: list[int]) -> None:
        idx = torch.tensor(index, dtype=torch.long)
        if self.width:
            dev = idx.to(hf.layers(self.cache)[0].keys.device)
            for layer in hf.layers(self.cache):
                hf.set_layer(layer, layer.keys[dev], layer.values[dev])
        self.valid = self.valid[idx]

    def tidy(self) -> None:
        """Crop columns no row uses from the end; squeeze holes out when they dominate."""
        used = self.valid.any(0).nonzero()
        end = int(used[-1]) + 1 if len(used) else 0
        if end < self.width:
            self.crop(end)
        longest = int(self.valid.sum(1).max()) if self.rows else 0
        if self.width > 32 and self.width > 2 * longest:
            self.compact()

    def crop(self, width: int) -> None:
        hf.crop(self.cache, width)
        self.valid = self.valid[:, :width]
        if width == 0:
            self.cache = hf.new_cache(self.model)

    def compact(self) -> None:
        """Move every row's valid columns to the front (order kept); width = longest row."""
        longest = int(self.valid.sum(1).max())
        order = torch.sort((~self.valid).long(), dim=1, stable=True).indices[:, :longest]  # valid columns first
        for layer in hf.layers(self.cache):
            k, v = layer.keys, layer.values
            idx = order.to(k.device)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            hf.set_layer(layer, k.gather(2, idx), v.gather(2, idx))
        self.valid = torch.arange(longest)[None, :] < self.valid.sum(1, keepdim=True)

    def extend(self, other: RaggedCache) -> None:
        """Append ``other``'s rows (a newly prefilled request) below this cache's rows."""
        w = max(self.width, other.width)
        mine, theirs = hf.layers(self.cache), hf.layers(other.cache)
        for a, b in zip(mine, theirs):
            ref = a if a.is_initialized else b if b.is_initialized else None
            if ref is None:
                continue
            parts = []
            for layer, rows, width in ((a, self.rows, self.width), (b, other.rows, other.width)):
                pair = []
                for t, r in ((layer.keys, ref.keys), (layer.values, ref.values)):
                    if not layer.is_initialized or t.numel() == 0:
                        t = r.new_zeros(rows, r.shape[1], 0, r.shape[3])
                    pad = r.new_zeros(rows, r.shape[1], w - width, r.shape[3])
                    pair.append(torch.cat([t, pad], 2))
                parts.append(pair)
            hf.set_layer(a, torch.cat([parts[0][0], parts[1][0]]), torch.cat([parts[0][1], parts[1][1]]))
        pad = lambda v: torch.cat([v, torch.zeros(v.shape[0], w - v.shape[1], dtype=torch.bool)], 1)  # noqa: E731
        self.valid = torch.cat([pad(self.valid), pad(other.valid)])
