"""Build a tiny random-weight DeepSeek-V2 (MLA attention) model (no hub).

Run with the vLLM venv's Python: ``python tiny_deepseek_v2.py OUT_DIR``. Its
KV cache is MLA's one latent buffer per layer: kv_lora_rank 512 + rope 64 =
576 values per token, the only size vLLM's CPU MLA decode kernel compiles
for (vLLM forces block_size 16 and turns prefix caching off for MLA on CPU).
Two dense layers (no routed experts used), the tokenizer of tiny_llama.py,
fixed seed.
"""

from __future__ import annotations

import pathlib
import sys

from tiny_llama import save_model, save_tokenizer


def build(out: pathlib.Path) -> None:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    save_tokenizer(out)
    torch.manual_seed(1234)
    cfg = DeepseekV2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
        torch_dtype="bfloat16", tie_word_embeddings=False, rope_scaling=None,
        initializer_range=0.2)  # as in tiny_gemma3.py: greedy output that depends on the prompt
    save_model(DeepseekV2ForCausalLM(cfg), out)


if __name__ == "__main__":
    build(pathlib.Path(sys.argv[1]))
