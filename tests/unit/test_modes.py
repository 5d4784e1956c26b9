import logging

import pytest

from tpgraph.errors import ConfigError
from tpgraph.graphs.modes import (
    DECODE_MODES,
    PREFILL_MODES,
    CaptureSupport,
    Downgrade,
    ResolvedModes,
    log_downgrades,
    resolve_modes,
)

SUPPORTS = {
    "all": CaptureSupport(full_decode=True, piecewise=True),
    "no_full": CaptureSupport(full_decode=False, piecewise=True, reason="backend A replans per batch"),
    "no_piecewise": CaptureSupport(full_decode=True, piecewise=False, reason="backend B splits prefill"),
    "nothing": CaptureSupport(full_decode=False, piecewise=False, reason="backend C allocates per call"),
}
FALLBACK = {"full": ("full", "piecewise", "none"), "piecewise": ("piecewise", "none"),
            "breakable": ("breakable",), "none": ("none",)}


def expected(phase, requested, enforce_eager, device, support):
    """The rule restated as 'walk the fallback chain to the first mode that can run here'."""
    if enforce_eager:
        return "none", None
    cuda = device == "cuda"
    can_run = {
        "full": cuda and support.full_decode,
        "piecewise": cuda and support.piecewise,
        "breakable": True,  # captures nothing
        "none": True,
    }
    resolved = next(m for m in FALLBACK[requested] if can_run[m])
    if resolved == requested:
        return resolved, None
    reason = "CUDA graphs need a CUDA device (device is 'cpu')" if not cuda else support.reason
    return resolved, Downgrade(phase, requested, resolved, reason)


@pytest.mark.parametrize("decode", DECODE_MODES)
@pytest.mark.parametrize("prefill", PREFILL_MODES)
@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("support", SUPPORTS)
def test_resolution_matrix(decode, prefill, enforce_eager, device, support):
    sup = SUPPORTS[support]
    got = resolve_modes(decode, prefill, enforce_eager=enforce_eager, device_type=device, support=sup)
    want_decode, decode_dg = expected("decode", decode, enforce_eager, device, sup)
    want_prefill, prefill_dg = expected("prefill", prefill, enforce_eager, device, sup)
    assert (got.decode, got.prefill) == (want_decode, want_prefill)
    assert got.downgrades == tuple(d for d in (decode_dg, prefill_dg) if d is not None)


def test_named_cases():
    cpu = resolve_modes("full", "piecewise", enforce_eager=False, device_type="cpu", support=SUPPORTS["all"])
    assert (cpu.decode, cpu.prefill) == ("none", "none")
    assert [(d.phase, d.requested, d.resolved) for d in cpu.downgrades] == [
        ("decode", "full", "none"), ("prefill", "piecewise", "none")]
    assert all(d.reason.startswith("CUDA graphs need a CUDA device") for d in cpu.downgrades)

    breakable = resolve_modes("breakable", "none", enforce_eager=False, device_type="cpu", support=SUPPORTS["nothing"])
    assert breakable == ResolvedModes("breakable", "none", ())

    no_full = resolve_modes("full", "piecewise", enforce_eager=False, device_type="cuda", support=SUPPORTS["no_full"])
    assert no_full == ResolvedModes(
        "piecewise", "piecewise", (Downgrade("decode", "full", "piecewise", "backend A replans per batch"),))

    nothing = resolve_modes("full", "piecewise", enforce_eager=False, device_type="cuda", support=SUPPORTS["nothing"])
    assert nothing.decode == "none" and nothing.prefill == "none"
    assert [d.reason for d in nothing.downgrades] == ["backend C allocates per call"] * 2

    eager = resolve_modes("full", "piecewise", enforce_eager=True, device_type="cpu", support=SUPPORTS["nothing"])
    assert eager == ResolvedModes("none", "none", ())

    ok = resolve_modes("full", "piecewise", enforce_eager=False, device_type="cuda", support=SUPPORTS["all"])
    assert ok == ResolvedModes("full", "piecewise", ())


def test_unknown_modes_list_the_choices():
    with pytest.raises(ConfigError, match="unknown decode graph mode 'fast'; choose one of full, piecewise, breakable"):
        resolve_modes("fast", "none", enforce_eager=False, device_type="cuda", support=SUPPORTS["all"])
    with pytest.raises(ConfigError, match="unknown prefill graph mode 'full'; choose one of piecewise, none"):
        resolve_modes("full", "full", enforce_eager=True, device_type="cuda", support=SUPPORTS["all"])


def test_support_needs_a_reason_for_any_false():
    with pytest.raises(ConfigError, match="needs a reason"):
        CaptureSupport(full_decode=False, piecewise=True)
    with pytest.raises(ConfigError, match="needs a reason"):
        CaptureSupport(full_decode=True, piecewise=False, reason="  ")


def test_describe():
    dg = Downgrade("decode", "full", "piecewise", "backend A")
    assert dg.describe() == "decode: full -> piecewise (backend A)"
    lines = ResolvedModes("piecewise", "none", (dg,)).describe().splitlines()
    assert lines == ["graph modes: decode=piecewise prefill=none", "  downgraded decode: full -> piecewise (backend A)"]
    with pytest.raises(ConfigError, match="decode stays 'full'"):
        Downgrade("decode", "full", "full", "x")
    with pytest.raises(ConfigError, match="phase"):
        Downgrade("sample", "full", "none", "x")


def test_log_downgrades_is_a_loud_banner(caplog):
    logger = logging.getLogger("test_modes")
    resolved = resolve_modes("full", "piecewise", enforce_eager=False, device_type="cpu", support=SUPPORTS["all"])
    with caplog.at_level(logging.WARNING, logger="test_modes"):
        log_downgrades(resolved, logger)
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    lines = caplog.records[0].getMessage().splitlines()
    assert len(lines) >= 5
    assert any("CUDA GRAPH MODE DOWNGRADED" in line for line in lines)
    assert sum("decode: full -> none" in line for line in lines) == 1
    assert sum("prefill: piecewise -> none" in line for line in lines) == 1


def test_log_downgrades_silent_without_downgrades(caplog):
    logger = logging.getLogger("test_modes")
    with caplog.at_level(logging.DEBUG, logger="test_modes"):
        log_downgrades(ResolvedModes("full", "piecewise"), logger)
    assert caplog.records == []
