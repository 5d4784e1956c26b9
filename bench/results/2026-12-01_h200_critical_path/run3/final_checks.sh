#!/usr/bin/env bash
# run3 as it ran: `bash run3/final_checks.sh OUT`, ab_old/ holding the previous commit's package (git archive HEAD
# tpgraph): the GPU tests of the changed kernels, HF parity at TP=1, the engine GPU tests, then the decode step with
# the kept changes (new) against the previous commit (old), each its own process, two rounds, and the new profile
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }
cp tpgraph/_C*.so ab_old/tpgraph/
export TPGRAPH_CONFIG_DIR=$PWD/configs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $out/gpu.txt 2>&1
timeout 200 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -k "small_m or qkv_rope or split_kv or decode_attention" 2>&1 | tail -3 | tee $out/kernel_tests.log
for dt in bf16 fp32; do timeout 150 torchrun --nproc-per-node 1 bench/hf_parity.py --dtype $dt \
  $([ $dt = bf16 ] && echo --embed-std 4.0) 2>&1 | grep -E "PASS" | sed "s/^/$dt /" | tee -a $out/hf_parity.log; done
timeout 120 python3 -m pytest tests/gpu/test_engine_gpu.py -q -rs 2>&1 | tail -2 | tee $out/engine_tests.log
for v in new old new old; do
  if [ $v = old ]; then pp=$PWD/ab_old; else pp=$PWD; fi
  PYTHONPATH=$pp timeout 100 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full \
    --batches 1,8,32 --no-ladders --allreduce custom+gemv+overlap --steps 100 --out $out/decode_$v.json 2>&1 \
    | grep -E "TPOT|Error" | sed "s/^.*\r//; s/^/$v /" | tee -a $out/ab.log
done
timeout -k 5 100 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full --batches 1,8 \
  --no-ladders --allreduce custom+gemv --profile --steps 20 --out $out/profile.json 2>&1 \
  | grep -v "it/s\]\|tensor/s\]\|graph/s\]" | tail -40 > $out/profile.log
tar czf $out/../results.tgz -C $out .
