"""A row's roofline: which machine limit binds it and what fraction of it the row reached."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kt_ops.bench.limits import DTYPE_NAMES, ComputeLimits, GemmReference
from kt_ops.bench.runner import Row


@dataclass(frozen=True)
class MachineLimits:
    """The run's limits: read bandwidth (GB/s, the best bracket of
    :class:`~kt_ops.bench.limits.BandwidthBrackets`), the GEMM references and the
    last-level cache (bytes)."""

    read_gbs: float
    compute: ComputeLimits
    llc_bytes: int

    def gemm_for(self, row: Row) -> GemmReference | None:
        """The compute limit of ``row``: the float GEMM for float arithmetic; for int8
        arithmetic torch's int8 GEMM, or None where torch has none or where it runs slower
        than the float one (``torch._int_mm`` without a fast path: 2 GOP/s against fp32's
        167 GFLOP/s on an AVX2 Zen 3), which is then no reference for int8 kernels."""
        if row.arithmetic != "int8":
            return self.compute.float_gemm
        int8 = self.compute.int8_gemm
        return int8 if int8 is not None and int8.gflops >= self.compute.float_gemm.gflops else None


def rate(row: Row, limits: MachineLimits) -> Row:
    """``row`` with its bound and fraction of that limit (roofline time / measured time).

    - ``<dtype> gemm`` (e.g. ``int8 gemm``): its FLOPs at the GEMM reference of its
      arithmetic take longer than reading its weights at the read bandwidth;
    - ``no int8 ref`` (no fraction): an int8 row without an int8 reference (see
      :meth:`MachineLimits.gemm_for`) whose FLOPs at the float GEMM's rate take longer;
    - ``cache``: otherwise, when every weight the row's calls can reach fits in the
      last-level cache (``row.reachable_bytes``: all experts of the layers it cycles
      through; the activated experts' bytes when unknown). The bench evicts the caches
      before each call, but an LLC with a scan-resistant replacement policy (RRIP-like, on
      current Intel and AMD parts) may keep a small, often reused working set through a
      streaming flush, so such a row may read from the cache: no fraction of DRAM
      bandwidth is given (None). A call's activated experts alone fitting is not enough:
      each call routes to newly drawn experts, most of them untouched since several calls
      and a flush, so they come from DRAM (on a 2-core Zen 4 with a 32 MiB LLC, 2026-12-07,
      the 1-token S1 rows of the 4-bit methods and Q6_K, 20-31 MB per call, read 0.64-0.90
      of the mean of their two bandwidth brackets: not at cache speed);
    - ``bandwidth``: otherwise.

    The fraction is not clamped: above 1 means the limit was measured too low, and the
    table says so."""
    seconds = row.us * 1e-6
    gemm = limits.gemm_for(row)
    bandwidth_seconds = row.weight_bytes / (limits.read_gbs * 1e9)
    if gemm is None:
        if row.flops / (limits.compute.float_gemm.gflops * 1e9) >= bandwidth_seconds:
            return dataclasses.replace(row, bound="no int8 ref", limit_fraction=None)
        gemm = limits.compute.float_gemm  # bandwidth-bound either way
    compute_seconds = row.flops / (gemm.gflops * 1e9)
    if compute_seconds >= bandwidth_seconds:
        bound = f"{DTYPE_NAMES[gemm.dtype]} gemm"
        return dataclasses.replace(row, bound=bound, limit_fraction=compute_seconds / seconds)
    reachable = row.weight_bytes if row.reachable_bytes is None else row.reachable_bytes
    if reachable <= limits.llc_bytes:
        return dataclasses.replace(row, bound="cache", limit_fraction=None)
    return dataclasses.replace(row, bound="bandwidth", limit_fraction=bandwidth_seconds / seconds)


def fraction_text(row: Row) -> str:
    """The "of limit" cell: ``87%``; ``(cache)`` for a row whose reachable weights fit in the LLC;
    ``>100%?`` above the limit (a wrong limit: no percentage above 100% is printed);
    ``-`` before :func:`rate`."""
    if row.bound == "cache":
        return "(cache)"
    if row.limit_fraction is None:
        return "-"
    if row.limit_fraction > 1.0:
        return ">100%?"
    return f"{100 * row.limit_fraction:.0f}%"
