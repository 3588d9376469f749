"""Build a tiny random-weight Llama and a locally trained tokenizer (no hub).

Run with the vLLM venv's Python: ``python tiny_llama.py OUT_DIR [MAX_POSITIONS]``
(default 2048: the longest ``--max-model-len`` vLLM accepts for it). The model is
what vLLM's CPU attention accepts (head_dim 32, bf16); the weights come from a
fixed seed, so every run builds the same model and greedy outputs are
reproducible across processes.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a paged kv cache commits memory only while blocks are in use",
    "engines share one machine and memory follows the load",
    "prefix caching keeps full blocks that another request may reuse",
    "the scheduler preempts a request when the pool is short of blocks",
    "zero copy tensors view memory that the allocator committed",
] * 50


def save_tokenizer(out: pathlib.Path) -> None:
    """A byte-level BPE of 512 tokens trained on CORPUS (ids 0-2: unk, bos, eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)


def save_model(model: Any, out: pathlib.Path) -> None:
    """Widen the model's logit margins and save it in bf16.

    Wide logit margins: with the default init (std 0.02) the top two logits
    of a random model sit within bf16 rounding of each other, so greedy
    tokens would depend on batch composition (kernel reduction order), not
    on the KV cache. The tests compare runs whose batches differ.
    """
    import torch

    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)
    model.to(torch.bfloat16).save_pretrained(out)


def build(out: pathlib.Path, max_positions: int = 2048) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    save_tokenizer(out)
    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=max_positions,
                      bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", tie_word_embeddings=False)
    save_model(LlamaForCausalLM(cfg), out)
    (out / "kvpool-tiny.json").write_text(json.dumps({"built": True}))


if __name__ == "__main__":
    build(pathlib.Path(sys.argv[1]), *(int(a) for a in sys.argv[2:3]))
