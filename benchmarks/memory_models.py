"""Models of the memory benchmarks, built from a config in code (no download): ``varlen calibrate
--model benchmarks.memory_models:NAME``. transformers is imported here, at module level, as a
training script imports it (the measuring processes import this module before building).

- ``decoder_2x96``: the decoder of issue 22: Llama layout, 2 layers, width 96 (4 heads, MLP 384),
  eager attention, vocabulary 30,522 (BERT's), untied embeddings;
- ``gpt2_3x128``: another shape: GPT-2 layout (learned positions, LayerNorm, GELU MLP, tied
  embeddings), 3 layers, width 128, 4 heads, eager attention, the same vocabulary;
- ``llama_4x64_8h``: attention-heavy: 4 layers, width 64, 8 heads of 8, vocabulary 8,000.
"""

from __future__ import annotations

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB = 30522


def decoder_2x96():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=96, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=8192, attn_implementation="eager", tie_word_embeddings=False))


def gpt2_3x128():
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=3, n_head=4, n_positions=8192,
                                      attn_implementation="eager"))


def llama_4x64_8h():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=8000, hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=8192, attn_implementation="eager", tie_word_embeddings=False))
