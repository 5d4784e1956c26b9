"""Views into the regions of `lamport.local_channels` (ranks emulated in one process), for tests."""

from __future__ import annotations

import torch

from tpgraph.kernels.lamport import PHASES, PHASES_BYTES, Channel


def slots_view(channel: Channel, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """This rank's slots [3, world_size, slot_elems] as `dtype` (a view of its region)."""
    region = channel.keepalive[channel.rank]
    n = PHASES * channel.world_size * channel.slot_elems
    return region[PHASES_BYTES // 4:].view(dtype)[:n].view(PHASES, channel.world_size, channel.slot_elems)


def phases_view(channel: Channel) -> torch.Tensor:
    """This rank's phase per 16-column granule."""
    return channel.keepalive[channel.rank][: PHASES_BYTES // 4]
