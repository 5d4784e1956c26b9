#!/usr/bin/env bash
# Session 17, call 5 (one H200): the final tree's GPU tests: the fused all-reduce epilogue across phases on the GPU
# (emulated ranks 1-3; split-K, resident one-row and several-row tiles in its rotation), the engine, the last-split
# reduction. Usage: bash run.sh OUT
set -uo pipefail
dest=${1:?outdir}; mkdir -p "$dest"; out=$(mktemp -d /tmp/res.XXXX)
pack() { tar czf "$dest/results.tgz" -C "$out" . 2>/dev/null; }
exec > >(tee -a "$dest/summary.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
[ -n "${TPG_SKIP_BUILD:-}" ] || python3 -m pip install --no-build-isolation --no-deps -v -e . > "$out/build.log" 2>&1 \
  || { tail -40 "$out/build.log"; exit 1; }
echo "=== epilogue $(date +%T)"
timeout 100 python3 -m pytest tests/unit/test_lamport_gemv.py -q -rs -m gpu -k "across_phases" 2>&1 | tail -3 \
  | tee "$out/tests.log"; pack
echo "=== engine $(date +%T)"
timeout 60 python3 -m pytest tests/gpu/test_engine_gpu.py -q -rs 2>&1 | tail -3 | tee -a "$out/tests.log"; pack
echo "=== last split $(date +%T)"
timeout 70 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -k "last_split" 2>&1 | tail -3 \
  | tee -a "$out/tests.log"; pack
echo "=== done $(date +%T)"
