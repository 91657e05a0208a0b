"""JSON files that processes on one host share (``kernels.json``, ``costs.json``): read as {}
where absent or unreadable, and updated by merging under a lock, so two workers writing at once
keep each other's entries; the file is written under a name of its own and renamed into place,
so a reader never sees half of it."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path
from typing import Any

from .mapped import replacing


def load(path: Path | None) -> dict[str, Any]:
    """The file's object, {} where there is none or it is not a JSON object."""
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def update(path: Path, entries: dict[str, Any]) -> None:
    """Merges ``entries`` into the file, holding ``NAME.lock`` (flock) from the read to the
    rename. Raises OSError (a read-only cache: the caller measures again next time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f"{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = {**load(path), **entries}
        with replacing(path) as tmp:
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
