#!/usr/bin/env bash
# run2 as it ran: `bash bench/results/2026-12-01_h200_newest_apart/run2/checks.sh OUT`: the newest row apart and the
# early rope inputs (both) against the default, at context 512 (batches 1, 2, 4, 8) with two tile variants on top,
# and at context 4096; then the GPU tests of both settings' kernels
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }; rm -f $out/build.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $out/gpu.txt
both=TPGRAPH_ATTN_NEWEST_APART=1,TPGRAPH_QKV_ROPE_EARLY=1
ab() { ctx=$1 batches=$2; shift 2
  timeout 400 python3 bench/ab_decode.py --out $out/ab$ctx --nproc 1 --rounds 2 "$@" -- --shape llama3-8b-half \
    --modes full --batches $batches --no-ladders --allreduce custom+gemv+overlap --context $ctx --steps 100 2>&1 \
    | grep -E "^\||left out|Error" | tee $out/ab$ctx.log; }
ab 512 1,2,4,8 --variant new=. --variant both=.:$both --variant bq16=.:$both --variant bo16=.:$both \
  --tiles bq16=3072,4096,1=16x128x4x3x4 --tiles bo16=epilogue:4096,2048,1=16x256x4x4x1
ab 4096 1,8 --variant new=. --variant both=.:$both
timeout 300 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -k "qkv_rope or (matches_reference and True)" \
  2>&1 | tail -3 | tee $out/tests.log
rm -rf $out/ab512/tables
