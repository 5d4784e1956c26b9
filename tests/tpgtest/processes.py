"""Processes a test started (an engine's follower ranks): their pids from the line the script prints, and whether
each has gone."""


def followers_of(line: str) -> list[int]:
    """The pids in a `followers [pid, ...]` line."""
    return [int(p) for p in line.split("[", 1)[1].rstrip("]\n").split(",") if p.strip()]


def gone(pid: int) -> bool:
    """Exited (reaped, or a zombie waiting for its parent)."""
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    except FileNotFoundError:
        return True
