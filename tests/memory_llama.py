"""Config-built Hugging Face Llama models for the analytic-vs-measured test (no download).

transformers is imported at module level so that `varlen calibrate`'s parent process imports it
once and every forked measuring child starts with it loaded."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

_COMMON = {"attn_implementation": "eager", "tie_word_embeddings": False, "attention_dropout": 0.0}
SMALL = dict(_COMMON, vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024)
MEDIUM = dict(_COMMON, vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)


def small_llama():
    return LlamaForCausalLM(LlamaConfig(**SMALL))


def medium_llama():
    return LlamaForCausalLM(LlamaConfig(**MEDIUM))


def config_json(config: dict) -> dict:
    """What config.json of such a model holds (LlamaConfig's own serialisation)."""
    return LlamaConfig(**config).to_dict()
