"""INT8 checkpoints as published, read in place: W8A8 / W8A16 per-channel int8 experts.

compressed-tensors' ``int-quantized`` format (llm-compressor's W8A8 and W8A16 schemes, e.g.
the ``*-quantized.w8a8`` Qwen3-MoE checkpoints) stores each expert linear as
``{stem}.weight`` int8 ``[N, K]`` and ``{stem}.weight_scale`` (fp32/bf16/fp16) ``[N, 1]`` or
``[N]``: ``W = q * scale``, one scale per output row, symmetric, levels -128 ... 127
(llm-compressor rounds ``w / (max|w| / 127.5)``, so -128 occurs). That is format ``int8``
(kt-kernel's ``AMXINT8``) exactly: the levels are copied into the packed blob, never
re-quantized, and the kernels quantize the activations per token to int8 as the ``A8`` of
W8A8 does (dynamic, symmetric). Read by ``method="AMXINT8"`` (or ``"MOE_INT8"``); kt-kernel
reads none of these checkpoints.

Refused with a ``ValueError`` naming the tensor: group-wise scales (``[N, K/gs]``, the
``group`` strategy), zero points other than 0 (``weight_zero_point``, asymmetric), an
act-order ``weight_g_idx``, a non-finite scale, fused ``gate_up_proj`` int8 tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kt_ops.hf_checkpoint import HfCheckpoint, LayerExperts

INT8_DTYPE = "I8"  # the safetensors dtype of the levels
_FLOATS = ("F32", "BF16", "F16")


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


def is_int8_layer(checkpoint: HfCheckpoint, layer: int) -> bool:
    """Whether a layer's routed experts are stored as int8 levels (the first gate tensor's
    header; a layer without it is left to the float reader, which names the missing key)."""
    where = checkpoint.layer(layer)
    key = where.key(0)
    return where.suffix == "weight" and key in checkpoint.keys() and checkpoint.tensor_info(key)[0] == INT8_DTYPE


def read_int8_linear(checkpoint: HfCheckpoint, stem: str, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels int8 ``[N, K]``, scales fp32 ``[N]``) of the int8 linear ``{stem}.weight``;
    ``ValueError`` naming the tensor for a wrong dtype or shape, a missing scale, group-wise
    scales, a zero point other than 0, an act-order ``g_idx`` or a non-finite scale."""
    keys = checkpoint.keys()
    key, scale_key = f"{stem}.weight", f"{stem}.weight_scale"
    dtype, shape = checkpoint.tensor_info(key)
    if dtype != INT8_DTYPE or tuple(shape) != (N, K):
        raise ValueError(f"{checkpoint.path}: tensor {key!r} is {dtype} {list(shape)}; an INT8 layer needs I8 "
                         f"[{N}, {K}]")
    if scale_key not in keys:
        raise ValueError(f"{checkpoint.path}: tensor {scale_key!r} is missing: int8 weights need their scales")
    scale_dtype, scale_shape = checkpoint.tensor_info(scale_key)
    if scale_dtype not in _FLOATS:
        raise ValueError(f"{checkpoint.path}: tensor {scale_key!r} is {scale_dtype}; scales are F32, BF16 or F16")
    if tuple(scale_shape) not in ((N,), (N, 1)):
        grouped = len(scale_shape) == 2 and scale_shape[0] == N and scale_shape[1] > 1
        raise ValueError(f"{checkpoint.path}: tensor {scale_key!r} is {list(scale_shape)}; kt_ops reads per-channel "
                         f"INT8 ([{N}, 1] or [{N}]: one scale per output row)"
                         + (", not group-wise scales" if grouped else ""))
    zero_key = f"{stem}.weight_zero_point"
    if zero_key in keys and bool(checkpoint.read_tensor(zero_key).ne(0).any()):
        raise ValueError(f"{checkpoint.path}: tensor {zero_key!r} holds zero points other than 0 (asymmetric INT8); "
                         "kt_ops reads symmetric INT8 only")
    if f"{stem}.weight_g_idx" in keys:
        raise ValueError(f"{checkpoint.path}: tensor '{stem}.weight_g_idx' (act-order) is not read for INT8 layers")
    scale = checkpoint.read_tensor(scale_key).float().reshape(N)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"{checkpoint.path}: tensor {scale_key!r} holds a non-finite scale")
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
    for e in experts:
        if not 0 <= e < where.num_experts:
            raise KeyError(f"{checkpoint.path}: layer {layer} has {where.num_experts} experts; expert {e} is missing "
                           f"(e.g. {where.key(0, e)!r})")
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
