"""Writes the GEMV table variants of runs 4-7 into ab/tables/ (run from the repository root, at 7d42d33, before the
shipped table changed): each is configs/gemv/sm90.json with the entries below replaced. The device calls then ran
`AB_VARIANTS="--variant NAME=.:TPGRAPH_GEMV_TABLE=ab/tables/NAME.json ..." AB_ENTRY=custom+gemv+overlap,\
custom+gemv+push+overlap NPROC=1 SHAPE=llama3-8b-half bash bench/gpu_graph_checks.sh OUT ab` (see README.md)."""

import json
from pathlib import Path


def cfg(block_n: int, block_k: int, stages: int, split_k: int) -> dict:
    return dict(block_n=block_n, block_k=block_k, num_warps=4, num_stages=stages, split_k=split_k)


D2 = {"4096,7168,1": cfg(32, 128, 5, 2)}  # down at one row: 32x128, 5 stages, split-K 2 ("d128s2", then "b2")
D4 = {"4096,7168,1": cfg(32, 128, 4, 4)}
Q8 = {"3072,4096,1": cfg(32, 128, 3, 8)}
VARIANTS = {
    # run4
    "d128": {"4096,7168,1": cfg(32, 128, 5, 1)}, "d128s2": D2,
    # run5 (each on top of D2)
    "b2": D2, "o_s2": {**D2, "4096,2048,1": cfg(32, 128, 5, 2)}, "o_16": {**D2, "4096,2048,1": cfg(16, 128, 5, 1)},
    "q_s2": {**D2, "3072,4096,1": cfg(32, 128, 4, 2)}, "q_s8": {**D2, **Q8},
    "gu_32": {**D2, "14336,4096,1": cfg(32, 128, 4, 1)}, "d_s4": D4,
    # run6
    "c_b2": D2, "c_d4q8": {**D4, **Q8}, "c_d8q8": {"4096,7168,1": cfg(32, 128, 4, 8), **Q8},
    "c_d4q16": {**D4, "3072,4096,1": cfg(32, 128, 3, 16)},
    "c_d4q8m8": {**D4, **Q8, "4096,7168,8": cfg(32, 128, 4, 4), "3072,4096,8": cfg(32, 128, 3, 8)},
}

if __name__ == "__main__":
    base = json.loads(Path("configs/gemv/sm90.json").read_text())
    Path("ab/tables").mkdir(parents=True, exist_ok=True)
    for name, entries in VARIANTS.items():
        table = json.loads(json.dumps(base))
        table["best"].update(entries)
        Path(f"ab/tables/{name}.json").write_text(json.dumps(table))
