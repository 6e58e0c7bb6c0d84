"""patch_model: swap the MoE blocks of a Hugging Face ``transformers`` model for
:class:`HybridMoE` layers whose routed experts run on the CPU.

With :class:`HybridMoE` (its own routing, GPU experts by mask): ``qwen3_moe``,
``qwen2_moe``, ``mixtral``, ``deepseek_v3``, ``deepseek_v2`` — transformers v5's fused
expert tensors (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) and
v4's per-expert ``nn.Linear`` lists (``gate_proj/up_proj/down_proj`` or Mixtral's
``w1/w3/w2``) alike. Every other model whose experts class uses transformers' experts
interface is patched through it (:mod:`kt_ops.hf_experts`: the model's own routing, the
experts packed, CPU experts only). :func:`supported_model_types` lists both, read from
the installed transformers.
"""

from __future__ import annotations

import functools
import logging
import numbers
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from kt_ops import gpu_prefill, hf_experts
from kt_ops._optional import require_transformers
from kt_ops._validate import is_int, is_integral, require_bools
from kt_ops.gguf_types import GgufTypeLike
from kt_ops.wrappers.hybrid_moe import HybridMoE
from kt_ops.wrappers.routing import Routing

logger = logging.getLogger("kt_ops")


@dataclass(frozen=True)
class PatchReport:
    """What :func:`patch_model` did (also ``model.kt_ops_patch_report``).

    ``released_bytes``: the original routed-expert tensors dropped; ``packed_bytes``: the
    CPU experts' packed blobs (host memory); ``gpu_expert_bytes``: the GPU experts'
    weights kept as buffers.
    """

    layers: int
    method: str
    released_bytes: int
    packed_bytes: int
    gpu_expert_bytes: int

    def __str__(self) -> str:
        mib = 2**20
        return (f"kt_ops.patch_model: {self.layers} MoE layers -> {self.method}; released "
                f"{self.released_bytes / mib:.1f} MiB of expert weights, packed {self.packed_bytes / mib:.1f} MiB "
                f"(host), kept {self.gpu_expert_bytes / mib:.1f} MiB of GPU experts")


def _setting(block: nn.Module, config: object, *names: str, default: object = None) -> object:
    """A routing setting as the block computes with it: its router's attribute (transformers
    copies the config's into the router when it builds it, so a config edited later changes
    nothing), else the block's (v4 blocks with an ``nn.Linear`` gate), else the config's."""
    for source in (getattr(block, "gate", None), block, config):
        for name in names:
            value = getattr(source, name, None)
            if value is not None and not isinstance(value, (nn.Module, torch.Tensor)):
                return value
    return default


def _routing(config: object, model_type: str, block: nn.Module) -> Routing:
    top_k = int(_setting(block, config, "top_k", "num_experts_per_tok"))
    norm_topk_prob = bool(_setting(block, config, "norm_topk_prob", default=False))
    if model_type in ("qwen3_moe", "qwen2_moe"):
        return Routing(top_k, norm_topk_prob=norm_topk_prob, weights_in_logits_dtype=True)
    if model_type == "mixtral":
        return Routing(top_k, norm_topk_prob=True)
    scaling = float(_setting(block, config, "routed_scaling_factor", default=1.0))
    groups = int(_setting(block, config, "num_group", "n_group", default=1))
    topk_groups = int(_setting(block, config, "topk_group", default=1))
    if model_type == "deepseek_v3":
        return Routing(top_k, scoring="sigmoid", norm_topk_prob=norm_topk_prob, num_groups=groups,
                       topk_groups=topk_groups, group_score="top2_sum", routed_scaling_factor=scaling,
                       logits_fp32=True)
    # deepseek_v2: softmax; "group_limited_greedy" keeps the groups with the best expert
    method = _setting(block, config, "topk_method", default="greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"deepseek_v2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    grouped = method == "group_limited_greedy"
    return Routing(top_k, num_groups=groups if grouped else 1, topk_groups=topk_groups if grouped else 1,
                   group_score="max", routed_scaling_factor=scaling, logits_fp32=True)


_BLOCKS: dict[str, tuple[str, ...]] = {  # model_type -> MoE block class names (v5, v4)
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock",),
    "qwen2_moe": ("Qwen2MoeSparseMoeBlock",),
    "mixtral": ("MixtralSparseMoeBlock",),
    "deepseek_v3": ("DeepseekV3MoE",),
    "deepseek_v2": ("DeepseekV2Moe", "DeepseekV2MoE"),
}
HYBRID_MODEL_TYPES = tuple(_BLOCKS)


def _interface_missing() -> str:
    """Why :func:`supported_model_types` lists no architecture of transformers' experts
    interface (``" (... not installed: pip install ...)"``), or ``""`` when it can."""
    try:
        require_transformers("patching the architectures of transformers' experts interface")
    except ImportError as error:
        return f" ({error})"
    return ""


@functools.lru_cache(maxsize=1)
def supported_model_types() -> tuple[str, ...]:
    """The ``model_type``s :func:`patch_model` handles: :data:`HYBRID_MODEL_TYPES` and every
    model of the installed transformers whose modeling code decorates its experts class
    with ``@use_experts_implementation`` (without ``has_gate=False`` or a post-expert norm,
    which kt_ops does not compute). Empty of the latter without transformers."""
    found = set(_BLOCKS)
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name
    except ImportError:
        return tuple(sorted(found))
    root = Path(transformers.__file__).parent / "models"
    for model_type in CONFIG_MAPPING_NAMES:
        name = model_type_to_module_name(model_type)
        source = root / name / f"modeling_{name}.py"
        if not source.is_file():
            continue
        decorators = re.findall(r"@use_experts_implementation(\([^)]*\))?", source.read_text(encoding="utf-8"))
        if decorators and all("has_gate=False" not in d and "has_post_expert_norm=True" not in d for d in decorators):
            found.add(model_type)
    return tuple(sorted(found))


def __getattr__(name: str) -> object:
    if name == "SUPPORTED_MODEL_TYPES":  # generated from the installed transformers on first use
        return supported_model_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _expert_tensors(experts: nn.Module, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(gate [E, I, H], up [E, I, H], down [E, H, I])`` of a v5 fused or v4 list experts module."""
    if isinstance(experts, nn.ModuleList):
        names = ("gate_proj", "up_proj", "down_proj") if hasattr(experts[0], "gate_proj") else ("w1", "w3", "w2")
        return tuple(torch.stack([getattr(e, n).weight.detach() for e in experts]) for n in names)  # type: ignore[return-value]
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if gate_up.shape[-1] != hidden:  # stored transposed: [E, H, 2I] / [E, I, H]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    gate, up = gate_up.chunk(2, dim=1)
    return gate, up, down


def _layer_masks(
    layers: int, experts: int, gpu_experts_mask: torch.Tensor | None, num_gpu_experts: int | Sequence[int] | None
) -> list[torch.Tensor | None]:
    if gpu_experts_mask is not None and num_gpu_experts is not None:
        raise ValueError("give gpu_experts_mask or num_gpu_experts, not both")
    if gpu_experts_mask is not None:
        mask = torch.as_tensor(gpu_experts_mask).to("cpu")
        if mask.dtype != torch.bool or mask.shape != (layers, experts):
            raise ValueError(f"gpu_experts_mask must be bool [num_moe_layers={layers}, E={experts}], got "
                             f"{mask.dtype} {tuple(mask.shape)}")
        return list(mask)
    if num_gpu_experts is None:
        return [None] * layers
    # one count for every layer: a number, a numpy scalar or a 0-d tensor (list() of the latter two raised TypeError)
    scalar = isinstance(num_gpu_experts, numbers.Number) or (isinstance(num_gpu_experts, torch.Tensor)
                                                             and num_gpu_experts.dim() == 0)
    try:
        counts = [num_gpu_experts] * layers if scalar else list(num_gpu_experts)
    except TypeError:
        raise ValueError(f"num_gpu_experts must be an int or {layers} ints in [0, {experts}], "
                         f"got {num_gpu_experts!r}") from None
    counts = [int(c) if isinstance(c, torch.Tensor) and c.dim() == 0 and not c.is_floating_point()
              and c.dtype != torch.bool else c for c in counts]  # an int tensor's elements
    counts = [int(c) if is_integral(c) else c for c in counts]  # numpy ints
    if len(counts) != layers or any(not is_int(c) or not 0 <= c <= experts
                                    for c in counts):
        raise ValueError(f"num_gpu_experts must be an int or {layers} ints in [0, {experts}], got {num_gpu_experts!r}")
    return [torch.arange(experts) < c for c in counts]


def _placement_mask(model: nn.Module, names: list[str], num_experts: int, expert_nbytes: int, placement: str,
                    gpu_budget: int | float | str | None, expert_stats: object, other: tuple) -> torch.Tensor:
    """The GPU-expert mask ``[num_moe_layers, E]`` of ``placement`` (:func:`kt_ops.placement.model_masks`)."""
    from kt_ops.placement import model_masks

    if any(value is not None for value in other):
        raise ValueError("give placement= (with gpu_budget=) or gpu_experts_mask / num_gpu_experts, not both")
    if gpu_budget is None:
        raise ValueError(f"placement={placement!r} needs gpu_budget: GPU experts per MoE layer (int), a ratio of all "
                         "routed experts (float in (0, 1]) or GPU bytes ('24GiB')")
    return model_masks(model, names, placement, gpu_budget, num_experts, expert_nbytes, expert_stats)


def patch_model(
    model: nn.Module,
    method: str = "BF16",
    gpu_experts_mask: torch.Tensor | None = None,
    num_gpu_experts: int | Sequence[int] | None = None,
    *,
    group_size: int = 128,
    gguf_type: GgufTypeLike | tuple[GgufTypeLike, GgufTypeLike, GgufTypeLike] | None = None,
    progress: Callable[[int, int], None] | None = None,
    placement: str | None = None,
    gpu_budget: int | float | str | None = None,
    expert_stats: object = None,
    dynamic_gpu_experts: bool = False,
    gpu_prefill_token_threshold: int = 0,
    experts_interface: bool = False,
) -> nn.Module:
    """Replaces every MoE block of a ``transformers`` model, in place, by a :class:`HybridMoE`
    (:data:`HYBRID_MODEL_TYPES`), or packs its experts behind transformers' experts interface
    (every other supported architecture, and these with ``experts_interface=True``).

    Args:
        model: a ``PreTrainedModel`` (or any module with a ``config``) of a supported
            ``model_type`` (:func:`supported_model_types`).
        method: packing method of the CPU experts (``BF16``, ``AMXINT8``, ``AMXINT4``,
            ``LLAMAFILE`` with ``gguf_type`` …).
        gpu_experts_mask: bool ``[num_moe_layers, E]``: experts kept in torch on the
            model's device (in model order of the MoE blocks).
        num_gpu_experts: instead of a mask: experts ``[0, n)`` of each layer (an int, or
            one per MoE layer).
        placement, gpu_budget, expert_stats: instead of a mask: SGLang's placement strategy
            (``uniform``, ``frequency``, ``front-loading``, ``random``;
            :func:`kt_ops.placement_masks`) for ``gpu_budget`` GPU experts per MoE layer
            (int), a ratio of all routed experts (float) or GPU bytes (``"24GiB"``, divided
            by one expert's bytes in the experts' dtype); ``expert_stats`` (counts
            ``[num_hidden_layers, E]``, a :class:`kt_ops.ExpertStats` or a dump path) for
            ``frequency``.
        dynamic_gpu_experts: the GPU experts may be moved at run time
            (:func:`kt_ops.rebalance_gpu_experts`, :meth:`HybridMoE.update_gpu_experts`,
            :func:`kt_ops.hf_experts.update_local_experts` on the experts-interface
            architectures): every expert packed for the CPU, host float weights kept.
        gpu_prefill_token_threshold: calls of at least this many tokens on a GPU compute
            the CPU experts there (:func:`kt_ops.set_gpu_prefill_token_threshold`; 0: never).
        experts_interface: on the :data:`HYBRID_MODEL_TYPES`, pack the experts behind
            transformers' experts interface (``experts_implementation="kt_ops"``: the model's
            own router and modules, the experts module's fused parameters, so PEFT's
            ``target_parameters`` LoRA trains over the packed experts) instead of replacing
            the block by a :class:`HybridMoE`; a model without that interface is a
            ``ValueError``. The other architectures always take this path.
        group_size, gguf_type: as :func:`kt_ops.pack_experts`.
        progress: called as ``progress(done, total)`` after each layer.

    Returns:
        ``model``, patched; ``model.kt_ops_patch_report`` is a :class:`PatchReport`
        (also logged at INFO). The original expert tensors are released.

    Raises:
        ValueError: an unsupported architecture (the message lists the supported ones),
            no MoE block found, a non-SiLU activation, a bad mask, or expert weights on the
            meta device (not loaded, or offloaded by accelerate).
    """
    gpu_prefill.checked_threshold(gpu_prefill_token_threshold)
    require_bools(dynamic_gpu_experts=dynamic_gpu_experts, experts_interface=experts_interface)
    if placement is None:  # else both were dropped silently: every expert on the CPU
        given = [n for n, v in (("gpu_budget", gpu_budget), ("expert_stats", expert_stats)) if v is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} apply with placement= (uniform, frequency, front-loading, "
                             "random); give placement, or gpu_experts_mask / num_gpu_experts")
    if progress is not None and not callable(progress):  # was raised after the first layer had been patched
        raise TypeError(f"progress must be a callable progress(done, total) or None, got {progress!r}")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _BLOCKS or experts_interface:
        experts = [(name, m) for name, m in model.named_modules() if hf_experts.is_experts_module(m)]
        if not experts and experts_interface and model_type in _BLOCKS:
            raise ValueError(f"experts_interface=True: {type(model).__name__} has no experts class using "
                             "transformers' experts interface (transformers v5 models have one)")
        if not experts:
            raise ValueError(f"kt_ops.patch_model does not support model_type {model_type!r} "
                             f"({type(model).__name__}: no experts class using transformers' experts interface); "
                             f"supported: {', '.join(supported_model_types())}{_interface_missing()}")
        packed = [name for name, module in experts if hf_experts.packed_blob(module) is not None]
        if packed:
            raise ValueError(f"{packed[0]} (and {len(packed) - 1} more) already runs on packed kt_ops experts "
                             "(patch_model or KtOpsConfig ran on this model); its float weights are gone")
        num_experts = int(experts[0][1].down_proj.shape[0])
        if placement is not None:
            nbytes = hf_experts.expert_nbytes(experts[0][1])
            gpu_experts_mask = _placement_mask(model, [name for name, _ in experts], num_experts, nbytes, placement,
                                               gpu_budget, expert_stats, (gpu_experts_mask, num_gpu_experts))
        masks = _layer_masks(len(experts), num_experts, gpu_experts_mask, num_gpu_experts)
        _patch_experts(model, experts, masks, method, group_size, gguf_type, progress, dynamic_gpu_experts)
        gpu_prefill.set_gpu_prefill_token_threshold(model, gpu_prefill_token_threshold)
        return model
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"the CPU experts compute SiLU; this model's hidden_act is {config.hidden_act!r}")
    blocks = [(name, module) for name, module in model.named_modules()
              if type(module).__name__ in _BLOCKS[model_type]]
    if not blocks:
        patched = any(isinstance(module, HybridMoE) for module in model.modules())
        raise ValueError(f"no {'/'.join(_BLOCKS[model_type])} block found in {type(model).__name__}"
                         + ("; its MoE blocks are kt_ops HybridMoE layers already (patch_model ran on it)"
                            if patched else ""))
    routings = [_routing(config, model_type, block) for _, block in blocks]  # refused before any is replaced
    hidden = int(config.hidden_size)
    num_experts = int(blocks[0][1].gate.weight.shape[0])
    if placement is not None:
        nbytes = sum(p.numel() * p.element_size() for p in blocks[0][1].experts.parameters()) // num_experts
        gpu_experts_mask = _placement_mask(model, [name for name, _ in blocks], num_experts, nbytes, placement,
                                           gpu_budget, expert_stats, (gpu_experts_mask, num_gpu_experts))
    masks = _layer_masks(len(blocks), num_experts, gpu_experts_mask, num_gpu_experts)
    _check_dynamic(dynamic_gpu_experts, masks)  # HybridMoE(dynamic=True) without GPU experts kept host copies for nothing
    for name, block in blocks:  # before any block is replaced (HybridMoE: NotImplementedError from .cpu())
        if any(t.is_meta for t in (*block.experts.parameters(), block.gate.weight)):
            raise ValueError(f"{name}: the expert or router weights are on the meta device (not loaded, or offloaded "
                             "by accelerate: device_map 'disk', cpu_offload); patch_model packs their values, so load "
                             "the experts into memory first")
    released = packed_bytes = gpu_bytes = 0
    for index, ((name, block), mask) in enumerate(zip(blocks, masks)):
        gate, up, down = _expert_tensors(block.experts, hidden)
        released += sum(p.numel() * p.element_size() for p in block.experts.parameters())
        gate_module = block.gate
        layer = HybridMoE(
            gate_module.weight.detach(), gate, up, down, routings[index], method=method, gpu_experts_mask=mask,
            e_score_correction_bias=getattr(gate_module, "e_score_correction_bias", None),
            shared_experts=getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None),
            shared_expert_gate=getattr(block, "shared_expert_gate", None),
            group_size=group_size, gguf_type=gguf_type, layer_idx=hf_experts.layer_index(name),
            dynamic=dynamic_gpu_experts, gpu_prefill_token_threshold=gpu_prefill_token_threshold,
            router_jitter_noise=float(_setting(block, config, "jitter_noise", "router_jitter_noise", default=0.0))
            if model_type == "mixtral" else 0.0,
        )
        # the router trains as in the unpatched model (HybridMoE keeps a detached copy, frozen by default)
        layer.router_weight.requires_grad_(gate_module.weight.requires_grad)
        layer.record_router_logits = True  # output_router_logits: transformers' hooks were on the router removed
        layer.to(gate_module.weight.device)  # the packed experts stay in host memory
        packed_bytes += layer.packed.numel()
        gpu_bytes += sum(b.numel() * b.element_size() for b in (layer.gpu_gate_up, layer.gpu_down))
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer)
        del gate, up, down, block, gate_module
        if progress is not None:
            progress(index + 1, len(blocks))
    report = PatchReport(len(blocks), method.upper(), released, packed_bytes, gpu_bytes)
    model.kt_ops_patch_report = report
    logger.info("%s", report)
    return model


def _check_dynamic(dynamic: bool, masks: list[torch.Tensor | None]) -> None:
    """``ValueError`` for ``dynamic_gpu_experts`` with no GPU expert in any layer's mask:
    nothing to move, while every expert's host weights would be kept."""
    if dynamic and all(mask is None or not bool(mask.any()) for mask in masks):
        raise ValueError("dynamic_gpu_experts needs GPU experts to move: give num_gpu_experts, gpu_experts_mask or "
                         "placement")


def _patch_experts(model: nn.Module, experts: list[tuple[str, nn.Module]], masks: list[torch.Tensor | None],
                   method: str, group_size: int, gguf_type: object,
                   progress: Callable[[int, int], None] | None, dynamic: bool = False) -> nn.Module:
    """patch_model through transformers' experts interface: each experts module packed
    (its activation probed, biases kept; the experts of its mask kept in torch on the
    model's device; ``dynamic``: every expert packed and host weights kept, so they can
    move), its expert tensors released, the model's experts implementation set to kt_ops."""
    from kt_ops.formats import GROUPED_FORMATS, format_for_method

    pack_args: dict[str, object] = {}
    if format_for_method(method) in GROUPED_FORMATS:
        pack_args["group_size"] = group_size
    if gguf_type is not None:
        pack_args["gguf_type"] = gguf_type
    for _, module in experts:  # refuse before anything changes
        hf_experts.check_supported(module)
    _check_dynamic(dynamic, masks)
    hf_experts.set_layer_ids(model)  # kt_ops.ExpertStats rows (and rebalance_gpu_experts) by layer id
    released = packed_bytes = gpu_bytes = 0
    for index, ((_, module), mask) in enumerate(zip(experts, masks)):
        packed_bytes += hf_experts.pack_module_experts(module, method, gpu_experts_mask=mask, dynamic=dynamic,
                                                       **pack_args).numel()
        local = hf_experts.local_experts(module)
        gpu_bytes += sum(t.numel() * t.element_size() for t in (local or ())[1:] if t is not None)
        released += hf_experts.release_weights(module)
        if progress is not None:
            progress(index + 1, len(experts))
    model.set_experts_implementation(hf_experts.IMPLEMENTATION)
    report = PatchReport(len(experts), method.upper(), released, packed_bytes, gpu_bytes)
    model.kt_ops_patch_report = report
    logger.info("%s", report)
    return model
