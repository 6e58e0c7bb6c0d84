"""The plain-PyTorch MoE layer: the per-expert loop of Hugging Face's Qwen3-MoE block."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def torch_moe_forward(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """``[T, H]`` in the dtype of ``hidden_states``; weights ``[E, I, H]``, ``[E, H, I]``."""
    num_experts = gate_proj.shape[0]
    out = torch.zeros_like(hidden_states)
    expert_mask = F.one_hot(topk_ids.long(), num_classes=num_experts).permute(2, 1, 0)
    hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in hit.flatten().tolist():
        slot, token = torch.where(expert_mask[expert])
        x = hidden_states[token]
        h = F.silu(F.linear(x, gate_proj[expert])) * F.linear(x, up_proj[expert])
        y = F.linear(h, down_proj[expert]) * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(hidden_states.dtype))
    return out
