"""Repetition, frequency and presence penalties from token counts kept on the device.

A penalized sequence holds one slot (a row) of a [slots, vocab] table: how often each token appears in its output,
and which tokens its prompt holds. The slot is filled once from the host's ids when the sequence first needs it, and
then grows by each step's sampled ids on the device, in stream order. A step therefore neither waits for the host's
copy of the last token (penalties overlap like any other sampling) nor uploads a sequence's history again: per step
the host does a lookup per row, whatever the prompt's and output's lengths.

Slots are keyed by sequence id. The engine releases a sequence's slot when it finishes; otherwise slots are reused
least recently used first, never from a sequence in the same call. The table has a slot for each row of the largest
batch, so a running sequence (sampled every step) keeps its slot; one that sits out (preempted) and loses it is filled
again when it returns, by then with every token read back. Rows without a key (direct use of the sampler) are filled
for the call only. One engine owns a table: it clears it when it starts, as its sequence ids start from 0.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import torch

from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.engine.sequence import PENDING_TOKEN
from tpgraph.kernels import penalties as fused
from tpgraph.uploads import to_device, to_device_parts

# the most history tokens one upload fills slots from: on the device while it lasts, 16 bytes each (ids and slots)
# and the output counts' sort in index_put_; the memory profile's sampling step fills this many
# (sampler.worst_case_rows)
FILL_TOKENS = 1 << 19


class PenalizedRow(Protocol):
    """What the table reads from a sample row (sampler.SampleRow)."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    seq_id: int | None


class PenaltyTable:
    def __init__(self, slots: int, vocab: int, device: torch.device | str, fused: bool | None = None) -> None:
        """`fused`: apply and count with kernels/penalties.py's launches (None: on CUDA unless
        TPGRAPH_FUSED_PENALTIES=0; True on CPU runs them under TRITON_INTERPRET=1) rather than torch ops."""
        if slots < 1 or vocab < 1:
            raise ValueError(f"a penalty table needs at least one slot and one token, got {slots} x {vocab}")
        self.device = torch.device(device)
        self.counts = torch.zeros(slots, vocab, dtype=torch.int32, device=self.device)  # output tokens
        self.in_prompt = torch.zeros(slots, vocab, dtype=torch.bool, device=self.device)
        self._slots: OrderedDict[int, int] = OrderedDict()  # seq id -> slot, least recently used first
        self._free = list(range(slots - 1, -1, -1))
        self.fused = fused
        self.fills = 0  # slots filled from the host's ids so far (a sequence's first step, or its return)

    def _takes_fused(self) -> bool:
        if fused.triton is None:
            return False
        if self.fused is not None:
            return self.fused
        return self.device.type == "cuda" and fused.fused_penalties_enabled()

    @property
    def num_slots(self) -> int:
        return self.counts.shape[0]

    @property
    def vocab(self) -> int:
        return self.counts.shape[1]

    @property
    def num_held(self) -> int:
        """Slots held by sequences."""
        return len(self._slots)

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes + self.in_prompt.nbytes

    def clear(self) -> None:
        """Forget every sequence."""
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def release(self, seq_id: int) -> None:
        """A finished sequence's slot is free again (its last step's count may still be queued: the next fill's
        zeroing comes after it in stream order)."""
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def slots_for(self, rows: list[PenalizedRow]) -> list[int]:
        """The slot of each row in `rows` (all penalized), filling those not held yet from the host's ids."""
        if len(rows) > self.num_slots:
            raise ValueError(f"{len(rows)} penalized rows in one step, but the penalty table holds {self.num_slots}")
        keys = {r.seq_id for r in rows if r.seq_id is not None}
        if len(keys) < sum(r.seq_id is not None for r in rows):
            raise ValueError("a sequence appears twice in one sampling step")
        new = [r for r in rows if r.seq_id not in self._slots]
        if any(PENDING_TOKEN in r.output_ids for r in new):  # (checked before any slot changes hands)
            raise ValueError("penalties need every output token on the host to fill a sequence's slot, but one is "
                             "still pending")
        out, to_fill, this_call_only = [], [], []
        for r in rows:
            slot = self._slots.get(r.seq_id) if r.seq_id is not None else None
            if slot is None:
                slot = self._take(keys)
                if r.seq_id is not None:
                    self._slots[r.seq_id] = slot
                else:
                    this_call_only.append(slot)
                to_fill.append((slot, r))
            else:
                self._slots.move_to_end(r.seq_id)
            out.append(slot)
        if to_fill:
            try:
                self._fill(to_fill)
            except BaseException:  # (bad ids): no sequence keeps a slot it was not filled into
                for slot, r in to_fill:
                    self._slots.pop(r.seq_id, None)
                    self._free.append(slot)
                raise
        self._free += this_call_only  # free once this call's slots are taken (their contents are read in stream order)
        return out

    def _take(self, keep: set[int]) -> int:
        if self._free:
            return self._free.pop()
        for key in self._slots:  # least recently used first
            if key not in keep:
                return self._slots.pop(key)
        raise AssertionError("unreachable: more slots asked than the table holds")

    def _fill(self, rows: list[tuple[int, PenalizedRow]]) -> None:
        """Counts and prompt marks of whole histories, from the host: an upload per FILL_TOKENS of them."""
        taken = to_device([slot for slot, _ in rows], torch.int64, self.device)
        self.counts.index_fill_(0, taken, 0)
        self.in_prompt.index_fill_(0, taken, False)
        chunk: list[tuple[int, PenalizedRow]] = []
        size = 0
        for slot, r in rows:
            n = len(r.prompt_ids) + len(r.output_ids)
            if chunk and size + n > FILL_TOKENS:
                self._upload(chunk)
                chunk, size = [], 0
            chunk.append((slot, r))
            size += n
        self._upload(chunk)
        self.fills += len(rows)

    def _upload(self, rows: list[tuple[int, PenalizedRow]]) -> None:
        prompt_slots = [slot for slot, r in rows for _ in r.prompt_ids]
        out_slots = [slot for slot, r in rows for _ in r.output_ids]
        prompt_ids = [t for _, r in rows for t in r.prompt_ids]
        out_ids = [t for _, r in rows for t in r.output_ids]
        prompt_slots, prompt_ids, out_slots, out_ids = to_device_parts(
            [prompt_slots, prompt_ids, out_slots, out_ids], torch.int64, self.device)
        self.in_prompt.index_put_((prompt_slots, prompt_ids), torch.ones((), dtype=torch.bool, device=self.device))
        self.count(out_slots, out_ids)

    def count(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Add one occurrence of ids[i] to slot slots[i] (a step's sampled ids, on the device)."""
        if self._takes_fused():
            fused.count_rows(self.counts, slots, ids)
            return
        self.counts.index_put_((slots, ids), torch.ones((), dtype=torch.int32, device=self.device), accumulate=True)

    def apply(self, x: torch.Tensor, slots: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """x [B, vocab] fp32 logits of rows held in `slots` [B] -> penalized logits (a new tensor). Repetition (HF:
        prompt and output tokens), frequency and presence (OpenAI: output tokens)."""
        if x.shape[1] != self.vocab:
            raise ValueError(f"logits of {x.shape[1]} tokens, but the penalty table counts {self.vocab}")
        values = [v for p in params for v in (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)]
        per_row = to_device(values, torch.float32, x.device).view(-1, 3)  # one upload
        if self._takes_fused() and x.stride(-1) == 1:
            return fused.apply_rows(x, self.counts, self.in_prompt, slots, per_row)
        counts = self.counts.index_select(0, slots).float()
        seen = self.in_prompt.index_select(0, slots) | (counts > 0)
        rep, freq, pres = per_row.unsqueeze(-1).unbind(1)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        return x - freq * counts - pres * (counts > 0).float()
