#!/usr/bin/env bash
# run4 as it ran: `bash run4/ab_run.sh OUT`, ab_old/ holding the previous commit's package (git archive HEAD tpgraph),
# ab_attn/ its decode_attention.py (da_head.py), this tree's (da_unroll.py) and run2's bench.py: the merge walking the
# splits eight a load, unrolled, against the loop; the attention GPU tests, the kernel alone, then the step at 512
# tokens (two rounds) and at 4096 (one)
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }
cp tpgraph/_C*.so ab_old/tpgraph/
export TPGRAPH_CONFIG_DIR=$PWD/configs
timeout 120 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -k "split_kv or decode_attention" 2>&1 | tail -2 | tee $out/attn_tests.log
timeout 150 python3 ab_attn/bench.py head,unroll $out/attn_ab.json 2>&1 | grep -v Warn | tail -8 | tee $out/attn_ab.log
for v in new old new old; do
  if [ $v = old ]; then pp=$PWD/ab_old; else pp=$PWD; fi
  PYTHONPATH=$pp timeout 100 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full \
    --batches 1,8,32 --no-ladders --allreduce custom+gemv+overlap --steps 100 --out $out/decode_$v.json 2>&1 \
    | grep -E "TPOT|Error" | sed "s/^.*\r//; s/^/$v /" | tee -a $out/ab.log
done
for v in new old; do
  if [ $v = old ]; then pp=$PWD/ab_old; else pp=$PWD; fi
  PYTHONPATH=$pp timeout 100 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full \
    --batches 1,8 --context 4096 --no-ladders --allreduce custom+gemv+overlap --steps 100 \
    --out $out/decode_4k_$v.json 2>&1 | grep -E "TPOT|Error" | sed "s/^.*\r//; s/^/$v ctx4096 /" | tee -a $out/ab.log
done
