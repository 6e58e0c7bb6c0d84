#!/usr/bin/env bash
# Builds kt_ops with its CUDA key where a GPU is, then runs every GPU test, then (with
# KT_OPS_GPU_CPU_SECONDS > 0, for at most that long) the rest of the suite on the host CPU.
#
#   bash scripts/run_gpu_tests.sh            # logs in $OUT (default /tmp/kt_gpu)
#
# KT_OPS_GPU_ALSO_SECONDS / KT_OPS_GPU_BENCH_SECONDS cap those two steps (below).
# KT_OPS_GPU_DEADLINE=N: every step after the build is cut (SIGINT, so pytest still
# reports) so that the script ends within N seconds of its start, and a step that would
# get under 20 s is skipped: a lease's one call returns its logs in time.
# KT_OPS_GPU_CPU_VARIANT=V: the CPU part runs pinned to variant V (as one pass of
# scripts/test_all_variants.sh), e.g. amx on a Xeon host, where no CI machine runs it.
#
# Meant for a short lease of a machine with a GPU whose python3 already holds a CUDA torch
# (no pip index there): wheels of what it lacks (gguf, expecttest, transformers, peft)
# can wait in .whl/ and are installed into /tmp/site first. The build goes in place
# (kt_ops/_C*.so); nothing outside the checkout and /tmp is written.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kt_gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L
lscpu | grep -E "^(Model name|CPU\(s\)|NUMA node\(s\))" | sed 's/  */ /g'
lscpu | grep -o -w -E "avx2|avx512f|avx512_bf16|avx512_vnni|avx_vnni|amx_tile|amx_int8|amx_bf16" | sort -u | tr '\n' ' '; echo
$PY -c "import torch, transformers, gguf; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| transformers', transformers.__version__)"
if [ -z "${CUDA_HOME:-}" ]; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then CUDA_HOME=/usr/local/cuda
  else CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; fi
fi
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"

deadline=${KT_OPS_GPU_DEADLINE:-0}
# step_limit WANTED: seconds a step may take, WANTED capped by what the deadline leaves
# (10 s kept for the summary); prints 0 when under 20 s would be left.
step_limit() {
  local want=$1 left
  [ "$deadline" -gt 0 ] || { echo "$want"; return; }
  left=$(( deadline - SECONDS - 10 ))  # bash's SECONDS: time since the script started
  [ "$left" -lt "$want" ] && want=$left
  [ "$want" -lt 20 ] && want=0
  echo "$want"
}

start=$(date +%s)
if ! KT_OPS_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
    $PY setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -30
  tail -20 "$OUT/build.log"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
$PY -c "import kt_ops, kt_ops.cuda; assert kt_ops.cuda.is_built(); print('kt_ops CUDA key built | CPU variant', kt_ops.cpu_variant())"

start=$(date +%s)
gpu_limit=$(step_limit 100000)
[ "$gpu_limit" -gt 0 ] || { echo "no time left for the GPU tests"; exit 1; }
timeout -s INT "$gpu_limit" $PY -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py tests/test_wrapper_cuda.py tests/test_dynamic_experts.py \
  tests/test_expert_stats.py tests/test_hf_cuda.py tests/test_wrapper_dynamic.py tests/test_gpu_prefill.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
gpu_rc=${PIPESTATUS[0]}
echo "GPU tests: rc $gpu_rc, $(( $(date +%s) - start )) s"

# KT_OPS_GPU_ALSO="tests/a.py tests/b.py": those files alone (no xdist, all host threads),
# their whole log kept in $OUT/also.log. KT_OPS_GPU_BENCH=1: scripts/bench_gpu_prefill.py
# (one S1 layer, GPU prefill against the CPU experts) into $OUT/bench.log.
also_limit=$(step_limit "${KT_OPS_GPU_ALSO_SECONDS:-100000}")
if [ -n "${KT_OPS_GPU_ALSO:-}" ] && [ "$also_limit" -gt 0 ]; then
  # shellcheck disable=SC2086  # a list of paths
  timeout -s INT "$also_limit" $PY -m pytest -q -p no:cacheprovider -rfE $KT_OPS_GPU_ALSO >"$OUT/also.log" 2>&1
  echo "also ($KT_OPS_GPU_ALSO): rc $?"; tail -3 "$OUT/also.log"
fi
bench_limit=$(step_limit "${KT_OPS_GPU_BENCH_SECONDS:-300}")
if [ "${KT_OPS_GPU_BENCH:-0}" = 1 ] && [ "$bench_limit" -gt 0 ]; then
  timeout "$bench_limit" $PY scripts/bench_gpu_prefill.py --breakdown --method BF16 AMXINT4 AMXINT8 FP8 Q4_K_M \
    --tokens 512 2048 8192 --repeats 3 2>&1 | tee "$OUT/bench.log"
fi

cpu_seconds=$(step_limit "${KT_OPS_GPU_CPU_SECONDS:-0}")
if [ "$cpu_seconds" -gt 0 ]; then
  # The rest of the suite: every variant the host CPU has (the variant fixture skips the
  # others), the default variant elsewhere; xdist workers of 2 threads. Stopped with SIGINT
  # at the limit, so pytest still prints what failed so far (-v logs each result as it ends).
  start=$(date +%s)
  workers=$(( $(nproc) / 2 ))
  if [ -n "${KT_OPS_GPU_CPU_VARIANT:-}" ]; then export KT_OPS_CPU_VARIANT=$KT_OPS_GPU_CPU_VARIANT; fi
  echo "CPU suite on variant ${KT_OPS_CPU_VARIANT:-(every variant the host has)}, $workers workers, at most $cpu_seconds s"
  OMP_NUM_THREADS=2 timeout -s INT "$cpu_seconds" $PY -m pytest -v -p no:cacheprovider -n "$workers" tests \
    --ignore=tests/test_cuda.py --ignore=tests/test_wrapper_cuda.py --ignore=tests/test_hf_cuda.py \
    --ignore=tests/test_wrapper_dynamic.py --ignore=tests/test_gpu_prefill.py \
    >"$OUT/cpu_suite.log" 2>&1
  cpu_rc=$?
  grep -E "^(FAILED|ERROR) " "$OUT/cpu_suite.log" | head -60
  echo "failed as they ran: $(grep -c -E "\] FAILED |\] ERROR " "$OUT/cpu_suite.log")"; tail -2 "$OUT/cpu_suite.log"
  echo "CPU suite: rc $cpu_rc, $(( $(date +%s) - start )) s (124/130: stopped at the limit)"
fi
exit "$gpu_rc"
