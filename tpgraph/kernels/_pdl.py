"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

A kernel launched as a programmatic dependent can be resident and waiting (`gdc_wait`) while the kernel before it
still runs, once that kernel lets it in (`griddepcontrol.launch_dependents`), instead of being launched after it ends.
The all-reduce kernels and the small kernels (`pdl_enter`: RMSNorm, rope + KV store, split-K sum, decode attention and
its combine, SiLU·mul) let the next kernel in as they start (decode attention from batch 2 after its tiles:
attention_late_trigger); the small-M projections after their K loop, so that the next kernel does not take SM slots
and L2 from their weight stream (two K steps earlier lost: bench/results/2026-12-02_h200_trigger_ahead). cuBLAS and
NCCL kernels never let anyone in early: after them the same launch simply starts when they end, as before.

On by default on sm_90+ with a Triton that has `launch_pdl` and `gdc_wait` (`TPGRAPH_TRITON_PDL=0` turns it off).
Measured on 2xH200 (Llama-3-8B shape, TP=2, full graphs, every entry in one interleaved process:
bench/results/2026-11-30_h200x2_session7/run1_pdl_default), a step took, at batch 1 / 8 / 32: small-M projections
3.180 / 3.361 / 3.952 ms with it against 3.309 / 3.402 / 3.932 without; cuBLAS 3.370 / 3.522 / 3.940 against
3.461 / 3.517 / 3.940.
"""

from __future__ import annotations

import functools

import torch

from tpgraph.kernels._settings import env_flag, triton_interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no kernels to launch
    triton = None


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
    if not env_flag("TPGRAPH_TRITON_PDL", default=True) or not t.is_cuda:
        return False
    if triton_interpreting():
        return False
    return _device_has_pdl(t.device.index) and triton_has_pdl()


if triton is not None:

    @triton.jit
    def pdl_enter(PDL: tl.constexpr, LET_IN: tl.constexpr = True):
        """The first statement of a small kernel launched as a programmatic dependent: wait until the kernel before
        has finished and its writes are visible, then (LET_IN) let the kernel after become resident at once (a small
        grid leaves the SMs room for it; it waits in turn). Without LET_IN the kernel lets it in later itself."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            if LET_IN:
                tl.extra.cuda.gdc_launch_dependents()


def pdl_launch(pdl: bool) -> dict:
    """The launch option that makes a kernel a programmatic dependent, where `pdl` (from use_pdl)."""
    return {"launch_pdl": True} if pdl else {}
