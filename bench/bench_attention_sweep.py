"""Decode attention's launch shapes, swept per batch x context against the shipped heuristic. One GPU.

    python bench/bench_attention_sweep.py --points 1x512,8x512,32x512,8x4096 --out bench/results/.../attn_sweep.json

At Llama-3-8B's TP=2 rank shape (bench_kernels.py: 16 query heads, 4 KV heads of 128, bf16, 16-token cache blocks),
each point times `paged_decode_attention_v2` with the model's launch (the default: 64-token tiles, 4 warps,
attention_stages' stages, choose_num_splits / min_split_tiles for a grid sized by `--max-seq-len`, the max_model_len a
server runs with) and with every shape of the grid: tile length, warps, stages, the split count the heuristic gives
scaled by `--split-scales`, the fewest tiles a split takes, and the tiles each program keeps asked of L2 ahead
(`--l2-prefetch`). Shapes that resolve to the same launch are timed once. One timing method for all
(tpgraph/tune/timing.py: a graph of 64 calls cycling through cache copies that cannot sit in L2, the median replay);
the default and the best three are then timed again, interleaved, and those figures are the ones reported. The
default's output is checked against the fp32 reference and every shape's against the default's, relative to the
output's largest value (a dropped row or tile moves it by more than bf16 rounding does): a shape off by more is wrong,
not fast. Prints the best and top 3 per point with the default's time and the K/V bytes' floor; writes JSON after
every point.

A kernel alone is not the step: attention in the step starts as a programmatic dependent of the qkv kernel, so a
shape that wins here is a candidate to time in whole steps (bench/ab_decode.py), not a verdict.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from bench_kernels import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, copies_for, moved_bytes, per_op_us

# Random q/K/V give softmax averages of 0.02-0.5: valid shapes differed from the default by up to 0.4% of the largest
# output on CPU (bf16 rounding emulated), a dropped newest row or tile by 5-20%
MAX_REL_ERR = 0.02


@dataclass(frozen=True)
class AttnShape:
    """One launch of paged_decode_attention_v2 (None: the heuristic's choice)."""

    block_n: int = 64
    num_warps: int | None = None  # (None: attention_warps, the model's)
    num_stages: int | None = None  # (None: attention_stages, the model's)
    num_splits: int | None = None
    split_tiles: int | None = None
    l2_prefetch: int | None = None  # tiles kept asked of L2 ahead (None: the launch's default)
    kv_ahead: int | None = None  # how far the tile loop reads ahead (None: kv_lookahead's choice)
    long_split_tiles: int | None = None  # a long sequence's splits grow to this many tiles (None: the model's)
    merge_splits: int | None = None  # and it takes at most this many splits until then (None: the model's)
    combine_rows: int | None = None  # partial rows the last split's merge loads at once (None: the model's)

    def short(self) -> str:
        splits = "auto" if self.num_splits is None else str(self.num_splits)
        tiles = "auto" if self.split_tiles is None else str(self.split_tiles)
        prefetch = "" if self.l2_prefetch is None else f" l2 {self.l2_prefetch}"
        ahead = "" if self.kv_ahead is None else f" ahead {self.kv_ahead}"
        stages = "auto" if self.num_stages is None else str(self.num_stages)
        long = "" if self.long_split_tiles is None else f" long {self.long_split_tiles}"
        long += "" if self.merge_splits is None else f" merge {self.merge_splits}"
        rows = "" if self.combine_rows is None else f" rows {self.combine_rows}"
        warps = "auto" if self.num_warps is None else str(self.num_warps)
        return (f"n{self.block_n} w{warps} s{stages} splits {splits} tiles {tiles}{prefetch}{ahead}{long}"
                f"{rows}")


def parse_points(text: str) -> list[tuple[int, int]]:
    """'8x512,32x4096' -> [(8, 512), (32, 4096)] (batch x context)."""
    points = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        batch, _, ctx = item.partition("x")
        if not (batch.isdigit() and ctx.isdigit() and int(batch) > 0 and int(ctx) > 0):
            raise SystemExit(f"--points takes BATCHxCONTEXT entries joined by ',', e.g. 8x512, got {item!r}")
        points.append((int(batch), int(ctx)))
    if not points:
        raise SystemExit("--points is empty")
    return points


def grid(batch: int, max_seq_len: int, sms: int, block_ns: list[int], warps: list[int], stages: list[int],
         split_scales: list[float], split_tiles: list[int | None], l2_prefetch: tuple[int | str, ...] = (0,),
         l2_bytes: int = 50 << 20, kv_ahead: tuple[int | None, ...] = (None,),
         long_split_tiles: tuple[int | None, ...] = (None,), merge_splits: tuple[int | None, ...] = (None,),
         combine_rows: tuple[int | None, ...] = (None,)) -> list[AttnShape]:
    """The default first, then every combination, each resolved to the launch it makes: the grid's split count
    (the heuristic's for that tile length, scaled, at most one split a tile of max_seq_len), the fewest tiles a
    split takes (min_split_tiles where not given) and the tiles each program keeps asked of L2 ahead ("auto":
    the budget rule `l2_prefetch_tiles` for that launch's programs and an `l2_bytes` L2; the default launch's is
    TPGRAPH_ATTN_L2_PREFETCH's), how far the tile loop reads ahead (None: `kv_lookahead`), how long a long
    sequence's splits grow and how many it takes until then (None: LONG_SPLIT_TILES, `merge_split_cap`) and how many
    partial rows the merge loads at once (None: COMBINE_ROWS). A combination that
    resolves to a launch already listed is dropped, so the default is timed once, under its own name."""
    from tpgraph.kernels._settings import env_flag
    from tpgraph.kernels.decode_attention import (
        COMBINE_ROWS,
        LONG_SPLIT_TILES,
        attention_stages,
        attention_warps,
        choose_num_splits,
        kv_lookahead,
        l2_prefetch_tiles,
        merge_split_cap,
        min_split_tiles,
        splits_in_use,
    )

    def given(value: int | None, default: int) -> int:
        return default if value is None else value

    def rule(block_n: int, splits: int, long: int | None, merge: int | None) -> int:
        programs = batch * KV_HEADS * splits_in_use(splits, max_seq_len, block_n, given(long, LONG_SPLIT_TILES),
                                                    merge_splits=given(merge, merge_split_cap(batch, KV_HEADS, sms)))
        return l2_prefetch_tiles(programs, 2 * block_n * HEAD_DIM * 2, l2_bytes)  # bf16 K and V tiles

    def resolved(shape: AttnShape) -> tuple:
        auto = choose_num_splits(batch, KV_HEADS, max_seq_len, sms, min_split_tokens=shape.block_n)
        splits = auto if shape.num_splits is None else shape.num_splits
        tiles = min_split_tiles(batch, KV_HEADS, sms) if shape.split_tiles is None else shape.split_tiles
        prefetch = shape.l2_prefetch
        if prefetch is None:
            prefetch = (rule(shape.block_n, splits, shape.long_split_tiles, shape.merge_splits)
                        if env_flag("TPGRAPH_ATTN_L2_PREFETCH") else 0)
        ahead = kv_lookahead(torch.bfloat16) if shape.kv_ahead is None else shape.kv_ahead
        stages = attention_stages(ahead) if shape.num_stages is None else shape.num_stages
        return (shape.block_n, given(shape.num_warps, attention_warps()), stages, splits, tiles, prefetch, ahead,
                given(shape.long_split_tiles, LONG_SPLIT_TILES),
                given(shape.merge_splits, merge_split_cap(batch, KV_HEADS, sms)),
                given(shape.combine_rows, COMBINE_ROWS))

    launches = {resolved(AttnShape()): AttnShape()}
    for block_n, w, s, scale, tiles, pf, ahead, long, merge, rows in itertools.product(
            block_ns, warps, stages, split_scales, split_tiles, l2_prefetch, kv_ahead, long_split_tiles, merge_splits,
            combine_rows):
        auto = choose_num_splits(batch, KV_HEADS, max_seq_len, sms, min_split_tokens=block_n)
        splits = None if scale == 1 else max(1, min(round(auto * scale), -(-max_seq_len // block_n)))
        prefetch = rule(block_n, auto if splits is None else splits, long, merge) if pf == "auto" else int(pf)
        shape = AttnShape(block_n, w, s, splits, tiles, prefetch, ahead, long, merge, rows)
        launches.setdefault(resolved(shape), shape)
    return list(launches.values())


def sweep_point(batch: int, ctx: int, max_seq_len: int, shapes: list[AttnShape], hbm: float, l2: int,
                device: torch.device) -> dict:
    """Every shape at one batch x context: timed, failed (a launch the GPU refused) or wrong."""
    from tqdm import tqdm

    from tpgraph.kernels.decode_attention import paged_decode_attention_v2
    from tpgraph.kernels.paged_decode import paged_decode_reference
    from tpgraph.tune.timing import K_OPS, capture, graph_ops_us_interleaved

    scale = HEAD_DIM ** -0.5
    nbytes = moved_bytes("attention", batch, ctx)
    copies = min(copies_for(nbytes, l2), max(1, (24 << 30) // nbytes))
    per_seq = -(-ctx // BLOCK_SIZE)
    g = torch.Generator(device=device).manual_seed(batch * 100003 + ctx)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device, generator=g)
    caches = [tuple(torch.randn(batch * per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device,
                                generator=g) for _ in range(2)) for _ in range(copies)]
    tables = torch.randperm(batch * per_seq, device=device, generator=g).to(torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)

    def run(shape: AttnShape, i: int) -> torch.Tensor:
        return paged_decode_attention_v2(q, caches[i][0], caches[i][1], tables, lens, scale,
                                         max_seq_len=max_seq_len, **asdict(shape))

    ref = run(AttnShape(), 0).float()
    exact = paged_decode_reference(q.float(), caches[0][0].float(), caches[0][1].float(), tables, lens, scale)
    top = ref.abs().max().item()
    if (ref - exact).abs().max().item() > MAX_REL_ERR * top:
        raise SystemExit(f"attention {batch}x{ctx}: the default launch is off the fp32 reference; nothing to sweep")
    timed, failed, wrong = [], [], []
    for shape in tqdm(shapes, desc=f"attention {batch}x{ctx}", leave=False, unit="shape", mininterval=2):
        try:
            rel = (run(shape, 0).float() - ref).abs().max().item() / top
            us = per_op_us(lambda i, shape=shape: run(shape, i), copies)
        except Exception as e:  # out of registers or shared memory, a launch the GPU refuses: skip it
            torch.cuda.synchronize()  # a sticky CUDA error raises here and ends the sweep
            failed.append({**asdict(shape), "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        (wrong if rel > MAX_REL_ERR else timed).append({**asdict(shape), "us": us, "max_rel_err": rel})
    timed.sort(key=lambda r: r["us"])
    # the default and the best three again, interleaved (one pass each in rotating order), so that drift over the
    # sweep cannot favour a shape timed late over the default timed first
    finalists = {AttnShape(**shape_fields(r)) for r in timed[:3]} | ({AttnShape()} if timed else set())
    turns = {shape: itertools.cycle(range(copies)) for shape in finalists}
    graphs = {shape.short(): capture(lambda shape=shape: run(shape, next(turns[shape])), K_OPS)
              for shape in finalists}
    again = graph_ops_us_interleaved(None, graphs, K_OPS) if graphs else {}
    for r in timed:
        r["us_sweep"] = r["us"]
        r["us"] = again.get(AttnShape(**shape_fields(r)).short(), r["us"])
    timed.sort(key=lambda r: (AttnShape(**shape_fields(r)) not in finalists, r["us"]))  # the finalists by re-time
    graphs.clear()
    caches.clear()
    torch.cuda.empty_cache()
    default = next((r for r in timed if AttnShape(**shape_fields(r)) == AttnShape()), None)
    return {"batch": batch, "context": ctx, "max_seq_len": max_seq_len, "moved_bytes": nbytes,
            "floor_us": nbytes / hbm * 1e6, "default": default, "best": timed[0] if timed else None,
            "top3": timed[:3], "timed": timed, "failed": failed, "wrong": wrong}


def shape_fields(result: dict) -> dict:
    """The AttnShape fields of a result (a field it lacks, as in results written before that field: its default)."""
    return {name: result.get(name, f.default) for name, f in AttnShape.__dataclass_fields__.items()}


def point_line(e: dict) -> str:
    """One line per point: the best shape, the default's time and the floor, the top 3."""
    head = f"attention {e['batch']:3d} x {e['context']:6d}"
    counts = f"[{len(e['timed'])} timed, {len(e['failed'])} failed, {len(e['wrong'])} wrong]"
    if e["best"] is None:
        return f"{head}  no shape ran  {counts}"
    b, d = e["best"], e["default"]
    default = f"default {d['us']:.1f} us" if d else "default failed"
    top = ", ".join(f"{AttnShape(**shape_fields(r)).short()} {r['us']:.1f}" for r in e["top3"])
    return (f"{head}  best {AttnShape(**shape_fields(b)).short()} {b['us']:.1f} us  {default}  floor "
            f"{e['floor_us']:.1f} us  top3: {top}  {counts}")


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def auto_ints(text: str) -> tuple[int | None, ...]:
    """'auto,4,8' -> (None, 4, 8): None is the model's setting."""
    return tuple(None if v == "auto" else int(v) for v in text.split(","))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("attn_sweep.json"))
    p.add_argument("--points", default="1x512,8x512,32x512", help="BATCHxCONTEXT entries joined by ','")
    p.add_argument("--max-seq-len", type=int, default=8192,
                   help="the static bound that sizes the split grid (the engine's max_model_len; Llama-3: 8192)")
    p.add_argument("--block-n", default="32,64,128", help="tokens per tile")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--split-scales", default="1,2", help="the heuristic's split count times these")
    p.add_argument("--split-tiles", default="auto,1", help="the fewest tiles a split takes (auto: the heuristic)")
    p.add_argument("--kv-ahead", default="auto",
                   help="how far the tile loop reads ahead: 0, 1, 2 (decode_attention's KV_AHEAD), "
                        "auto: kv_lookahead's")
    p.add_argument("--l2-prefetch", default="0",
                   help="tiles each program keeps asked of L2 ahead: 0 or powers of two, auto: the budget rule")
    p.add_argument("--long-split-tiles", default="auto",
                   help="how many tiles a long sequence's splits grow to before it takes more than --merge-splits "
                        "(auto: LONG_SPLIT_TILES)")
    p.add_argument("--merge-splits", default="auto",
                   help="the most splits a long sequence takes until they pass --long-split-tiles "
                        "(auto: merge_split_cap's)")
    p.add_argument("--combine-rows", default="auto",
                   help="(split, query head) rows of partials the last split's merge loads at once "
                        "(auto: COMBINE_ROWS)")
    args = p.parse_args()
    points = parse_points(args.points)
    tiles = list(auto_ints(args.split_tiles))
    prefetch = tuple(v if v == "auto" else int(v) for v in args.l2_prefetch.split(","))
    from bench_decode import hbm_bandwidth  # bench/ is on the path when this script runs

    device = torch.device("cuda")
    hbm = hbm_bandwidth(device)
    props = torch.cuda.get_device_properties(device)
    entries = []
    for batch, ctx in points:
        if ctx > args.max_seq_len:
            raise SystemExit(f"context {ctx} is above --max-seq-len {args.max_seq_len}")
        shapes = grid(batch, args.max_seq_len, props.multi_processor_count, ints(args.block_n), ints(args.warps),
                      ints(args.stages), [float(v) for v in args.split_scales.split(",")], tiles, prefetch,
                      props.L2_cache_size, auto_ints(args.kv_ahead), long_split_tiles=auto_ints(args.long_split_tiles),
                      merge_splits=auto_ints(args.merge_splits), combine_rows=auto_ints(args.combine_rows))
        entries.append(sweep_point(batch, ctx, args.max_seq_len, shapes, hbm, props.L2_cache_size, device))
        print(point_line(entries[-1]), flush=True)
        # after every point: a call cut short by its time limit keeps what it timed
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "hbm_bytes_per_s": hbm,
                                        "points": entries}, indent=1))


if __name__ == "__main__":
    main()
