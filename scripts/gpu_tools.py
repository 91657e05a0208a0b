"""Helpers for scripts/gpu_prepare.sh and scripts/gpu_check.sh (standard library only, except
``wheels`` and ``check-deps``, which read package metadata with ``packaging``).

    gpu_tools.py wheels                     # name==version of what a GPU machine must be given
    gpu_tools.py pack --gguf F --wheels D --dest .gpu [--budget-mib N]   # split into call folders
    gpu_tools.py join --bundle .gpu --work W   # on the GPU machine: parts -> one GGUF + a pairs file
    gpu_tools.py check-deps                 # every requirement of the project satisfied here?
    gpu_tools.py record --summary S --stage NAME --status ok --seconds 1.2 [--figures F.json] [--log L]
    gpu_tools.py finish --out OUT           # overall status, logs packed into OUT/logs.tar.gz

The GPU machine (one H200, no network) receives the working tree plus at most 64 MiB in all
per call, so the demo GGUF (~94 MiB) and the wheels travel in parts over several calls made
back to back; each call carries one folder ``.gpu/callN``; the last call runs the check.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAIR = "smollm2-135m"
SELF_DRAFT, SELF_DRAFT_FP8 = "smollm2-135m-q4", "smollm2-135m-fp8"  # the quantized stage's pairs
MIB = 1 << 20
TREE_LIMIT = 64 * MIB  # what one device call may carry: working tree + carried paths
MARGIN = 2 * MIB

# Distributions the GPU image already holds at a version the project accepts, so they do not
# travel (the device docs' package list of 2026-11-17, intersected with this project's
# dependency closure). torch and its own dependencies are never carried (the image has a CUDA
# build). transformers is there too, but at 5.17, below the project's >=5.20: it travels.
ON_DEVICE = {
    "accelerate",
    "annotated-doc",
    "anyio",
    "certifi",
    "charset-normalizer",
    "click",
    "filelock",
    "fsspec",
    "h11",
    "hf-xet",
    "httpcore",
    "httpx",
    "huggingface-hub",
    "idna",
    "jinja2",
    "markdown-it-py",
    "markupsafe",
    "mdurl",
    "mpmath",
    "networkx",
    "numpy",
    "packaging",
    "psutil",
    "pygments",
    "python-dateutil",
    "pyyaml",
    "regex",
    "requests",
    "rich",
    "safetensors",
    "setuptools",
    "shellingham",
    "six",
    "sympy",
    "tokenizers",
    "tqdm",
    "typer",
    "typing-extensions",
    "urllib3",
    "xxhash",
}
NEVER = {"torch", "triton", "psycopg", "psycopg-binary"}  # PostgreSQL is not used there (SQLite)


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _requirements() -> list[str]:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


def closure(problems: list[str] | None = None) -> dict[str, str]:
    """name -> installed version for the project's dependencies and theirs (extras followed).
    A requirement missing or not satisfied here is appended to ``problems``."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    found: dict[str, tuple[str, set]] = {}
    stack = [(Requirement(r), "specdec-llm") for r in _requirements()]
    while stack:
        req, parent = stack.pop()
        name = _norm(req.name)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        if name in NEVER - {"torch"}:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            if problems is not None:
                problems.append(f"{req} (needed by {parent}): not installed")
            continue
        if problems is not None and req.specifier and not req.specifier.contains(dist.version, prereleases=True):
            problems.append(f"{req} (needed by {parent}): {dist.version} is installed")
        extras = set(req.extras)
        if name in found and extras <= found[name][1]:
            continue
        found[name] = (dist.version, found.get(name, ("", set()))[1] | extras)
        if name == "torch":
            continue  # torch's own dependencies are the GPU image's business
        for spec in dist.requires or []:
            sub = Requirement(spec)
            if sub.marker:
                if not any(sub.marker.evaluate({"extra": e}) for e in extras | {""}):
                    continue
                sub.marker = None
            stack.append((sub, name))
    return {n: v for n, (v, _) in sorted(found.items())}


def cmd_wheels(args) -> None:
    for name, version in closure().items():
        if name not in ON_DEVICE and name not in NEVER:
            print(f"{name}=={version.split('+')[0]}")


def cmd_check_deps(args) -> None:
    problems: list[str] = []
    found = closure(problems)
    report = {"ok": not problems, "problems": problems, "versions": found}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    for p in problems:
        print(f"unsatisfied: {p}", file=sys.stderr)
    print(f"{len(found)} distributions checked, {len(problems)} unsatisfied")
    sys.exit(1 if problems else 0)


# -- packing for the device calls -----------------------------------------------------------
def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def tree_bytes(repo: Path) -> int:
    """What travels with every call besides the carried paths: tracked files, untracked files
    git does not ignore, and shared/ when it is inside the checkout."""

    def listed(*flags):
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", *flags], capture_output=True, check=True)
        return [repo / p for p in out.stdout.decode().split("\0") if p]

    files = set(listed()) | set(listed("--others", "--exclude-standard"))
    if (repo / "shared").is_dir():
        files |= {p for p in (repo / "shared").rglob("*") if p.is_file()}
    return sum(p.stat().st_size for p in files if p.is_file() and not p.is_symlink())


def cmd_pack(args) -> None:
    gguf, dest = Path(args.gguf), Path(args.dest)
    wheels = sorted(Path(args.wheels).glob("*.whl")) if args.wheels else []
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    tree = tree_bytes(REPO)
    budget = int(args.budget_mib * MIB) if args.budget_mib else TREE_LIMIT - tree - MARGIN
    if wheel_bytes >= budget:
        sys.exit(f"the wheels ({wheel_bytes / MIB:.1f} MiB) do not fit one call ({budget / MIB:.1f} MiB)")
    size = gguf.stat().st_size
    last_room = budget - wheel_bytes  # the last call carries the wheels and the GGUF's last part
    calls = 1 if size <= last_room else 1 + math.ceil((size - last_room) / budget)
    chunk = math.ceil((size - min(size, last_room)) / (calls - 1)) if calls > 1 else 0
    for old in dest.glob("call*"):  # a previous packing
        for f in sorted(old.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        old.rmdir()
    parts = []
    with gguf.open("rb") as src:
        for i in range(calls):
            n = chunk if i < calls - 1 else size - chunk * (calls - 1)
            folder = dest / f"call{i + 1}"
            folder.mkdir(parents=True)
            part = folder / f"{gguf.name}.part{i + 1}of{calls}"
            h = hashlib.sha256()
            with part.open("wb") as out:
                left = n
                while left:
                    block = src.read(min(MIB * 8, left))
                    h.update(block)
                    out.write(block)
                    left -= len(block)
            parts.append({"name": part.name, "call": folder.name, "size": n, "sha256": h.hexdigest()})
    last = dest / f"call{calls}"
    if wheels:
        (last / "wheels").mkdir()
        for w in wheels:
            (last / "wheels" / w.name).write_bytes(w.read_bytes())
    manifest = {
        "gguf": gguf.name,
        "size": size,
        "sha256": sha256(gguf),
        "pair": PAIR,
        "calls": calls,
        "parts": parts,
        "wheels": [w.name for w in wheels],
        "python_version": args.python_version,
        "budget_bytes": budget,
        "tree_bytes": tree,
        "made": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for i in range(calls):
        (dest / f"call{i + 1}" / "manifest.json").write_text(json.dumps(manifest, indent=2))
    rel = os.path.relpath(dest, REPO)
    print(
        f"packed {gguf.name} ({size / MIB:.1f} MiB) and {len(wheels)} wheels ({wheel_bytes / MIB:.1f} MiB) "
        f"into {calls} calls of at most {budget / MIB:.1f} MiB each (working tree: {tree / MIB:.1f} MiB)"
    )
    for i in range(calls):
        folder = dest / f"call{i + 1}"
        mib = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / MIB
        cmd = "scripts/gpu_check.sh" if i == calls - 1 else f"ls -l {rel}/call*"
        print(f'  call {i + 1}: carry ["{rel}/call{i + 1}"] ({mib:.1f} MiB), command: {cmd}')


def cmd_join(args) -> None:
    """Find the parts of every call folder under --bundle, check them, join them into one GGUF
    under --work, and write a pairs file whose demo pair targets that GGUF. Prints the
    environment the later stages need (KEY=VALUE lines) and writes figures to --json."""
    bundle, work = Path(args.bundle), Path(args.work)
    manifests = sorted(bundle.glob("call*/manifest.json"))
    figures: dict = {}
    if not manifests:
        figures["gguf"] = "installed package (no bundle)"
        _write(args.json, figures)
        return
    manifest = json.loads(manifests[-1].read_text())
    missing = [p for p in manifest["parts"] if not (bundle / p["call"] / p["name"]).is_file()]
    if missing:
        calls = ", ".join(p["call"] for p in missing)
        sys.exit(
            f"GGUF parts missing: {calls} of {manifest['calls']} calls. The machine went back between calls "
            f"(it keeps files only while warm, 30 s): make calls 1..{manifest['calls']} again, back to back"
        )
    out = work / "models" / manifest["gguf"]
    out.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    with out.open("wb") as dst:
        for p in manifest["parts"]:
            data = (bundle / p["call"] / p["name"]).read_bytes()
            if len(data) != p["size"] or hashlib.sha256(data).hexdigest() != p["sha256"]:
                sys.exit(f"GGUF part {p['name']} in {p['call']} is damaged (size or sha256 differs); carry it again")
            h.update(data)
            dst.write(data)
    if h.hexdigest() != manifest["sha256"]:
        sys.exit(f"joined GGUF {out}: sha256 differs from the manifest's")
    pairs = work / "pairs.toml"
    pairs.write_text(pair_toml(str(out)))
    figures.update(gguf=str(out), gguf_bytes=manifest["size"], parts=len(manifest["parts"]), pairs_file=str(pairs))
    _write(args.json, figures)
    print(f"SPECDEC_CONFIG_FILE={pairs}")


def pair_toml(target: str) -> str:
    """The built-in pairs of the demo target (the demo pair and its int4 self-draft) with
    their target replaced by a GGUF path (a user pairs file overrides a built-in pair of the
    same name), and ``SELF_DRAFT_FP8``: the self-draft in fp8."""
    import tomllib

    builtin = tomllib.loads((REPO / "specdec_llm" / "builtin_pairs.toml").read_text())["pairs"]
    specs = {PAIR: builtin[PAIR], SELF_DRAFT: builtin[SELF_DRAFT]}
    specs[SELF_DRAFT_FP8] = {**builtin[SELF_DRAFT], "draft": "quantized:fp8", "description": "fp8 self-draft"}
    lines = []
    for name, spec in specs.items():
        lines.append(f"[pairs.{name}]")
        for key, value in {**spec, "target": target}.items():
            lines.append(f"{key} = {json.dumps(value)}")  # strings, lists of strings: TOML reads JSON's forms
    return "\n".join(lines) + "\n"


# -- the summary ------------------------------------------------------------------------------
def _write(path: str | None, data: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, default=str))


def cmd_record(args) -> None:
    path = Path(args.summary)
    summary = json.loads(path.read_text()) if path.exists() else {"stages": {}}
    stage = {
        "status": args.status,
        "seconds": round(args.seconds, 1),
        "budget_s": args.budget,
        "exit_code": args.rc,
        "log": args.log,
    }
    if args.figures and Path(args.figures).is_file():
        try:
            stage["figures"] = json.loads(Path(args.figures).read_text())
        except json.JSONDecodeError as e:
            stage["figures"] = {"error": f"unreadable {args.figures}: {e}"}
    if args.status != "ok" and args.log and Path(args.log).is_file():
        stage["log_tail"] = Path(args.log).read_text(errors="replace").splitlines()[-15:]
    summary["stages"][args.stage] = stage
    path.write_text(json.dumps(summary, indent=2, default=str))


def headline(stages: dict) -> dict:
    """The figures a README table needs, from the stages' figures (missing ones left out)."""
    fig = {name: s.get("figures") or {} for name, s in stages.items()}
    out: dict = {}
    setup = fig.get("setup", {})
    device = setup.get("device", {})
    out["gpu"] = device.get("gpu") or device.get("nvidia_smi")
    out["torch"], out["transformers"] = device.get("torch"), setup.get("load", {}).get("transformers")
    for dtype, res in fig.get("fidelity", {}).get("dtypes", {}).items():
        checks = res.get("checks", {})
        out.setdefault("fidelity", {})[dtype] = {
            "ok": res.get("ok"),
            "greedy_vs_generate": {v: c.get("identical") for v, c in checks.get("greedy_vs_generate", {}).items()},
            "batched_vs_single": {v: c.get("identical") for v, c in checks.get("batched_vs_single", {}).items()},
            "same_batch_repeat": checks.get("same_batch_repeat", {}).get("identical"),
            "sampled_tv": [checks.get("sampled_distribution", {}).get(k) for k in ("tv", "bound")],
        }
    for name, res in fig.get("speed", {}).items():
        bench, _, dtype = name.removeprefix("bench_").partition("_")
        row = out.setdefault("speed", {}).setdefault(dtype, {})
        if bench == "engine":
            for method, m in res.get("methods", {}).items():
                row.setdefault("engine batch 1, tok/s (speedup over generate, acceptance)", {})[method] = [
                    round(m["tokens_per_s"]["all"], 1),
                    round(m["speedup"]["all"], 2),
                    None if m.get("acceptance") is None else round(m["acceptance"], 2),
                ]
        elif bench == "batch":
            row["generate one at a time, tok/s"] = round(res.get("a_tokens_per_s", 0), 1)
            for b, r in res.get("batches", {}).items():
                row.setdefault("batched, tok/s k=0 / auto (auto over generate)", {})[b] = [
                    round(r["b_tokens_per_s"], 1),
                    round(r["c_tokens_per_s"], 1),
                    round(r["c_over_a"], 2),
                ]
        elif bench == "forward":
            row["verify ratio (5 and 9 tokens over 1)"] = [
                round(res.get("verify_ratio", {}).get(w, 0), 2) for w in ("5", "9")
            ]
            row["one-token step, ms"] = round(res.get("ms", {}).get("1", 0), 2)
    worker = fig.get("worker", {})
    if worker.get("report"):
        r = worker["report"][0]
        keys = ("tokens_per_s_mean", "acceptance_rate", "mean_accepted_length", "speedup", "latency_p50_s")
        out["worker"] = {
            "dtype": worker.get("dtype"),
            "rows ok": f"{worker.get('ok_rows')}/{worker.get('rows')}",
            **{k: None if r.get(k) is None else round(r[k], 3) for k in keys},
        }
    return out


def cmd_finish(args) -> None:
    out = Path(args.out)
    path = out / "summary.json"
    summary = json.loads(path.read_text())
    stages = summary["stages"]
    try:
        summary["headline"] = headline(stages)
    except Exception as e:  # noqa: BLE001 - the summary must still be written
        summary["headline"] = {"error": repr(e)}
    summary["ok"] = bool(stages) and all(s["status"] == "ok" for s in stages.values())
    summary["failed"] = [name for name, s in stages.items() if s["status"] != "ok"]
    summary["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    logs = out / "logs"
    if logs.is_dir() and not args.keep_logs:  # the device call returns at most 8 files: one archive
        with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
            tar.add(logs, arcname="logs")
        for f in sorted(logs.rglob("*"), reverse=True):
            f.unlink() if f.is_file() or f.is_symlink() else f.rmdir()
        logs.rmdir()
        summary["logs"] = "logs.tar.gz"
    path.write_text(json.dumps(summary, indent=2, default=str))
    for name, s in stages.items():
        print(f"  {name:9} {s['status']:8} {s['seconds']:7.1f} s")
    print(
        f"gpu check: {'all stages ok' if summary['ok'] else 'FAILED: ' + ', '.join(summary['failed'])}; "
        f"summary in {path}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("wheels")
    p = sub.add_parser("check-deps")
    p.add_argument("--json")
    p = sub.add_parser("pack")
    p.add_argument("--gguf", required=True)
    p.add_argument("--wheels")
    p.add_argument("--dest", default=str(REPO / ".gpu"))
    p.add_argument("--budget-mib", type=float, help="bytes per call (default: 64 MiB - working tree - 2 MiB)")
    p.add_argument("--python-version", default="")
    p = sub.add_parser("join")
    p.add_argument("--bundle", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--json")
    p = sub.add_parser("record")
    for name in ("--summary", "--stage", "--status", "--log", "--figures"):
        p.add_argument(name)
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--budget", type=float)
    p.add_argument("--rc", type=int)
    p = sub.add_parser("finish")
    p.add_argument("--out", required=True)
    p.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()
    {
        "wheels": cmd_wheels,
        "check-deps": cmd_check_deps,
        "pack": cmd_pack,
        "join": cmd_join,
        "record": cmd_record,
        "finish": cmd_finish,
    }[args.cmd](args)


if __name__ == "__main__":
    main()
