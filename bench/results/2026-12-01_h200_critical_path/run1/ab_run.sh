#!/usr/bin/env bash
# run1 as it ran: `bash run1/ab_run.sh OUT`, with the previous commit's package unpacked in ab_old/ (git archive HEAD
# tpgraph): decode steps with this tree's kernels (new) and the previous ones (old), each its own process, two rounds,
# then the profile of the new step
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install --no-build-isolation --no-deps -e . > $out/build.log 2>&1 || { tail -20 $out/build.log; exit 1; }
cp tpgraph/_C*.so ab_old/tpgraph/
export TPGRAPH_CONFIG_DIR=$PWD/configs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $out/gpu.txt 2>&1
for v in new old new old; do
  if [ $v = old ]; then pp=$PWD/ab_old; else pp=$PWD; fi
  (cd /tmp && PYTHONPATH=$pp python3 -c "import tpgraph.kernels.decode_attention as d; print('$v', hasattr(d, '_combine_tiles'))") \
    | tee -a $out/variants.log
  PYTHONPATH=$pp timeout 130 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full \
    --batches 1,8,32 --no-ladders --allreduce custom+gemv+overlap --steps 100 --out $out/decode_$v.json 2>&1 \
    | grep -E "TPOT|Error" | sed "s/^.*\r//; s/^/$v /" | tee -a $out/ab.log
done
timeout -k 5 150 torchrun --nproc-per-node 1 bench/bench_decode.py --shape llama3-8b-half --modes full --batches 1,8 \
  --no-ladders --allreduce custom+gemv --profile --steps 20 --out $out/profile.json 2>&1 \
  | grep -v "it/s\]\|tensor/s\]\|graph/s\]" | tail -40 | tee $out/profile.log
