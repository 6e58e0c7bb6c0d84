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
import sys
from typing import Any

import torch
from torch import nn

IMPLEMENTATION = "kt_ops"
_BLOB = "_kt_ops_blob"
_MOE_MODULE = "transformers.integrations.moe"


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
    return torch.ops.kt.moe_forward(hidden_states.contiguous(), top_k_index.contiguous(),
                                    top_k_weights.contiguous(), blob)


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is an experts class decorated with ``@use_experts_implementation``."""
    return all(hasattr(module, name) for name in ("has_gate", "is_concatenated", "is_transposed", "_apply_gate"))


def check_supported(module: nn.Module) -> None:
    """``ValueError`` naming the class for experts kt_ops cannot compute (no gate, a
    post-expert norm, expert parallelism)."""
    name = type(module).__name__
    if not module.has_gate:
        raise ValueError(f"{name} has no gate (has_gate=False: act(up) experts); kt_ops computes gated experts only")
    if getattr(module, "has_post_expert_norm", False):
        raise ValueError(f"{name} applies a norm after each expert (has_post_expert_norm); kt_ops does not")
    if getattr(module, "_is_expert_parallel", False):
        raise ValueError(f"{name} is expert-parallel; kt_ops runs every expert of the layer in this process")


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

    g = torch.Generator().manual_seed(0)
    probe = torch.rand(32, 2 * intermediate, generator=g) * 24 - 12
    with torch.no_grad():
        got = module._apply_gate(probe).float()
    gate, up = _split(probe.unsqueeze(-1), module.is_concatenated)
    gate, up = gate.squeeze(-1), up.squeeze(-1)
    limits = [0.0, *_numbers(module, ("limit", "swiglu_limit"))]
    alphas = [0.0, *_numbers(module, ("alpha", "swiglu_alpha"))]
    for alpha in alphas:
        for limit in limits:
            want = reference.glu(gate, up, limit, alpha)
            if want.shape == got.shape and torch.allclose(want, got, rtol=1e-4, atol=1e-5):
                return limit, alpha
    raise ValueError(f"{type(module).__name__}._apply_gate is an activation kt_ops does not compute (act_fn "
                     f"{getattr(module, 'act_fn', None)!r}; tried silu(g) * u, clamped at {limits[1:] or 'no limit'}, "
                     f"and alpha-SwiGLU with alpha {alphas[1:] or 'none'})")


def module_weights(module: nn.Module, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The keyword arguments of :func:`kt_ops.pack_experts` that describe ``module``: ``gate [E,
    I, H]``, ``up``, ``down [E, H, I]`` (CPU, stored dtype), ``biases`` or None,
    ``swiglu_limit``, ``swiglu_alpha``. ``tensors``: ``gate_up_proj``, ``down_proj`` (and
    ``gate_up_proj_bias``, ``down_proj_bias``) in the module's layout, instead of its own
    parameters (while a checkpoint loads)."""
    check_supported(module)
    source = tensors if tensors is not None else {name: getattr(module, name).detach() for name in
                                                 ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
                                                 if getattr(module, name, None) is not None}
    gate_up, down = source["gate_up_proj"], source["down_proj"]
    if gate_up.is_meta or down.is_meta:
        raise ValueError(f"{type(module).__name__}: the expert weights are on the meta device (not loaded)")
    if module.is_transposed:  # [E, H, 2I] and [E, I, H]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
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
                        **pack_args: Any) -> torch.Tensor:
    """Packs one experts module into ``method`` (``pack_args``: ``group_size``, ``gguf_type``,
    ``scale_search`` as :func:`kt_ops.pack_experts`; ``tensors`` as :func:`module_weights`),
    keeps the blob on the module and returns it."""
    from kt_ops.ops import pack_experts

    weights = module_weights(module, tensors)
    packed = pack_experts(weights.pop("gate_proj"), weights.pop("up_proj"), weights.pop("down_proj"), method=method,
                          **weights, **pack_args)
    setattr(module, _BLOB, packed.data)
    return packed.data


def pack_model_experts(model: nn.Module, method: str = "BF16", **pack_args: Any) -> int:
    """Packs every experts module of ``model`` (eagerly: required before ``torch.compile``);
    returns how many. ``ValueError`` naming the class for experts kt_ops cannot compute."""
    count = 0
    for module in model.modules():
        if is_experts_module(module):
            pack_module_experts(module, method, **pack_args)
            count += 1
    return count


def packed_blob(module: nn.Module) -> torch.Tensor | None:
    """The packed blob an experts module runs with, or None before it is packed."""
    return getattr(module, _BLOB, None)


def register(moe_module: Any = None) -> bool:
    """Registers ``"kt_ops"`` in transformers' experts interface (``moe_module``: the imported
    ``transformers.integrations.moe``; default: import it). False without transformers."""
    if moe_module is None:
        try:
            import transformers.integrations.moe as moe_module
        except ImportError:
            return False
    moe_module.ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    return True


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers ``kt_ops`` right after ``transformers.integrations.moe`` is imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _MOE_MODULE:
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
                register(module)

            spec.loader.exec_module = exec_module  # this module's loader instance only
            return spec
        return None


def install() -> None:
    """Registers now if transformers' MoE integration is already imported, else when it is."""
    if _MOE_MODULE in sys.modules:
        register(sys.modules[_MOE_MODULE])
    elif not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
