"""Measured decoding costs kept on disk, so a new process starts with them instead of
measuring again (costs.CostModel: verify(k), each model drafter's step, a plain iteration's
overhead, per batch-size bucket).

One JSON file beside the kernel timings (``costs.json`` in ``SPECDEC_CACHE_DIR``, default
``~/.cache/specdec-llm``), one entry per machine (CPU model and flags, torch version,
threads: ``kernels.machine_key``; the GPU's name on CUDA), device, dtype, pair fingerprint
(the weights of the target and of each model drafter, the drafters' names, the shared
vocabulary, max k) and batch-size bucket. A decoder writes its live figures back when a
request or a batch finishes, so the entry follows the machine's current speed; a write
merges with what other processes wrote meanwhile and replaces the file atomically.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import jsoncache
from .hf import weights_fingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .drafting.base import Drafter

log = logging.getLogger(__name__)

FILE = "costs.json"
FORMAT = 2  # what an entry holds (2: draft forwards over several tokens, for two-level drafting)


def device_key(model: torch.nn.Module) -> str:
    device = next(model.parameters()).device
    if device.type == "cuda":
        return f"{device.type}|{torch.cuda.get_device_name(device)}"
    from .kernels import machine_key

    return f"{device.type}|{machine_key()}"


def decoder_key(target: PreTrainedModel, drafters: list[Drafter], vocab_size: int, max_k: int) -> str:
    """Everything a decoder's costs depend on, except the batch size."""
    parts = [
        device_key(target),
        str(next(target.parameters()).dtype).removeprefix("torch."),
        f"target {weights_fingerprint(target)}",
        f"vocab {vocab_size}",
        f"max_k {max_k}",
        f"costs {FORMAT}",
    ]
    parts += [f"{d.name} {d.key}" if d.key else d.name for d in drafters]
    return "|".join(parts)


def save(path: Path | None, entries: dict[str, dict[str, Any]]) -> None:
    """Merge ``entries`` into the file (another process's entries are kept)."""
    if path is None or not entries:
        return
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        jsoncache.update(path, {key: {**entry, "updated_at": now} for key, entry in entries.items()})
    except OSError as e:  # a read-only cache costs a calibration next time, nothing else
        log.info("could not save decoding costs to %s: %s", path, e)
