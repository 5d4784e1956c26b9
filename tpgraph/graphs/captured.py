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
        self.num_pieces = 1

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class PiecewiseGraph:
    """Graph pieces split at every boundary. At replay: piece 0, boundary op 0, piece 1, ... The boundary ops' results
    land in one persistent scratch buffer shared by every layer and size (only one op runs at a time)."""

    def __init__(self, forward: Forward, size: int, pool: Any, stream: torch.cuda.Stream,
                 workspaces: Workspaces) -> None:
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.ops: list[tuple[Callable[..., Any], tuple[Any, ...], torch.Tensor]] = []
        current = torch.cuda.CUDAGraph()

        def boundary(fn: Callable[..., Any], *args: Any) -> torch.Tensor:
            nonlocal current
            current.capture_end()
            self.pieces.append(current)
            result = fn(*args)  # eagerly, between pieces (its inputs are not computed yet: values are garbage)
            static = workspaces.get("piecewise_boundary", result.numel(), result.dtype, result.device)
            static = static.view(result.shape)
            static.copy_(result)
            self.ops.append((fn, args, static))
            current = torch.cuda.CUDAGraph()
            current.capture_begin(pool=pool)
            return static

        with torch.cuda.stream(stream):
            current.capture_begin(pool=pool)
            try:
                self.output = forward(size, boundary)
            finally:
                current.capture_end()
                self.pieces.append(current)
        self.num_pieces = len(self.pieces)

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
        self.num_pieces = 0

    def replay(self) -> torch.Tensor:
        self.output = self.forward(self.size, call)
        return self.output
