"""vLLM's Logprob, and the one shape a token's log-probabilities take where vLLM gives Logprob dicts: the offline
outputs' `logprobs` and `prompt_logprobs` (CompletionOutput, GenerationOutput) and the server's `prompt_logprobs`
field. Code written against vLLM's LLM.generate reads `out.outputs[0].logprobs[i][token_id].logprob` as there."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability, its rank (1 for the most likely; the ids at least as likely, as vLLM counts) and its
    text (None where the request asked detokenize=False)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_entry(token: int, logprob: float, rank: int | None, top: Sequence[tuple[int, float]],
                  decode: Callable[[int], str] | None) -> dict[int, Logprob]:
    """{token: its Logprob, then each top alternative ranked 1 to k}: the token first, as vLLM orders them. A token
    among the top takes its place's rank there (as vLLM's: tied ids get one rank each)."""
    def text(t: int) -> str | None:
        return None if decode is None else decode(t)

    entry = {token: Logprob(logprob, rank, text(token))}
    for r, (t, v) in enumerate(top, 1):
        entry[t] = Logprob(v, r, text(t))
    return entry
