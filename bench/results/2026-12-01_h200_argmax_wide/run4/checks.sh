#!/usr/bin/env bash
# run4 as it ran: `bash bench/results/2026-12-01_h200_argmax_wide/run4/checks.sh OUT`, ab/head holding the previous
# commit's package (python bench/ab_decode.py --prepare HEAD ab/head): the fused argmax on by default and the losing
# variants deleted (one-pass merge, split-tiles override, 32-row small-M tiles), against the previous commit; HF parity
# TP=1 (bf16, fp32, bf16 at 24 rows a step), the GPU tests of the argmax, the engine and the small-M kernels; then the
# profile of the default path at batches 1, 8 and 32 (last: CUPTI slows every later launch)
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }; rm -f $out/build.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $out/gpu.txt
for dt in bf16 fp32; do timeout 100 torchrun --nproc-per-node 1 bench/hf_parity.py --dtype $dt \
  $([ $dt = bf16 ] && echo --embed-std 4.0) 2>&1 | grep -E "PASS|FAIL" | tee -a $out/hf_parity.log; done
timeout 100 torchrun --nproc-per-node 1 bench/hf_parity.py --embed-std 4.0 --copies 8 2>&1 | grep -E "PASS|FAIL" \
  | tee -a $out/hf_parity.log
timeout 240 python3 bench/ab_decode.py --out $out/ab512 --nproc 1 --rounds 2 --variant head=ab/head --variant new=. -- \
  --shape llama3-8b-half --modes full --batches 1,8,32 --no-ladders --allreduce custom+gemv+overlap --context 512 \
  --steps 100 2>&1 | grep -E "^\||left out|Error" | tee $out/ab512.log
timeout 150 python3 -m pytest tests/gpu/test_argmax_gpu.py tests/gpu/test_engine_gpu.py -q -rs 2>&1 | tail -2 | tee $out/tests.log
timeout 200 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -k "gemv or gate_up or qkv_rope" 2>&1 | tail -2 \
  | tee -a $out/tests.log
timeout -k 5 150 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full --batches 1 \
  --no-ladders --allreduce custom+gemv+overlap --profile --profile-batches 1,8,32 --steps 20 --out $out/profile.json 2>&1 \
  | grep -E "^profile|^  [a-z]|kernels in order" | tee $out/profile.log
rm -f $out/ab*/*.png; tar czf $out/results.tgz -C $out ab512 profile.json profile.png; rm -rf $out/ab512
