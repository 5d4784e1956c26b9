"""NVLink multicast (NVLS) gate. Creating a multicast object can take a shared host's GPUs out of service,
so any of these variables means "multicast unavailable". csrc/ar_context.cu (multicast_env_allowed) reads the same
list the same way in C++."""

from __future__ import annotations

import os
from collections.abc import Mapping

# (variable, value that disables multicast)
DISABLING_VARIABLES = (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
    ("TPGRAPH_DISABLE_MULTICAST", "1"),
)


def multicast_disabled_reason(env: Mapping[str, str] | None = None) -> str | None:
    """Why multicast is off by environment, or None if the environment allows it."""
    env = os.environ if env is None else env
    for name, disabling in DISABLING_VARIABLES:
        value = env.get(name)
        if value is None:
            continue
        if value.strip().lower() == disabling or (disabling == "1" and value.strip().lower() in ("true", "yes")):
            return f"multicast disabled by {name}={value}"
    return None


def multicast_allowed(env: Mapping[str, str] | None = None) -> bool:
    return multicast_disabled_reason(env) is None
