#!/usr/bin/env bash
# run8 as it ran: `bash bench/results/2026-12-01_h200_early_residual/run8/final_checks.sh OUT`, ab/head holding the
# previous commit's package and tables (python bench/ab_decode.py --prepare 7d42d33 ab/head): the kept changes (the
# epilogue on by default at TP=1, down's tiles, the early residual): their GPU tests, HF parity TP=1 on the default
# path, then the step against the previous commit (its default and this tree's plain chain beside it)
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }; rm -f $out/build.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $out/gpu.txt
timeout 100 python3 -m pytest tests/unit/test_lamport_gemv.py tests/unit/test_gemv_kernel.py -q -rs -k cuda 2>&1 \
  | tail -2 | tee $out/tests.log
timeout 200 python3 -m pytest tests/gpu/test_engine_gpu.py tests/gpu/test_buffers_gpu.py -q -rs 2>&1 \
  | grep -v "it/s\]\|tensor/s\]\|graph/s\]" | tail -2 | tee -a $out/tests.log
for dt in bf16 fp32; do timeout 100 torchrun --nproc-per-node 1 bench/hf_parity.py --dtype $dt \
  $([ $dt = bf16 ] && echo --embed-std 4.0) 2>&1 | grep -E "PASS|FAIL" | sed "s/^/$dt /" | tee -a $out/hf_parity.log; done
AB_VARIANTS="--variant new=. --variant head=ab/head" AB_ENTRY=custom+gemv+overlap,custom+gemv+nopush+overlap \
  NPROC=1 SHAPE=llama3-8b-half TPG_SKIP_BUILD=1 bash bench/gpu_graph_checks.sh $out ab
