"""tpgraph: small-batch tensor-parallel Llama decode with a graph-aware custom all-reduce."""

from tpgraph.errors import (
    CaptureError,
    CheckpointError,
    CommError,
    ConfigError,
    ExtensionError,
    RequestError,
    TPGraphError,
)

__all__ = ["TPGraphError", "ConfigError", "CheckpointError", "CommError", "CaptureError", "ExtensionError",
           "RequestError", "TPEngine", "SamplingParams", "GenerationOutput", "Logprob",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
           # (vLLM's top-level names, so that its scripts port by their import line)
           "RequestOutput", "CompletionOutput", "TextPrompt", "TokensPrompt"]
__version__ = "0.1.0"

_LAZY = {"TPEngine": "tpgraph.engine.tp_engine", "GenerationOutput": "tpgraph.engine.tp_engine",
         "SamplingParams": "tpgraph.engine.sampling_params", "Logprob": "tpgraph.engine.logprob",
         "BeamSearchParams": "tpgraph.engine.beam_search", "BeamSearchOutput": "tpgraph.engine.beam_search",
         "BeamSearchSequence": "tpgraph.engine.beam_search",
         "RequestOutput": "tpgraph.engine.tp_engine", "CompletionOutput": "tpgraph.engine.tp_engine",
         "TextPrompt": "tpgraph.prompts", "TokensPrompt": "tpgraph.prompts"}


def __getattr__(name: str):
    """The engine API, imported on first use (importing tpgraph alone stays light)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tpgraph' has no attribute {name!r}")
