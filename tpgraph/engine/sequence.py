"""A request's token state and its KV blocks."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    finished: bool = False

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
