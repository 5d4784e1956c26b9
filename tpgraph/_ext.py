"""Access to the compiled extension, with an error that names the fix when it is missing."""

from __future__ import annotations

import functools
from types import ModuleType

from tpgraph.errors import ExtensionError


@functools.cache
def load_ext() -> ModuleType:
    """Return tpgraph._C, or raise ExtensionError explaining how to build it."""
    try:
        from tpgraph import _C
    except ImportError as exc:
        raise ExtensionError(
            "tpgraph's CUDA extension (tpgraph._C) is not built: it was installed without nvcc. "
            "Install the CUDA toolkit (nvcc on PATH or CUDA_HOME set), then rebuild with "
            "`pip install --no-build-isolation -e .`"
            f" (import error: {exc})"
        ) from exc
    return _C


def extension_available() -> bool:
    try:
        load_ext()
    except ExtensionError:
        return False
    return True
