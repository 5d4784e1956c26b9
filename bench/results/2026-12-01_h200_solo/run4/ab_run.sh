#!/usr/bin/env bash
# run4 as it ran (commit bfec95c, whose experiment knobs were then removed: TPGRAPH_X_STAGED_PDL=0 launched the
# staged consumers without PDL; TPGRAPH_X_LATE_TRIGGER=1 is what TPGRAPH_GEMV_AR_LATE_TRIGGER=1 does now): the fused
# epilogue at TP=1 (push) against the plain chain (nopush), each setting its own process, entries interleaved
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }
for v in "X=0" "TPGRAPH_X_STAGED_PDL=0" "TPGRAPH_X_LATE_TRIGGER=1" "TPGRAPH_X_STAGED_PDL=0 TPGRAPH_X_LATE_TRIGGER=1"; do
  env $v timeout 150 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full --batches 1,8 \
    --no-ladders --allreduce custom+gemv+nopush+overlap,custom+gemv+push+overlap \
    --interleave --steps 100 --out $out/decode_ab.json 2>&1 | grep -E "TPOT|Error" | sed "s/^.*\r//; s/^/$v /" | tee -a $out/bench_ab.log
done
