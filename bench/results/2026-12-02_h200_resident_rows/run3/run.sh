#!/usr/bin/env bash
# Session 17, call 3 (one H200, TP=1): the shipped table's new o_proj entries at 8-16 rows (best 64x128x4 split-K 2,
# epilogue 32x128x5 split-K 2) against the previous commit (ab/head: python bench/ab_decode.py --prepare HEAD ab/head);
# the GPU tests of the small-M paths; HF parity at TP=1 with the parity model's o_proj in those tiles at 8+ rows.
# Usage: bash run.sh OUT
set -uo pipefail
dest=${1:?outdir}; mkdir -p "$dest"; out=$(mktemp -d /tmp/res.XXXX)
pack() { tar czf "$dest/results.tgz" -C "$out" . 2>/dev/null; }
exec > >(tee -a "$dest/summary.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
[ -n "${TPG_SKIP_BUILD:-}" ] || python3 -m pip install --no-build-isolation --no-deps -v -e . > "$out/build.log" 2>&1 \
  || { tail -40 "$out/build.log"; exit 1; }
echo "=== ab $(date +%T)"
timeout 300 python3 bench/ab_decode.py --out "$out/ab" --nproc 1 --rounds 2 --variant new=. --variant head=ab/head \
  -- --shape llama3-8b-half --modes full --no-ladders --allreduce custom+gemv+overlap,custom+gemv+nopush+overlap \
  --context 512 --steps 100 --batches 1,2,4,8,12,16 2>&1 | grep -E "^\||left out|Error" | tee "$out/ab.log"; pack
echo "=== parity $(date +%T)"
# the parity model (Llama 3.2 1B shape) has other weight shapes: its o_proj gets the new tiles at 8+ rows
python3 - "$out/parity_table.json" <<'PY'
import json, sys
t = json.load(open("configs/gemv/sm90.json"))
t["best"]["2048,2048,8"] = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "split_k": 2}
t["epilogue"]["2048,2048,8"] = {"block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 5, "split_k": 2}
json.dump(t, open(sys.argv[1], "w"), indent=1)
PY
for run in "bf16 4" "fp32 4"; do set -- $run
  TPGRAPH_GEMV_TABLE=$out/parity_table.json timeout 120 torchrun --nproc-per-node 1 bench/hf_parity.py --dtype $1 \
    $([ $1 = bf16 ] && echo --embed-std 4.0) --copies $2 --out "$out/hf_parity_$1_x$2.json" 2>&1 \
    | grep -E "prompt|PASS|FAIL|identical=False|Error" | tail -4 | tee -a "$out/hf_parity.log"; done; pack
echo "=== tests $(date +%T)"
timeout 150 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -x -k "split or epilogue or small_m or resident" \
  2>&1 | tail -3 | tee "$out/tests.log"; pack
echo "=== done $(date +%T)"
