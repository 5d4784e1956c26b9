"""Small host values (a row's temperature, a step's table rows) sent to the device without waiting for it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: Sequence | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of `values` on `device`, in stream order. `torch.tensor(values, device="cuda")` copies
    synchronously: the host waits for everything already queued on the stream, which in the overlapped loop is the
    step's forward, so the next step cannot be scheduled while it runs. From pinned memory the copy is queued instead
    (the caching host allocator keeps the source until the copy is done)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    if isinstance(values, np.ndarray):  # torch.tensor(ndarray, pin_memory=True) refuses it. Copy it into new pinned
        # memory (pin_memory() would hand back an already pinned array's own memory, which its owner may rewrite
        # before the queued copy reads it)
        host = torch.empty(values.shape, dtype=dtype, pin_memory=True)
        host.copy_(torch.from_numpy(values))
        return host.to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_device_parts(parts: Sequence[Sequence], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Several lists as 1-D tensors on `device`, in one copy (to_device of them joined, then split)."""
    joined = to_device([v for part in parts for v in part], dtype, device)
    return list(joined.split([len(part) for part in parts]))
