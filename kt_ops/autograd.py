"""Autograd for ``kt::moe_forward`` and ``kt::moe_lora_forward``.

The packed experts are frozen. The backwards are operators of their own
(``kt::moe_backward``, ``kt::moe_lora_backward``; schemas in ``csrc/ops/library.cpp``,
fakes in :mod:`kt_ops.fakes`, CPU kernels in ``csrc/ops/moe_train_cpu.cpp``): one pass over
the experts the live tokens route to, each expert dequantized to fp32 (the values the
inference kernels multiply) and its forward recomputed and differentiated with fp32 GEMMs —
nothing is saved by the forward but its inputs. The gradient is the ideal layer's (weights
as dequantized, activations not quantized), which the inference kernels approximate within
their format's tolerance. Gradients flow to ``hidden_states`` and ``topk_weights`` (and the
six LoRA matrices); ``topk_ids`` and the blob get none. Rows past ``live_tokens`` get zero
gradients. CUDA inputs are computed on the host and copied back.
"""

from __future__ import annotations

import torch

from kt_ops._native import _C  # noqa: F401  (registers the kt:: operators)


def _on_host(op: object):
    """The CUDA key of a training op: its CPU kernel on host copies, results copied back."""
    def kernel(*args: object) -> object:
        device = next(a.device for a in args if isinstance(a, torch.Tensor) and a.device.type != "cpu")
        host = tuple(a.to("cpu") if isinstance(a, torch.Tensor) and a.device.type != "cpu" else a for a in args)
        out = op(*host)
        return tuple(t.to(device) for t in out) if isinstance(out, tuple) else out.to(device)
    return kernel


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    hidden_states, topk_ids, topk_weights, packed, live_tokens = (*inputs, None)[:5]
    ctx.save_for_backward(hidden_states, topk_ids, topk_weights, packed,
                          *(() if live_tokens is None else (live_tokens,)))


def _backward(ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor) -> tuple:
    hidden_states, topk_ids, topk_weights, packed, *live = ctx.saved_tensors
    grad_x, grad_w = torch.ops.kt.moe_backward(grad_output.contiguous(), hidden_states, topk_ids, topk_weights,
                                               packed, live[0] if live else None)
    needs = ctx.needs_input_grad
    return (grad_x if needs[0] else None, None, grad_w if needs[2] else None, None, None)


def _lora_setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    *tensors, scaling, live_tokens = (*inputs, None)[:12]
    ctx.scaling = scaling
    ctx.save_for_backward(*tensors, *(() if live_tokens is None else (live_tokens,)))


def _lora_backward(ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor) -> tuple:
    x, ids, w, packed, *rest = ctx.saved_tensors
    lora, live = rest[:6], rest[6:]
    grads = torch.ops.kt.moe_lora_backward(grad_output.contiguous(), x, ids, w, packed, *lora, ctx.scaling,
                                           live[0] if live else None)
    needs = ctx.needs_input_grad
    grad_x, grad_w, *grad_lora = grads
    return (grad_x if needs[0] else None, None, grad_w if needs[2] else None, None,
            *(g if needs[4 + i] else None for i, g in enumerate(grad_lora)), None, None)


def _parts_setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    hidden_states, topk_ids, topk_weights, parts, _nodes = inputs
    ctx.num_parts = len(parts)
    ctx.save_for_backward(hidden_states, topk_ids, topk_weights, *parts)


def _parts_backward(ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor) -> tuple:
    """``moe_forward_parts`` is the sum of its parts' ``moe_forward``: the gradients are the
    sums of the parts' ``moe_backward``, in part order."""
    hidden_states, topk_ids, topk_weights, *parts = ctx.saved_tensors
    grad_x = grad_w = None
    for part in parts:
        gx, gw = torch.ops.kt.moe_backward(grad_output.contiguous(), hidden_states, topk_ids, topk_weights, part)
        grad_x, grad_w = (gx, gw) if grad_x is None else (grad_x + gx, grad_w + gw)
    needs = ctx.needs_input_grad
    return (grad_x if needs[0] else None, None, grad_w if needs[2] else None, [None] * ctx.num_parts, None)


for _name in ("moe_backward", "moe_lora_forward", "moe_lora_backward"):
    torch.library.impl(f"kt::{_name}", "CUDA")(_on_host(getattr(torch.ops.kt, _name).default))
torch.library.register_autograd("kt::moe_forward", _backward, setup_context=_setup_context)
torch.library.register_autograd("kt::moe_lora_forward", _lora_backward, setup_context=_lora_setup_context)
torch.library.register_autograd("kt::moe_forward_parts", _parts_backward, setup_context=_parts_setup_context)
