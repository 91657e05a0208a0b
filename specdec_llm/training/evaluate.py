"""How well a draft agrees with its target: greedy acceptance over a prompt set, per category."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from ..engine import GenerationRequest, RequestError, SpeculativeDecoder


def _json_object(path: Path, n: int, line: str) -> dict:
    """Line ``n`` of ``path`` as a JSON object, or a ValueError naming ``path:n``."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f'{path}:{n}: {line.strip()[:40]!r} is not a JSON object; write {{"prompt": "..."}}')
    return row


def read_prompts(path: Path, limit: int | None = None) -> list[dict]:
    """JSONL rows with ``prompt`` (or Spec-Bench ``turns[0]``) and an optional ``category``.

    ``limit`` keeps the first N rows of each category (of the file, if it has none).
    """
    rows, taken = [], defaultdict(int)
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = _json_object(path, n, line)
        turns = row.get("turns")
        prompt = row.get("prompt") or (turns[0] if isinstance(turns, list) and turns else None)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{path}:{n}: no 'prompt' (or 'turns') text")
        cat = row.get("category", "all")
        if not isinstance(cat, str):
            raise ValueError(f"{path}:{n}: 'category' is {cat!r}; use a string")
        if limit is None or taken[cat] < limit:
            taken[cat] += 1
            rows.append({"prompt": prompt, "category": cat})
    return rows


def _summary(stats: list) -> dict:
    proposed = sum(s.draft_tokens_proposed for s in stats)
    accepted = sum(s.draft_tokens_accepted for s in stats)
    forwards = sum(s.target_forwards for s in stats)
    tokens = sum(s.output_tokens for s in stats)
    width = max((len(s.per_position_acceptance) for s in stats), default=0)
    per_pos = []
    for i in range(width):
        # weight each request's position-i rate by how often it proposed position i
        num = sum(
            s.per_position_acceptance[i] * sum(k > i for k in s.k_values)
            for s in stats
            if i < len(s.per_position_acceptance)
        )
        den = sum(sum(k > i for k in s.k_values) for s in stats)
        per_pos.append(num / den if den else 0.0)
    return {
        "prompts": len(stats),
        "output_tokens": tokens,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_accepted_length": tokens / forwards if forwards else 0.0,
        "per_position_acceptance": per_pos,
        "tokens_per_s": tokens / sum(s.wall_time_s for s in stats) if stats else 0.0,
    }


def evaluate(
    decoder: SpeculativeDecoder,
    rows: list[dict],
    max_new_tokens: int = 128,
    k: int = 4,
    on_row=None,
    drafter: str = "auto",
) -> dict:
    """Greedy speculative decoding at a fixed k over ``rows`` with ``drafter`` ("auto": the
    first of the pair's drafters that proposes, each iteration); figures overall and per category."""
    by_cat: dict[str, list] = defaultdict(list)
    skipped = []
    for n, row in enumerate(rows, 1):
        req = GenerationRequest(prompt=row["prompt"], chat=True, max_new_tokens=max_new_tokens, k=k, drafter=drafter)
        try:
            res = decoder.generate(req)
        except RequestError as e:  # (a prompt over the context, say: the others still count)
            if e.field != "prompt":
                raise
            skipped.append(f"prompt {n}: {e}")
            continue
        by_cat[row["category"]].append(res.stats)
        if on_row:
            on_row(row, res)
    out = {
        "overall": _summary([s for v in by_cat.values() for s in v]),
        "k": k,
        "drafter": drafter,
        "max_new_tokens": max_new_tokens,
    }
    if skipped:
        out["skipped"] = skipped
    if len(by_cat) > 1 or "all" not in by_cat:
        out["categories"] = {c: _summary(v) for c, v in sorted(by_cat.items())}
    return out
