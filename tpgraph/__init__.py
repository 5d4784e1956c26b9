"""tpgraph: small-batch tensor-parallel Llama decode with a graph-aware custom all-reduce."""

from tpgraph.errors import CaptureError, CheckpointError, CommError, ConfigError, ExtensionError, TPGraphError

__all__ = ["TPGraphError", "ConfigError", "CheckpointError", "CommError", "CaptureError", "ExtensionError"]
__version__ = "0.1.0"
