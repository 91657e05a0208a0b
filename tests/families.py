"""Tiny random causal LMs of many families, built from transformers' own configs (nothing downloaded)."""

from __future__ import annotations

import torch

WINDOW = 8  # sliding windows in the tests: shorter than prompts and outputs, so the window matters
H, LAYERS, HEADS, KV = 64, 2, 4, 2


def _llama_like(cls_name: str, **extra):
    def build(vocab: int):
        import transformers as t

        cfg = getattr(t, cls_name)(
            vocab_size=vocab,
            hidden_size=H,
            intermediate_size=2 * H,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV,
            max_position_embeddings=512,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
            tie_word_embeddings=False,
            **extra,
        )
        return cfg

    return build


def _gpt2(vocab):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab,
        n_embd=H,
        n_layer=LAYERS,
        n_head=HEADS,
        n_positions=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


def _neox(vocab):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        vocab_size=vocab,
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def _falcon(vocab):
    from transformers import FalconConfig

    return FalconConfig(
        vocab_size=vocab,
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_kv_heads=KV,
        new_decoder_architecture=True,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


def _bloom(vocab):  # ALiBi: the position bias comes from the mask (hf.alibi_from_masks)
    from transformers import BloomConfig

    return BloomConfig(
        vocab_size=vocab,
        hidden_size=H,
        n_layer=LAYERS,
        n_head=HEADS,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


def _opt(vocab):
    from transformers import OPTConfig

    return OPTConfig(
        vocab_size=vocab,
        hidden_size=H,
        ffn_dim=2 * H,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        word_embed_proj_dim=H,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


CONFIGS = {
    "llama": _llama_like("LlamaConfig"),
    "qwen2": _llama_like("Qwen2Config"),
    "qwen2-sliding": _llama_like("Qwen2Config", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": _llama_like("Qwen3Config", head_dim=16),
    "phi3": _llama_like("Phi3Config"),
    "olmo2": _llama_like("Olmo2Config"),
    "granite": _llama_like("GraniteConfig"),
    "starcoder2": _llama_like("Starcoder2Config"),
    "cohere": _llama_like("CohereConfig"),
    "mixtral": _llama_like("MixtralConfig", num_local_experts=4, num_experts_per_tok=2),
    "mistral": _llama_like("MistralConfig", sliding_window=None),
    "mistral-sliding": _llama_like("MistralConfig", sliding_window=WINDOW),
    "gemma2": _llama_like("Gemma2Config", head_dim=16, sliding_window=WINDOW),
    "gemma3": _llama_like(
        "Gemma3TextConfig", head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
    ),
    "gpt2": _gpt2,
    "gpt-neox": _neox,
    "falcon": _falcon,
    "opt": _opt,
    "bloom": _bloom,
}


def tiny_family(name: str, seed: int = 0, vocab: int = 512):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = CONFIGS[name](vocab)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model
