"""CustomAllReduce: the workspace, its IPC exchange, and calls into tpgraph._C. Policy (which algorithm,
how many blocks) comes from the tables in thresholds.py; the kernels live in csrc/.

Eager: pull algorithms stage the input in this rank's workspace. Inside `capture()`, while the stream is
capturing, pull calls are zero-copy: each takes a row of a device pointer table and the kernel reads the
peers' original buffers through it; the rows are filled when `capture()` exits (one handle exchange).
2shot_multicast runs as its unicast emulation (the same kernel over peer mappings): this build never creates
a multicast object, so `multicast_live` is False and the tables never pick it; tests force it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from tpgraph._ext import load_ext
from tpgraph.comm.limits import algo_codes, dtype_codes, kernel_limits
from tpgraph.comm.registration import CaptureRegistration
from tpgraph.comm.thresholds import WORLD_SIZES, Algo, AlgoTable, Bands, load_table_for, pick_algo
from tpgraph.comm.topology import host_identity, hosts_reason, nvlink_reason, p2p_env_reason, unexportable_allocator
from tpgraph.distributed import ParallelState, gather_objects, run_on_all_ranks, shared_gpu
from tpgraph.errors import AllReduceUnavailable, CommError, ConfigError
from tpgraph.kernels._settings import env_flag
from tpgraph.kernels.lamport import (
    MAX_HIDDEN,
    MAX_ROWS,
    PHASES_BYTES,
    SENTINEL_WORD,
    Channel,
    epilogue_enabled,
    region_bytes,
)

logger = logging.getLogger(__name__)
ZERO_COPY_IN_GRAPHS = (Algo.PULL_1SHOT, Algo.PULL_2SHOT)
MB = 1 << 20
MAX_TIMEOUT_S = 2**63 / 1e9  # a kernel wait's limit travels as int64 nanoseconds


@dataclass(frozen=True)
class CallPlan:
    """Everything one call needs besides its pointers, computed once per (dtype, size, mode, forced algorithm,
    forced grid) and cached."""

    algo: Algo
    algo_code: int
    dtype_code: int
    nbytes: int
    blocks: int
    zero_copy: bool  # graph mode: pull inputs are read through a pointer-table row, no staging copy


def timeout_default() -> float:
    """TPGRAPH_AR_TIMEOUT_S, seconds (30 where unset); one that is no number is refused with its name (float() raised
    a ValueError traceback from the engine's start). Set to nothing: as unset, as tpgraph's other variables read it."""
    text = os.environ.get("TPGRAPH_AR_TIMEOUT_S", "").strip() or "30"
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    # (a negative, inf or nan one was refused as the config's "timeout_s", a name no user set)
    if not 0 <= value < MAX_TIMEOUT_S:
        raise ConfigError(f"TPGRAPH_AR_TIMEOUT_S must be a number of seconds (0: wait forever), at least 0 and below "
                          f"{MAX_TIMEOUT_S:.0f}, got {text!r}")
    return value


def fused_norm_default() -> bool:
    """Whether the all-reduce is fused with the residual add + RMSNorm after it, unless the caller says (on;
    TPGRAPH_FUSED_AR_NORM=0: the unfused pair, for comparisons)."""
    return env_flag("TPGRAPH_FUSED_AR_NORM", default=True)


@dataclass(frozen=True)
class CustomAllReduceConfig:
    # The push slot is per rank and the workspace holds 3 phases x world_size of them (at 8 ranks, 24 x the slot),
    # so it is capped: a larger message goes through it in slot-sized pieces, one launch each.
    max_push_bytes: int = 16 * MB
    push_slot_bytes: int | None = None  # None: the table's largest push band, capped by max_push_bytes
    max_staging_bytes: int = 64 * MB  # eager pull copies its input here; graphs read inputs in place (zero-copy)
    staging_bytes: int | None = None  # None: what the table's pull bands can reach, capped by max_staging_bytes
    # read when a config is made (not at import), so the environment of the moment counts
    # A kernel waiting longer than this for a peer traps, which ends this process's CUDA context (every later CUDA
    # call fails; the process must exit) but names rank, algorithm and peer instead of hanging. 0: wait forever.
    timeout_s: float = field(default_factory=timeout_default)
    # programmatic dependent launch: the next kernel is scheduled while the previous one drains (sm_90+)
    pdl: bool = field(default_factory=lambda: env_flag("TPGRAPH_AR_PDL", default=True))
    # 1shot_push fused with the residual add + RMSNorm after it (off: the unfused pair, for comparisons)
    fused_norm: bool = field(default_factory=fused_norm_default)
    # elements (rows x hidden, 16-bit) one all-reduce fused into a small-M projection's epilogue can carry
    # (kernels/lamport.py): 16 decode rows of a hidden size up to 8192, or 32 of a hidden size up to 4096. 0: no
    # channel (the all-reduce runs as its own kernel after the projection).
    channel_slot_elems: int = MAX_ROWS * MAX_HIDDEN

    def __post_init__(self) -> None:
        for name in ("max_push_bytes", "max_staging_bytes", "push_slot_bytes", "staging_bytes"):
            value = getattr(self, name)
            vector = kernel_limits().vector_bytes
            if value is not None and (value < 0 or value % vector):
                raise ConfigError(f"{name} must be a non-negative multiple of {vector}, got {value}")
        if self.channel_slot_elems < 0 or self.channel_slot_elems % 8:
            raise ConfigError(f"channel_slot_elems must be a non-negative multiple of 8, got {self.channel_slot_elems}")
        if not 0 <= self.timeout_s < MAX_TIMEOUT_S:  # (nan too: the kernels take int64 nanoseconds)
            raise ConfigError(f"timeout_s must be >= 0 (0: wait forever, for debuggers) and below {MAX_TIMEOUT_S:.0f}, "
                              f"got {self.timeout_s}")


MIN_STAGING_BYTES = 4096  # room for the P2P probe words, one per rank


def clamp_to_workspace(table: AlgoTable, staging_bytes: int, graph_in_place: bool = False) -> AlgoTable:
    """The table with every staged pull band cut to what the staging buffer holds (larger messages fall through to
    the next algorithm). 1shot_push is never cut: above the slot it runs in pieces. `graph_in_place`: graph rows'
    pull algorithms read their inputs in place (zero-copy), so the staging buffer does not bound them."""
    def clamp(mode: str, b: Bands) -> Bands:
        push = b.push_max
        limit = b.pull2_max if (graph_in_place and mode == "graph") else staging_bytes
        pull1 = max(push, min(b.pull1_max, limit))  # (pull1_max >= push_max: what push cannot hold goes to pull)
        pull2 = max(pull1, min(b.pull2_max, limit))
        return replace(b, push_max=push, pull1_max=pull1, pull2_max=pull2, multicast=None)

    return replace(table, rows={k: clamp(k[1], b) for k, b in table.rows.items()})


def size_workspace(table: AlgoTable, world_size: int, cfg: CustomAllReduceConfig,
                   graph_in_place: bool) -> tuple[int, int, AlgoTable]:
    """(push slot bytes, staging bytes, the table cut to them) for this world size. The slot holds the largest push
    band, capped by max_push_bytes (larger pushes go through it in pieces); staging holds the largest message a
    staged pull band reaches (eager rows, and graph rows unless inputs are read in place), capped by
    max_staging_bytes, and nothing where no pull band is reachable."""
    rows = {mode: table.bands(world_size, mode == "graph") for mode in ("graph", "eager")}
    push = cfg.push_slot_bytes if cfg.push_slot_bytes is not None else min(max(b.push_max for b in rows.values()),
                                                                            cfg.max_push_bytes)
    if push == 0:  # no slot (max_push_bytes=0 or push_slot_bytes=0): the kernel refuses push, so no band may pick it
        table = replace(table, rows={k: replace(b, push_max=0) for k, b in table.rows.items()})
        rows = {mode: table.bands(world_size, mode == "graph") for mode in ("graph", "eager")}
    staged = [b for mode, b in rows.items() if mode == "eager" or not graph_in_place]
    reach = max((b.pull2_max for b in staged if b.pull2_max > b.push_max), default=0)
    staging = cfg.staging_bytes if cfg.staging_bytes is not None else min(reach, cfg.max_staging_bytes)
    # set-up writes a probe word per rank at the staging offset of every peer (_check_p2p_writes): keep room for it
    staging = max(staging, MIN_STAGING_BYTES)
    return push, staging, clamp_to_workspace(table, staging, graph_in_place)


def fused_norm_fits(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Shapes, dtypes and layouts the fused 1shot_push + add + RMSNorm kernel takes."""
    if x.dim() != 2 or x.dtype not in dtype_codes() or residual.shape != x.shape or residual.dtype != x.dtype:
        return False
    row_bytes = x.shape[1] * x.element_size()
    k = kernel_limits()  # rows are whole chunks (one warp's vectors), at most norm_max_row_chunks of them
    return (weight.shape == (x.shape[1],) and weight.dtype == x.dtype and x.shape[0] > 0
            and row_bytes % k.chunk_bytes == 0 and row_bytes <= k.norm_max_row_chunks * k.chunk_bytes
            and x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()
            and all(t.data_ptr() % 16 == 0 for t in (x, residual, weight)))


def agree_on_devices(devices: list[tuple[int, tuple[int, int]]]) -> int:
    """Every rank's (SM count, compute capability) -> the SM count all ranks size their grids with. Grids must be
    equal on every rank (block b waits for block b of each peer), so the smallest GPU decides; one table serves
    the group, so the architectures must match."""
    archs = {cap for _, cap in devices}
    if len(archs) != 1:
        raise AllReduceUnavailable(f"custom all-reduce disabled: the ranks' GPUs differ in architecture "
                                   f"{[f'sm_{a}{b}' for _, (a, b) in devices]} (rank order)")
    return min(sms for sms, _ in devices)


class CustomAllReduce:
    def __init__(self, state: ParallelState, cfg: CustomAllReduceConfig | None = None) -> None:
        cfg = cfg or CustomAllReduceConfig()
        if state.device.type != "cuda":
            raise CommError("the custom all-reduce needs CUDA devices")
        if state.world_size not in WORLD_SIZES:
            raise CommError(f"the custom all-reduce supports {WORLD_SIZES.start}..{WORLD_SIZES.stop - 1} ranks, "
                            f"got {state.world_size}")
        self.ext = load_ext()
        self.state, self.cfg = state, cfg
        # one machine first (every rank reaches this exchange): across machines the NVLink check below would judge
        # this host's GPUs by other hosts' ranks, and a peer's IPC handle cannot be opened here
        spread = hosts_reason(gather_objects(state, host_identity()))
        if spread:
            raise AllReduceUnavailable(f"custom all-reduce disabled: {spread}")
        # NVLink between every pair matters from 3 ranks up (one node: rank r drives CUDA device r, or with
        # TPGRAPH_SHARED_GPU every rank GPU 0, which has no pair to link); two PCIe GPUs still gain from it, as vLLM
        # also allows.
        group_devices = [0] if shared_gpu() else list(range(state.world_size))
        linked = state.world_size > 2 and len(group_devices) > 1

        def gates():
            for reason in (p2p_env_reason(), nvlink_reason(group_devices) if linked else None):
                if reason:
                    raise AllReduceUnavailable(f"custom all-reduce disabled: {reason}")
            return self.ext.device_properties(state.device.index)

        # Every step a rank takes alone before an exchange is agreed on (run_on_all_ranks): one that raised on its
        # rank alone (a gate of that rank's environment, no memory for its workspace) sent it to the caller's
        # exchange while the others went on to set-up's next one, which paired with it.
        props = run_on_all_ranks(state, gates, "custom all-reduce set-up (this rank's gates)")
        # memory CUDA IPC cannot export (VMM-backed, stream-ordered): graphs then stage their inputs
        backend = torch.cuda.get_allocator_backend() if torch.cuda.is_available() else None
        unexportable = unexportable_allocator(backend=backend)
        self.zero_copy = unexportable is None
        if not self.zero_copy and state.is_driver:
            logger.warning("%s: graph-captured all-reduces copy their input into the workspace (slower) instead of "
                           "zero-copy registration", unexportable)
        self.num_sms = agree_on_devices(gather_objects(state, (props.sm_count, (props.major, props.minor))))
        ws = state.world_size
        table = load_table_for((props.major, props.minor))
        push, staging, self.table = size_workspace(table, ws, cfg, graph_in_place=self.zero_copy)
        self.push_slot_bytes, self.staging_bytes = push, staging
        self._opened: list[bytes] = []  # peer workspace handles this object opened
        self._registrations: list[CaptureRegistration] = []  # live captures (released with their graphs)
        slot_elems = cfg.channel_slot_elems
        channel_bytes = region_bytes(ws, slot_elems) if slot_elems else 0
        self.channel: Channel | None = None
        self.ctx = 0

        def create() -> bytes:
            self.ctx = self.ext.ar_create(state.rank, ws, push, staging, cfg.pdl, channel_bytes)
            return self.ext.ipc_get_handle(self.ext.ar_workspace(self.ctx))

        try:
            handle = run_on_all_ranks(state, create,
                                      "custom all-reduce set-up (allocating and exporting the workspace)")
            base = self.ext.ar_workspace(self.ctx)
            handles = gather_objects(state, handle)
            # every rank has mapped every workspace before the first kernel, or every rank knows which could not (a
            # peer's workspace refused to map on one rank alone, raised there alone, paired the others' next exchanges
            # with its fallback's)
            peers = run_on_all_ranks(state, lambda: self._map_peers(base, handles, channel_bytes, slot_elems),
                                     "custom all-reduce set-up (mapping the peers' workspaces)")
            self._check_p2p_writes(peers)
        except BaseException:
            self._release()  # the workspace is hundreds of MiB: never leak it when setup fails
            raise
        self.timeout_ns = int(cfg.timeout_s * 1e9)
        self._watchdog_stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch_timeouts, name="tpgraph-ar-watchdog", daemon=True)
        self._watchdog.start()
        self._capturing = False
        self._pending: list[tuple[int, int]] = []  # (row, input pointer) recorded during capture
        self._plans: dict[tuple, CallPlan | None] = {}
        self._device_index = state.device.index
        if state.is_driver:
            logger.info("custom all-reduce: %.1f MiB workspace per rank; eager bands %s",
                        self.ext.ar_workspace_bytes(self.ctx) / MB, self.table.bands(ws, False).describe())

    def push_channel(self, residual: torch.Tensor) -> Channel | None:
        """The channel for a row-parallel output shaped like `residual`, where the fused all-reduce takes it (the
        fused norm on, TPGRAPH_GEMV_ALLREDUCE=1, rows and dtype the channel carries), else None. Off by default at
        TP > 1 until it has run on two GPUs: so far it has run with ranks emulated on one
        (bench/results/2026-12-01_h200_lamport)."""
        if self.channel is None or not self.cfg.fused_norm or not epilogue_enabled(self.state.world_size):
            return None
        return self.channel if self.channel.takes(residual) else None

    def _map_peers(self, base: int, handles: list[bytes], channel_bytes: int, slot_elems: int) -> list[int]:
        """Open every peer's workspace (this rank's own at its place), hand the pointers to the context, and arm the
        push channel; returns the pointers in rank order."""
        peers = []
        for r, handle in enumerate(handles):
            if r == self.state.rank:
                peers.append(base)
                continue
            peers.append(self.ext.ipc_open_handle(handle))
            self._opened.append(handle)  # only once open: _release closes exactly these
        self.ext.ar_set_peers(self.ctx, peers)
        if channel_bytes:  # arm the channel's slots (its phases are zero), before any peer can push
            offset = self.ext.ar_channel_offset(self.ctx)
            self.ext.fill_u32(base + offset + PHASES_BYTES, SENTINEL_WORD, (channel_bytes - PHASES_BYTES) // 4,
                              torch.cuda.current_stream(self.state.device).cuda_stream)
            # the regions, then this context's timeout record: the epilogue's timeouts are named as ours are
            addrs = [p + offset for p in peers] + [self.ext.ar_timeout_record(self.ctx)]
            self.channel = Channel(torch.tensor(addrs, dtype=torch.int64, device=self.state.device), self.state.rank,
                                   self.state.world_size, slot_elems, int(self.cfg.timeout_s * 1e9))
        torch.cuda.synchronize()
        return peers

    def _check_p2p_writes(self, peers: list[int]) -> None:
        """A real P2P check: write a word into each peer's workspace through the IPC mapping, then let the peer
        read it back. Links that advertise P2P but drop writes (some VMs, PCIe ACS) fail here, on every rank."""
        ws, rank = self.state.world_size, self.state.rank
        staging = self.ext.ar_staging_offset(self.ctx)
        stream = torch.cuda.current_stream().cuda_stream
        for peer in range(ws):
            if peer != rank:
                self.ext.fill_u32(peers[peer] + staging + 4 * rank, 0x7A170000 + 16 * rank + peer, 1, stream)
        torch.cuda.synchronize()
        gather_objects(self.state, None)  # all writes issued and completed
        got = torch.empty(ws, dtype=torch.int32, device=self.state.device)
        self.ext.memcpy_async(got.data_ptr(), peers[rank] + staging, 4 * ws, stream)
        torch.cuda.synchronize()
        words = got.cpu().tolist()
        bad = [r for r in range(ws) if r != rank and (words[r] & 0xFFFFFFFF) != 0x7A170000 + 16 * r + rank]
        everyone = gather_objects(self.state, bad)
        broken = [(r, p) for r, lost in enumerate(everyone) for p in lost]
        if broken:
            raise AllReduceUnavailable(f"peer writes through CUDA IPC were lost (writer -> reader): "
                                       f"{[(p, r) for r, p in broken]}; P2P is advertised but does not work here")

    multicast_live = False  # no multicast objects yet; where the environment forbids them, never

    def pick(self, x: torch.Tensor, graph: bool | None = None) -> Algo:
        """The table's algorithm for x, in the current mode unless `graph` says which."""
        graph = self.graph_mode if graph is None else graph
        return pick_algo(x.numel() * x.element_size(), graph, self.table, self.state.world_size, dtype=x.dtype,
                         contiguous=x.is_contiguous(), multicast_live=self.multicast_live)

    @property
    def graph_mode(self) -> bool:
        """True while the current stream is capturing inside capture(): the graph table and zero-copy apply."""
        if not self._capturing:
            return False
        try:
            return torch.cuda.is_current_stream_capturing()
        except RuntimeError as exc:  # a trapped kernel poisoned the context: name the cause if it was ours
            raise self.timeout_error() or exc from None

    def plan(self, x: torch.Tensor, algo: Algo | None = None, blocks: int | None = None) -> CallPlan | None:
        """The call plan for x in the current mode (None: the table sends it to NCCL). Forcing an algorithm or a
        grid size overrides the table. Cached, so a decode step pays for the policy once per shape."""
        graph = self.graph_mode
        key = (x.dtype, x.numel(), graph, algo, blocks)
        try:
            return self._plans[key]
        except KeyError:
            pass
        nbytes = x.numel() * x.element_size()
        if algo is None:
            algo = self.pick(x, graph)
            if algo == Algo.NCCL:
                self._plans[key] = None
                return None
        if algo.value not in algo_codes():
            raise CommError(f"{algo.value} cannot run on the custom path here")
        if x.dtype not in dtype_codes():
            raise CommError(f"custom all-reduce needs a bf16/fp16/fp32 tensor, got {x.dtype}")
        if blocks is None:
            blocks = self.table.blocks(algo, self.state.world_size, self.num_sms, nbytes)
        zero_copy = graph and self.zero_copy and algo in ZERO_COPY_IN_GRAPHS
        plan = CallPlan(algo, algo_codes()[algo.value], dtype_codes()[x.dtype], nbytes, blocks, zero_copy)
        self._plans[key] = plan
        return plan

    def all_reduce(self, x: torch.Tensor, algo: Algo | None = None, blocks: int | None = None) -> torch.Tensor:
        """Sum x over the ranks with `algo` (and `blocks`, which must then be the same on every rank) or the
        table's choice. Returns the result: x itself (in place), except zero-copy 1shot_pull in graph mode, which
        writes a new tensor (peers still read x)."""
        self._check_tensor(x)
        if not x.is_contiguous():
            raise CommError("custom all-reduce needs a contiguous tensor")
        plan = self.plan(x, algo, blocks)
        if plan is None:
            raise CommError(f"the table sends {x.numel() * x.element_size()} bytes to NCCL")
        return self._run(x, plan)

    def try_all_reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        """The table's choice on the custom path, or None where NCCL should do it (the communicator's entry)."""
        self._check_tensor(x)
        # (the kernels move 16-byte vectors: a view that starts mid-vector, e.g. x[1:], goes to NCCL, not to an error)
        if not x.is_contiguous() or x.data_ptr() % kernel_limits().vector_bytes:
            return None
        plan = self.plan(x)
        return None if plan is None else self._run(x, plan)

    def try_all_reduce_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                   eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused kernel where the table picks 1shot_push for x and the rows fit it; None otherwise (the caller
        runs the unfused pair)."""
        self._check_tensor(x)
        # Fused only while every row gets its own block (decode batches): with more rows a block works through several
        # one after another, unpipelined, which has not been measured against the unfused pair (prefill sizes).
        if not (self.cfg.fused_norm and fused_norm_fits(x, residual, weight) and x.shape[0] <= self.num_sms
                and x.numel() * x.element_size() <= self.push_slot_bytes):  # the fused kernel takes no pieces
            return None
        plan = self.plan(x)
        if plan is None or plan.algo != Algo.PUSH_1SHOT:
            return None
        return self._fused_norm(x, residual, weight, eps, min(x.shape[0], self.num_sms))

    def all_reduce_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                               blocks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * rmsnorm(sum(x) + residual), sum(x) + residual): 1shot_push, the residual add and RMSNorm in one
        kernel, whatever the table says. x, residual [rows, hidden] and weight [hidden], one dtype."""
        self._check_tensor(x)
        if not fused_norm_fits(x, residual, weight):
            raise CommError(f"fused all-reduce + RMSNorm needs contiguous, 16-byte aligned x and residual [rows, "
                            f"hidden] and weight [hidden] of one bf16/fp16/fp32 dtype, with rows of whole "
                            f"{kernel_limits().chunk_bytes}-byte chunks up to "
                            f"{kernel_limits().norm_max_row_chunks * kernel_limits().chunk_bytes} bytes; got x "
                            f"{tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} {residual.dtype}, weight "
                            f"{tuple(weight.shape)} {weight.dtype}")
        # a block owns whole rows; every block must be resident
        return self._fused_norm(x, residual, weight, eps, blocks or min(x.shape[0], self.num_sms))

    def _fused_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The launch, once the callers above have checked the tensors."""
        rows, hidden = x.shape
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        try:
            stream = torch._C._cuda_getCurrentRawStream(self._device_index)
            self.ext.ar_all_reduce_add_rmsnorm(self.ctx, dtype_codes()[x.dtype], x.data_ptr(), residual.data_ptr(),
                                               weight.data_ptr(), out.data_ptr(), res_out.data_ptr(), rows, hidden,
                                               eps, blocks, stream, self.timeout_ns)
        except (RuntimeError, ValueError) as exc:
            raise CommError(f"rank {self.state.rank}, 1shot_push + RMSNorm: {exc}") from None
        return out, res_out

    def _check_tensor(self, x: torch.Tensor) -> None:
        if x.get_device() != self._device_index:  # -1 on CPU
            raise CommError(f"custom all-reduce of rank {self.state.rank} runs on cuda:{self._device_index}, "
                            f"got a tensor on {x.device}")

    def _run(self, x: torch.Tensor, plan: CallPlan) -> torch.Tensor:
        out, row = x, -1
        try:
            if plan.zero_copy:
                row = self.ext.ar_reserve_row(self.ctx)
                self._pending.append((row, x.data_ptr()))
                if plan.algo == Algo.PULL_1SHOT:
                    out = torch.empty_like(x)
            stream = torch._C._cuda_getCurrentRawStream(self._device_index)
            self.ext.ar_all_reduce(self.ctx, plan.algo_code, plan.dtype_code, x.data_ptr(), out.data_ptr(),
                                   plan.nbytes, plan.blocks, stream, self.timeout_ns, row)
        except (RuntimeError, ValueError) as exc:  # the extension's CUDA errors and refused arguments
            raise CommError(f"rank {self.state.rank}, {plan.algo.value}: {exc}") from None
        return out

    @contextlib.contextmanager
    def capture(self) -> Iterator[CaptureRegistration]:
        """Wrap CUDA-graph capture. On exit, every rank's captured pull inputs are registered in one exchange.

        Yields the registration: the rows and peer mappings this capture takes. Whoever owns the captured graphs
        releases it (`release_registration`) once they are dropped, so rows are reused and peers' memory freed."""
        if self._capturing:
            raise CommError("capture() is already active")
        self._capturing, self._pending = True, []
        registration = CaptureRegistration()
        try:
            yield registration
        except BaseException as exc:
            self._capturing = False
            rows, self._pending = [row for row, _ in self._pending], []
            # the peers are about to exchange their captured calls: tell them first, instead of leaving them waiting
            try:
                gather_objects(self.state, f"rank {self.state.rank} failed while capturing: {exc!r}")
            finally:
                try:
                    self._return_rows(rows)
                except RuntimeError as cuda_error:  # a dead context cannot zero rows; the original error matters
                    logger.error("pointer-table rows not returned after a failed capture: %s", cuda_error)
            raise
        self._capturing = False
        try:
            self.register_captured(registration)
        except BaseException:
            self.release_registration(registration)
            raise
        self._registrations.append(registration)

    def register_captured(self, registration: CaptureRegistration | None = None) -> None:
        registration = registration if registration is not None else CaptureRegistration()
        pending, self._pending = self._pending, []
        registration.rows.extend(row for row, _ in pending)
        counts = gather_objects(self.state, len(pending))
        failed = [c for c in counts if isinstance(c, str)]
        if failed:
            raise CommError(f"capture abandoned: {'; '.join(failed)}")
        if len(set(counts)) != 1:
            raise CommError(f"ranks captured different numbers of custom all-reduces: {counts} (rank order); "
                            "every rank must capture the same sequence of collectives")
        # Handles are taken afresh at every registration: a freed graph pool can hand the same address to a new
        # allocation, whose handle differs (peers cache mappings by handle, so a new handle gets a new mapping).
        # Each step a rank may fail alone ends in an exchange every rank reaches, its failure in it: a rank that
        # raised before the exchange left its peers to pair it with its next collective.
        everyone = self._agreed(lambda: self._export(pending), "sharing its captured inputs")
        self._agreed(lambda: self._fill(pending, everyone, registration), "mapping the peers' captured inputs")

    def _agreed(self, step, what: str):
        """Every rank's result of `step` (this rank's own error raised where it failed, after the exchange); where a
        peer failed, a CommError naming it, as for an abandoned capture."""
        result, error = None, None
        try:
            result = step()
        except Exception as exc:  # noqa: BLE001 - raised below, once the peers know
            error = exc
        everyone = gather_objects(self.state, result if error is None else
                                  f"rank {self.state.rank} failed {what}: {type(error).__name__}: {error}")
        try:
            if error is not None:
                raise error
            failed = [v for v in everyone if isinstance(v, str)]
            if failed:
                raise CommError(f"capture abandoned: {'; '.join(failed)}")
            return everyone
        finally:
            del error

    def _export(self, pending: list[tuple[int, int]]) -> list[tuple[bytes, int]]:
        """(IPC handle of its allocation, offset in it) of each captured input."""
        exported: dict[int, bytes] = {}
        mine = []
        for _, ptr in pending:
            base, _size = self.ext.allocation_range(ptr)
            if base not in exported:
                try:
                    exported[base] = self.ext.ipc_get_handle(base)
                except RuntimeError as exc:
                    raise CommError(f"cannot share a captured all-reduce input over CUDA IPC: {exc}") from None
            mine.append((exported[base], ptr - base))
        return mine

    def _fill(self, pending: list[tuple[int, int]], everyone: list, registration: CaptureRegistration) -> None:
        """Map the peers' captured inputs and fill the rows: all rows everywhere before anyone replays."""
        ptrs = []
        for i, (_, ptr) in enumerate(pending):
            for r in range(self.state.world_size):
                if r == self.state.rank:
                    ptrs.append(ptr)
                else:
                    handle, offset = everyone[r][i]
                    ptrs.append(self.ext.ipc_open_handle(handle) + offset)  # cached: one mapping per allocation
                    registration.handles.append(handle)  # each open counts a reference, closed on release
        self.ext.ar_fill_rows(self.ctx, [row for row, _ in pending], ptrs)
        torch.cuda.synchronize()

    def release_registration(self, registration: CaptureRegistration) -> None:
        """Give back what a capture registered: its rows (zeroed, reused by later captures) and its mappings of
        the peers' captured buffers (which otherwise pin the peers' freed graph pools). The graphs that use the
        rows must be dropped first: a replay after this traps as 'unregistered'. Local only: no collective."""
        if registration.released:
            return
        registration.released = True
        if registration in self._registrations:
            self._registrations.remove(registration)
        self._return_rows(registration.rows)
        for handle in registration.handles:
            self.ext.ipc_close_handle(handle)
        registration.rows, registration.handles = [], []

    def _return_rows(self, rows: list[int]) -> None:
        if rows and self.ctx:
            self.ext.ar_release_rows(self.ctx, rows)

    @property
    def workspace_bytes(self) -> int:
        return self.ext.ar_workspace_bytes(self.ctx) if self.ctx else 0

    @property
    def rows_in_use(self) -> int:
        return self.ext.ar_rows_in_use(self.ctx)

    def _watch_timeouts(self) -> None:
        """Log a kernel timeout the moment it fires (the record is host memory, no CUDA call): the trap's sticky
        CUDA error then reaches the caller wherever it next synchronizes, but the log already names the peer.
        The next all_reduce raises the same message as a CommError."""
        while not self._watchdog_stop.wait(0.2):
            message = self.ext.ar_timeout_message(self.ctx)
            if message:
                logger.error("%s", message)
                return

    def timeout_error(self) -> CommError | None:
        """After a CUDA failure: the error naming rank, algorithm and peer, if a kernel wait timed out."""
        message = self.ext.ar_timeout_message(self.ctx)
        return CommError(message) if message else None

    def close(self) -> None:
        if getattr(self, "_watchdog", None) is not None:
            self._watchdog_stop.set()
            self._watchdog.join()
            self._watchdog = None
        if self.ctx:
            try:
                torch.cuda.synchronize()
            except RuntimeError as exc:  # a trapped kernel: the CUDA context is gone, nothing can be freed
                logger.error("custom all-reduce not released: %s", self.timeout_error() or exc)
                self.ctx = 0
                return
            self._release()

    def _release(self) -> None:
        for registration in list(self._registrations):
            self.release_registration(registration)
        for h in self._opened:
            self.ext.ipc_close_handle(h)
        self._opened = []
        if self.ctx:  # (0: set-up failed before the context was made)
            self.ext.ar_destroy(self.ctx)
        self.ctx = 0
