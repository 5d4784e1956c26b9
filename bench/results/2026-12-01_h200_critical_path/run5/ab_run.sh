#!/usr/bin/env bash
# run5 as it ran: `bash run5/ab_run.sh OUT`, with an experiment knob in choose_num_splits (TPGRAPH_X_MAX_SPLITS=N capped
# the grid's splits at N instead of MAX_SPLITS; removed after): attention alone at caps 64 / 32 / 16
# (ab_attn/bench_splits.py), then the step at 4096 tokens, batch 1 and 8, each cap its own process
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }
export TPGRAPH_CONFIG_DIR=$PWD/configs
timeout 150 python3 ab_attn/bench_splits.py 64,32,16 $out/splits_ab.json 2>&1 | grep -v Warn | tail -5 | tee $out/splits_ab.log
for cap in 64 32 16; do
  TPGRAPH_X_MAX_SPLITS=$cap timeout 100 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half \
    --modes full --batches 1,8 --context 4096 --no-ladders --allreduce custom+gemv+overlap --steps 100 \
    --out $out/decode_4k_$cap.json 2>&1 | grep -E "TPOT|Error" | sed "s/^.*\r//; s/^/max_splits=$cap /" | tee -a $out/ab.log
done
