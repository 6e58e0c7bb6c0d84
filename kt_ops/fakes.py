"""Fake (meta) implementations of every ``torch.ops.kt`` operator, one per schema.

``TORCH_LIBRARY(kt, m)`` names this module with ``set_python_module``; a test checks
that the schemas and the fakes match one to one. Fakes compute output shapes and dtypes
only, so ``torch.compile`` and FakeTensor tracing never touch the data.
"""

import torch

from kt_ops._native import _C


@torch.library.register_fake("kt::moe_forward")
def _moe_forward_fake(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: torch.Tensor,
    live_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    torch._check(hidden_states.dim() == 2, lambda: f"hidden_states must be 2-D, got {hidden_states.shape}")
    torch._check(topk_ids.dim() == 2, lambda: f"topk_ids must be 2-D, got {topk_ids.shape}")
    torch._check(
        topk_ids.shape[0] == hidden_states.shape[0],
        lambda: f"topk_ids has {topk_ids.shape[0]} rows but hidden_states has {hidden_states.shape[0]} tokens",
    )
    torch._check(
        topk_weights.shape == topk_ids.shape,
        lambda: f"topk_weights must have the shape of topk_ids {topk_ids.shape}, got {topk_weights.shape}",
    )
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


@torch.library.register_fake("kt::pack_experts")
def _pack_experts_fake(
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    format: str,
    group_size: int = 0,
    scale_search: bool = False,
) -> torch.Tensor:
    experts, intermediate, hidden = gate_proj.shape
    nbytes = _C.packed_nbytes(format, int(experts), int(hidden), int(intermediate), int(group_size))
    return gate_proj.new_empty((nbytes,), dtype=torch.uint8)


@torch.library.register_fake("kt::pack_gguf_experts")
def _pack_gguf_experts_fake(
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gguf_types: list[int],
) -> torch.Tensor:
    experts, intermediate, hidden = gate_proj.shape
    nbytes = _C.gguf_packed_nbytes(list(gguf_types), int(experts), int(hidden), int(intermediate))
    return gate_proj.new_empty((nbytes,), dtype=torch.uint8)


@torch.library.register_fake("kt::pack_fp8_experts")
def _pack_fp8_experts_fake(
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_scale: torch.Tensor,
    up_scale: torch.Tensor,
    down_scale: torch.Tensor,
    format: str,
) -> torch.Tensor:
    experts, intermediate, hidden = gate_proj.shape
    nbytes = _C.packed_nbytes(format, int(experts), int(hidden), int(intermediate), 0)
    return gate_proj.new_empty((nbytes,), dtype=torch.uint8)


@torch.library.register_fake("kt::pack_int4_experts")
def _pack_int4_experts_fake(
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_scale: torch.Tensor,
    up_scale: torch.Tensor,
    down_scale: torch.Tensor,
    gate_min: torch.Tensor | None,
    up_min: torch.Tensor | None,
    down_min: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    experts, intermediate, half_hidden = gate_proj.shape
    fmt = "int4" if gate_min is None else "int4_asym"
    nbytes = _C.packed_nbytes(fmt, int(experts), 2 * int(half_hidden), int(intermediate), int(group_size))
    return gate_proj.new_empty((nbytes,), dtype=torch.uint8)


def _inference_only(ctx: object, grad: torch.Tensor) -> None:
    raise RuntimeError("kt::moe_forward is an inference kernel and has no backward")


def _no_context(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    return None


torch.library.register_autograd("kt::moe_forward", _inference_only, setup_context=_no_context)
