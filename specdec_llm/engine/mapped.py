"""Safetensors files read by mapping each tensor on its own (``mapped_tensors``), and written
whole, atomically (``save_tensors``).

Reading a 7 GB model into fresh process memory costs what faulting in 7 GB of zeroed pages
costs: 11.5 s with safetensors' ``pread`` backend on a 2-vCPU EPYC VM (3.5 s just to populate
the pages), against 1 s to map the file from the page cache. safetensors' own ``mmap`` backend
maps the file once, so every page a load touched stayed resident while any one tensor lived
(the prepared weights that replace most of them sat beside them). Here each tensor has its own
private (copy-on-write) mapping: it goes when the tensor goes, and a tensor kept as it is costs
the page cache's pages, not a copy of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _header(file: Path | str) -> tuple[dict[str, Any], int]:
    """A safetensors file's header ({name: {dtype, shape, data_offsets}}) and where its data starts."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))
    meta.pop("__metadata__", None)
    return meta, 8 + n


def complete(file: Path | str) -> bool:
    """Whether a safetensors file holds a readable header and every byte it promises (a write
    cut short leaves less)."""
    try:
        meta, base = _header(file)
        end = max((info["data_offsets"][1] for info in meta.values()), default=0)
        return os.path.getsize(file) >= base + end
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError):
        return False


def _enough_descriptors(n: int) -> None:
    """Each mapping holds a file descriptor (CPython's mmap keeps one): a model of ~1,000
    tensors would exceed the usual soft limit of 1,024, so it is raised to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < hard and n > soft // 4:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def mapped_tensors(file: Path | str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a safetensors file, in file order, each over its own
    private mapping of its bytes (released with the tensor; writes stay in the process)."""
    meta, base = _header(file)
    items = sorted(meta.items(), key=lambda kv: kv[1]["data_offsets"][0])
    _enough_descriptors(len(items))
    with open(file, "rb") as f:
        for name, info in items:
            start, end = info["data_offsets"]
            dtype, shape = DTYPES[info["dtype"]], info["shape"]
            if end == start:
                yield name, torch.empty(shape, dtype=dtype)
                continue
            raw = np.memmap(f, dtype=np.uint8, mode="c", offset=base + start, shape=(end - start,))
            yield name, torch.from_numpy(raw).view(dtype).view(shape)


@contextmanager
def replacing(file: Path) -> Iterator[Path]:
    """A temporary path beside ``file``, of this writer's own (processes and threads writing at
    once never share one): what the block writes there takes ``file``'s name when the block
    ends, atomically; a block that raises leaves nothing. No fsync: readers check what they
    read (``complete``), and a power cut's short file is rebuilt."""
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(name)
        os.replace(name, file)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def save_tensors(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` as a safetensors ``file``, written whole (``replacing``)."""
    from safetensors.torch import save_file

    with replacing(file) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))


def remove_stale(folder: Path, pattern: str, age_s: float = 86400) -> None:
    """Deletes what matches ``pattern`` in ``folder`` unchanged for ``age_s`` (the temporary files
    and folders of writers killed mid-write: a live writer's is younger; stored drafts unused)."""
    for path in folder.glob(pattern):
        with contextlib.suppress(OSError):  # (another process removed it first)
            if path.stat().st_mtime < time.time() - age_s:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
