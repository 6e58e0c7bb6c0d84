"""GGUF blocks decoded by torch ops on any device (the GPU side of GPU-assisted prefill).

:func:`dequantize_rows` turns rows of ggml blocks, as a GGUF file and kt_ops' ``gguf``
format store them, into fp32 weights with the arithmetic of ``gguf.quants`` (the values
``kt_ops.dequantize_experts`` and the CPU kernels use, bit for bit: each type's scale
products are formed in fp32 in the same order; as there, MXFP4's scale exponent 255 is NaN
where ``gguf.quants`` reads ``2^127``). Covered: the float types, Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and MXFP4 (:data:`DEVICE_TYPES`); Q2_K and Q3_K are
left to the CPU's dequantizer. Formats: docs/formats.md, "GGUF".
"""

from __future__ import annotations

import torch

from kt_ops import reference
from kt_ops._validate import is_integral
from kt_ops.gguf_types import ggml_type_info

QK_K = 256
DEVICE_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
                          "MXFP4"})
E2M1 = torch.tensor(reference.MXFP4_VALUES, dtype=torch.float32)  # e2m1 code -> value


def ue8m0(codes: torch.Tensor) -> torch.Tensor:
    """uint8 OCP MX exponents -> fp32 ``2^(e - 127)`` built from bits (exact on any device;
    0 is the subnormal 2^-127, 255 NaN)."""
    e = codes.to(torch.int32)
    return torch.where(e == 0, 0x00400000, torch.where(e == 255, 0x7FC00000, e << 23)).view(torch.float32)


def _field(blocks: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``[start, stop)`` of every block as ``dtype`` ``[..., (stop - start) / size]``."""
    return blocks[..., start:stop].contiguous().view(dtype)


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return _field(blocks, at, at + 2, torch.float16).float()  # [..., 1]


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 2 n]``: every byte's low nibbles, then its high nibbles."""
    return torch.cat((qs & 15, qs >> 4), dim=-1)


def _bits32(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian uint32 at ``at`` of every block, bit ``j`` at ``[..., j]`` (uint8 0/1)."""
    b = blocks[..., at:at + 4].to(torch.int64)
    word = b[..., 0:1] | (b[..., 1:2] << 8) | (b[..., 2:3] << 16) | (b[..., 3:4] << 24)
    return ((word >> torch.arange(32, device=blocks.device)) & 1).to(torch.uint8)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> the eight 6-bit sub-block scales and minimums ``[..., 8]``."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _blocks(kind: str, b: torch.Tensor) -> torch.Tensor:
    """``b`` uint8 ``[..., block_bytes]`` -> fp32 ``[..., block_elems]``."""
    if kind == "Q8_0":
        return _field(b, 2, 34, torch.int8).float() * _half(b, 0)
    if kind == "Q4_0":
        return (_low_high(b[..., 2:18]).to(torch.int8) - 8).float() * _half(b, 0)
    if kind == "Q4_1":
        return _half(b, 0) * _low_high(b[..., 4:20]).float() + _half(b, 2)
    if kind in ("Q5_0", "Q5_1"):
        at = 2 if kind == "Q5_0" else 4
        q = _low_high(b[..., at + 4:at + 20]) | (_bits32(b, at) << 4)
        if kind == "Q5_0":
            return _half(b, 0) * (q.to(torch.int8) - 16).float()
        return _half(b, 0) * q.float() + _half(b, 2)
    if kind in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(b[..., 4:16])
        d = (_half(b, 0) * sc.float()).unsqueeze(-1)  # [..., 8, 1]
        dm = (_half(b, 2) * mn.float()).unsqueeze(-1)
        if kind == "Q4_K":  # 4 groups of 32 bytes: low nibbles are sub-block 2 j, high 2 j + 1
            qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 1, 32)
            q = torch.cat((qs & 15, qs >> 4), dim=-2).reshape(*b.shape[:-1], 8, 32)
        else:
            qh = b[..., 16:48].reshape(*b.shape[:-1], 1, 32)
            qs = b[..., 48:176].reshape(*b.shape[:-1], 4, 1, 32)
            low = torch.cat((qs & 15, qs >> 4), dim=-2).reshape(*b.shape[:-1], 8, 32)
            high = (qh >> torch.arange(8, device=b.device, dtype=torch.uint8).reshape(8, 1)) & 1
            q = low | (high << 4)
        return (d * q.float() - dm).reshape(*b.shape[:-1], QK_K)
    if kind == "Q6_K":
        lead = b.shape[:-1]
        ql = b[..., 0:128].reshape(*lead, 2, 1, 64)
        ql = torch.cat((ql & 15, ql >> 4), dim=-2).reshape(*lead, 8, 32)
        qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
        qh = (qh >> torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).reshape(4, 1)) & 3
        q = (ql | (qh.reshape(*lead, 8, 32) << 4)).to(torch.int8) - 32
        d = (_half(b, 208) * _field(b, 192, 208, torch.int8).float()).unsqueeze(-1)  # [..., 16, 1]
        return (d * q.reshape(*lead, 16, 16).float()).reshape(*lead, QK_K)
    if kind == "MXFP4":
        codes = _low_high(b[..., 1:17]).int()
        return E2M1.to(b.device)[codes] * ue8m0(b[..., 0:1])
    raise ValueError(f"GGUF type {kind} is not decoded on the device")


def dequantize_rows(raw: torch.Tensor, type_id: int, k: int) -> torch.Tensor:
    """Rows of ggml blocks ``raw`` uint8 ``[..., row_bytes]`` of type ``type_id`` (row
    length ``k``, a multiple of the type's block; ``row_bytes`` its blocks' bytes) -> fp32
    ``[..., k]`` on ``raw``'s device (any strides and storage offset); ``TypeError`` for
    ``raw`` of another dtype, ``ValueError`` for a type outside :data:`DEVICE_TYPES`, such a
    ``k`` or rows of another byte count."""
    info = ggml_type_info(type_id)
    if info.name not in DEVICE_TYPES:
        raise ValueError(f"GGUF type {info.name} is not decoded on the device ({', '.join(sorted(DEVICE_TYPES))} are)")
    if raw.dtype != torch.uint8:
        raise TypeError(f"GGUF rows must be uint8 bytes, got {raw.dtype}")
    if not is_integral(k) or k < 0 or k % info.block_elems:
        raise ValueError(f"GGUF type {info.name} needs a row length that is a multiple of {info.block_elems}, "
                         f"got {k!r}")
    k = int(k)
    row_bytes = k // info.block_elems * info.block_bytes
    if raw.dim() == 0 or raw.shape[-1] != row_bytes:
        got = "a 0-d tensor" if raw.dim() == 0 else f"rows of {raw.shape[-1]} bytes"
        raise ValueError(f"a {info.name} row of {k} weights takes {row_bytes} bytes, got {got}")
    if not raw.is_contiguous() or raw.storage_offset() % 4:  # the fp16 / fp32 fields are viewed in place
        raw = raw.clone(memory_format=torch.contiguous_format)
    lead = raw.shape[:-1]
    if info.name == "F32":
        return raw.view(torch.float32).clone()
    if info.name in ("F16", "BF16"):
        return raw.view(torch.float16 if info.name == "F16" else torch.bfloat16).float()
    blocks = raw.reshape(*lead, k // info.block_elems, info.block_bytes)
    return _blocks(info.name, blocks).reshape(*lead, k)
