#!/usr/bin/env bash
# run5 as it ran (commit 2fb5d31 plus an uncommitted knob in choose_num_splits: TPGRAPH_X_ATTN_PPS replaced PROGRAMS_PER_SM)
# one-off A/B (deleted after the run): decode attention's programs per SM (the split count of its grid)
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }
for pps in 3 1.5 1 3 1.5; do
  TPGRAPH_X_ATTN_PPS=$pps timeout 110 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full \
    --batches 1,8,32 --no-ladders --allreduce custom+gemv+overlap --steps 100 --out $out/decode_pps$pps.json 2>&1 \
    | grep -E "TPOT|Error" | sed "s/^.*\r//; s/^/pps=$pps /" | tee -a $out/attn_ab.log
done
