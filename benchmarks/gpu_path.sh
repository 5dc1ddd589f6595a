#!/usr/bin/env bash
# fedlb's GPU path on a CUDA machine: the cuda-marked tests, then `fedlb cluster` with every
# rank on the GPU (4 ranks sharing it over gloo, with and without competing load; 1 rank on
# NCCL). Results go to $OUT (default ./gpu-out). Used on a lent NVIDIA H200 without network
# access: its python3 had torch; Flower and TenSEAL came as wheels made here with
#   pip download flwr==1.42.0 tenseal --python-version 3.12 --only-binary=:all: \
#     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .gpuwheels
# and installed there with --no-deps (the figures: docs/benchmarks.md, "On a real GPU").
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD FEDLB_PROFILE_DIR=off FEDLB_CACHE_DIR=off
if [ -d .gpuwheels ]; then python3 -m pip install --no-deps --no-index -q .gpuwheels/*.whl; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, flwr; print('torch', torch.__version__, 'flwr', flwr.__version__, \
torch.cuda.get_device_name(0))" | tee -a "$OUT/gpu.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_path.py tests/test_training.py -rs \
  2>&1 | tail -20 | tee "$OUT/pytest.txt"
cluster() { timeout 200 python3 -m fedlb.cli cluster --nproc 4 --speeds 1,1,2,4 --device cuda \
  --iterations 150 "$@" 2>&1 | tail -30; }
cluster --policies bsp,lb,lb-ema,lb-gpu --out "$OUT/c0" | tee "$OUT/cluster-0.txt"
cluster --policies bsp,lb,lb-gpu --load 0.1 --out "$OUT/c0.1" | tee "$OUT/cluster-0.1.txt"
timeout 100 python3 -m fedlb.cli cluster --nproc 1 --speeds 1 --device cuda --backend nccl \
  --policies bsp --iterations 150 --out "$OUT/c1" 2>&1 | tail -12 | tee "$OUT/cluster-1nccl.txt"
