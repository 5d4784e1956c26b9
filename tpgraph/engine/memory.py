"""KV-cache budget: what is left of the GPU for the cache once everything else the engine holds is counted."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from tpgraph.checks import unit_fraction
from tpgraph.errors import ConfigError

GiB = 1 << 30


# a container's memory limit, cgroup v2 then v1 (v1 writes a huge number for "no limit")
CGROUP_LIMIT_FILES = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def host_memory_bytes(limit_files: tuple[Path, ...] = CGROUP_LIMIT_FILES) -> int:
    """The memory this process may take: the host's physical memory, or less where a container's cgroup limits it
    (past that limit the OOM killer ends the process, however much the host has)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in limit_files:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # ("max": no limit)
            return min(physical, int(text))
    return physical


@dataclass(frozen=True)
class MemoryBudget:
    """All in bytes, for one rank's GPU. `in_use` is what the device reports used after the weights, the all-reduce
    workspace, the persistent buffers and a profiling step (its cached activations freed): it includes all of those
    and the CUDA context. Activations of a step and the graph pool come on top of it."""

    total: int
    utilization: float
    in_use: int
    weights: int
    workspace: int  # custom all-reduce workspace (inside in_use; shown so the log can say where memory went)
    activation_peak: int
    graph_pool_estimate: int
    block_bytes: int
    agreed_blocks: int | None = None  # the smallest num_blocks over the ranks, once they have compared
    kernel_workspace: int = 0  # the kernels' persistent buffers: split counters, polled partials (inside in_use)
    penalty_table: int = 0  # penalized sequences' token counts, a row each (inside in_use)
    rope_tables: int = 0  # the rope cos/sin tables, a row per position of max_model_len (inside in_use)
    # ranks whose allocations share this GPU (TPGRAPH_SHARED_GPU): in_use is then all of theirs (weights and the
    # workspaces are this rank's), and what is left after it is split between them before each takes its own
    # activations and graph pool
    sharers: int = 1

    def __post_init__(self) -> None:
        unit_fraction("gpu_memory_utilization", self.utilization)  # (the name it is set by)
        if self.block_bytes < 1:
            raise ConfigError(f"a KV block must take at least one byte, got {self.block_bytes}")
        if self.sharers < 1:
            raise ConfigError(f"a GPU is shared by at least one rank, got {self.sharers}")

    @property
    def kv_bytes(self) -> int:
        left = (int(self.total * self.utilization) - self.in_use) // self.sharers
        return left - self.activation_peak - self.graph_pool_estimate

    @property
    def num_blocks(self) -> int:
        own = max(self.kv_bytes, 0) // self.block_bytes
        return own if self.agreed_blocks is None else min(own, self.agreed_blocks)

    @property
    def own_bytes(self) -> int:
        """What in_use holds that this rank knows by name: weights, workspaces and tables."""
        return self.weights + self.workspace + self.kernel_workspace + self.penalty_table + self.rope_tables

    def describe(self) -> str:
        shared = f", shared by {self.sharers} ranks" if self.sharers > 1 else ""
        return (f"GPU {_gib(self.total)} x {self.utilization:.2f} = {_gib(int(self.total * self.utilization))}"
                f"{shared}: in use {_gib(self.in_use)} (weights {_gib(self.weights)}, all-reduce workspace "
                f"{_gib(self.workspace)}, kernel workspaces {self.kernel_workspace / (1 << 20):.2f} MiB, penalty table "
                f"{self.penalty_table / (1 << 20):.2f} MiB, rope tables {self.rope_tables / (1 << 20):.2f} MiB, "
                f"the rest {_gib(self.in_use - self.own_bytes)}: CUDA context, input buffers, other processes"
                f"{' and ranks' if self.sharers > 1 else ''}), "
                f"activations and sampling {_gib(self.activation_peak)}, graph pool (estimated) "
                f"{_gib(self.graph_pool_estimate)} -> KV cache "
                f"{_gib(self.num_blocks * self.block_bytes)} = {self.num_blocks} blocks of "
                f"{self.block_bytes / (1 << 20):.2f} MiB{self._agreed_note()}")

    def _agreed_note(self) -> str:
        """Where another rank's smaller budget set the blocks: what this rank's own would have held."""
        own = max(self.kv_bytes, 0) // self.block_bytes
        if own <= self.num_blocks:
            return ""
        return f" (another rank's budget; this rank's held {own} blocks, {_gib(self.kv_bytes)})"

    def check(self, min_blocks: int, max_model_len_asked: bool = True) -> None:
        """Refuse a cache too small to hold min_blocks, with the ways out: one sequence of an asked max_model_len,
        else (the model's own, which is capped to the cache instead) the null block and one more. The refusal says
        how much memory is missing and the --gpu-memory-utilization that would hold it, where one would."""
        if self.num_blocks >= min_blocks:
            return
        need = "for one sequence of max_model_len" if max_model_len_asked else "(the null block and one more)"
        lower = "lower --max-model-len or --max-num-seqs" if max_model_len_asked else "lower --max-num-seqs"
        need_bytes = min_blocks * self.block_bytes
        ways = [lower]
        if self.kv_bytes >= need_bytes:  # (this rank has room: another rank's smaller budget was agreed on)
            short = f"another rank's GPU has room for {self.agreed_blocks} blocks only"
            ways.insert(0, "raise --gpu-memory-utilization")
        else:
            short = f"{_gib(need_bytes)} of KV cache, {_gib(need_bytes - self.kv_bytes)} more than is left"
            # the utilization at which kv_bytes reaches need_bytes, every other figure as measured
            fits = (self.in_use + self.sharers * (self.activation_peak + self.graph_pool_estimate + need_bytes)) \
                / self.total
            if fits <= 1:
                ways.insert(0, "raise --gpu-memory-utilization")
                short += f"; --gpu-memory-utilization {math.ceil(fits * 100) / 100:.2f} would hold it"
            else:
                short += "; even --gpu-memory-utilization 1.0 would not hold it"
        if self.graph_pool_estimate > 0:
            ways += ["capture fewer graphs", "use --enforce-eager"]
        remedies = ways[0] if len(ways) == 1 else ", ".join(ways[:-1]) + ("," if len(ways) > 2 else "") + " or " \
            + ways[-1]
        raise ConfigError(
            f"the KV cache would get {self.num_blocks} blocks but needs at least {min_blocks} {need}: {short} "
            f"({self.describe()}). To fit it, {remedies}")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"
