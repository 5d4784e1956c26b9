"""Prompt log-probabilities (SamplingParams.prompt_logprobs; the server's `echo` with `logprobs`): the
log-probability the model gives each prompt token after the ones before it, and its top alternatives. The first
prompt token has none.

A prefill chunk's hidden state at position p predicts token p + 1, so a chunk yields the entries of the prompt tokens
just after its positions. Their logits are gathered PASS_ROWS positions at a time (a whole 8192-token chunk's fp32
log-probabilities at Llama-3's vocabulary would take 4 GB), and what is kept is small, [m, 3 + 2k] a chunk, in the
sampler's packed layout, copied to the host while the GPU runs on and read with the step's tokens."""

from __future__ import annotations

import torch

from tpgraph.engine.sampler import packed_rows
from tpgraph.engine.sequence import Sequence
from tpgraph.kernels._rows import WIDE_M

PASS_ROWS = 256  # positions whose [rows, vocab] logits exist at once (the memory profile runs a pass of this many)
# fewer rows would run the lm_head through the small-M kernels, whose row counts Triton compiles apart (a first
# request's pass of 19 rows would compile one in its step); a pass is padded to this many, which cuBLAS takes
PASS_MIN_ROWS = WIDE_M + 1


def prompt_targets(seq: Sequence, start: int, n: int) -> range:
    """The prompt tokens whose entries a chunk of positions [start, start + n) gives and that seq has not read back
    yet (a recomputed prompt gives them again)."""
    first = max(start + 1, len(seq.prompt_logprobs) + 1)
    return range(first, min(start + n + 1, len(seq.prompt_ids)))


def packed_logprobs(compute_logits, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, k: int
                    ) -> torch.Tensor:
    """hidden[rows] [m, H], the positions before targets [m] -> [m, 3 + 2k] float64 on the device, the sampler's
    packed_rows of each target: its id, log-probability and rank, and the k most likely. Rows are taken a pass at a
    time, so no pass holds more than PASS_ROWS of anything. compute_logits gathers the vocabulary across ranks: every
    rank makes the same calls, as every rank runs the same chunks."""
    out = []
    for s in range(0, len(rows), PASS_ROWS):
        at = rows[s:s + PASS_ROWS]
        n = len(at)
        if n < PASS_MIN_ROWS:  # (the last row again; its copies are cut off below)
            at = torch.cat([at, at[-1:].expand(PASS_MIN_ROWS - n)])
        logits = compute_logits(hidden[at])[:n]
        logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        out.append(packed_rows(logprobs, targets[s:s + PASS_ROWS], k))
    return out[0] if len(out) == 1 else torch.cat(out)
