"""The on/off switches in the environment are read alike: 0 or 1 (unset: the default), anything else refused with its
name, as env_flag reads the others."""

import re
from pathlib import Path

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


ROOT = Path(__file__).resolve().parents[2]
# a file that reads the environment (its own reads, or the helpers that refuse a bad value by name)
READS_ENV = re.compile(r"os\.environ|getenv|env_flag\(|env_choice\(")
VARIABLE = re.compile(r"""["']((?:TPGRAPH|VLLM)_[A-Z0-9_]+)["']""")


def variables_read() -> set[str]:
    """Every TPGRAPH_* / VLLM_* name written as a string in a package (or setup.py) file that reads the environment."""
    names = set()
    for path in [ROOT / "setup.py", *sorted((ROOT / "tpgraph").rglob("*.py"))]:
        text = path.read_text()
        if READS_ENV.search(text):
            names.update(VARIABLE.findall(text))
    return names


def test_every_variable_the_package_reads_is_in_the_readme():
    """TPGRAPH_FUSED_AR_NORM, TPGRAPH_PDL_PREFETCH_MB, TPGRAPH_QKV_PAIRED and TPGRAPH_VARLEN_PREFILL were read and
    acted on, but named nowhere a user looks: a variable set from an old shell changed the kernels unexplained."""
    readme = (ROOT / "README.md").read_text()
    read = variables_read()
    assert {"TPGRAPH_GEMV", "VLLM_API_KEY", "TPGRAPH_CUDA_ARCHS"} <= read  # (the scan finds them at all)
    assert sorted(name for name in read if not re.search(rf"\b{name}\b", readme)) == []
