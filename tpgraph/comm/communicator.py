"""TPCommunicator: the one object model code calls for cross-rank traffic.

Row-parallel layers call `all_reduce` explicitly at their output; the vocab-parallel head calls
`all_gather`. All-reduce is a short chain: the custom all-reduce when it is allowed and the table picks
it, else NCCL (gloo on CPU). Use the returned tensor: the custom path may return a new one in graphs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tpgraph.comm.custom_ar import fused_norm_default
from tpgraph.comm.registration import CaptureRegistration
from tpgraph.comm.thresholds import WORLD_SIZES
from tpgraph.comm.topology import unavailable_cuda_error
from tpgraph.distributed import ParallelState, gather_objects, run_on_all_ranks
from tpgraph.errors import AllReduceUnavailable, CaptureError, PeerError
from tpgraph.kernels import gemv
from tpgraph.kernels.lamport import Channel, PendingProjection, ReducedNorm, epilogue_enabled, solo_channel
from tpgraph.kernels.norm import add_rms_norm

logger = logging.getLogger(__name__)


class TPCommunicator:
    def __init__(self, state: ParallelState, use_custom_allreduce: bool = True, custom_config=None,
                 disabled_by: str = "the caller") -> None:
        """custom_config: a CustomAllReduceConfig for the custom path (default: its defaults and environment).
        disabled_by: what turned the custom path off (use_custom_allreduce=False), named in the log and summary. The
        choice must be the same on every rank: the custom path's set-up is a collective."""
        self.state = state
        self.world_size = state.world_size
        self.rank = state.rank
        self.custom = None
        self.capture_locked = False  # set by the graph runner once its capture phase is over
        self.custom_reason = f"disabled by {disabled_by}" if not use_custom_allreduce else None
        # one rank: the residual add and the norm's staging in the row-parallel projections' epilogue unless it is
        # turned off (TPGRAPH_GEMV_ALLREDUCE=0) or the fused norm is (custom_config.fused_norm,
        # TPGRAPH_FUSED_AR_NORM=0: the comparisons' unfused path)
        self.solo = None
        if state.world_size == 1 and (custom_config.fused_norm if custom_config is not None else fused_norm_default()):
            self.solo = solo_channel(state.device)
        if use_custom_allreduce:
            self.custom, self.custom_reason = _try_custom_allreduce(state, custom_config)
        if state.is_driver and state.world_size > 1:
            if self.custom is not None:
                logger.info("all-reduce: custom (tables: %s), NCCL above its bands", self.custom.table.source)
            elif not use_custom_allreduce:
                logger.info("custom all-reduce disabled (%s): NCCL", disabled_by)
            else:
                logger.info("all-reduce: NCCL/gloo only (%s)", self.custom_reason)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the TP group. Returns the result (x itself, or a new tensor: from the custom path, or a
        contiguous copy of a strided x, which NCCL refuses)."""
        if self.world_size == 1:
            return x
        if self.custom is not None:
            out = self.custom.try_all_reduce(x)
            if out is not None:
                return out
        x = x.contiguous()
        dist.all_reduce(x, group=self.state.tp_group)
        return x

    def push_channel(self, residual: torch.Tensor) -> Channel | None:
        """Where a row-parallel projection whose output is shaped like `residual` may all-reduce in its epilogue
        (kernels/lamport.py): the custom all-reduce's channel, for decode rows of a bf16 model; at TP=1 a solo
        channel (the epilogue adds the residual and stages the norm); else None."""
        if self.world_size == 1:
            return self.solo if self.solo is not None and epilogue_enabled(1) and self.solo.takes(residual) else None
        if self.custom is None:
            return None
        return self.custom.push_channel(residual)

    def all_reduce_add_rmsnorm(self, x: torch.Tensor | PendingProjection, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor | ReducedNorm, torch.Tensor]:
        """(weight * rmsnorm(s + residual), s + residual) with s = the sum of x over the TP group: the all-reduce at a
        row-parallel output with the residual add and RMSNorm that follow it. One kernel where the custom
        all-reduce's 1shot_push applies (it fuses them), else the all-reduce and then the add+RMSNorm kernel.
        x a PendingProjection (a row-parallel projection not yet run): at decode rows with a push channel (the
        custom all-reduce's, or at TP=1 the solo channel), the projection with all of this in its epilogue
        (kernels/lamport.py), which leaves a ReducedNorm for the next projection instead of the normalised input;
        else the projection first, then as above."""
        if isinstance(x, PendingProjection):
            channel = self.push_channel(residual)
            # (a biased projection, a Llama's with attention_bias or mlp_bias, runs first: the epilogue adds no bias)
            if channel is not None and getattr(x.layer, "small_m", False) and getattr(x.layer, "bias", None) is None:
                # the residual predates x's branch (the contract of a PendingProjection): read before the PDL wait
                reduced = gemv.linear_all_reduce_norm(x.x, x.layer.weight, channel, residual, weight, eps,
                                                      residual_early=True)
                if reduced is not None:
                    return reduced, reduced.residual_out
            x = x.run()
        if self.world_size > 1 and self.custom is not None:
            fused = self.custom.try_all_reduce_add_rmsnorm(x, residual, weight, eps)
            if fused is not None:
                return fused
        return add_rms_norm(self.all_reduce(x), residual, weight, eps)

    def all_gather(self, x: torch.Tensor, dim: int = -1, out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenate every rank's x along dim, in rank order (into `out` if given)."""
        if self.world_size == 1:
            return x if out is None else out.copy_(x)
        x = x.contiguous()
        # one collective into one buffer [world, *x.shape], then one copy into place (a list of parts costs a copy
        # out per rank and then the concatenation)
        flat = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(flat, x, group=self.state.tp_group)
        flat = flat.view(self.world_size, *x.shape)
        dim = dim % x.dim()
        shape = (*x.shape[:dim], self.world_size * x.shape[dim], *x.shape[dim + 1:])
        if out is not None and tuple(out.shape) != shape:
            raise ValueError(f"all_gather out has shape {tuple(out.shape)}, expected {shape}")
        target = out if out is not None and out.is_contiguous() else torch.empty(shape, dtype=x.dtype, device=x.device)
        # target viewed as [..., world, x.shape[dim], ...] is flat with the world axis moved to dim
        target.view(*x.shape[:dim], self.world_size, *x.shape[dim:]).copy_(flat.movedim(0, dim))
        return target if out is None or target is out else out.copy_(target)

    @contextlib.contextmanager
    def capture(self) -> Iterator[CaptureRegistration]:
        """Wrap CUDA-graph capture: custom all-reduce inputs captured inside are registered on exit.

        Yields the registration (pointer-table rows, peer mappings); give it back with `release_capture` once the
        graphs captured inside are dropped."""
        if self.capture_locked:
            raise CaptureError("all-reduce capture after the capture phase: graphs were already captured and the "
                               "communicator locked; re-capture through the graph runner, which releases first")
        if self.custom is None:
            yield CaptureRegistration()
            return
        with self.custom.capture() as registration:
            yield registration

    def release_capture(self, registration: CaptureRegistration) -> None:
        """Return a capture's rows and close its peer mappings (local; the graphs must be dropped already)."""
        if self.custom is not None:
            self.custom.release_registration(registration)

    @property
    def workspace_bytes(self) -> int:
        """Device memory the custom all-reduce holds on this rank (0 without it): the KV budget subtracts it."""
        return 0 if self.custom is None else self.custom.workspace_bytes

    def close(self) -> None:
        if self.custom is not None:
            self.custom.close()
            self.custom = None


def _try_custom_allreduce(state: ParallelState, config=None):
    """(CustomAllReduce, None) when every rank can use it, else (None, reason), decided the same on all ranks.

    Only a reason of the machine's falls back to NCCL (logged as a warning, naming the rank): an AllReduceUnavailable
    (P2P or CUDA IPC off or not working, GPUs not linked, mixed architectures) or a CUDA error that says the same
    (topology.UNAVAILABLE_CUDA_ERRORS). Anything else in the set-up is a bug and is raised on every rank: its own error
    on the rank that met it, a PeerError naming that rank on the others (a silent slow path would hide it)."""
    if state.device.type != "cuda":
        return None, "not on CUDA"
    if state.world_size not in WORLD_SIZES:
        return None, f"world size {state.world_size} is outside {WORLD_SIZES.start}..{WORLD_SIZES.stop - 1}"
    from tpgraph._ext import extension_available

    if not extension_available():
        return None, "tpgraph._C is not built (no nvcc at install time)"
    from tpgraph.comm.custom_ar import CustomAllReduce
    from tpgraph.comm.thresholds import load_table_for

    # A missing or broken table is a setup error to fix, not a reason to fall back to NCCL unnoticed.
    capability = torch.cuda.get_device_capability(state.device)
    run_on_all_ranks(state, lambda: load_table_for(capability), "reading the all-reduce table")
    custom, error = None, None
    try:
        custom = CustomAllReduce(state, config)
    except Exception as exc:  # noqa: BLE001 - every rank hears of it below; raised unless the machine is the reason
        error = exc
    try:
        mine = None if error is None else _verdict(error)
        failed = [(rank, v) for rank, v in enumerate(gather_objects(state, mine)) if v is not None]
        if not failed:
            return custom, None
        if custom is not None:  # (set-up passed here and failed on a peer: give the workspace back)
            custom.close()
        # a rank that failed only because a peer did ("peer") leaves the decision to that peer's own verdict
        bugs = [(rank, v) for rank, v in failed if v[0] == "error"]
        unavailable = [(rank, v) for rank, v in failed if v[0] == "unavailable"]
        if unavailable and not bugs:
            rank, (_, _, detail) = unavailable[0]
            reason = f"rank {rank}: {detail}"
            logger.warning("custom all-reduce unavailable, every rank uses NCCL instead (%s)", reason)
            return None, reason
        if mine is not None and mine[0] == "error":
            raise error
        rank, (_, kind, detail) = (bugs or failed)[0]
        raise PeerError(f"setting up the custom all-reduce failed on rank {rank}: {kind}: {detail}", rank, kind, detail)
    finally:
        # break the frame <-> exception cycle (as run_on_all_ranks does): it would keep the process groups alive
        del error


def _verdict(error: Exception) -> tuple[str, str, str]:
    """(verdict, the error's type name, its message) for a rank's failure to set up the custom all-reduce: "unavailable"
    (a reason of the machine's: fall back to NCCL), "peer" (raised here because another rank failed in a step all
    take together: that rank's verdict decides) or "error" (a bug: raise it)."""
    kind = type(error).__name__
    if isinstance(error, AllReduceUnavailable):
        return "unavailable", kind, str(error)
    if unavailable_cuda_error(error) is not None:
        return "unavailable", kind, f"{kind}: {error}"
    if isinstance(error, PeerError):
        return "peer", kind, str(error)
    return "error", kind, str(error)
