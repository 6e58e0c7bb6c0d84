#!/usr/bin/env bash
# Runs the benchmark once per CPU variant this machine supports (forced with
# KT_OPS_CPU_VARIANT), to compare the ISA paths on the same machine. Extra arguments go
# to the benchmark, e.g. scripts/bench_variants.sh --quick
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
for variant in $("$PY" -c "import kt_ops; print(' '.join(kt_ops.supported_cpu_variants()))"); do
  echo "=== KT_OPS_CPU_VARIANT=$variant"
  KT_OPS_CPU_VARIANT=$variant "$PY" -m kt_ops.bench "$@"
done
