"""GraphRunner: capture each phase's forward once per bucket size, replay it, and account for its memory.

Capture goes largest bucket first into one shared pool, with warm-ups, gc frozen and a progress bar, inside the
communicator's `capture()` so every all-reduce input captured is registered in one exchange. The set of graphs of
a phase owns that registration (pointer-table rows, peer IPC mappings) and gives it back when it is released or
re-captured. After `close_capture_phase()`, any capture raises and workspaces can no longer grow.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from tqdm import tqdm

from tpgraph.comm.registration import CaptureRegistration
from tpgraph.errors import CaptureError
from tpgraph.graphs.captured import BreakableGraph, Captured, Forward, FullGraph, PiecewiseGraph, call
from tpgraph.graphs.workspace import Workspaces

logger = logging.getLogger(__name__)
KINDS = ("full", "piecewise", "breakable")
OOM_REMEDIES = ("lower --gpu-memory-utilization (leaves more room outside the KV cache), capture fewer buckets "
                "(--cuda-graph-ladder with a shorter list, or a smaller --max-num-seqs), use --cuda-graph-mode "
                "piecewise, or run without graphs (--enforce-eager)")


class CaptureComm(Protocol):
    """What the runner needs of the communicator."""

    capture_locked: bool

    def capture(self) -> Any: ...

    def release_capture(self, registration: CaptureRegistration) -> None: ...


@dataclass(eq=False)
class GraphSet:
    """One phase's captured forwards, keyed by bucket size."""

    phase: str
    kind: str
    graphs: dict[int, Captured]
    registration: CaptureRegistration
    input_ptrs: dict[int, dict[str, int]]  # what each graph read at capture (debug address check)
    capture_bytes: dict[int, int] = field(default_factory=dict)  # device memory each capture took
    capture_s: float = 0.0

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.graphs))

    @property
    def pool_bytes(self) -> int:
        return sum(self.capture_bytes.values())


def estimate_pool_bytes(first: int, second: int, sizes: tuple[int, ...], kind: str = "full") -> int:
    """Graph memory for capturing every size in `sizes` into one pool, from the two largest captures (`first` and
    `second` bytes). The largest sets the pool's working set.

    full: the second adds what sharing the pool costs and the smaller ones fit in what is there (outputs live in
    persistent buffers, so nothing accumulates per graph). Measured on 2xH200 (35 vLLM-ladder buckets, 4-layer
    model): a uniform `second` per later graph estimated 150 MiB and one proportional to the bucket size 119 MiB,
    against 94 MiB taken; the two equations give the largest capture 92.1 MiB and the second 1.7 MiB, so the 33 later
    captures together added about 0.2 MiB.
    piecewise: each graph keeps the tensors its attention calls read (q, k, v per layer), in proportion to its token
    count, so each smaller size adds `second` scaled by its size."""
    order = sorted(set(sizes), reverse=True)
    if not order:
        return 0
    first, second = max(first, 0), max(second, 0)
    if len(order) == 1:
        return first
    if kind == "piecewise":
        return first + int(second / order[1] * sum(order[1:]))
    return first + second


class GraphRunner:
    def __init__(self, comm: CaptureComm, device: torch.device, *, warmups: int = 1, check_addresses: bool = False,
                 show_progress: bool = True) -> None:
        self.comm, self.device = comm, device
        self.warmups, self.check_addresses, self.show_progress = warmups, check_addresses, show_progress
        self.workspaces = Workspaces()
        self.sets: dict[str, GraphSet] = {}
        self.capture_open = True
        self._pool: Any = None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # ---- capture ---------------------------------------------------------------------------------------------
    def capture(self, phase: str, kind: str, sizes: tuple[int, ...], forward: Forward,
                inputs: Callable[[int], dict[str, torch.Tensor]], prepare: Callable[[int], None]) -> GraphSet:
        """Capture forward at every size (largest first). `prepare(size)` writes valid dummy inputs into the
        persistent buffers; `inputs(size)` names the tensors the forward reads at that size."""
        if not self.capture_open:
            raise CaptureError(f"capture of {phase!r} graphs after the capture phase ended: the workspaces are locked "
                               "and graphs may already hold their addresses; call reopen_capture_phase() first")
        if kind not in KINDS:
            raise CaptureError(f"unknown graph kind {kind!r}; choose one of {', '.join(KINDS)}")
        if kind != "breakable" and self.device.type != "cuda":
            raise CaptureError(f"{kind} CUDA graphs need a CUDA device (this runner is on {self.device})")
        if phase in self.sets:
            self.release(phase)  # re-capture: give back the old graphs' rows and mappings first
        if self._pool is None and self.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        order = sorted(set(sizes), reverse=True)
        graphs: dict[int, Captured] = {}
        used: dict[int, int] = {}
        start = time.perf_counter()
        with self._frozen_gc(), self.comm.capture() as registration:
            bar = tqdm(order, desc=f"capturing {phase} graphs ({kind})", disable=not self.show_progress,
                       unit="graph", leave=False)
            for size in bar:
                try:
                    prepare(size)
                    if kind != "breakable":
                        for _ in range(self.warmups):
                            forward(size, call)  # eager, inside capture(): all-reduces really communicate
                    free_before = self._free_bytes()
                    graphs[size] = self._capture_one(kind, forward, size)
                    used[size] = free_before - self._free_bytes()
                except torch.OutOfMemoryError as exc:
                    raise CaptureError(f"out of GPU memory while capturing the {phase} graph for {size} tokens: "
                                       f"{OOM_REMEDIES}") from exc
        graph_set = GraphSet(phase, kind, graphs, registration,
                             {s: _ptrs(inputs(s)) for s in graphs}, used, time.perf_counter() - start)
        self.sets[phase] = graph_set
        return graph_set

    def _capture_one(self, kind: str, forward: Forward, size: int) -> Captured:
        if kind == "breakable":
            return BreakableGraph(forward, size)
        assert self._stream is not None
        torch.cuda.synchronize(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        if kind == "full":
            graph: Captured = FullGraph(forward, size, self._pool, self._stream)
        else:
            graph = PiecewiseGraph(forward, size, self._pool, self._stream, self.workspaces)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return graph

    def _free_bytes(self) -> int:
        """The device's free memory: a capture's cost counts what libraries allocate outside PyTorch's pool too.
        (Ranks that share one GPU, TPGRAPH_SHARED_GPU, move it for each other: their capture figures are not theirs.)"""
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.mem_get_info(self.device)[0]

    @contextmanager
    def _frozen_gc(self) -> Iterator[None]:
        """No collection during capture (slow, and it could free tensors mid-graph); old objects frozen out of it."""
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            yield
        finally:
            gc.enable()
            gc.unfreeze()

    def close_capture_phase(self) -> None:
        """From now on: capture raises, workspaces cannot grow, and the communicator refuses to capture."""
        self.capture_open = False
        self.workspaces.lock()
        self.comm.capture_locked = True

    def reopen_capture_phase(self) -> None:
        self.capture_open = True
        self.workspaces.locked = False
        self.comm.capture_locked = False

    # ---- replay ----------------------------------------------------------------------------------------------
    def replay(self, phase: str, size: int, inputs: Callable[[int], dict[str, torch.Tensor]] | None = None
               ) -> torch.Tensor:
        graph_set = self.sets[phase]
        if self.check_addresses:
            if inputs is None:
                raise CaptureError("check_addresses needs the replay's inputs")
            self._check_addresses(graph_set, size, _ptrs(inputs(size)))
        return graph_set.graphs[size].replay()

    @staticmethod
    def _check_addresses(graph_set: GraphSet, size: int, now: dict[str, int]) -> None:
        captured = graph_set.input_ptrs[size]
        moved = [f"{name}: captured at {captured.get(name, 0):#x}, now at {ptr:#x}"
                 for name, ptr in now.items() if captured.get(name) != ptr]
        if moved:
            raise CaptureError(f"the {graph_set.phase} graph for {size} tokens would read stale inputs (an input was "
                               f"rebound after capture; write persistent buffers in place instead): {'; '.join(moved)}")

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def release(self, phase: str | None = None) -> None:
        """Drop a phase's graphs (all phases if None), then give back their all-reduce rows and peer mappings.
        Their pool memory returns to the device at the next torch.cuda.empty_cache()."""
        for name in [phase] if phase is not None else list(self.sets):
            graph_set = self.sets.pop(name, None)
            if graph_set is None:
                continue
            graph_set.graphs.clear()
            gc.collect()  # graphs referenced from cycles (metadata in piecewise ops) must be gone before the pool
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.comm.release_capture(graph_set.registration)
        if not self.sets:
            self._pool = None  # a fresh pool next time: the old one dies with its graphs

    def close(self) -> None:
        """Release every graph and forget the workspaces (the runner is done)."""
        self.reopen_capture_phase()
        self.release()
        self.workspaces.release()

    @property
    def pool_bytes(self) -> int:
        return sum(s.pool_bytes for s in self.sets.values())

    def __del__(self) -> None:
        try:
            if self.sets:
                self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to return things to
            pass


def _ptrs(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in tensors.items()}
