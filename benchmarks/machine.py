"""The machine a benchmark ran on, printed beside every table: lscpu's model, CPU count and
the flags that decide kernels (avx512*, amx*, avx2, fma). Imports nothing heavy."""

from __future__ import annotations

import subprocess


def cpu_info() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    keep = [f for f in flags if f.startswith(("avx512", "amx", "avx2", "fma"))]
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs ({' '.join(keep)})"
