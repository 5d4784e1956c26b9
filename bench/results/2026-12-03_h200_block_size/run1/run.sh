#!/usr/bin/env bash
# session 28, run1: the KV cache's block size (16 / 32 / 64 tokens) for decode attention, alone and in whole steps
# usage (on the device, repository root): bash bench/results/2026-12-03_h200_block_size/run1/run.sh OUTDIR
set -uo pipefail
dest=${1:?outdir}; mkdir -p "$dest"
out=$(mktemp -d)  # packed into dest/results.tgz at the end (a call brings back few files)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
python3 -m pip install --no-build-isolation --no-deps -v -e . > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
echo "=== attention alone $(date +%T)"
(cd bench && timeout 150 python3 bench_attention_layout.py --block-sizes 16,32,64 \
    --points 1x512,8x512,32x512,1x4096,8x4096,32x4096 --out "$out/attn_layout.json" 2>&1 | grep -v "it/s\]" \
    | tail -40 | tee "$out/attn_layout.log")
for ctx in 512 4096; do
  echo "=== whole steps, context $ctx $(date +%T)"
  timeout 200 python3 bench/ab_decode.py --out "$out/ab_$ctx" --nproc 1 --rounds 2 --variant b16=. \
      --variant b32=. --args b32="--block-size 32" --variant b64=. --args b64="--block-size 64" \
      -- --shape llama3-8b-half --modes full --batches 1,8,32 --no-ladders --allreduce custom+gemv+overlap \
      --context $ctx --steps 100 2>&1 | grep -E "^==|^\||left out|Error" | tee "$out/ab_$ctx.log"
done
tar czf "$dest/results.tgz" -C "$out" --exclude build.log . 2>/dev/null
echo "=== done $(date +%T)"
