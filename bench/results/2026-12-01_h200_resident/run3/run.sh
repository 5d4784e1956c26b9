#!/usr/bin/env bash
# Session 16, call 3 (one H200, TP=1): o_proj's resident tiles in the plain chain too (the table's "best" entry, so
# TP>1's default path), against the previous commit (ab/prev: python bench/ab_decode.py --prepare HEAD ab/prev), and
# resident tiles at 2-4 rows (rl, the rows' loop); the GPU tests; the profile at batch 1 and 8. Usage: bash run.sh OUT
set -uo pipefail
dest=${1:?outdir}; mkdir -p "$dest"; out=$(mktemp -d /tmp/res.XXXX)
pack() { tar czf "$dest/results.tgz" -C "$out" . 2>/dev/null; }
exec > >(tee -a "$dest/summary.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
[ -n "${TPG_SKIP_BUILD:-}" ] || python3 -m pip install --no-build-isolation --no-deps -v -e . > "$out/build.log" 2>&1 \
  || { tail -40 "$out/build.log"; exit 1; }
echo "=== tests $(date +%T)"
timeout 150 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -k "resident or small_m_projection" 2>&1 \
  | tail -3 | tee "$out/tests.log"; pack
echo "=== ab $(date +%T)"
timeout 240 python3 bench/ab_decode.py --out "$out/ab" --nproc 1 --rounds 2 --variant new=. --variant prev=ab/prev \
  --variant rl=. --tiles rl=4096,2048,2=32x2048x16x1x1/4096,2048,5=32x128x4x5x1 -- --shape llama3-8b-half --modes full \
  --no-ladders --allreduce custom+gemv+overlap,custom+gemv+nopush+overlap --context 512 --steps 100 \
  --batches 1,2,4,8 2>&1 | grep -E "^\||left out|Error" | tee "$out/ab.log"; pack
echo "=== profile $(date +%T)"
timeout -k 5 120 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full --batches 1,8,32 \
  --no-ladders --allreduce custom+gemv+overlap --profile --profile-batches 1,8,32 --steps 20 --out "$out/profile.json" \
  2>&1 | grep -v "it/s\]\|tensor/s\]\|graph/s\]" | grep -E "profile,|mid-step|TPOT" | tee "$out/profile.log"; pack
echo "=== done $(date +%T)"
