"""The start-up summary: what this engine runs, in one table (model, TP, all-reduce bands, graphs, memory)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpgraph.engine.memory import GiB
from tpgraph.graphs.calibration import describe_counts

if TYPE_CHECKING:
    from tpgraph.engine.runner import ModelRunner


def startup_summary(runner: ModelRunner) -> str:
    """Model, TP, dtype, all-reduce bands, graph modes and buckets, graph memory, KV blocks: one table."""
    comm, mcfg = runner.model.comm, runner.model.cfg
    custom = comm.custom
    if custom is not None:
        bands = {m: custom.table.bands(comm.world_size, m == "graph").describe() for m in ("graph", "eager")}
    else:
        bands = {"graph": comm.custom_reason or "n/a", "eager": "NCCL" if comm.world_size > 1 else "none (TP=1)"}
    sets = runner.graphs.sets
    rows = [
        ("model", f"{mcfg.num_hidden_layers} layers, hidden {mcfg.hidden_size}, vocab {mcfg.vocab_size}"),
        ("TP / dtype / device", f"{comm.world_size} / {str(runner.dtype).removeprefix('torch.')} / {runner.device}"),
        ("all-reduce (graph)", bands["graph"]),
        ("all-reduce (eager)", bands["eager"]),
        ("decode graphs", f"{runner.modes.decode}: {list(sets['decode'].sizes) if 'decode' in sets else '-'}"
                          + (f"; eager above {runner.decode_eager_above}" if runner.decode_eager_above else "")),
        ("prefill graphs", f"{runner.modes.prefill}: {list(sets['prefill'].sizes) if 'prefill' in sets else '-'}"
                           + (_timed(runner.prefill_dispatcher.eager_counts) if runner.prefill_timings else "")),
        ("prefill attention", runner.prefill_attention),
        ("prefix caching", "on (blocks named by sha256 of their token prefix)" if runner.cfg.enable_prefix_caching
         else "off"),
        ("downgrades", "; ".join(d.describe() for d in runner.modes.downgrades) or "none"),
        ("graph memory", f"{runner.capture_bytes / GiB:.2f} GiB taken, "
                         f"{(runner.budget.graph_pool_estimate if runner.budget else 0) / GiB:.2f} GiB estimated, "
                         f"captured in {runner.capture_s:.1f} s"),
        ("KV cache", f"{runner.num_kv_blocks} blocks x {runner.block_size} tokens "
                     f"({runner.num_kv_blocks * runner.block_bytes / GiB:.2f} GiB)"
                     + (f"; {runner.budget.describe()}" if runner.budget else "")),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def _timed(eager_counts: tuple[int, ...]) -> str:
    """What the start-up timing of the prefill graphs chose (graphs/calibration.py)."""
    if not eager_counts:
        return "; timed: every count padded to its graph"
    return f"; timed: eager for {describe_counts(eager_counts)} tokens"
