#!/usr/bin/env bash
# Everything the GPU issue measures, on a lent GPU machine (bare when it starts; no network):
# install the packed wheels, build random-weight models, run the `cuda` tests and our CPU
# kernels' tests on the host CPU, the benchmarks; logs and tables go to $OUT (they come back).
# Prepare here with scripts/gpu_pack.sh, then call the device tool with carry [".gpu"]:
#   bash scripts/gpu_run.sh tests     (~5 min: install, models, cuda tests, host-CPU tests)
#   bash scripts/gpu_run.sh bench     (~8 min: attention, whole model, workload, exactness)
#   bash scripts/gpu_run.sh all       (both; for a machine without a 10-minute limit)
# FlashInfer compiles its kernels on first use into .flashinfer/ (ignored, not carried: it
# stays on the machine while the machine stays warm between calls); gpu_pack.sh copies
# ../shared/gpu's compiled kernels into .gpu/, unpacked there first (~70 s of compiling saved).
# Each phase adds its part to $OUT/gpu-runs/<date>-<device>.md, the record to commit under
# docs/gpu-runs/ (device, driver, commit, pytest summaries, the bench's tables).
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:-all}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-run-$PHASE.log") 2>&1
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=$PWD/.flashinfer HF_HUB_OFFLINE=1
export PYTHONPATH=/tmp/site:$PWD
step() { echo; echo "=== $1 ($(date +%T))"; }

if [ ! -f /tmp/site/.installed ]; then
  step "install"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 1
  touch /tmp/site/.installed
fi
if ls .gpu/flashinfer-*-jit-cache.tgz >/dev/null 2>&1 && [ ! -d .flashinfer/.unpacked ]; then
  mkdir -p .flashinfer && tar -xzf .gpu/flashinfer-*-jit-cache.tgz -C .flashinfer --strip-components=1
  mkdir -p .flashinfer/.unpacked
fi
step "machine"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
lscpu | grep -E "Model name|^Flags"
VERSIONS=$(python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'flashinfer', flashinfer.__version__)") || exit 1
echo "$VERSIONS"
echo "commit: $(cat .gpu/commit)"
mkdir -p "$OUT/gpu-runs"
RECORD="$OUT/gpu-runs/$(date +%F)-$(echo "$GPU" | tr ' A-Z' '-a-z' | tr -cd 'a-z0-9-').md"
if [ ! -f "$RECORD" ]; then
  {
    echo "# GPU run $(date +%F): $GPU"
    echo
    echo "- device: $GPU, driver $DRIVER; $VERSIONS"
    echo "- host CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores"
    echo "- commit: $(tr '\n' ' ' < .gpu/commit)"
    echo "- made by scripts/gpu_run.sh (random-weight checkpoints of the SmolLM2-135M and 1B Llama shapes)"
    echo
  } > "$RECORD"
fi
for shape in smollm2-135m llama-1b; do
  [ -f /tmp/$shape/config.json ] || python3 -m workloads.checkpoints.random_model build .gpu/front /tmp/$shape --shape $shape
done

if [ "$PHASE" = tests ] || [ "$PHASE" = all ]; then
  step "cuda tests (random-weight SmolLM2 shape: the bundled weights cannot travel)"
  RADIXKV_GPU_MODEL=/tmp/smollm2-135m timeout 330 python3 -m pytest -q -p no:cacheprovider \
    -m cuda tests/engine/test_cuda_flashinfer.py tests/engine/test_cuda_engine.py 2>&1 | tee "$OUT/pytest-cuda.txt"
  step "host CPU: our kernels' invariance, portability and hardening"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_products.py \
    tests/engine/test_native_attention.py tests/engine/test_kernel_portability.py \
    $(ls tests/engine/test_native_fuzz.py 2>/dev/null) \
    2>&1 | tail -8 | tee "$OUT/pytest-host-cpu.txt"
  {
    echo "## Tests"
    echo
    echo "CUDA (\`-m cuda\`, random-weight SmolLM2 shape): \`$(tail -1 "$OUT/pytest-cuda.txt")\`"
    echo
    echo "Host CPU kernels: \`$(tail -1 "$OUT/pytest-host-cpu.txt")\`"
    echo
  } >> "$RECORD"
fi
if [ "$PHASE" = bench ] || [ "$PHASE" = all ]; then
  step "benchmarks"
  timeout 500 python3 -m workloads.model_bench.gpu --model /tmp/llama-1b \
    --exactness-model /tmp/smollm2-135m ${BENCH_SKIP:+--skip $BENCH_SKIP} 2>&1 | tee "$OUT/gpu-bench.md"
  { echo "## Benchmarks (workloads.model_bench.gpu)"; echo; cat "$OUT/gpu-bench.md"; echo; } >> "$RECORD"
fi
step "done"
