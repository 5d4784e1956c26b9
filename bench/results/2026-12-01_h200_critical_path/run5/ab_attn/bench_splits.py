"""run5 scratch: decode attention alone at MAX_SPLITS 64 / 32 / 16 (TPGRAPH_X_MAX_SPLITS, read per call on the host),
a graph of 32 back-to-back calls each, replayed round-robin; median µs per call."""
import json
import os
import statistics
import sys

import torch

from tpgraph.kernels.decode_attention import paged_decode_attention_v2
from tpgraph.kernels.paged_decode import paged_decode_reference

HEADS, KV, D, BS, MAXLEN, CALLS = 16, 4, 128, 16, 32768, 32
caps = [int(c) for c in sys.argv[1].split(",")]
dev = torch.device("cuda")
g = torch.Generator(device="cpu").manual_seed(0)
results = {}
for batch, ctx in ((1, 512), (1, 4096), (1, 32768), (8, 4096)):
    per = -(-ctx // BS)
    nblocks = batch * per + 7
    k = torch.randn(nblocks, BS, KV, D, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(nblocks, BS, KV, D, generator=g).to(dev, torch.bfloat16)
    table = torch.zeros(batch, MAXLEN // BS, dtype=torch.int32)
    table[:, :per] = torch.randperm(nblocks, generator=g)[: batch * per].view(batch, per)
    table = table.to(dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HEADS, D, generator=g).to(dev, torch.bfloat16)
    ref = paged_decode_reference(q, k, v, table, lens, D ** -0.5).float()
    graphs = {}
    for cap in caps:
        os.environ["TPGRAPH_X_MAX_SPLITS"] = str(cap)
        out = paged_decode_attention_v2(q, k, v, table, lens, D ** -0.5, max_seq_len=MAXLEN)
        assert (out.float() - ref).abs().max().item() < 3e-2
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for _ in range(CALLS):
                paged_decode_attention_v2(q, k, v, table, lens, D ** -0.5, max_seq_len=MAXLEN)
        graphs[cap] = gr
    times = {c: [] for c in caps}
    for _ in range(7):
        for c, gr in graphs.items():
            for _ in range(10):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                gr.replay()
                b.record()
                b.synchronize()
                times[c].append(a.elapsed_time(b) * 1000 / CALLS)
    row = {c: statistics.median(t) for c, t in times.items()}
    results[f"{batch},{ctx}"] = row
    print(f"bs {batch:3d} ctx {ctx:5d} " + "  ".join(f"max_splits {c} {us:6.2f}" for c, us in row.items()), flush=True)
    del graphs
json.dump(results, open(sys.argv[2], "w"), indent=1)
