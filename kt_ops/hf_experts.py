"""``experts_implementation="kt_ops"``: transformers' MoE experts run by ``torch.ops.kt.moe_forward``.

transformers (v5) routes the experts of every MoE architecture whose experts class is
decorated with ``@use_experts_implementation`` (DeepSeek-V2/V3/V4, Qwen2/3-MoE,
Qwen3-Next, GLM-4-MoE, gpt-oss, MiniMax-M2, Mixtral, OLMoE, ...) through
``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``. ``import kt_ops`` registers
``"kt_ops"`` there — when transformers is imported, not before (transformers stays
optional and ``import kt_ops`` does not pay for importing it). Then::

    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="kt_ops")
    kt_ops.hf_experts.pack_model_experts(model, method="AMXINT4")   # optional: choose the format

or ``model.set_experts_implementation("kt_ops")`` on a built model. Each experts module's
weights are packed once — by :func:`pack_model_experts`, or as ``BF16`` on its first call —
into a host-memory blob kept on the module (``_kt_ops_blob``, a plain attribute: moving
the model to a GPU leaves it in host RAM; inputs on a GPU use the operator's CUDA key).

:func:`pack_model_experts` can keep some experts in torch on the model's device
(``gpu_experts_mask`` / ``num_gpu_experts``, as :class:`kt_ops.HybridMoE`), computed densely
over the batch with the class's own gate; the others are packed.

The decorator's flags are honoured: concatenated or interleaved gate/up, transposed
storage, biases. The activation is read from the class's ``_apply_gate`` by probing it
against kt_ops' variants (``silu(g) * u``, DeepSeek-V4's clamped SwiGLU, gpt-oss's
alpha-SwiGLU) with the module's own ``limit`` / ``alpha``; a gate that is none of them, no
gate (``has_gate=False``), a post-expert norm and expert parallelism are ``ValueError``s
naming the class — never a silent SiLU. ``torch.compile(fullgraph=True)`` needs the
experts packed first (:func:`pack_model_experts`); then the call is one opaque operator.
"""

from __future__ import annotations

import importlib.abc
import re
import sys
from typing import Any, Sequence

import torch
from torch import nn

from kt_ops import autograd, expert_stats, gpu_prefill
from kt_ops._optional import transformers_problem
from kt_ops._validate import is_int, plain_int, require_bools
from kt_ops.dynamic_experts import checked_expert_ids, cpu_route, host_copy, most_activated
from kt_ops.packed import PackedExperts

IMPLEMENTATION = "kt_ops"
_BLOB = "_kt_ops_blob"
BLOB_ATTRIBUTE = _BLOB  # the packed experts of a module (absent until it is packed)
_INTERMEDIATE = "_kt_ops_intermediate_size"  # the blob's I, read once (kt_ops.autograd.moe_forward)
_ROUTE = "_kt_ops_route"  # int64 [E]: expert -> packed index, -1 for the experts kept in torch
_LOCAL = "_kt_ops_local"  # the experts kept in torch: (ids [G], gate_up, gate_up_bias, down, down_bias)
_LOCAL_ON = "_kt_ops_local_on"  # {device: _LOCAL's tensors there}, for inputs on another device
_ROUTE_ON = "_kt_ops_route_on"  # {device: _ROUTE there}
_SOURCE = "_kt_ops_source"  # dynamic: every expert's (gate_up, gate_up_bias, down, down_bias) in host memory
_DERIVED = (_ROUTE, _LOCAL, _LOCAL_ON, _ROUTE_ON, _SOURCE)  # what packing sets besides the blob
_LAYER_ID = "_kt_ops_layer"  # (layer index in the model, E): the module's row in kt_ops.ExpertStats
_SHAPES = "_kt_ops_shapes"  # {"gate_up_proj": shape, "down_proj": shape} as stored before packing
_PACKED_WITH = "_kt_ops_packed_with"  # pack_module_experts' arguments, to repack after load_state_dict
_VERSIONS = "_kt_ops_versions"  # {expert tensor: (data_ptr, _version)} as packed from (_repack_if_edited)
_LORA = "_kt_ops_lora"  # {parameter name: PEFT LoRA factors} while a PEFT adapter is active (kt_ops.hf_peft)
_PEFT_MODULE = "peft.tuners.lora.layer"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_MOE_MODULE = "transformers.integrations.moe"
EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")  # an experts class's weights


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``kt_ops`` experts function: ``hidden_states [T, H]``, ``top_k_index [T, K]``,
    ``top_k_weights [T, K]`` -> ``[T, H]`` in ``hidden_states``' dtype."""
    blob = getattr(self, _BLOB, None)
    if blob is None:
        if torch.compiler.is_compiling():
            raise RuntimeError(f"{type(self).__name__}: kt_ops experts are packed on their first eager call; call "
                               "kt_ops.hf_experts.pack_model_experts(model) (or run the model once) before "
                               "torch.compile")
        blob = pack_module_experts(self)
    elif not torch.compiler.is_compiling():
        _repack_if_edited(self)
        blob = getattr(self, _BLOB)
    layer_id, experts = getattr(self, _LAYER_ID, None) or (None, 0)
    expert_stats.record(layer_id, top_k_index, experts)  # kt_ops.ExpertStats (a no-op outside one)
    local = getattr(self, _LOCAL, None)
    if local is not None:
        local = _on(self, _LOCAL_ON, local, hidden_states.device)
    if self.__dict__.get(_LORA):  # a PEFT LoRA adapter on the experts (kt_ops.hf_peft)
        from kt_ops.hf_peft import lora_forward

        return lora_forward(self, self.__dict__[_LORA], hidden_states, top_k_index, top_k_weights, blob)
    if blob.numel() == 0:  # every expert kept in torch
        return _local_experts(self, local, hidden_states, top_k_index, top_k_weights)
    route = getattr(self, _ROUTE, None)
    ids = top_k_index if route is None else _packed_ids(_on(self, _ROUTE_ON, route, top_k_index.device), top_k_index)
    x, weights = hidden_states.contiguous(), top_k_weights.contiguous()
    prefill = gpu_prefill.should_run_on_device(x, self.__dict__.get(gpu_prefill.PREFILL_ATTRIBUTE, 0))
    if prefill:
        out = gpu_prefill.moe_forward_on_device(x, ids, weights, PackedExperts(blob),
                                                next_layer=gpu_prefill.next_layer(self))
    elif autograd.saves_gate_up(x, weights):  # training: save gate and up for the backward
        size = self.__dict__.get(_INTERMEDIATE)
        if size is None:
            size = autograd.blob_intermediate_size(blob)
            if size is not None:
                self.__dict__[_INTERMEDIATE] = size
        out = autograd.moe_forward(x, ids.contiguous(), weights, blob, size)
    else:
        out = autograd.MOE_FORWARD(x, ids.contiguous(), weights, blob)
    if local is not None:
        out = out + _local_experts(self, local, hidden_states, top_k_index, top_k_weights)
    if prefill and self.__dict__.get(gpu_prefill.UPDATE_ATTRIBUTE):  # queued after this call's compute
        rebalance_local_experts(self, gpu_prefill.batch_counts(top_k_index, int(self.__dict__[_SOURCE][0].shape[0])))
    return out


def _packed_ids(route: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Expert ids -> packed ids through ``route [E]``; ids outside ``[0, E)`` stay as they are
    (-1 skips the slot, the operator names the others). ``torch.take`` alone read -1 as
    ``route[E - 1]``: a skipped slot computed the last expert, silently. Shape-static."""
    inside = (ids >= 0) & (ids < route.shape[0])
    return torch.where(inside, torch.take(route, torch.where(inside, ids, 0)), ids.to(route.dtype))


def _on(module: nn.Module, cache: str, value: Any, device: torch.device) -> Any:
    """``value`` (a tensor, or a tuple of tensors and Nones: the route, the experts kept in
    torch) on ``device``, copied there once and kept in ``module.__dict__[cache]``: a model
    moved with ``.to()`` / ``.cuda()`` after packing computes where its activations are, and
    once an eager call on a device has run, a captured CUDA graph copies nothing."""
    tensors = value if isinstance(value, tuple) else (value,)
    if all(t is None or t.device == device for t in tensors):
        return value
    copies = module.__dict__.setdefault(cache, {})
    if device not in copies:
        moved = tuple(None if t is None else t.to(device) for t in tensors)
        copies[device] = moved if isinstance(value, tuple) else moved[0]
    return copies[device]


def _local_experts(module: nn.Module, local: tuple, x: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """The experts kept in torch (``gpu_experts_mask``), dense over the tokens on x's device
    with the class's own ``_apply_gate``: ``[T, H]`` in x's dtype (shape-static, for compile
    and CUDA graphs)."""
    expert_ids, gate_up, gate_up_bias, down, down_bias = local
    routed = ids.unsqueeze(-1) == expert_ids.to(ids.device)  # [T, K, G]
    per_expert = (routed * weights.unsqueeze(-1).float()).sum(dim=1)  # [T, G]
    projected = torch.einsum("th,gjh->gtj", x, gate_up.to(x.dtype))
    if gate_up_bias is not None:
        projected = projected + gate_up_bias.to(x.dtype).unsqueeze(1)
    y = torch.einsum("gti,ghi->gth", module._apply_gate(projected), down.to(x.dtype))  # [G, T, H]
    if down_bias is not None:
        y = y + down_bias.to(x.dtype).unsqueeze(1)
    return (y.float() * per_expert.t().unsqueeze(-1)).sum(dim=0).to(x.dtype)


def layer_index(name: str) -> int | None:
    """The decoder-layer index in a module name (``model.layers.3.mlp.experts`` -> 3), or None."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def record_shapes(module: nn.Module) -> None:
    """Keeps the shapes of an experts module's ``gate_up_proj`` and ``down_proj`` (read by
    PEFT's LoRA wrappers once the parameters are released: :mod:`kt_ops.hf_peft`)."""
    if module.__dict__.get(_SHAPES) is None:
        shapes = {name: tuple(getattr(module, name).shape) for name in ("gate_up_proj", "down_proj")
                  if isinstance(getattr(module, name, None), torch.Tensor)}
        if all(len(shape) == 3 for shape in shapes.values()) and len(shapes) == 2:
            module.__dict__[_SHAPES] = shapes


def stored_shape(module: nn.Module, name: str) -> tuple[int, ...] | None:
    """The shape :func:`record_shapes` kept for parameter ``name``, or None."""
    return (module.__dict__.get(_SHAPES) or {}).get(name)


def expert_nbytes(module: nn.Module) -> int:
    """Bytes of one expert's gate, up and down in the module's stored dtype (meta is fine)."""
    E = int(module.down_proj.shape[0])
    return (module.gate_up_proj.numel() + module.down_proj.numel()) // E * module.down_proj.element_size()


def set_layer_ids(model: nn.Module) -> None:
    """Tells every experts module of ``model`` its decoder-layer index (from its name) and
    expert count, so :class:`kt_ops.ExpertStats` counts it under that row, and keeps its
    weights' shapes (:func:`record_shapes`). Call while the expert parameters still have
    their shapes (meta is fine)."""
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        record_shapes(module)
        if getattr(module, _LAYER_ID, None) is None:
            layer = layer_index(name)
            down = getattr(module, "down_proj", None)
            if layer is not None and isinstance(down, torch.Tensor) and down.dim() == 3:
                setattr(module, _LAYER_ID, (layer, int(down.shape[0])))


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is an experts class decorated with ``@use_experts_implementation``."""
    return all(hasattr(module, name) for name in ("has_gate", "is_concatenated", "is_transposed", "_apply_gate"))


def check_supported(module: nn.Module) -> None:
    """``ValueError`` naming the class for experts kt_ops cannot compute (no gate, a
    post-expert norm, expert parallelism, an activation :func:`activation_of` does not find)."""
    name = type(module).__name__
    if not module.has_gate:
        raise ValueError(f"{name} has no gate (has_gate=False: act(up) experts); kt_ops computes gated experts only")
    if getattr(module, "has_post_expert_norm", False):
        raise ValueError(f"{name} applies a norm after each expert (has_post_expert_norm); kt_ops does not")
    if getattr(module, "_is_expert_parallel", False):
        raise ValueError(f"{name} is expert-parallel; kt_ops runs every expert of the layer in this process")
    gate_up = getattr(module, "gate_up_proj", None)
    if isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3:  # (meta is fine: only its shape is read)
        # the activation too, before anything is read or packed: KtOpsConfig found it only while packing,
        # once transformers had read the checkpoint, and its ValueError came out as transformers'
        # RuntimeError about "automatic conversion of the weights"
        activation_of(module, int(gate_up.shape[2 if module.is_transposed else 1]) // 2)


def _split(gate_up: torch.Tensor, concatenated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up halves of ``[..., 2I, ...]`` along dim -2 (rows): ``[gate; up]`` or interleaved."""
    if concatenated:
        half = gate_up.shape[-2] // 2
        return gate_up[..., :half, :], gate_up[..., half:, :]
    return gate_up[..., 0::2, :], gate_up[..., 1::2, :]


def _numbers(module: nn.Module, names: tuple[str, ...]) -> list[float]:
    found = []
    for owner in (module, getattr(module, "config", None)):
        for name in names:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                found.append(float(value))
    return found


def activation_of(module: nn.Module, intermediate: int) -> tuple[float, float]:
    """``(swiglu_limit, swiglu_alpha)`` of the module's ``_apply_gate``, found by running it on
    probe values (clamps reached) and comparing with :func:`kt_ops.reference.glu` for each
    candidate built from the module's ``limit``/``alpha`` (or ``swiglu_*``) attributes and its
    config; ``ValueError`` naming the class when none matches."""
    from kt_ops import reference

    limits = [0.0, *_numbers(module, ("limit", "swiglu_limit"))]
    alphas = [0.0, *_numbers(module, ("alpha", "swiglu_alpha"))]
    # probes past every candidate limit: a probe inside [-12, 12] never reached a clamp at 12 or
    # above, so the unclamped candidate matched first and such a limit was dropped, silently
    reach = max(12.0, 2.0 * max(limits))
    g = torch.Generator().manual_seed(0)
    probe = torch.rand(32, 2 * intermediate, generator=g, device="cpu", dtype=torch.float32) * (2 * reach) - reach
    with torch.no_grad():
        got = module._apply_gate(probe).float()
    gate, up = _split(probe.unsqueeze(-1), module.is_concatenated)
    gate, up = gate.squeeze(-1), up.squeeze(-1)
    for alpha in alphas:
        for limit in limits:
            want = reference.glu(gate, up, limit, alpha)
            if want.shape == got.shape and torch.allclose(want, got, rtol=1e-4, atol=1e-5):
                return limit, alpha
    raise ValueError(f"{type(module).__name__}._apply_gate is an activation kt_ops does not compute (act_fn "
                     f"{getattr(module, 'act_fn', None)!r}; tried silu(g) * u, clamped at {limits[1:] or 'no limit'}, "
                     f"and alpha-SwiGLU with alpha {alphas[1:] or 'none'})")


def _stored(module: nn.Module, tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """``tensors``, or the module's own expert tensors (:data:`EXPERT_TENSORS` it has)."""
    if tensors is not None:
        return tensors
    return {name: getattr(module, name).detach() for name in EXPERT_TENSORS if getattr(module, name, None) is not None}


def _untransposed(module: nn.Module, source: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up [E, 2I, H]`` and ``down [E, H, I]`` (views) whatever the module's storage."""
    gate_up, down = source["gate_up_proj"], source["down_proj"]
    if module.is_transposed:  # stored [E, H, 2I] and [E, I, H]
        return gate_up.transpose(1, 2), down.transpose(1, 2)
    return gate_up, down


def release_weights(module: nn.Module) -> int:
    """Replaces the module's expert tensors by empty parameters (its packed blob computes
    them now); returns the bytes they held. ``load_state_dict`` of a state dict holding
    them is refused from then on (:func:`_refuse_released_experts`)."""
    released = 0
    for name in EXPERT_TENSORS:
        param = getattr(module, name, None)
        if isinstance(param, torch.Tensor):
            released += param.numel() * param.element_size()
            setattr(module, name, nn.Parameter(param.new_empty(0), requires_grad=False))
    refuse_released_on_load(module)
    return released


def refuse_released_on_load(module: nn.Module) -> None:
    """Registers :func:`_refuse_released_experts` on ``module`` once (its expert tensors are, or
    are about to be, empty placeholders of its packed blob)."""
    if not module.__dict__.get("_kt_ops_release_hook"):
        module.register_load_state_dict_pre_hook(_refuse_released_experts)
        module.__dict__["_kt_ops_release_hook"] = True


def _refuse_released_experts(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook of a module whose expert tensors were released: the packed
    experts are a plain attribute, not in any state dict, and the released tensors are empty,
    so loading one kept the module's own experts, silently (or packed the empty tensors: an
    IndexError). A ``RuntimeError`` naming the module when ``state_dict`` has its experts."""
    keys = [prefix + name for name in EXPERT_TENSORS if prefix + name in state_dict]
    released = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
    if keys and all(isinstance(t, torch.Tensor) and not t.is_meta and t.numel() == 0 for t in released):
        raise RuntimeError(f"{prefix.rstrip('.') or type(module).__name__}: its expert tensors were released when "
                           "kt_ops packed them (patch_model, KtOpsConfig): the packed experts are not part of a "
                           "state_dict, so "
                           f"{keys[0]} cannot be loaded here; load the unpatched model's weights before patching, "
                           "or leave the experts' keys out of the state dict")


def module_weights(module: nn.Module, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The keyword arguments of :func:`kt_ops.pack_experts` that describe ``module``: ``gate [E,
    I, H]``, ``up``, ``down [E, H, I]`` (CPU, stored dtype), ``biases`` or None,
    ``swiglu_limit``, ``swiglu_alpha``. ``tensors``: ``gate_up_proj``, ``down_proj`` (and
    ``gate_up_proj_bias``, ``down_proj_bias``) in the module's layout, instead of its own
    parameters (while a checkpoint loads)."""
    check_supported(module)
    source = _stored(module, tensors)
    gate_up, down = _untransposed(module, source)
    if gate_up.is_meta or down.is_meta:
        raise ValueError(f"{type(module).__name__}: the expert weights are on the meta device (not loaded, or "
                         "offloaded by accelerate: device_map 'disk', cpu_offload); kt_ops packs their values, so "
                         "load the experts into memory first")
    gate, up = _split(gate_up, module.is_concatenated)
    biases = None
    if getattr(module, "has_bias", False):
        gate_up_bias = source["gate_up_proj_bias"].unsqueeze(-1)
        gate_bias, up_bias = (b.squeeze(-1).cpu() for b in _split(gate_up_bias, module.is_concatenated))
        biases = (gate_bias, up_bias, source["down_proj_bias"].cpu())
    limit, alpha = activation_of(module, int(gate.shape[1]))
    return {"gate_proj": gate.cpu().contiguous(), "up_proj": up.cpu().contiguous(),
            "down_proj": down.cpu().contiguous(), "biases": biases, "swiglu_limit": limit, "swiglu_alpha": alpha}


def pack_module_experts(module: nn.Module, method: str = "BF16", tensors: dict[str, torch.Tensor] | None = None,
                        gpu_experts_mask: torch.Tensor | None = None, dynamic: bool = False,
                        **pack_args: Any) -> torch.Tensor:
    """Packs one experts module into ``method`` (``pack_args``: ``group_size``, ``gguf_type``,
    ``scale_search`` as :func:`kt_ops.pack_experts`; ``tensors`` as :func:`module_weights`),
    keeps the blob on the module and returns it. ``gpu_experts_mask`` (bool ``[E]``): those
    experts are not packed but kept in torch on the module's device (its ``gate_up_proj``'s;
    pass ``tensors`` on that device while loading), computed densely over the batch.
    ``dynamic``: every expert is packed and a host copy of every expert's weights kept, so
    :func:`update_local_experts` can change which ones run in torch at run time."""
    from kt_ops.ops import pack_experts

    require_bools(dynamic=dynamic)  # "no" is truthy: every expert packed, host copies kept
    if tensors is None:
        record_shapes(module)
    weights = module_weights(module, tensors)
    gate, up, down = weights.pop("gate_proj"), weights.pop("up_proj"), weights.pop("down_proj")
    E = int(gate.shape[0])
    # What the module gets besides its blob, set only once the blob is packed: a packing that
    # fails or is interrupted (Ctrl-C) keeps the module as it was (a new route with the old
    # blob computed the wrong experts, silently).
    derived: dict[str, Any] = {}
    if dynamic:
        if gpu_experts_mask is None:
            raise ValueError(f"{type(module).__name__}: dynamic=True needs gpu_experts_mask (the first GPU experts)")
        source = _stored(module, tensors)
        gate_up_all, down_all = _untransposed(module, source)
        biases_all = [source.get(name) if getattr(module, "has_bias", False) else None
                      for name in ("gate_up_proj_bias", "down_proj_bias")]
        derived[_SOURCE] = tuple(None if t is None else host_copy(t)
                                 for t in (gate_up_all, biases_all[0], down_all, biases_all[1]))
    if gpu_experts_mask is not None:
        mask = torch.as_tensor(gpu_experts_mask).to("cpu")
        if mask.dtype != torch.bool or mask.shape != (E,):
            raise ValueError(f"{type(module).__name__}: gpu_experts_mask must be bool [{E}], got {mask.dtype} "
                             f"{tuple(mask.shape)}")
        if bool(mask.any()):
            source = _stored(module, tensors)
            gate_up, down_local = _untransposed(module, source)
            keep = torch.nonzero(mask).reshape(-1)
            on = gate_up.device
            bias = source.get("gate_up_proj_bias") if getattr(module, "has_bias", False) else None
            down_bias = source.get("down_proj_bias") if getattr(module, "has_bias", False) else None
            derived[_LOCAL] = (keep.to(on), gate_up[keep.to(on)].contiguous(),
                               None if bias is None else bias[keep.to(bias.device)].contiguous(),
                               down_local[keep.to(on)].contiguous(),
                               None if down_bias is None else down_bias[keep.to(down_bias.device)].contiguous())
            if dynamic:  # every expert packed; the route skips the ones in torch
                derived[_ROUTE] = cpu_route(keep, E, torch.long)
            else:
                cpu = ~mask
                route = torch.full((E,), -1, dtype=torch.long)
                route[cpu] = torch.arange(int(cpu.sum()))
                derived[_ROUTE] = route
                gate, up, down = gate[cpu], up[cpu], down[cpu]
                if weights["biases"] is not None:
                    weights["biases"] = tuple(None if b is None else b[cpu] for b in weights["biases"])
    versions = _tensor_versions(module) if tensors is None else {}
    if gate.shape[0] == 0:  # every expert kept in torch: nothing for the CPU (an empty blob)
        blob = torch.empty(0, dtype=torch.uint8)
    else:
        blob = pack_experts(gate, up, down, method=method, **weights, **pack_args).data
    for name in _DERIVED:
        module.__dict__.pop(name, None)
    module.__dict__.update(derived)
    _repack_on_load(module, dict(method=method, gpu_experts_mask=gpu_experts_mask, dynamic=dynamic, **pack_args))
    module.__dict__[_VERSIONS] = versions
    setattr(module, _BLOB, blob)
    return blob


def _repack_on_load(module: nn.Module, arguments: dict[str, Any]) -> None:
    """Keeps ``arguments`` and, once per module, a ``load_state_dict`` post-hook that packs
    the loaded experts again with them: the blob is a copy, so without it a model whose
    experts were packed kept computing the experts it had before the load, silently."""
    module.__dict__[_PACKED_WITH] = arguments
    if not module.__dict__.get("_kt_ops_load_hook"):
        module.register_load_state_dict_post_hook(_repack_after_load)
        module.__dict__["_kt_ops_load_hook"] = True


def _tensor_versions(module: nn.Module) -> dict[str, tuple[int, int]]:
    """``(data_ptr, _version)`` of each of the module's expert tensors (:data:`EXPERT_TENSORS`)."""
    versions = {}
    for name in EXPERT_TENSORS:
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor) and not t.is_meta and t.numel():  # released (empty): nothing to pack
            versions[name] = (t.data_ptr(), t._version)
    return versions


def _repack_if_edited(module: nn.Module) -> None:
    """Packs the module again (with :func:`pack_module_experts`' arguments) when an expert
    tensor it was packed from has been changed in place since: the same storage, its version
    counter moved (``with torch.no_grad(): experts.down_proj.mul_(0.5)``, ``.copy_(...)``,
    an optimizer's step). The blob is a copy: without this the layer kept computing the
    old weights, silently. A tensor replaced (moved to another device, converted) is recorded
    anew, not packed again: its values are those packed. A released (empty) tensor is
    forgotten: it has nothing to pack (its version moved by ``load_state_dict`` or a
    ``torch.load`` of the model packed it again: an IndexError). Edits through ``.data``
    have a version counter of their own and are not seen. Eager calls only."""
    recorded = module.__dict__.get(_VERSIONS)
    if not recorded:
        return
    edited = False
    for name, was in list(recorded.items()):
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor) and not t.is_meta and not t.numel():  # released: the blob computes it
            del recorded[name]
            continue
        if not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        now = (t.data_ptr(), t._version)
        if now != was:
            edited |= now[0] == was[0]
            recorded[name] = now
    arguments = module.__dict__.get(_PACKED_WITH)
    if edited and arguments is not None:
        pack_module_experts(module, **arguments)


def _repack_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    arguments = module.__dict__.get(_PACKED_WITH)
    if arguments is None or getattr(module, _BLOB, None) is None:
        return
    weights = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
    if any(not isinstance(w, torch.Tensor) or w.is_meta or w.numel() == 0 for w in weights):
        return  # released (the blob computes them) or not loaded: nothing to pack from
    pack_module_experts(module, **arguments)


def pack_model_experts(model: nn.Module, method: str = "BF16", gpu_experts_mask: torch.Tensor | None = None,
                       num_gpu_experts: int | None = None, dynamic: bool = False, **pack_args: Any) -> int:
    """Packs every experts module of ``model`` (eagerly: required before ``torch.compile``);
    returns how many. ``gpu_experts_mask`` (bool ``[num_moe_layers, E]``, in model order) or
    ``num_gpu_experts`` (experts ``[0, n)`` of each layer) keeps those experts in torch on
    the model's device; ``dynamic``: they can be moved later (:func:`update_local_experts`,
    :func:`kt_ops.rebalance_gpu_experts`). ``ValueError`` naming the class for experts kt_ops
    cannot compute."""
    require_bools(dynamic=dynamic)  # "no" is truthy: every expert packed, host copies kept
    num_gpu_experts = plain_int(num_gpu_experts)  # numpy's integers too, as patch_model's
    set_layer_ids(model)
    modules = [m for m in model.modules() if is_experts_module(m)]
    if gpu_experts_mask is not None and num_gpu_experts is not None:
        raise ValueError("give gpu_experts_mask or num_gpu_experts, not both")
    masks: list[torch.Tensor | None] = [None] * len(modules)
    if gpu_experts_mask is not None:
        mask = torch.as_tensor(gpu_experts_mask)
        if mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[0] != len(modules):
            raise ValueError(f"gpu_experts_mask must be bool [num_moe_layers={len(modules)}, E], got "
                             f"{mask.dtype} {tuple(mask.shape)}")
        masks = list(mask)
    elif num_gpu_experts is not None:
        experts = [int(m.down_proj.shape[0]) for m in modules]
        if not is_int(num_gpu_experts) or \
                not all(0 <= num_gpu_experts <= e for e in experts):
            raise ValueError(f"num_gpu_experts must be an int in [0, {min(experts, default=0)}], got {num_gpu_experts!r}")
        masks = [torch.arange(e) < num_gpu_experts for e in experts]
    if dynamic and masks and masks[0] is None:  # (no experts module: nothing to pack, as without dynamic)
        raise ValueError("dynamic=True needs gpu_experts_mask or num_gpu_experts (the first GPU experts)")
    for module, mask in zip(modules, masks):
        pack_module_experts(module, method, gpu_experts_mask=mask, dynamic=dynamic, **pack_args)
    return len(modules)


def local_experts(module: nn.Module) -> tuple | None:
    """The experts a module keeps in torch: ``(ids [G], gate_up, gate_up_bias, down,
    down_bias)`` in the module's layout, or None."""
    return getattr(module, _LOCAL, None)


def layer_id(module: nn.Module) -> int | None:
    """The module's decoder-layer index (its row in :class:`kt_ops.ExpertStats`), or None."""
    recorded = getattr(module, _LAYER_ID, None)
    return None if recorded is None else recorded[0]


def is_dynamic(module: nn.Module) -> bool:
    """Whether the module's experts in torch can be moved (packed with ``dynamic=True``)."""
    return module.__dict__.get(_SOURCE) is not None


@torch.no_grad()
def update_local_experts(module: nn.Module, expert_ids: torch.Tensor | Sequence[int]) -> None:
    """Makes ``expert_ids`` (as many distinct ids in ``[0, E)`` as the module keeps in
    torch) the experts computed in torch, in ascending order, without reloading: the slots
    whose expert changed are copied from the host weights into the tensors in place (on
    every device they were copied to), and the route to the packed experts is updated in
    place, so compiled functions and CUDA graphs captured before keep working (replay after
    this returns; copies are queued on the current stream). Needs ``dynamic=True``."""
    source = module.__dict__.get(_SOURCE)
    local = local_experts(module)
    if source is None:
        raise RuntimeError(f"{type(module).__name__}: update_local_experts needs the experts packed with "
                           "dynamic=True (every expert packed, host weights kept to fill the torch slots from)")
    E = int(source[0].shape[0])
    count = 0 if local is None else int(local[0].numel())
    ids = checked_expert_ids(expert_ids, count, E)
    if local is None:
        return
    old = local[0].to("cpu")
    changed = torch.nonzero(old != ids).reshape(-1).tolist()
    copies = [local, *module.__dict__.get(_LOCAL_ON, {}).values()]
    for copy in copies:
        for slot in changed:
            e = int(ids[slot])
            for target, weights in zip(copy[1:], source):
                if target is not None:
                    target[slot].copy_(weights[e], non_blocking=True)
        copy[0].copy_(ids, non_blocking=True)
    route = module.__dict__[_ROUTE]
    new_route = cpu_route(ids, E, route.dtype)
    for table in (route, *module.__dict__.get(_ROUTE_ON, {}).values()):
        table.copy_(new_route, non_blocking=True)


def rebalance_local_experts(module: nn.Module, counts: torch.Tensor) -> torch.Tensor:
    """Moves the module's experts in torch to its most activated (``counts [E]``, a row of
    :attr:`kt_ops.ExpertStats.counts`), as SGLang picks them; returns the new ids."""
    chosen = most_activated_local(module, counts)
    update_local_experts(module, chosen)
    return chosen


def most_activated_local(module: nn.Module, counts: torch.Tensor) -> torch.Tensor:
    """The ids :func:`rebalance_local_experts` moves the module's experts in torch to (``counts``
    checked; nothing moved)."""
    if not is_dynamic(module):
        raise RuntimeError(f"{type(module).__name__}: rebalance_local_experts needs the experts packed with "
                           "dynamic=True")
    local = local_experts(module)
    experts = int(module.__dict__[_SOURCE][0].shape[0])
    return most_activated(counts, 0 if local is None else int(local[0].numel()), experts)


def move_local_experts(module: nn.Module, device: torch.device) -> None:
    """Moves the experts a module keeps in torch to ``device`` (after a checkpoint loaded)."""
    local = local_experts(module)
    if local is not None:
        setattr(module, _LOCAL, tuple(None if t is None else t.to(device) for t in local))
        module.__dict__.pop(_LOCAL_ON, None)


def install_blob(module: nn.Module, blob: torch.Tensor) -> None:
    """Makes ``blob`` (a packed uint8 blob in host memory, e.g. a mapped GGUF layer) the one
    the module's experts run with; the experts kept in torch are dropped."""
    for name in _DERIVED:
        module.__dict__.pop(name, None)
    setattr(module, _BLOB, blob)


def packed_blob(module: nn.Module) -> torch.Tensor | None:
    """The packed blob an experts module runs with, or None before it is packed."""
    return getattr(module, _BLOB, None)


def register(moe_module: Any = None) -> bool:
    """Registers ``"kt_ops"`` in transformers' experts interface (``moe_module``: the imported
    ``transformers.integrations.moe``; default: import it). False without transformers, or
    with one older than kt_ops supports (nothing registered: the user's import goes on)."""
    if not _transformers_supported():
        return False
    if moe_module is None:
        try:
            import transformers.integrations.moe as moe_module
        except ImportError:
            return False
    moe_module.ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    return True


class _OnImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after module ``name`` is imported."""

    def __init__(self, name: str, callback: Any) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                continue
            run = spec.loader.exec_module

            def exec_module(module: Any, run: Any = run) -> None:
                run(module)
                self.callback(module)

            spec.loader.exec_module = exec_module  # this module's loader instance only
            return spec
        return None


def on_import(name: str, callback: Any) -> None:
    """``callback(module)`` now if module ``name`` is imported, else right after it is."""
    if name in sys.modules:
        callback(sys.modules[name])
    elif not any(isinstance(f, _OnImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _OnImport(name, callback))


def _patch_peft(module: Any) -> None:
    from kt_ops.hf_peft import patch

    patch(module)


def _transformers_supported() -> bool:
    """Whether transformers is importable and recent enough for kt_ops' integrations (a
    too old one is left alone; KtOpsConfig and the like then say what is needed)."""
    try:
        import transformers
    except ImportError:
        return False
    return transformers_problem(transformers) is None


def _register_quantizer(module: Any) -> None:
    if _transformers_supported():
        import kt_ops.hf_quantizer  # noqa: F401  (registers the "kt_ops" quantization method)


def install() -> None:
    """Registers ``kt_ops`` in transformers' experts interface now if it is imported, else
    when it is; likewise its quantizer once ``transformers.modeling_utils`` is (a config.json
    with kt_ops' quantization_config was loaded unquantized, "Unknown quantization type",
    unless ``kt_ops.KtOpsConfig`` had been touched first); teaches PEFT's LoRA parameter
    wrappers about packed experts likewise."""
    on_import(_MOE_MODULE, register)
    on_import("transformers.modeling_utils", _register_quantizer)
    on_import(_PEFT_MODULE, _patch_peft)
