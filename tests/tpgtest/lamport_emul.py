"""Ranks of the fused GEMV all-reduce emulated in one process: one channel region per rank, every rank's channel
holding all of their addresses, so that rank r's push writes into the others' regions as over NVLink. Kernels run
rank after rank (every rank's push, then every rank's receive), which the Lamport slots allow: a receive only waits
for data that is already there."""

from __future__ import annotations

import torch

from tpgraph.kernels.lamport import CONTROL_BYTES, SENTINEL_WORD, Channel, region_bytes


def armed_region(world_size: int, slot_elems: int, device: torch.device | str) -> torch.Tensor:
    """One rank's region as int32 words: the control block zero, every slot armed."""
    region = torch.zeros(region_bytes(world_size, slot_elems) // 4, dtype=torch.int32, device=device)
    region[CONTROL_BYTES // 4:] = SENTINEL_WORD - (1 << 32)  # the word's bits as an int32
    return region


def emulated_channels(world_size: int, slot_elems: int, device: torch.device | str = "cpu") -> list[Channel]:
    regions = [armed_region(world_size, slot_elems, device) for _ in range(world_size)]
    addrs = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64, device=device)
    return [Channel(addrs, rank, world_size, slot_elems, keepalive=tuple(regions)) for rank in range(world_size)]


def slots_view(channel: Channel, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """This rank's slots [3, world_size, slot_elems] as `dtype` (a view of its emulated region)."""
    region = channel.keepalive[channel.rank]
    return region[CONTROL_BYTES // 4:].view(dtype)[: 3 * channel.world_size * channel.slot_elems].view(
        3, channel.world_size, channel.slot_elems)


def control_view(channel: Channel) -> torch.Tensor:
    """push_phase, recv_phase, rows_used[3] of this rank."""
    return channel.keepalive[channel.rank][:5]
