"""Triton kernels (GPU; run on CPU under TRITON_INTERPRET=1) and their torch references."""
