"""What one all-reduce capture registered, owned by whoever owns the captured graphs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class CaptureRegistration:
    """Pointer-table rows taken by the zero-copy calls captured inside one `capture()`, and the peer IPC mappings
    opened to fill them. Both are finite or pin peers' memory, so the graphs' owner gives them back when it drops
    the graphs (`TPCommunicator.release_capture`)."""

    rows: list[int] = field(default_factory=list)
    handles: list[bytes] = field(default_factory=list)
    released: bool = False
