"""Process topology: rank and world size from torchrun (or given explicitly), a TP group and a CPU group.

Nothing here is global: `init_distributed` returns a ParallelState that callers pass down.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from tpgraph.errors import CommError, ConfigError, PeerError
from tpgraph.kernels._settings import env_flag
from tpgraph.ranks import PROCESS_GROUP_TIMEOUT_S, env_int

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


SHARED_GPU_ENV = "TPGRAPH_SHARED_GPU"


def shared_gpu() -> bool:
    """TPGRAPH_SHARED_GPU=1: every rank of a multi-rank CUDA run on GPU 0, so that the TP code paths (CUDA IPC
    between the ranks' processes, the custom all-reduce's kernels, graphs of them) run and can be checked for
    correctness on a machine with one GPU. The ranks' contexts take the GPU in turns (time slices), so a kernel
    that waits for a peer waits a slice: results, never timings."""
    return env_flag(SHARED_GPU_ENV)


SHARED_HOSTID_PREFIX = "tpgraph-shared-gpu-rank"


def nccl_as_separate_hosts(rank: int) -> dict[str, str]:
    """The NCCL settings (set where the environment has none) for ranks that share a GPU: NCCL refuses two ranks on
    one device of one host ("Duplicate GPU detected"), so each rank gets its own host id and the ranks talk over
    NCCL's socket transport on the loopback interface."""
    return {"NCCL_HOSTID": f"{SHARED_HOSTID_PREFIX}{rank}", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo"}


def init_distributed(
    device: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    timeout_s: float = PROCESS_GROUP_TIMEOUT_S,
    control_timeout_s: float | None = None,
    before_join: Callable[[], None] | None = None,
) -> ParallelState:
    """Join (or create) the process group.

    Under torchrun, rank/world size come from RANK/WORLD_SIZE/LOCAL_RANK. Spawned workers pass rank,
    world_size and an init_method (e.g. 'file:///tmp/x' or 'tcp://127.0.0.1:port') explicitly.
    control_timeout_s: rank 0's step messages get a gloo group of their own with this timeout, for ranks that wait in
    it for as long as rank 0 is idle (a dead or frozen peer is PeerWatch's to find, not the timeout's); every other
    collective keeps `timeout_s`. before_join: called once this rank's own checks pass, as it joins the rendezvous
    (a started rank tells rank 0: followers.follower_main); such a rank's failure before it is rank 0's to report.
    The ranks meet at a start check before the process group is made (agree_to_start): a rank whose own checks here
    failed tells the others, which raise a PeerError naming it instead of waiting in the rendezvous for it.
    """
    rank, world_size = _rank_and_world(rank, world_size)
    try:
        local_rank = env_int("LOCAL_RANK")
        local_rank = rank if local_rank is None else local_rank
        dev, shared = _this_ranks_device(device, world_size, local_rank)
    except Exception as exc:
        if before_join is None:
            report_start_failure(exc, rank, world_size, init_method, timeout_s)
        raise

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
            for name, value in nccl_as_separate_hosts(rank).items():  # (before NCCL reads its variables)
                # where unset, or set by tpgraph for the rank whose process started this one (TPEngine's followers
                # inherit rank 0's environment, host id included, from its earlier starts)
                current = os.environ.get(name)
                if current is None or current.startswith(SHARED_HOSTID_PREFIX):
                    os.environ[name] = value
        timeout = datetime.timedelta(seconds=timeout_s)
        if world_size > 1:  # (the rendezvous's store, made here so that the ranks meet in it before the group forms)
            group = dict(store=agree_to_start(None, rank, world_size, init_method, timeout_s))
        else:
            group = dict(init_method=init_method or "env://")
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=dev if dev.type == "cuda" else None, **group)
    tp_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo") if dev.type == "cuda" else tp_group
    control = None if control_timeout_s is None else dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=control_timeout_s))
    return ParallelState(rank, world_size, local_rank, dev, tp_group, cpu_group, control)


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size): as given, else from torchrun's RANK and WORLD_SIZE, else a world of one."""
    rank = env_int("RANK") if rank is None else rank
    world_size = env_int("WORLD_SIZE") if world_size is None else world_size
    rank, world_size = rank or 0, world_size or 1
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world size {world_size}")
    return rank, world_size


def _this_ranks_device(device: str | None, world_size: int, local_rank: int) -> tuple[torch.device, bool]:
    """(this rank's device, whether every rank shares GPU 0), made current: the checks of init_distributed that a rank
    may fail alone (no GPU for it)."""
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
        return torch.device("cuda", index), shared
    if device == "cpu":
        return torch.device("cpu"), shared
    raise ConfigError(f"unknown device {device!r}; use 'cuda' or 'cpu'")


# The start check: before the process group forms, every rank posts "ok" or its error in the rendezvous's store, and
# waits for the others' posts. A rank whose start failed (a check of its own host or settings) would otherwise leave
# the others waiting for it in the rendezvous for its whole timeout; now they raise at once, naming it and its error.
# The last rank done with the posts deletes them, for the next start in a store that stays (torchrun's agent's).
START_PREFIX = "tpgraph/start"
START_POLL_S = 0.05
# Where a start fails, every rank stays until the others have read the posts (rank 0 may host the store: tcp://, and
# env:// outside torchrun; a rank's next start would post over them), this long at most (they arrive within seconds:
# every rank runs the same checks)
START_LINGER_S = 30.0


def report_start_failure(error: BaseException, rank: int | None = None, world_size: int | None = None,
                         init_method: str | None = None, timeout_s: float = PROCESS_GROUP_TIMEOUT_S) -> None:
    """Tell the other ranks, waiting for this one in the rendezvous (init_distributed), that its start failed with
    `error` (the caller then raises it). Nothing where this rank has no peers, or belongs to a process group made
    before; a failure to reach them is logged, never raised over `error`."""
    try:
        rank, world_size = _rank_and_world(rank, world_size)
    except ConfigError:
        return
    if world_size == 1 or dist.is_initialized():
        return
    try:  # (not the whole timeout where the store's host never comes: this rank's own error waits meanwhile)
        agree_to_start(error, rank, world_size, init_method, min(timeout_s, START_LINGER_S))
    except Exception as exc:  # noqa: BLE001 - the start's own error is the one to raise
        logger.warning("rank %d could not tell the other ranks that its start failed: %s", rank, exc)


def agree_to_start(error: BaseException | None, rank: int, world_size: int, init_method: str | None,
                   timeout_s: float) -> dist.Store | None:
    """Join the rendezvous's store and post this rank's start: "ok" (error None) or its error. With "ok", wait for every
    other rank's post and return the store for the process group (under a prefix of this start's own), or raise a
    PeerError naming the first failed rank (CommError where a rank has posted nothing within timeout_s: it died, or
    hangs). With an error, return None once posted (no group forms; the caller raises its error). Where a start fails,
    every rank returns or raises once the others have read the posts."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous(init_method or "env://", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefix = f"{START_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    # this start's number in the store, the same on every rank (read before any rank can be done with this start)
    start = store.add(f"{prefix}/starts", 0)
    store.set(keys[rank], "ok" if error is None else _said(error))

    def done() -> None:  # (the last rank done deletes the posts and numbers the next start)
        if store.add(f"{prefix}/done", 1) == world_size:
            for k in (*keys, f"{prefix}/done"):
                store.delete_key(k)
            store.add(f"{prefix}/starts", 1)

    def linger() -> None:  # (a start that fails) until the last rank's last request, numbering the next start:
        # rank 0 may host the store, which goes with it; and a rank starting again sooner posted "ok" over its failure
        # before a later rank read it, which then joined that next start as this one, and every rank waited for good
        deadline = time.monotonic() + min(START_LINGER_S, timeout_s)
        try:
            while store.add(f"{prefix}/starts", 0) == start and time.monotonic() < deadline:
                time.sleep(START_POLL_S)
        except dist.DistNetworkError:  # (the store gone with rank 0, which leaves once the start is done)
            pass

    if error is not None:
        done()
        linger()
        return None  # (the rendezvous's store was for a group that will not form)
    waiting, deadline = [r for r in range(world_size) if r != rank], time.monotonic() + timeout_s
    started = False
    try:
        while waiting:
            for r in [r for r in waiting if store.check([keys[r]])]:
                said = store.get(keys[r]).decode()
                if said != "ok":
                    raise _failed_peer(r, said)
                waiting.remove(r)
            if waiting and time.monotonic() > deadline:
                raise CommError(f"rank(s) {waiting} did not reach the start of the process group within "
                                f"{timeout_s:.0f} s (died, or hung, before joining)")
            if waiting:
                time.sleep(START_POLL_S)
        started = True
    finally:
        done()
        if not started:
            linger()
    # The process group's keys apart from an earlier start's in a store that stays (torchrun's agent's): gloo read a
    # peer's address from the last process group there before the peer wrote its new one, and waited on it for good.
    return dist.PrefixStore(f"default_pg/{prefix}/{start}", store)


# After the process group formed, a rank whose start failed leaves its error in the group's store: the others meet its
# absence in their next collective as a lost connection (gloo's "Connection closed by peer"), not its reason.
START_FAILED = "tpgraph/start-failed"


def _said(error: BaseException) -> str:
    """A failed start as a rank posts it for the others: "ErrorType: message"."""
    return f"{type(error).__name__}: {error}"


def _failed_peer(rank: int, said: str) -> PeerError:
    """The error a rank raises for a peer's failed start, as that peer posted it (_said)."""
    return PeerError(f"rank {rank} failed to start: {said}", rank, *said.split(": ", 1))


def _group_store(state: ParallelState) -> dist.Store | None:
    return dist.distributed_c10d._get_default_store() if state.world_size > 1 and dist.is_initialized() else None


def post_start_failure(state: ParallelState, error: BaseException) -> None:
    """Leave this rank's start failure in the process group's store, for peer_start_failure on the others (before the
    group is destroyed). Not a PeerError (a peer's failure, which that peer posts itself); nothing raised."""
    if isinstance(error, PeerError):
        return
    try:
        store = _group_store(state)
        if store is not None:
            store.set(f"{START_FAILED}/{state.rank}", _said(error))
    except Exception as exc:  # noqa: BLE001 - this rank's own error is the one to raise
        logger.warning("rank %d could not leave its start failure for the other ranks: %s", state.rank, exc)


def peer_start_failure(state: ParallelState) -> PeerError | None:
    """A PeerError for the first other rank whose start failure is in the process group's store (post_start_failure),
    else None (none there, or the store gone with its host)."""
    try:
        store = _group_store(state)
        for r in range(state.world_size if store is not None else 0):
            if r != state.rank and store.check([f"{START_FAILED}/{r}"]):
                return _failed_peer(r, store.get(f"{START_FAILED}/{r}").decode())
    except Exception:  # noqa: BLE001 - (the store's host is gone): this rank raises the error it met
        return None
    return None


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


def check_same_on_every_rank(state: ParallelState, name: str, value: object) -> None:
    """A setting that chooses which collectives run, refused on every rank where the ranks differ on it (torchrun's
    ranks each read their own command line; ranks TPEngine starts are given rank 0's): they would otherwise meet in
    different collectives, a hang or garbled exchanges."""
    if state.world_size == 1:
        return
    values = gather_objects(state, value)
    if any(v != values[0] for v in values):
        given = ", ".join(f"rank {rank} {v!r}" for rank, v in enumerate(values))
        raise ConfigError(f"{name} differs between ranks: {given}; give every rank the same", (name,))


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
