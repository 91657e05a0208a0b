"""Per-row-count matmul kernels (engine/kernels.py): the choice logic, the installed forward
computes the same products, timings are cached per machine and re-read, untune restores."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import tiny_llama

from specdec_llm.engine import kernels


def test_choose_keeps_one_copy_and_table_covers_every_row_count():
    P = len(kernels.POINTS)
    times = {"row": [1.0] * P, "col": [1.02] * P, "onednn": [5.0] * P}
    times["row"][4:] = [3.0] * (P - 4)  # row-major slows down from 5 rows
    times["onednn"][4:] = [2.0] * (P - 4)
    times["col"][4:] = [2.05] * (P - 4)  # within 3% of the fastest everywhere: the one kept
    assert kernels.choose(times) == ["col"] * P
    times["col"][4:] = [6.0] * (P - 4)  # col falls far behind at many rows
    times["onednn"][:4] = [1.5] * 4  # and oneDNN loses less at few rows than row-major at many
    assert kernels.choose(times) == ["onednn"] * P
    times["onednn"][4:] = [float("inf")] * (P - 4)  # a kernel not timed further (far behind) is never kept
    assert kernels.choose(times) == ["row"] * P
    tab = kernels.table(["row"] * 4 + ["onednn"] * (P - 4))
    assert tab[1] == tab[4] == "row" and tab[5] == tab[64] == tab[kernels.TABLE - 1] == "onednn"


def test_a_tuned_weight_is_held_once(tmp_path):
    """Each Linear keeps one layout of its weight: the kernel's (its parameter takes a
    row- or column-major one; oneDNN's packed copy replaces the row-major data)."""
    model = tiny_llama(0)
    before = sum(p.numel() for p in model.parameters())
    for force in kernels.kinds(torch.float32):
        m = copy.deepcopy(model)
        kernels.tune(m, tmp_path / "k.json", force=force)
        for lin in (x for x in m.modules() if getattr(x, "_kernels", None) is not None):
            (kind,) = lin._kernel_weights
            if kind == "onednn":
                assert lin.weight.numel() == 0 or kernels.tied(lin, m)
            else:
                assert lin._kernel_weights[kind].data_ptr() == lin.weight.data_ptr()
        if force != "onednn":
            assert sum(p.numel() for p in m.parameters()) == before


def test_tuned_forward_equals_plain_linear_and_the_cache_is_reused(tmp_path, monkeypatch):
    model = tiny_llama(0)
    ref = copy.deepcopy(model)
    cache = tmp_path / "kernels.json"
    report = kernels.tune(model, cache)
    assert report and all(set(r["choice"].values()) <= set(kernels.kinds(torch.float32)) for r in report.values())
    saved = json.loads(cache.read_text())
    assert all(k.startswith(kernels.machine_key()) for k in saved)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        for rows in (1, 3, 7):
            a = model(input_ids=ids[:, :rows]).logits
            b = ref(input_ids=ids[:, :rows]).logits
            assert torch.allclose(a, b, atol=1e-4), rows
    # a second model of the same shapes on this machine: read from the cache, nothing measured
    monkeypatch.setattr(kernels, "measure", lambda *a: pytest.fail("measured again"))
    other = tiny_llama(1)
    forced = {"row": [0.0] * len(kernels.POINTS), "col": [1.0] * len(kernels.POINTS)}
    cache.write_text(json.dumps({k: {**v, "ms": forced} for k, v in saved.items()}))
    report = kernels.tune(other, cache)
    assert all(set(r["choice"].values()) == {"row"} for r in report.values())
    assert kernels.tune(other, cache) == {}  # idempotent: already tuned
    kernels.untune(other)
    assert all(getattr(m, "_kernels", None) is None for m in other.modules())
    assert all("forward" not in vars(m) for m in other.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("tuned", [False, True])
def test_lean_forward_equals_transformers(tuned, monkeypatch):
    """engine/lean.py runs the same operations as transformers' Llama forward (q/k/v and
    gate/up as one matmul each): the same logits up to the last bits a kernel choice moves,
    and the same argmax, for one row (causal), a ragged batch with holes and padding
    (masked), prefill and k-token verification, on plain and kernel-tuned weights;
    unsupported models fall back."""
    from specdec_llm.engine import hf, lean
    from specdec_llm.engine.ragged import RaggedCache

    model = tiny_llama(0)
    hf.prepare(model, None) if tuned else model.set_attn_implementation(hf.ATTENTION)

    def run(enabled: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(lean, "ENABLED", enabled)
        out = []
        one = RaggedCache(model, 1)
        out.append(one.forward([list(range(3, 40))], 5))  # prefill, no mask
        out.append(one.forward([[7]], 1))  # one-token step
        out.append(one.forward([[9, 10, 11, 12, 13]], 5))  # verification over a past
        batch = RaggedCache(model, 2)
        out.append(batch.forward([[1, 2, 3, 4, 5, 6], [8, 9]], 1))  # padded rows: masked
        batch.drop(0, [batch.width - 2])  # a hole
        out.append(batch.forward([[20, 21, 22], [23]], 3))
        out.append(batch.forward([[24], [25]], 1))
        return out

    ref, got = run(False), run(True)
    assert lean.runner(model) is not None
    for r, g in zip(ref, got):
        assert torch.allclose(r, g, atol=1e-5, rtol=0), (r - g).abs().max()
        assert torch.equal(r.argmax(-1), g.argmax(-1))

    eager = tiny_llama(0)
    eager.set_attn_implementation("eager")
    monkeypatch.setattr(lean, "ENABLED", True)
    assert lean.runner(eager) is None  # transformers' own forward


def test_a_timing_at_every_row_count_serves_one_asked_at_fewer(tmp_path, monkeypatch):
    """A copy that may never be built is timed at one row only (``every=False``); a shape timed
    at every row count answers that question from the cache, and a one-row entry is timed at
    the rest when every row count is asked for (``tune``)."""
    cache, measured = tmp_path / "kernels.json", []
    real = kernels.measure
    monkeypatch.setattr(kernels, "measure", lambda *a: measured.append(tuple(a[2])) or real(*a))
    full, small = torch.randn(64, 32), torch.randn(48, 32)
    kernels.fastest_ms(full, 1, cache)
    assert kernels.fastest_ms(full, 1, cache, every=False) == kernels.fastest_ms(full, 1, cache)
    assert measured == [kernels.POINTS]  # (timed once)
    kernels.fastest_ms(small, 1, cache, every=False)
    kernels.fastest_ms(small, 1, cache)
    assert measured == [kernels.POINTS, (1,), kernels.POINTS]


@pytest.mark.parametrize(
    "damage",
    [
        lambda e: [],
        lambda e: "x",
        lambda e: {k: {"points": v["points"]} for k, v in e.items()},
        lambda e: {k: {**v, "ms": {kind: t[:2] for kind, t in v["ms"].items()}} for k, v in e.items()},
        lambda e: {k: {**v, "ms": {"gone": v["ms"][next(iter(v["ms"]))]}} for k, v in e.items()},
        lambda e: {
            k: {**v, "ms": {kind: [float("nan")] * len(t) for kind, t in v["ms"].items()}} for k, v in e.items()
        },
    ],
)
def test_a_damaged_kernel_timing_is_measured_again_not_a_crash(tmp_path, damage):
    """A hand-edited or damaged ``kernels.json`` (not an object, an entry without timings, too
    few, of a kernel this version lacks, NaN) is measured again at load."""
    cache = tmp_path / "kernels.json"
    kernels.tune(tiny_llama(0), cache)
    cache.write_text(json.dumps(damage(json.loads(cache.read_text()))))
    report = kernels.tune(tiny_llama(1), cache)
    assert report and all(set(r["choice"].values()) <= set(kernels.kinds(torch.float32)) for r in report.values())
    assert kernels.fastest_ms(tiny_llama(1).lm_head.weight, 1, cache) > 0


def test_writers_keep_each_others_timings_and_time_one_matrix(tmp_path, monkeypatch):
    """Two processes timing different shapes at once keep both (a write merges under a lock);
    a timing is per matrix, however many copies were streamed to time it (an int8 head's)."""
    cache = tmp_path / "kernels.json"
    view = kernels._load(cache)  # this process read the file (empty) before the other wrote
    kernels.fastest_ms(torch.randn(48, 32), 1, cache)  # the other process
    kernels.fastest_ms(torch.randn(80, 32), 1, cache)  # this one
    kernels._save(cache, view)
    assert len(json.loads(cache.read_text())) == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith("tmp")] == []
    monkeypatch.setattr(kernels, "_time", lambda fn, weights, x, repeats=3: 0.001 * len(weights))
    monkeypatch.setattr(kernels, "last_level_cache", lambda: 64 << 20)  # an int8 head timed over many copies
    w = torch.randn(1024, 1024)
    assert len(kernels._copies("int8", [w])) > 1
    assert kernels.measure([w], ["row", "int8"], (1, 2)) == {"row": [0.001, 0.001], "int8": [0.001, 0.001]}


def _int8_in_child(w: torch.Tensor, x: torch.Tensor, want: torch.Tensor, done: object) -> None:
    done.put(bool(torch.allclose(kernels.DynamicInt8Linear(w, None)(x), want)))  # type: ignore[attr-defined]


@pytest.mark.skipif(not kernels.int8_engine(), reason="this torch has no quantized CPU engine")
def test_int8_weights_pack_on_threads_beside_the_load_and_in_a_forked_worker():
    """DynamicInt8Linear packs its weight on a thread of its process (``kernels._packer``) and
    waits for it at the first product; a worker forked after the parent packed gets threads of its
    own (an inherited pool has none: its packing would wait forever)."""
    import multiprocessing

    torch.manual_seed(0)
    w, x = torch.randn(96, 64), torch.randn(3, 64)
    parent = kernels.DynamicInt8Linear(w, None)
    assert parent._packed is None  # (not awaited yet)
    want = parent(x)
    assert (want - x @ w.T).norm() < 0.05 * (x @ w.T).norm()
    ctx = multiprocessing.get_context("fork")
    done = ctx.Queue()
    child = ctx.Process(target=_int8_in_child, args=(w, x, want, done))
    child.start()
    child.join(60)
    alive = child.is_alive()
    child.kill()
    assert not alive and child.exitcode == 0 and done.get(timeout=5)
