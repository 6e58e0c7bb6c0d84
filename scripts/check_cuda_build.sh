#!/usr/bin/env bash
# Proves the CUDA key compiles on a machine without a GPU: a separate venv (.venv-cuda)
# with the CUDA build of torch (default torch==2.14.1, ~5.5 GB; KT_OPS_CUDA_TORCH_SPEC
# overrides), kt_ops built with KT_OPS_CUDA=1 by nvcc into build/cuda-check (the CPU
# build in kt_ops/ is left alone), then imported: the CUDA key is registered, the CPU key
# still computes, and the hybrid layer traces with fake CUDA tensors. Executing the CUDA
# path needs a GPU: tests/test_cuda.py runs it there.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvcc >/dev/null || { echo "nvcc not found on PATH" >&2; exit 1; }
if [ -z "${CUDA_HOME:-}" ]; then  # the toolkit's root (nvcc on PATH may be a wrapper elsewhere)
  if [ -x /usr/local/cuda/bin/nvcc ]; then CUDA_HOME=/usr/local/cuda
  else CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; fi
fi
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
echo "CUDA_HOME=$CUDA_HOME"; nvcc --version | tail -2
if [ ! -x .venv-cuda/bin/python ]; then
  python3 -m venv .venv-cuda
fi
. .venv-cuda/bin/activate
pip install --quiet "${KT_OPS_CUDA_TORCH_SPEC:-torch==2.14.1}" numpy ninja setuptools wheel safetensors gguf pytest
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
rm -rf build/cuda-check
TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}" KT_OPS_CUDA=1 MAX_JOBS="${MAX_JOBS:-4}" python setup.py -q build --build-base build/cuda-temp \
  --build-lib build/cuda-check 2>&1 | grep -v -E "^(copying|creating|running)" | tail -20
cd build/cuda-check
python - <<'PY'
import torch, kt_ops, kt_ops.cuda
from torch._subclasses.fake_tensor import FakeTensorMode
assert kt_ops.cuda.is_built(), "built without the CUDA key"
for op in ("kt::moe_forward", "kt::moe_forward_parts"):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"), f"no CUDA kernel registered for {op}"
E, H, I = 8, 64, 32
gate, up, down = (torch.randn(E, I, H) * 0.1, torch.randn(E, I, H) * 0.1, torch.randn(E, H, I) * 0.1)
layer = kt_ops.HybridMoE(torch.randn(E, H), gate, up, down, kt_ops.Routing(2), gpu_experts_mask=torch.arange(E) < 2)
x = torch.randn(5, H)
print("CPU key:", tuple(layer(x).shape), "| kernel", kt_ops.cpu_variant())
with FakeTensorMode(allow_non_fake_inputs=True):
    state = {n: (t if n == "packed" else torch.empty(t.shape, dtype=t.dtype, device="cuda"))
             for n, t in {**dict(layer.named_parameters()), **dict(layer.named_buffers())}.items()}
    out = torch.func.functional_call(layer, state, (torch.empty(5, H, device="cuda"),))
print("fake CUDA trace:", out.device, tuple(out.shape))
print("GPU present:", torch.cuda.is_available(), "| CUDA key compiled: yes (kt::moe_forward and kt::moe_forward_parts have CUDA kernels)")
PY
