"""Build a tiny random-weight Gemma 3 text model (no hub): a hybrid of five
sliding-window layers (window 64 tokens) and one full-attention layer, for
which vLLM builds six KV cache groups over one block pool.

Run with the vLLM venv's Python: ``python tiny_gemma3.py OUT_DIR``. Same
tokenizer as tiny_llama.py; head_dim 32 and bf16 for vLLM's CPU attention;
fixed seed, so every run builds the same model.
"""

from __future__ import annotations

import pathlib
import sys

from tiny_llama import save_model, save_tokenizer

WINDOW = 64


def build(out: pathlib.Path) -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    save_tokenizer(out)
    torch.manual_seed(1234)
    cfg = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], bos_token_id=1, eos_token_id=2, pad_token_id=0,
        torch_dtype="bfloat16", tie_word_embeddings=False,
        # Larger than the default 0.02: with it, greedy output of a random
        # Gemma 3 barely depends on the prompt, and outputs that repeat one
        # token would compare equal whatever the KV cache held.
        initializer_range=0.2)
    save_model(Gemma3ForCausalLM(cfg), out)


if __name__ == "__main__":
    build(pathlib.Path(sys.argv[1]))
