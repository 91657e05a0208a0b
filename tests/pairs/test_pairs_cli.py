"""Pair registry and loading (vocabulary checks, shared tensors) and the CLI contract."""

from __future__ import annotations

import json
import re

import pytest
from conftest import tiny_llama, tiny_tokenizer
from typer.testing import CliRunner

from specdec_llm.cli import app
from specdec_llm.engine import GenerationRequest
from specdec_llm.pairs import PairError, PairSpec, load_pair, registry

runner = CliRunner()


def test_registry_merges_builtin_and_user_file(pairs_file):
    pairs = registry()
    assert pairs["smollm2-135m"].source == "builtin"
    assert pairs["tiny"].source == str(pairs_file)


def test_env_overrides_device_and_dtype(pairs_file, monkeypatch):
    from specdec_llm.settings import reload_settings

    monkeypatch.setenv("SPECDEC_DTYPE", "bfloat16")
    reload_settings()
    try:
        assert {s.dtype for s in registry().values()} == {"bfloat16"}
    finally:
        monkeypatch.delenv("SPECDEC_DTYPE")
        reload_settings()


def test_bad_user_file_names_the_key(tmp_path, monkeypatch):
    from specdec_llm.settings import reload_settings

    path = tmp_path / "pairs.toml"
    path.write_text('[pairs.x]\ntarget = "a"\ndraftt = "b"\n')
    monkeypatch.setenv("SPECDEC_CONFIG_FILE", str(path))
    reload_settings()
    try:
        with pytest.raises(PairError, match=r"pair 'x' has unknown keys \['draftt'\]"):
            registry()
        path.write_text('[pairs.x]\ntarget = "a"\ndrafters = ["lookup", "medusa"]\n')
        with pytest.raises(
            PairError, match=r"pair 'x': unknown drafter 'medusa'; known drafters: lookup, suffix, model"
        ):
            registry()
        path.write_text('[pairs.x]\ntarget = "a"\ndrafters = ["model"]\n')
        with pytest.raises(PairError, match=r"drafter 'model' needs a draft"):
            registry()
    finally:
        monkeypatch.delenv("SPECDEC_CONFIG_FILE")
        reload_settings()


@pytest.mark.parametrize(
    "text, message",
    [
        ('[pair.x]\ntarget = "a"\n', "unknown table or key 'pair'; a pairs file has [pairs.NAME] and [files.NAME]"),
        ('[pairs."org/x"]\ntarget = "a"\n', "pair 'org/x': a pair's name is letters, digits"),
        ('[pairs.x]\ntarget = "a"\ndraft = ""\n', "pair 'x': draft is empty"),
        ('[pairs.x]\ntarget = " "\n', "pair 'x': target is empty"),
        ('[pairs.x]\ntarget = "a"\ndraft = "layers:a,b"\n', "draft 'layers:a,b': name the target's layers"),
        ('[pairs.x]\ntarget = "a"\nchat_template = "chatml_tools"\n', "chat_template 'chatml_tools' is no built-in"),
        ('files = "x"\n', "'files' must be a table of files"),
        ('[pairs.x]\ntarget = "a"\ndrafters = ["lookup", "lookup"]\n', "name 'lookup' twice; list each once"),
        (
            '[files."m.gguf"]\npackage = "p{n}"\nparts = 1000000000\nversion = "1"\nsize = 1\nsha256 = "'
            + "0" * 64
            + '"\n',
            "parts must be 1 to 1000",
        ),
        ('[pairs.x]\ntarget = "a"\ndescription = "caf\xe9"\n', "not UTF-8 text (byte 42); save it as UTF-8"),
    ],
)
def test_a_pairs_file_that_cannot_mean_what_it_says_is_one_error_naming_it(text, message, tmp_path, monkeypatch):
    """A [pair.x] typo (a pair that silently did not exist), a name no queue or file can hold, an
    empty or unreadable reference, a misspelt template name (it became every chat's text), a
    Latin-1 file (a traceback): each is one PairError naming the key, when the file is read."""
    from specdec_llm.pairs.files import sources
    from specdec_llm.settings import reload_settings

    path = tmp_path / "pairs.toml"
    path.write_bytes(text.encode("latin-1"))
    monkeypatch.setenv("SPECDEC_CONFIG_FILE", str(path))
    reload_settings()
    try:
        with pytest.raises(PairError, match=re.escape(message)):
            registry()
            sources()
    finally:
        monkeypatch.delenv("SPECDEC_CONFIG_FILE")
        reload_settings()


@pytest.mark.parametrize(
    "line, message",
    [
        # a string "false" is truthy: it must never reach from_pretrained as trust_remote_code
        (
            'trust_remote_code = "false"',
            "trust_remote_code must be true or false (a TOML boolean, without quotes), not 'false' (a string)",
        ),
        (
            'compile_draft = "yes"',
            "compile_draft must be true or false (a TOML boolean, without quotes), not 'yes' (a string)",
        ),
        ("k = true", 'k must be an integer or "auto", not True (a boolean)'),
        ("k = 2.5", 'k must be an integer or "auto", not 2.5 (a float)'),
        ('k = "4"', "k must be an integer or \"auto\", not '4' (a string)"),
        ("draft_vocab = true", "draft_vocab must be an integer, not True (a boolean)"),
        ('draft_vocab = "32768"', "draft_vocab must be an integer, not '32768' (a string)"),
        ("draft = 3", "draft must be a string, not 3 (an integer)"),
        ("dtype = 16", "dtype must be a string, not 16 (an integer)"),
        ("device = 0", "device must be a string, not 0 (an integer)"),
        ('dtype = "fp16"', "dtype 'fp16' unknown; use one of float32, bfloat16, float16"),
        ('device = "gpu"', "device 'gpu' is not a device; use cpu, cuda, cuda:N or mps"),
        (
            'drafters = "lookup"',
            'drafters must be a list of strings, e.g. ["lookup", "suffix"], not \'lookup\' (a string)',
        ),
        ("drafters = [1]", "drafters must be a list of strings"),
        ("chat_template = 1", "chat_template must be a string, not 1 (an integer)"),
        ("description = false", "description must be a string, not False (a boolean)"),
        ("description = { a = 1 }", "description must be a string, not {'a': 1} (a table)"),
    ],
)
def test_every_key_of_a_pair_is_type_checked(tmp_path, monkeypatch, line, message):
    from specdec_llm.settings import reload_settings

    path = tmp_path / "pairs.toml"
    path.write_text(f'[pairs.x]\ntarget = "a"\n{line}\n')
    monkeypatch.setenv("SPECDEC_CONFIG_FILE", str(path))
    reload_settings()
    try:
        with pytest.raises(PairError) as e:
            registry()
        assert str(e.value).startswith(f"{path}: pair 'x': {message}"), str(e.value)
        path.write_text("[pairs.x]\ntarget = 7\n")
        with pytest.raises(PairError, match=r"pair 'x': target must be a string, not 7"):
            registry()
    finally:
        monkeypatch.delenv("SPECDEC_CONFIG_FILE")
        reload_settings()


def test_every_pair_key_has_a_type_and_the_right_types_pass(tmp_path):
    from specdec_llm.pairs.spec import KEY_TYPES, read_toml

    assert set(KEY_TYPES) == set(PairSpec.__dataclass_fields__) - {"name", "source"}  # a new key needs its type
    text = (
        '[pairs.x]\ntarget = "a"\ndraft = "quantized:int4"\ndtype = "float32"\ndevice = "cpu"\nk = 4\n'
        'drafters = ["lookup", "quantized"]\ntrust_remote_code = false\ncompile_draft = true\n'
        'chat_template = "gemma"\ndraft_vocab = 32768\ndescription = "d"\n'
    )
    spec = read_toml(text, "f.toml")["x"]
    assert spec.trust_remote_code is False and spec.compile_draft is True and spec.k == 4


def test_tiny_pair_generates_text(pairs_file):
    pair = load_pair("tiny")
    res = pair.decoder().generate(GenerationRequest(prompt="The quick brown", max_new_tokens=12, k=2))
    assert res.stats.output_tokens >= 1 and isinstance(res.text, str)
    assert pair.draft_info["kind"] == "model"


def test_shared_tensor_draft_holds_shared_tensors_once(pairs_file):
    pair = load_pair("tiny-shared")
    t, d = pair.target, pair.draft
    assert d.model.embed_tokens.weight.data_ptr() == t.model.embed_tokens.weight.data_ptr()
    assert d.lm_head.weight.data_ptr() == t.lm_head.weight.data_ptr()
    assert d.model.norm.weight.data_ptr() == t.model.norm.weight.data_ptr()
    # the draft's layers are its own copies
    assert d.model.layers[0].mlp.up_proj.weight.data_ptr() != t.model.layers[0].mlp.up_proj.weight.data_ptr()
    target_ptrs = {p.data_ptr() for p in t.parameters()}
    own = [p for p in d.parameters() if p.data_ptr() not in target_ptrs]
    assert sum(p.numel() for p in own) == sum(p.numel() for p in t.model.layers[0].parameters())
    assert pair.draft_info == {"kind": "placeholder", "init_layers": [0], "trained": False}


def test_vocabulary_mismatch_is_refused(tmp_path, tiny_pair_dir):
    other = tiny_tokenizer(vocab=300)
    other_model = tiny_llama(5, vocab=len(other), layers=1)
    other_model.save_pretrained(tmp_path / "other")
    # a tokenizer trained on different text: same size class, different ids
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["zzz yyy xxx www"] * 5, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path / "other")
    spec = PairSpec(name="mismatch", target=str(tiny_pair_dir / "target"), draft=str(tmp_path / "other"))
    with pytest.raises(PairError, match=r"vocabulary mismatch: target .*target and draft .*other"):
        load_pair(spec)


def test_padded_embedding_compares_only_the_shared_vocabulary(tmp_path, tiny_pair_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair_dir / "target")
    padded = tiny_llama(3, vocab=len(tok) + 64, layers=1)  # e.g. 151936 vs 152064
    padded.save_pretrained(tmp_path / "padded")
    tok.save_pretrained(tmp_path / "padded")
    pair = load_pair(PairSpec(name="padded", target=str(tiny_pair_dir / "target"), draft=str(tmp_path / "padded")))
    assert pair.vocab_size == len(tok)
    res = pair.decoder().generate(GenerationRequest(prompt="The quick", max_new_tokens=10, k=3))
    assert all(t < len(tok) for t in res.token_ids)


def test_cli_generate_json(pairs_file):
    r = runner.invoke(
        app, ["generate", "The quick brown", "--pair", "tiny", "--max-new-tokens", "9", "--k", "2", "--json"]
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert set(out) == {"text", "token_ids", "finish_reason", "stats"}
    assert out["stats"]["output_tokens"] == len(out["token_ids"]) <= 9
    assert out["stats"]["k_values"][0] == 2
    for field in (
        "prompt_tokens",
        "draft_tokens_proposed",
        "draft_tokens_accepted",
        "acceptance_rate",
        "mean_accepted_length",
        "per_position_acceptance",
        "target_forwards",
        "draft_forwards",
        "draft_time_s",
        "target_time_s",
        "wall_time_s",
        "time_to_first_token_s",
        "tokens_per_s",
        "finish_reason",
    ):
        assert field in out["stats"]


def test_cli_generate_chat_and_baseline(pairs_file):
    r = runner.invoke(
        app, ["generate", "hello", "--pair", "tiny", "--chat", "--mode", "baseline", "--max-new-tokens", "5", "--json"]
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["stats"]["draft_forwards"] == 0
    assert out["stats"]["prompt_tokens"] > 5  # the chat template wrapped the prompt


@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", ""], "prompt: is empty"),
        (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens: 0 is below 1"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--top-p", "2"], "top_p"),
        (["generate", "hi", "--top-k", "-3"], "top_k"),
        (["generate", "hi", "--k", "-1"], "k: -1 is below 0"),
        (["generate", "hi", "--k", "lots"], "k: 'lots' is not a number"),
        (["generate", "hi", "--pair", "nope"], "pair: unknown pair 'nope'"),
        (["generate", "hi", "--mode", "warp"], "mode: unknown mode"),
        (
            ["generate", "hi", "--pair", "smollm2-135m", "--drafter", "eagle"],
            "drafter: unknown drafter 'eagle' for pair smollm2-135m; use one of: auto, lookup, suffix, model",
        ),
        (["generate", "x " * 600, "--pair", "tiny"], "prompt: is .* tokens but the model's context is 512"),
    ],
)
def test_cli_bad_input_exit_2_one_line(pairs_file, args, message):
    r = runner.invoke(app, args)
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    import re

    assert re.search(message, lines[0]), lines[0]


def test_cli_pairs_list_and_show(pairs_file):
    r = runner.invoke(app, ["pairs", "list"])
    assert r.exit_code == 0 and "smollm2-135m" in r.stdout and "tiny" in r.stdout
    r = runner.invoke(app, ["pairs", "show", "smollm2-135m"])
    info = json.loads(r.stdout)
    assert info["draft"] == "pkg:specdec_llm/drafts/smollm2-135m" and "draft_note" not in info  # the distilled draft
    assert info["drafters"] == ["lookup", "suffix", "model"]
    r = runner.invoke(app, ["pairs", "show", "tiny-shared", "--load"])
    info = json.loads(r.stdout)
    assert info["draft_info"]["kind"] == "placeholder" and info["draft_own_bytes"] > 0
    assert "PLACEHOLDER" in info["draft_note"]
    r = runner.invoke(app, ["pairs", "show", "nope"])
    assert r.exit_code == 2


def test_cli_eval_pair_per_category(pairs_file, tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": f"The quick {i}", "category": c} for i, c in enumerate(["a", "a", "a", "b", "b"])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = runner.invoke(
        app,
        [
            "eval-pair",
            "--pair",
            "tiny-shared",
            "--prompts",
            str(path),
            "--limit",
            "2",
            "--max-new-tokens",
            "8",
            "--k",
            "3",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["overall"]["prompts"] == 4 and set(out["categories"]) == {"a", "b"}
    assert 0 <= out["overall"]["acceptance_rate"] <= 1 and len(out["overall"]["per_position_acceptance"]) == 3
    r = runner.invoke(app, ["eval-pair", "--pair", "tiny", "--prompts", str(tmp_path / "missing.jsonl")])
    assert r.exit_code == 2 and "prompts:" in r.stderr
