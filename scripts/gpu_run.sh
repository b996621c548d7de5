#!/usr/bin/env bash
# Everything the GPU issue measures, on a lent GPU machine (bare when it starts; no network):
# install the packed wheels, build random-weight models, run the `cuda` tests and our CPU
# kernels' tests on the host CPU, the benchmarks; logs and tables go to $OUT (they come back).
# Prepare here with scripts/gpu_pack.sh, then call the device tool with carry [".gpu"] and
# timeout_s 600:
#   bash scripts/gpu_run.sh all       (one call, the usual one: everything, most wanted first,
#                                      within BUDGET seconds, default 560)
#   bash scripts/gpu_run.sh tests     (the cuda tests, then our CPU kernels on the host CPU)
#   bash scripts/gpu_run.sh bench     (workloads.model_bench.gpu alone)
# A session has 15 minutes of device time, the machine's start (a minute or more) included,
# so `all` is one call: cuda tests (exactness first), the bench (its sections flushed as they
# finish, so a cut keeps the tables done), then the host CPU's tests, each step given what is
# left of the budget (a step that would get under 10 s is skipped and says so).
# FlashInfer compiles its kernels on first use into .flashinfer/ (ignored, not carried: it
# stays on the machine while the machine stays warm between calls); gpu_pack.sh copies
# ../shared/gpu's compiled kernels into .gpu/, unpacked there first (~70 s of compiling saved).
# Each phase adds its part to $OUT/gpu-runs/<date>-<device>.md, the record to commit under
# docs/gpu-runs/ (device, driver, commit, pytest summaries, the bench's tables).
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:-all}
BUDGET=${BUDGET:-560}
END=$((SECONDS + BUDGET))
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-run-$PHASE.log") 2>&1
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=$PWD/.flashinfer HF_HUB_OFFLINE=1
export PYTHONPATH=/tmp/site:$PWD
step() { echo; echo "=== $1 ($(date +%T), $((END - SECONDS)) s of the budget left)"; }
# seconds a step may run: at most WANT, leaving RESERVE for the steps after it; never 0
# (`timeout 0` would mean no limit at all)
allow() {
  local left=$((END - SECONDS - ${2:-0}))
  [ "$left" -lt 1 ] && left=1
  [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}

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

# Reserves (seconds) kept for what follows a step in `all`: the bench, then the host tests.
BENCH_RESERVE=${BENCH_RESERVE:-300}
HOST_RESERVE=${HOST_RESERVE:-60}
if [ "$PHASE" = tests ] || [ "$PHASE" = all ]; then
  step "cuda tests (random-weight SmolLM2 shape: the bundled weights cannot travel)"
  reserve=0; [ "$PHASE" = all ] && reserve=$((BENCH_RESERVE + HOST_RESERVE))
  # -v: each test's verdict is printed as it ends, so a run cut by the budget still counts
  RADIXKV_GPU_MODEL=/tmp/smollm2-135m timeout "$(allow 330 $reserve)" python3 -m pytest -v \
    -p no:cacheprovider -m cuda tests/engine/test_cuda_flashinfer.py tests/engine/test_cuda_engine.py \
    2>&1 | tee "$OUT/pytest-cuda.txt"
  code=${PIPESTATUS[0]}
  summary=$(tail -1 "$OUT/pytest-cuda.txt")
  [ "$code" = 124 ] && summary="cut by the budget after $(grep -c ' PASSED' "$OUT/pytest-cuda.txt") passed, $(grep -c -E ' (FAILED|ERROR)' "$OUT/pytest-cuda.txt") failed"
  { echo "## Tests"; echo
    echo "CUDA (\`-m cuda\`, random-weight SmolLM2 shape): \`$summary\`"
    grep -E ' (FAILED|ERROR)' "$OUT/pytest-cuda.txt" | grep '::' | sed 's/^/- /' | head -20
    echo; } >> "$RECORD"
fi
if [ "$PHASE" = bench ] || [ "$PHASE" = all ]; then
  step "benchmarks"
  reserve=0; [ "$PHASE" = all ] && reserve=$HOST_RESERVE
  timeout "$(allow 500 $reserve)" python3 -m workloads.model_bench.gpu --model /tmp/llama-1b \
    --exactness-model /tmp/smollm2-135m ${BENCH_SKIP:+--skip $BENCH_SKIP} 2>&1 | tee "$OUT/gpu-bench.md"
  code=${PIPESTATUS[0]}
  { echo "## Benchmarks (workloads.model_bench.gpu)"; echo; cat "$OUT/gpu-bench.md"; echo
    [ "$code" = 124 ] && echo "(cut by the call's time budget: the sections after the last table did not run)"
    echo; } >> "$RECORD"
fi
if [ "$PHASE" = tests ] || [ "$PHASE" = all ]; then
  step "host CPU: our kernels' invariance, portability and hardening"
  limit=$(allow 150)
  if [ "$limit" -ge 10 ]; then
    timeout "$limit" python3 -m pytest -q -p no:cacheprovider tests/engine/test_products.py \
      tests/engine/test_native_attention.py tests/engine/test_kernel_portability.py \
      $(ls tests/engine/test_native_fuzz.py 2>/dev/null) \
      2>&1 | tail -8 | tee "$OUT/pytest-host-cpu.txt"
  else
    echo "skipped: the budget is spent" | tee "$OUT/pytest-host-cpu.txt"
  fi
  { echo "Host CPU kernels: \`$(tail -1 "$OUT/pytest-host-cpu.txt")\`"; echo; } >> "$RECORD"
fi
step "done"
