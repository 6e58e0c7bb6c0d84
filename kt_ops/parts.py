"""The intermediate-dimension split of a layer's experts into ``threadpool_count`` parts.

Part ``p`` holds gate/up rows and down columns ``[p * I / n, (p + 1) * I / n)`` of every
expert; the layer's output is the sum of the parts' outputs (tensor parallel over the
intermediate dimension, as kt-kernel splits experts over NUMA nodes).
"""

from __future__ import annotations

import torch

from kt_ops.ops import pack_experts
from kt_ops.packed import PackedExperts


def part_bounds(intermediate_size: int, parts: int) -> list[tuple[int, int]]:
    """``[begin, end)`` of each part; ``ValueError`` unless ``parts`` divides I."""
    if parts < 1 or intermediate_size % parts:
        raise ValueError(f"threadpool_count {parts} must divide moe_intermediate_size {intermediate_size}")
    step = intermediate_size // parts
    return [(p * step, (p + 1) * step) for p in range(parts)]


def pack_parts(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, method: str, parts: int, **pack_args: object
) -> list[PackedExperts]:
    """``gate [E, I, H]``, ``up [E, I, H]``, ``down [E, H, I]`` packed as ``parts`` parts
    with :func:`kt_ops.pack_experts` (``pack_args``: group_size, gguf_type, ...)."""
    if parts == 1:
        return [pack_experts(gate, up, down, method=method, **pack_args)]
    return [
        pack_experts(gate[:, a:b], up[:, a:b], down[:, :, a:b].contiguous(), method=method, **pack_args)
        for a, b in part_bounds(int(gate.shape[1]), parts)
    ]
