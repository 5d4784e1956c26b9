#!/usr/bin/env bash
# session 40 call 1: GPU tests for varlen + engine, prefix caching on the GPU (shared-prefix points), HF parity bf16
set -x
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TPGRAPH_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1
mkdir -p TMPDIR; L=TMPDIR
(sleep 570; tar czf $OUT/x.tgz -C /tmp l) &
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > $L/smi.txt
date +%T > $L/t_build
python3 -c "import tpgraph._C" 2>/dev/null || python3 -m pip install -q --no-build-isolation --no-deps -e . > $L/build.log 2>&1
date +%T >> $L/t_build
timeout 220 python3 -m pytest tests/gpu/test_varlen_prefill_gpu.py tests/gpu/test_engine_gpu.py -q -rs 2>&1 \
  | grep -v "it/s\]" | tail -25 > $L/gpu_tests.log
date +%T >> $L/t_build
for caching in on off; do timeout 130 python3 bench/bench_prefill.py --shape llama3-8b \
  $([ $caching = off ] && echo --no-prefix-caching) --points 32x256+2048,8x64+4096,1x256+4096 \
  --out $L/prefill_shared_caching_$caching.json 2>&1 | tr '\r' '\n' | grep -v "it/s\]" | tail -30 > $L/prefill_$caching.log
  date +%T >> $L/t_build; done
timeout 100 torchrun --nproc-per-node 1 bench/hf_parity.py --embed-std 4.0 --out $L/hf_parity_bf16.json 2>&1 \
  | grep -E "prompt|PASS|FAIL|Error" > $L/parity.log
date +%T >> $L/t_build
tar czf $OUT/x.tgz -C /tmp l
