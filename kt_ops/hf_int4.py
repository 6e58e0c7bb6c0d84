"""INT4 checkpoints as published, read in place: RAWINT4, GPTQ_INT4 and AWQ_INT4.

Per-expert tensors (``{stem}`` = ``{base}.mlp.experts.{e}.{gate,up,down}_proj`` or
``{base}.block_sparse_moe.experts.{e}.{w1,w3,w2}``; ``N`` output rows, ``K`` inputs):

- ``RAWINT4`` (compressed-tensors ``pack-quantized``, Kimi-K2-Thinking / K2.5):
  ``{stem}.weight_packed`` int32 ``[N, K/8]`` (or uint8 ``[N, K/2]``), ``{stem}.weight_scale``
  ``[N, K/gs]``, optional ``{stem}.weight_shape`` ``[N, K]``; ``W = (nibble - 8) * scale``
  (a ``weight_zero_point`` other than 0 or an act-order ``weight_g_idx`` is refused).
- ``GPTQ_INT4``: ``{stem}.qweight`` int32 ``[K/8, N]``, ``{stem}.scales`` ``[K/gs, N]``,
  ``{stem}.qzeros`` int32 ``[K/gs, N/8]``; ``W = (q - (z + 1)) * scale`` (the published v1
  convention; ``checkpoint_format: gptq_v2``: ``q - z``). Symmetric and asymmetric (``sym:
  false``); without ``qzeros`` the zero is 8. An act-order ``g_idx`` that is not ``k // gs`` is
  refused (see :func:`load_int4_experts`).
- ``AWQ_INT4`` (AutoAWQ GEMM): ``{stem}.qweight`` int32 ``[K, N/8]`` whose nibble ``i`` holds
  column ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of its group of 8, ``{stem}.qzeros`` packed the same
  way ``[K/gs, N/8]``, ``{stem}.scales`` ``[K/gs, N]``; ``W = (q - z) * scale``.

The nibbles are kept (re-tiled, never widened): a symmetric layer becomes format ``int4``
(``w = scale * (q - 8)``), one with zero points ``int4_asym`` (``minimum = -scale * zero``),
both exact. Group sizes that are multiples of 32 are taken (a group above 128 is stored as
several 128-groups with the same scale). ``kt_ops.reference.dequantize_rawint4`` /
``dequantize_gptq`` / ``dequantize_awq`` are the oracles.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from kt_ops.hf_checkpoint import HfCheckpoint, LayerExperts, read_config_json
from kt_ops.hf_int8 import is_packed_int8
from kt_ops.reference import AWQ_ORDER

INT4_METHODS = ("RAWINT4", "GPTQ_INT4", "AWQ_INT4")
PACKED_GROUPS = (128, 64, 32)  # the int4 formats' k-groups, largest first
_FLOATS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass(frozen=True)
class Int4Experts:
    """One layer's INT4 experts, normalized for :func:`kt_ops.pack_int4_experts`.

    ``gate``, ``up``: uint8 ``[n, I, H/2]``, ``down`` ``[n, H, I/2]``: two levels 0..15 per
    byte (element k of a row in byte k // 2, the low nibble for even k). Scales (and
    ``minimums``, None when symmetric) fp32 ``[n, N, K / group_size]``:
    ``w = scale * (q - 8)`` or ``w = scale * q + minimum``.
    """

    method: str
    group_size: int
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    minimums: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


def quantization_config(path: str | Path) -> dict:
    """``config.json``'s ``quantization_config`` of a checkpoint directory (or its parent, as
    kt-kernel also looks there); ``{}`` when there is none."""
    for folder in (Path(path), Path(path).parent):
        if (folder / "config.json").is_file():
            value = read_config_json(folder).get("quantization_config") or {}
            return value if isinstance(value, dict) else {}
    return {}


def int4_method(checkpoint: HfCheckpoint, layer: int) -> str | None:
    """``"RAWINT4"``, ``"GPTQ_INT4"`` or ``"AWQ_INT4"`` for a layer whose experts are INT4
    (from the tensor names, ``config.json``'s ``quant_method`` and the shapes); None when
    they are not (8-bit ``weight_packed`` words included: :func:`kt_ops.hf_int8.is_packed_int8`).
    ``ValueError`` when the config and the shapes disagree."""
    where = checkpoint.layer(layer)
    if where.suffix == "weight_packed" and is_packed_int8(checkpoint, where.stem(0, 0)):
        return None
    if where.suffix == "weight_packed":
        scale_key = f"{where.stem(0, 0)}.weight_scale"
        dtype = checkpoint.tensor_info(scale_key)[0] if scale_key in checkpoint.keys() else None
        fp4 = {"F8_E4M3": "NVFP4", "U8": "MXFP4", "F8_E8M0": "MXFP4"}.get(dtype or "")
        if fp4 is not None:  # compressed-tensors' FP4 formats name their tensors as pack-quantized INT4 does
            raise ValueError(f"{checkpoint.path}: {scale_key} is {dtype}: layer {layer} holds {fp4} experts "
                             "(compressed-tensors), not RAWINT4; kt_ops does not read this checkpoint format")
        return "RAWINT4"
    if where.suffix != "qweight":
        return None
    stem = where.stem(0, 0)
    qweight = checkpoint.tensor_info(f"{stem}.qweight")[1]
    scales_key = f"{stem}.scales"
    if scales_key not in checkpoint.keys():
        raise ValueError(f"{checkpoint.path}: {stem}.qweight has no {scales_key!r} beside it")
    scales = checkpoint.tensor_info(scales_key)[1]
    by_shape = None
    if len(qweight) == 2 and len(scales) == 2:
        if scales[1] == qweight[1]:
            by_shape = "GPTQ_INT4"  # qweight [K/8, N]
        elif scales[1] == 8 * qweight[1]:
            by_shape = "AWQ_INT4"  # qweight [K, N/8]
    config = quantization_config(checkpoint.path)
    named = {"gptq": "GPTQ_INT4", "awq": "AWQ_INT4"}.get(str(config.get("quant_method", "")).lower())
    bits = config.get("bits", config.get("w_bit"))
    if named is not None and bits is not None and str(bits) != "4":
        raise ValueError(f"{checkpoint.path}: config.json's quantization_config says bits {bits!r}; kt_ops reads "
                         f"4-bit {named.split('_')[0]} checkpoints only ({stem}.qweight {list(qweight)})")
    if by_shape is None:
        raise ValueError(f"{checkpoint.path}: {stem}.qweight {list(qweight)} and {scales_key} {list(scales)} fit "
                         "neither GPTQ (qweight [K/8, N], scales [K/gs, N]) nor AWQ (qweight [K, N/8])")
    if named is not None and named != by_shape:
        raise ValueError(f"{checkpoint.path}: config.json says {named} but {stem}.qweight {list(qweight)} with "
                         f"scales {list(scales)} is laid out as {by_shape}")
    return by_shape


def _float(checkpoint: HfCheckpoint, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    if key not in checkpoint.keys():
        raise ValueError(f"{checkpoint.path}: tensor {key!r} is missing")
    dtype, got = checkpoint.tensor_info(key)
    if dtype not in _FLOATS or tuple(got) != shape:
        raise ValueError(f"{checkpoint.path}: tensor {key!r} is {dtype} {list(got)}; expected a float tensor "
                         f"{list(shape)}")
    value = checkpoint.read_tensor(key).float()
    if not torch.isfinite(value).all():
        raise ValueError(f"{checkpoint.path}: tensor {key!r} holds NaN or infinite values")
    return value


def _int32(checkpoint: HfCheckpoint, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    if key not in checkpoint.keys():
        raise ValueError(f"{checkpoint.path}: tensor {key!r} is missing")
    dtype, got = checkpoint.tensor_info(key)
    if dtype != "I32" or tuple(got) != shape:
        raise ValueError(f"{checkpoint.path}: tensor {key!r} is {dtype} {list(got)}; expected I32 {list(shape)}")
    return checkpoint.read_tensor(key)


def _groups(checkpoint: HfCheckpoint, key: str, K: int) -> int:
    """The group size of a ``[K/gs, ...]`` (GPTQ/AWQ) or ``[..., K/gs]`` (RAWINT4) scale."""
    if key not in checkpoint.keys():
        raise ValueError(f"{checkpoint.path}: tensor {key!r} is missing")
    _, shape = checkpoint.tensor_info(key)
    if len(shape) != 2:
        raise ValueError(f"{checkpoint.path}: tensor {key!r} is {list(shape)}; scales are 2-D")
    count = shape[-1] if key.endswith("weight_scale") else shape[0]
    if count < 1 or K % count or (K // count) % 32:
        raise ValueError(f"{checkpoint.path}: tensor {key!r} {list(shape)} gives {count} groups over K = {K}: the "
                         "group size must divide K and be a multiple of 32")
    return K // count


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Levels ``[N, K]`` (0..15) -> bytes ``[N, K/2]``, element k in byte k // 2 (even: low)."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def _unpack_columns(words: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """int32 ``[R, C]`` holding 8 nibbles each -> int64 ``[R, 8C]``, nibble i of word c at
    column 8c + order[i]."""
    out = torch.empty(words.shape[0], words.shape[1], 8, dtype=torch.int64)
    wide = words.to(torch.int64)
    for i, column in enumerate(order):
        out[:, :, column] = (wide >> (4 * i)) & 0xF
    return out.reshape(words.shape[0], -1)


def check_rawint4_symmetric(checkpoint: HfCheckpoint, stem: str, N: int, K: int, gs: int) -> None:
    """``ValueError`` naming the tensor when a RAWINT4 matrix has a ``weight_zero_point``
    other than 0 (asymmetric compressed-tensors: packed 8 per int32 along N with 8 added,
    ``[ceil(N/8), K/gs]``, or unpacked ``[N, K/gs]``) or a ``weight_g_idx`` that is not
    ``k // gs`` (act-order): reading the nibbles as symmetric, in k order, would be wrong."""
    key = f"{stem}.weight_zero_point"
    if key in checkpoint.keys():
        dtype, shape = checkpoint.tensor_info(key)
        zeros = checkpoint.read_tensor(key)
        packed = dtype == "I32" and tuple(shape) == (-(-N // 8), K // gs)
        symmetric = (not zeros.is_floating_point() and tuple(shape) in ((N, K // gs), (-(-N // 8), K // gs))
                     and bool((zeros == (-0x77777778 if packed else 0)).all()))
        if not symmetric:
            raise ValueError(f"{checkpoint.path}: {key} ({dtype} {list(shape)}) holds zero points other than 0: an "
                             "asymmetric compressed-tensors checkpoint, which kt_ops does not read (its nibbles "
                             "would be taken as symmetric); quantize symmetrically, or load the float model")
    key = f"{stem}.weight_g_idx"
    if key in checkpoint.keys():
        g_idx = checkpoint.read_tensor(key).reshape(-1).long()
        if g_idx.numel() != K or not torch.equal(g_idx, torch.arange(K) // gs):
            raise ValueError(f"{checkpoint.path}: {key} is an act-order permutation; kt_ops reads compressed-tensors "
                             "checkpoints quantized without act-order only. Quantize with actorder=None, or load "
                             "the float model with method AMXINT4")


def _read_matrix(checkpoint: HfCheckpoint, method: str, stem: str, N: int, K: int, zero_offset: int,
                 sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """(nibbles [N, K/2], scales [N, K/gs] fp32, zeros [N, K/gs] int64 or None, gs) of one matrix."""
    if K % 8:
        raise ValueError(f"{checkpoint.path}: {stem} has K = {K}, not a multiple of 8 (int4 words)")
    if method == "RAWINT4":
        key = f"{stem}.weight_packed"
        dtype, shape = checkpoint.tensor_info(key)
        if not ((dtype == "I32" and tuple(shape) == (N, K // 8)) or (dtype == "U8" and tuple(shape) == (N, K // 2))):
            raise ValueError(f"{checkpoint.path}: tensor {key!r} is {dtype} {list(shape)}; expected I32 "
                             f"[{N}, {K // 8}] or U8 [{N}, {K // 2}]")
        if f"{stem}.weight_shape" in checkpoint.keys():
            declared = [int(v) for v in checkpoint.read_tensor(f"{stem}.weight_shape").reshape(-1).tolist()]
            if declared != [N, K]:
                raise ValueError(f"{checkpoint.path}: {stem}.weight_shape is {declared}; the layer needs [{N}, {K}]")
        gs = _groups(checkpoint, f"{stem}.weight_scale", K)
        scales = _float(checkpoint, f"{stem}.weight_scale", (N, K // gs))
        check_rawint4_symmetric(checkpoint, stem, N, K, gs)
        nibbles = checkpoint.read_tensor(key).contiguous().view(torch.uint8).reshape(N, K // 2)
        return nibbles, scales, None, gs
    if N % 8:
        raise ValueError(f"{checkpoint.path}: {stem} has N = {N}, not a multiple of 8 (packed zero points)")
    gs = _groups(checkpoint, f"{stem}.scales", K)
    scales = _float(checkpoint, f"{stem}.scales", (K // gs, N)).t().contiguous()
    zeros_key = f"{stem}.qzeros"
    if method == "GPTQ_INT4":
        qweight = _int32(checkpoint, f"{stem}.qweight", (K // 8, N))
        nibbles = qweight.t().contiguous().view(torch.uint8)  # [N, K/2]: words along k, low nibble first
        g_idx_key = f"{stem}.g_idx"
        if g_idx_key in checkpoint.keys():
            g_idx = checkpoint.read_tensor(g_idx_key).reshape(-1).long()
            if g_idx.numel() != K or not torch.equal(g_idx, torch.arange(K) // gs):
                raise ValueError(
                    f"{checkpoint.path}: {g_idx_key} is an act-order (desc_act) permutation; kt_ops reads GPTQ "
                    "checkpoints quantized without act-order only (gate/up would need the hidden state permuted "
                    "per layer). Quantize with desc_act=False, or load the float model with method AMXINT4")
        if zeros_key not in checkpoint.keys():
            if not sym:
                raise ValueError(f"{checkpoint.path}: {zeros_key!r} is missing but config.json says sym: false "
                                 "(asymmetric GPTQ needs its zero points)")
            return nibbles, scales, None, gs
        zeros = _unpack_columns(_int32(checkpoint, zeros_key, (K // gs, N // 8)), range(8)).t() + zero_offset
        return nibbles, scales, zeros, gs
    qweight = _int32(checkpoint, f"{stem}.qweight", (K, N // 8))
    nibbles = _pack_nibbles(_unpack_columns(qweight, AWQ_ORDER).t())
    if zeros_key not in checkpoint.keys():
        raise ValueError(f"{checkpoint.path}: {zeros_key!r} is missing; AWQ checkpoints carry zero points")
    zeros = _unpack_columns(_int32(checkpoint, zeros_key, (K // gs, N // 8)), AWQ_ORDER).t()
    return nibbles, scales, zeros, gs


def _packed_group(sizes: set[int], H: int, I: int) -> int:
    for group in PACKED_GROUPS:
        if all(size % group == 0 for size in sizes) and H % group == 0 and I % group == 0:
            return group
    raise ValueError(f"group sizes {sorted(sizes)} with H = {H}, I = {I}: no int4 k-group of "
                     f"{'/'.join(map(str, PACKED_GROUPS))} divides them all")


def load_int4_experts(checkpoint: HfCheckpoint, layer: int, experts: Sequence[int], hidden_size: int,
                      intermediate_size: int, method: str | None = None) -> Int4Experts:
    """The listed experts (logical indices, repeats allowed) of an INT4 layer, normalized
    (:class:`Int4Experts`); the nibbles are copied, never widened.

    ``method`` (default: :func:`int4_method`) must match what the layer holds. Raises
    ``ValueError`` naming the tensor for a wrong shape or dtype, a group size that does not
    divide K or is not a multiple of 32, a missing ``qzeros`` for ``sym: false``, an
    act-order ``g_idx``, a RAWINT4 zero point other than 0, a non-finite scale, expert biases
    (:meth:`HfCheckpoint.check_no_biases`), or a method the layer does not hold;
    ``KeyError`` for a missing layer or expert.
    """
    found = int4_method(checkpoint, layer)
    if found is None:
        raise ValueError(f"{checkpoint.path}: layer {layer} holds no INT4 experts ({checkpoint.layer(layer).key(0)!r})")
    if method is not None and method.upper() != found:
        raise ValueError(f"{checkpoint.path}: layer {layer} holds {found} experts; method {method!r} cannot read them "
                         f"(use method='{found}')")
    where: LayerExperts = checkpoint.layer(layer)
    checkpoint.check_no_biases(where)
    for e in experts:
        if not 0 <= e < where.num_experts:
            raise KeyError(f"{checkpoint.path}: layer {layer} has {where.num_experts} experts; expert {e} is missing")
    config = quantization_config(checkpoint.path)
    zero_offset = 0 if str(config.get("checkpoint_format", "")).lower() == "gptq_v2" else 1
    sym = bool(config.get("sym", True))
    H, I = hidden_size, intermediate_size
    read = [[_read_matrix(checkpoint, found, where.stem(m, e), N, K, zero_offset, sym) for e in experts]
            for m, (N, K) in enumerate(((I, H), (I, H), (H, I)))]
    group = _packed_group({gs for matrix in read for (_, _, _, gs) in matrix}, H, I)
    asymmetric = any(z is not None and bool((z != 8).any()) for matrix in read for (_, _, z, _) in matrix)
    nibbles, scales, minimums = [], [], []
    for m, (N, K) in enumerate(((I, H), (I, H), (H, I))):
        q = torch.empty((len(experts), N, K // 2), dtype=torch.uint8)
        s = torch.empty((len(experts), N, K // group))
        mins = torch.empty_like(s) if asymmetric else None
        matrix, read[m] = read[m][::-1], []
        for i in range(len(experts)):
            nib, scale, zeros, gs = matrix.pop()  # each expert's copy dropped once stacked: peak 1.3x, not 2.2x
            q[i].copy_(nib)
            s[i].copy_(scale.repeat_interleave(gs // group, dim=1))
            if mins is not None:
                zero = torch.full_like(scale, 8.0) if zeros is None else zeros.float()
                mins[i].copy_((-scale * zero).repeat_interleave(gs // group, dim=1))
        nibbles.append(q)
        scales.append(s)
        if mins is not None:
            minimums.append(mins)
    return Int4Experts(found, group, nibbles[0], nibbles[1], nibbles[2], (scales[0], scales[1], scales[2]),
                       (minimums[0], minimums[1], minimums[2]) if asymmetric else None)
