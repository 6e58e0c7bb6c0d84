"""The intermediate-dimension split of a layer's experts into ``threadpool_count`` parts.

Part ``p`` holds gate/up rows and down columns ``[p * I / n, (p + 1) * I / n)`` of every
expert; the layer's output is the sum of the parts' outputs (tensor parallel over the
intermediate dimension, as kt-kernel splits experts over NUMA nodes).
"""

from __future__ import annotations

import re
import struct
from typing import TYPE_CHECKING, Sequence

import torch

from kt_ops.ops import (Biases, check_finite, check_pack_arguments, pack_experts, pack_fp8_experts,
                        pack_int4_experts, set_activation)
from kt_ops.packed import PackedExperts

if TYPE_CHECKING:
    from kt_ops.hf_checkpoint import Fp8Experts
    from kt_ops.hf_int4 import Int4Experts
    from kt_ops.hf_int8 import Int8Experts

FP8_KIND_METHODS = {"fp8": "FP8", "fp8_perchannel": "FP8_PERCHANNEL", "mxfp8": "MXFP8"}
_SCALE_GROUP = {"fp8": 128, "mxfp8": 32}  # k per scale column (fp8_perchannel: none)
_MX_WHERE = re.compile(r"mxfp8 (gate|up|down) scale of expert (\d+), row (\d+), group (\d+)")  # check_mx_exponents
_ARGUMENT_KEYS = ("group_size", "zero_point", "scale_search", "gguf_type")  # check_pack_arguments' keywords


def part_bounds(intermediate_size: int, parts: int) -> list[tuple[int, int]]:
    """``[begin, end)`` of each part; ``ValueError`` unless ``parts`` divides I."""
    if parts < 1 or intermediate_size % parts:
        raise ValueError(f"threadpool_count {parts} must divide moe_intermediate_size {intermediate_size}")
    step = intermediate_size // parts
    return [(p * step, (p + 1) * step) for p in range(parts)]


def pack_parts(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, method: str, parts: int, **pack_args: object
) -> list[PackedExperts]:
    """``gate [E, I, H]``, ``up [E, I, H]``, ``down [E, H, I]`` packed as ``parts`` parts
    with :func:`kt_ops.pack_experts` (``pack_args``: group_size, gguf_type, ...). A part the
    method cannot pack (an INT4 group wider than a part) is a ``ValueError`` naming the split.
    ``biases`` (``pack_args``) hold the whole layer and are split as :func:`activate_parts`
    splits them: gate and up biases with the parts' rows, down's bias on part 0 only (the
    parts' outputs are summed); one of another shape is a ``ValueError``. Arguments the
    method does not take and non-finite weights are refused for the whole layer, as
    :func:`kt_ops.pack_experts` refuses them (the row named is the layer's, not a part's)."""
    if parts == 1:
        return [pack_experts(gate, up, down, method=method, **pack_args)]
    bounds = part_bounds(int(gate.shape[1]), parts)
    check_pack_arguments(method, **{k: v for k, v in pack_args.items() if k in _ARGUMENT_KEYS})
    biases = pack_args.pop("biases", None)
    if biases is not None:
        _check_layer_biases(biases, int(gate.shape[0]), int(gate.shape[1]), int(gate.shape[2]))
    if isinstance(method, str) and method.upper() == "MXFP4" and any(a % 32 or b % 32 for a, b in bounds):
        raise ValueError(f"threadpool_count {parts} splits moe_intermediate_size {int(gate.shape[1])} into parts of "
                         f"{bounds[0][1]}; MXFP4 needs each part's bounds to be multiples of 32")
    try:
        return [
            pack_experts(gate[:, a:b], up[:, a:b], down[:, :, a:b].contiguous(), method=method,
                         biases=None if biases is None else _part_biases(biases, index, a, b), **pack_args)
            for index, (a, b) in enumerate(bounds)
        ]
    except ValueError as error:  # it named the part's width as the layer's I ("intermediate_size I = 64")
        # A non-finite weight is the layer's, named by the layer's row: looked for here, after a part
        # failed, so that a good layer is not read once more before its parts check their slices.
        for name, weight in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            if not weight.is_meta:  # (pack_experts names a meta tensor)
                check_finite(name, weight)
        raise ValueError(f"threadpool_count {parts} splits moe_intermediate_size {int(gate.shape[1])} into parts of "
                         f"{bounds[0][1]}, each packed as a layer of that intermediate size: {error}") from None


def activate_parts(
    parts: list[PackedExperts], swiglu_limit: float, swiglu_alpha: float, biases: Biases | None
) -> list[PackedExperts]:
    """The layer's activation and biases (:func:`kt_ops.set_activation`) on each part.

    ``biases`` hold the whole layer (``[E, I]``, ``[E, I]``, ``[E, H]`` in the parts' expert
    order): gate and up biases are split with the parts' rows; down's bias goes to part 0
    only, since the parts' outputs are summed. Without biases, the default activation or
    the one every part's header already holds returns the parts as they are (keeping what
    a loaded part holds: a converted gpt-oss layer's biases).
    """
    no_biases = biases is None or all(b is None for b in biases)
    if no_biases and ((swiglu_limit == 0 and swiglu_alpha == 0)
                      or all(holds_activation(part, swiglu_limit, swiglu_alpha) for part in parts)):
        return parts
    I = sum(part.intermediate_size for part in parts)
    out = []
    for index, (a, b) in enumerate(part_bounds(I, len(parts))):
        part_biases = None if biases is None else _part_biases(biases, index, a, b)
        out.append(set_activation(parts[index], swiglu_limit, swiglu_alpha, part_biases))
    return out


def _check_layer_biases(biases: object, experts: int, intermediate_size: int, hidden_size: int) -> None:
    """``ValueError`` unless ``biases`` is a ``(gate [E, I], up [E, I], down [E, H])`` tuple of
    the whole layer (entries may be None), checked before it is split: a slice of a wider
    bias would have had a part's shape."""
    if not isinstance(biases, (tuple, list)) or len(biases) != 3:
        raise ValueError("biases must be a (gate_bias, up_bias, down_bias) tuple; any entry may be None")
    for name, bias, width in zip(("gate_bias", "up_bias", "down_bias"), biases,
                                 (intermediate_size, intermediate_size, hidden_size)):
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (experts, width)):
            got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"{name} must be a tensor [{experts}, {width}] (the whole layer) or None, got {got}")


def _part_biases(biases: Biases, index: int, begin: int, end: int) -> Biases | None:
    """Part ``index``'s share (rows ``[begin, end)``) of the layer's ``biases``: gate and up
    biases' columns of its rows, down's bias on part 0 only; None when it has none."""
    gate, up, down = biases
    part = (None if gate is None else gate[:, begin:end], None if up is None else up[:, begin:end],
            down if index == 0 else None)
    return None if all(x is None for x in part) else part


def holds_activation(part: PackedExperts, swiglu_limit: float, swiglu_alpha: float) -> bool:
    """Whether ``part``'s header holds this activation (its fields are fp32, so the numbers
    are compared as fp32 values: 1.702 is the header's 1.70200002)."""
    return struct.unpack("2f", struct.pack("2f", swiglu_limit, swiglu_alpha)) == (part.swiglu_limit,
                                                                                   part.swiglu_alpha)


def _rows(scale: torch.Tensor, kind: str, rows: int) -> torch.Tensor:
    """fp8 block scales ``[n, ceil(N/128), G]`` -> one row per output row ``[n, N, G]``."""
    if kind != "fp8" or scale.shape[1] == rows:
        return scale
    return scale.repeat_interleave(128, dim=1)[:, :rows]


def _in_layer(error: ValueError, begin: int, ids: Sequence[int] | None) -> ValueError:
    """The packer's error about an mxfp8 exponent of the part starting at intermediate row
    ``begin``, naming the layer's row (gate/up) or scale group (down) and the expert's id in
    ``ids`` (None: its position) instead of the part's; other errors as they are."""
    match = _MX_WHERE.match(str(error))
    if match is None:
        return error
    matrix, expert, row, group = match.group(1), *map(int, match.group(2, 3, 4))
    if matrix == "down":
        group += begin // _SCALE_GROUP["mxfp8"]
    else:
        row += begin
    expert = expert if ids is None else int(ids[expert])
    return ValueError(f"mxfp8 {matrix} scale of expert {expert}, row {row}, group {group}{str(error)[match.end():]}")


def pack_fp8_parts(experts: Fp8Experts, parts: int, ids: Sequence[int] | None = None) -> list[PackedExperts]:
    """An FP8 checkpoint's experts (:meth:`kt_ops.hf_checkpoint.HfCheckpoint.load_fp8_experts`)
    packed in place as ``parts`` parts of the intermediate dimension (:func:`part_bounds`).
    A part boundary inside down's k must fall on a scale column (fp8: a multiple of 128,
    mxfp8: of 32); ``ValueError`` otherwise. An mxfp8 exponent the kernels do not take is
    named by the layer's row and scale group and by the expert's id in ``ids`` (the
    checkpoint's expert ids the experts were read from; None: their positions)."""
    method = FP8_KIND_METHODS[experts.kind]
    if parts == 1:
        try:
            return [pack_fp8_experts(experts.gate, experts.up, experts.down, experts.gate_scale, experts.up_scale,
                                     experts.down_scale, method)]
        except ValueError as error:
            raise _in_layer(error, 0, ids) from None
    I = int(experts.gate.shape[1])
    gate_scale, up_scale = (_rows(s, experts.kind, I) for s in (experts.gate_scale, experts.up_scale))
    group = _SCALE_GROUP.get(experts.kind)
    out = []
    for a, b in part_bounds(I, parts):
        if group is not None and a % group:
            raise ValueError(f"threadpool_count {parts} splits down_proj's k (I = {I}) at {a}, inside a {group}-wide "
                             f"{experts.kind} scale group; choose a count that splits I at multiples of {group}")
        down_scale = experts.down_scale if group is None else experts.down_scale[:, :, a // group: -(-b // group)]
        try:
            out.append(pack_fp8_experts(experts.gate[:, a:b], experts.up[:, a:b], experts.down[:, :, a:b].contiguous(),
                                        gate_scale[:, a:b], up_scale[:, a:b], down_scale.contiguous(), method))
        except ValueError as error:
            raise _in_layer(error, a, ids) from None
    return out


def pack_int4_parts(experts: Int4Experts, parts: int) -> list[PackedExperts]:
    """An INT4 checkpoint's experts (:func:`kt_ops.hf_int4.load_int4_experts`) packed in
    place as ``parts`` parts of the intermediate dimension (:func:`part_bounds`). Where a
    part's width is not a multiple of the checkpoint's group, the group is stored as
    smaller groups with the same scale (exact); ``ValueError`` when the width is not a
    multiple of 32."""
    I = int(experts.gate.shape[1])
    bounds = part_bounds(I, parts)
    width = bounds[0][1] - bounds[0][0]
    G = next((g for g in (128, 64, 32) if experts.group_size % g == 0 and width % g == 0), None)
    if G is None:
        raise ValueError(f"threadpool_count {parts} splits I = {I} into parts of {width}, not a multiple of 32 (the "
                         "smallest int4 group); choose a count that leaves multiples of 32")
    factor = experts.group_size // G

    def regroup(values: torch.Tensor) -> torch.Tensor:
        return values if factor == 1 else values.repeat_interleave(factor, dim=-1)

    scales = [regroup(s) for s in experts.scales]
    mins = None if experts.minimums is None else [regroup(m) for m in experts.minimums]
    out = []
    for a, b in bounds:
        rows = slice(a, b)
        part_scales = (scales[0][:, rows], scales[1][:, rows], scales[2][:, :, a // G: b // G])
        part_mins = None if mins is None else (mins[0][:, rows], mins[1][:, rows], mins[2][:, :, a // G: b // G])
        out.append(pack_int4_experts(experts.gate[:, rows], experts.up[:, rows], experts.down[:, :, a // 2: b // 2],
                                     part_scales, part_mins, G))
    return out


def pack_int8_parts(experts: Int8Experts, parts: int) -> list[PackedExperts]:
    """An INT8 checkpoint's experts (:func:`kt_ops.hf_int8.load_int8_experts`) packed in
    place (format ``int8``, the levels copied) as ``parts`` parts of the intermediate
    dimension (:func:`part_bounds`): gate/up rows with their scales, down's columns with
    down's row scales whole (exact: each part's sums carry the same row scale)."""
    out = []
    for a, b in part_bounds(int(experts.gate.shape[1]), parts):
        scales = (experts.scales[0][:, a:b], experts.scales[1][:, a:b], experts.scales[2])
        out.append(PackedExperts(torch.ops.kt.pack_int8_experts(
            experts.gate[:, a:b], experts.up[:, a:b], experts.down[:, :, a:b], *scales)))
    return out
