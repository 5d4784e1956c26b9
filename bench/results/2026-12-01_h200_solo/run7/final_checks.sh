#!/usr/bin/env bash
# run7 as it ran (commit a336c01): `bash run7/final_checks.sh OUT`
# the session's last device call: the GPU tests of what changed since the measured runs
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }
timeout 150 python3 -m pytest tests/unit/test_lamport_gemv.py -q -rs -k "cuda or never_pushes" 2>&1 | tail -3 | tee $out/lamport_tests.log
timeout 200 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -k "small_m or qkv_rope or split_kv or decode_attention" 2>&1 | tail -3 | tee $out/kernel_tests.log
timeout 100 python3 -m pytest tests/gpu/test_engine_gpu.py -q -rs 2>&1 | tail -2 | tee $out/engine_tests.log
