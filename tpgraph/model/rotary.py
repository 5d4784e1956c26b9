"""Rotary position embedding (rotate-half layout, as HF Llama), with linear and llama3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from tpgraph.config import RopeConfig


def inv_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """fp32 inverse frequencies after the configured scaling."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type != "llama3":
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly between.
    old_ctx = rope.original_max_position_embeddings
    low_freq_wavelen = old_ctx / rope.low_freq_factor
    high_freq_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, D]


class RotaryEmbedding(nn.Module):
    """cos/sin for a step's positions, computed once per forward and shared by every layer."""

    def __init__(self, head_dim: int, rope: RopeConfig, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_frequencies(head_dim, rope).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """positions [T] -> (cos, sin), each [T, 1, D] in `dtype`."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] -> rotated (same dtype as inputs)."""
    cos, sin = rope
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
