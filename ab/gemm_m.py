# session 43: cuBLAS bf16 GEMM time against M for the Llama-3-8B TP=1 prefill shapes (CUDA events, median of 50)
import json, sys, torch
shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ms = [256, 384, 448, 512, 517, 520, 528, 544, 576, 640, 700, 768, 896, 1024, 1100, 1152, 1280, 1536, 2048]
out = {}
for name, (k, n) in shapes.items():
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(5):
            torch.nn.functional.linear(x, w)
        times = []
        for _ in range(50):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); torch.nn.functional.linear(x, w); b.record(); b.synchronize()
            times.append(a.elapsed_time(b))
        times.sort()
        out.setdefault(name, {})[m] = times[len(times) // 2] * 1000
tot = {m: sum(out[n][m] for n in out) for m in ms}
print("M, us per layer (qkv+o+gate_up+down), us per token")
for m in ms:
    print(m, round(tot[m], 1), round(tot[m] / m, 3), {n: round(out[n][m], 1) for n in out})
json.dump(out, open(sys.argv[1], "w"))
