"""TPCommunicator: the one object model code calls for cross-rank traffic.

Row-parallel layers call `all_reduce` explicitly at their output; the vocab-parallel head calls
`all_gather`. All-reduce is a short chain: the custom all-reduce when it is allowed and the table picks
it, else NCCL (gloo on CPU). Use the returned tensor: the custom path may return a new one in graphs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tpgraph.comm.thresholds import WORLD_SIZES
from tpgraph.distributed import ParallelState, run_on_all_ranks
from tpgraph.errors import TPGraphError

logger = logging.getLogger(__name__)


class TPCommunicator:
    def __init__(self, state: ParallelState, use_custom_allreduce: bool = True) -> None:
        self.state = state
        self.world_size = state.world_size
        self.rank = state.rank
        self.custom = None
        self.custom_reason = "disabled by the caller" if not use_custom_allreduce else None
        if use_custom_allreduce:
            self.custom, self.custom_reason = _try_custom_allreduce(state)
        if state.is_driver and state.world_size > 1:
            if self.custom is not None:
                logger.info("all-reduce: custom (tables: %s), NCCL above its bands", self.custom.table.source)
            else:
                logger.info("all-reduce: NCCL/gloo only (%s)", self.custom_reason)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the TP group. Returns the result (x itself, or a new tensor from the custom path)."""
        if self.world_size == 1:
            return x
        if self.custom is not None:
            out = self.custom.try_all_reduce(x)
            if out is not None:
                return out
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

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Wrap CUDA-graph capture: custom all-reduce inputs captured inside are registered on exit."""
        if self.custom is None:
            yield
            return
        with self.custom.capture():
            yield

    def close(self) -> None:
        if self.custom is not None:
            self.custom.close()
            self.custom = None


def _try_custom_allreduce(state: ParallelState):
    """(CustomAllReduce, None) when every rank can use it, else (None, reason). Decided the same on all ranks."""
    if state.device.type != "cuda":
        return None, "not on CUDA"
    if state.world_size not in WORLD_SIZES:
        return None, f"world size {state.world_size} is outside {WORLD_SIZES.start}..{WORLD_SIZES.stop - 1}"
    from tpgraph._ext import extension_available

    if not extension_available():
        return None, "tpgraph._C is not built (no nvcc at install time)"
    from tpgraph.comm.custom_ar import CustomAllReduce

    try:
        return run_on_all_ranks(state, lambda: CustomAllReduce(state), "setting up the custom all-reduce"), None
    except TPGraphError as exc:
        logger.warning("custom all-reduce unavailable, using NCCL: %s", exc)
        return None, str(exc)
