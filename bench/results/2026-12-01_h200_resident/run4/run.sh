#!/usr/bin/env bash
# Session 16, call 4 (one H200): the GPU tests the session's changes touch, on the final tree (resident tiles,
# two-tile attention splits from batch 4, qkv at 17-32 rows): fused kernels, graph decode, engine. Usage: bash run.sh OUT
set -uo pipefail
dest=${1:?outdir}; mkdir -p "$dest"
exec > >(tee -a "$dest/summary.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
[ -n "${TPG_SKIP_BUILD:-}" ] || python3 -m pip install --no-build-isolation --no-deps -v -e . > /dev/null 2>&1 \
  || { echo "build failed"; exit 1; }
for f in test_fused_kernels_gpu test_graph_decode_gpu test_engine_gpu; do
  echo "=== $f $(date +%T)"
  timeout 200 python3 -m pytest tests/gpu/$f.py -q -rs -x 2>&1 | tail -4
done
echo "=== done $(date +%T)"
