#!/usr/bin/env bash
# run6 as it ran: `bash bench/results/2026-12-01_h200_wide_default/run6/checks.sh OUT` on one H200, with 17-32 rows
# through the small-M kernels by default: HF parity at TP=1 (bf16, fp32, bf16 at 24 rows a step), then the GPU tests
# of the engine, the argmax, the small-M kernels and the all-reduce epilogue (one rank)
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }; rm -f $out/build.log
export PYTHONPATH=$PWD
for dt in bf16 fp32; do timeout 100 torchrun --nproc-per-node 1 bench/hf_parity.py --dtype $dt \
  $([ $dt = bf16 ] && echo --embed-std 4.0) 2>&1 | grep -E "PASS|FAIL" | sed "s/^/$dt: /" | tee -a $out/hf_parity.log; done
timeout 100 torchrun --nproc-per-node 1 bench/hf_parity.py --embed-std 4.0 --copies 8 2>&1 | grep -E "PASS|FAIL" \
  | sed "s/^/bf16 x8: /" | tee -a $out/hf_parity.log
timeout 150 python3 -m pytest tests/gpu/test_engine_gpu.py tests/gpu/test_argmax_gpu.py -q -rs 2>&1 | tail -2 | tee $out/tests.log
timeout 200 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py tests/unit/test_lamport_gemv.py -q -rs \
  -k "gemv or gate_up or qkv_rope or wide or cuda" 2>&1 | tail -2 | tee -a $out/tests.log
