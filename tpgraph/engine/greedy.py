"""A greedy generation loop straight over a ModelRunner, without the scheduler: what parity checks
(bench/hf_parity.py, the multi-rank and graph tests) compare, step by step, against a reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpgraph.engine.argmax import row_argmax
from tpgraph.engine.runner import ModelRunner
from tpgraph.engine.sequence import Sequence
from tpgraph.errors import ConfigError


@dataclass
class GreedyResult:
    tokens: list[list[int]]  # generated ids per prompt
    step_logits: list[torch.Tensor] = field(default_factory=list)  # per step [B, vocab] fp32 on CPU (if kept)


def greedy_generate(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int,
                    keep_logits: bool = False) -> GreedyResult:
    """Prefill all prompts together, then decode max_new_tokens for each (no EOS stops them: what parity checks
    compare, step by step).

    Every rank makes the same ids (from the same gathered logits, or the same all-reduced shard maxima), so they agree
    everywhere without a broadcast.
    """
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompts) > runner.cfg.max_batch:
        raise ConfigError(f"{len(prompts)} prompts exceed max_batch {runner.cfg.max_batch}")
    for i, p in enumerate(prompts):
        if not p:
            raise ConfigError(f"prompt {i} is empty")
        if len(p) + max_new_tokens > runner.max_model_len:
            raise ConfigError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                              f"max_model_len {runner.max_model_len}")
    seqs = [Sequence(i, list(p), max_new_tokens) for i, p in enumerate(prompts)]
    runner.forget_rows()  # (its sequence ids start from 0: a decode row an earlier owner left is not theirs)
    result = GreedyResult(tokens=[[] for _ in prompts])
    try:
        logits, ids = runner.prefill(seqs), None
        for step in range(max_new_tokens):  # (every sequence runs them all: they end together)
            if keep_logits:
                result.step_logits.append(logits.to("cpu", torch.float32, copy=True))  # (a runner reuses its buffer)
            for seq, tok in zip(seqs, (row_argmax(logits) if ids is None else ids).tolist(), strict=True):
                seq.output_ids.append(tok)
            if step == max_new_tokens - 1:
                break
            if keep_logits:
                logits = runner.decode(seqs)
            else:  # the step makes its greedy ids itself (at TP > 1 without gathering the logits)
                ids = runner.decode_greedy(seqs)
    finally:
        for seq in seqs:
            runner.free(seq)
    for seq in seqs:
        result.tokens[seq.seq_id] = seq.output_ids
    return result
