"""A request's token state and its KV blocks (one Sequence per sample: a request with n > 1 has n)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tpgraph.engine.sampling_params import SamplingParams

# An output token the GPU has sampled but the host has not read yet (overlapped scheduling): it holds its place in
# output_ids, so lengths and positions are right, and the engine writes the real id in when the step resolves.
PENDING_TOKEN = -1


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its KV blocks given back; it will be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    finished: bool = False
    # engine bookkeeping (the plain runner and the greedy loop leave these at their defaults)
    request_id: str = ""
    sample_index: int = 0
    params: SamplingParams | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_preemptions: int = 0
    num_pending: int = 0  # trailing output_ids that are PENDING_TOKEN (sampled on the GPU, not read back yet)

    @property
    def num_uncached(self) -> int:
        return len(self) - self.num_cached

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def blocks_needed(self, block_size: int, num_tokens: int) -> int:
        """Extra blocks to hold num_tokens in total."""
        return max(0, -(-num_tokens // block_size) - len(self.block_table))
