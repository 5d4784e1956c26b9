"""Views into the regions of `lamport.local_channels` (ranks emulated in one process), for tests."""

from __future__ import annotations

import torch

from tpgraph.kernels.lamport import CONTROL_BYTES, Channel, local_channels

emulated_channels = local_channels


def slots_view(channel: Channel, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """This rank's slots [3, world_size, slot_elems] as `dtype` (a view of its region)."""
    region = channel.keepalive[channel.rank]
    return region[CONTROL_BYTES // 4:].view(dtype)[: 3 * channel.world_size * channel.slot_elems].view(
        3, channel.world_size, channel.slot_elems)


def control_view(channel: Channel) -> torch.Tensor:
    """push_phase, recv_phase, rows_used[3] of this rank."""
    return channel.keepalive[channel.rank][:5]
