"""Which routed experts live on the GPU: SGLang/kt-kernel's placement strategies.

:func:`placement_masks` computes the same masks as SGLang's ``--kt-expert-placement-strategy``
(``uniform``, ``frequency``, ``front-loading``, ``random``) for the same model and budget;
:func:`generate_gpu_experts_masks` is kt-kernel's global top-k that ``frequency`` uses;
:func:`budget_from_bytes` turns a GPU byte budget into experts per MoE layer.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from fractions import Fraction
from typing import TYPE_CHECKING, Sequence, Union

import torch

from kt_ops._validate import bad_count, is_integral

if TYPE_CHECKING:
    from kt_ops.expert_stats import ExpertStats

STRATEGIES = ("uniform", "frequency", "front-loading", "random")

StatsLike = Union[torch.Tensor, "ExpertStats", str, "os.PathLike[str]"]


def generate_gpu_experts_masks(activation_freq: torch.Tensor, num_gpu_experts: int) -> torch.Tensor:
    """The ``num_gpu_experts`` most frequently activated experts of the whole model
    (``activation_freq [num_layers, num_experts]``), as a bool ``[num_layers, num_experts]``
    CPU mask (True: on the GPU). As kt-kernel's, the choice is global: a layer may get
    more GPU experts than another, or none. As kt-kernel's, ``num_gpu_experts`` is clamped
    to ``[0, num_layers * num_experts]``: more than that puts every expert on the GPU, a
    negative count none. A count that is not an int (or a bool) is a ``TypeError``;
    ``activation_freq`` holding NaN, inf or a negative count a ``ValueError``."""
    if not isinstance(activation_freq, torch.Tensor):
        raise TypeError(f"activation_freq must be a tensor [num_layers, num_experts], got {type(activation_freq).__name__}")
    if activation_freq.dim() != 2:
        raise ValueError(f"activation_freq must be [num_layers, num_experts], got shape {tuple(activation_freq.shape)}")
    if activation_freq.dtype == torch.bool or activation_freq.is_complex():
        raise ValueError(f"activation_freq must hold real counts, got {activation_freq.dtype}")
    bad = bad_count(activation_freq.detach())
    if bad is not None:  # a NaN or inf expert went to the GPU, a negative one ranked below the idle ones
        raise ValueError(f"activation_freq must hold finite and non-negative counts, got {bad}")
    if not is_integral(num_gpu_experts):
        raise TypeError(f"num_gpu_experts must be an int, got {num_gpu_experts!r}")
    num_gpu_experts = int(num_gpu_experts)
    total = activation_freq.numel()
    num_gpu_experts = max(min(num_gpu_experts, total), 0)
    flat = activation_freq.detach().reshape(-1).to("cpu", torch.float64)
    mask = torch.zeros(total, dtype=torch.bool)
    if num_gpu_experts:
        mask[torch.topk(flat, num_gpu_experts, sorted=False).indices] = True
    return mask.view(activation_freq.shape)


def total_gpu_experts(budget: int | float, num_experts: int, num_moe_layers: int) -> int:
    """SGLang's GPU expert total: ``budget * num_moe_layers`` for an int budget (experts
    per MoE layer, ``--kt-num-gpu-experts``), ``int(num_moe_layers * num_experts * r)`` for a
    float ratio ``r`` in (0, 1] (``--kt-gpu-experts-ratio``). ``ValueError`` otherwise."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise ValueError(f"budget must be an int (GPU experts per MoE layer) or a float ratio in (0, 1], got {budget!r}")
    if isinstance(budget, numbers.Integral):
        if budget < 0:
            raise ValueError(f"budget (GPU experts per MoE layer) must be >= 0, got {budget}")
        return int(budget) * num_moe_layers
    ratio = float(budget)
    if not (math.isfinite(ratio) and 0.0 < ratio <= 1.0):
        raise ValueError(f"a float budget is a ratio of all routed experts in (0, 1], got {budget!r}")
    return int(num_moe_layers * num_experts * ratio)


def _check_layers(num_experts: int, moe_layers: Sequence[int]) -> list[int]:
    if not is_integral(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    layers = list(moe_layers)
    if any(not is_integral(i) or i < 0 for i in layers):
        raise ValueError(f"moe_layers must be non-negative layer indices, got {layers!r}")
    layers = [int(i) for i in layers]
    if len(set(layers)) != len(layers):
        raise ValueError(f"moe_layers has repeated layer indices: {layers!r}")
    return layers


def _frequency(stats: StatsLike | None, num_experts: int, layers: list[int], num_hidden_layers: int | None) -> torch.Tensor:
    """float32 ``[num_hidden_layers, E]``: the counts of ``stats`` on the MoE layers' rows
    (0 elsewhere), or 1.0 on them without stats — SGLang's ``activation_freq``."""
    counts: torch.Tensor | None = None
    if stats is not None:
        from kt_ops.expert_stats import ExpertStats

        if isinstance(stats, (str, os.PathLike)):
            counts = ExpertStats.load(stats).counts
        elif isinstance(stats, ExpertStats):
            counts = stats.counts
        elif isinstance(stats, torch.Tensor):
            counts = stats.detach().to("cpu")
            if counts.dtype == torch.bool or counts.is_complex():
                raise ValueError(f"stats must hold finite real counts, got {counts.dtype}")
            bad = bad_count(counts)
            if bad is not None:  # a negative count ranked its expert below the idle ones, silently
                raise ValueError(f"stats must hold finite and non-negative counts, got {bad}")
        else:
            raise ValueError(f"stats must be a counts tensor [num_hidden_layers, E], an ExpertStats or a path, "
                             f"got {type(stats).__name__}")
        if counts.dim() != 2 or counts.shape[1] != num_experts:
            raise ValueError(f"stats must be counts [num_hidden_layers, E={num_experts}] indexed by layer id, "
                             f"got shape {tuple(counts.shape)}")
        if num_hidden_layers is not None and counts.shape[0] != num_hidden_layers:
            raise ValueError(f"stats has {counts.shape[0]} layers; num_hidden_layers is {num_hidden_layers}")
        if layers and max(layers) >= counts.shape[0]:
            raise ValueError(f"stats has {counts.shape[0]} layers; moe_layers reaches layer {max(layers)}")
        rows = int(counts.shape[0])
    else:
        rows = num_hidden_layers if num_hidden_layers is not None else max(layers, default=-1) + 1
    freq = torch.zeros(rows, num_experts, dtype=torch.float32)
    index = torch.tensor(layers, dtype=torch.long)
    freq[index] = 1.0 if counts is None else counts[index].float()
    return freq


def placement_masks(
    strategy: str,
    num_experts: int,
    moe_layers: Sequence[int],
    budget: int | float,
    stats: StatsLike | None = None,
    seed: int = 42,
    *,
    num_hidden_layers: int | None = None,
) -> torch.Tensor:
    """GPU-expert masks of the MoE layers, as SGLang's ``--kt-expert-placement-strategy``.

    Args:
        strategy: ``uniform``: the total spread evenly over the MoE layers (the first
            ``total % L`` layers one more), experts ``[0, n)`` of each; ``front-loading``:
            layers filled in order, ``min(remaining, E)`` experts ``[0, n)`` each;
            ``random``: ``total`` of the ``L * E`` (layer, expert) pairs, enumerated layer by
            layer in increasing layer index, picked by ``torch.randperm`` with
            ``torch.Generator().manual_seed(seed)``; ``frequency``: kt-kernel's global top-k
            (:func:`generate_gpu_experts_masks`) over the counts of ``stats``.
        num_experts: routed experts per layer E.
        moe_layers: the MoE layers' indices in the model (L of them, distinct). The
            algorithms walk them in increasing order, as SGLang does; the result's rows
            follow ``moe_layers``' order.
        budget: an int: GPU experts per MoE layer (total ``budget * L``, SGLang's
            ``--kt-num-gpu-experts``; may exceed E); a float ``r`` in (0, 1]: a ratio of all
            routed experts (total ``int(L * E * r)``, ``--kt-gpu-experts-ratio``).
        stats: ``frequency`` only: counts ``[num_hidden_layers, E]`` indexed by layer id
            (any real dtype), an :class:`kt_ops.ExpertStats`, or the path of a dump
            (:meth:`kt_ops.ExpertStats.load`). Rows of layers not in ``moe_layers`` are taken
            as 0 (SGLang's recorder never counts them). None: every MoE expert counts 1.0,
            as SGLang without ``--init-expert-location`` (ties: torch.topk's choice).
            Ignored by the other strategies.
        seed: ``random`` only (SGLang: 42).
        num_hidden_layers: ``frequency`` only: the model's layer count, the rows of the
            matrix the top-k runs over (default: the stats' rows, else ``max(moe_layers) + 1``).
            With stats it must match them. Without stats, pass it to reproduce SGLang's
            tie-breaking exactly when dense layers follow the last MoE layer.

    Returns:
        bool CPU ``[len(moe_layers), E]``: True where the expert runs on the GPU.

    Raises:
        ValueError: an unknown strategy, a bad budget, layer list or stats shape, stats holding
            NaN, inf or a negative count.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown placement strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    layers = _check_layers(num_experts, moe_layers)
    if num_hidden_layers is not None and (not is_integral(num_hidden_layers)
                                          or num_hidden_layers <= max(layers, default=-1)):
        raise ValueError(f"num_hidden_layers must be an int > every MoE layer index, got {num_hidden_layers!r}")
    if not is_integral(seed):  # 1.5: RuntimeError from manual_seed
        raise ValueError(f"seed must be an int, got {seed!r}")
    # numpy ints (a config's, an array's) as Python ints: manual_seed refuses numpy.int64
    num_hidden_layers = None if num_hidden_layers is None else int(num_hidden_layers)
    seed = int(seed)
    E, L = int(num_experts), len(layers)
    total = total_gpu_experts(budget, E, L)
    if strategy == "frequency":
        full = generate_gpu_experts_masks(_frequency(stats, E, layers, num_hidden_layers), total)
        return full[torch.tensor(layers, dtype=torch.long)].clone()
    ascending = sorted(layers)
    masks = torch.zeros(L, E, dtype=torch.bool)  # rows in ascending layer order
    if strategy == "uniform" and L:
        for position in range(L):
            n = min(total // L + (1 if position < total % L else 0), E)
            masks[position, :n] = True
    elif strategy == "front-loading":
        remaining = total
        for position in range(L):
            n = min(remaining, E)
            masks[position, :n] = True
            remaining -= n
    elif strategy == "random" and L:
        generator = torch.Generator().manual_seed(seed)
        chosen = torch.randperm(L * E, generator=generator)[: min(total, L * E)]
        masks.view(-1)[chosen] = True  # pair (position, expert) is number position * E + expert
    row = {layer: position for position, layer in enumerate(ascending)}
    return masks[torch.tensor([row[layer] for layer in layers], dtype=torch.long)]


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(spec: str | int) -> int:
    """Bytes of ``spec``: an int, or a string ``"<number><unit>"`` with unit B, KB/MB/GB/TB
    (powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024), case-insensitive, no unit: bytes
    (``"24GiB"``, ``"500MB"``, ``"1.5 GB"``); fractions of a byte are dropped."""
    if is_integral(spec):
        value = int(spec)
    elif isinstance(spec, str):
        match = _SIZE.fullmatch(spec)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read a byte size from {spec!r}: use e.g. '24GiB', '500MB' or a number of bytes")
        value = math.floor(Fraction(match.group(1)) * _UNITS[match.group(2).lower()])
    else:
        raise ValueError(f"a byte size must be an int or a string such as '24GiB', got {spec!r}")
    if value < 0:
        raise ValueError(f"a byte size must be >= 0, got {spec!r}")
    return value


def budget_from_bytes(spec: str | int, expert_nbytes: int, num_moe_layers: int) -> int:
    """GPU experts per MoE layer that fit a GPU byte budget: ``floor(bytes / (expert_nbytes
    * num_moe_layers))`` — the int ``budget`` of :func:`placement_masks`.

    Args:
        spec: the budget, ``"24GiB"``, ``"500MB"`` or an int of bytes (:func:`parse_bytes`).
        expert_nbytes: bytes of one expert on the GPU (gate + up + down, in the GPU dtype).
        num_moe_layers: MoE layers sharing the budget.
    """
    for name, value in (("expert_nbytes", expert_nbytes), ("num_moe_layers", num_moe_layers)):
        if not is_integral(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return parse_bytes(spec) // (int(expert_nbytes) * int(num_moe_layers))


def model_masks(
    model: torch.nn.Module,
    module_names: Sequence[str],
    strategy: str,
    budget: int | float | str,
    num_experts: int,
    expert_nbytes: int,
    stats: StatsLike | None = None,
    seed: int = 42,
) -> torch.Tensor:
    """:func:`placement_masks` for the MoE modules ``module_names`` of a model being loaded or
    patched: the MoE layers are the modules' layer indices (``layers.N`` in their names),
    ``num_hidden_layers`` comes from the model's config, and ``budget`` may also be a GPU
    byte budget (``"24GiB"``, :func:`budget_from_bytes` with one expert's ``expert_nbytes``
    on the GPU). bool ``[len(module_names), E]``; ``ValueError`` for a name without an index."""
    from kt_ops.hf_experts import layer_index

    layers = [layer_index(name) for name in module_names]
    if any(layer is None for layer in layers):
        raise ValueError(f"placement needs each MoE module's layer index (layers.N in its name); "
                         f"{module_names[layers.index(None)]!r} has none")
    if isinstance(budget, str):
        budget = budget_from_bytes(budget, expert_nbytes, max(len(layers), 1))
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "num_hidden_layers", None)
    hidden = hidden if isinstance(hidden, int) and layers and hidden > max(layers) else None
    return placement_masks(strategy, num_experts, layers, budget, stats, seed, num_hidden_layers=hidden)
