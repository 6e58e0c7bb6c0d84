"""What runs on this machine, and why (``kt_ops.doctor()``, ``python -m kt_ops.doctor``)."""

from __future__ import annotations

import torch

from kt_ops._native import _C
from kt_ops.cpu import CPU_VARIANTS, cpu_variant, get_num_threads, missing_features, thread_source
from kt_ops.formats import FORMATS, FormatInfo
from kt_ops.gguf_types import GGML_TYPES


def _methods(fmt: FormatInfo) -> str:
    """``"method BF16"``, ``"methods AMXINT4, MOE_INT4 + zero_point=True"``."""
    words = f"method{'s' if len(fmt.methods) > 1 else ''} {', '.join(fmt.methods)}"
    return words + (" + zero_point=True" if fmt.zero_point else "")


def doctor() -> str:
    """A report: torch, CPU variants (supported or what is missing), the active variant,
    threads, and for every row of the format table the kernel it runs under the active
    variant (for gguf also the ggml types that variant reads in place)."""
    active = cpu_variant()
    lines = [f"torch {torch.__version__}", f"active CPU variant: {active}"]
    for variant in CPU_VARIANTS:
        missing = missing_features(variant)
        lines.append(f"  {variant:12s} {'supported' if not missing else 'unsupported: missing ' + missing}")
    pools = _C.num_pools()
    lines.append(f"threads: {get_num_threads()} on {thread_source()}"
                 + (f", {pools} NUMA pool(s)" if pools else ""))
    lines.append(f"formats (kernel under {active}):")
    width = max(len(fmt.name) for fmt in FORMATS)
    for fmt in FORMATS:
        lines.append(f"  {fmt.name:{width}s}  {_methods(fmt)}: {fmt.kernels[active]}")
        if fmt.k_rule == "ggml_block":
            in_place = [t.name for t in GGML_TYPES if active in t.in_place_variants]
            lines.append(f"  {'':{width}s}  ggml types: {', '.join(t.name for t in GGML_TYPES)}")
            lines.append(f"  {'':{width}s}  read in place: {', '.join(in_place) if in_place else 'none'}")
    return "\n".join(lines)
