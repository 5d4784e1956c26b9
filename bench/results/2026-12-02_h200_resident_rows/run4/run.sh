#!/usr/bin/env bash
# Session 17, call 4 (one H200, TP=1): the other projections' 8-16-row tiles by whole steps (the table's came from
# timing each kernel alone): down split-K 4 (d4), qkv split-K 2 / 8 (q2, q8), gate_up 32-wide (g32) or 4 stages
# (g4); then the GPU tests of the last-split reduction. Usage: bash run.sh OUT
set -uo pipefail
dest=${1:?outdir}; mkdir -p "$dest"; out=$(mktemp -d /tmp/res.XXXX)
pack() { tar czf "$dest/results.tgz" -C "$out" . 2>/dev/null; }
exec > >(tee -a "$dest/summary.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
[ -n "${TPG_SKIP_BUILD:-}" ] || python3 -m pip install --no-build-isolation --no-deps -v -e . > "$out/build.log" 2>&1 \
  || { tail -40 "$out/build.log"; exit 1; }
echo "=== ab $(date +%T)"
timeout 330 python3 bench/ab_decode.py --out "$out/ab" --nproc 1 --rounds 2 --variant new=. \
  --variant d4=. --tiles d4=4096,7168,8=32x128x4x4x4 --variant q2=. --tiles q2=3072,4096,8=32x128x4x3x2 \
  --variant q8=. --tiles q8=3072,4096,8=32x128x4x3x8 --variant g32=. --tiles g32=14336,4096,8=32x128x4x3x1 \
  --variant g4=. --tiles g4=14336,4096,8=64x128x4x4x1 -- --shape llama3-8b-half --modes full --no-ladders \
  --allreduce custom+gemv+overlap,custom+gemv+nopush+overlap --context 512 --steps 100 --batches 8,16 2>&1 \
  | grep -E "^\||left out|Error" | tee "$out/ab.log"; pack
echo "=== tests $(date +%T)"
timeout 90 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -k "last_split" 2>&1 | tail -3 \
  | tee "$out/tests.log"; pack
echo "=== done $(date +%T)"
