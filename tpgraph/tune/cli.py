"""`tpgraph-tune`: measure the all-reduce algorithms on this machine and rewrite its rows of the table.

    tpgraph-tune --world-size 2                       # starts its own ranks
    torchrun --nproc-per-node 2 -m tpgraph.tune.cli   # or under torchrun
    tpgraph-tune --world-size 2 --dry-run --plot tune.png

Every algorithm (1shot_push, 1shot_pull, 2shot_pull; NCCL) at sizes 4 KB .. 64 MB, in graph and eager mode, custom
ones over grid sizes, by one timing method (tpgraph/tune/timing.py). From the curves: monotone bands (the least
time lost beyond --tolerance, every band at least --min-points sizes), NCCL above the last; grid bands from graph
mode. Writes this architecture's graph and eager rows for this world size, with provenance, into the table the
loader reads (TPGRAPH_CONFIG_DIR, else the package's), leaving other rows and architectures as they are.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import importlib.util
import json
import logging
import os
import shlex
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from tpgraph.errors import ConfigError, TPGraphError
from tpgraph.ranks import env_int

logger = logging.getLogger("tpgraph.tune")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tpgraph-tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=None, help="ranks to start (outside torchrun; under it, "
                   "torchrun's world size, which this must then equal)")
    p.add_argument("--runs", type=int, default=20, help="timed runs per candidate (median; at least 20; default: "
                   "%(default)s)")
    p.add_argument("--tolerance", type=float, default=0.03, help="within this fraction of the fastest counts "
                   "as fast (default: %(default)s)")
    p.add_argument("--min-points", type=int, default=2, help="sizes a band must cover at least (default: "
                   "%(default)s)")
    p.add_argument("--max-bytes", type=int, default=64 << 20,
                   help="largest size measured, at most 64 MiB (default: %(default)s, 64 MiB; below it only with "
                        "--dry-run: rows need the whole range)")
    p.add_argument("--table", type=Path, default=None, help="table to update (default: the one the loader reads)")
    p.add_argument("--dry-run", action="store_true", help="print the diff, write nothing to the table")
    p.add_argument("--plot", type=Path, default=None, help="PNG of the curves with the chosen bands shaded")
    p.add_argument("--log", type=Path, default=None, help="JSON of every measurement and the derived rows")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.runs < 20:
        print("error: --runs must be at least 20 (the timing method's median)", file=sys.stderr)
        return 2
    if not 0.0 <= args.tolerance < 1.0:  # (3 for 3% counted 4x as fast, and nan everything: one band took all)
        print(f"error: --tolerance is a fraction of the fastest time, in [0, 1) (0.03: within 3%), got "
              f"{args.tolerance}", file=sys.stderr)
        return 2
    if args.min_points < 1:  # (0 or below filtered no band: each behaved as 1, a band of one noisy size)
        print(f"error: --min-points must be at least 1, got {args.min_points}", file=sys.stderr)
        return 2
    from tpgraph.comm.limits import kernel_limits
    from tpgraph.tune.measure import DEFAULT_SIZES

    vector, smallest, largest = kernel_limits().vector_bytes, DEFAULT_SIZES[0], DEFAULT_SIZES[-1]
    # (above the largest no size is measured: the rows would claim sizes nothing timed)
    if args.max_bytes % vector or not smallest <= args.max_bytes <= largest:
        print(f"error: --max-bytes must be a multiple of {vector} bytes, at least {smallest} and at most {largest} "
              f"(the smallest and largest sizes measured), got {args.max_bytes}", file=sys.stderr)
        return 2
    if args.max_bytes < largest and not args.dry_run:  # (the rule sends what lies above the last band to NCCL)
        print(f"error: --max-bytes {args.max_bytes} measures less than {largest} bytes: rows written from it would "
              "send every larger message to NCCL unmeasured; add --dry-run to see them without writing",
              file=sys.stderr)
        return 2
    from tpgraph.distributed import SHARED_GPU_ENV, shared_gpu

    if shared_gpu() and not args.dry_run:  # (the ranks take GPU 0 in turns: results, never timings)
        print(f"error: {SHARED_GPU_ENV}=1 puts every rank on GPU 0, where they take it in turns: its timings would "
              f"steer every real run; unset {SHARED_GPU_ENV} to tune, or add --dry-run to see them without writing",
              file=sys.stderr)
        return 2
    try:  # (torchrun's; not an integer, it was a ValueError traceback)
        launched, on_host = env_int("WORLD_SIZE"), env_int("LOCAL_WORLD_SIZE")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if launched is None and args.world_size is None:
        print("error: outside torchrun, say how many ranks: --world-size N", file=sys.stderr)
        return 2
    if args.plot is not None:  # (checked, and written, where matplotlib puts it)
        args.plot = plot_path(args.plot)
    for flag, path in (("--log", args.log), ("--plot", args.plot)):  # (written after minutes of measuring: a
        # failed write there lost the run, the table's update included)
        if path is not None and (refused := output_refused(path)):
            print(f"error: {flag} {path}: {refused}", file=sys.stderr)
            return 2
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:  # (not after minutes of measuring)
        print("error: --plot needs matplotlib (pip install matplotlib, or tpgraph[bench])", file=sys.stderr)
        return 2
    if args.plot is not None and (unknown := plot_format_refused(args.plot)):
        print(f"error: --plot {args.plot}: {unknown}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():  # (under torchrun each rank would fail to find a GPU, with a traceback)
        print("error: tpgraph-tune measures the all-reduce on CUDA GPUs; none is visible here", file=sys.stderr)
        return 2
    from tpgraph.comm.thresholds import arch_for, load_table_for

    capability = torch.cuda.get_device_capability(0)
    try:  # (under torchrun every rank checks the same file against the same GPUs: all refuse or none)
        # the table the ranks' set-up reads (it sizes their workspace), --table or not: where it is missing, the
        # loader names TPGRAPH_CONFIG_DIR and the fix, before any rank starts
        load_table_for(capability)
        table = table_for(args, capability)
        check_table_arch(table, arch_for(capability))
        check_outputs_apart(args, table)
        if not args.dry_run:
            check_table_writable(table)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from tpgraph.comm.thresholds import WORLD_SIZES

    lo, hi = WORLD_SIZES.start, WORLD_SIZES.stop - 1  # (the custom all-reduce's, and the table's rows)
    if launched is not None:
        if launched not in WORLD_SIZES:  # (each rank would fail alike, after NCCL started)
            print(f"error: the table has rows for {lo}..{hi} ranks; torchrun started {launched}", file=sys.stderr)
            return 2
        if args.world_size is not None and args.world_size != launched:  # (torchrun's decides)
            print(f"error: --world-size {args.world_size}, but torchrun started {launched} ranks: "
                  "leave --world-size out under torchrun, or start that many (--nproc-per-node)", file=sys.stderr)
            return 2
        # (a rank past the host's GPUs failed the process group's start in a traceback, and its peers in another)
        if on_host is not None and on_host > torch.cuda.device_count() and not shared_gpu():
            print(f"error: torchrun started {on_host} ranks on this host, but {torch.cuda.device_count()} GPUs are "
                  f"visible: start at most one rank per GPU (--nproc-per-node)", file=sys.stderr)
            return 2
        return run_rank(args, None)
    import torch.multiprocessing as mp

    from tpgraph.engine.followers import free_tcp_init

    if args.world_size not in WORLD_SIZES:
        print(f"error: --world-size {args.world_size}: the table has rows for {lo}..{hi} ranks", file=sys.stderr)
        return 2
    if args.world_size > (gpus := torch.cuda.device_count()):
        most = min(gpus, hi)
        fix = (f"the all-reduce is tuned across {lo} GPUs at least" if most < lo
               else f"give --world-size {lo}" if most == lo else f"give --world-size {lo}..{most}")
        print(f"error: --world-size {args.world_size} starts one rank per GPU, but {gpus} "
              f"{'GPU is' if gpus == 1 else 'GPUs are'} visible: {fix}", file=sys.stderr)
        return 2
    init = free_tcp_init()
    try:
        mp.start_processes(_spawned, args=(args, init), nprocs=args.world_size, start_method="spawn")
    except mp.ProcessExitedException as exc:  # (a rank that said why and exited: no second traceback here)
        if exc.exit_code < 0:  # (killed by a signal, the OOM killer's or a crash's: it said nothing)
            print(f"error: rank {exc.error_index} was killed by signal {exc.signal_name or -exc.exit_code}",
                  file=sys.stderr)
            return 1
        return exc.exit_code or 1
    return 0


def _spawned(rank: int, args: argparse.Namespace, init: str) -> None:
    code = run_rank(args, (rank, args.world_size, init))
    if code:
        raise SystemExit(code)


def run_rank(args: argparse.Namespace, dist_init: tuple[int, int, str] | None) -> int:
    from tqdm import tqdm

    from tpgraph.comm.custom_ar import CustomAllReduce, CustomAllReduceConfig
    from tpgraph.distributed import destroy_distributed, init_distributed
    from tpgraph.tune.measure import DEFAULT_SIZES, count_steps, measure, skipped_multicast

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rank, world, init = dist_init or (None, None, None)
    state = init_distributed("cuda", rank, world, init)
    try:
        # staging for the largest size, whatever the current table says; the push slot the product gets when push
        # reaches its cap (larger pushes go through it in pieces, as in the product)
        try:
            ar = CustomAllReduce(state, CustomAllReduceConfig(
                push_slot_bytes=min(args.max_bytes, CustomAllReduceConfig().max_push_bytes),
                staging_bytes=args.max_bytes))
        except RuntimeError as exc:  # (every rank raises: its own reason, or a PeerError naming the rank's)
            if not set_up_refused(exc):
                raise
            if state.is_driver:
                print(f"error: nothing to tune here: {exc}", file=sys.stderr)
            return 2
        try:
            props = ar.ext.device_properties(state.device.index)
            table = table_for(args, (props.major, props.minor))
            sizes = [s for s in DEFAULT_SIZES if s <= args.max_bytes]
            driver = state.is_driver
            if driver:
                logger.info("%s", skipped_multicast())
            bar = tqdm(total=count_steps(sizes, state.world_size, ar.num_sms), desc="tuning", disable=not driver)
            results = measure(state, ar, sizes, args.runs, progress=lambda label: (bar.set_postfix_str(label),
                                                                                   bar.update()))
            bar.close()
            if driver:
                _write(args, state.world_size, ar.num_sms, results, table, _provenance(ar, props))
        finally:
            ar.close()
    finally:
        destroy_distributed(state)
    return 0


def set_up_refused(exc: BaseException) -> bool:
    """Whether the custom all-reduce's set-up failed for a reason of the machine's, as the engine reads it before it
    falls back to NCCL (a CUDA error of topology.UNAVAILABLE_CUDA_ERRORS too: a GPU tpgraph._C has no kernels for,
    CUDA IPC refused), or was refused by tpgraph: nothing to tune here, said in a line, not a traceback."""
    from tpgraph.comm.topology import unavailable_cuda_error

    return isinstance(exc, TPGraphError) or unavailable_cuda_error(exc) is not None


def check_table_arch(table: Path, arch: str) -> None:
    """Refuse, before any measuring, a table that is missing, does not parse, or that another architecture reads
    (these GPUs' figures would steer that one)."""
    from tpgraph.comm.thresholds import load_table

    _require_table(table)
    found = load_table(table).arch
    if found != arch:
        raise ConfigError(f"{table} is the {found!r} table; these GPUs are {arch}: tune into an {arch} table")


def plot_format_refused(path: Path) -> str | None:
    """Why matplotlib would refuse to save a figure at `path` (its suffix names no format it writes), else None: it
    refused only after the measuring, before the table was written."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = path.suffix[1:].lower()  # (none: matplotlib's default format, png)
    if suffix and suffix not in formats:
        return f"matplotlib writes {', '.join(sorted(formats))}, not .{suffix}"
    return _render_refused(suffix) if suffix else None


def _render_refused(suffix: str) -> str | None:
    """Why a figure in this format cannot be rendered on this machine, else None: a format matplotlib lists may need
    a program it lacks (pgf: xelatex), found only when the plot was saved, after the measuring."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.set_title("µs")  # (text, as the plot has: pgf measures it through LaTeX)
    try:
        fig.savefig(io.BytesIO(), format=suffix)
    except Exception as exc:  # noqa: BLE001 - whatever the backend raises, the plot would raise it after the measuring
        return f"matplotlib cannot write .{suffix} here ({exc})"
    finally:
        plt.close(fig)
    return None


def output_refused(path: Path) -> str | None:
    """Why a --log or --plot file could not be written at `path`, else None: a folder in its place, no folder to
    write it in, or one (or a file) this user cannot write, which failed only after the measuring, with a traceback
    and before the table was written."""
    if path.is_dir():
        return "a folder, not a file"
    if not path.parent.is_dir():
        return f"there is no folder {path.parent} to write it in"
    if path.exists() and not os.access(path, os.W_OK):
        return "the file is not writable"
    if not path.exists() and not os.access(path.parent, os.W_OK | os.X_OK):
        return f"the folder {path.parent} is not writable"
    return None


def plot_path(path: Path) -> Path:
    """Where matplotlib writes a figure saved at `path`: a name with no suffix gets its default format's (--plot tune
    wrote tune.png, while the checks before the measuring judged "tune")."""
    if path.suffix or importlib.util.find_spec("matplotlib") is None:  # (without matplotlib, refused below)
        return path
    import matplotlib

    return path.with_name(f"{path.name}.{matplotlib.rcParams['savefig.format']}")


def check_outputs_apart(args: argparse.Namespace, table: Path) -> None:
    """Refuse a --log or --plot naming the table itself (the log is written first, over the table, which was then
    lost: the run failed reading it back as a table), or naming each other."""
    for flag, path in (("--log", args.log), ("--plot", args.plot)):
        if path is not None and path.resolve() == table.resolve():
            raise ConfigError(f"{flag} {path} is the table being tuned: give {flag} another file")
    # (the plot is written after the log, over it: the measurements it kept were lost)
    if args.log is not None and args.plot is not None and args.log.resolve() == args.plot.resolve():
        raise ConfigError(f"--log {args.log} and --plot {args.plot} name one file: give each its own")


def check_table_writable(table: Path) -> None:
    """Refuse, before any measuring, a table whose folder takes no new file (the update is a new file moved into
    place): a read-only install's shipped table failed only after minutes of measuring."""
    table = table.resolve()  # (a link: the new file is written beside the file it names)
    if not os.access(table.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write a new {table} there (its folder is not writable): copy tpgraph's configs "
                          "folder where you can write and set TPGRAPH_CONFIG_DIR to it (the tuner then updates, and "
                          "the engine reads, the copy), or add --dry-run")


def table_for(args: argparse.Namespace, capability: tuple[int, int]) -> Path:
    """--table, or the table the loader reads for GPUs of this capability."""
    from tpgraph.comm.thresholds import config_dir, table_file_for

    return args.table or config_dir() / "allreduce" / table_file_for(capability)


def _require_table(table: Path) -> None:
    if not table.is_file():
        raise ConfigError(f"{table}: no such table to update (give --table an existing one from configs/allreduce)")


@contextlib.contextmanager
def _locked(table: Path) -> Iterator[None]:
    """The table file held against other tpgraph-tune runs' updates (an flock, on the file the path names once it is
    held: one that waited holds the file the run before it moved away, and takes the new one)."""
    while True:
        _require_table(table)
        f = open(table)
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
            if os.fstat(f.fileno()).st_ino == os.stat(table).st_ino:
                break
        except BaseException:
            f.close()
            raise
        f.close()
    try:
        yield
    finally:
        f.close()


def _provenance(ar, props) -> str:
    """GPU, SM count, driver, CUDA, torch and NCCL versions, date and command."""
    import torch

    driver = ar.ext.driver_version()  # CUDA driver API version, e.g. 13000
    nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    command = "tpgraph-tune " + shlex.join(_without_paths(sys.argv[1:]))
    return (f"tpgraph-tune on {props.name} ({ar.num_sms} SMs), driver API {driver // 1000}.{driver % 1000 // 10}, "
            f"CUDA {torch.version.cuda}, torch {torch.__version__}, NCCL {nccl}, "
            f"{datetime.date.today().isoformat()}: `{command}`")


def _without_paths(argv: list[str]) -> list[str]:
    """The command as provenance keeps it: file arguments by their names alone, since the table ships to other
    machines and a folder on this one means nothing there."""
    def short(arg: str) -> str:
        flag, eq, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
        return flag + eq + (Path(value).name if os.sep in value else value)

    return [short(a) for a in argv]


def _write(args: argparse.Namespace, world_size: int, num_sms: int, results: list, table: Path,
           provenance: str) -> None:
    from tpgraph.comm.thresholds import Algo
    from tpgraph.tune.bands import Curves, derive_bands
    from tpgraph.tune.launch import launch_bands
    from tpgraph.tune.writer import diff, render, updated_table

    def log(**derived: dict) -> None:
        if args.log:
            args.log.write_text(json.dumps({"provenance": provenance, **derived,
                                            "measurements": [vars(m) for m in results]}, indent=1))

    log()  # (first the measurements alone: minutes of them are kept where deriving the bands fails)
    sizes = sorted({m.nbytes for m in results})
    rows, choices = {}, {}
    for mode in ("graph", "eager"):
        times = {a.value: [next((m.us for m in results if m.mode == mode and m.algo == a.value and m.nbytes == s),
                                None) for s in sizes] for a in (Algo.PUSH_1SHOT, Algo.PULL_1SHOT, Algo.PULL_2SHOT,
                                                                 Algo.NCCL)}
        choices[mode] = derive_bands(Curves(tuple(sizes), times), args.tolerance, args.min_points)
        rows[mode] = choices[mode].bounds
        print(f"ws={world_size} {mode}: " + ", ".join(f"{k}={v}" for k, v in rows[mode].items())
              + f" (excess {choices[mode].excess:.3f})", flush=True)
    launch = {}
    for algo in (Algo.PUSH_1SHOT, Algo.PULL_1SHOT, Algo.PULL_2SHOT):
        best = {m.nbytes: m.blocks for m in results if m.mode == "graph" and m.algo == algo.value and m.blocks}
        if best:
            launch[algo] = launch_bands(best, num_sms)
    log(rows=rows, launch={a.value: b for a, b in launch.items()})  # (kept where the plot or the table fails)
    if args.plot:
        from tpgraph.tune.plot import plot_curves

        plot_curves(results, choices, args.plot, f"all-reduce, {world_size} ranks")

    def tuned(path: Path) -> str:
        return render(updated_table(json.loads(path.read_text()), world_size, rows, provenance, launch, str(table)))

    if args.dry_run:
        _require_table(table)
        new_text = tuned(table)
        print(diff(table, new_text) or f"{table}: no change", flush=True)
        return
    # the file a link names (the link stays one); read, updated and replaced under its lock, so that another
    # tpgraph-tune writing its world size's rows into it meanwhile loses none of them, nor this one's
    target = table.resolve()
    with _locked(target):
        new_text = tuned(target)
        # a new file moved into place: a tuner stopped halfway never leaves a truncated table behind; with the old
        # file's permissions (a group's table stays the group's)
        partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with open(partial, "w") as f:
                f.write(new_text)
                f.flush()
                os.fsync(f.fileno())
            shutil.copymode(target, partial)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    print(f"wrote {table}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
