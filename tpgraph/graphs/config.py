"""GraphConfig: the graph settings, validated once; and the one place CLI flags map to its fields."""

from __future__ import annotations

import argparse
import json
import logging
import re
from dataclasses import dataclass, fields, replace

from tpgraph.checks import positive_int
from tpgraph.errors import ConfigError
from tpgraph.graphs.ladder import LADDERS, capture_sizes, check_sizes, parse_ladder, vllm_ladder
from tpgraph.graphs.modes import DECODE_MODES, PREFILL_MODES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphConfig:
    decode_mode: str = "full"
    prefill_mode: str = "piecewise"
    ladder: str | tuple[int, ...] = "sglang"  # a LADDERS name, or explicit decode batch sizes
    # token counts captured for piecewise prefill (those up to the first that holds a whole forward's budget): past 512,
    # every 128 to 1024, where an eager forward waits on the host's launches (session 43: 1 x 517 tokens 21.4 ms eager,
    # 16.7 ms padded to 640; near 1024 the GPU's work hides them, and calibration then picks eager). Each size keeps
    # its attention inputs (q, k, v of every layer, about 0.4 MB a token for Llama-3-8B), which the graph pool's
    # estimate counts against the KV cache
    prefill_sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 640, 768, 896, 1024)
    # time each prefill size eagerly and from its graph after capture, and run eagerly the token counts that padding
    # makes slower (calibration.py)
    calibrate_prefill: bool = True
    warmups: int = 1  # eager runs per size before its capture
    enforce_eager: bool = False
    check_addresses: bool = False  # debug: verify replay input addresses equal the captured ones

    def __post_init__(self) -> None:
        if self.decode_mode not in DECODE_MODES:
            raise ConfigError(f"decode_mode must be one of {', '.join(DECODE_MODES)}, got {self.decode_mode!r}")
        if self.prefill_mode not in PREFILL_MODES:
            raise ConfigError(f"prefill_mode must be one of {', '.join(PREFILL_MODES)}, got {self.prefill_mode!r}")
        try:
            ladder = parse_ladder(self.ladder)
        except ConfigError as e:
            raise ConfigError(f"ladder: {e}") from None
        # Normalized in place (e.g. "1,2,4" -> (1, 2, 4)) so equal settings compare equal; frozen, hence setattr.
        object.__setattr__(self, "ladder", ladder)
        sizes = self.prefill_sizes
        checked = check_sizes(sizes, "prefill_sizes")
        if checked != tuple(sizes):  # (any sequence, a range too: compared as a tuple, only its order can differ)
            raise ConfigError(f"prefill_sizes must be ascending, got {list(sizes)}; did you mean {list(checked)}?")
        object.__setattr__(self, "prefill_sizes", checked)
        # (at least one: Triton loads a kernel variant's module at its first launch, which CUDA refuses inside a
        # capture, and a size's first run may launch variants no other size has)
        positive_int("warmups", self.warmups, " (a size's kernels load in an eager run before its capture)")
        for name in ("calibrate_prefill", "enforce_eager", "check_addresses"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def decode_sizes(self, max_batch: int) -> tuple[int, ...]:
        """The decode batch sizes to capture for `max_batch` (the ladder's rungs up to the first >= max_batch)."""
        return capture_sizes(self.ladder, max_batch)


_DEFAULTS = {f.name: f.default for f in fields(GraphConfig)}


def add_graph_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("CUDA graphs")
    group.add_argument("--cuda-graph-mode", choices=DECODE_MODES, default=_DEFAULTS["decode_mode"],
                       help="decode graph mode: one graph per batch size (full), graphs between attention calls "
                            "(piecewise), the capture/replay path with no graph (breakable, debug), or eager (none); "
                            "default: %(default)s")
    group.add_argument("--prefill-graph-mode", choices=PREFILL_MODES, default=_DEFAULTS["prefill_mode"],
                       help="prefill graph mode (default: %(default)s)")
    # (None where not given: the default spelt out beside vLLM's size flags is a second setting, refused as such)
    group.add_argument("--cuda-graph-ladder", default=None, metavar="{" + ",".join(LADDERS) + ",N,...}",
                       help="decode capture sizes: a named ladder or a comma-separated list such as 1,2,4,8 "
                            f"(default: {_DEFAULTS['ladder']})")
    group.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                       help="vLLM's form of the decode capture sizes: one N is 1, 2, 4 and every 8 up to N; several "
                            "are the sizes themselves (in place of --cuda-graph-ladder)")
    group.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=None, metavar="N",
                       help="vLLM's newer form: the decode capture sizes themselves")
    group.add_argument("--max-cudagraph-capture-size", type=int, default=None, metavar="N",
                       help="vLLM's default decode capture sizes up to N: 1, 2, 4, every 8 below 256, every 16 "
                            "from 256 (beside --cudagraph-capture-sizes: their largest)")
    group.add_argument("--compilation-config", "-O", type=compilation_json, default=None, metavar="JSON",
                       help="vLLM's, as JSON: its cudagraph_capture_sizes and max_cudagraph_capture_size set the "
                            "decode capture sizes, its cudagraph_mode (NONE, PIECEWISE, FULL_DECODE_ONLY, "
                            "FULL_AND_PIECEWISE; FULL read as vLLM reads it where attention has no full graphs of "
                            "mixed batches: FULL_AND_PIECEWISE) the graph modes (in place of the flags above); its "
                            "compilation mode (-O3, vLLM's default, asks nothing more; -O0 captures no graphs)")
    group.add_argument("--prefill-capture-sizes", default=",".join(map(str, _DEFAULTS["prefill_sizes"])),
                       metavar="N,...", help="token counts captured for piecewise prefill (ascending; a forward pads "
                                             "to the first that holds it, or runs eagerly past the last; "
                                             "default: %(default)s)")
    group.add_argument("--no-prefill-calibration", dest="calibrate_prefill", action="store_false",
                       help="pad every prefill the capture sizes hold to its graph, without timing at start-up where "
                            "an eager forward is faster")
    group.add_argument("--graph-warmups", type=int, default=_DEFAULTS["warmups"], metavar="N",
                       help="eager runs per size before capturing it (at least 1; default: %(default)s)")
    group.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                       help="never capture or replay CUDA graphs")
    group.add_argument("--check-graph-addresses", action="store_true",
                       help="debug: check each replay reads the input addresses its graph captured")


# the flag that sets each GraphConfig field whose refusal begins with the field's name (the ladder's comes here only
# from --cuda-graph-ladder: vLLM's size flags are checked, under their own names, before)
FIELD_FLAGS = {"decode_mode": "--cuda-graph-mode", "prefill_mode": "--prefill-graph-mode",
               "ladder": "--cuda-graph-ladder", "prefill_sizes": "--prefill-capture-sizes",
               "warmups": "--graph-warmups"}


def graph_config_from_args(args: argparse.Namespace) -> GraphConfig:
    try:
        graphs = GraphConfig(
            decode_mode=args.cuda_graph_mode,
            prefill_mode=args.prefill_graph_mode,
            ladder=ladder_from_args(args),
            prefill_sizes=parse_sizes(args.prefill_capture_sizes, "--prefill-capture-sizes"),
            calibrate_prefill=args.calibrate_prefill,
            warmups=args.graph_warmups,
            enforce_eager=args.enforce_eager,
            check_addresses=args.check_graph_addresses,
        )
    except ConfigError as exc:  # (said as the flag typed: `warmups must be ...` named no flag a user has)
        raise _as_flag(exc) from None
    config = args.compilation_config
    if config is None:
        return graphs
    # (a flag of this engine beside it setting the same is a second setting: refused, not overridden unsaid)
    given = []
    if any(config.get(key) is not None for key in COMPILATION_KEYS[:2]):
        given += [flag for flag in _ladder_flags(args) if getattr(args, _dest(flag)) is not None]
    if config.get("cudagraph_mode") is not None or _compilation_mode(config, "--compilation-config") == "NONE":
        given += [flag for flag, field in (("--cuda-graph-mode", "decode_mode"), ("--prefill-graph-mode",
                                                                                  "prefill_mode"))
                  if getattr(args, _dest(flag)) != _DEFAULTS[field]]
    if given:
        raise ConfigError(f"give {' or '.join(given)} or --compilation-config, not both: each sets the CUDA graphs")
    return from_compilation_config(config, graphs)


def compilation_json(text: str) -> dict[str, object]:
    """--compilation-config's JSON object; a whole number (vLLM's -O3) is its compilation mode, {"mode": N}."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        return {"mode": value}
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of {', '.join(COMPILATION_KEYS)}, or vLLM's "
                                         f"compilation mode (-O3), got {text!r}")
    return value


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def ladder_from_args(args: argparse.Namespace) -> str | tuple[int, ...]:
    """--cuda-graph-ladder, or one of vLLM's flags for the decode capture sizes: --cuda-graph-sizes (one value N is its
    older pattern, 1, 2, 4, then every 8 up to N; several are the sizes), --cudagraph-capture-sizes (the sizes) or
    --max-cudagraph-capture-size N (its newer default sizes up to N; beside the sizes, their largest, as vLLM checks
    it). (Each batch pads to the first size that holds it: the largest must hold --max-num-seqs, where vLLM would run
    larger batches eagerly.)"""
    given = _ladder_flags(args)
    if len(given) > 1:
        raise ConfigError(f"give {' or '.join(given)}, not both: each sets the decode capture sizes")
    (flag, value), = given.items()
    if flag == "--cuda-graph-ladder":
        return value
    if flag == "--max-cudagraph-capture-size":
        return vllm_ladder(positive_int("--max-cudagraph-capture-size", value))
    if flag == "--cuda-graph-sizes" and len(value) == 1:
        value = [s for s in (1, 2, 4, *range(8, value[0] + 1, 8)) if s <= value[0]] or value
    return check_sizes(value, flag)


def _ladder_flags(args: argparse.Namespace) -> dict[str, object]:
    """The flags given that set the decode capture sizes, by name (none: --cuda-graph-ladder's default). vLLM's max
    beside its sizes is no second setting where it is their largest (its CompilationConfig takes the pair so)."""
    top = args.max_cudagraph_capture_size
    if args.cudagraph_capture_sizes is not None and top is not None:
        largest = max(args.cudagraph_capture_sizes)
        if top != largest:
            raise ConfigError(f"--max-cudagraph-capture-size {top} must be the largest of --cudagraph-capture-sizes "
                              f"({largest}) where both are given, as vLLM checks them")
        top = None
    given = {flag: value for flag, value in (("--cuda-graph-ladder", args.cuda_graph_ladder),
                                             ("--cuda-graph-sizes", args.cuda_graph_sizes),
                                             ("--cudagraph-capture-sizes", args.cudagraph_capture_sizes),
                                             ("--max-cudagraph-capture-size", top))
             if value is not None}
    return given or {"--cuda-graph-ladder": _DEFAULTS["ladder"]}


# vLLM's CompilationConfig.cudagraph_mode, by name: the (decode, prefill) graph modes it asks for. Its FULL (mixed
# prefill batches in full graphs too) is read as vLLM reads it with a backend that has no such graphs (below)
VLLM_CUDAGRAPH_MODES = {"NONE": ("none", "none"), "PIECEWISE": ("piecewise", "piecewise"),
                        "FULL_DECODE_ONLY": ("full", "none"), "FULL_AND_PIECEWISE": ("full", "piecewise")}
COMPILATION_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size", "cudagraph_mode")
# vLLM's CompilationConfig.mode (level before it), the torch.compile mode, by name: VLLM_COMPILE (3) is its default,
# which asks for nothing here; NONE (0) leaves vLLM no piecewise graphs (those need its compilation), and with no
# cudagraph_mode no graphs at all. STOCK_TORCH_COMPILE (1) and DYNAMO_TRACE_ONCE (2) have no counterpart
VLLM_COMPILATION_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")
COMPILATION_MODE_KEYS = ("mode", "level")  # (vLLM reads mode where both are given)


def from_compilation_config(value: object, graphs: GraphConfig) -> GraphConfig:
    """vLLM's compilation_config (LLM(...)'s keyword) as `graphs` with its settings: cudagraph_capture_sizes and
    max_cudagraph_capture_size the decode capture sizes (as the flags of those names), cudagraph_mode the decode and
    prefill graph modes, its compilation mode (mode, or level; an int compilation_config is one) 3 nothing more and 0
    vLLM's graphs without compilation. None, or a key at None, sets nothing; what has no setting here is refused by
    name."""
    if value is None:
        return graphs
    named = "compilation_config"
    if isinstance(value, int) and not isinstance(value, bool):  # (vLLM's LLM reads an int as the compilation mode)
        value = {"mode": value}
    if not isinstance(value, dict):
        raise ConfigError(f"{named}={value!r} (vLLM's) is not taken: give a dict of {', '.join(COMPILATION_KEYS)} "
                          "(or vLLM's compilation mode, 3)")
    compile_mode = _compilation_mode(value, named)
    value = {key: v for key, v in value.items() if key not in COMPILATION_MODE_KEYS}
    unknown = sorted(set(value) - set(COMPILATION_KEYS), key=str)
    if unknown:
        raise ConfigError(f"{named}'s {', '.join(map(str, unknown))} (vLLM's) is not taken: {named} takes "
                          f"{', '.join(COMPILATION_KEYS)} (no torch.compile here)")
    sizes, top, mode = (value.get(key) for key in COMPILATION_KEYS)
    changes: dict[str, object] = {}
    if sizes is not None:
        changes["ladder"] = check_sizes(_distinct(sizes), f"{named}'s cudagraph_capture_sizes")
        if top is not None and top != changes["ladder"][-1]:
            raise ConfigError(f"{named}'s max_cudagraph_capture_size {top!r} must be the largest of its "
                              f"cudagraph_capture_sizes ({changes['ladder'][-1]}) where both are given, as vLLM "
                              "checks them")
    elif top is not None:
        changes["ladder"] = vllm_ladder(positive_int(f"{named}'s max_cudagraph_capture_size", top))
    if mode is not None:
        name = mode.upper() if isinstance(mode, str) else getattr(mode, "name", mode)  # (a name, or vLLM's enum)
        if name == "FULL":  # (mixed batches in full graphs: no attention here captures those)
            name = "FULL_DECODE_ONLY" if compile_mode == "NONE" else "FULL_AND_PIECEWISE"
            logger.warning("compilation_config's cudagraph_mode FULL: mixed prefill-decode batches are not captured "
                           "whole here; setting cudagraph_mode=%s, as vLLM does with an attention backend that "
                           "captures uniform decode batches only", name)
        if name not in VLLM_CUDAGRAPH_MODES:
            raise ConfigError(f"{named}'s cudagraph_mode {mode!r} is not taken: give one of "
                              f"{', '.join(VLLM_CUDAGRAPH_MODES)} or FULL")
        changes["decode_mode"], changes["prefill_mode"] = VLLM_CUDAGRAPH_MODES[name]
    if compile_mode == "NONE":  # (vLLM's full decode graphs need no compilation; its piecewise ones are dropped)
        changes["decode_mode"] = "full" if mode is not None and changes["decode_mode"] == "full" and \
            changes["prefill_mode"] == "none" else "none"
        changes["prefill_mode"] = "none"
    return replace(graphs, **changes)


def _distinct(values: object) -> object:
    """vLLM's capture sizes each once, as its config keeps them (a repeat dropped); anything but a list or tuple as
    given, for check_sizes to refuse."""
    if not isinstance(values, (list, tuple)):
        return values
    kept: list = []
    for v in values:
        if isinstance(v, bool) or v not in kept:  # (True == 1: left for check_sizes to refuse)
            kept.append(v)
    return kept


def _compilation_mode(value: dict, named: str) -> str | None:
    """The compilation mode's name a compilation_config asks for (mode, else level: vLLM's reading), None where
    neither; one with no counterpart here is refused."""
    key = next((k for k in COMPILATION_MODE_KEYS if value.get(k) is not None), None)
    if key is None:
        return None
    given = value[key]
    if isinstance(given, str):
        name = given.upper()
    elif isinstance(given, int) and not isinstance(given, bool) and 0 <= given < len(VLLM_COMPILATION_MODES):
        name = VLLM_COMPILATION_MODES[given]  # (vLLM's IntEnum is an int too)
    else:
        name = None
    if name in ("NONE", "VLLM_COMPILE"):
        return name
    raise ConfigError(f"{named}'s {key} {given!r} (vLLM's torch.compile mode) is not taken: no torch.compile runs "
                      "here; give 3 (VLLM_COMPILE, vLLM's default: the CUDA graphs as cudagraph_mode sets them) or 0 "
                      "(NONE: no graphs, but full decode ones where cudagraph_mode is FULL_DECODE_ONLY), or leave it "
                      "out")


def parse_sizes(text: str, name: str = "capture sizes") -> tuple[int, ...]:
    """A comma-separated list of sizes ("16,32,64"), each an integer (GraphConfig checks the rest); `name` is what a
    refusal calls it."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{name} must be comma-separated integers, got {text!r}") from None


def _as_flag(exc: ConfigError) -> ConfigError:
    """GraphConfig's refusal with the field it begins with named as its flag (any other left as it is)."""
    message = str(exc)
    for field, flag in FIELD_FLAGS.items():
        if re.match(rf"{field}\b", message):
            return ConfigError(flag + message[len(field):], exc.settings)
    return exc
