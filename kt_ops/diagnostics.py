"""What runs on this machine, and why (``kt_ops.doctor()``, ``python -m kt_ops.doctor``,
``kt-ops doctor``)."""

from __future__ import annotations

from typing import Sequence

import torch

from kt_ops import _native, host, numa
from kt_ops._optional import integration_lines
from kt_ops.cpu import (
    CPU_VARIANTS,
    cpu_variant,
    get_num_threads,
    missing_features,
    supported_cpu_variants,
    thread_source,
)
from kt_ops.formats import CHECKPOINT_METHODS, FORMATS, FormatInfo
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


def cpu_list(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"`` (the kernel's CPU list notation); ``""`` for none."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def pool_line(plan: numa.PoolPlan) -> str:
    """One node's pool: ``"  pool of node0: 4 threads: the caller (CPU 0 kept for it), pinned to CPUs 1-3"``."""
    pinned = [cpu for cpu in plan.cpus if cpu >= 0]
    words = []
    if plan.caller_cpu >= 0:
        words.append(f"the caller (CPU {plan.caller_cpu} kept for it)")
    if pinned:
        words.append(f"pinned to CPU{'s' if len(pinned) > 1 else ''} {cpu_list(pinned)}")
    if len(pinned) < len(plan.cpus):
        words.append(f"{len(plan.cpus) - len(pinned)} unpinned (more threads than CPUs)")
    if not words:
        words.append("no thread (its parts run on the caller's node)")
    return f"  pool of node{plan.node}: {plan.threads} thread{'s' if plan.threads != 1 else ''}: {', '.join(words)}"


def _numa_lines() -> list[str]:
    """The machine's nodes, the engine's (simulated ones say so), the pools NUMA parts run
    on, and where the packed parts of live KTMoEWrappers lie (``/proc/self/numa_maps``)."""
    nodes = host.numa_nodes()
    if nodes:
        listed = ", ".join(f"node{node}: CPUs {cpus}" for node, cpus in nodes.items())
        lines = [f"NUMA nodes: {len(nodes)} ({listed})"]
    else:
        lines = ["NUMA nodes: unknown (no /sys/devices/system/node)"]
    engine = numa.topology()
    if engine.simulated:
        listed = ", ".join(f"node{node.id}: CPUs {cpu_list(node.cpus)}" for node in engine.nodes)
        lines.append(f"simulated NUMA nodes (KT_OPS_NUMA_SIMULATE={len(engine.nodes)}, no memory of their own): "
                     f"{listed}")
    if len(engine.nodes) == 1:
        lines.append("NUMA parts (threadpool_count >= 2): one node, so a layer's parts run one after another on "
                     "all threads")
    else:
        lines.append(f"NUMA parts (threadpool_count >= 2) run at once on kt_ops' own pools, one per node, "
                     f"{get_num_threads()} threads in all:")
        lines += [pool_line(plan) for plan in numa.pool_plans()]
    lines += _parts_memory_lines()
    return lines


def _parts_memory_lines() -> list[str]:
    """Per part of each live KTMoEWrapper that runs on nodes: its node and the nodes its
    blob's pages are on (from ``/proc/self/numa_maps``; empty when not readable)."""
    from kt_ops.wrappers.kt_moe_wrapper import KTMoEWrapper

    lines: list[str] = []
    wrappers = [w for w in sorted(KTMoEWrapper._instances, key=lambda w: w.layer_idx) if w._part_nodes is not None]
    if not wrappers:
        return lines
    numa_maps = numa.read_numa_maps()
    for wrapper in wrappers:
        for index, (part, node) in enumerate(zip(wrapper._parts, wrapper._part_nodes)):
            pages = numa.memory_nodes(part.data, numa_maps)
            where = ", ".join(f"node{n}: {count}" for n, count in pages.items()) or "unknown"
            lines.append(f"  layer {wrapper.layer_idx} part {index} ({part.nbytes} bytes) runs on node{node}; "
                         f"pages of the mapping holding it: {where}")
    return lines


def _hugepages_line() -> str:
    transparent = host.transparent_hugepages() or "unknown"
    reserved = host.hugepages()
    words = "unknown" if reserved is None else (
        f"{reserved.total} reserved, {reserved.free} free, {reserved.size_kib} KiB each")
    return f"huge pages: transparent {transparent}; hugetlbfs {words}"


def _prefetch_line() -> str:
    """How the INT8/INT4 decode prefetches on this CPU (csrc/cpu/isa/cpu_model.h)."""
    if _native._C.prefetch_l2_fills_l1():
        return ("software prefetch: PREFETCHT1 fills L1 on this CPU (AMD before Zen 4), so INT8/INT4 decode "
                "streams each next tile without its tiles' prefetches 32 lines ahead")
    return ("software prefetch: PREFETCHT1 stops at L2 on this CPU; INT8/INT4 decode prefetches 32 lines ahead "
            "beside each next tile's stream")


def doctor() -> str:
    """A report: torch, the active CPU variant and why, every variant (supported or what
    is missing), AMX (CPU and OS permission), how decode prefetches on this CPU model,
    threads, NUMA nodes (the machine's, the simulated ones, the pool of each node and the
    CPUs it is pinned to, where the packed parts of live wrappers lie), huge pages, and for
    every row of the format table the kernel it runs under the active variant (for gguf
    also the ggml types that variant reads in place), and which optional packages
    (transformers, PEFT, accelerate, vLLM) are installed, found without importing them."""
    active = cpu_variant()
    # The variable as kt_ops read it at import (a later os.environ change forces nothing).
    reason = variant_reason(active, supported_cpu_variants(), _native._requested)
    lines = [f"torch {torch.__version__}", f"active CPU variant: {active} ({reason})"]
    for variant in CPU_VARIANTS:
        missing = missing_features(variant)
        lines.append(f"  {variant:12s} {'supported' if not missing else 'unsupported: missing ' + missing}")
    lines.append(f"AMX: {amx_status(host.cpu_flags(), missing_features('amx'))}")
    lines.append(_prefetch_line())
    lines.append(f"threads: {get_num_threads()} on {thread_source()}")
    lines += _numa_lines()
    lines.append(_hugepages_line())
    lines.append(f"formats (kernel under {active}):")
    width = max(len(fmt.name) for fmt in FORMATS)
    for fmt in FORMATS:
        lines.append(f"  {fmt.name:{width}s}  {methods_label(fmt)}: {fmt.kernels[active]}")
        if fmt.k_rule == "ggml_block":
            in_place = [t.name for t in GGML_TYPES if active in t.in_place_variants]
            lines.append(f"  {'':{width}s}  ggml types: {', '.join(t.name for t in GGML_TYPES)}")
            lines.append(f"  {'':{width}s}  read in place: {', '.join(in_place) if in_place else 'none'}")
    # The published 4-bit checkpoints' methods pack into the formats above (kt_ops.hf_int4, hf_mxfp4).
    read = [f"{method} -> {fmt}" + (" (int4_asym with zero points)" if method == "GPTQ_INT4" else "")
            for method, (fmt, _) in CHECKPOINT_METHODS.items()]
    lines.append(f"4-bit checkpoints read in place: {', '.join(read)}, MXFP4 (gpt-oss, DeepSeek-V4) -> mxfp4")
    lines += integration_lines()
    return "\n".join(lines)
