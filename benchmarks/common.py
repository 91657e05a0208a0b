"""Helpers shared by the benchmark scripts (prompt loading, timing tables)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data"


def spec_bench(per_category: int, path: Path = DATA / "spec_bench_dev.jsonl") -> list[dict]:
    """The first ``per_category`` Spec-Bench dev questions of each category."""
    taken: dict[str, int] = defaultdict(int)
    rows = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if taken[row["category"]] < per_category:
            taken[row["category"]] += 1
            rows.append({"id": row["question_id"], "category": row["category"], "prompt": row["turns"][0]})
    return rows
