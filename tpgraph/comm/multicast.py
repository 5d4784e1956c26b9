"""NVLink multicast (NVLS) gate. Creating a multicast object can take a shared host's GPUs out of service,
so any of these variables means "multicast unavailable". csrc/ar_context.cu (multicast_env_allowed) reads the same
list the same way in C++.

Where a value is unclear the gate errs towards off. NCCL_NVLS_ENABLE is NCCL's switch, which NCCL reads with C's
strtoll(value, NULL, 0): any value that does not start with a nonzero number ("0", "00", "0x0", "false", "off")
turns NVLS off there, and so here. The others are "disable" switches: any value but a clear no ("0", "false", "no",
"n", "off", or a number 0, the whole value: "0abc", "0.5" or "08" are no clear no) turns multicast off. An empty
value counts as unset; values are trimmed of C's whitespace only, so that Python and C++ read every byte alike.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping

# (variable, the value pass_gate_on writes to switch it off; "0" also marks NCCL's enable switch)
DISABLING_VARIABLES = (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
    ("TPGRAPH_DISABLE_MULTICAST", "1"),
)


FALSE_WORDS = ("0", "false", "no", "n", "off")
C_WHITESPACE = " \t\n\v\f\r"  # what C's isspace (and so strtoll) skips; Python's strip() would take more
_C_INTEGER = re.compile(r"[+-]?(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)")


def c_integer_prefix(text: str) -> int | None:
    """The number C's strtoll(text, NULL, 0) reads from the start of text (None: no digits there, where strtoll
    gives 0)."""
    m = _C_INTEGER.match(text)
    if m is None:
        return None
    digits = m.group(0).lstrip("+-")
    value = int(digits, 16) if digits[:2].lower() == "0x" else int(digits, 8) if digits.startswith("0") else int(digits)
    return -value if m.group(0).startswith("-") else value


def disable_switch_set(value: str) -> bool:
    """Whether a "disable" switch's value turns its thing off: any value but a clear no (or empty, as unset). A number
    is a clear no only where it is the whole value and 0: "0abc" or "0.5" start with one but say something else."""
    s = value.strip(C_WHITESPACE).lower()
    return bool(value) and s not in FALSE_WORDS and not (_C_INTEGER.fullmatch(s) and c_integer_prefix(s) == 0)


def _disables(disabling: str, value: str) -> bool:
    if not value:  # set to nothing: as unset (NCCL too ignores an empty variable)
        return False
    if disabling == "0":  # an enable switch, read as NCCL reads it (whitespace alone reads 0 there)
        return not c_integer_prefix(value.strip(C_WHITESPACE).lower())
    return disable_switch_set(value)


def multicast_disabled_reason(env: Mapping[str, str] | None = None) -> str | None:
    """Why multicast is off by environment, or None if the environment allows it."""
    env = os.environ if env is None else env
    for name, disabling in DISABLING_VARIABLES:
        value = env.get(name)
        if value is not None and _disables(disabling, value):
            return f"multicast disabled by {name}={value}"
    return None


def pass_gate_on(env: MutableMapping[str, str] | None = None) -> list[str]:
    """Where multicast is off, say so in every library's own variable too, in the one value each library is sure to
    read as off (before NCCL or torch's symmetric memory starts): NCCL would otherwise still build NVLS communicators
    from TPGRAPH_DISABLE_MULTICAST=1 alone, and torch reads only "1" as on, so a TORCH_SYMM_MEM_DISABLE_MULTICAST=true
    that this gate reads as off would leave torch's multicast on. Returns the variables it set."""
    env = os.environ if env is None else env
    if multicast_disabled_reason(env) is None:
        return []
    changed = []
    for name, disabling in DISABLING_VARIABLES:
        if env.get(name) != disabling:
            env[name] = disabling
            changed.append(name)
    return changed
