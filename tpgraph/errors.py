"""One exception family; every message names what is wrong and how to fix it."""


class TPGraphError(RuntimeError):
    """Base of every error tpgraph raises on purpose."""


class ConfigError(TPGraphError, ValueError):
    """A configuration that cannot run (bad field, unsupported model, heads not divisible by TP). `settings`: the
    EngineConfig fields the message names, which a command line says as the flags that set them (cli.py)."""

    def __init__(self, message: str, settings: tuple[str, ...] = ()):
        super().__init__(message)
        self.settings = settings


class CheckpointError(TPGraphError):
    """A checkpoint that cannot be loaded (missing file, truncated file, missing tensor, wrong shape)."""


class CommError(TPGraphError):
    """A communication failure or misuse."""


class AllReduceUnavailable(CommError):
    """The custom all-reduce cannot run on this machine for a reason of the machine's, not a bug: peer-to-peer or CUDA
    IPC missing or not working, GPUs not linked, mixed architectures. The communicator uses NCCL instead."""


class PeerError(TPGraphError):
    """Raised on the other ranks when a step every rank takes together failed on one rank: `rank`, and that rank's
    error as its type's name (`kind`) and message (`detail`)."""

    def __init__(self, message: str, rank: int | None = None, kind: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.rank, self.kind, self.detail = rank, kind, detail

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.kind, self.detail)


class CaptureError(TPGraphError):
    """CUDA-graph capture or replay misuse."""


class ExtensionError(TPGraphError, ImportError):
    """The compiled extension tpgraph._C is missing or unusable."""


class RequestError(TPGraphError, ValueError):
    """A request that cannot be served as asked (bad sampling parameter, prompt too long); the server answers 400."""
