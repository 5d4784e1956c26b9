"""Rotary position embedding (rotate-half layout, as HF Llama), with linear, llama3 and yarn scaling.

The cos/sin tables hold a row for each position the engine can reach (its max_model_len, not the model's whole
context, which for long-context models is large memory never read); each step's kernel (kernels/rope_store.py)
indexes them by position, rotates q and k, and writes k and v into the paged cache.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tpgraph.config import RopeConfig
from tpgraph.kernels.rope_store import rope_cos_sin_table


def inv_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """fp32 inverse frequencies after the configured scaling."""
    powers = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv_freq = 1.0 / powers
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "yarn":
        return _yarn(powers, head_dim, rope)
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


def _yarn(powers: torch.Tensor, head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are divided by `factor`,
    those past beta_fast kept, a linear ramp over the dimensions between (as transformers computes them: the divided
    ones as 1 / (factor x theta^i), which rounds otherwise than (1 / theta^i) / factor where factor is no power of
    two). `powers`: theta^i, each frequency's inverse."""
    def dimension(rotations: float) -> float:  # (the dimension whose frequency turns this often over the context)
        ctx = rope.original_max_position_embeddings
        return head_dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dimension(rope.beta_fast), dimension(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    kept = 1 - ramp  # (the share of each frequency left as it is)
    return 1.0 / (rope.factor * powers) * (1 - kept) + 1.0 / powers * kept


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, head_dim / 2] in the model dtype, as HF computes them per position."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self._inv_freq, self._scale = inv_frequencies(head_dim, rope), rope.attention_factor
        self.register_buffer("cos", None, persistent=False)
        self.register_buffer("sin", None, persistent=False)
        self._build(max_positions, dtype, device)

    def _build(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        self.cos = self.sin = None  # (the old tables freed before the new ones are made)
        self.cos, self.sin = rope_cos_sin_table(self._inv_freq, max_positions, dtype, device, self._scale)

    def resize(self, max_positions: int) -> None:
        """Tables of max_positions rows (each row as computed for its position, whatever the size)."""
        if self.cos.shape[0] != max_positions:
            self._build(max_positions, self.cos.dtype, self.cos.device)

    @property
    def nbytes(self) -> int:
        return self.cos.nbytes + self.sin.nbytes

    @property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin
