#!/usr/bin/env bash
# run6 as it ran: `bash bench/results/2026-12-01_h200_argmax_wide/run6/checks.sh OUT`, ab/head holding d853d2d's package
# and ab/bench_gemv_head.py its bench/bench_gemv.py (git show d853d2d:bench/bench_gemv.py): each projection of the
# llama3-8b-half shape alone at 16 and 32 rows, the small-M kernel (32-row tiles at 32, the M<=16 tile table) against
# cuBLAS, to see which projection lost in run5's profile
set -uo pipefail
out=$1; mkdir -p $out
PYTHONPATH=$PWD/ab/head:$PWD/bench TPGRAPH_GEMV_MAX_M=32 timeout 150 python3 ab/bench_gemv_head.py --ms 16,32 --out $out/gemv_m32.json 2>&1 \
  | grep -v "it/s\]\|s/it\]" | tail -30 | tee $out/gemv_m32.log
# run6b, two more calls: the config sweep at 32 rows for down, then qkv and o_proj, then gate_up (the M<=16 table's
# configs lost 2 us at down, M=32); their BEST entries are configs/gemv/sm90.json's entries from 17 rows (keyed at 17)
# for shapes in down qkv,o_proj gate_up; do PYTHONPATH=$PWD/ab/head:$PWD/bench TPGRAPH_GEMV_MAX_M=32 timeout 110 \
#   python3 ab/bench_gemv_head.py --sweep --sweep-ms 32 --shapes $shapes --out $out/sweep_${shapes/,/_}.json; done
