"""Persistent graph inputs: allocated once at the largest bucket, written in place every step.

A captured graph reads fixed addresses, so every step writes its rows [0, n) into a host twin, the buffer's padding
policy decides what the padded tail rows [n, padded) hold, and one copy moves the rows to the device buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from tpgraph.checks import positive_int
from tpgraph.errors import CaptureError, ConfigError

PAD_KINDS = ("keep", "zero", "fill", "copy_head_only", "fill_once")


@dataclass(frozen=True)
class Pad:
    """What the padded tail rows [n, padded) of a buffer hold at replay.

    KEEP: whatever the host buffer holds (stale rows of earlier steps) — for buffers whose padded rows are never read.
    ZERO: the host tail is zeroed each step.
    fill(v): the host tail is set to v each step (a sentinel such as seq_len 0 or slot -1).
    COPY_HEAD_ONLY: only rows [0, n) are copied; the device tail keeps its old contents and costs no copy bytes
        (wide rows such as block tables, whose padded rows are never read).
    fill_once(v): host and device start filled with v; a step re-fills only tail rows an earlier step wrote, so a
        steady batch size costs nothing.
    """

    kind: str
    value: int | float | None = None

    KEEP: ClassVar[Pad]
    ZERO: ClassVar[Pad]
    COPY_HEAD_ONLY: ClassVar[Pad]

    def __post_init__(self) -> None:
        if self.kind not in PAD_KINDS:
            raise ConfigError(f"unknown padding policy {self.kind!r}; choose one of {', '.join(PAD_KINDS)}")
        needs_value = self.kind in ("fill", "fill_once")
        if needs_value and (isinstance(self.value, bool) or not isinstance(self.value, (int, float))):
            raise ConfigError(f"padding policy {self.kind!r} needs a numeric fill value, got {self.value!r}")
        if not needs_value and self.value is not None:
            raise ConfigError(f"padding policy {self.kind!r} takes no value, got {self.value!r}")

    @staticmethod
    def fill(value: int | float) -> Pad:
        return Pad("fill", value)

    @staticmethod
    def fill_once(value: int | float) -> Pad:
        return Pad("fill_once", value)

    @property
    def initial_value(self) -> int | float:
        """What host and device hold at allocation: the fill value, else 0 (deterministic, never uninitialized)."""
        return self.value if self.value is not None else 0


Pad.KEEP = Pad("keep")
Pad.ZERO = Pad("zero")
Pad.COPY_HEAD_ONLY = Pad("copy_head_only")


@dataclass
class _Buffer:
    pad: Pad
    dtype: torch.dtype
    row_shape: tuple[int, ...]
    offset: int = 0  # bytes into the arenas
    row_bytes: int = 0
    host: torch.Tensor | None = None
    host_np: np.ndarray | None = None  # None where numpy has no such dtype (bfloat16)
    device: torch.Tensor | None = None
    dirty_rows: int = 0  # fill_once: rows [0, dirty_rows) may hold real data from an earlier step (host and device)


ALIGN = 256  # every buffer starts 256-byte aligned in the arenas, as a fresh allocation would


class PersistentBuffers:
    """Named device buffers of `max_rows` rows, each with a host twin and a padding policy.

    Declare every buffer with `add`, then use them: the first use lays them out, in declaration order, in one pinned
    host arena and one device arena, so a step's `commit` is a single host-to-device copy (a copy costs ~10-20 us of
    host time; a decode step has several inputs). The copy spans from the arena start to the end of the last rows any
    buffer's policy needs, so it may also carry rows of earlier-declared buffers that their policy would skip. That is
    harmless because the host twin is the source of truth: every row it holds was meant for the device. Declare wide
    buffers whose tail is never read (block tables, COPY_HEAD_ONLY) last, so the span stays short.

    Per step: write rows [0, n) through `host(name)` / `host_np(name)`, then `commit(n, padded)`. With
    non_blocking=True the copy reads the pinned host twin asynchronously, so the next `host` / `host_np` waits for it
    (an event recorded after the copy): a step submitted before the last one's tokens were read back (overlapped
    scheduling) cannot overwrite rows the last copy has yet to read.
    """

    def __init__(self, max_rows: int, device: torch.device | str, pin_memory: bool | None = None) -> None:
        self._max_rows = positive_int("max_rows", max_rows, " (the largest capture size)")
        self._device = torch.device(device)
        # Pinned host memory lets the host->device copy run asynchronously; pinning needs CUDA.
        self._pin = self._device.type == "cuda" if pin_memory is None else pin_memory
        self._buffers: dict[str, _Buffer] = {}
        self._host_arena: torch.Tensor | None = None
        self._device_arena: torch.Tensor | None = None
        self._copy_done: torch.cuda.Event | None = None  # recorded after each asynchronous copy from pinned memory
        self._copy_pending = False

    @property
    def max_rows(self) -> int:
        return self._max_rows

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._buffers)

    @property
    def nbytes(self) -> int:
        """Device bytes held by the buffers, alignment included (for graph memory accounting)."""
        self.allocate()
        return 0 if self._device_arena is None else self._device_arena.nbytes

    def add(self, name: str, dtype: torch.dtype, pad: Pad, row_shape: tuple[int, ...] = ()) -> None:
        """Declare a buffer of shape [max_rows, *row_shape]. Every buffer is declared before any is used."""
        if self._device_arena is not None:
            raise ConfigError(f"buffer {name!r} declared after the buffers were laid out; declare every buffer "
                              f"before the first host()/device()/commit()")
        if name in self._buffers:
            raise ConfigError(f"persistent buffer {name!r} is declared twice; give each buffer one name")
        if not isinstance(pad, Pad):
            raise ConfigError(f"buffer {name!r}: pad must be a Pad (Pad.KEEP, Pad.ZERO, Pad.fill(v), ...), got {pad!r}")
        row_shape = tuple(row_shape)
        for d in row_shape:
            positive_int(f"buffer {name!r}: each row_shape entry", d, f" (row_shape {row_shape!r})")
        self._buffers[name] = _Buffer(pad, dtype, row_shape)

    def allocate(self) -> None:
        """Lay every declared buffer out in the two arenas (once), each filled with its policy's initial value: at
        the first use, or now (memory profiling needs them in place before it measures)."""
        if self._device_arena is not None or not self._buffers:
            return
        total = 0
        for buf in self._buffers.values():
            buf.offset = total
            buf.row_bytes = torch.Size(buf.row_shape).numel() * buf.dtype.itemsize
            total += -(-buf.row_bytes * self._max_rows // ALIGN) * ALIGN
        # normal tensors even when first used under inference_mode: inference tensors refuse in-place writes outside it
        with torch.inference_mode(False):
            self._lay_out(total)

    def _lay_out(self, total: int) -> None:
        host = torch.empty(total, dtype=torch.uint8, pin_memory=self._pin)
        device = torch.empty(total, dtype=torch.uint8, device=self._device)
        for buf in self._buffers.values():
            span = slice(buf.offset, buf.offset + buf.row_bytes * self._max_rows)
            shape = (self._max_rows, *buf.row_shape)
            buf.host = host[span].view(buf.dtype).view(shape).fill_(buf.pad.initial_value)
            buf.device = device[span].view(buf.dtype).view(shape).fill_(buf.pad.initial_value)
            try:
                buf.host_np = buf.host.numpy()
            except TypeError:  # numpy has no bfloat16
                buf.host_np = None
        self._host_arena, self._device_arena = host, device

    def host(self, name: str) -> torch.Tensor:
        """The host twin to write rows [0, n) into (once the last commit's copy has read it)."""
        self._await_copy()
        return self._get(name).host

    def host_np(self, name: str) -> np.ndarray:
        """A numpy view of the host twin (same memory), the fastest way to write small rows."""
        self._await_copy()
        buf = self._get(name)
        if buf.host_np is None:
            raise ConfigError(f"buffer {name!r} is {buf.host.dtype}, which numpy cannot view; write through host()")
        return buf.host_np

    def device(self, name: str, rows: int | None = None) -> torch.Tensor:
        """The device buffer, or a view of its first `rows` rows (same storage: graphs capture these addresses)."""
        buf = self._get(name)
        if rows is None:
            return buf.device
        if not 1 <= rows <= self._max_rows:
            raise CaptureError(f"buffer {name!r} has {self._max_rows} rows; cannot view {rows}")
        return buf.device[:rows]

    def commit(self, n: int, padded: int, non_blocking: bool = True) -> int:
        """Apply every padding policy to host rows [n, padded) and copy the rows the policy needs to the device.

        Returns the bytes copied host -> device (one copy, from the arena start).
        """
        if not 0 <= n <= padded:
            raise CaptureError(f"commit needs 0 <= n <= padded, got n={n}, padded={padded}")
        if padded > self._max_rows:
            raise CaptureError(
                f"commit of {padded} rows exceeds the buffers' {self._max_rows} rows; buffers are sized for the "
                f"largest capture size"
            )
        self.allocate()
        self._await_copy()  # the padding below writes host rows
        end = 0
        for buf in self._buffers.values():
            rows = self._pad_tail(buf, n, padded)
            if rows:
                end = max(end, buf.offset + rows * buf.row_bytes)
        if end:
            self._device_arena[:end].copy_(self._host_arena[:end], non_blocking=non_blocking)
            if non_blocking and self._pin and self._device.type == "cuda":
                self._copy_done = self._copy_done or torch.cuda.Event()
                self._copy_done.record(torch.cuda.current_stream(self._device))
                self._copy_pending = True
        return end

    def _await_copy(self) -> None:
        if self._copy_pending:
            self._copy_done.synchronize()
            self._copy_pending = False

    @staticmethod
    def _pad_tail(buf: _Buffer, n: int, padded: int) -> int:
        """Write the host tail for `buf`'s policy; return how many leading rows must reach the device."""
        kind = buf.pad.kind
        if kind == "copy_head_only":
            return n
        if kind == "keep":
            return padded
        if kind == "fill_once":
            restore = min(buf.dirty_rows, padded)  # tail rows [n, restore) hold an earlier step's data
            if restore > n:
                _fill(buf, n, restore, buf.pad.value)
            # Rows below `padded` are clean again past n; rows at or above it stay as dirty as they were.
            buf.dirty_rows = n if buf.dirty_rows <= padded else max(buf.dirty_rows, n)
            return max(n, restore)
        _fill(buf, n, padded, 0 if kind == "zero" else buf.pad.value)
        return padded

    def _get(self, name: str) -> _Buffer:
        self.allocate()
        try:
            return self._buffers[name]
        except KeyError:
            declared = ", ".join(self._buffers) or "none"
            raise ConfigError(f"no persistent buffer {name!r}; declared: {declared}") from None

    def __repr__(self) -> str:
        return f"PersistentBuffers(max_rows={self._max_rows}, device={self._device}, buffers={list(self._buffers)})"


def _fill(buf: _Buffer, start: int, stop: int, value: int | float) -> None:
    if stop <= start:
        return
    if buf.host_np is not None:
        buf.host_np[start:stop] = value  # numpy slicing is cheaper than a torch op for a few rows
    else:
        buf.host[start:stop].fill_(value)
