#!/usr/bin/env bash
# session 43: why is one 517-token prompt 42% slower with varlen than with the SDPA loop? profile both.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TPGRAPH_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
dest=$1
python3 -c "import tpgraph._C" 2>/dev/null || python3 -m pip install -q --no-build-isolation --no-deps -e . > $dest/build.log 2>&1
for v in 0 1; do
  TPGRAPH_VARLEN_PREFILL=$v timeout 250 python3 bench/bench_prefill.py --shape llama3-8b --no-prefix-caching \
    --points 1x512,1x517,1x1024 --profile 1x517 --out $dest/prefill_profile_varlen$v.json 2>&1 | tr '\r' '\n' \
    | grep -v "it/s]\|graph/s]\|tensor/s]" > $dest/prefill_profile_varlen$v.log
  tail -70 $dest/prefill_profile_varlen$v.log
done
