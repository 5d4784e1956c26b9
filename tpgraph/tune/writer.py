"""Write one architecture's rows for one world size into a table file, leaving everything else as it was."""

from __future__ import annotations

import copy
import difflib
import json
from pathlib import Path
from typing import Any

from tpgraph.comm.thresholds import LAUNCH_KEYS, WORLD_SIZES, Algo, parse_table
from tpgraph.errors import ConfigError


def updated_table(doc: dict[str, Any], world_size: int, rows: dict[str, dict[str, int]], provenance: str,
                  launch: dict[Algo, list] | None = None, source: str = "table") -> dict[str, Any]:
    """A copy of `doc` with the graph and eager rows of `world_size` replaced (`rows[mode]` = push_max, pull1_max,
    pull2_max) and, if given, this world size's launch bands. Other rows, other world sizes' launch entries and
    every other key stay. The result is checked as the loader checks it."""
    if world_size not in WORLD_SIZES:
        raise ConfigError(f"world size {world_size} is outside {WORLD_SIZES.start}..{WORLD_SIZES.stop - 1}: the "
                          "table has no row for it")
    out = copy.deepcopy(doc)
    for mode, bounds in rows.items():
        matches = [r for r in out["rows"] if r.get("world_size") == world_size and r.get("mode") == mode]
        if len(matches) != 1:
            raise ConfigError(f"{source}: expected one row for world_size={world_size}, mode={mode}, found "
                              f"{len(matches)}")
        row = matches[0]
        row.update({k: int(v) for k, v in bounds.items()})
        row["multicast"] = row.get("multicast")  # kept as it was: never measured while multicast is gated
        row["provenance"] = f"{mode}: {provenance}"
    if launch:
        for algo, bands in launch.items():
            key = LAUNCH_KEYS[algo]
            out.setdefault("launch", {}).setdefault(key, {})[str(world_size)] = bands
        out["launch_provenance"] = launch_provenance(out.get("launch_provenance"), world_size, provenance)
    parse_table(out, source)  # still a table the loader accepts
    return out


def launch_provenance(old: Any, world_size: int, provenance: str) -> str:
    """The table's note on where its grids came from, with this world size's clause ("world size N grids: ...")
    replaced by this run's and the other world sizes' clauses kept ("; " between clauses)."""
    ours = f"world size {world_size} grids"
    kept = [c for c in (old.split("; ") if isinstance(old, str) and old else [])
            if not c.lower().startswith(ours)]
    return "; ".join([*kept, f"{ours}: {provenance}"])


def render(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1) + "\n"


def diff(path: Path, new_text: str) -> str:
    old = path.read_text().splitlines(keepends=True) if path.exists() else []
    return "".join(difflib.unified_diff(old, new_text.splitlines(keepends=True), str(path), f"{path} (tuned)"))
