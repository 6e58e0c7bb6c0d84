"""What runs on this machine, and why (``kt_ops.doctor()``, ``python -m kt_ops.doctor``,
``kt-ops doctor``)."""

from __future__ import annotations

import os

import torch

from kt_ops import host
from kt_ops._native import _C
from kt_ops.cpu import (
    CPU_VARIANTS,
    cpu_variant,
    get_num_threads,
    missing_features,
    supported_cpu_variants,
    thread_source,
)
from kt_ops.formats import FORMATS, FormatInfo
from kt_ops.gguf_types import GGML_TYPES


def methods_label(fmt: FormatInfo) -> str:
    """``"method BF16"``, ``"methods AMXINT4, MOE_INT4 + zero_point=True"``."""
    words = f"method{'s' if len(fmt.methods) > 1 else ''} {', '.join(fmt.methods)}"
    return words + (" + zero_point=True" if fmt.zero_point else "")


def variant_reason(active: str, supported: list[str], requested: str) -> str:
    """Why ``active`` is the active variant: the best of ``supported`` (oldest first, as
    :func:`kt_ops.supported_cpu_variants` lists them), ``KT_OPS_CPU_VARIANT=requested``
    (empty: unset) at import, or a later :func:`kt_ops.set_cpu_variant` call."""
    best = supported[-1] if supported else None
    if requested and active == requested:
        return f"forced by KT_OPS_CPU_VARIANT={requested}" + (
            "; it is also the best this CPU supports" if active == best else f"; the best this CPU supports is {best}")
    if active == best and not requested:
        return "the best this CPU supports"
    set_by = "set by kt_ops.set_cpu_variant()"
    if requested:
        set_by += f" after KT_OPS_CPU_VARIANT={requested} at import"
    return set_by + ("; it is also the best this CPU supports" if active == best else
                     f"; the best this CPU supports is {best}")


def amx_status(cpu_flags: frozenset[str] | None, missing: str) -> str:
    """Whether AMX runs here, from ``/proc/cpuinfo``'s flags (None: unreadable) and
    :func:`kt_ops.missing_features` of ``"amx"``: absent from the CPU, present but not
    enabled by the OS (XCR0 tile state, or the ``arch_prctl`` permission refused), usable."""
    if not missing:
        return "usable (the CPU has AMX tiles and the OS granted the tile permission)"
    if cpu_flags is not None and "amx_tile" not in cpu_flags:
        return "not in this CPU (no amx_tile flag in /proc/cpuinfo)"
    if "AMX permission" in missing:
        return ("the CPU has AMX but the OS refused the tile permission "
                "(arch_prctl ARCH_REQ_XCOMP_PERM; Linux grants it from 5.16)")
    if "XCR0" in missing and "(CPUID)" not in missing:
        return "the CPU has AMX but the OS has not enabled tile state (XCR0; Linux enables it from 5.16)"
    return f"unavailable: missing {missing}"


def _numa_line() -> str:
    nodes = host.numa_nodes()
    pools = _C.num_pools()
    pool_words = f"; kt_ops' own thread pools: {pools} (one per node with helpers)" if pools else ""
    if not nodes:
        return "NUMA nodes: unknown (no /sys/devices/system/node)" + pool_words
    listed = ", ".join(f"node{node}: CPUs {cpus}" for node, cpus in nodes.items())
    return f"NUMA nodes: {len(nodes)} ({listed}){pool_words}"


def _hugepages_line() -> str:
    transparent = host.transparent_hugepages() or "unknown"
    reserved = host.hugepages()
    words = "unknown" if reserved is None else (
        f"{reserved.total} reserved, {reserved.free} free, {reserved.size_kib} KiB each")
    return f"huge pages: transparent {transparent}; hugetlbfs {words}"


def doctor() -> str:
    """A report: torch, the active CPU variant and why, every variant (supported or what
    is missing), AMX (CPU and OS permission), threads, NUMA nodes, huge pages, and for
    every row of the format table the kernel it runs under the active variant (for gguf
    also the ggml types that variant reads in place)."""
    active = cpu_variant()
    reason = variant_reason(active, supported_cpu_variants(), os.environ.get("KT_OPS_CPU_VARIANT", "").strip())
    lines = [f"torch {torch.__version__}", f"active CPU variant: {active} ({reason})"]
    for variant in CPU_VARIANTS:
        missing = missing_features(variant)
        lines.append(f"  {variant:12s} {'supported' if not missing else 'unsupported: missing ' + missing}")
    lines.append(f"AMX: {amx_status(host.cpu_flags(), missing_features('amx'))}")
    lines.append(f"threads: {get_num_threads()} on {thread_source()}")
    lines.append(_numa_line())
    lines.append(_hugepages_line())
    lines.append(f"formats (kernel under {active}):")
    width = max(len(fmt.name) for fmt in FORMATS)
    for fmt in FORMATS:
        lines.append(f"  {fmt.name:{width}s}  {methods_label(fmt)}: {fmt.kernels[active]}")
        if fmt.k_rule == "ggml_block":
            in_place = [t.name for t in GGML_TYPES if active in t.in_place_variants]
            lines.append(f"  {'':{width}s}  ggml types: {', '.join(t.name for t in GGML_TYPES)}")
            lines.append(f"  {'':{width}s}  read in place: {', '.join(in_place) if in_place else 'none'}")
    return "\n".join(lines)
