"""The oracle: every operator in plain torch with fp32 math.

Slow and simple on purpose; tests compare every kernel, format and CPU variant with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_forward(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """Reference MoE forward in fp32.

    Args:
        hidden_states: ``[T, H]`` any float dtype.
        topk_ids: ``[T, K]`` integer, ``-1`` skips the slot.
        topk_weights: ``[T, K]`` any float dtype.
        gate_proj, up_proj: ``[E, I, H]``; down_proj: ``[E, H, I]`` (unpacked weights,
            e.g. dequantized ones for a quantized format).

    Returns:
        ``[T, H]`` float32: ``sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``.
    """
    x = hidden_states.float()
    weights = topk_weights.float()
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        tokens, slots = torch.nonzero(topk_ids == expert, as_tuple=True)
        h = x[tokens]
        inter = F.silu(h @ gate_proj[expert].float().T) * (h @ up_proj[expert].float().T)
        y = inter @ down_proj[expert].float().T
        out.index_add_(0, tokens, y * weights[tokens, slots, None])
    return out
