#!/usr/bin/env bash
# run3 as it ran (working tree of commit 94f598f): the layer micro-bench, then the fused epilogue at TP=1 with and
# without PDL, interleaved in one process
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }
timeout 200 python3 bench/bench_lamport.py --out $out/lamport.json 2>&1 | tail -8 | tee $out/lamport_bench.log
timeout 330 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full --batches 1,8 \
  --no-ladders --allreduce custom+gemv+nopush+overlap,custom+gemv+push+overlap,custom+gemv+nopush+nopdl+overlap,custom+gemv+push+nopdl+overlap \
  --interleave --steps 100 --out $out/decode_solo_pdl.json 2>&1 | grep -E "TPOT|Error" | sed "s/^.*\r//" | tee $out/bench_solo_pdl.log
