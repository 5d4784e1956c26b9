"""The kernels' on/off settings from the environment, read where they apply (so a test or a benchmark can change
one between calls), each refused with its name when it is not 0 or 1."""

from __future__ import annotations

import os

from tpgraph.errors import ConfigError


def env_flag(name: str, default: bool = False) -> bool:
    """A 0/1 switch from the environment (unset: `default`); anything else is refused with its name."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ConfigError(f"{name} must be 0 or 1, got {value!r}")
    return default if not value else value == "1"
