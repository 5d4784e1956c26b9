"""Reading vLLM-shaped log-probabilities (per token {id: Logprob}, the token's own entry and the top k ranked 1..k) back
into the lists tests compare."""

from __future__ import annotations

from tpgraph.engine.logprob import Logprob


def own_logprobs(entries: list[dict[int, Logprob] | None], ids: list[int]) -> list[float | None]:
    """Each entry's own token's log-probability (None where the entry is None: a prompt's first token)."""
    return [None if e is None else e[t].logprob for e, t in zip(entries, ids, strict=True)]


def ranked(entries: list[dict[int, Logprob] | None], k: int) -> list[list[tuple[int, float]]]:
    """Each entry's k most likely (id, log-probability) in rank order ([] where the entry is None). The token's own
    entry, when it is not among them, ranks past k (the k ids are at least as likely), so the ranks 1..k are theirs."""
    return [[] if e is None else [(t, v.logprob) for t, v in sorted(e.items(), key=lambda kv: kv[1].rank)
                                  if v.rank <= k] for e in entries]


def top_ids(entries: list[dict[int, Logprob] | None], k: int) -> list[list[int]]:
    return [[t for t, _ in top] for top in ranked(entries, k)]
