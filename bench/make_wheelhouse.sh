#!/usr/bin/env bash
# The lent GPU machines cannot reach PyPI: download the server's dependencies here, for their Python, into
# wheelhouse/ (gitignored), and carry it: run(..., carry=["wheelhouse"]). bench/gpu_graph_checks.sh's serve step
# installs from it when fastapi or uvicorn is missing there, and xgrammar when it is.
# usage: bash bench/make_wheelhouse.sh [python version, default 3.12]
set -euo pipefail
py=${1:-3.12}
rm -rf wheelhouse && mkdir -p wheelhouse
python3 -m pip download -q -d wheelhouse --only-binary=:all: --python-version "$py" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --implementation cp fastapi uvicorn jinja2 pydantic prometheus-client httpx2
# structured outputs: xgrammar and its FFI alone (--no-deps: its torch, transformers and triton are there already)
python3 -m pip download -q -d wheelhouse --only-binary=:all: --python-version "$py" --no-deps \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --implementation cp xgrammar apache-tvm-ffi
# the GPU test steps' pytest workers (all-gpu-tests-parallel: -n 12), pure Python
python3 -m pip download -q -d wheelhouse --only-binary=:all: --no-deps pytest-xdist execnet
ls wheelhouse | wc -l
du -sh wheelhouse
