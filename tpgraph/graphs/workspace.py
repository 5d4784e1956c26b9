"""Persistent scratch buffers that captured graphs read or write at fixed addresses.

A workspace must not move once a graph holds its address: growth after a view was handed out raises, and so
does any growth after `lock()` (the end of the capture phase). Reserve the largest size at start-up."""

from __future__ import annotations

import torch

from tpgraph.errors import CaptureError


class Workspaces:
    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._handed_out: set[str] = set()
        self.locked = False

    def reserve(self, name: str, numel: int, dtype: torch.dtype, device: torch.device | str) -> None:
        """Make workspace `name` hold at least numel elements of dtype (before any graph uses it)."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        buf = self._buffers.get(name)
        if buf is not None and buf.numel() >= nbytes and buf.device == torch.device(device):
            return
        have = 0 if buf is None else buf.numel()
        if self.locked or name in self._handed_out:
            why = "the capture phase is over" if self.locked else "captured graphs already hold its address"
            raise CaptureError(f"workspace {name!r} must grow from {have} to {nbytes} bytes, but {why}: growing "
                               "would move memory the graphs read. Reserve the largest size at start-up.")
        self._buffers[name] = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A flat view of `numel` elements of workspace `name`; from now on the workspace cannot move."""
        self.reserve(name, numel, dtype, device)
        self._handed_out.add(name)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        return self._buffers[name][:nbytes].view(dtype)

    def lock(self) -> None:
        self.locked = True

    def release(self) -> None:
        """Forget every workspace (the graphs that held them are gone)."""
        if self.locked:
            raise CaptureError("workspaces are locked: release the graphs and reopen the capture phase first")
        self._buffers.clear()
        self._handed_out.clear()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())
