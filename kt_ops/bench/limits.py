"""The machine's limits, measured in the same run as the kernels: the last-level cache,
the read bandwidth and the GEMM reference."""

from __future__ import annotations

import glob
import mmap
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

from kt_ops._native import _C

GiB = 1 << 30
MiB = 1 << 20

# torch's reader sums the buffer viewed as int64: a uint8 or int32 sum widens every
# element on the way (0.1 and 0.5 GB/s here), int64 and float32 sums stream at the
# memory's rate, and an integer sum cannot hit denormals or NaNs whatever the bytes are.
TORCH_READ_DTYPE = torch.int64

DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int8: "int8"}


def _cache_size_bytes(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": MiB, "G": GiB}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def last_level_cache_bytes() -> int:
    """Bytes of last-level cache the process's CPUs share among them (sysfs): the sum of
    the distinct highest-level cache instances over ``os.sched_getaffinity`` (a CPU with
    several L3 slices, e.g. AMD's CCDs, has several), or 32 MiB if the OS reports none."""
    instances: dict[tuple[int, str], int] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        for index in glob.glob(f"/sys/devices/system/cpu/cpu{cpu}/cache/index*"):
            try:
                with open(f"{index}/level") as f:
                    level = int(f.read())
                with open(f"{index}/size") as f:
                    size = _cache_size_bytes(f.read())
                with open(f"{index}/shared_cpu_list") as f:
                    shared = f.read().strip()
            except (OSError, ValueError):
                continue
            instances[(level, shared)] = size
    if not instances:
        return 32 * MiB
    top = max(level for level, _ in instances)
    return sum(size for (level, _), size in instances.items() if level == top)


def available_memory_bytes() -> int:
    """``MemAvailable`` of /proc/meminfo, or 8 GiB where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB


def read_buffer_bytes(llc_bytes: int | None = None) -> int:
    """Size of the read-bandwidth buffer: at least 8x the last-level cache, so that the
    caches hold at most an eighth of it and the passes measure DRAM; at least 1 GiB (a
    pass then lasts ~10 ms or more, long enough for the threads' start-up not to count);
    at most a quarter of the memory available, which the layers need. Whole MiB."""
    llc = last_level_cache_bytes() if llc_bytes is None else llc_bytes
    wanted = max(8 * llc, GiB)
    return max(min(wanted, available_memory_bytes() // 4) // MiB, 1) * MiB


def read_buffer(nbytes: int) -> torch.Tensor:
    """``[nbytes]`` uint8 ones (every page touched), 2 MiB-aligned on transparent huge
    pages where the OS grants them (``madvise``), as the packed experts are (kt_ops
    allocates them so): on 4 KiB pages both readers read 10-15% slower here (TLB misses),
    a limit below what the kernels can reach. Plain ``torch.ones`` where there is no
    ``mmap.MADV_HUGEPAGE``."""
    huge = 2 * MiB
    try:
        mapping = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError, ValueError):
        return torch.ones(nbytes, dtype=torch.uint8)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference to the mapping
    start = -whole.data_ptr() % huge
    buffer = whole[start : start + nbytes]
    buffer.fill_(1)
    return buffer


def flush_bytes(llc_bytes: int, buffer_bytes: int) -> int:
    """Bytes the cache flush streams before each timed call: 4x the last-level cache
    (at least 256 MiB), within the read buffer. Less than the read buffer because it
    runs before every timed call: at 45 GB/s 256 MiB (here: 32 MiB LLC) takes 6 ms, 1 GiB 24 ms."""
    return min(max(4 * llc_bytes, 256 * MiB), buffer_bytes)


class CacheFlusher:
    """Evicts the caches by streaming the first ``nbytes`` of ``buffer`` (all engine
    threads), so the next timed call reads its weights from DRAM as in a real model,
    whose other layers evict a layer's experts before it runs again.

    ``buffer``: uint8, contiguous; ``nbytes`` defaults to :func:`flush_bytes`."""

    def __init__(self, buffer: torch.Tensor, nbytes: int | None = None) -> None:
        if buffer.dtype != torch.uint8 or not buffer.is_contiguous():
            raise TypeError(f"buffer must be a contiguous uint8 tensor, got {buffer.dtype}")
        size = flush_bytes(last_level_cache_bytes(), buffer.numel()) if nbytes is None else nbytes
        self.buffer = buffer[:size]

    def __call__(self) -> None:
        _C.time_read_passes(self.buffer, 1)


def extension_read_seconds(buffer: torch.Tensor, passes: int) -> list[float]:
    """Seconds of each pass of the extension's reader over ``buffer`` (uint8): every
    engine thread streams its share with the widest loads the CPU has."""
    return list(_C.time_read_passes(buffer, passes))


def torch_read_seconds(buffer: torch.Tensor, passes: int) -> list[float]:
    """Seconds of each ``sum`` of ``buffer`` viewed as :data:`TORCH_READ_DTYPE` (torch's
    intra-op threads)."""
    view = buffer.view(TORCH_READ_DTYPE)
    seconds = []
    for _ in range(passes):
        start = time.perf_counter()
        view.sum()
        seconds.append(time.perf_counter() - start)
    return seconds


# The two readers of a bracket: each is a function (buffer, passes) -> seconds per pass.
READERS: dict[str, Callable[[torch.Tensor, int], list[float]]] = {
    "kt_ops": extension_read_seconds,
    "torch.sum": torch_read_seconds,
}


@dataclass(frozen=True)
class ReadBandwidth:
    """One bracket: the best pass of each reader, in GB/s (10^9 bytes per second)."""

    by_reader: dict[str, float]

    @property
    def gbs(self) -> float:
        """The faster reader's best pass."""
        return max(self.by_reader.values())

    @property
    def reader(self) -> str:
        return max(self.by_reader, key=self.by_reader.__getitem__)


def read_bandwidth(buffer: torch.Tensor, passes: int = 4) -> ReadBandwidth:
    """Read bandwidth of ``buffer`` (uint8, contiguous, a multiple of 8 bytes): the best
    (shortest) of ``passes`` passes of each of :data:`READERS`. The best pass, not the
    median: the question is what the memory can deliver, and on a shared machine every
    disturbance makes a pass slower, never faster. Two readers because neither is always
    the faster: here torch's sum reads 1.7x faster than the extension's loop."""
    if buffer.numel() % 8:
        raise ValueError(f"buffer must hold a multiple of 8 bytes, got {buffer.numel()}")
    return ReadBandwidth({name: buffer.numel() / min(read(buffer, passes)) / 1e9 for name, read in READERS.items()})


class BandwidthBrackets:
    """The run's read-bandwidth limit: measured (:func:`read_bandwidth`) before every row
    and after the last, and the best bracket taken as the limit of every row. The
    machine's bandwidth drifts by a third within minutes on shared hosts (here it flipped
    between ~40 and ~77 GB/s within seconds); the best bracket is at least what the
    machine showed right before and right after each row, so a row that beats it read
    faster than the machine did around it. A bracket of 3 passes per reader over 1 GiB
    costs ~0.15 s at 45 GB/s."""

    def __init__(self, buffer: torch.Tensor, passes: int = 3) -> None:
        self.buffer = buffer
        self.passes = passes
        self.readings: list[ReadBandwidth] = []

    def measure(self) -> ReadBandwidth:
        reading = read_bandwidth(self.buffer, self.passes)
        self.readings.append(reading)
        return reading

    @property
    def best(self) -> ReadBandwidth:
        if not self.readings:
            raise ValueError("no bracket measured yet: call measure() first")
        return max(self.readings, key=lambda r: r.gbs)

    @property
    def lowest_gbs(self) -> float:
        return min(r.gbs for r in self.readings)


def matmul_seconds(matmul: Callable[[], object], repeats: int) -> float:
    """Best of ``repeats`` timed calls after one untimed warm-up call (oneDNN compiles its
    kernel on the first call of a shape)."""
    matmul()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass(frozen=True)
class GemmReference:
    """A compute limit: torch's fastest square GEMM in ``dtype`` on this machine."""

    gflops: float  # 2 * size^3 / seconds / 1e9 (GOP/s for int8)
    dtype: torch.dtype
    size: int  # side of the GEMM that measured it
    backend: str  # "matmul" (torch.matmul: BLAS or oneDNN, as torch dispatches), "oneDNN" or "_int_mm"


def gemm_calls(dtype: torch.dtype, size: int) -> dict[str, Callable[[], object]]:
    """torch's GEMM back-ends for ``[size, size] x [size, size]`` in ``dtype``: for bf16 and
    fp32 ``torch.matmul`` and oneDNN's inner product (``torch._C._nn.mkldnn_linear``);
    for int8 ``torch._int_mm`` (int8 x int8 -> int32)."""
    if dtype == torch.int8:
        a = torch.randint(-128, 128, (size, size), dtype=torch.int8)
        b = torch.randint(-128, 128, (size, size), dtype=torch.int8)
        return {"_int_mm": lambda: torch._int_mm(a, b)}
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    calls: dict[str, Callable[[], object]] = {"matmul": lambda: torch.matmul(a, b)}
    if torch.backends.mkldnn.is_available():
        a_mkldnn, b_mkldnn = a.to_mkldnn(), b.to_mkldnn()
        calls["oneDNN"] = lambda: torch._C._nn.mkldnn_linear(a_mkldnn, b_mkldnn, None)
    return calls


def gemm_reference(dtype: torch.dtype, min_call_seconds: float = 0.01, max_size: int = 4096, repeats: int = 2) -> GemmReference | None:
    """torch's fastest square GEMM in ``dtype`` (:func:`gemm_calls`), best of ``repeats``
    calls of each back-end at side 1024, then doubled (with the back-ends within 2x of
    the best) until the best call lasts ``min_call_seconds`` (thread start-up then costs
    under 1%) or the side reaches ``max_size``; None if no back-end runs ``dtype`` here.

    Both float back-ends because neither is always the fast one: torch's fp32 matmul
    goes to MKL, which runs below the FMA peak on AMD CPUs (here 210 GFLOP/s against
    oneDNN's 451 at side 2048). Side 1024 at ~40 GFLOP/s takes 54 ms a call, and the side
    grows only while a call is shorter than 10 ms, so a reference costs well under a
    second on any x86 CPU."""
    best: GemmReference | None = None
    backends: list[str] | None = None
    size = 1024
    while True:
        calls = gemm_calls(dtype, size)
        seconds: dict[str, float] = {}
        for backend, call in calls.items():
            if backends is not None and backend not in backends:
                continue
            try:
                seconds[backend] = matmul_seconds(call, repeats)
            except (RuntimeError, NotImplementedError):  # a back-end without this dtype on this CPU
                continue
        if not seconds:
            return best
        fastest = min(seconds, key=seconds.__getitem__)
        gflops = 2.0 * size**3 / seconds[fastest] / 1e9
        if best is None or gflops > best.gflops:
            best = GemmReference(gflops, dtype, size, fastest)
        if seconds[fastest] >= min_call_seconds or size * 2 > max_size:
            return best
        backends = [b for b in seconds if seconds[b] <= 2 * seconds[fastest]]
        size *= 2


@dataclass(frozen=True)
class ComputeLimits:
    """The compute limits of the rows: ``float_gemm`` for the BF16 method (bf16 or fp32
    arithmetic: the faster GEMM of the dtypes measured), ``int8_gemm`` for the quantized
    methods, whose kernels multiply int8 (vpmaddubsw, vpdpbusd, AMX int8) at 2-4x the
    float rate (here 445 GOP/s against fp32's 226 GFLOP/s with AVX2), so that a float
    reference is no limit for them (None where torch has no int8 GEMM)."""

    float_gemm: GemmReference
    int8_gemm: GemmReference | None

    @staticmethod
    def measure(float_dtypes: tuple[torch.dtype, ...]) -> "ComputeLimits":
        """``float_dtypes``: the float dtypes worth measuring (fp32, plus bf16 where torch is
        fast in it: a bf16 GEMM without native support takes seconds)."""
        floats = [r for r in (gemm_reference(d) for d in float_dtypes) if r is not None]
        if not floats:
            raise RuntimeError(f"no torch GEMM ran in {float_dtypes}")
        return ComputeLimits(max(floats, key=lambda r: r.gflops), gemm_reference(torch.int8))

    def best(self, other: "ComputeLimits") -> "ComputeLimits":
        """The faster of each limit in ``self`` and ``other`` (two brackets of a run)."""
        int8 = [r for r in (self.int8_gemm, other.int8_gemm) if r is not None]
        return ComputeLimits(
            max(self.float_gemm, other.float_gemm, key=lambda r: r.gflops),
            max(int8, key=lambda r: r.gflops) if int8 else None,
        )
