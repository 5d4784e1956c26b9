#!/usr/bin/env bash
# Session 16, call 2 (one H200, TP=1): the kept changes (o_proj's resident weights at one row in the epilogue chain,
# two-tile attention splits from batch 4, qkv split-K 4 at 17-32 rows) checked and timed against the previous commit
# (ab/old: python bench/ab_decode.py --prepare HEAD ab/old before the call). Usage: bash run.sh OUT (repo root).
set -uo pipefail
dest=${1:?outdir}; mkdir -p "$dest"; out=$(mktemp -d /tmp/res.XXXX)
pack() { tar czf "$dest/results.tgz" -C "$out" . 2>/dev/null; }
exec > >(tee -a "$dest/summary.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
[ -n "${TPG_SKIP_BUILD:-}" ] || python3 -m pip install --no-build-isolation --no-deps -v -e . > "$out/build.log" 2>&1 \
  || { tail -40 "$out/build.log"; exit 1; }
echo "=== tests $(date +%T)"
timeout 150 python3 -m pytest tests/unit/test_lamport_gemv.py -q -rs -k cuda 2>&1 | tail -3 | tee "$out/tests.log"
timeout 150 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -k "resident or wide_rows or qkv_rope" 2>&1 \
  | tail -3 | tee -a "$out/tests.log"
timeout 100 python3 -m pytest tests/gpu -q -rs -k "split and attention" 2>&1 | tail -3 | tee -a "$out/tests.log"; pack
echo "=== parity $(date +%T)"
# the parity model (Llama 3.2 1B shape) has other weight shapes: a table giving its o_proj the resident tiles at
# one row (both chains, so fp32 too), its qkv the new 17-row tiles
python3 - "$out/parity_table.json" <<'PY'
import json, sys
t = json.load(open("configs/gemv/sm90.json"))
res = {"block_n": 32, "block_k": 2048, "num_warps": 16, "num_stages": 1, "split_k": 1}
t["best"]["2048,2048,1"] = t["epilogue"]["2048,2048,1"] = res
t["best"]["3072,2048,17"] = {"block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 4, "split_k": 4}
json.dump(t, open(sys.argv[1], "w"), indent=1)
PY
for run in "bf16 1" "fp32 1" "bf16 8"; do set -- $run
  TPGRAPH_GEMV_TABLE=$out/parity_table.json timeout 150 torchrun --nproc-per-node 1 bench/hf_parity.py --dtype $1 \
    $([ $1 = bf16 ] && echo --embed-std 4.0) --copies $2 --out "$out/hf_parity_$1_x$2.json" 2>&1 \
    | grep -E "prompt|PASS|FAIL|identical=False|Error" | tail -4 | tee -a "$out/hf_parity.log"; done; pack
echo "=== ab $(date +%T)"
timeout 330 python3 bench/ab_decode.py --out "$out/ab" --nproc 1 --rounds 2 --variant new=. --variant old=ab/old \
  --variant rb=. --tiles rb=4096,2048,1=32x2048x16x1x1/4096,2048,2=32x128x4x5x1 -- --shape llama3-8b-half --modes full \
  --no-ladders --allreduce custom+gemv+overlap,custom+gemv+nopush+overlap --context 512 --steps 100 \
  --batches 1,2,4,8,16,24,32 2>&1 | grep -E "^\||left out|Error" | tee "$out/ab.log"; pack
echo "=== done $(date +%T)"
