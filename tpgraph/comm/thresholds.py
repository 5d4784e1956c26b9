"""All-reduce algorithm tables: schema, loading with validation, and the pure `pick_algo` policy.

A table holds, per architecture, per world size and per mode (graph / eager), inclusive byte bounds:
n <= push_max -> 1shot_push; n <= pull1_max -> 1shot_pull; multicast live and lo <= n <= hi ->
2shot_multicast; n <= pull2_max -> 2shot_pull; else nccl. Equal adjacent bounds disable the middle one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from tpgraph.comm.limits import kernel_limits
from tpgraph.errors import ConfigError

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WORLD_SIZES = range(2, 9)
MODES = ("graph", "eager")
ROW_KEYS = {"world_size", "mode", "push_max", "pull1_max", "pull2_max", "multicast", "provenance"}


class Algo(str, Enum):
    PUSH_1SHOT = "1shot_push"
    PULL_1SHOT = "1shot_pull"
    PULL_2SHOT = "2shot_pull"
    MULTICAST_2SHOT = "2shot_multicast"
    NCCL = "nccl"


# Grid size per algorithm, in a table's "launch" object, spelled one way: {"<world size>" or "default": bands}, where
# bands are [[max_bytes, grid], ...] with growing max_bytes (the first band that holds the message wins; the last also
# covers larger ones) and a grid is a block count (capped at the GPU's SM count), "num_sms" or "num_sms*k" (k blocks
# per SM; the extension refuses grids that cannot all be resident). No entry for a world size: DEFAULT_BLOCKS.
LAUNCH_KEYS = {Algo.PUSH_1SHOT: "push_blocks", Algo.PULL_1SHOT: "pull1_blocks", Algo.PULL_2SHOT: "pull2_blocks",
               Algo.MULTICAST_2SHOT: "multicast_blocks"}
DEFAULT_BLOCKS = 64


def _sms_multiple(spec: Any) -> int:
    """k for "num_sms" (1) or "num_sms*k"; 0 for anything else."""
    if not isinstance(spec, str) or not spec.startswith("num_sms"):
        return 0
    rest = spec[len("num_sms"):]
    if rest == "":
        return 1
    k = rest[1:]  # (ASCII digits only: int() refuses some of what isdigit() takes, such as "²")
    return int(k) if rest[0] == "*" and k.isascii() and k.isdigit() and 1 <= int(k) <= 8 else 0


@dataclass(frozen=True)
class Bands:
    """One (arch, world size, mode) row of a table."""

    push_max: int
    pull1_max: int
    pull2_max: int
    multicast: tuple[int, int] | None
    provenance: str

    def describe(self) -> str:
        mc = f", multicast {self.multicast[0]}..{self.multicast[1]}" if self.multicast else ""
        return f"push<={self.push_max}, pull1<={self.pull1_max}, pull2<={self.pull2_max}{mc} B"


@dataclass(frozen=True)
class AlgoTable:
    arch: str
    source: str
    rows: dict[tuple[int, str], Bands]
    launch: dict[str, Any]

    def bands(self, world_size: int, graph: bool) -> Bands:
        key = (world_size, "graph" if graph else "eager")
        if key not in self.rows:
            raise ConfigError(f"{self.source} has no row for world_size={world_size}, mode={key[1]}")
        return self.rows[key]

    def blocks(self, algo: Algo, world_size: int, num_sms: int, nbytes: int | None = None) -> int:
        """Grid size for an algorithm: table policy, resolved against this GPU's SM count, and no more blocks
        than the message has work for (useful_blocks)."""
        per_ws = self.launch.get(LAUNCH_KEYS[algo], {})
        bands = per_ws.get(str(world_size), per_ws.get("default"))
        spec: Any = DEFAULT_BLOCKS
        if bands:  # the first band that holds the message; the last also covers larger ones
            spec = next((b for upto, b in bands if nbytes is None or nbytes <= upto), bands[-1][1])
        per_sm = _sms_multiple(spec)
        value = num_sms * per_sm if per_sm else min(int(spec), num_sms)
        if nbytes is not None:
            value = min(value, useful_blocks(algo, nbytes, world_size))
        return max(1, min(value, kernel_limits().max_blocks))


def useful_blocks(algo: Algo, nbytes: int, world_size: int) -> int:
    """The most blocks a message has work for: 1shot_push gives each block whole chunks of vectors; the pull kernels
    give each thread one vector, of a rank's shard for the 2-shot ones."""
    k = kernel_limits()
    vectors = -(-nbytes // k.vector_bytes)
    if algo in (Algo.PULL_2SHOT, Algo.MULTICAST_2SHOT):
        vectors = -(-vectors // world_size)
    per_block = k.push_chunk_vectors if algo == Algo.PUSH_1SHOT else k.threads_per_block
    return max(1, -(-vectors // per_block))


def pick_algo(nbytes: int, graph: bool, table: AlgoTable, world_size: int, *, dtype: torch.dtype = torch.bfloat16,
              contiguous: bool = True, multi_node: bool = False, multicast_live: bool = False) -> Algo:
    """The algorithm for one all-reduce. Pure: same inputs, same answer, no side effects."""
    if (multi_node or not contiguous or dtype not in SUPPORTED_DTYPES or nbytes <= 0
            or nbytes % kernel_limits().vector_bytes or world_size not in WORLD_SIZES):
        return Algo.NCCL
    b = table.bands(world_size, graph)
    if nbytes <= b.push_max:
        return Algo.PUSH_1SHOT
    if nbytes <= b.pull1_max:
        return Algo.PULL_1SHOT
    if multicast_live and b.multicast is not None and b.multicast[0] <= nbytes <= b.multicast[1]:
        return Algo.MULTICAST_2SHOT
    if nbytes <= b.pull2_max:
        return Algo.PULL_2SHOT
    return Algo.NCCL


def _parse_row(row: Any, where: str) -> tuple[tuple[int, str], Bands]:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a row must be an object, got {type(row).__name__}")
    missing, unknown = ROW_KEYS - row.keys(), row.keys() - ROW_KEYS
    if missing or unknown:
        raise ConfigError(f"{where}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")
    ws, mode = row["world_size"], row["mode"]
    if not isinstance(ws, int) or ws not in WORLD_SIZES:
        raise ConfigError(f"{where}: world_size must be an integer in 2..8, got {ws!r}")
    if mode not in MODES:
        raise ConfigError(f"{where}: mode must be 'graph' or 'eager', got {mode!r}")
    bounds = [row["push_max"], row["pull1_max"], row["pull2_max"]]
    mc = row["multicast"]
    if mc is not None:
        if not (isinstance(mc, list) and len(mc) == 2):
            raise ConfigError(f"{where}: multicast must be null or [lo, hi], got {mc!r}")
        bounds += mc
    for v in bounds:
        vector = kernel_limits().vector_bytes
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v % vector:
            raise ConfigError(f"{where}: thresholds must be non-negative multiples of {vector} bytes, got {v!r}")
    if not row["push_max"] <= row["pull1_max"] <= row["pull2_max"]:
        raise ConfigError(f"{where}: thresholds must satisfy push_max <= pull1_max <= pull2_max, got {bounds[:3]}")
    if mc is not None and mc[0] > mc[1]:
        raise ConfigError(f"{where}: multicast range [{mc[0]}, {mc[1]}] is empty")
    if not isinstance(row["provenance"], str) or not row["provenance"].strip():
        raise ConfigError(f"{where}: every row needs a provenance string (where the numbers came from)")
    return (ws, mode), Bands(row["push_max"], row["pull1_max"], row["pull2_max"],
                             None if mc is None else (mc[0], mc[1]), row["provenance"])


def _check_grid(grid: Any, where: str) -> None:
    max_blocks = kernel_limits().max_blocks
    if _sms_multiple(grid) or (isinstance(grid, int) and not isinstance(grid, bool) and 1 <= grid <= max_blocks):
        return
    raise ConfigError(f"{where}: a grid is 1..{max_blocks} blocks, \"num_sms\" or \"num_sms*k\" (k 1..8), "
                      f"got {grid!r}")


def _check_launch(launch: Any, source: str) -> None:
    if not isinstance(launch, dict):
        raise ConfigError(f"{source}: 'launch' must be an object")
    unknown = launch.keys() - set(LAUNCH_KEYS.values())
    if unknown:
        raise ConfigError(f"{source}: unknown launch keys {sorted(unknown)} (known: {sorted(LAUNCH_KEYS.values())})")
    for key, per_ws in launch.items():
        where = f"{source} launch.{key}"
        if not isinstance(per_ws, dict):
            raise ConfigError(f"{where}: must be an object of world size (or 'default') -> [[max_bytes, grid], ...] "
                              f"bands, e.g. {{\"default\": [[67108864, \"num_sms\"]]}}; got {per_ws!r}")
        for ws, bands in per_ws.items():
            # spelt as blocks() looks them up: "02" would pass as 2 here and never be read there
            if ws != "default" and ws not in {str(w) for w in WORLD_SIZES}:
                raise ConfigError(f"{where}: keys are world sizes 2..8 or 'default', got {ws!r}")
            if not isinstance(bands, list) or not bands:
                raise ConfigError(f"{where}.{ws}: a non-empty list of [max_bytes, grid] bands, got {bands!r}")
            last = 0
            for band in bands:
                if not (isinstance(band, list) and len(band) == 2 and isinstance(band[0], int)
                        and not isinstance(band[0], bool) and band[0] > last):
                    raise ConfigError(f"{where}.{ws}: bands must be [max_bytes, grid] pairs with growing max_bytes, "
                                      f"got {band!r}")
                _check_grid(band[1], f"{where}.{ws}")
                last = band[0]


TABLE_KEYS = ("arch", "rows", "launch", "launch_provenance", "rule", "units")


def parse_table(doc: Any, source: str) -> AlgoTable:
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) or not isinstance(doc.get("arch"), str):
        raise ConfigError(f"{source}: a table is an object with 'arch' (string) and 'rows' (list)")
    unknown = sorted(set(doc) - set(TABLE_KEYS))
    if unknown:  # (a misspelt "launch" would silently fall back to the default grids)
        raise ConfigError(f"{source}: unknown keys {unknown}; a table has {', '.join(TABLE_KEYS)}")
    rows: dict[tuple[int, str], Bands] = {}
    for i, raw in enumerate(doc["rows"]):
        key, bands = _parse_row(raw, f"{source} row {i}")
        if key in rows:
            raise ConfigError(f"{source} row {i}: duplicate row for world_size={key[0]}, mode={key[1]}")
        rows[key] = bands
    absent = [f"{ws}/{m}" for ws in WORLD_SIZES for m in MODES if (ws, m) not in rows]
    if absent:
        raise ConfigError(f"{source}: rows missing for world_size/mode {', '.join(absent)}")
    launch = doc.get("launch", {})
    _check_launch(launch, source)
    return AlgoTable(doc["arch"], source, rows, launch)


def config_dir() -> Path:
    """TPGRAPH_CONFIG_DIR if set; else the tables installed with the package (tpgraph/configs, from a wheel or
    `pip install .`); else configs/ of this checkout (an editable install)."""
    if os.environ.get("TPGRAPH_CONFIG_DIR"):  # (~ expanded: an env file's value reaches here unexpanded by a shell)
        return Path(os.environ["TPGRAPH_CONFIG_DIR"]).expanduser()
    return shipped_config_dir()


def shipped_config_dir() -> Path:
    """The tables installed with the package (tpgraph/configs), else configs/ of this checkout."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


def arch_for(capability: tuple[int, int]) -> str:
    """The architecture a table is written for (its file's name and its "arch")."""
    return {9: "sm90", 10: "sm100"}.get(capability[0], "other")


def table_file_for(capability: tuple[int, int]) -> str:
    return f"{arch_for(capability)}.json"


def load_table(path: str | Path) -> AlgoTable:
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        # (tpgraph-tune only updates a table that exists: the fix is a copy of the shipped one)
        raise ConfigError(f"all-reduce table {path} does not exist: restore it from tpgraph's configs/allreduce "
                          f"(tpgraph-tune then retunes it)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # (bytes that are not text: a corrupt copy)
        raise ConfigError(f"all-reduce table {path} is not valid JSON: {exc}") from None
    except OSError as exc:  # (a folder in its place, no permission to read it)
        raise ConfigError(f"cannot read the all-reduce table {path}: {exc.strerror or exc}") from None
    return parse_table(doc, str(path))


def load_table_for(capability: tuple[int, int]) -> AlgoTable:
    name = table_file_for(capability)
    path = config_dir() / "allreduce" / name
    if os.environ.get("TPGRAPH_CONFIG_DIR") and not path.exists():  # (the variable, not the package, is the mistake)
        # (the whole folder: the GEMV kernels read their tiles from its gemv/, and without it fall back silently)
        raise ConfigError(f"TPGRAPH_CONFIG_DIR={os.environ['TPGRAPH_CONFIG_DIR']} has no allreduce/{name}: copy "
                          f"tpgraph's configs folder (allreduce/ and gemv/) there, or unset TPGRAPH_CONFIG_DIR to use "
                          f"the shipped tables")
    table = load_table(path)
    if table.arch != arch_for(capability):  # (a table copied over another architecture's)
        raise ConfigError(f"{table.source} says arch {table.arch!r}, but it is the {name} table this GPU "
                          f"(sm_{capability[0]}{capability[1]}) reads")
    return table
