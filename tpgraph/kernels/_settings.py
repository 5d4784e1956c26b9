"""The kernels' on/off settings from the environment, read where they apply (so a test or a benchmark can change
one between calls), each refused with its name when it is not one of its values."""

from __future__ import annotations

import os

from tpgraph.errors import ConfigError


def env_flag(name: str, default: bool = False) -> bool:
    """A 0/1 switch from the environment (unset: `default`); anything else is refused with its name."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ConfigError(f"{name} must be 0 or 1, got {value!r}")
    return default if not value else value == "1"


def env_choice(name: str, choices: tuple[int, ...], default: int) -> int:
    """A whole number from the environment, one of `choices` (unset: `default`); anything else is refused with its
    name."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if value not in {str(c) for c in choices}:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
    return int(value)


# what Triton reads as true in TRITON_INTERPRET (its knobs' env_bool: these, in any case, nothing else)
INTERPRET_VALUES = ("1", "true", "on", "yes", "y")


def triton_interpreting() -> bool:
    """Whether Triton runs the kernels in its interpreter: TRITON_INTERPRET read as Triton reads it, so that every
    decision that follows it (PDL, soft bf16 rounding, the polls' limit) agrees with what Triton does."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in INTERPRET_VALUES
