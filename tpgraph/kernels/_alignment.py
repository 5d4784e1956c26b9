"""Pointer arguments at a 16-byte boundary, so that a kernel compiles once.

Triton compiles a kernel again for each alignment of its pointer arguments (a multiple of 16 bytes or not), and
loading the new module waits for the device, unseen by torch's sync debug mode. A small view into a shared upload
(uploads.to_device_parts splits one copy into several lists) starts wherever the lists before it end, so a step whose
batch size moved it off the boundary would compile mid-serving and stall the overlapped loop behind the GPU.
"""

from __future__ import annotations

import torch


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t (contiguous), or a contiguous copy where it does not start at a 16-byte boundary (the caching allocator's
    blocks do)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()
