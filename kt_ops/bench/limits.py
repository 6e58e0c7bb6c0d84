"""The machine's limits, measured in the same run as the kernels."""

from __future__ import annotations

import glob
import statistics
import time

import torch

from kt_ops._native import _C


def last_level_cache_bytes() -> int:
    """The largest CPU cache the OS reports (sysfs), or 32 MiB if it reports none."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = open(path).read().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


def streaming_buffer_bytes() -> int:
    """A buffer size that no cache holds: 4x the last-level cache, 1 to 4 GiB."""
    return min(max(4 * last_level_cache_bytes(), 1 << 30), 4 << 30)


class CacheFlusher:
    """Evicts the caches by streaming through a buffer larger than them (all engine
    threads), so the next timed call reads its weights from DRAM as in a real model,
    whose other layers evict a layer's experts before it runs again."""

    def __init__(self, nbytes: int | None = None) -> None:
        self.buffer = torch.ones(nbytes or streaming_buffer_bytes(), dtype=torch.uint8)

    def __call__(self) -> None:
        _C.time_read_passes(self.buffer, 1)


def read_bandwidth_gbs(buffer: torch.Tensor | None = None, repeats: int = 7) -> float:
    """Read bandwidth in GB/s: every engine thread streams its share of a buffer several
    times the last-level cache with the widest loads the CPU has; median of ``repeats``
    passes after two warm-up passes."""
    if buffer is None:
        buffer = torch.ones(streaming_buffer_bytes(), dtype=torch.uint8)
    seconds = _C.time_read_passes(buffer, repeats + 2)[2:]
    return buffer.numel() / statistics.median(seconds) / 1e9


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
