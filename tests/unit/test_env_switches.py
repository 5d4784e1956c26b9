"""The on/off switches in the environment are read alike: 0 or 1 (unset: the default), anything else refused with its
name, as env_flag reads the others."""

import pytest
import torch

from tpgraph.comm.custom_ar import CustomAllReduceConfig, fused_norm_default
from tpgraph.errors import ConfigError
from tpgraph.kernels import gemv
from tpgraph.kernels._counters import last_split_reduces
from tpgraph.kernels._pdl import use_pdl

SWITCHES = {
    "TPGRAPH_GEMV": gemv.enabled,
    "TPGRAPH_LAST_SPLIT_REDUCES": last_split_reduces,
    "TPGRAPH_FUSED_AR_NORM": fused_norm_default,
    "TPGRAPH_AR_PDL": lambda: CustomAllReduceConfig().pdl,
    "TPGRAPH_TRITON_PDL": lambda: use_pdl(torch.zeros(1)) or None,  # (a CPU tensor: never PDL, but read the switch)
}


@pytest.mark.parametrize("name", sorted(SWITCHES))
@pytest.mark.parametrize("value", ["false", "off", "no"])
def test_a_switch_spelt_another_way_is_refused_not_read_as_on(name, value, monkeypatch):
    """These five read anything but "0" as on: TPGRAPH_GEMV=false (or off, no) left the kernel on with no word, where
    every other switch (env_flag) refuses the value by name."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"{name} must be 0 or 1, got '{value}'"):
        SWITCHES[name]()


@pytest.mark.parametrize("name", ["TPGRAPH_GEMV", "TPGRAPH_LAST_SPLIT_REDUCES", "TPGRAPH_FUSED_AR_NORM",
                                  "TPGRAPH_AR_PDL"])
def test_the_switches_are_on_unless_set_to_0(name, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    assert SWITCHES[name]() is True
    monkeypatch.setenv(name, "0")
    assert SWITCHES[name]() is False
    monkeypatch.setenv(name, "1")
    assert SWITCHES[name]() is True
