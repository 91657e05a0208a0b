"""The one check of a device string against what torch on this machine has: ``cpu``
always; ``cuda`` and ``cuda:N`` when torch sees a CUDA device and N is below their count;
``mps`` when torch has it here. Pairs loading, ``generate``, ``run`` and ``worker`` use it,
each naming where the string came from (an option, ``SPECDEC_DEVICE``, a pairs-file key).

It never initializes CUDA: ``torch.cuda.device_count`` asks NVML where it can, so a worker
may check its device before its pool forks."""

from __future__ import annotations

import re

DEVICE = re.compile(r"cpu|mps|cuda(:\d+)?")
FORMS = "cpu, cuda, cuda:N or mps"


def device_problem(device: object) -> str | None:
    """Why this machine cannot run ``device`` (None: it can), and what to use instead."""
    if not isinstance(device, str) or not DEVICE.fullmatch(device):
        return f"{device!r} unknown: not a device; use {FORMS}"
    if device == "cpu":
        return None
    import torch

    if device == "mps":
        if torch.backends.mps.is_available():
            return None
        return "'mps' is not available on this machine (no Apple GPU, or torch without MPS); use cpu"
    count = torch.cuda.device_count()
    if count == 0:
        build = "its CUDA driver sees no GPU" if torch.backends.cuda.is_built() else "it is a CPU-only build"
        return f"{device!r}: torch {torch.__version__} on this machine has no CUDA device ({build}); use cpu"
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        return f"{device!r}: this machine has {count} CUDA device{'s' if count > 1 else ''} (cuda:0 to cuda:{count - 1}); use one of them"
    return None
