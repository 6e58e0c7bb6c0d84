"""What runs on this machine, and why (``kt_ops.doctor()``, ``python -m kt_ops.doctor``)."""

from __future__ import annotations

import torch

from kt_ops._native import _C
from kt_ops.cpu import CPU_VARIANTS, cpu_variant, get_num_threads, missing_features
from kt_ops.formats import METHOD_FORMATS


def doctor() -> str:
    """A report: torch, CPU variants (supported or what is missing), the active variant,
    threads, and the kernel each method runs under the active variant."""
    active = cpu_variant()
    lines = [f"torch {torch.__version__}", f"active CPU variant: {active}"]
    for variant in CPU_VARIANTS:
        missing = missing_features(variant)
        lines.append(f"  {variant:12s} {'supported' if not missing else 'unsupported: missing ' + missing}")
    lines.append(f"engine threads: {get_num_threads()} in {_C.num_pools()} NUMA pool(s)")
    for method, fmt in METHOD_FORMATS.items():
        lines.append(f"method {method}: {_C.kernel_name(fmt, active)}")
    return "\n".join(lines)
