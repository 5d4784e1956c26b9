#!/usr/bin/env bash
# run2 as it ran: `bash run2/ab_run.sh OUT`. ab_old/ holds the previous commit's package (git archive); ab_s1-3 this
# tree's package with one decode_attention.py swapped in: s1 the previous one (so only the qkv change), s2 only the
# newest-row change, s3 only the merge change; ab_attn/ the four attention files and the kernel A/B (bench.py).
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }
for d in ab_old ab_s1 ab_s2 ab_s3; do cp tpgraph/_C*.so $d/tpgraph/; done
export TPGRAPH_CONFIG_DIR=$PWD/configs
timeout 200 python3 ab_attn/bench.py old,new,row,comb $out/attn_ab.json 2>&1 | grep -v Warn | tail -8 | tee $out/attn_ab.log
for v in old new s1 s2 s3 old new; do
  case $v in new) pp=$PWD ;; old) pp=$PWD/ab_old ;; *) pp=$PWD/ab_$v ;; esac
  PYTHONPATH=$pp timeout 100 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full \
    --batches 1,8,32 --no-ladders --allreduce custom+gemv+overlap --steps 100 --out $out/decode_$v.json 2>&1 \
    | grep -E "TPOT|Error" | sed "s/^.*\r//; s/^/$v /" | tee -a $out/ab.log
done
