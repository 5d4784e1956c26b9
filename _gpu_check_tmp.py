import sys

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, "tests")
from tpgtest.paged_cases import random_paged_case  # noqa: E402

from tpgraph.kernels.decode_attention import choose_num_splits, paged_decode_attention_v2  # noqa: E402
from tpgraph.kernels.paged_decode import paged_decode_reference  # noqa: E402

dev = "cuda"
for dt in (torch.float32, torch.bfloat16):
    worst = 0.0
    for seed in range(16):
        q, k, v, bt, lens, scale = random_paged_case(seed, dev, dt, max_batch=16, max_len=1500)
        ref = paged_decode_reference(q, k, v, bt, lens, scale).float()
        for ns in (None, 1, 7):
            out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=1500, num_splits=ns).float()
            worst = max(worst, (out - ref).abs().max().item())
    print(dt, "max abs err", worst, flush=True)
for hq, hkv in [(32, 8), (8, 1)]:
    for B, L in [(1, 1024), (1, 4096), (1, 32768), (4, 4096), (8, 4096), (16, 8192), (32, 4096), (64, 2048),
                 (128, 1024), (256, 512)]:
        bs, d = 16, 128
        nblk = B * (L // bs) + 4
        kc = torch.randn(nblk, bs, hkv, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.randperm(nblk, device=dev)[: B * (L // bs)].view(B, -1).int()
        lens = torch.full((B,), L, device=dev, dtype=torch.int32)
        q = torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16)
        t = do_bench_cudagraph(lambda: paged_decode_attention_v2(q, kc, vc, bt, lens, 0.088, max_seq_len=L),
                               rep=100) * 1000
        mb = 2 * B * L * hkv * d * 2 / 1e6
        print(f"Hq {hq} Hkv {hkv} B {B} L {L}: {choose_num_splits(B, hkv, L, 132)} splits {t:.1f} us "
              f"({mb / t * 1e3:.0f} GB/s)", flush=True)
        del kc, vc
