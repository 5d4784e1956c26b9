set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TPGRAPH_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
dest=$1
python3 -c "import tpgraph._C" 2>/dev/null || python3 -m pip install -q --no-build-isolation --no-deps -e . > $dest/build.log 2>&1
for sizes in - 640,768,896,1024 576,640,704,768,832,896,960,1024; do
  timeout 170 python3 ab/prefill_sizes.py $sizes --shape llama3-8b --no-prefix-caching \
    --points 1x512,1x517,1x600,1x700,1x900,1x1024,2x300,4x256 --out $dest/prefill_sizes_$sizes.json 2>&1 | tr '\r' '\n' \
    | grep -E " x +[0-9]+|Error|Graph capture|KV budget" | sed "s/^/[$sizes] /" | tee -a $dest/prefill_sizes.log
done
python3 bench/bench_prefill_gemm.py --out $dest/gemm_m.json 2>&1 | tail -22 | tee $dest/gemm_m.log
