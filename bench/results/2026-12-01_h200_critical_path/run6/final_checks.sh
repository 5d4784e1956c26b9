#!/usr/bin/env bash
# run6 as it ran: `bash run6/final_checks.sh OUT`, ab_old/ holding the previous commit's package (git archive HEAD
# tpgraph): the unrolled merge and the long-sequence split rule (new) against that commit (old): the step at 512
# tokens (two rounds) and 4096 (one), each its own process; then the attention GPU tests and HF parity at TP=1
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }
cp tpgraph/_C*.so ab_old/tpgraph/
export TPGRAPH_CONFIG_DIR=$PWD/configs
for v in new old new old; do
  if [ $v = old ]; then pp=$PWD/ab_old; else pp=$PWD; fi
  PYTHONPATH=$pp timeout 80 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full \
    --batches 1,8,32 --no-ladders --allreduce custom+gemv+overlap --steps 100 --out $out/decode_$v.json 2>&1 \
    | grep -E "TPOT|Error" | sed "s/^.*\r//; s/^/$v /" | tee -a $out/ab.log
done
for v in new old; do
  if [ $v = old ]; then pp=$PWD/ab_old; else pp=$PWD; fi
  PYTHONPATH=$pp timeout 70 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full \
    --batches 1,8 --context 4096 --no-ladders --allreduce custom+gemv+overlap --steps 100 \
    --out $out/decode_4k_$v.json 2>&1 | grep -E "TPOT|Error" | sed "s/^.*\r//; s/^/$v ctx4096 /" | tee -a $out/ab.log
done
timeout 150 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -k "split_kv or decode_attention" 2>&1 | tail -2 | tee $out/attn_tests.log
for dt in bf16 fp32; do timeout 60 torchrun --nproc-per-node 1 bench/hf_parity.py --dtype $dt \
  $([ $dt = bf16 ] && echo --embed-std 4.0) 2>&1 | grep -E "PASS" | sed "s/^/$dt /" | tee -a $out/hf_parity.log; done
