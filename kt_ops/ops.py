"""Typed Python entry points to the ``torch.ops.kt`` operators."""

from __future__ import annotations

import torch

from kt_ops import fakes  # noqa: F401  (registers the fake implementations)
from kt_ops.formats import format_for_method
from kt_ops.packed import PackedExperts


def pack_experts(
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    method: str = "BF16",
) -> PackedExperts:
    """Packs one layer's routed experts for :func:`moe_forward`.

    Args:
        gate_proj: ``[E, I, H]`` (Hugging Face ``nn.Linear`` layout), bf16/fp16/fp32, CPU.
        up_proj: ``[E, I, H]``, same dtype rules.
        down_proj: ``[E, H, I]``.
        method: kt-kernel method name; ``"BF16"`` stores the weights as bf16 (fp16/fp32
            inputs are rounded to bf16).

    Returns:
        A :class:`PackedExperts` whose ``data`` is a new uint8 CPU tensor.
    """
    return PackedExperts(torch.ops.kt.pack_experts(gate_proj, up_proj, down_proj, format_for_method(method)))


def moe_forward(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: PackedExperts | torch.Tensor,
) -> torch.Tensor:
    """Routed-experts MoE forward on the CPU.

    ``out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with
    ``e = topk_ids[t, j]``; slots with id ``-1`` are skipped.

    Args:
        hidden_states: ``[T, H]`` bf16, fp16 or fp32, contiguous, CPU.
        topk_ids: ``[T, K]`` int32 or int64, values in ``[-1, E)``.
        topk_weights: ``[T, K]`` fp32, bf16 or fp16.
        packed: a :class:`PackedExperts` or its ``data`` tensor.

    Returns:
        ``[T, H]`` in the dtype of ``hidden_states`` (a new tensor).
    """
    data = packed.data if isinstance(packed, PackedExperts) else packed
    return torch.ops.kt.moe_forward(hidden_states, topk_ids, topk_weights, data)
