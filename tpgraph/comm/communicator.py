"""TPCommunicator: the one object model code calls for cross-rank traffic.

Row-parallel layers call `all_reduce` explicitly at their output; the vocab-parallel head calls
`all_gather`. Today both are backed by torch.distributed on the TP group; the custom all-reduce
plugs in behind the same interface.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpgraph.distributed import ParallelState


class TPCommunicator:
    def __init__(self, state: ParallelState) -> None:
        self.state = state
        self.world_size = state.world_size
        self.rank = state.rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the TP group. In place; returns x."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.state.tp_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's x along dim, in rank order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.state.tp_group)
        return torch.cat(parts, dim=dim)
