"""When the Triton kernels launch as programmatic dependents: by default on a GPU that has it, unless turned off."""

import torch

from tpgraph.kernels import _pdl


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
