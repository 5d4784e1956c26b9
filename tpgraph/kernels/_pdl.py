"""Programmatic dependent launch (PDL) for the Triton kernels that follow an all-reduce.

The all-reduce kernels signal `griddepcontrol.launch_dependents` as they start, so a kernel launched as a programmatic
dependent can be resident and waiting (`gdc_wait`) while the all-reduce runs, instead of being launched after it ends.
That saves a launch gap per all-reduce (64 per Llama-3-8B step). NCCL's kernels never signal, so after NCCL the same
launch simply starts when the all-reduce ends, as before.

Opt-in (`TPGRAPH_TRITON_PDL=1`); it needs sm_90+ and a Triton with `launch_pdl` and `gdc_wait`. Measured on 2xH200
(bench/results/2026-11-30_h200x2_gemv, runs 12-14, Llama-3-8B shape, TP=2, full graphs), the small-M path with it
took 3.306-3.316 ms a step at batch 1 against 3.323-3.366 without, and 3.444-3.470 against 3.490-3.552 at batch 8;
but the cuBLAS path (larger batches) was up to 0.08 ms slower with it in the same calls, and batch 32 was not
measured. Default-on waits for that.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_has_pdl() -> bool:
    """Triton exposes gdc_wait in kernels and the launch_pdl launch option."""
    try:
        import dataclasses

        import triton.language.extra.cuda as tl_cuda
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    fields = {f.name for f in dataclasses.fields(CUDAOptions)}
    return hasattr(tl_cuda, "gdc_wait") and "launch_pdl" in fields


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Launch the kernel reading `t` as a programmatic dependent of the kernel before it?"""
    if os.environ.get("TPGRAPH_TRITON_PDL", "0") != "1" or not t.is_cuda:
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return _device_has_pdl(t.device.index) and triton_has_pdl()
