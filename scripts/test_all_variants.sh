#!/usr/bin/env bash
# Runs the test suite once per CPU variant this machine supports
# (kt_ops.supported_cpu_variants(), oldest first), each pass with KT_OPS_CPU_VARIANT set
# so the whole suite runs on that variant's kernels and the `variant` fixture runs
# that variant only:
#   - the best variant (the last one) runs every test;
#   - every other variant runs -m "not slow";
#   - the avx2 pass also sets DNNL_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2, so torch
#     itself (oneDNN, ATen's vectorized kernels) behaves as on an AVX2-only CPU; the
#     avx_vnni pass sets DNNL_MAX_CPU_ISA=AVX2_VNNI ATEN_CPU_CAPABILITY=avx2 (an Intel
#     Core from Alder Lake on: AVX2 + AVX-VNNI, no AVX-512); the avx512 pass sets
#     DNNL_MAX_CPU_ISA=AVX512_CORE (Skylake-SP: no VNNI, no BF16) and the avx512_vnni
#     pass DNNL_MAX_CPU_ISA=AVX512_CORE_VNNI (Cascade Lake, Ice Lake: no BF16).
# Each pass has its own TORCHINDUCTOR_CACHE_DIR (a fresh temporary one): with torch 2.13,
# an ATEN_CPU_CAPABILITY=avx2 process that loads inductor kernels cached by a process
# without it crashes (segmentation fault in the compiled graph, reproduced here).
# Extra arguments go to every pytest call (e.g. a test path, -x, -k EXPR).
# Exit status 1 if any pass fails, including a pass that collects no tests (pytest's
# exit code 5). The last line is the sum over the passes: "N passed, N failed, N skipped"
# (errors count as failed).
# PYTHON overrides the interpreter (default .venv/bin/python, made by scripts/setup_env.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"

variants=$(env -u KT_OPS_CPU_VARIANT "$PY" -c "import kt_ops; print(' '.join(kt_ops.supported_cpu_variants()))") || {
  echo "test_all_variants: cannot import kt_ops with $PY (run scripts/setup_env.sh first)" >&2
  exit 1
}
read -r -a list <<<"$variants"
if [ "${#list[@]}" -eq 0 ]; then
  echo "test_all_variants: kt_ops supports no CPU variant here" >&2
  exit 1
fi
best="${list[${#list[@]}-1]}"

log_dir=$(mktemp -d)
trap 'rm -rf "$log_dir"' EXIT
status=0
total_passed=0 total_failed=0 total_skipped=0
recap=()
start_all=$SECONDS
i=0
for v in "${list[@]}"; do
  i=$((i + 1))
  env_vars=("KT_OPS_CPU_VARIANT=$v")
  select=()
  what="whole suite"
  if [ "$v" != "$best" ]; then
    select=(-m "not slow")
    what='-m "not slow"'
  fi
  case $v in
    avx2) env_vars+=("DNNL_MAX_CPU_ISA=AVX2" "ATEN_CPU_CAPABILITY=avx2") ;;
    avx_vnni) env_vars+=("DNNL_MAX_CPU_ISA=AVX2_VNNI" "ATEN_CPU_CAPABILITY=avx2") ;;
    avx512) env_vars+=("DNNL_MAX_CPU_ISA=AVX512_CORE") ;;
    avx512_vnni) env_vars+=("DNNL_MAX_CPU_ISA=AVX512_CORE_VNNI") ;;
  esac
  echo
  echo "===== pass $i/${#list[@]}: variant $v ($what) -- ${env_vars[*]} ====="
  log="$log_dir/$v.log"
  start=$SECONDS
  env "${env_vars[@]}" TORCHINDUCTOR_CACHE_DIR="$log_dir/inductor-$v" "$PY" -m pytest -q "${select[@]}" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  elapsed=$((SECONDS - start))
  # pytest's last summary line, e.g. "3 failed, 500 passed, 40 skipped, 2 warnings in 312.05s".
  read -r passed failed skipped < <("$PY" - "$log" <<'EOF'
import re, sys
counts = {}
for line in open(sys.argv[1], errors="replace"):
    if re.search(r"\bin [0-9.]+s\b", line) and re.search(r"\d+ (passed|failed|skipped|errors?|deselected)|no tests ran", line):
        counts = {k.rstrip("s") if k.startswith("error") else k: int(n)
                  for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", line)}
print(counts.get("passed", 0), counts.get("failed", 0) + counts.get("error", 0), counts.get("skipped", 0))
EOF
  )
  total_passed=$((total_passed + passed))
  total_failed=$((total_failed + failed))
  total_skipped=$((total_skipped + skipped))
  case $rc in
    0) verdict="ok" ;;
    1) verdict="FAILED (tests failed)" ;;
    5) verdict="FAILED (pytest exit 5: no tests collected)" ;;
    *) verdict="FAILED (pytest exit $rc: crashed or interrupted, counts incomplete)" ;;
  esac
  [ "$rc" -eq 0 ] || status=1
  recap+=("pass $v ($what): $verdict, $passed passed, $failed failed, $skipped skipped, ${elapsed}s")
done

echo
echo "===== all variants: ${list[*]} in $((SECONDS - start_all))s ====="
printf '%s\n' "${recap[@]}"
echo "$total_passed passed, $total_failed failed, $total_skipped skipped"
exit $status
