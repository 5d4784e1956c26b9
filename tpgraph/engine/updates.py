"""What the engine says of a request after each step (StepUpdate), and how it says it refused one (REFUSED): the
engine's side and the HTTP front ends' share them, and a front end's process imports nothing of the engine beside
(no torch, no triton: a front end of several, --api-server-count, is an interpreter of its own)."""

from __future__ import annotations

from dataclasses import dataclass

# the finish reason of a request the engine refused when it came to add it (a RequestError: a 400 at the server),
# as against "error", a failure
REFUSED = "refused"


@dataclass
class StepUpdate:
    """One sequence's news from one step: its new token (if one was sampled), text, and whether it finished."""

    request_id: str
    sample_index: int
    token_id: int | None
    text: str
    finish_reason: str | None = None
    # with finish_reason "stop": the stop string or stop_token_ids entry that ended it (None for an EOS), as vLLM's
    stop_reason: int | str | None = None
    logprob: float | None = None
    rank: int | None = None  # (with logprob) the token's rank, 1 the most likely
    top_logprobs: list[tuple[int, float]] | None = None
    # with a sequence's first token, where its params ask: (id, log-probability, top alternatives) of each prompt
    # token after the first
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    prompt_ranks: list[int] | None = None  # (with prompt_logprobs) each prompt token's rank, 1 the most likely
    cached_tokens: int | None = None  # with a sequence's first token: its prompt tokens read from the prefix cache
    queue_s: float | None = None  # with a sequence's first token: seconds from the engine's taking it to its admission
    # with a sequence's first token: seconds from its first admission to that token's reading back (vLLM's prefill time)
    prefill_s: float | None = None
