"""Every packing case kt_ops offers, derived from the library's own lists.

``format_cases()`` enumerates one :class:`FormatCase` per packed format the methods of
``kt_ops.formats.METHOD_FORMATS`` reach (with and without ``zero_point``), per int4 group
size each of the ``GROUPED_FORMATS`` takes (its ``group_sizes``; mxfp4: 32; a ``zero_point``
format once more with ``scale_search``, whose minimums are not integer zero points), and per ggml type of
``kt_ops.gguf_types.SUPPORTED_TYPES`` for the GGUF method (each type alone, plus the
Q4_K_M mix: gate/up Q4_K, down Q6_K). A row added to those lists is a new case here,
so a test parametrized by ``format_cases()`` covers it on every CPU variant without
new test code.

Each case carries a shape it can hold: H (the k of gate/up) and I (the k of down) are
multiples of the case's block (the int4 group; the ggml type's block, read from
``kt_ops._C.ggml_type``: 256 for K-quants, 32 for the 32-weight types, 1 for float
types), an odd multiple of it (odd sizes where the block is 1), and above ``min_k`` so
the kernels' k-blocking (256 for bf16, 512 for int8/int4) is crossed with a partial last
block where the block rules allow it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

import kt_ops
from kt_ops._native import _C
from kt_ops.formats import GROUPED_FORMATS, METHOD_FORMATS, format_for_method, format_info
from kt_ops.gguf_types import SUPPORTED_TYPES, gguf_type_id

GGUF_METHOD_FORMAT = "gguf"
# llama.cpp's Q4_K_M files: gate/up in Q4_K, down in Q6_K.
GGUF_MIXES: dict[str, tuple[str, str, str]] = {"Q4_K_M": ("Q4_K", "Q4_K", "Q6_K")}


@dataclass(frozen=True)
class FormatCase:
    """One way to pack a layer: the arguments of ``kt_ops.pack_experts`` and a shape."""

    id: str
    method: str
    format: str  # the packed format pack_experts must report
    hidden: int  # H
    intermediate: int  # I
    kwargs: dict = field(default_factory=dict, hash=False, compare=False)  # group_size, zero_point, gguf_type

    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> kt_ops.PackedExperts:
        packed = kt_ops.pack_experts(gate, up, down, method=self.method, **self.kwargs)
        assert packed.format == self.format, f"{self.id}: packed as {packed.format!r}, expected {self.format!r}"
        return packed


def ggml_block(type_name: str) -> int:
    """Weights per block of a ggml type, as the extension reports it."""
    name, block_elems = _C.ggml_type(gguf_type_id(type_name))[:2]
    assert name == type_name
    return int(block_elems)


def fitting_size(block: int, min_k: int) -> int:
    """The smallest odd multiple of ``block`` above ``min_k`` (odd sizes where block is 1)."""
    m = min_k // block + 1
    if m % 2 == 0:
        m += 1
    return m * block


def method_formats() -> dict[str, tuple[str, bool]]:
    """Packed format -> (a method selecting it, zero_point), over every method of
    METHOD_FORMATS with zero_point False and (where the method takes it) True."""
    out: dict[str, tuple[str, bool]] = {}
    for method in METHOD_FORMATS:
        for zero_point in (False, True):
            try:
                fmt = format_for_method(method, zero_point)
            except ValueError:
                continue  # zero_point asked of a method without groups
            out.setdefault(fmt, (method, zero_point))
    return out


def format_cases(min_hidden: int = 600, min_intermediate: int = 520) -> list[FormatCase]:
    """Every packing case, each with a shape (H > min_hidden, I > min_intermediate) it can hold."""
    cases: list[FormatCase] = []
    for fmt, (method, zero_point) in method_formats().items():
        if fmt == GGUF_METHOD_FORMAT:
            type_sets = [(name, (name,) * 3) for name in SUPPORTED_TYPES] + list(GGUF_MIXES.items())
            for label, types in type_sets:
                blocks = [ggml_block(t) for t in types]
                h_block = math.lcm(blocks[0], blocks[1])  # gate/up rows have H weights
                H = fitting_size(h_block, min_hidden)
                I = fitting_size(blocks[2], min_intermediate)  # down rows have I weights
                gguf_type = types[0] if len(set(types)) == 1 else types
                cases.append(FormatCase(f"gguf-{label}", method, fmt, H, I, {"gguf_type": gguf_type}))
        elif fmt in GROUPED_FORMATS:
            for group in format_info(fmt).group_sizes:
                H, I = fitting_size(group, min_hidden), fitting_size(group, min_intermediate)
                kwargs = {"group_size": group, "zero_point": zero_point}
                cases.append(FormatCase(f"{fmt}-g{group}", method, fmt, H, I, kwargs))
            if zero_point:  # round-to-nearest gives integer zero points; the search any minimum
                group = format_info(fmt).group_sizes[0]
                H, I = fitting_size(group, min_hidden), fitting_size(group, min_intermediate)
                kwargs = {"group_size": group, "zero_point": True, "scale_search": True}
                cases.append(FormatCase(f"{fmt}-g{group}-minimums", method, fmt, H, I, kwargs))
        else:
            H, I = fitting_size(1, min_hidden), fitting_size(1, min_intermediate)
            cases.append(FormatCase(fmt, method, fmt, H, I, {"zero_point": zero_point} if zero_point else {}))
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), f"duplicate case ids: {ids}"
    return cases
