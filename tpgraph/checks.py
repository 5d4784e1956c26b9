"""Checks of configured values shared by every layer that takes them, each refusing under the name its caller's user
typed (a field, a keyword or a flag), so one rule is not restated, and drifting, in each."""

from __future__ import annotations

from tpgraph.errors import ConfigError


def positive_int(name: str, value: object, note: str = "") -> int:
    """A count (bools aside: True is no count), refused under the name it was given by: EngineConfig's field, vLLM's
    keyword for one (not the tpgraph field it becomes), a flag. `note` says more after "a positive integer"."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer{note}, got {value!r}", (name,))
    return value


def is_unit_fraction(value: object) -> bool:
    """Whether `value` is a number in (0, 1] (bools aside; nan is in no range)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0.0 < value <= 1.0


def unit_fraction(name: str, value: object) -> float:
    """A share of something (gpu_memory_utilization), refused under the name it was given by."""
    if not is_unit_fraction(value):
        raise ConfigError(f"{name} must be a number in (0, 1], got {value!r}", (name,))
    return value
