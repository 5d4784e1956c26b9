"""Decode attention over two KV-cache layouts, one timing method. One GPU.

    python bench/bench_attention_layout.py --points 8x512,32x512,8x4096 --out attn_layout.json

The cache the model keeps is [blocks, block_size, KV heads, D] ("NHD": a block's tokens, each with its heads side by
side), so one KV head's program reads 2 x D-byte rows at a stride of KV heads x D elements. "HND" keeps each KV head's
tokens of a block together ([blocks, KV heads, block_size, D]), so that program reads block_size x D contiguous
elements. `paged_decode_attention_v2` takes either through its strides (a permuted view), so the same kernel with the
same launch times both: at Llama-3-8B's TP=2 rank shape (16 query heads, 4 KV heads of 128, bf16), the model's default
launch, the one timing method of bench_kernels.py (a graph of 64 calls cycling through cache copies that cannot sit
in L2, the median replay), each layout at each `--block-sizes`. The outputs must be equal bit for bit (the same values
in another place). Prints one line per point and writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from bench_kernels import HEAD_DIM, HEADS, KV_HEADS, copies_for, moved_bytes, per_op_us


def layout_caches(layout: str, blocks: int, block_size: int, copies: int, g: torch.Generator,
                  device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`copies` (K, V) pairs, each a [blocks, block_size, KV heads, D] view of a cache stored as `layout`."""
    def one() -> torch.Tensor:
        if layout == "NHD":
            return torch.randn(blocks, block_size, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device, generator=g)
        stored = torch.randn(blocks, KV_HEADS, block_size, HEAD_DIM, dtype=torch.bfloat16, device=device, generator=g)
        return stored.permute(0, 2, 1, 3)

    return [(one(), one()) for _ in range(copies)]


def time_point(batch: int, ctx: int, block_size: int, max_seq_len: int, hbm: float, l2: int,
               device: torch.device, shuffled: bool = True) -> dict:
    from tpgraph.kernels.decode_attention import paged_decode_attention_v2

    nbytes = moved_bytes("attention", batch, ctx)
    copies = min(copies_for(nbytes, l2), max(1, (24 << 30) // nbytes))
    per_seq = -(-ctx // block_size)
    g = torch.Generator(device=device).manual_seed(batch * 7919 + ctx)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device, generator=g)
    order = torch.randperm(batch * per_seq, device=device, generator=g) if shuffled else \
        torch.arange(batch * per_seq, device=device)
    tables = order.to(torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    row = {"batch": batch, "context": ctx, "block_size": block_size, "shuffled": shuffled, "max_seq_len": max_seq_len,
           "floor_us": nbytes / hbm * 1e6}
    nhd = layout_caches("NHD", batch * per_seq, block_size, copies, g, device)
    hnd = layout_caches("HND", batch * per_seq, block_size, copies, g, device)
    # HND's first copy holds NHD's first copy's values, stored the other way: the outputs must be equal
    hnd[0] = tuple(c.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for c in nhd[0])
    outs = {}
    for layout, caches in (("NHD", nhd), ("HND", hnd)):
        def run(i: int, caches=caches) -> torch.Tensor:
            return paged_decode_attention_v2(q, caches[i][0], caches[i][1], tables, lens, HEAD_DIM ** -0.5,
                                             max_seq_len=max_seq_len)

        outs[layout] = run(0).clone()
        row[layout] = per_op_us(run, copies)
    del nhd, hnd
    torch.cuda.empty_cache()
    row["equal"] = bool(torch.equal(outs["NHD"], outs["HND"]))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default="1x512,8x512,32x512,8x4096,32x4096")
    p.add_argument("--block-sizes", default="16")
    p.add_argument("--tables", default="shuffled", help="shuffled and/or in-order block tables, comma-separated")
    p.add_argument("--max-seq-len", type=int, default=8192)
    p.add_argument("--out", type=Path, default=Path("attn_layout.json"))
    args = p.parse_args()
    from bench_attention_sweep import parse_points
    from bench_decode import hbm_bandwidth

    device = torch.device("cuda")
    hbm = hbm_bandwidth(device)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    rows = []
    for block_size, tables in itertools.product((int(b) for b in args.block_sizes.split(",")),
                                                args.tables.split(",")):
        for batch, ctx in parse_points(args.points):
            r = time_point(batch, ctx, block_size, args.max_seq_len, hbm, l2, device, tables == "shuffled")
            rows.append(r)
            print(f"attention {batch:3d} x {ctx:5d} block {block_size:3d} {tables}: NHD {r['NHD']:.1f} us, "
                  f"HND {r['HND']:.1f} us, floor {r['floor_us']:.1f} us, equal {r['equal']}", flush=True)
            args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
