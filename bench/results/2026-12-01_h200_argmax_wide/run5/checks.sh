#!/usr/bin/env bash
# run5 as it ran: `bash bench/results/2026-12-01_h200_argmax_wide/run5/checks.sh OUT`, ab/head holding d853d2d's package
# (python bench/ab_decode.py --prepare d853d2d ab/head; the last commit with TPGRAPH_GEMV_MAX_M=32): where the 32-row
# small-M tiles lost at batch 32 (run1: +0.019 ms a step), kernel by kernel: the batch-32 profile with 16-row tiles
# (cuBLAS above 16 rows) and with 32-row tiles, in one call
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }; rm -f $out/build.log
cp tpgraph/_C*.so ab/head/tpgraph/
for m in 16 32; do PYTHONPATH=$PWD/ab/head TPGRAPH_GEMV_MAX_M=$m timeout -k 5 120 torchrun --nproc-per-node 1 \
  bench/bench_decode.py --shape llama3-8b-half --modes full --batches 32 --no-ladders --allreduce custom+gemv+overlap \
  --profile --profile-batches 32 --steps 20 --out $out/profile_m$m.json 2>&1 \
  | grep -E "^profile|^  [a-z]|^ +[0-9]+ +[0-9.]+ +[0-9.]+ |kernels in order|^\|" | tee $out/profile_m$m.log; done
