"""Autograd for ``kt::moe_forward``, ``kt::moe_forward_parts``, ``kt::moe_forward_train`` and
``kt::moe_lora_forward``.

The inference operators' autograd kernels are C++ (``csrc/ops/autograd.cpp``): a call that
needs no gradient goes straight to the CPU or CUDA kernel, with no Python on the way (a
Python registration ran torch's generated autograd function on every call: ~10 us). The
training operators' are registered here (:func:`torch.library.register_autograd`).

The packed experts are frozen. The backwards are operators of their own
(``kt::moe_backward``, ``kt::moe_train_backward``, ``kt::moe_lora_backward``; schemas in
``csrc/ops/library.cpp``, fakes in :mod:`kt_ops.fakes`, CPU kernels in
``csrc/ops/moe_train_cpu.cpp``): one pass over the experts the live tokens route to, each
expert dequantized to fp32 (the values the inference kernels multiply) and differentiated
with fp32 GEMMs. Gradients flow to ``hidden_states`` and ``topk_weights`` (and the six LoRA
matrices, or ``gate_up_delta``); ``topk_ids`` and the blob get none. Rows past
``live_tokens`` get zero gradients. CUDA inputs are computed on the host and copied back.

Two ways to get ``g`` and ``u`` (gate and up before the activation) for the backward:

- **Saved** (:func:`moe_forward`, which :func:`kt_ops.moe_forward`, the transformers
  path and ``HybridMoE`` call): when a gradient is needed, the forward runs
  ``kt::moe_forward_train`` — the inference kernel, which also writes each slot's ``g`` and
  ``u`` as fp32 ``[T, K, 2I]`` (``8 I`` bytes per (token, slot): 25 MB for 512 tokens of a
  Qwen3-30B-A3B layer) — and the backward reads them. The backward's GEMMs are then two
  per expert (``G Wd`` and ``[dg du] [Wg; Wu]``) instead of three.
- **Recomputed** (``torch.ops.kt.moe_forward`` called directly, and
  :func:`set_save_gate_up` ``(False)``): the forward saves only its inputs and the backward
  recomputes ``x [Wg; Wu]^T`` in fp32.

The gradient is that of the layer with the dequantized weights, activated at the ``g`` and
``u`` of the path taken: the kernel's own values when saved (its activation quantization
included, a straight-through estimate for the int8-activation formats), the ideal fp32
values when recomputed.
"""

from __future__ import annotations

import torch

from kt_ops._native import _C  # also registers the kt:: operators
from kt_ops._validate import require_bools


# kt::moe_forward's overload, looked up once: ``torch.ops.kt.moe_forward(...)`` walks the
# namespace, the packet and its overloads (~0.5 us) on every call.
MOE_FORWARD = torch.ops.kt.moe_forward.default


def _on_host(op: object):
    """The CUDA key of a training op: its CPU kernel on host copies, results copied back."""
    def kernel(*args: object) -> object:
        device = next(a.device for a in args if isinstance(a, torch.Tensor) and a.device.type != "cpu")
        host = tuple(a.to("cpu") if isinstance(a, torch.Tensor) and a.device.type != "cpu" else a for a in args)
        out = op(*host)
        return tuple(t.to(device) for t in out) if isinstance(out, tuple) else out.to(device)
    return kernel


_save_gate_up = True


def set_save_gate_up(save: bool) -> None:
    """Whether :func:`moe_forward` saves ``g`` and ``u`` for the backward when a gradient is
    needed (default ``True``: the backward ~1.65x faster for an S1 layer at 512 tokens on Zen 3,
    ``8 I`` bytes per (token, slot) held until the backward) or recomputes them there (the
    forward holds only its inputs). ``ValueError`` for anything but a bool."""
    global _save_gate_up
    require_bools(save=save)  # bool("False") is True: saving stayed on silently
    _save_gate_up = save


def saves_gate_up(hidden_states: torch.Tensor, topk_weights: torch.Tensor) -> bool:
    """Whether :func:`moe_forward` takes the saving path for these inputs: CPU inputs only
    (CUDA inputs keep ``kt::moe_forward``'s stream-ordered CUDA key and the recomputing
    backward)."""
    # requires_grad first: an inference call (no input requiring a gradient) answers on it.
    return (_save_gate_up and (hidden_states.requires_grad or topk_weights.requires_grad)
            and torch.is_grad_enabled() and hidden_states.device.type == "cpu")


def blob_intermediate_size(blob: torch.Tensor) -> int | None:
    """A raw blob's ``I`` from its header, read eagerly (``None`` while compiling: the blob is
    a FakeTensor there, and :func:`moe_forward` falls back to the recomputing backward)."""
    if torch.compiler.is_compiling() or blob.device.type != "cpu" or blob.dtype != torch.uint8:
        return None
    return int(_C.packed_info(blob)["intermediate_size"])


def moe_forward(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                packed: torch.Tensor, intermediate_size: int | None,
                live_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """``kt::moe_forward``, or ``kt::moe_forward_train`` (saving ``g`` and ``u``) when autograd
    will need the backward: grad mode on, ``hidden_states`` or ``topk_weights`` requiring a
    gradient, ``intermediate_size`` (the packed layer's ``I``) known, saving enabled
    (:func:`set_save_gate_up`). Same arguments and result as ``kt::moe_forward``."""
    if intermediate_size is not None and saves_gate_up(hidden_states, topk_weights):
        out, _ = torch.ops.kt.moe_forward_train(hidden_states, topk_ids, topk_weights, packed, int(intermediate_size),
                                                None, live_tokens)
        return out
    return MOE_FORWARD(hidden_states, topk_ids, topk_weights, packed, live_tokens)


def _train_setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    hidden_states, topk_ids, topk_weights, packed, _size, delta, live_tokens = (*inputs, None, None)[:7]
    gate_up = output[1]
    ctx.mark_non_differentiable(gate_up)
    ctx.delta_dtype = None if delta is None else delta.dtype
    ctx.save_for_backward(hidden_states, topk_ids, topk_weights, packed, gate_up,
                          *(() if live_tokens is None else (live_tokens,)))


def _train_backward(ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor,
                    _grad_gate_up: torch.Tensor | None) -> tuple:
    hidden_states, topk_ids, topk_weights, packed, gate_up, *live = ctx.saved_tensors
    grad_x, grad_w, grad_gu = torch.ops.kt.moe_train_backward(grad_output.contiguous(), hidden_states, topk_ids,
                                                              topk_weights, packed, gate_up,
                                                              live[0] if live else None)
    needs = (*ctx.needs_input_grad, False, False, False)
    grad_delta = grad_gu.to(ctx.delta_dtype) if needs[5] and ctx.delta_dtype is not None else None
    return (grad_x if needs[0] else None, None, grad_w if needs[2] else None, None, None, grad_delta, None)


def _lora_setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    *tensors, scaling, live_tokens = (*inputs, None)[:12]
    gate_up = output[1]
    ctx.mark_non_differentiable(gate_up)
    ctx.scaling = scaling
    ctx.has_live = live_tokens is not None
    ctx.save_for_backward(*tensors, gate_up, *(() if live_tokens is None else (live_tokens,)))


def _lora_backward(ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor,
                   _grad_gate_up: torch.Tensor | None) -> tuple:
    x, ids, w, packed, *rest = ctx.saved_tensors
    lora, gate_up = rest[:6], rest[6]
    live = rest[7] if ctx.has_live else None
    grads = torch.ops.kt.moe_lora_backward(grad_output.contiguous(), x, ids, w, packed, *lora, ctx.scaling, live,
                                           gate_up)
    needs = (*ctx.needs_input_grad, False, False)
    grad_x, grad_w, *grad_lora = grads
    return (grad_x if needs[0] else None, None, grad_w if needs[2] else None, None,
            *(g if needs[4 + i] else None for i, g in enumerate(grad_lora)), None, None)


for _name in ("moe_backward", "moe_forward_train", "moe_train_backward", "moe_lora_forward", "moe_lora_backward"):
    torch.library.impl(f"kt::{_name}", "CUDA")(_on_host(getattr(torch.ops.kt, _name).default))
torch.library.register_autograd("kt::moe_forward_train", _train_backward, setup_context=_train_setup_context)
torch.library.register_autograd("kt::moe_lora_forward", _lora_backward, setup_context=_lora_setup_context)


def _no_double_backward(name: str):
    """The autograd of a backward operator: differentiating it (a gradient penalty,
    ``create_graph=True`` then another ``grad``) is not implemented. Without this, torch's
    not-implemented fallback gave the gradient's graph no edge to the inputs, so a second
    derivative came back as None (zero) instead of an error."""
    def backward(ctx: torch.autograd.function.FunctionCtx, *grads: torch.Tensor) -> tuple:
        raise RuntimeError(f"kt::{name}: double backward (differentiating a gradient of kt_ops' MoE operators, e.g. "
                           "a gradient penalty) is not implemented")
    return backward


def _no_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: object) -> None:
    pass


for _name in ("moe_backward", "moe_train_backward", "moe_lora_backward"):
    torch.library.register_autograd(f"kt::{_name}", _no_double_backward(_name), setup_context=_no_context)
