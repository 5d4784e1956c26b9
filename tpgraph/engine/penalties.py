"""Repetition, frequency and presence penalties from token counts kept on the device.

A penalized sequence holds one row of a [rows, vocab] table: how often each token appears in its output, and which
tokens its prompt holds. The row is filled once from the host's ids when the sequence first needs it, and then grows
by each step's sampled ids on the device, in stream order. A step therefore neither waits for the host's copy of the
last token (penalties overlap like any other sampling) nor uploads a sequence's history again: per step the host
does a lookup per row, whatever the prompt's and output's lengths.

Rows are keyed by sequence id and reused least recently used first. A row is never taken from a sequence in the
same call, and the table holds the largest batch's rows, so a running sequence (sampled every step) keeps its row;
one that sits out (preempted) and loses it is filled again when it returns, by then with every token read back.
Rows without a key (direct use of the sampler) are filled for the call only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import torch

from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.engine.sequence import PENDING_TOKEN
from tpgraph.engine.uploads import to_device

# the most history tokens one upload fills rows from (16 bytes each on the device while it lasts: ids and rows); the
# memory profile's sampling step fills this many (sampler.worst_case_rows)
FILL_TOKENS = 1 << 19


class PenalizedRow(Protocol):
    """What the table reads from a sample row (sampler.SampleRow)."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    seq_id: int | None


class PenaltyTable:
    def __init__(self, rows: int, vocab: int, device: torch.device | str) -> None:
        if rows < 1 or vocab < 1:
            raise ValueError(f"a penalty table needs at least one row and one token, got {rows} x {vocab}")
        self.device = torch.device(device)
        self.counts = torch.zeros(rows, vocab, dtype=torch.int32, device=self.device)  # output tokens
        self.in_prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=self.device)
        self._rows: OrderedDict[int, int] = OrderedDict()  # seq id -> row, least recently used first
        self._free = list(range(rows - 1, -1, -1))
        self.fills = 0  # rows filled from the host's ids so far (a sequence's first step, or its return)

    @property
    def num_rows(self) -> int:
        return self.counts.shape[0]

    @property
    def vocab(self) -> int:
        return self.counts.shape[1]

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes + self.in_prompt.nbytes

    def clear(self) -> None:
        """Forget every sequence (a new engine numbers its sequences from 0 again)."""
        self._rows.clear()
        self._free = list(range(self.num_rows - 1, -1, -1))

    def rows_for(self, rows: list[PenalizedRow]) -> list[int]:
        """The table row of each row in `rows` (all penalized), filling those not held yet from the host's ids."""
        if len(rows) > self.num_rows:
            raise ValueError(f"{len(rows)} penalized rows in one step, but the penalty table holds {self.num_rows}")
        keys = {r.seq_id for r in rows if r.seq_id is not None}
        if len(keys) < sum(r.seq_id is not None for r in rows):
            raise ValueError("a sequence appears twice in one sampling step")
        out, to_fill, this_call_only = [], [], []
        for r in rows:
            row = self._rows.get(r.seq_id) if r.seq_id is not None else None
            if row is None:
                row = self._take(keys)
                if r.seq_id is not None:
                    self._rows[r.seq_id] = row
                else:
                    this_call_only.append(row)
                to_fill.append((row, r))
            else:
                self._rows.move_to_end(r.seq_id)
            out.append(row)
        if to_fill:
            self._fill(to_fill)
        self._free += this_call_only  # free once this call's rows are taken (their contents are read in stream order)
        return out

    def _take(self, keep: set[int]) -> int:
        if self._free:
            return self._free.pop()
        for key in self._rows:  # least recently used first
            if key not in keep:
                return self._rows.pop(key)
        raise AssertionError("unreachable: more rows asked than the table holds")

    def _fill(self, rows: list[tuple[int, PenalizedRow]]) -> None:
        """Counts and prompt marks of whole histories, from the host: an upload per FILL_TOKENS of them."""
        for _, r in rows:
            if PENDING_TOKEN in r.output_ids:
                raise ValueError("penalties need every output token on the host to fill a sequence's row, but one "
                                 "is still pending")
        index = to_device([row for row, _ in rows], torch.int64, self.device)
        self.counts.index_fill_(0, index, 0)
        self.in_prompt.index_fill_(0, index, False)
        chunk: list[tuple[int, PenalizedRow]] = []
        size = 0
        for row, r in rows:
            n = len(r.prompt_ids) + len(r.output_ids)
            if chunk and size + n > FILL_TOKENS:
                self._upload(chunk)
                chunk, size = [], 0
            chunk.append((row, r))
            size += n
        self._upload(chunk)
        self.fills += len(rows)

    def _upload(self, rows: list[tuple[int, PenalizedRow]]) -> None:
        prompt_rows = [row for row, r in rows for _ in r.prompt_ids]
        out_rows = [row for row, r in rows for _ in r.output_ids]
        ids = to_device([t for _, r in rows for t in r.prompt_ids] + [t for _, r in rows for t in r.output_ids],
                        torch.int64, self.device)
        at = to_device(prompt_rows + out_rows, torch.int64, self.device)
        n = len(prompt_rows)
        self.in_prompt.index_put_((at[:n], ids[:n]), torch.ones((), dtype=torch.bool, device=self.device))
        self.count(at[n:], ids[n:])

    def count(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Add one occurrence of ids[i] to table row rows[i] (a step's sampled ids, on the device)."""
        self.counts.index_put_((rows, ids), torch.ones((), dtype=torch.int32, device=self.device), accumulate=True)

    def apply(self, x: torch.Tensor, rows: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """x [B, vocab] fp32 logits of rows held at table rows `rows` [B] -> penalized logits (a new tensor).
        Repetition (HF: prompt and output tokens), frequency and presence (OpenAI: output tokens)."""
        if x.shape[1] != self.vocab:
            raise ValueError(f"logits of {x.shape[1]} tokens, but the penalty table counts {self.vocab}")
        counts = self.counts.index_select(0, rows).float()
        seen = self.in_prompt.index_select(0, rows) | (counts > 0)
        device = x.device
        rep = to_device([p.repetition_penalty for p in params], torch.float32, device).unsqueeze(1)
        freq = to_device([p.frequency_penalty for p in params], torch.float32, device).unsqueeze(1)
        pres = to_device([p.presence_penalty for p in params], torch.float32, device).unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        return x - freq * counts - pres * (counts > 0).float()
