"""Captured forwards, one object per bucket size, each replayable with `replay() -> output`.

- FullGraph: the whole forward in one CUDA graph.
- PiecewiseGraph: CUDA graphs between the forward's boundaries (attention), which run eagerly at replay and write
  into a persistent scratch buffer that the next piece reads.
- BreakableGraph: the debug mode: the capture/replay path stays, but nothing is captured: every op runs eagerly,
  on the same persistent buffers and padded sizes as a graph would.

A forward is `forward(num_tokens, boundary) -> Tensor`, reading the first num_tokens rows of persistent buffers and
calling `boundary(fn, *args)` where a piecewise graph may split.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from tpgraph.graphs.workspace import Workspaces

Forward = Callable[[int, Callable[..., Any]], torch.Tensor]


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """The boundary outside piecewise capture: just the call."""
    return fn(*args)


class Captured(Protocol):
    output: torch.Tensor

    def replay(self) -> torch.Tensor: ...


class FullGraph:
    def __init__(self, forward: Forward, size: int, pool: Any, stream: torch.cuda.Stream) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            self.graph.capture_begin(pool=pool)
            try:
                self.output = forward(size, call)
            finally:
                self.graph.capture_end()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class PiecewiseGraph:
    """Graph pieces split at every boundary. At replay: piece 0, boundary op 0, piece 1, ... The boundary ops' results
    land in one persistent scratch buffer shared by every layer and size (only one op runs at a time)."""

    def __init__(self, forward: Forward, size: int, pool: Any, stream: torch.cuda.Stream,
                 workspaces: Workspaces) -> None:
        pieces: list[torch.cuda.CUDAGraph] = []
        ops: list[tuple[Callable[..., Any], tuple[Any, ...], torch.Tensor]] = []
        # what the boundary closure needs, emptied after capture: the closure may outlive it (a metadata object in the
        # ops' arguments holds it), and must not keep this graph, its pool and its tensors alive through a cycle
        live: dict[str, Any] = {"graph": torch.cuda.CUDAGraph(), "capturing": False}

        def boundary(fn: Callable[..., Any], *args: Any) -> torch.Tensor:
            live["graph"].capture_end()
            live["capturing"] = False
            pieces.append(live["graph"])
            result = fn(*args)  # eagerly, between pieces (its inputs are not computed yet: values are garbage)
            static = workspaces.get("piecewise_boundary", result.numel(), result.dtype, result.device)
            static = static.view(result.shape)
            static.copy_(result)
            ops.append((fn, args, static))
            live["graph"] = torch.cuda.CUDAGraph()
            live["graph"].capture_begin(pool=pool)
            live["capturing"] = True
            return static

        with torch.cuda.stream(stream):
            live["graph"].capture_begin(pool=pool)
            live["capturing"] = True
            try:
                self.output = forward(size, boundary)
            finally:
                if live["capturing"]:  # an error between pieces leaves no capture open: keep that error
                    live["graph"].capture_end()
                    pieces.append(live["graph"])
                live.clear()
        self.pieces, self.ops = pieces, ops

    def replay(self) -> torch.Tensor:
        for i, piece in enumerate(self.pieces):
            piece.replay()
            if i < len(self.ops):
                fn, args, static = self.ops[i]
                static.copy_(fn(*args))
        return self.output


class BreakableGraph:
    def __init__(self, forward: Forward, size: int) -> None:
        self.forward, self.size = forward, size
        self.output = torch.empty(0)

    def replay(self) -> torch.Tensor:
        self.output = self.forward(self.size, call)
        return self.output
