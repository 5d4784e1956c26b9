"""The scheduler's settings (its policy and token budget) and their checks: read by the command line and EngineConfig
before any rank starts, without the scheduler itself (its KV cache, and through it torch and triton)."""

from __future__ import annotations

from dataclasses import dataclass

from tpgraph.checks import positive_int
from tpgraph.errors import ConfigError

SCHEDULING_POLICIES = ("fcfs", "priority")  # (vLLM's --scheduling-policy)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # or "priority": the queue in (priority, arrival) order, the last of it preempted first

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            positive_int(name, getattr(self, name))
        check_token_budget(self.max_num_batched_tokens, self.max_num_seqs, self.max_model_len,
                           self.enable_chunked_prefill)
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")


DEFAULT_CHUNK_TOKENS = 8192  # (chunked prefill) the default budget's cap: longer prompts run in chunks of it
MIN_DEFAULT_BUDGET = 512


def default_token_budget(max_model_len: int, max_num_seqs: int, chunked_prefill: bool = True) -> int:
    """max_num_batched_tokens where none is given: max_model_len, capped at DEFAULT_CHUNK_TOKENS with chunked prefill
    (without it a step must hold a whole prompt of max_model_len, as vLLM's default then holds); at least
    MIN_DEFAULT_BUDGET, and a decode token for each of max_num_seqs sequences."""
    tokens = min(max_model_len, DEFAULT_CHUNK_TOKENS) if chunked_prefill else max_model_len
    return max(tokens, MIN_DEFAULT_BUDGET, max_num_seqs)


def check_token_budget(tokens: int, max_num_seqs: int, max_model_len: int | None, chunked_prefill: bool) -> None:
    """max_num_batched_tokens against the other limits, as vLLM checks it (EngineConfig says it before the weights
    load, SchedulerConfig after; max_model_len None: not known yet)."""
    if tokens < max_num_seqs:
        raise ConfigError(f"max_num_batched_tokens ({tokens}) must be at least max_num_seqs ({max_num_seqs}): a step "
                          f"decodes a token for each running sequence, so fewer tokens would run fewer sequences at a "
                          f"time than max_num_seqs", ("max_num_batched_tokens", "max_num_seqs"))
    if not chunked_prefill and max_model_len is not None and tokens < max_model_len:
        raise ConfigError(f"without chunked prefill, max_num_batched_tokens ({tokens}) must hold a whole prompt of "
                          f"max_model_len ({max_model_len}) tokens", ("max_num_batched_tokens", "max_model_len"))
