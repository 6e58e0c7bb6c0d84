"""INT8 checkpoints as published, read in place: W8A8 / W8A16 per-channel int8 experts.

compressed-tensors' ``int-quantized`` format (llm-compressor's W8A8 scheme, e.g. the
``*-quantized.w8a8`` Qwen3-MoE checkpoints) stores each expert linear as ``{stem}.weight``
int8 ``[N, K]`` and ``{stem}.weight_scale`` (fp32/bf16/fp16) ``[N, 1]`` or ``[N]`` (the
``tensor`` strategy: ``[1]``, taken for every row): ``W = q * scale``, one scale per output
row, symmetric, levels -128 ... 127 (llm-compressor rounds ``w / (max|w| / 127.5)``, so
-128 occurs). That is format ``int8`` (kt-kernel's ``AMXINT8``) exactly: the levels are
copied into the packed blob, never re-quantized, and the kernels quantize the activations
per token to int8 as the ``A8`` of W8A8 does (dynamic, symmetric; a static ``input_scale`` /
``input_zero_point`` is not read). Read by ``method="AMXINT8"`` (or ``"MOE_INT8"``);
kt-kernel reads none of these checkpoints.

Weight-only int8 (llm-compressor's W8A16) is saved ``pack-quantized`` instead:
``{stem}.weight_packed`` int32 ``[N, K/4]`` (four consecutive levels plus 128 per word, the
first in the low byte), ``{stem}.weight_shape`` ``[N, K]`` and the same ``weight_scale``;
its words are unpacked into the same levels (a layer is 8-bit packed when ``weight_shape``
says so, or, without it, when config.json's groups all say ``num_bits: 8``).

Refused with a ``ValueError`` naming the tensor: group-wise scales (``[N, K/gs]``, the
``group`` strategy), zero points other than 0 (``weight_zero_point``, asymmetric), an
act-order ``weight_g_idx``, a non-finite scale, fused ``gate_up_proj`` int8 tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kt_ops.hf_checkpoint import HfCheckpoint, LayerExperts, read_config_json

INT8_DTYPE = "I8"  # the safetensors dtype of the levels
_FLOATS = ("F32", "BF16", "F16")
_PACKED_ZERO = -0x7F7F7F80  # four zero points of 0 packed as 8-bit words (0x80808080)


@dataclass(frozen=True)
class Int8Experts:
    """One layer's INT8 experts as stored, for ``torch.ops.kt.pack_int8_experts``.

    ``gate``, ``up``: int8 ``[n, I, H]``, ``down`` ``[n, H, I]``; ``scales`` fp32 ``[n, N]``
    per matrix (one per output row): ``w = scale * q``.
    """

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def is_packed_int8(checkpoint: HfCheckpoint, stem: str) -> bool:
    """Whether ``{stem}.weight_packed`` holds 8-bit levels (compressed-tensors W8A16, four per
    int32) rather than INT4's eight: its ``weight_shape`` says K is four times the words, or,
    without one, every config group of config.json's ``quantization_config`` says ``num_bits: 8``."""
    key = f"{stem}.weight_packed"
    if key not in checkpoint.keys():
        return False
    dtype, shape = checkpoint.tensor_info(key)
    if dtype != "I32" or len(shape) != 2:
        return False
    if f"{stem}.weight_shape" in checkpoint.keys():
        declared = checkpoint.read_tensor(f"{stem}.weight_shape").reshape(-1).tolist()
        return len(declared) == 2 and -(-int(declared[1]) // 4) == shape[1] != -(-int(declared[1]) // 8)
    config = read_config_json(checkpoint.path).get("quantization_config") or {}
    groups = config.get("config_groups") if isinstance(config, dict) else None
    bits = [str((group.get("weights") or {}).get("num_bits")) for group in (groups or {}).values()
            if isinstance(group, dict) and isinstance(group.get("weights"), dict)]
    return bool(bits) and all(b == "8" for b in bits)


def is_int8_layer(checkpoint: HfCheckpoint, layer: int) -> bool:
    """Whether a layer's routed experts are stored as int8 levels: an int8 ``weight``, or
    8-bit ``weight_packed`` words (:func:`is_packed_int8`), from the first gate tensor (a
    layer without it is left to the float reader, which names the missing key)."""
    where = checkpoint.layer(layer)
    key = where.key(0)
    if where.suffix == "weight_packed":
        return is_packed_int8(checkpoint, where.stem(0))
    return where.suffix == "weight" and key in checkpoint.keys() and checkpoint.tensor_info(key)[0] == INT8_DTYPE


def read_int8_linear(checkpoint: HfCheckpoint, stem: str, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels int8 ``[N, K]``, scales fp32 ``[N]``) of the int8 linear ``{stem}.weight``
    (or its 8-bit ``{stem}.weight_packed`` words); ``ValueError`` naming the tensor for a wrong
    dtype or shape, a missing scale, group-wise scales, a zero point other than 0, an
    act-order ``g_idx`` or a non-finite scale."""
    keys = checkpoint.keys()
    packed = f"{stem}.weight" not in keys and f"{stem}.weight_packed" in keys
    key, scale_key = f"{stem}.weight_packed" if packed else f"{stem}.weight", f"{stem}.weight_scale"
    dtype, shape = checkpoint.tensor_info(key)
    want = ("I32", (N, -(-K // 4))) if packed else (INT8_DTYPE, (N, K))
    if (dtype, tuple(shape)) != want:
        raise ValueError(f"{checkpoint.path}: tensor {key!r} is {dtype} {list(shape)}; an INT8 layer needs "
                         f"{want[0]} {list(want[1])}")
    if packed and f"{stem}.weight_shape" in keys:
        declared = [int(v) for v in checkpoint.read_tensor(f"{stem}.weight_shape").reshape(-1).tolist()]
        if declared != [N, K]:
            raise ValueError(f"{checkpoint.path}: {stem}.weight_shape is {declared}; the layer needs [{N}, {K}]")
    if scale_key not in keys:
        raise ValueError(f"{checkpoint.path}: tensor {scale_key!r} is missing: int8 weights need their scales")
    scale_dtype, scale_shape = checkpoint.tensor_info(scale_key)
    if scale_dtype not in _FLOATS:
        raise ValueError(f"{checkpoint.path}: tensor {scale_key!r} is {scale_dtype}; scales are F32, BF16 or F16")
    per_tensor = tuple(scale_shape) in ((), (1,), (1, 1))  # the ``tensor`` strategy: that scale on every row
    if not per_tensor and tuple(scale_shape) not in ((N,), (N, 1)):
        grouped = len(scale_shape) == 2 and scale_shape[0] == N and scale_shape[1] > 1
        raise ValueError(f"{checkpoint.path}: tensor {scale_key!r} is {list(scale_shape)}; kt_ops reads per-channel "
                         f"INT8 ([{N}, 1] or [{N}]: one scale per output row; or one per tensor, [1])"
                         + (", not group-wise scales" if grouped else ""))
    zero_key = f"{stem}.weight_zero_point"
    zeros = checkpoint.read_tensor(zero_key) if zero_key in keys else None
    if zeros is not None and bool(zeros.ne(_PACKED_ZERO if packed and zeros.dtype == torch.int32 else 0).any()):
        raise ValueError(f"{checkpoint.path}: tensor {zero_key!r} holds zero points other than 0 (asymmetric INT8); "
                         "kt_ops reads symmetric INT8 only")
    if f"{stem}.weight_g_idx" in keys:
        raise ValueError(f"{checkpoint.path}: tensor '{stem}.weight_g_idx' (act-order) is not read for INT8 layers")
    scale = checkpoint.read_tensor(scale_key).float().reshape(-1).expand(N).contiguous()
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"{checkpoint.path}: tensor {scale_key!r} holds a non-finite scale")
    if packed:  # bytes of the little-endian words in k order, each level + 128
        words = checkpoint.read_tensor(key).contiguous().view(torch.uint8)[:, :K]
        return (words ^ 0x80).view(torch.int8).contiguous(), scale
    return checkpoint.read_tensor(key), scale


def load_int8_experts(checkpoint: HfCheckpoint, layer: int, experts: Sequence[int], hidden_size: int,
                      intermediate_size: int) -> Int8Experts:
    """The listed experts (logical indices, repeats allowed) of an INT8 layer as stored
    (:class:`Int8Experts`): the levels are copied, never widened. Raises ``ValueError``
    naming the tensor (:func:`read_int8_linear`), for expert biases
    (:meth:`HfCheckpoint.check_no_biases`) or fused int8 tensors; ``KeyError`` for a
    missing layer or expert."""
    where: LayerExperts = checkpoint.layer(layer)
    if where.convention == "fused":
        raise ValueError(f"{checkpoint.path}: layer {layer}'s int8 experts are fused ({where.key(0)!r}); kt_ops reads "
                         "INT8 experts stored per expert (gate_proj / up_proj / down_proj or w1 / w3 / w2)")
    checkpoint.check_no_biases(where)
    checkpoint._check_experts(where, experts)  # KeyError naming a missing expert
    H, I, n = hidden_size, intermediate_size, len(experts)
    levels: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    for m, (N, K) in enumerate(((I, H), (I, H), (H, I))):
        q = torch.empty((n, N, K), dtype=torch.int8)
        s = torch.empty((n, N))
        for i, e in enumerate(experts):
            q[i], s[i] = read_int8_linear(checkpoint, where.stem(m, e), N, K)
        levels.append(q)
        scales.append(s)
    return Int8Experts(levels[0], levels[1], levels[2], (scales[0], scales[1], scales[2]))
