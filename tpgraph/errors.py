"""One exception family; every message names what is wrong and how to fix it."""


class TPGraphError(RuntimeError):
    """Base of every error tpgraph raises on purpose."""


class ConfigError(TPGraphError, ValueError):
    """A configuration that cannot run (bad field, unsupported model, heads not divisible by TP)."""


class CheckpointError(TPGraphError):
    """A checkpoint that cannot be loaded (missing file, truncated file, missing tensor, wrong shape)."""


class CommError(TPGraphError):
    """A communication failure or misuse."""


class CaptureError(TPGraphError):
    """CUDA-graph capture or replay misuse."""


class ExtensionError(TPGraphError, ImportError):
    """The compiled extension tpgraph._C is missing or unusable."""


class RequestError(TPGraphError, ValueError):
    """A request that cannot be served as asked (bad sampling parameter, prompt too long); the server answers 400."""
