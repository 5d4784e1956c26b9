#!/usr/bin/env bash
# run3 as it ran: `bash bench/results/2026-12-01_h200_newest_apart/run3/checks.sh OUT`, ab/head holding the previous
# commit's package (python bench/ab_decode.py --prepare HEAD ab/head): the attention grid rounded down to 3 programs
# an SM (this tree, "floor") against the rounded-up one (head), alone and with the newest row apart / the early
# rope inputs, at context 512 (batches 1, 2, 4, 8) and 4096 (1, 8)
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }; rm -f $out/build.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $out/gpu.txt
apart=TPGRAPH_ATTN_NEWEST_APART=1 rope=TPGRAPH_QKV_ROPE_EARLY=1
ab() { ctx=$1 batches=$2; shift 2
  timeout 400 python3 bench/ab_decode.py --out $out/ab$ctx --nproc 1 --rounds 2 "$@" -- --shape llama3-8b-half \
    --modes full --batches $batches --no-ladders --allreduce custom+gemv+overlap --context $ctx --steps 100 2>&1 \
    | grep -E "^\||left out|Error" | tee $out/ab$ctx.log; }
ab 512 1,2,4,8 --variant head=ab/head --variant floor=. --variant fapart=.:$apart --variant frope=.:$rope \
  --variant fboth=.:$apart,$rope
ab 4096 1,8 --variant head=ab/head --variant floor=. --variant fboth=.:$apart,$rope
rm -f $out/ab*/*.png; tar czf $out/results.tgz -C $out ab512 ab4096; rm -rf $out/ab512 $out/ab4096
