#!/usr/bin/env bash
# Packs, here, what a GPU machine lacks into .gpu/ (ignored; carried by the device tool):
# the wheels its image does not hold (FlashInfer, pinned by the `gpu` extra, and what it and
# radixkv import), the bundled model's config and tokenizer (its weights cannot travel: over
# the 64 MiB a call may carry), and the commit under test. Then, in one device call:
#   run(command="bash scripts/gpu_run.sh", carry=[".gpu"])
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .gpu && mkdir -p .gpu/whl
# The GPU image: Python 3.12, torch 2.11 + CUDA 13, x86-64 (../.library/device/KINDS.md). It
# holds nvidia-ml-py, einops, tabulate, ninja and nvcc, which FlashInfer 0.6.13 also needs
# (checked: `import flashinfer` needs nothing more than these and apache-tvm-ffi).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl \
  "flashinfer-python==0.6.13" "apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0" \
  nvidia-cudnn-frontend cuda-tile msgspec 2>&1 | grep -v "is ignored" || true
"$PY" -m workloads.checkpoints.random_model pack-front .gpu/front
# FlashInfer's kernels compiled for an H200 (sm90a, head_dim 64, bf16): ~70 s of device time
cp ../shared/gpu/flashinfer-*-jit-cache.tgz .gpu/ 2>/dev/null || echo "no compiled kernels in ../shared/gpu"
git rev-parse HEAD > .gpu/commit
git status --porcelain | grep -q . && echo "dirty" >> .gpu/commit || true
du -sh .gpu && ls .gpu/whl
