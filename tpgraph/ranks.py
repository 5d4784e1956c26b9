"""What a launcher (torchrun) tells each rank, and how long ranks wait for one another: read without torch, so that
the server's command line checks them before any rank starts (distributed.py sets the ranks up with them)."""

from __future__ import annotations

import os

from tpgraph.errors import ConfigError

# how long a collective waits for a peer (the process group's timeout): a rank waiting for rank 0's next step message
# too, under torchrun (serve.py's ranks hear from an idle rank 0 every --heartbeat-s)
PROCESS_GROUP_TIMEOUT_S = 600.0


def env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None
