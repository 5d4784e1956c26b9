#!/usr/bin/env bash
# run3 as it ran: `bash bench/results/2026-12-01_h200_wide_default/run3/checks.sh OUT` on one H200: decode attention
# alone by KV-cache block size (16 / 32 / 64 tokens) and block-table order (shuffled, in order), both cache layouts;
# then whole TP=1 steps at a TP=2 rank's shape with 16-, 32- and 64-token blocks, alternating processes, two rounds
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }; rm -f $out/build.log
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv > $out/gpu.txt
(cd bench && timeout 150 python3 bench_attention_layout.py --points 8x512,32x512,8x4096,32x4096 --block-sizes 16,32,64 \
  --tables shuffled,inorder --out $out/attn_blocks.json 2>&1 | grep "^attention" | tee $out/attn_blocks.log)
for round in 1 2; do for bs in 16 32 64; do timeout 100 torchrun --nproc-per-node 1 bench/bench_decode.py \
  --shape llama3-8b-half --modes full --batches 1,8,32 --no-ladders --allreduce custom+gemv+overlap --context 512 \
  --steps 100 --block-size $bs --out $out/decode_b${bs}_r$round.json 2>&1 | grep -E "TPOT" | sed "s/^.*\r//; s/^/block $bs round $round: /" \
  | tee -a $out/decode_blocks.log; done; done
rm -f $out/*.png
