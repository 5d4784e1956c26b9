#!/usr/bin/env bash
# Session 17, call 2 (one H200, TP=1): o_proj's tiles at 2-16 rows chosen by whole steps (the table's 32x128x5 came
# from timing the kernel alone): split-K 2 (o2), 32x256x3 (o3), 16-wide (o16), 64x128x4 split-K 2 (o64); and the
# epilogue chain's producers letting the next kernel in only at exit (late). Usage: bash run.sh OUT
set -uo pipefail
dest=${1:?outdir}; mkdir -p "$dest"; out=$(mktemp -d /tmp/res.XXXX)
pack() { tar czf "$dest/results.tgz" -C "$out" . 2>/dev/null; }
exec > >(tee -a "$dest/summary.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
[ -n "${TPG_SKIP_BUILD:-}" ] || python3 -m pip install --no-build-isolation --no-deps -v -e . > "$out/build.log" 2>&1 \
  || { tail -40 "$out/build.log"; exit 1; }
echo "=== ab $(date +%T)"
o() { echo "4096,2048,2=$1/4096,2048,8=$1"; }
timeout 560 python3 bench/ab_decode.py --out "$out/ab" --nproc 1 --rounds 2 --variant new=. \
  --variant o2=. --tiles o2=$(o 32x128x4x5x2) --variant o3=. --tiles o3=$(o 32x256x4x3x1) \
  --variant o16=. --tiles o16=$(o 16x128x4x5x1) --variant o64=. --tiles o64=$(o 64x128x4x4x2) \
  --variant late=.:TPGRAPH_GEMV_AR_LATE_TRIGGER=1 -- --shape llama3-8b-half --modes full --no-ladders \
  --allreduce custom+gemv+overlap,custom+gemv+nopush+overlap --context 512 --steps 100 --batches 2,8,16 2>&1 \
  | grep -E "^\||left out|Error" | tee "$out/ab.log"; pack
echo "=== done $(date +%T)"
