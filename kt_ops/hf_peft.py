"""PEFT LoRA adapters on kt_ops experts: ``get_peft_model(model, LoraConfig(target_parameters=...))``.

transformers v5 stores a layer's routed experts as fused parameters (``experts.gate_up_proj``
``[E, 2I, H]``, ``experts.down_proj [E, H, I]``, or transposed); PEFT adapts them with
``LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])``:
its ``ParamWrapper`` keeps per-expert factors (``lora_A`` ``[E * r, in]``, ``lora_B``
``[out, E * r]``) and, for each forward, parametrizes the parameter as ``W + s * B @ A``.
A kt_ops experts module has no ``W`` (its experts live in a packed blob, the parameters are
empty placeholders), so ``import kt_ops`` teaches PEFT's ``ParamWrapper`` two things when
PEFT is imported (:func:`patch`), for packed experts modules only:

- the targeted parameter's shape is the one it had before packing (``in``/``out`` features,
  expert count);
- activating the adapter hands the LoRA factors to the module (no parametrization, no dense
  ``E x out x in`` delta): :func:`lora_forward` then runs ``kt::moe_lora_forward`` — the
  frozen base of any format plus the adapter, differentiable w.r.t. the PEFT weights.

PEFT's fused ``gate_up_proj`` adapter has one ``A`` for gate and up and a ``B`` of ``2I``
rows; it maps onto kt_ops' per-projection layout as ``gate_a = up_a = A`` and ``B`` split
into its gate and up rows (concatenated or interleaved as the class stores them). Saved
adapters are PEFT's own files: an unpatched transformers model loads them with
``PeftModel.from_pretrained``. Not supported (a clear error): several adapters active at
once, merging an adapter into packed experts, and experts kept in torch (GPU experts).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from kt_ops import hf_experts

_PATCHED = "_kt_ops_patched"


def _packed_base(wrapper: Any) -> nn.Module | None:
    """The experts module under a PEFT wrapper when kt_ops packed it, else None."""
    base = wrapper.get_base_layer()
    if hf_experts.is_experts_module(base) and hf_experts.packed_blob(base) is not None:
        return base
    return None


def _pack_if_kt_ops(wrapper: Any) -> None:
    """Packs the experts module under a PEFT wrapper now when it runs kt_ops but is not packed
    yet (``experts_implementation="kt_ops"`` without :func:`kt_ops.hf_experts.pack_model_experts`
    packs on the first call). Packing on that call, under PEFT's parametrization, packed
    ``W + B A``: the blob kept the adapter's delta, every later call added it again, and the
    packing call's output had no gradient for the experts' LoRA factors."""
    base = wrapper.get_base_layer()
    config = getattr(base, "config", None)
    if (hf_experts.is_experts_module(base) and hf_experts.packed_blob(base) is None
            and getattr(config, "_experts_implementation", None) == hf_experts.IMPLEMENTATION
            and not torch.compiler.is_compiling()):
        hf_experts.pack_module_experts(base)


# ParamWrapper's methods that patch() replaces or calls.
_WRAPPER_METHODS = ("_get_in_out_features", "_activate_lora", "merge", "get_delta_factors")


def patch(layer_module: Any) -> None:
    """Patches ``peft.tuners.lora.layer.ParamWrapper`` (once) for packed experts modules. A
    PEFT without it (or without the methods patched and used here: older than LoRA on
    parameters) is left alone: the user's ``import peft`` goes on."""
    wrapper = getattr(layer_module, "ParamWrapper", None)
    if wrapper is None or not all(hasattr(wrapper, name) for name in _WRAPPER_METHODS):
        return
    if getattr(wrapper, _PATCHED, False):
        return
    original_features = wrapper._get_in_out_features
    original_activate = wrapper._activate_lora
    original_merge = wrapper.merge

    def _get_in_out_features(self: Any, module: nn.Module) -> Any:
        base = _packed_base(self)
        shape = None if base is None else hf_experts.stored_shape(base, self.parameter_name)
        if shape is None:
            return original_features(self, module)
        num_experts, in_features, out_features = shape
        self.num_experts = num_experts
        self._param_ndim = 3
        return in_features, out_features

    @contextmanager
    def _activate_lora(self: Any, active_adapters: list[str]) -> Iterator[None]:
        _pack_if_kt_ops(self)
        base = _packed_base(self)
        if base is None:
            with original_activate(self, active_adapters):
                yield
            return
        adapters = [a for a in active_adapters if a in self.lora_A]
        if not adapters:
            yield
            return
        if len(adapters) > 1:
            raise ValueError(f"{type(base).__name__}: kt_ops runs one LoRA adapter on packed experts at a time; "
                             f"active: {adapters}")
        lhs, rhs, scaling = self.get_delta_factors(adapters[0])
        active = base.__dict__.setdefault(hf_experts._LORA, {})
        active[self.parameter_name] = (lhs, rhs, float(scaling), bool(self._did_swap_in_out_features))
        try:
            yield
        finally:
            active.pop(self.parameter_name, None)

    def merge(self: Any, *args: Any, **kwargs: Any) -> None:
        base = _packed_base(self)
        if base is not None:
            raise ValueError(f"{type(base).__name__}: a LoRA adapter cannot be merged into packed experts; save the "
                             "adapter and merge it into the float model (or pack the merged weights again)")
        return original_merge(self, *args, **kwargs)

    wrapper._get_in_out_features = _get_in_out_features
    wrapper._activate_lora = _activate_lora
    wrapper.merge = merge
    setattr(wrapper, _PATCHED, True)


def _untransposed(lhs: torch.Tensor, rhs: torch.Tensor, swapped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B [E, out, r], A [E, r, in])`` in Hugging Face orientation (``delta = B @ A``, ``[E,
    out, in]``) from PEFT's factors (``delta = lhs @ rhs`` in the parameter's own layout)."""
    if swapped:  # parameter stored [E, out, in]
        return lhs, rhs
    return rhs.transpose(1, 2), lhs.transpose(1, 2)  # stored [E, in, out]: delta^T = rhs^T lhs^T


def lora_tensors(module: nn.Module, active: dict[str, tuple]) -> tuple[torch.Tensor, ...]:
    """The six LoRA tensors of ``kt::moe_lora_forward`` (scaling folded into the ``B``s) from
    the PEFT factors an experts module was handed; a projection without an adapter gets zeros."""
    E, *rest = hf_experts.stored_shape(module, "down_proj")
    H, I = (rest[1], rest[0]) if module.is_transposed else (rest[0], rest[1])
    parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, (lhs, rhs, scaling, swapped) in active.items():
        b, a = _untransposed(lhs, rhs, swapped)
        parts[name] = (b * scaling, a)
    rank = max((a.shape[1] for _, a in parts.values()), default=1)
    reference = next(iter(parts.values()))[1]

    def padded(t: torch.Tensor, dim: int) -> torch.Tensor:
        missing = rank - t.shape[dim]
        if missing == 0:
            return t
        pad = list(t.shape)
        pad[dim] = missing
        return torch.cat([t, t.new_zeros(pad)], dim=dim)

    zeros = {"a_h": reference.new_zeros(E, rank, H), "a_i": reference.new_zeros(E, rank, I),
             "b_i": reference.new_zeros(E, I, rank), "b_h": reference.new_zeros(E, H, rank)}
    if "gate_up_proj" in parts:
        b, a = parts["gate_up_proj"]
        b, a = padded(b, 2), padded(a, 1)
        gate_b, up_b = (b[:, :I], b[:, I:]) if module.is_concatenated else (b[:, 0::2], b[:, 1::2])
        gate_a = up_a = a
    else:
        gate_a, up_a, gate_b, up_b = zeros["a_h"], zeros["a_h"], zeros["b_i"], zeros["b_i"]
    if "down_proj" in parts:
        down_b, down_a = parts["down_proj"]
        down_b, down_a = padded(down_b, 2), padded(down_a, 1)
    else:
        down_a, down_b = zeros["a_i"], zeros["b_h"]
    return gate_a, gate_b.contiguous(), up_a, up_b.contiguous(), down_a, down_b


def lora_forward(module: nn.Module, active: dict[str, tuple], hidden_states: torch.Tensor,
                 top_k_index: torch.Tensor, top_k_weights: torch.Tensor, blob: torch.Tensor) -> torch.Tensor:
    """An experts module's forward with the PEFT adapter it was handed (``kt::moe_lora_forward``)."""
    if hf_experts.local_experts(module) is not None or module.__dict__.get(hf_experts._ROUTE) is not None:
        raise ValueError(f"{type(module).__name__}: LoRA on experts kept in torch (GPU experts) is not supported; "
                         "pack every expert (num_gpu_experts=0) to train a LoRA adapter through kt_ops")
    tensors = lora_tensors(module, active)
    tensors = tuple(t.to(hidden_states.device) for t in tensors)
    out, _gate_up = torch.ops.kt.moe_lora_forward(hidden_states.contiguous(), top_k_index.contiguous(),
                                                  top_k_weights.contiguous(), blob, *tensors, 1.0)
    return out
