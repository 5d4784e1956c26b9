"""Which graph mode each phase runs, resolved once at start-up from what was asked and what can run.

Every downgrade is recorded with its reason and logged loudly: a silent fall back to eager would look like a
slow engine, not a misconfigured one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tpgraph.errors import ConfigError

DECODE_MODES = ("full", "piecewise", "breakable", "none")
PREFILL_MODES = ("piecewise", "none")
PHASES = ("decode", "prefill")
NO_CUDA_REASON = "CUDA graphs need a CUDA device"


@dataclass(frozen=True)
class CaptureSupport:
    """What an attention backend tolerates under capture; `reason` explains any False."""

    full_decode: bool
    piecewise: bool
    reason: str = ""

    def __post_init__(self) -> None:
        if not (self.full_decode and self.piecewise) and not self.reason.strip():
            raise ConfigError(
                "CaptureSupport without full_decode or piecewise needs a reason (it is shown to the user in the "
                "downgrade warning)"
            )


@dataclass(frozen=True)
class Downgrade:
    phase: str
    requested: str
    resolved: str
    reason: str

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ConfigError(f"downgrade phase must be one of {', '.join(PHASES)}, got {self.phase!r}")
        if self.requested == self.resolved:
            raise ConfigError(f"a downgrade changes the mode; {self.phase} stays {self.requested!r}")

    def describe(self) -> str:
        return f"{self.phase}: {self.requested} -> {self.resolved} ({self.reason})"


@dataclass(frozen=True)
class ResolvedModes:
    decode: str
    prefill: str
    downgrades: tuple[Downgrade, ...] = ()

    def __post_init__(self) -> None:
        _check_mode("decode", self.decode, DECODE_MODES)
        _check_mode("prefill", self.prefill, PREFILL_MODES)

    def describe(self) -> str:
        """One line for the modes, then one line per downgrade."""
        lines = [f"graph modes: decode={self.decode} prefill={self.prefill}"]
        lines += [f"  downgraded {d.describe()}" for d in self.downgrades]
        return "\n".join(lines)


def resolve_modes(
    decode: str, prefill: str, *, enforce_eager: bool, device_type: str, support: CaptureSupport
) -> ResolvedModes:
    _check_mode("decode", decode, DECODE_MODES)
    _check_mode("prefill", prefill, PREFILL_MODES)
    if enforce_eager:
        return ResolvedModes("none", "none")  # the user asked for eager: nothing was downgraded
    downgrades: list[Downgrade] = []

    def downgrade(phase: str, requested: str, resolved: str, reason: str) -> str:
        downgrades.append(Downgrade(phase, requested, resolved, reason))
        return resolved

    if device_type != "cuda":
        reason = f"{NO_CUDA_REASON} (device is {device_type!r})"
        if decode in ("full", "piecewise"):  # breakable captures nothing, so it runs anywhere
            decode = downgrade("decode", decode, "none", reason)
        if prefill == "piecewise":
            prefill = downgrade("prefill", prefill, "none", reason)
        return ResolvedModes(decode, prefill, tuple(downgrades))

    if decode == "full" and not support.full_decode:
        decode = downgrade("decode", "full", "piecewise" if support.piecewise else "none", support.reason)
    elif decode == "piecewise" and not support.piecewise:
        decode = downgrade("decode", "piecewise", "none", support.reason)
    if prefill == "piecewise" and not support.piecewise:
        prefill = downgrade("prefill", "piecewise", "none", support.reason)
    return ResolvedModes(decode, prefill, tuple(downgrades))


def log_downgrades(resolved: ResolvedModes, logger: logging.Logger) -> None:
    """A multi-line WARNING banner, one line per downgrade; nothing when every phase runs what was asked."""
    if not resolved.downgrades:
        return
    bar = "!" * 78
    lines = [bar, "CUDA GRAPH MODE DOWNGRADED: this engine will not run the graph modes you asked for", bar]
    lines += [f"  {d.describe()}" for d in resolved.downgrades]
    lines += [f"  running with decode={resolved.decode} prefill={resolved.prefill}", bar]
    # One record, so ranks logging at once cannot interleave the banner's lines.
    logger.warning("\n%s", "\n".join(lines))


def _check_mode(phase: str, mode: str, choices: tuple[str, ...]) -> None:
    if mode not in choices:
        raise ConfigError(f"unknown {phase} graph mode {mode!r}; choose one of {', '.join(choices)}")
