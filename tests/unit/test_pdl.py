"""When the Triton kernels launch as programmatic dependents: by default on a GPU that has it, unless turned off."""

import os
import subprocess
import sys

import pytest
import torch

from tpgraph.kernels import _pdl
from tpgraph.kernels._rounding import soft_bf16_rounding
from tpgraph.kernels._settings import triton_interpreting


def test_on_by_default_off_when_asked(monkeypatch):
    monkeypatch.delenv("TPGRAPH_TRITON_PDL", raising=False)
    monkeypatch.setattr(_pdl, "_device_has_pdl", lambda index: True)
    monkeypatch.setattr(_pdl, "triton_has_pdl", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    t = torch.zeros(1)
    assert _pdl.use_pdl(t)
    monkeypatch.setenv("TPGRAPH_TRITON_PDL", "0")
    assert not _pdl.use_pdl(t)
    monkeypatch.setenv("TPGRAPH_TRITON_PDL", "1")
    assert _pdl.use_pdl(t)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter has no grid dependency control
    assert not _pdl.use_pdl(t)


def test_needs_the_gpu_and_triton_support(monkeypatch):
    monkeypatch.setenv("TPGRAPH_TRITON_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not _pdl.use_pdl(torch.zeros(1))  # a CPU tensor
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(_pdl, "triton_has_pdl", lambda: True)
    monkeypatch.setattr(_pdl, "_device_has_pdl", lambda index: False)  # sm_80
    assert not _pdl.use_pdl(torch.zeros(1))
    monkeypatch.setattr(_pdl, "_device_has_pdl", lambda index: True)
    monkeypatch.setattr(_pdl, "triton_has_pdl", lambda: False)  # an old Triton
    assert not _pdl.use_pdl(torch.zeros(1))


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "on", "yes", "y", "0", "false", "2", " 1", ""])
def test_the_interpreter_is_read_as_triton_reads_it(monkeypatch, value):
    """Triton interprets for TRITON_INTERPRET=true (on, yes, y, any case), not only 1: a PDL launch of CUDA tensors
    there ran gdc_wait, which the interpreter does not have, and "y" also took the inline-asm roundings."""
    knobs = pytest.importorskip("triton.knobs")
    monkeypatch.delenv("TPGRAPH_TRITON_PDL", raising=False)
    monkeypatch.setattr(_pdl, "_device_has_pdl", lambda index: True)
    monkeypatch.setattr(_pdl, "triton_has_pdl", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setenv("TRITON_INTERPRET", value)
    interpreted = knobs.runtime.interpret
    assert triton_interpreting() == interpreted
    t = torch.zeros(1)
    assert _pdl.use_pdl(t) != interpreted
    assert soft_bf16_rounding(t) == interpreted


def test_the_polls_limit_follows_the_interpreter():
    code = "from tpgraph.kernels import _counters; print(_counters.POLL_LIMIT)"
    for value, limit in (("true", 4), ("1", 4), ("0", 1 << 24)):
        env = {**os.environ, "TRITON_INTERPRET": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert int(out.stdout) == limit, value
