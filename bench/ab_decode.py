"""Whole decode steps, A against B: package trees (this checkout's, a revision's) and environment settings, each run
its own `bench_decode.py` process, the variants alternating round by round, so that the machine's drift between
device calls (0.02 ms a step was seen, bench/results/2026-12-01_h200_critical_path) never enters a comparison.

    # here, before the device call: a revision's package, unpacked where the device copy will carry it
    python bench/ab_decode.py --prepare HEAD ab/head
    # on the device (the checkout built): two rounds of new against HEAD, and new with a setting changed
    python bench/ab_decode.py --out OUT --rounds 2 --nproc 1 --variant new=. --variant old=ab/head \\
        --variant nolr=.:TPGRAPH_LAST_SPLIT_REDUCES=0 -- --shape llama3-8b-half --modes full --batches 1,8,32 \\
        --no-ladders --allreduce custom+gemv+overlap --steps 100

A variant is LABEL=DIR[:NAME=VALUE,...]: DIR holds the `tpgraph` package to import (put first on PYTHONPATH; the
built extension is copied into it where it lacks one), and the settings are added to that variant's environment.
`--tiles LABEL=SPEC` gives variant LABEL a small-M tile table: DIR's configs/gemv table (--tiles-arch, sm90) with
SPEC's entries replaced, written to OUT/tables/LABEL.json and named by TPGRAPH_GEMV_TABLE. SPEC is entries joined by
`/`, each `[epilogue:]N,K,M=BLOCK_NxBLOCK_KxWARPSxSTAGESxSPLIT_K[xRESIDENT]` (GemvConfig's fields in order, RESIDENT
0 or 1, and 1 only at M = 1; `epilogue:` for the table's section read by projections with the all-reduce in their
epilogue), e.g.

    --variant d2=. --tiles d2=4096,7168,1=32x128x4x5x2/epilogue:4096,7168,1=32x128x4x4x4
    --variant r=. --tiles r=4096,2048,1=32x2048x16x1x1x1
`--args LABEL=ARGS` adds bench_decode.py arguments for variant LABEL only, after the common ones, so that an option
with a value given in both takes the variant's (a flag given after `--` applies to every variant), e.g.
`--variant b32=. --args b32="--block-size 32"`; through gpu_graph_checks.sh's AB_VARIANTS, which the shell splits
unquoted, write `--args b32=--block-size=32`.
The arguments after `--` go to every bench_decode.py run (its --out is set here). Writes OUT/LABEL_rK.json per run,
OUT/ab.json (every TPOT) and OUT/ab.md: per entry and batch the median over rounds, each round, and the change
against the first variant. A run that fails or times out is left out of them, and the command then exits 1.
Unpacked trees need no git on the device, so `--prepare` runs here.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "bench_decode.py"  # this checkout's benchmark runs every variant's package
STOP_GRACE_S = 30  # a timed-out run's seconds to end its ranks before it is killed


@dataclass(frozen=True)
class Variant:
    label: str
    tree: Path  # holds the tpgraph package
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()  # bench_decode.py arguments for this variant only (--args)


def parse_variant(text: str) -> Variant:
    """LABEL=DIR[:NAME=VALUE,...] -> Variant; a clear error for anything else."""
    label, sep, rest = text.partition("=")
    if not sep or not label or not rest:
        raise argparse.ArgumentTypeError(f"a variant is LABEL=DIR[:NAME=VALUE,...], got {text!r}")
    if not label.replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"variant label {label!r}: letters, digits, - and _ only (it names files)")
    tree, _, settings = rest.partition(":")
    env = {}
    for item in filter(None, settings.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"variant {label!r}: a setting is NAME=VALUE, got {item!r}")
        env[name] = value
    return Variant(label, Path(tree), env)


def sets_out(args: list[str] | tuple[str, ...]) -> bool:
    """Whether bench_decode.py arguments name --out, which each run's command sets itself."""
    return any(a == "--out" or a.startswith("--out=") for a in args)


def parse_args_entry(text: str) -> tuple[str, tuple[str, ...]]:
    """LABEL=ARGS -> (label, ARGS split as a shell would); a clear error for anything else."""
    label, sep, rest = text.partition("=")
    try:
        args = tuple(shlex.split(rest))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--args {label}: {e}") from None
    if not sep or not label or not args:
        raise argparse.ArgumentTypeError(f"--args is LABEL=ARGS (bench_decode.py arguments), got {text!r}")
    if sets_out(args):
        raise argparse.ArgumentTypeError(f"--args {label}: --out is set per run here; leave it out")
    return label, args


FIELDS = ("block_n", "block_k", "num_warps", "num_stages", "split_k", "resident")


def parse_tiles(text: str) -> tuple[str, list[tuple[str, str, dict[str, int]]]]:
    """LABEL=SPEC -> (label, [(section, "n,k,m", config fields)]); a clear error for anything else."""
    label, sep, spec = text.partition("=")
    if not sep or not label or not spec:
        raise argparse.ArgumentTypeError(f"--tiles is LABEL=SPEC, got {text!r}")
    entries = []
    for item in filter(None, spec.split("/")):
        section, _, item_body = item.rpartition(":")
        key, sep, cfg = item_body.partition("=")
        dims, sizes = key.split(","), cfg.lower().split("x")
        if (section not in ("", "epilogue") or not sep or len(dims) != 3 or len(sizes) not in (5, len(FIELDS))
                or not all(d.strip().isdigit() for d in dims + sizes)):
            raise argparse.ArgumentTypeError(
                f"--tiles {label}: an entry is [epilogue:]N,K,M=BLOCK_NxBLOCK_KxWARPSxSTAGESxSPLIT_K[xRESIDENT], "
                f"got {item!r}")
        fields = dict(zip(FIELDS, (int(v) for v in sizes), strict=False))
        if "resident" in fields:
            fields["resident"] = bool(fields["resident"])
            if fields["resident"] and int(dims[2]) != 1:  # more rows would take the default tiles, silently
                raise argparse.ArgumentTypeError(f"--tiles {label}: resident tiles take one row (M = 1), got {item!r}")
        entries.append((section or "best", ",".join(d.strip() for d in dims), fields))
    if not entries:
        raise argparse.ArgumentTypeError(f"--tiles {label}: no entries")
    return label, entries


def write_tiles(variant: Variant, entries: list[tuple[str, str, dict[str, int]]], arch: str, out: Path) -> Variant:
    """The variant's tree's table with the entries replaced, written under out/tables; the variant then names it."""
    base = variant.tree / "configs" / "gemv" / f"{arch}.json"
    if not base.is_file():
        raise SystemExit(f"--tiles {variant.label}: {base} not found (a tree from --prepare carries its configs)")
    table = json.loads(base.read_text())
    for section, key, fields in entries:
        table.setdefault(section, {})[key] = fields
    dest = out / "tables" / f"{variant.label}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(table, indent=1) + "\n")
    return replace(variant, env={**variant.env, "TPGRAPH_GEMV_TABLE": str(dest.resolve())})


def recorded_env(env: dict[str, str], out: Path) -> dict[str, str]:
    """A variant's settings as ab.json keeps them: a path under out (a --tiles table) relative to it, so that the
    results name no folder of the machine they ran on."""
    root = out.resolve()
    return {name: (str(Path(value).relative_to(root)) if Path(value).is_absolute() and Path(value).is_relative_to(root)
                   else value) for name, value in env.items()}


def prepare(rev: str, dest: Path) -> None:
    """`git archive` rev's tpgraph package and its configs/ tables into dest (dest must not exist yet). The tables
    come too: a package without them finds none (thresholds.config_dir looks beside it) and runs the default tiles,
    which made one such "old" tree 0.55 ms a step slower at batch 1 than the same code with its tables."""
    if dest.exists():
        raise SystemExit(f"{dest} exists: remove it or pick another folder")
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "tpgraph", "configs"], capture_output=True,
                             check=False)
    if archive.returncode:
        shutil.rmtree(dest)
        raise SystemExit(f"git archive {rev}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    print(f"{rev}'s tpgraph package and configs are in {dest}: pass --variant LABEL={dest} on the device")


def with_extension(tree: Path) -> None:
    """A prepared tree has no built extension: copy this checkout's (built on the device before the runs)."""
    if tree.resolve() == REPO or any((tree / "tpgraph").glob("_C*.so")):
        return
    built = sorted((REPO / "tpgraph").glob("_C*.so"))
    if not built:
        raise SystemExit("no tpgraph/_C*.so in this checkout: build it first (pip install --no-build-isolation -e .)")
    shutil.copy2(built[0], tree / "tpgraph" / built[0].name)


def run_command(variant: Variant, nproc: int, bench_args: list[str], out: Path) -> tuple[list[str], dict[str, str]]:
    """The torchrun command line and environment of one run."""
    env = {**os.environ, **variant.env, "PYTHONPATH": os.pathsep.join(
        [str(variant.tree.resolve()), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           str(BENCH), *bench_args, *variant.args, "--out", str(out)]
    return cmd, env


def run_once(cmd: list[str], env: dict[str, str], timeout: float) -> int | None:
    """Run one torchrun command; its exit status, or None past `timeout` seconds. Then torchrun is asked to stop
    (SIGTERM: it ends its ranks, which run in sessions of their own) and killed after STOP_GRACE_S: killed at once,
    as subprocess.run's timeout does, its ranks lived on, holding the GPU while the next variant was timed."""
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return None


def tpots(result: dict) -> dict[str, float]:
    """'entry mode bs N' -> TPOT ms, from one bench_decode.py JSON."""
    return {f"{r['allreduce']} {r['mode']} bs {r['batch']}": r["tpot_ms"] for r in result["tpot"]}


def table(runs: dict[str, list[dict[str, float]]]) -> str:
    """Markdown: one row per point (entry, mode, batch), per variant the median over its rounds and the rounds, and
    each variant's change against the first one's median."""
    labels = list(runs)
    points = list(dict.fromkeys(p for rounds in runs.values() for r in rounds for p in r))
    head = ["point", *(f"{label} (ms)" for label in labels), *(f"{label} - {labels[0]}" for label in labels[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        medians = {lb: statistics.median(v) if (v := [r[p] for r in runs[lb] if p in r]) else None for lb in labels}
        cells = [p]
        for lb in labels:
            got = [f"{r[p]:.3f}" for r in runs[lb] if p in r]
            cells.append(f"{medians[lb]:.3f} ({' / '.join(got)})" if got else "-")
        for lb in labels[1:]:
            base, m = medians[labels[0]], medians[lb]
            cells.append(f"{m - base:+.3f}" if base is not None and m is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_variant(p: argparse.ArgumentParser, flag: str, entries: list[tuple[str, object]],
                variants: list[Variant]) -> dict[str, object]:
    """A per-variant option's (label, value) entries as a dict; an argparse error (exit 2) for a label given twice or
    not given by --variant."""
    got = dict(entries)
    twice = sorted(label for label, n in Counter(label for label, _ in entries).items() if n > 1)
    unknown = sorted(set(got) - {v.label for v in variants})
    if twice or unknown:
        p.error(f"{flag}: one per variant, and only for a variant given by --variant (given twice: {twice or 'none'}; "
                f"no such variant: {unknown or 'none'})")
    return got


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prepare", nargs=2, metavar=("REV", "DIR"), help="unpack REV's package into DIR and stop")
    p.add_argument("--variant", action="append", type=parse_variant, default=[], help="LABEL=DIR[:NAME=VALUE,...]")
    p.add_argument("--tiles", action="append", type=parse_tiles, default=[],
                   help="LABEL=SPEC: variant LABEL's tile table (see above)")
    p.add_argument("--args", action="append", type=parse_args_entry, default=[], dest="variant_args",
                   help="LABEL=ARGS: bench_decode.py arguments for variant LABEL only (see above)")
    p.add_argument("--tiles-arch", default="sm90", help="which configs/gemv table --tiles starts from")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1, help="ranks of every run (torchrun --nproc-per-node)")
    p.add_argument("--timeout", type=float, default=300, help="seconds one run may take")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.prepare:
        prepare(args.prepare[0], Path(args.prepare[1]))
        return
    if len(args.variant) < 2 or args.out is None:
        p.error("give --out and at least two --variant (or --prepare REV DIR)")
    if len({v.label for v in args.variant}) != len(args.variant):
        p.error("variant labels must differ")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.nproc < 1:  # (else every run fails in torchrun, one after another, each after its start-up)
        p.error(f"--nproc must be at least 1, got {args.nproc}")
    if not args.timeout > 0:
        p.error(f"--timeout must be positive seconds, got {args.timeout:g}")
    if sets_out(bench_args):
        p.error("--out after -- is set per run here; leave it out")
    tiles = per_variant(p, "--tiles", args.tiles, args.variant)
    extra = per_variant(p, "--args", args.variant_args, args.variant)
    for v in args.variant:
        if not (v.tree / "tpgraph" / "__init__.py").is_file():
            p.error(f"variant {v.label}: {v.tree} holds no tpgraph package (bench/ab_decode.py --prepare REV DIR)")
        with_extension(v.tree)
    args.variant = [replace(v, args=extra.get(v.label, ())) for v in args.variant]
    args.out.mkdir(parents=True, exist_ok=True)
    args.variant = [write_tiles(v, tiles[v.label], args.tiles_arch, args.out) if v.label in tiles else v
                    for v in args.variant]
    runs: dict[str, list[dict[str, float]]] = {v.label: [] for v in args.variant}
    left_out = []
    for k in range(args.rounds):
        for v in args.variant:
            out = args.out / f"{v.label}_r{k + 1}.json"
            out.unlink(missing_ok=True)  # an earlier ab run's into this --out: never read as this run's
            cmd, env = run_command(v, args.nproc, bench_args, out)
            print(f"== round {k + 1}, {v.label}", flush=True)
            code = run_once(cmd, env, args.timeout)
            if code is None or code or not out.is_file():
                why = f"past {args.timeout:.0f} s" if code is None else f"exit {code}" if code else "no results written"
                print(f"   {v.label} round {k + 1}: {why}, left out", flush=True)
                left_out.append(f"{v.label} round {k + 1} ({why})")
                continue
            runs[v.label].append(tpots(json.loads(out.read_text())))
    text = table(runs)
    print(text)
    (args.out / "ab.md").write_text(text + "\n")
    (args.out / "ab.json").write_text(json.dumps({
        "variants": [{"label": v.label, "tree": str(v.tree), "env": recorded_env(v.env, args.out),
                      "args": list(v.args)} for v in args.variant],
        "bench_args": bench_args, "nproc": args.nproc, "tpot_ms": runs, "left_out": left_out}, indent=1))
    if left_out:  # the table holds the rest; the command fails, so that a script running it sees the runs that did not
        raise SystemExit(f"{len(left_out)} run(s) left out: {', '.join(left_out)}")


if __name__ == "__main__":
    main()
