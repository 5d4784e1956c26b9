#!/usr/bin/env bash
# run2 as it ran: `bash bench/results/2026-12-01_h200_early_residual/run2/checks.sh OUT`, with ab/head (7d42d33, the
# previous commit) and ab/before-norm (e4cfda6, before the norm kernel's early weight load) made by
# `python bench/ab_decode.py --prepare REV DIR`: the fused-epilogue GPU tests, HF parity TP=1 with the epilogue on,
# then the step (plain chain and fused epilogue) of this tree against both, alternating processes
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }; rm -f $out/build.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $out/gpu.txt
timeout 200 python3 -m pytest tests/unit/test_lamport_gemv.py -q -rs -k cuda 2>&1 | tail -3 | tee $out/epilogue_tests.log
for dt in bf16 fp32; do TPGRAPH_GEMV_ALLREDUCE=1 timeout 100 torchrun --nproc-per-node 1 bench/hf_parity.py --dtype $dt \
  $([ $dt = bf16 ] && echo --embed-std 4.0) 2>&1 | grep -E "PASS|FAIL" | sed "s/^/$dt /" | tee -a $out/hf_parity_epilogue.log; done
AB_VARIANTS="--variant new=. --variant head=ab/head --variant before_norm=ab/before-norm" \
  AB_ENTRY=custom+gemv+overlap,custom+gemv+push+overlap NPROC=1 SHAPE=llama3-8b-half \
  TPG_SKIP_BUILD=1 bash bench/gpu_graph_checks.sh $out ab
