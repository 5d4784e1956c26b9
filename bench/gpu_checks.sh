#!/usr/bin/env bash
# One device session's worth of GPU checks (build, GPU tests, HF parity, generate). Logs go to $1.
set -uo pipefail
# any check that fails (any part of a pipeline: pipefail) is named here and makes the script exit 1 at the end
status=0
trap 'code=$?; status=1; echo "FAILED (exit $code): line $LINENO" >&2' ERR
out=${1:-bench/results/gpu_checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } 2>&1 | tee "$out/gpu.txt"
python3 -m pip install --no-build-isolation --no-deps -v -e . > "$out/build.log" 2>&1; { grep -E "NVCC|LINK|tpgraph: building|Successfully|rror" "$out/build.log" || true; } | cut -c1-300
python3 -c "import tpgraph._C as c; print(c.build_info())" 2>&1 | tee -a "$out/build.log"
python3 -m pytest tests/gpu -v -rs 2>&1 | tail -80 | tee "$out/gpu_tests.log"
# bf16 acceptance on a well-conditioned random checkpoint; fp32 on HF's default init (exactness)
torchrun --nproc-per-node 2 bench/hf_parity.py --embed-std 4.0 --out "$out/hf_parity_tp2_bf16.json" 2>&1 \
  | grep -v "it/s\]" | tee "$out/hf_parity.log"
torchrun --nproc-per-node 2 bench/hf_parity.py --dtype fp32 --out "$out/hf_parity_tp2_fp32.json" 2>&1 \
  | grep -v "it/s\]" | tee -a "$out/hf_parity.log"
torchrun --nproc-per-node 2 -m tpgraph.generate --prompt "Hello, tpgraph" --max-tokens 16 2>&1 \
  | grep -v "tensor/s\]" | tee "$out/generate.log"
exit $status
