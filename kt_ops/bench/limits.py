"""The machine's limits, measured in the same run as the kernels."""

from __future__ import annotations

import statistics
import time

import torch

from kt_ops._native import _C


def read_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 7) -> float:
    """Read bandwidth in GB/s: every engine thread streams its share of an ``nbytes``
    buffer (larger than the caches); median of ``repeats`` passes after one warm-up."""
    buffer = torch.ones(nbytes, dtype=torch.uint8)
    seconds = _C.time_read_passes(buffer, repeats + 1)[1:]
    return nbytes / statistics.median(seconds) / 1e9


def bf16_gemm_gflops(size: int = 3072, repeats: int = 5) -> float:
    """``torch.matmul`` on ``[size, size] x [size, size]`` bf16: the GEMM peak reference."""
    a = torch.randn(size, size, dtype=torch.bfloat16)
    b = torch.randn(size, size, dtype=torch.bfloat16)
    torch.matmul(a, b)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        seconds.append(time.perf_counter() - start)
    return 2.0 * size**3 / statistics.median(seconds) / 1e9
