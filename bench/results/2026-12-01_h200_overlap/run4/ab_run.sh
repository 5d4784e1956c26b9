#!/usr/bin/env bash
# one-off A/B of decode attention kernels at max_model_len 8192 (and old at the bench's small default): old (HEAD),
# v1 (dynamic splits, first tile before the PDL wait), v2 (v1 + next tile's loads issued before the current tile's math),
# v3 (v2, num_stages 1), v4 (v2, num_stages 1, 8 warps)
out=$1
tmp=$(mktemp -d)
cp tpgraph/kernels/decode_attention.py "$tmp/attn_cur.py"
for v in v3 v4; do cp ab/decode_attention_$v.py tpgraph/kernels/decode_attention.py; echo "tests with $v"
  timeout 200 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -x -k "decode or attention or paged" 2>&1 | tail -2; done
for round in 1 2; do
  for which in old v1 v2 v3 v4 old0; do
    mml=8192; f=$which; [ $which = old0 ] && { mml=0; f=old; }
    cp ab/decode_attention_$f.py tpgraph/kernels/decode_attention.py
    extra=""; [ $mml = 0 ] || extra="--max-model-len $mml"
    timeout 200 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full --batches 1,8,32 \
      --no-ladders --allreduce custom+gemv+overlap --interleave --steps 60 $extra --out "$tmp/ab.json" 2>&1 \
      | tr '\r' '\n' | grep -E "TPOT|Error" | sed "s/^/r$round $which /"
  done
done
cp "$tmp/attn_cur.py" tpgraph/kernels/decode_attention.py
