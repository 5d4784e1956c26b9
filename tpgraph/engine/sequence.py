"""A request's token state and its KV blocks (one Sequence per sample: a request with n > 1 has n)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpgraph.engine.sampling_params import SamplingParams

# An output token the GPU has sampled but the host has not read yet (overlapped scheduling): it holds its place in
# output_ids, so lengths and positions are right, and the engine writes the real id in when the step resolves.
PENDING_TOKEN = -1


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its KV blocks given back; it will be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


# (compared by identity: a queue's remove() compared every field of every sequence it passed, per abort)
@dataclass(eq=False)
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
    # prefix caching (prefix_cache.py): the names of its whole blocks of known ids so far (hashed once), and how many
    # leading blocks of block_table carry theirs
    block_names: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    # waiting (not admitted) for a running sequence to compute this many blocks of its prompt, to share them
    awaited_blocks: int = 0
    # params.prompt_logprobs: (id, log-probability, top alternatives) of prompt tokens 1, 2, ... read back so far
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)  # (beside prompt_logprobs) each token's rank
    # (a request's later samples) the sample that computes the prompt log-probabilities this one reports: one prompt's
    # are the same for all, so they are computed once, and the others wait for them and share its cached prompt
    prompt_logprobs_from: Sequence | None = field(default=None, repr=False)
    prompt_cached: int | None = None  # prompt tokens found in the prefix cache when first admitted (then fixed)
    queued_at: float = field(default_factory=time.perf_counter)  # (perf_counter) when the engine took it
    queue_s: float | None = None  # from then to its first admission (vLLM's queue time)
    bad_words: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences (bad_words.py)
    # the ids that would stop it, which its row bans before min_tokens (its stop ids and EOS ids, sorted)
    held_bans: tuple[int, ...] = ()
    # its one-token bad words' ids (sorted), banned at every step. This and held_bans are each one tuple for good, so
    # that the sampler uploads them once (KeptUploads), not each step
    word_bans: tuple[int, ...] = field(init=False, default=())
    # its bad words of more than one token: their bans read its last output tokens, so its row must then see the step
    # in flight read back (reads_output: set once, as the step loop asks of every row)
    long_bad_words: tuple[tuple[int, ...], ...] = field(init=False, default=())
    reads_output: bool = field(init=False, default=False)
    grammar: Any = None  # params.structured: a GrammarState, after the tokens read back (structured.py)
    # the engine's SampleRow for it (core.py's _sample_row), kept while it stays the same (reads_output: never), and
    # whether it bans held_bans (below min_tokens): built afresh each step, its rows cost ~1.9 us each
    sample_row: Any = field(default=None, init=False, repr=False)
    sample_row_held: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.word_bans = tuple(sorted({w[0] for w in self.bad_words if len(w) == 1}))
        self.long_bad_words = tuple(w for w in self.bad_words if len(w) > 1)
        self.reads_output = bool(self.long_bad_words)

    @property
    def num_uncached(self) -> int:
        return len(self) - self.num_cached

    @property
    def computes_prompt_logprobs(self) -> bool:
        """Does its prefill compute prompt log-probabilities (its request's, for every sample)?"""
        return self.params is not None and self.params.prompt_logprobs is not None and self.prompt_logprobs_from is None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Does it compute prompt log-probabilities that are not all read back yet? (Its prompt must then run in
        full: tokens taken from the prefix cache run no forward, so they have no logits.)"""
        return self.computes_prompt_logprobs and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def awaits_prompt_logprobs(self) -> bool:
        """Is it a later sample whose request's prompt log-probabilities are not all read back yet? (It waits for
        them, and then begins from the prompt the first sample left in the prefix cache.)"""
        return self.prompt_logprobs_from is not None and self.prompt_logprobs_from.needs_prompt_logprobs

    @property
    def reported_prompt_logprobs(self) -> Sequence:
        """The sample whose prompt log-probabilities this one reports: its own, or its request's first sample's."""
        return self.prompt_logprobs_from or self

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_span(self, start: int, end: int) -> list[int]:
        """token_ids[start:end], cut from the prompt and outputs as they are (token_ids copies the whole sequence:
        a block's or a chunk's ids read through it cost the sequence's length each time)."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def reached_length(self, max_model_len: int, outputs: int | None = None) -> bool:
        """Does the sequence end by length once it has `outputs` output tokens (default: all it has)? At
        max_new_tokens, or at max_model_len tokens in all."""
        outputs = len(self.output_ids) if outputs is None else outputs
        return outputs >= self.max_new_tokens or len(self.prompt_ids) + outputs >= max_model_len

    def add_pending(self) -> int:
        """Hold the place of a token sampled on the GPU and not read back yet; returns its index in output_ids."""
        self.output_ids.append(PENDING_TOKEN)
        self.num_pending += 1
        return len(self.output_ids) - 1

    def resolve_pending(self, index: int, token: int) -> None:
        """The token read back for the placeholder at output index `index`."""
        if self.output_ids[index] != PENDING_TOKEN:
            raise ValueError(f"sequence {self.seq_id}: output {index} is not pending")
        self.output_ids[index] = token
        self.num_pending -= 1

    def drop_pending(self, keep: int | None = None) -> None:
        """Drop every output after the first `keep` (default: the unresolved placeholders at the end): tokens sampled
        for a sequence that had already ended are not its own."""
        if keep is None:
            keep = len(self.output_ids) - self.num_pending
        dropped = self.output_ids[keep:]
        del self.output_ids[keep:]
        self.num_pending -= sum(t == PENDING_TOKEN for t in dropped)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def forget_blocks(self) -> None:
        """Its blocks were given back: no table, nothing cached, none of them named (its block names still hold)."""
        self.block_table = []
        self.num_cached = self.num_registered = 0

    def next_token_fits(self, block_size: int) -> bool:
        """Whether its next token's KV has room in the blocks it holds (a decoding row needs no block reserved)."""
        return self.num_cached < len(self.block_table) * block_size

    def blocks_needed(self, block_size: int, num_tokens: int) -> int:
        """Extra blocks to hold num_tokens in total."""
        return max(0, -(-num_tokens // block_size) - len(self.block_table))
