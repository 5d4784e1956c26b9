#!/usr/bin/env bash
# run4 as it ran: `bash bench/results/2026-12-01_h200_newest_apart/run4/checks.sh OUT`, ab/head holding the previous
# commit's package (python bench/ab_decode.py --prepare HEAD ab/head): the new defaults (the attention grid rounded
# down, the newest row apart from batch 2, the early rope inputs) against the previous commit; HF parity TP=1 bf16 and
# the engine's GPU tests on them
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }; rm -f $out/build.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $out/gpu.txt
timeout 100 torchrun --nproc-per-node 1 bench/hf_parity.py --dtype bf16 --embed-std 4.0 2>&1 | grep -E "PASS|FAIL" \
  | tee $out/hf_parity.log
ab() { ctx=$1 batches=$2; shift 2
  timeout 200 python3 bench/ab_decode.py --out $out/ab$ctx --nproc 1 --rounds 2 "$@" -- --shape llama3-8b-half \
    --modes full --batches $batches --no-ladders --allreduce custom+gemv+overlap --context $ctx --steps 100 2>&1 \
    | grep -E "^\||left out|Error" | tee $out/ab$ctx.log; }
ab 512 1,2,8 --variant head=ab/head --variant new=.
ab 4096 1,8 --variant head=ab/head --variant new=.
timeout 150 python3 -m pytest tests/gpu/test_engine_gpu.py -q -rs 2>&1 | tail -2 | tee $out/tests.log
rm -f $out/ab*/*.png; tar czf $out/results.tgz -C $out ab512 ab4096; rm -rf $out/ab512 $out/ab4096
