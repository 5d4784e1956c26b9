"""ShardSpec: which slice of which checkpoint tensor fills which part of a local parameter."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    param: torch.nn.Parameter  # the local parameter this slice lands in
    hf_name: str  # the tensor's name in the Hugging Face checkpoint
    hf_shape: tuple[int, ...]  # the full tensor's expected shape (from the config)
    dim: int  # the dimension along which the tensor is split (ignored when whole)
    src_start: int  # first index, along dim, of this rank's slice in the checkpoint tensor
    length: int  # slice length along dim
    dst_start: int = 0  # where along dim the slice lands in the local parameter (fused params)


def even_split(size: int, rank: int, world: int) -> tuple[int, int]:
    """(start, length) of rank's equal part of `size` (size must be divisible by world)."""
    part = size // world
    return rank * part, part


def whole(param: torch.nn.Parameter, hf_name: str) -> ShardSpec:
    """A replicated parameter: every rank reads the whole tensor."""
    shape = tuple(param.shape)
    return ShardSpec(param, hf_name, shape, 0, 0, shape[0])
