"""Logits processing and the two acceptance rules.

One ``probs`` function serves draft and target, so both distributions are transformed
identically (temperature, then top-k, then top-p), as the rejection rule requires.
"""

from __future__ import annotations

import torch


def probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Rows of ``logits`` [n, V] -> processed probabilities [n, V] (float32). temperature > 0."""
    x = logits.float()
    # shifted first and the temperature kept a finite float32 number: a tiny one gives -inf, never
    # 0 / 0 or inf - inf; a huge one nearly uniform odds, never -inf / inf (a masked token's NaN)
    f32 = torch.finfo(torch.float32)
    x = (x - x.amax(-1, keepdim=True)) / min(max(temperature, f32.tiny), f32.max)
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (cum - torch.softmax(sorted_x, dim=-1)) >= top_p
        drop_sorted[..., 0] = False  # (a top_p under float32's least number compares as 0: every token went)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(p: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def accept_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Longest prefix of drafts equal to the target's argmax; returns (n_accepted, next_token)."""
    best = target_logits.argmax(-1).tolist()  # k+1 target choices
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == best[n]:
        n += 1
    return n, best[n]


def accept_sampled(
    draft_tokens: list[int], q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator
) -> tuple[int, int]:
    """Rejection sampling (Leviathan et al. 2023, Alg. 1).

    ``q`` [k, V] draft probabilities the drafts were sampled from (None: a deterministic
    draft, i.e. one-hot at each draft token), ``p`` [k+1, V] target probabilities at the
    same positions plus the bonus one. Accept draft i with probability min(1, p_i(d)/q_i(d));
    on the first rejection sample from normalise(max(0, p_i - q_i)); if every draft is
    accepted, sample the bonus token from p_k. A ``q`` with k+1 rows carries the distribution
    of a draft cut after the k (one the grammar rejects, grammar.py): that token would have
    been rejected, so the bonus is the residual of p_k and q_k.
    """
    for i, tok in enumerate(draft_tokens):
        qi = q[i] if q is not None else torch.zeros_like(p[i]).index_fill_(0, torch.tensor([tok]), 1.0)
        ratio = p[i, tok] / qi[tok]
        if float(torch.rand((), generator=generator)) < float(ratio):
            continue
        return i, sample_residual(p[i], qi, generator)
    k = len(draft_tokens)
    if q is not None and len(q) > k:
        return k, sample_residual(p[k], q[k], generator)
    return k, sample(p[k], generator)


def sample_residual(p: torch.Tensor, q: torch.Tensor, generator: torch.Generator) -> int:
    """After a rejection: a token from normalise(max(0, p - q)) (p itself if that is empty)."""
    residual = (p - q).clamp_min(0)
    total = residual.sum()
    return sample(residual / total if total > 0 else p, generator)
