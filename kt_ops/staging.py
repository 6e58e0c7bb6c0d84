"""One expert's weights in kt-kernel's GPU staging layouts (``write_weight_scale_to_buffer``).

For layer-wise GPU prefill a serving engine (SGLang's ``kt_ep_wrapper``) copies every
expert of a layer to the GPU, one expert at a time through pinned double buffers, in the
checkpoint's own orientation and dtypes so the GPU kernels of that format can run it.
kt-kernel writes these buffers from its packed CPU layers (its ``write_weights_to_buffer``,
``../shared/reference/kt-kernel-upstream-specs.md`` §6.5); :func:`stage_expert` and
:func:`write_weight_scale_to_buffer` do the same from a kt_ops packed layer, un-tiling
the kernel layout back to rows, never widening the codes.

Per GPU tensor-parallel rank ``r`` of ``gpu_tp_count``, with ``I_r = I / gpu_tp_count``
(gate and up rows ``[r I_r, (r + 1) I_r)``, down columns likewise):

========================  ==========================  ============================  =====================  ===========================
format (methods)          w13_weight                  w13_scale                     w2_weight              w2_scale
========================  ==========================  ============================  =====================  ===========================
bf16 (BF16)               bf16 ``[2 I_r, H]``         --                            bf16 ``[H, I_r]``      --
fp8 (FP8)                 e4m3 ``[2 I_r, H]``         fp32 ``[2 ceil(I_r/128),      e4m3 ``[H, I_r]``      fp32 ``[ceil(H/128),
                                                      ceil(H/128)]``                                       ceil(I_r/128)]``
fp8_perchannel            e4m3 ``[2 I_r, H]``         fp32 ``[2 I_r]``              e4m3 ``[H, I_r]``      fp32 ``[H]`` (unsplit)
mxfp8 (MXFP8)             e4m3 ``[2 I_r, H]``         uint8 ue8m0 ``[2 I_r, H/32]`` e4m3 ``[H, I_r]``      uint8 ``[H, I_r/32]``
int4 (RAWINT4, and any    uint8 ``[2 I_r, H/2]``      bf16 ``[2 I_r, H/gs]``        uint8 ``[H, I_r/2]``   bf16 ``[H, I_r/gs]``
symmetric INT4 layer)
mxfp4 (MXFP4); gguf      uint8 ``[2 I_r, H/2]``      bf16 ``[2 I_r, H/32]``        uint8 ``[H, I_r/2]``   bf16 ``[H, I_r/32]``
of MXFP4 blocks
========================  ==========================  ============================  =====================  ===========================

``w13`` is the rank's gate rows, then its up rows. 4-bit bytes hold element ``2j`` in the
low nibble and ``2j + 1`` in the high one (compressed-tensors' and DeepSeek-V4's order);
int4 nibbles are ``q + 8`` (``w = (nibble - 8) * scale``, compressed-tensors'
``pack-quantized``), MXFP4 nibbles e2m1 codes. int4 scales are the fp32 scales truncated
to bf16 (kt-kernel's conversion: lossless for scales read from a bf16 checkpoint). MXFP4
scales are ``2^(e - 127)`` as bf16; where kt-kernel writes ``e << 7`` (exponent 0 as +0,
255 as +inf) this writes the OCP values: 0 as ``2^-127`` (a bf16 subnormal) and 255 as
NaN. FP8 block scales must be equal over each 128-row block (they are, for layers read
from block-FP8 checkpoints and for ``pack_experts(..., method="FP8")``). Layers with no
staging layout in kt-kernel (int8, asymmetric int4, GGUF types other than MXFP4) raise
``ValueError``, as does a split that cuts a scale group (``I_r``, and the I slice of each
NUMA part but the last, a multiple of 128 for FP8 blocks, of ``gs`` for INT4, of 32 for
MXFP4/MXFP8) and FP8_PERCHANNEL parts whose down_proj scales differ (quantized per part).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from kt_ops._native import _C
from kt_ops._validate import is_integral
from kt_ops.packed import PackedExperts

Destination = Union[int, torch.Tensor]
"""A host address (what kt-kernel takes: a pinned buffer's pointer as an int) or a tensor
of exactly the staged bytes (any dtype, any device but meta, contiguous)."""

_FP8_BLOCK = 128
_MX_GROUP = 32


@dataclass(frozen=True)
class ExpertStaging:
    """One expert for one GPU TP rank, in the layouts of the module's table."""

    w13_weight: torch.Tensor
    w13_scale: torch.Tensor | None
    w2_weight: torch.Tensor
    w2_scale: torch.Tensor | None


@dataclass
class _Rows:
    """An expert back in checkpoint rows (``kt::stage_expert_rows``): ``gate``/``up`` ``[I, .]``
    and ``down`` ``[H, .]`` in the staging element types (bf16, e4m3 bytes, or two 4-bit codes
    per byte), with per-row scales ``[rows, groups]`` (fp32, ue8m0 bytes or bf16) where the
    format has them."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_scale: torch.Tensor | None = None
    up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None


# format -> (code dtype, bytes per element of a row: 2 bf16, 1 e4m3, 0.5 two 4-bit codes per
# byte), scale dtype (None: no scales) and k per scale group (None: one scale per row).
def _row_formats(fmt: str, group: int, int4_fp32_scales: bool = False,
                 ) -> tuple[torch.dtype, float, torch.dtype | None, int | None]:
    if fmt in ("int4", "int4_asym") and int4_fp32_scales:  # int4_asym: (scale, minimum) pairs
        return torch.uint8, 0.5, torch.float32, group
    return {
        "bf16": (torch.bfloat16, 2.0, None, None),
        "fp8": (torch.uint8, 1.0, torch.float32, _FP8_BLOCK),
        "fp8_perchannel": (torch.uint8, 1.0, torch.float32, None),
        "mxfp8": (torch.uint8, 1.0, torch.uint8, _MX_GROUP),
        "int4": (torch.uint8, 0.5, torch.bfloat16, group),
        "mxfp4": (torch.uint8, 0.5, torch.bfloat16, _MX_GROUP),
        "int8": (torch.int8, 1.0, torch.float32, None),  # kt_ops' GPU prefill only
    }[fmt]


@dataclass(frozen=True)
class RowLayout:
    """How ``kt::stage_expert_rows`` writes a layer's experts: checkpoint rows of codes in
    ``code_dtype`` (``code_bytes`` per element), scales ``scale_dtype`` (None: none) per
    row and group of ``group`` k values (None: one per row)."""

    format: str  # bf16, fp8, fp8_perchannel, mxfp8, int4, mxfp4 (int8, int4_asym: row_layout(prefill=True))
    group_size: int  # the INT4 group (the packed header's), 32 for MXFP4
    hidden: int
    intermediate: int
    code_dtype: torch.dtype
    code_bytes: float
    scale_dtype: torch.dtype | None
    group: int | None
    int4_fp32_scales: bool = False  # int4 scales as fp32 (row_layout(prefill=True)), not bf16
    scale_values: int = 1  # values per row and group: 2 for int4_asym's (scale, minimum)

    def buffers(self, count: int | None = None, pin: bool = False) -> list[torch.Tensor]:
        """Empty uint8 outputs for ``count`` experts (None: one, no leading dim): gate,
        up ``[I, .]``, down ``[H, .]``, then their scales (empty without scales)."""
        lead = () if count is None else (count,)

        def make(rows: int, k: int, scales: bool) -> torch.Tensor:
            if not scales:
                width = int(k * self.code_bytes)
            elif self.scale_dtype is None:
                return torch.empty(*lead, 0, dtype=torch.uint8, pin_memory=pin)
            else:
                width = (1 if self.group is None else -(-k // self.group)) * self.scale_dtype.itemsize * self.scale_values
            return torch.empty(*lead, rows, width, dtype=torch.uint8, pin_memory=pin)

        H, I = self.hidden, self.intermediate
        return [make(I, H, False), make(I, H, False), make(H, I, False), make(I, H, True), make(I, H, True),
                make(H, I, True)]

    def views(self, outs: list[torch.Tensor]) -> _Rows:
        """:meth:`buffers` filled, seen in their element types."""
        c = [t.view(self.code_dtype) for t in outs[:3]]
        sc = [t.view(self.scale_dtype) if self.scale_dtype is not None else None for t in outs[3:]]
        return _Rows(c[0], c[1], c[2], sc[0], sc[1], sc[2])


def row_layout(packed: PackedExperts, prefill: bool = False) -> RowLayout:
    """The :class:`RowLayout` of a layer; ``ValueError`` for one with no staging layout.
    ``prefill``: the rows :mod:`kt_ops.gpu_prefill` moves, which are not all kt-kernel's:
    INT4 scales as fp32 (exact), and INT8 (int8 rows, fp32 scales per row) and asymmetric
    INT4 layers (fp32 (scale, minimum) pairs) too. ``RuntimeError`` for a layer whose
    mapped file changed on disk."""
    info = _C.packed_info(packed.data)
    fmt, H, I, G = (info[key] for key in ("format", "hidden_size", "intermediate_size", "group_size"))
    if fmt == "gguf" and list(info["gguf_types"]) == ["MXFP4"] * 3:
        fmt, G = "mxfp4", _MX_GROUP
    if fmt not in ("bf16", "fp8", "fp8_perchannel", "mxfp8", "int4", "mxfp4") and not (
            prefill and fmt in ("int8", "int4_asym")):
        kind = f"gguf ({'/'.join(info['gguf_types'])})" if fmt == "gguf" else fmt
        raise ValueError(f"a {kind} layer has no GPU staging layout (kt-kernel writes BF16, FP8, FP8_PERCHANNEL, "
                         "MXFP8, RAWINT4 and MXFP4 layers; a symmetric INT4 layer stages as RAWINT4)")
    return RowLayout(fmt, G, H, I, *_row_formats(fmt, G, prefill), int4_fp32_scales=prefill and fmt.startswith("int4"),
                     scale_values=2 if fmt == "int4_asym" else 1)


def stage_rows_into(packed: PackedExperts, expert: int, outs: list[torch.Tensor],
                    int4_fp32_scales: bool = False) -> None:
    """Writes expert ``expert``'s rows into :meth:`RowLayout.buffers` (or one expert's
    slices of them; ``int4_fp32_scales`` as the layout's), on the engine's threads, without
    the GIL. ``RuntimeError`` for a layer whose mapped file changed on disk."""
    num_experts = _C.packed_info(packed.data)["num_experts"]
    if not is_integral(expert) or not 0 <= expert < num_experts:  # True would be expert 1
        raise ValueError(f"expert {expert!r} is not in this layer's {num_experts} packed experts")
    _C.stage_expert_rows(packed.data, expert, outs, int4_fp32_scales)


def _expert_rows(packed: PackedExperts, expert: int) -> tuple[str, int, _Rows]:
    """(format, group size, rows) of one expert of one packed layer."""
    layout = row_layout(packed)
    outs = layout.buffers()
    stage_rows_into(packed, expert, outs)
    return layout.format, layout.group_size, layout.views(outs)


def _cat(parts: list[_Rows], field: str, dim: int) -> torch.Tensor | None:
    values = [getattr(p, field) for p in parts]
    return None if values[0] is None else torch.cat(values, dim=dim)


def _block_scales(rows: torch.Tensor, name: str) -> torch.Tensor:
    """Per-row fp32 scales ``[n, g]`` -> the block grid ``[ceil(n / 128), g]``, refused where a
    block's rows disagree. NaN entries (the packer's mark of a row whose group holds a NaN
    code: that code is NaN on the GPU too) are left out; a block of NaN only stays NaN."""
    n, g = rows.shape
    blocks = -(-n // _FP8_BLOCK)
    padded = torch.full((blocks * _FP8_BLOCK, g), float("nan"))
    padded[:n] = rows
    padded = padded.reshape(blocks, _FP8_BLOCK, g)
    valid = ~torch.isnan(padded)
    top = torch.where(valid, padded, float("-inf")).amax(dim=1)
    bottom = torch.where(valid, padded, float("inf")).amin(dim=1)
    seen = valid.any(dim=1)
    if bool((seen & (top != bottom)).any()):
        raise ValueError(f"{name}: the FP8 scales differ within a 128-row block, so the layer has no block-FP8 "
                         "staging layout")
    return torch.where(seen, top, torch.full_like(top, float("nan"))).contiguous()


def stage_expert(packed: PackedExperts | Sequence[PackedExperts], expert: int,
                 gpu_tp_count: int = 1) -> list[ExpertStaging]:
    """Expert ``expert`` (a packed expert index) of a layer, per GPU TP rank, in the layouts
    of this module's table.

    Args:
        packed: the layer, or its NUMA parts (``KTMoEWrapper``'s parts: each holds a slice
            of I, in order, that keeps down_proj's scale groups whole).
        expert: the expert's index in the packed layer.
        gpu_tp_count: GPU tensor-parallel ranks; must divide I (and keep scale groups whole).

    Returns:
        ``gpu_tp_count`` :class:`ExpertStaging`, new contiguous CPU tensors.
    """
    parts = [packed] if isinstance(packed, PackedExperts) else list(packed)
    if not parts:
        raise ValueError("stage_expert needs a packed layer")
    if not is_integral(gpu_tp_count) or gpu_tp_count < 1:  # True would be 1 rank, 2.0 a TypeError from slicing
        raise ValueError(f"gpu_tp_count must be an int >= 1, got {gpu_tp_count!r}")
    staged = [_expert_rows(p, expert) for p in parts]
    fmt, group = staged[0][0], staged[0][1]
    if any(s[0] != fmt or s[1] != group for s in staged):
        raise ValueError("the parts of a layer must share one format and group size")
    rows = [s[2] for s in staged]
    unit = {"fp8": _FP8_BLOCK, "mxfp8": _MX_GROUP, "int4": group, "mxfp4": _MX_GROUP}.get(fmt, 1)
    widths = [int(r.gate.shape[0]) for r in rows]
    if any(w % unit for w in widths[:-1]):  # each part's down scales restart their groups at its first column
        raise ValueError(f"the layer's parts split I = {sum(widths)} into {widths} rows, cutting down_proj's "
                         f"{unit}-wide {fmt} scale groups, so the layer has no staging layout")
    if fmt == "fp8_perchannel" and any(
            not torch.equal(r.down_scale.view(torch.uint8), rows[0].down_scale.view(torch.uint8)) for r in rows[1:]):
        raise ValueError("the layer's parts hold different fp8_perchannel down_proj scales (each part quantized its "
                         "own columns), so the layer has no staging layout (one w2 scale per row)")
    gate, up, down = _cat(rows, "gate", 0), _cat(rows, "up", 0), _cat(rows, "down", 1)
    gate_s, up_s, down_s = _cat(rows, "gate_scale", 0), _cat(rows, "up_scale", 0), _cat(rows, "down_scale", 1)
    H, I = down.shape[0], gate.shape[0]
    if I % gpu_tp_count:
        raise ValueError(f"gpu_tp_count {gpu_tp_count} does not divide I = {I}")
    ir = I // gpu_tp_count
    if gpu_tp_count > 1 and ir % unit:
        raise ValueError(f"gpu_tp_count {gpu_tp_count} splits I = {I} into {ir}-row slices, not multiples of the "
                         f"{fmt} scale group ({unit})")
    out = []
    for r in range(gpu_tp_count):
        rs = slice(r * ir, (r + 1) * ir)
        w13 = torch.cat((gate[rs], up[rs]), dim=0)
        per_byte = 2 if fmt in ("int4", "mxfp4") else 1  # elements per byte of a row
        w2 = down[:, r * ir // per_byte : (r + 1) * ir // per_byte].contiguous()
        if fmt == "bf16":
            out.append(ExpertStaging(w13, None, w2, None))
        elif fmt in ("fp8", "fp8_perchannel", "mxfp8"):
            w13_codes, w2_codes = w13.view(torch.float8_e4m3fn), w2.view(torch.float8_e4m3fn)
            if fmt == "fp8":
                gs = torch.cat((_block_scales(gate_s[rs], "gate"), _block_scales(up_s[rs], "up")), dim=0)
                first = r * ir // _FP8_BLOCK
                ds = _block_scales(down_s, "down")[:, first : first + -(-ir // _FP8_BLOCK)]
                out.append(ExpertStaging(w13_codes, gs.contiguous(), w2_codes, ds.contiguous()))
            elif fmt == "fp8_perchannel":
                gs = torch.cat((gate_s[rs, 0], up_s[rs, 0]))
                out.append(ExpertStaging(w13_codes, gs.contiguous(), w2_codes, down_s[:, 0].contiguous()))
            else:
                gs = torch.cat((gate_s[rs], up_s[rs]), dim=0)
                ds = down_s[:, r * ir // _MX_GROUP : -(-(r + 1) * ir // _MX_GROUP)]  # a partial last group kept
                out.append(ExpertStaging(w13_codes, gs.contiguous(), w2_codes, ds.contiguous()))
        else:  # int4 and mxfp4: two codes per byte, bf16 scales per group
            gs = torch.cat((gate_s[rs], up_s[rs]), dim=0)
            ds = down_s[:, r * ir // group : -(-(r + 1) * ir // group)]
            out.append(ExpertStaging(w13, gs.contiguous(), w2, ds.contiguous()))
    return out


def _check(destination: Destination, source: torch.Tensor, name: str) -> None:
    """``ValueError`` unless ``destination`` can take ``source``'s bytes: a plain contiguous
    tensor (strided, not quantized, no conjugate or negative bit) of exactly as many bytes on
    a real device, or a host address (an int in ``(0, 2^64)``)."""
    nbytes = source.numel() * source.element_size()
    if isinstance(destination, torch.Tensor):
        if (destination.layout != torch.strided or destination.is_quantized or destination.is_conj()
                or destination.is_neg() or not destination.is_contiguous() or destination.is_meta
                or destination.numel() * destination.element_size() != nbytes):  # (none of them takes plain bytes)
            raise ValueError(f"{name}: the destination must be a contiguous tensor of {nbytes} bytes "
                             f"({source.dtype} {tuple(source.shape)}) on a device that holds data, got "
                             f"{destination.dtype} {tuple(destination.shape)} on {destination.device}")
        return
    if isinstance(destination, bool) or not isinstance(destination, int) or not 0 < destination < 1 << 64:
        raise ValueError(f"{name}: a destination is a host address (int > 0) or a tensor, got {destination!r}")


def _write(destination: Destination, source: torch.Tensor) -> None:
    """Copies ``source``'s bytes into a destination :func:`_check` accepted."""
    data = source.contiguous().reshape(-1).view(torch.uint8)
    if isinstance(destination, torch.Tensor):
        destination.reshape(-1).view(torch.uint8).copy_(data)
        return
    target = torch.frombuffer((ctypes.c_uint8 * data.numel()).from_address(destination), dtype=torch.uint8)
    target.copy_(data)


def write_weight_scale_to_buffer(
    packed: PackedExperts | Sequence[PackedExperts],
    expert: int,
    gpu_tp_count: int,
    w13_weight_ptrs: Sequence[Destination],
    w13_scale_ptrs: Sequence[Destination],
    w2_weight_ptrs: Sequence[Destination],
    w2_scale_ptrs: Sequence[Destination],
) -> None:
    """Writes expert ``expert`` of a layer into one destination per GPU TP rank for each of
    the four tensors (kt-kernel's ``write_weight_scale_to_buffer``; layouts in this module's
    table). A destination is a host address (an int, as kt-kernel takes a pinned buffer's
    pointer, already at this expert's slot; the caller guarantees the bytes are writable) or
    a contiguous tensor of exactly the staged bytes. Formats without scales (BF16) ignore
    the scale destinations (``None`` entries are fine). Every destination is checked
    (``ValueError``) before any is written."""
    staged = stage_expert(packed, expert, gpu_tp_count)
    lists = {"w13_weight_ptrs": w13_weight_ptrs, "w13_scale_ptrs": w13_scale_ptrs,
             "w2_weight_ptrs": w2_weight_ptrs, "w2_scale_ptrs": w2_scale_ptrs}
    for name, values in lists.items():
        if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):  # None: "has no len()"
            raise ValueError(f"{name} must be a list or tuple of {gpu_tp_count} destination(s), one per GPU TP rank "
                             f"(a host address or a tensor), got {type(values).__name__}")
        if len(values) != gpu_tp_count:
            raise ValueError(f"{name} has {len(values)} entries for gpu_tp_count {gpu_tp_count}")
    writes = []
    for r, s in enumerate(staged):
        writes += [(w13_weight_ptrs[r], s.w13_weight, f"w13_weight_ptrs[{r}]"),
                   (w2_weight_ptrs[r], s.w2_weight, f"w2_weight_ptrs[{r}]")]
        if s.w13_scale is not None and s.w2_scale is not None:
            writes += [(w13_scale_ptrs[r], s.w13_scale, f"w13_scale_ptrs[{r}]"),
                       (w2_scale_ptrs[r], s.w2_scale, f"w2_scale_ptrs[{r}]")]
    for destination, source, name in writes:  # all checked before the first byte is written
        _check(destination, source, name)
    for destination, source, _ in writes:
        _write(destination, source)
