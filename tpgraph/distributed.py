"""Process topology: rank and world size from torchrun (or given explicitly), a TP group and a CPU group.

Nothing here is global: `init_distributed` returns a ParallelState that callers pass down.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from tpgraph.errors import ConfigError, PeerError
from tpgraph.kernels._settings import env_flag

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ParallelState:
    rank: int
    world_size: int
    local_rank: int  # (not always the device index: TPGRAPH_SHARED_GPU puts every rank on device 0)
    device: torch.device
    tp_group: dist.ProcessGroup | None  # NCCL on GPU, gloo on CPU; None when world_size == 1
    cpu_group: dist.ProcessGroup | None  # always gloo: handles, error consensus, small metadata
    # (ranks TPEngine started itself) a gloo group of its own for rank 0's step messages, which they wait for as long
    # as the user leaves rank 0 idle: its timeout is long, the rest keep the process group's
    control_group: dist.ProcessGroup | None = None

    @property
    def control(self) -> dist.ProcessGroup | None:
        """The group rank 0's step messages travel in (control.py)."""
        return self.control_group if self.control_group is not None else self.cpu_group

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


SHARED_GPU_ENV = "TPGRAPH_SHARED_GPU"


def shared_gpu() -> bool:
    """TPGRAPH_SHARED_GPU=1: every rank of a multi-rank CUDA run on GPU 0, so that the TP code paths (CUDA IPC
    between the ranks' processes, the custom all-reduce's kernels, graphs of them) run and can be checked for
    correctness on a machine with one GPU. The ranks' contexts take the GPU in turns (time slices), so a kernel
    that waits for a peer waits a slice: results, never timings."""
    return env_flag(SHARED_GPU_ENV)


def nccl_as_separate_hosts(rank: int) -> dict[str, str]:
    """The NCCL settings (set where the environment has none) for ranks that share a GPU: NCCL refuses two ranks on
    one device of one host ("Duplicate GPU detected"), so each rank gets its own host id and the ranks talk over
    NCCL's socket transport on the loopback interface."""
    return {"NCCL_HOSTID": f"tpgraph-shared-gpu-rank{rank}", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo"}


def init_distributed(
    device: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    timeout_s: float = 600.0,
    control_timeout_s: float | None = None,
    before_join: Callable[[], None] | None = None,
) -> ParallelState:
    """Join (or create) the process group.

    Under torchrun, rank/world size come from RANK/WORLD_SIZE/LOCAL_RANK. Spawned workers pass rank,
    world_size and an init_method (e.g. 'file:///tmp/x' or 'tcp://127.0.0.1:port') explicitly.
    control_timeout_s: rank 0's step messages get a gloo group of their own with this timeout, for ranks that wait in
    it for as long as rank 0 is idle (a dead or frozen peer is PeerWatch's to find, not the timeout's); every other
    collective keeps `timeout_s`. before_join: called once this rank's own checks pass, as it joins the rendezvous
    (a started rank tells rank 0: followers.follower_main).
    """
    rank = env_int("RANK") if rank is None else rank
    world_size = env_int("WORLD_SIZE") if world_size is None else world_size
    rank, world_size = rank or 0, world_size or 1
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world size {world_size}")
    local_rank = env_int("LOCAL_RANK")
    local_rank = rank if local_rank is None else local_rank

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    shared = device == "cuda" and world_size > 1 and shared_gpu()
    local_world = env_int("LOCAL_WORLD_SIZE")
    if shared and local_world is not None and local_world != world_size:
        raise ConfigError(f"{SHARED_GPU_ENV}=1 puts every rank on one GPU of one host, but {world_size} ranks run "
                          f"{local_world} to a host")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but no CUDA GPU is visible; use --device cpu")
        index = 0 if shared else local_rank
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible. "
                f"Launch at most one process per GPU ({SHARED_GPU_ENV}=1 puts every rank on GPU 0, for tests)."
            )
        torch.cuda.set_device(index)
        dev = torch.device("cuda", index)
    elif device == "cpu":
        dev = torch.device("cpu")
    else:
        raise ConfigError(f"unknown device {device!r}; use 'cuda' or 'cpu'")

    if world_size == 1 and not dist.is_initialized() and init_method is None and "MASTER_ADDR" not in os.environ:
        return ParallelState(0, 1, local_rank, dev, None, None)

    from tpgraph.comm.multicast import multicast_disabled_reason, pass_gate_on  # (tpgraph.comm imports this)

    # before NCCL reads its variables: also where the caller made the process group, whose NCCL communicator starts
    # at its first collective (unless the group was made with a device_id)
    reason = multicast_disabled_reason()
    changed = pass_gate_on()
    if changed:
        logger.info("%s: set %s too", reason, ", ".join(changed))
        if dist.is_initialized():
            logger.warning("%s, but the process group existed before tpgraph set %s: an NCCL communicator it already "
                           "made may use NVLink multicast", reason, ", ".join(changed))
    if before_join is not None:
        before_join()
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if shared:
            logger.warning("%s=1: rank %d shares GPU 0 with every other rank (a functional stand-in, never timed)",
                           SHARED_GPU_ENV, rank)
            for name, value in nccl_as_separate_hosts(rank).items():
                os.environ.setdefault(name, value)  # (before NCCL reads its variables)
        dist.init_process_group(
            backend=backend,
            init_method=init_method or "env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
        )
    tp_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo") if dev.type == "cuda" else tp_group
    control = None if control_timeout_s is None else dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=control_timeout_s))
    return ParallelState(rank, world_size, local_rank, dev, tp_group, cpu_group, control)


def destroy_distributed(state: ParallelState) -> None:
    # (a world of one has a process group too where it was joined through one: an init method, or MASTER_ADDR)
    if state.tp_group is not None and dist.is_initialized():
        gc.collect()  # drop unreachable holders of the groups now, not during interpreter shutdown
        dist.destroy_process_group()


def gather_objects(state: ParallelState, obj: T) -> list[T]:
    """All-gather a small picklable object over the CPU group (the value itself when world_size == 1)."""
    if state.world_size == 1:
        return [obj]
    out: list[T] = [None] * state.world_size  # type: ignore[list-item]
    dist.all_gather_object(out, obj, group=state.cpu_group)
    return out


def run_on_all_ranks(state: ParallelState, fn: Callable[[], T], what: str) -> T:
    """Run fn on every rank; if it fails on any rank, raise on every rank: its own error where fn raised, else a
    PeerError naming the first rank that failed.

    This is how a bad checkpoint on one rank becomes an error everywhere instead of a hang in the
    next collective: every rank reaches the same CPU-group exchange whether or not fn raised.
    """
    result: T | None = None
    error: BaseException | None = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
        error = exc
    failures = gather_objects(state, None if error is None else (type(error).__name__, str(error)))
    failed = [(r, f) for r, f in enumerate(failures) if f is not None]
    if failed:
        if error is not None:
            try:
                raise error
            finally:
                # break the frame <-> exception cycle: it would keep the model and process groups alive
                # until interpreter shutdown, where destroying a gloo group aborts the process
                del error
        rank, (kind, message) = failed[0]
        raise PeerError(f"{what} failed on rank {rank}: {kind}: {message}", rank, kind, message)
    return result  # type: ignore[return-value]
