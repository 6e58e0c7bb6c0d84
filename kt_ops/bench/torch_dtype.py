"""The dtype torch computes fast in on this CPU, for the plain-PyTorch layers the bench
compares with (the baseline MoE layer, the float GEMM reference, --model-step's torch
work)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kt_ops.bench.limits import DTYPE_NAMES


@dataclass(frozen=True)
class TorchDtype:
    """The chosen dtype and the two ``torch.matmul`` rates (GFLOP/s) that chose it."""

    dtype: torch.dtype
    bf16_gflops: float
    fp32_gflops: float

    @property
    def name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    def describe(self) -> str:
        return f"{self.name} (torch.matmul here: bf16 {self.bf16_gflops:.0f} GFLOP/s, fp32 {self.fp32_gflops:.0f})"


def matmul_rates(size: int, repeats: int) -> tuple[float, float]:
    """(bf16, fp32) GFLOP/s of ``torch.matmul`` on ``[size, size] x [size, size]``: best of
    ``repeats`` calls each after one warm-up call each, the two dtypes' calls alternating
    so that a busy moment of a shared machine slows both rather than one."""
    operands = {dtype: (torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype))
                for dtype in (torch.bfloat16, torch.float32)}
    best = {dtype: float("inf") for dtype in operands}
    for timed in [False] + [True] * repeats:
        for dtype, (a, b) in operands.items():
            start = time.perf_counter()
            torch.matmul(a, b)
            if timed:
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    flops = 2.0 * size**3
    return flops / best[torch.bfloat16] / 1e9, flops / best[torch.float32] / 1e9


def choose_torch_dtype(size: int = 384, repeats: int = 3, slower_factor: float = 2.0) -> TorchDtype:
    """bf16 (the models' dtype) unless torch's bf16 matmul runs ``slower_factor`` times
    slower than its fp32 matmul (:func:`matmul_rates` at side ``size``), then fp32.

    Without native bf16 (AVX2, AVX-512 without AVX512_BF16 or AMX) torch's bf16 matmul
    runs at 1-4 GFLOP/s against 100-200 for fp32 (measured here at sides 256-512 under
    ``DNNL_MAX_CPU_ISA=AVX2``: 44-67x), and a bf16 baseline would time that fallback
    rather than PyTorch; with native bf16 it is the faster one (here 3-4x fp32). The
    factor 2 keeps a near tie on bf16; side 384 costs 0.13 s where bf16 is slow and the
    gap it detects is 40x either way."""
    bf16, fp32 = matmul_rates(size, repeats)
    dtype = torch.float32 if bf16 * slower_factor < fp32 else torch.bfloat16
    return TorchDtype(dtype, bf16, fp32)
