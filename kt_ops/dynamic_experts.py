"""Dynamic GPU experts: what :class:`kt_ops.HybridMoE` and the transformers experts path
(:mod:`kt_ops.hf_experts`) share — checking a new set of GPU experts, choosing the most
activated ones as SGLang does, host copies to refill GPU slots from — and
:func:`rebalance_gpu_experts` over a model's layers of both kinds."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import torch
from torch import nn

from kt_ops._validate import bad_count


def host_copy(weight: torch.Tensor) -> torch.Tensor:
    """A copy of ``weight`` in host memory, pinned where CUDA is available (GPU slots fill
    from it). Never ``weight``'s own storage: a host tensor was returned as it was (without
    CUDA), so a caller reusing it (the next layer's weights read into the same buffer)
    changed the experts later moved to GPU slots, silently."""
    host = _pinned(weight.detach().to("cpu").contiguous())
    if host.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
        host = _pinned(host.clone())
    return host


def _pinned(host: torch.Tensor) -> torch.Tensor:
    """``host`` in pinned memory where CUDA is available (a copy unless it is pinned already)."""
    if torch.cuda.is_available() and not host.is_pinned():
        try:
            return host.pin_memory()
        except RuntimeError:  # pinning can fail (limits); pageable copies still work
            return host
    return host


def checked_expert_ids(expert_ids: torch.Tensor | Sequence[int], count: int, num_experts: int) -> torch.Tensor:
    """``expert_ids`` as ``count`` distinct int64 ids in ``[0, num_experts)``, ascending (slot
    ``i`` holds the ``i``-th smallest id, as SGLang); ``ValueError`` otherwise."""
    ids = torch.as_tensor(expert_ids).to("cpu")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex() or ids.dim() != 1 or ids.numel() != count:
        raise ValueError(f"expert_ids must be {count} integer expert ids (the layer's GPU expert count), got "
                         f"{ids.dtype} {tuple(ids.shape)}")
    ids = torch.sort(ids.long()).values
    if count and (int(ids[0]) < 0 or int(ids[-1]) >= num_experts or bool((ids[1:] == ids[:-1]).any())):
        raise ValueError(f"expert_ids must be distinct ids in [0, {num_experts}), got {ids.tolist()}")
    return ids


def most_activated(counts: torch.Tensor, count: int, num_experts: int) -> torch.Tensor:
    """The ``count`` most activated experts of ``counts [num_experts]`` (real, finite, >= 0) as
    SGLang picks them (``topk`` of the counts), ascending; ``ValueError`` otherwise."""
    counts = torch.as_tensor(counts).to("cpu")
    if counts.shape != (num_experts,):
        raise ValueError(f"counts must be [{num_experts}], got {tuple(counts.shape)}")
    if counts.is_complex():  # .double() dropped the imaginary part (a UserWarning), ranking the rest
        raise ValueError(f"counts must be real, got {counts.dtype}")
    bad = bad_count(counts)
    if bad is not None:  # NaN or inf went to the GPU, a negative count ranked below the idle experts: silently
        raise ValueError(f"counts must be finite and non-negative, got {bad}")
    return torch.sort(torch.topk(counts.double(), count, sorted=True).indices).values


def cpu_route(gpu_ids: torch.Tensor, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert -> packed slot when every expert is packed: the expert's own id, -1 for the
    experts on the GPU (``gpu_ids``)."""
    route = torch.arange(num_experts, dtype=dtype)
    route[gpu_ids] = -1
    return route


def rebalance_gpu_experts(model: nn.Module, stats: object) -> int:
    """Moves each dynamic MoE layer's GPU experts to its most activated ones from ``stats``:
    a real tensor of counts ``[num_hidden_layers, E]`` indexed by layer id, a
    :class:`kt_ops.ExpertStats` or a dump path (anything else: ``ValueError``). Dynamic
    layers are :class:`kt_ops.HybridMoE` ones built with ``dynamic=True``
    (:meth:`kt_ops.HybridMoE.rebalance`) and experts modules of the transformers path packed with
    ``dynamic=True`` (:func:`kt_ops.hf_experts.rebalance_local_experts`). Returns how many
    layers were rebalanced (changed or not); layers without a layer id or a row in
    ``stats`` are left alone. Call between forwards (e.g. every N decode steps, then
    ``stats.reset()``). Every layer's counts are checked before any layer moves: a bad row
    is a ``ValueError`` that leaves every layer as it was."""
    from kt_ops import hf_experts
    from kt_ops.expert_stats import ExpertStats
    from kt_ops.wrappers.hybrid_moe import HybridMoE

    if isinstance(stats, ExpertStats):
        counts = stats.counts
    elif isinstance(stats, torch.Tensor):
        counts = stats.detach().to("cpu")
        # [buffer, L, E] took its one row as layer 0's and rebalanced nothing; [E] failed per layer
        if counts.dim() != 2:
            raise ValueError(f"stats must be counts [num_hidden_layers, E] indexed by layer id, got shape "
                             f"{tuple(counts.shape)}")
        if counts.dtype == torch.bool or counts.is_complex():
            raise ValueError(f"stats must hold real counts, got {counts.dtype}")
    elif isinstance(stats, (str, os.PathLike)):
        counts = ExpertStats.load(stats).counts
    else:  # a numpy array was read as a path: "... is not a torch.save file"
        raise ValueError(f"stats must be counts [num_hidden_layers, E] (a tensor), an ExpertStats or a dump path, "
                         f"got {type(stats).__name__}")
    # Every layer's choice first (most_activated checks its row), then the moves: a bad row
    # (a negative count, another expert count) raised after the layers before it had moved.
    moves: list[tuple[Callable[[torch.Tensor], None], torch.Tensor]] = []
    for module in model.modules():
        if (isinstance(module, HybridMoE) and module.dynamic and module.num_gpu_experts
                and module.layer_idx is not None and module.layer_idx < counts.shape[0]):
            moves.append((module.update_gpu_experts, module.most_activated(counts[module.layer_idx])))
        elif hf_experts.is_experts_module(module) and hf_experts.is_dynamic(module):
            layer = hf_experts.layer_id(module)
            local = hf_experts.local_experts(module)
            if layer is not None and layer < counts.shape[0] and local is not None and local[0].numel():
                moves.append((functools.partial(hf_experts.update_local_experts, module),
                               hf_experts.most_activated_local(module, counts[layer])))
    for move, chosen in moves:
        move(chosen)
    return len(moves)
