"""Tiny random Hugging Face Llama (and Qwen2, Qwen3) checkpoints, written with save_pretrained (no network)."""

from __future__ import annotations

from pathlib import Path

import torch

# Each case names what it covers; all are small enough for CPU tests at TP 1, 2 and 4.
CASES: dict[str, dict] = {
    # Llama 2 shape: MHA, vocab not divisible by TP, untied, sharded into several files with an index.
    "llama2_vocab32003_sharded": dict(
        vocab_size=32003, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=256,
        rms_norm_eps=1e-5, shard_size="2MB",
    ),
    # Llama 3.2 shape: tied embeddings, llama3 rope scaling, GQA with 2 KV heads (< TP at TP=4).
    "llama32_tied_llama3rope_gqa": dict(
        vocab_size=1001, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16, rope_theta=500000.0),
    ),
    # Llama 3.1 shape: a single KV head (replicated on every rank), llama3 rope, untied, sharded.
    "llama31_kv1_sharded": dict(
        vocab_size=515, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, tie_word_embeddings=False, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=2.0,
                          original_max_position_embeddings=32, rope_theta=500000.0),
        shard_size="200KB",
    ),
    # a Llama with attention_bias and mlp_bias: column biases split with their rows (one KV head, replicated past TP=1),
    # the row-parallel ones (o, down) added once
    "llama_biases_kv1": dict(
        vocab_size=517, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, tie_word_embeddings=False, max_position_embeddings=256, rms_norm_eps=1e-5,
        attention_bias=True, mlp_bias=True,
    ),
    # Qwen2 (q, k, v biases), tied, 2 KV heads (< TP at TP=4), the unused window its configs name
    "qwen2_tied_gqa": dict(
        model="qwen2", vocab_size=601, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=1e6, sliding_window=32, use_sliding_window=False, max_window_layers=1,
    ),
    # Qwen3 (an RMSNorm over each head of q and k), 2 KV heads, untied, a head_dim apart from hidden / heads
    "qwen3_kv2_headdim": dict(
        model="qwen3", vocab_size=601, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
    ),
}

def vary(model: torch.nn.Module) -> torch.nn.Module:
    """Norms away from 1 and biases away from 0 (transformers' init), so that a wrong norm weight, or a bias left out
    or added twice, would show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.3)
    return model


PROMPTS = [[1, 17, 29, 3, 99], [5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 500], [7] * 17]


def make_checkpoint(case: str, out_dir: Path, seed: int = 0, init_std: float = 0.08) -> Path:
    """Write a random LlamaForCausalLM (Qwen2's or Qwen3's where the case says model="qwen2" or "qwen3") for `case`
    to out_dir and return it."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    kwargs = dict(CASES[case])
    shard_size = kwargs.pop("shard_size", None)
    rope = kwargs.pop("rope_scaling", None)
    if rope is not None:
        kwargs["rope_parameters"] = rope
    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kwargs.pop("model", "llama")]
    config = config_class(initializer_range=init_std, **kwargs)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    vary(model)
    save_kwargs = {"safe_serialization": True}
    if shard_size:
        save_kwargs["max_shard_size"] = shard_size
    model.save_pretrained(out_dir, **save_kwargs)
    return out_dir


def hf_greedy_reference(model_dir: Path, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list]:
    """HF's own greedy tokens, and its logits at each generated position ([steps, vocab] per prompt)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(steps):
                out = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(out.argmax()))
            full = model(torch.tensor([ids[:-1]])).logits[0]  # one pass: logits at every generated position
            tokens.append(ids[len(prompt):])
            logits.append(full[len(prompt) - 1:].float())
    return tokens, logits
