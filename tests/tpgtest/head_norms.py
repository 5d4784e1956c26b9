"""Tolerances for Qwen3's per-head norms inside the rotation kernels, which sum a head's squares by halves: the fp32
variance may differ from the norm kernel's or torch's in its last bit, and so, at rare elements, the rounded result."""

import torch


def assert_within_a_variance_bit(got: torch.Tensor, want: torch.Tensor) -> None:
    """In fp32 within 1e-5; in 16-bit dtypes apart on under 1% of the elements, by at most 4 units in the last place of
    a normed head's unit scale (not of each output: a rotation that cancels makes a small output from two rounded
    terms)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    assert (got.float() - want.float()).abs().max() <= 4 * torch.finfo(got.dtype).eps
    assert (got != want).float().mean() < 0.01


def random_head_norm(head_dim: int, dtype: torch.dtype, generator: torch.Generator | None = None,
                     device: str = "cpu", eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Qwen3-like (q_norm weight, k_norm weight, eps): weights about 1, apart from one another and from 1."""
    return *((1 + 0.2 * torch.randn(head_dim, generator=generator, device=device)).to(dtype) for _ in range(2)), eps
