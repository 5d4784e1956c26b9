"""The control path: rank 0 tells every other rank, once per step, what changed (new requests, aborts, shutdown).

Every rank runs an identical EngineCore; applying the same changes in the same order keeps them in lockstep, so the
schedule itself never travels. A step's message is one broadcast on the gloo CPU group, sent before the step's GPU
work; while idle, rank 0 sends an empty message every `heartbeat_s` so waiting ranks can tell it is alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from tpgraph.distributed import ParallelState
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.engine.structured import StructuredOutput


@dataclass
class StepMessage:
    adds: list[tuple[str, list[int], SamplingParams]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    compiles: list[StructuredOutput] = field(default_factory=list)  # grammars rank 0 compiles ahead of their adds
    reset_prefix_cache: bool = False  # (after the adds and aborts)
    shutdown: bool = False

    @property
    def empty(self) -> bool:
        return not self.adds and not self.aborts and not self.compiles and not self.reset_prefix_cache \
            and not self.shutdown


class ControlPlane:
    def __init__(self, state: ParallelState) -> None:
        self.state = state

    @property
    def needed(self) -> bool:
        return self.state.world_size > 1

    def exchange(self, message: StepMessage | None = None) -> StepMessage:
        """Rank 0 passes the message and gets it back; every other rank gets rank 0's. One broadcast."""
        if not self.needed:
            return message or StepMessage()
        box = [message if self.state.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.state.control)
        return box[0]
