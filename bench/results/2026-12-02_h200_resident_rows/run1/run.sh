#!/usr/bin/env bash
# Session 17, call 1 (one H200, TP=1): o_proj's resident tiles at 2-16 rows, as a batched tensor-core dot over K
# slices (rt), against the shipped table (new: resident at one row only); then the resident GPU tests (one, three and
# sixteen rows; gate_up on resident tiles). Usage: bash run.sh OUT
set -uo pipefail
dest=${1:?outdir}; mkdir -p "$dest"; out=$(mktemp -d /tmp/res.XXXX)
pack() { tar czf "$dest/results.tgz" -C "$out" . 2>/dev/null; }
exec > >(tee -a "$dest/summary.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
[ -n "${TPG_SKIP_BUILD:-}" ] || python3 -m pip install --no-build-isolation --no-deps -v -e . > "$out/build.log" 2>&1 \
  || { tail -40 "$out/build.log"; exit 1; }
echo "=== ab $(date +%T)"
rt=4096,2048,2=32x2048x16x1x1x1/4096,2048,8=32x2048x16x1x1x1
timeout 330 python3 bench/ab_decode.py --out "$out/ab" --nproc 1 --rounds 2 --variant new=. --variant rt=. \
  --tiles rt=$rt -- --shape llama3-8b-half --modes full --no-ladders \
  --allreduce custom+gemv+overlap,custom+gemv+nopush+overlap --context 512 --steps 100 --batches 1,2,4,8,16 2>&1 \
  | grep -E "^\||left out|Error" | tee "$out/ab.log"; pack
echo "=== tests $(date +%T)"
timeout 200 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -k "resident" 2>&1 | tail -3 \
  | tee "$out/tests.log"; pack
echo "=== done $(date +%T)"
