#!/usr/bin/env bash
# run6 as it ran (commit 5e6b417 plus an uncommitted knob in min_split_tiles: TPGRAPH_X_SPLIT_TILES=N returned N):
# decode attention's fewest tiles per split, the rule (min_split_tiles) against one tile always (the previous
# kernel), each its own process, two rounds; the attention GPU tests and HF parity first
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }
timeout 200 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -k "split_kv or decode_attention" 2>&1 | tail -3 | tee $out/attn_tests.log
for dt in bf16 fp32; do timeout 150 torchrun --nproc-per-node 1 bench/hf_parity.py --dtype $dt \
  $([ $dt = bf16 ] && echo --embed-std 4.0) 2>&1 | grep -E "PASS" | sed "s/^/$dt /" | tee -a $out/hf_parity.log; done
for v in rule 1 rule 1; do
  if [ $v = rule ]; then unset TPGRAPH_X_SPLIT_TILES; else export TPGRAPH_X_SPLIT_TILES=$v; fi
  timeout 110 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full \
    --batches 1,8,32 --no-ladders --allreduce custom+gemv+overlap --steps 100 --out $out/decode_tiles_$v.json 2>&1 \
    | grep -E "TPOT|Error" | sed "s/^.*\r//; s/^/split_tiles=$v /" | tee -a $out/attn_ab.log
done
