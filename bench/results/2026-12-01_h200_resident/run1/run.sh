#!/usr/bin/env bash
# Session 16, call 1 (one H200, TP=1, llama3-8b-half, context 512): resident o_proj weights at batch 1, attention's
# two-tile splits from batch 4 (div9), and 17-32-row qkv / down tiles. Usage: bash run.sh OUT (from the repo root).
set -uo pipefail
dest=${1:?outdir}; mkdir -p "$dest"; out=$(mktemp -d /tmp/res.XXXX)
pack() { tar czf "$dest/results.tgz" -C "$out" . 2>/dev/null; }
exec > >(tee -a "$dest/summary.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
[ -n "${TPG_SKIP_BUILD:-}" ] || python3 -m pip install --no-build-isolation --no-deps -v -e . > "$out/build.log" 2>&1 \
  || { tail -40 "$out/build.log"; exit 1; }
args="--shape llama3-8b-half --modes full --no-ladders --allreduce custom+gemv+overlap --context 512 --steps 100"
echo "=== tests $(date +%T)"
timeout 240 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -k "resident or pdl_and_prefetch" 2>&1 | tail -4 \
  | tee "$out/resident_tests.log"
timeout 200 python3 -m pytest tests/unit/test_lamport_gemv.py -q -rs -k "cuda and phases" 2>&1 | tail -3 \
  | tee -a "$out/resident_tests.log"; pack
echo "=== ab resident $(date +%T)"
timeout 200 python3 bench/ab_decode.py --out "$out/ab_resident" --nproc 1 --rounds 2 --variant new=. --variant r32=. \
  --variant r16=. --tiles r32=epilogue:4096,2048,1=32x2048x16x1x1/epilogue:4096,2048,2=32x128x4x5x1 \
  --tiles r16=epilogue:4096,2048,1=16x2048x8x1x1/epilogue:4096,2048,2=32x128x4x5x1 \
  -- $args --batches 1,2,8 2>&1 | grep -E "^\||left out|Error" | tee "$out/ab_resident.log"; pack
echo "=== ab div9 $(date +%T)"
timeout 150 python3 bench/ab_decode.py --out "$out/ab_div9" --nproc 1 --rounds 2 --variant new=. --variant div9=ab/div9 \
  -- $args --batches 3,4,5 2>&1 | grep -E "^\||left out|Error" | tee "$out/ab_div9.log"; pack
echo "=== ab wide tiles $(date +%T)"
timeout 230 python3 bench/ab_decode.py --out "$out/ab_wide" --nproc 1 --rounds 2 --variant new=. --variant q2=. \
  --variant q4=. --variant d2=. --tiles q2=3072,4096,17=32x256x4x3x2 --tiles q4=3072,4096,17=32x128x4x4x4 \
  --tiles d2=4096,7168,17=32x256x4x3x2 -- $args --batches 24,32 2>&1 | grep -E "^\||left out|Error" \
  | tee "$out/ab_wide.log"; pack
echo "=== profile r32 $(date +%T)"
TPGRAPH_GEMV_TABLE=$out/ab_resident/tables/r32.json timeout -k 5 100 torchrun --nproc-per-node 1 bench/bench_decode.py \
  --shape llama3-8b-half --modes full --batches 1 --no-ladders --allreduce custom+gemv+overlap --profile \
  --profile-batches 1 --steps 20 --out "$out/profile_r32.json" 2>&1 | grep -v "it/s\]\|tensor/s\]\|graph/s\]" \
  | tail -12 | tee "$out/profile_r32.log"; pack
echo "=== done $(date +%T)"
