"""CUDA-graph decode support: capture ladders, the batch dispatcher, persistent input buffers, graph modes,
metrics and configuration. The runner that captures and replays builds on these."""

from tpgraph.graphs.buffers import Pad, PersistentBuffers
from tpgraph.graphs.config import GraphConfig, add_graph_args, graph_config_from_args
from tpgraph.graphs.dispatcher import BatchDescriptor, Dispatcher, GraphMode
from tpgraph.graphs.ladder import LADDERS, capture_sizes, parse_ladder, sglang_ladder, vllm_ladder
from tpgraph.graphs.modes import (
    DECODE_MODES,
    PREFILL_MODES,
    CaptureSupport,
    Downgrade,
    ResolvedModes,
    log_downgrades,
    resolve_modes,
)
from tpgraph.graphs.stats import GraphStats

__all__ = [
    "DECODE_MODES",
    "LADDERS",
    "PREFILL_MODES",
    "BatchDescriptor",
    "CaptureSupport",
    "Dispatcher",
    "Downgrade",
    "GraphConfig",
    "GraphMode",
    "GraphStats",
    "Pad",
    "PersistentBuffers",
    "ResolvedModes",
    "add_graph_args",
    "capture_sizes",
    "graph_config_from_args",
    "log_downgrades",
    "parse_ladder",
    "resolve_modes",
    "sglang_ladder",
    "vllm_ladder",
]
