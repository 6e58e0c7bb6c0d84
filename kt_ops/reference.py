"""The oracle: every operator in plain torch with fp32 math.

Slow and simple on purpose; tests compare every kernel, format and CPU variant with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_forward(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    quantize_activations: bool | tuple[int | str | None, int | str | None, int | str | None] = False,
    swiglu_limit: float = 0.0,
    swiglu_alpha: float = 0.0,
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Reference MoE forward in fp32.

    Args:
        hidden_states: ``[T, H]`` any float dtype.
        topk_ids: ``[T, K]`` integer, ``-1`` skips the slot.
        topk_weights: ``[T, K]`` any float dtype.
        gate_proj, up_proj: ``[E, I, H]``; down_proj: ``[E, H, I]`` (unpacked weights,
            e.g. dequantized ones for a quantized format).
        quantize_activations: also round each token's input row and each (token, slot)
            intermediate row to int8 as the INT8/INT4 kernels do
            (:func:`fake_quantize_activations`), isolating their arithmetic error. A
            ``(gate, up, down)`` tuple gives the block size of the activations each
            matrix multiplies, as the GGUF kernels use them: ``None`` unquantized, ``0``
            one scale per row, ``32`` / ``256`` one per block, ``"bf16"`` rounded to
            bf16 (the amx variant's GGUF AMX tile path, layers with a float-type matrix).
        swiglu_limit, swiglu_alpha: the activation (:func:`glu`).
        biases: ``(gate_bias [E, I], up_bias [E, I], down_bias [E, H])``, entries may be
            ``None``; gate/up biases are added before the activation, down's before the
            routing weight.

    Returns:
        ``[T, H]`` float32: ``sum_j w[t, j] * down_e(act(gate_e(x_t), up_e(x_t)))``.
    """
    gate_bias, up_bias, down_bias = biases if biases is not None else (None, None, None)
    x = hidden_states.float()
    if isinstance(quantize_activations, tuple):
        blocks = quantize_activations
    else:
        blocks = (0, 0, 0) if quantize_activations else (None, None, None)

    def quantized(v: torch.Tensor, block: int | str | None) -> torch.Tensor:
        if block == "bf16":
            return v.bfloat16().float()
        return v if block is None else fake_quantize_activations(v, block)

    weights = topk_weights.float()
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        tokens, slots = torch.nonzero(topk_ids == expert, as_tuple=True)
        h = x[tokens]
        gate = quantized(h, blocks[0]) @ gate_proj[expert].float().T
        up = quantized(h, blocks[1]) @ up_proj[expert].float().T
        if gate_bias is not None:
            gate = gate + gate_bias[expert].float()
        if up_bias is not None:
            up = up + up_bias[expert].float()
        inter = glu(gate, up, swiglu_limit, swiglu_alpha)
        y = quantized(inter, blocks[2]) @ down_proj[expert].float().T
        if down_bias is not None:
            y = y + down_bias[expert].float()
        out.index_add_(0, tokens, y * weights[tokens, slots, None])
    return out


def glu(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float = 0.0, swiglu_alpha: float = 0.0) -> torch.Tensor:
    """The activation between gate/up and down, in fp32 (:func:`kt_ops.set_activation`).

    ``L = swiglu_limit > 0``: ``gate = min(gate, L)``, ``up = clamp(up, -L, L)``. Then
    ``silu(gate) * up`` (``swiglu_alpha == 0``) or ``gate * sigmoid(alpha * gate) * (up + 1)``.
    NaN stays NaN (``torch.clamp`` propagates it).
    """
    gate, up = gate.float(), up.float()
    if swiglu_limit > 0:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    if swiglu_alpha > 0:
        return gate * torch.sigmoid(swiglu_alpha * gate) * (up + 1)
    return F.silu(gate) * up


def activation_of(packed: torch.Tensor) -> dict:
    """A blob's activation as keyword arguments of :func:`moe_forward`: ``swiglu_limit``,
    ``swiglu_alpha`` and ``biases`` (fp32 ``[E, I]``, ``[E, I]``, ``[E, H]``, or ``None``),
    read from the bias region the header points to (docs/formats.md "Activation")."""
    from kt_ops._native import _C

    info = _C.packed_info(packed)
    packed = _aligned(packed)
    result = {"swiglu_limit": info["swiglu_limit"], "swiglu_alpha": info["swiglu_alpha"], "biases": None}
    if info["biases"]:
        E, H, I = info["num_experts"], info["hidden_size"], info["intermediate_size"]
        I16, H16 = (I + 15) // 16 * 16, (H + 15) // 16 * 16
        at = info["bias_offset"]
        floats = packed[at:at + E * (2 * I16 + H16) * 4].view(torch.float32)
        gate = floats[:E * I16].view(E, I16)[:, :I]
        up = floats[E * I16:2 * E * I16].view(E, I16)[:, :I]
        down = floats[2 * E * I16:].view(E, H16)[:, :H]
        result["biases"] = (gate.clone(), up.clone(), down.clone())
    return result


def _aligned(packed: torch.Tensor) -> torch.Tensor:
    """``packed``, or a copy of it where its storage offset is not a multiple of 8 bytes: the
    decoders view byte ranges as bf16/fp32, which torch refuses at an odd offset, while the
    kernels take a blob at any offset (a slice of a larger buffer)."""
    return packed.clone() if packed.storage_offset() % 8 else packed


def fake_quantize_activations(x: torch.Tensor, block_size: int = 0) -> torch.Tensor:
    """Symmetric int8 of ``x [..., K]`` (fp32) per row (``block_size=0``) or per block
    of ``block_size`` values along K (which it must divide), dequantized: the kernels'
    dynamic activation quantization (``scale = max|x| / 127``, round to nearest even; a
    row whose ``max|x|`` is below ``127 / FLT_MAX`` is quantized ``2^64`` times larger)."""
    if block_size:
        shape = x.shape
        return fake_quantize_activations(x.reshape(*shape[:-1], shape[-1] // block_size, block_size)).reshape(shape)
    amax = x.abs().amax(dim=-1, keepdim=True)
    # 127 / max|x| correctly rounded, as the kernels' fp32 ``127.0f / amax``: torch computes
    # ``127.0 / tensor`` as ``127 * (1 / tensor)``, one ulp off for about a quarter of the
    # values, which flips the level of a value whose x * inv lands next to n + 0.5
    # (fp16/bf16-valued activations hit such ties)
    hundred27 = torch.full_like(amax, 127.0)
    inv = torch.where(amax > 0, hundred27 / amax, torch.zeros_like(amax))
    # max|x| < 127 / FLT_MAX (127 / amax overflows): the kernels take such a row 2^64
    # times (exact) and scale back by 2^-64 (activation_quant.h, tiny_row_levels)
    tiny = torch.isinf(inv)
    up = torch.where(tiny, torch.full_like(amax, 2.0**64), torch.ones_like(amax))
    inv = torch.where(tiny, hundred27 / (amax * up), inv)
    scale = torch.where(tiny, amax * up / 127.0 * 2.0**-64, amax / 127.0)
    return torch.clamp(torch.round(x * up * inv), -127, 127) * scale


def _scaled(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w / scale`` as the packers compute it: ``w * (1 / scale)``, or ``w / scale`` where
    ``1 / scale`` overflows (a subnormal scale of tiny weights); 0 where the scale is 0."""
    inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    return torch.where(inv.isinf(), w / torch.where(inv.isinf(), scale, torch.ones_like(scale)), w * inv)


def fake_quantize(weight: torch.Tensor, format: str, group_size: int = 128) -> torch.Tensor:
    """Round-to-nearest quantization of ``weight`` ``[..., K]`` along its last dimension,
    returned dequantized (fp32, same shape): what ``pack_experts(..., scale_search=False)``
    stores, computed independently in torch.

    ``int8``: symmetric per row (``scale = max|w| / 127``, levels ``[-127, 127]``).
    ``int4``: symmetric per group of ``group_size`` (``scale = extreme / -8`` with the
    signed extreme value, the positive one on ties; levels ``[-8, 7]``). ``int4_asym``: per group
    as GPTQ and AWQ quantize: ``scale = (max(max, 0) - min(min, 0)) / 15`` rounded to 20
    significant bits, an integer zero point ``z = clamp(round(-min(min, 0) / scale), 0, 15)``,
    ``w ~ scale * (q - z)``, levels ``q`` in ``[0, 15]``.
    """
    if format not in ("int8", "int4", "int4_asym"):  # before the grouping reshape, which may not fit
        raise ValueError(f"fake_quantize: unknown format {format!r}")
    w = weight.float()
    if format == "int8":
        scale = w.abs().amax(dim=-1, keepdim=True) / 127.0
        return torch.clamp(torch.round(_scaled(w, scale)), -127, 127) * scale
    shape = w.shape
    g = w.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    if format == "int4":
        hi, lo = g.amax(dim=-1, keepdim=True), g.amin(dim=-1, keepdim=True)
        scale = torch.where(hi >= -lo, hi, lo) / -8.0  # the extreme value -> level -8
        q = torch.clamp(torch.round(_scaled(g, scale)), -8, 7)
        return (q * scale).reshape(shape)
    if format == "int4_asym":
        lo, hi = g.amin(dim=-1, keepdim=True).clamp(max=0), g.amax(dim=-1, keepdim=True).clamp(min=0)
        scale = (hi - lo) / 15.0
        bits = scale.view(torch.int32)  # 20 significant bits: z * scale is exact
        scale = torch.where(scale.isfinite(), ((bits + 8) & ~0xF).view(torch.float32), scale)
        z = torch.clamp(torch.round(_scaled(-lo, scale)), 0, 15)
        q = torch.maximum(torch.minimum(torch.round(_scaled(g, scale)), 15 - z), -z)
        return (q * scale).reshape(shape)
    raise ValueError(f"fake_quantize: unknown format {format!r}")


def _int_block_bytes(format: str, k: int, group: int) -> int:
    """Bytes of one 16-row block of a packed int8/int4/int4_asym/mxfp4 matrix of row length k."""
    nibbles = format.startswith("int4") or format == "mxfp4"
    padded_k = k if nibbles else -(-k // 32) * 32
    lines = padded_k // (8 if nibbles else 4)
    groups = padded_k // group if nibbles else 1
    if format == "mxfp4":  # bf16 scale rows of 32 bytes, padded to whole 64-byte lines
        return 64 * lines + -(-groups * 32 // 64) * 64
    return 64 * (lines + groups * (2 if format == "int4_asym" else 1))


def _int_matrix(blob: torch.Tensor, offset: int, experts: int, blocks: int, k: int, format: str,
                group: int) -> torch.Tensor:
    """One packed int8/int4/mxfp4 matrix -> ``[E, 16 * blocks, padded k]`` fp32 (docs/formats.md)."""
    int4 = format.startswith("int4") or format == "mxfp4"
    padded_k = k if int4 else -(-k // 32) * 32
    lines = padded_k // (8 if int4 else 4)
    groups = padded_k // group if int4 else 1
    block_bytes = _int_block_bytes(format, k, group)
    data = blob[offset : offset + experts * blocks * block_bytes].view(experts, blocks, block_bytes)
    raw = data[..., : lines * 64].reshape(experts, blocks, lines, 16, 4).to(torch.int32)

    def floats(start: int) -> torch.Tensor:  # [E, blocks, groups, 16]
        if format == "mxfp4":  # bf16 half-scales 2^(e - 128), exact as fp32
            chunk = data[..., start : start + groups * 32].contiguous().view(torch.bfloat16).float()
        else:
            chunk = data[..., start : start + groups * 64].contiguous().view(torch.float32)
        return chunk.reshape(experts, blocks, groups, 16)

    scales = floats(lines * 64)
    if not int4:
        q = (raw - 128).permute(0, 1, 3, 2, 4).reshape(experts, blocks, 16, padded_k)
        return (q.float() * scales[:, :, 0, :, None]).reshape(experts, blocks * 16, padded_k)
    # byte 4n + i of line l: low nibble k = 8l + i, high nibble k = 8l + 4 + i
    q = torch.stack((raw & 15, raw >> 4), dim=4)  # [E, blocks, lines, 16, 2, 4]
    q = q.permute(0, 1, 3, 2, 4, 5).reshape(experts, blocks, 16, padded_k).float()
    per_k = scales.permute(0, 1, 3, 2).repeat_interleave(group, dim=-1)  # [E, blocks, 16, K]
    if format == "int4":
        w = (q - 8) * per_k
    elif format == "mxfp4":  # the doubled e2m1 values times the half-scale: w = e2m1 * 2^(e - 127)
        doubled = torch.tensor(MXFP4_VALUES, dtype=torch.float32) * 2
        w = doubled[q.long()] * per_k
    else:
        minimums = floats(lines * 64 + groups * 64).permute(0, 1, 3, 2).repeat_interleave(group, dim=-1)
        w = q * per_k + minimums
    return w.reshape(experts, blocks * 16, padded_k)


FP8_FORMATS = ("fp8", "fp8_perchannel", "mxfp8")


# ---- INT4 checkpoints, as published (docs/formats.md, "INT4 checkpoints") ------------------


def _nibble(words: torch.Tensor, i: int) -> torch.Tensor:
    """Nibble ``i`` (bits 4i..4i+3) of each int32 word, as int64 0..15."""
    return (words.to(torch.int64) >> (4 * i)) & 0xF


def dequantize_rawint4(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors pack-quantized ``weight_packed`` int32 ``[N, K/8]`` (or uint8
    ``[N, K/2]``) and ``weight_scale [N, K/gs]`` -> fp32 ``[N, K]``:
    ``W[n, k] = (nibble k - 8) * scale[n, k // gs]``, nibble k at bits 4 (k % 8) of word k // 8."""
    words = weight_packed.view(torch.uint8).reshape(weight_packed.shape[0], -1).view(torch.int32)
    q = torch.stack([_nibble(words, i) for i in range(8)], dim=-1).reshape(words.shape[0], -1)
    gs = q.shape[1] // weight_scale.shape[1]
    return (q.float() - 8) * weight_scale.float().repeat_interleave(gs, dim=1)


def dequantize_gptq(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None = None,
                    g_idx: torch.Tensor | None = None, zero_offset: int = 1) -> torch.Tensor:
    """GPTQ ``qweight`` int32 ``[K/8, N]``, ``scales [K/gs, N]``, ``qzeros`` int32 ``[K/gs, N/8]``
    -> fp32 ``[N, K]``: ``W[n, k] = (q - (z + zero_offset)) * scale`` with ``q`` nibble k % 8 of
    ``qweight[k // 8, n]``, ``z`` nibble n % 8 of ``qzeros[g, n // 8]``, ``g = g_idx[k]`` (default
    ``k // gs``). ``zero_offset`` 1 is the published (v1) convention, 0 gptq_v2; no ``qzeros``:
    symmetric, zero 8."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    q = torch.stack([_nibble(qweight, i) for i in range(8)], dim=1).reshape(K, N)
    groups = scales.shape[0]
    g = torch.arange(K) // (K // groups) if g_idx is None else g_idx.long()
    if qzeros is None:
        zero = torch.full((groups, N), 8, dtype=torch.int64)
    else:
        zero = torch.stack([_nibble(qzeros, i) for i in range(8)], dim=-1).reshape(groups, N) + zero_offset
    return ((q - zero[g]).float() * scales.float()[g]).t().contiguous()


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM ``qweight`` int32 ``[K, N/8]``, ``qzeros`` int32 ``[K/gs, N/8]``, ``scales
    [K/gs, N]`` -> fp32 ``[N, K]``: ``W[n, k] = (q - z) * scale``, where nibble i of a word holds
    column ``8c + AWQ_ORDER[i]`` of its group of 8 columns (qweight and qzeros alike)."""

    def unpack(words: torch.Tensor) -> torch.Tensor:
        out = torch.empty(words.shape[0], words.shape[1], 8, dtype=torch.int64)
        for i, column in enumerate(AWQ_ORDER):
            out[:, :, column] = _nibble(words, i)
        return out.reshape(words.shape[0], -1)

    q, zero = unpack(qweight), unpack(qzeros)
    gs = q.shape[0] // zero.shape[0]
    return ((q - zero.repeat_interleave(gs, dim=0)).float() * scales.float().repeat_interleave(gs, dim=0)).t().contiguous()


def decode_ue8m0(codes: torch.Tensor) -> torch.Tensor:
    """OCP MX scale exponents (uint8 or float8_e8m0fnu) -> fp32 ``2^(e - 127)``; 255 is NaN."""
    e = codes.view(torch.uint8).to(torch.int32)
    value = torch.ldexp(torch.ones(e.shape, dtype=torch.float32), (e - 127).float())
    return torch.where(e == 255, torch.full_like(value, float("nan")), value)


MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The OCP e2m1 value of each 4-bit code (ggml stores them doubled, with a halved scale);
code 8, e2m1's -0, reads as +0 as in ggml and gguf.quants (the kernels' integer 0)."""


def dequantize_mxfp4(blocks: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """MXFP4 blocks as GGUF stores them (ggml type 39) -> fp32 weights, in plain torch.

    Args:
        blocks: uint8 ``[..., n * 17]``: per block of 32 weights one E8M0 exponent byte
            ``e``, then 16 bytes whose byte ``j`` holds weight ``j`` in its low nibble and
            weight ``j + 16`` in its high nibble (e2m1 codes, :data:`MXFP4_VALUES`).
        k: the row length (``n * 32``); checked when given.

    Returns:
        fp32 ``[..., n * 32]``: ``e2m1(code) * 2^(e - 127)``; a block with ``e == 255`` is
        NaN (OCP MX; ggml and ``gguf.quants`` read 255 as ``2^127``, see docs/formats.md).
    """
    if blocks.dtype != torch.uint8 or blocks.shape[-1] % 17:
        raise ValueError(f"MXFP4 blocks must be uint8 [..., n * 17], got {blocks.dtype} {tuple(blocks.shape)}")
    n = blocks.shape[-1] // 17
    if k is not None and k != 32 * n:
        raise ValueError(f"MXFP4 row of {blocks.shape[-1]} bytes holds {32 * n} weights, not k = {k}")
    b = blocks.reshape(*blocks.shape[:-1], n, 17)
    scale = decode_ue8m0(b[..., 0:1])  # [..., n, 1]
    qs = b[..., 1:].to(torch.int64)
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # [..., n, 32]: weights 0-15, then 16-31
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32)[codes]
    return (values * scale).reshape(*blocks.shape[:-1], 32 * n)


def _fp8_matrix(blob: torch.Tensor, offset: int, experts: int, blocks: int, k: int, format: str) -> torch.Tensor:
    """One packed fp8 / fp8_perchannel / mxfp8 matrix -> ``[E, 16 * blocks, padded k]`` fp32
    (docs/formats.md): e4m3 codes decoded by torch's ``float8_e4m3fn``, times their scales
    (mxfp8: a row whose NaN addend is set is NaN)."""
    padded_k = -(-k // 32) * 32
    group = {"fp8": 128, "mxfp8": 32}.get(format, padded_k)
    groups = -(-k // group)
    block_bytes = padded_k * 16 + _fp8_scale_bytes(k, format)
    data = blob[offset : offset + experts * blocks * block_bytes].view(experts, blocks, block_bytes)
    codes = data[..., : padded_k * 16].contiguous().view(torch.float8_e4m3fn).float()
    # byte 32 p + 2 n + i: row n, k = 2 p + i
    w = codes.reshape(experts, blocks, padded_k // 2, 16, 2).permute(0, 1, 3, 2, 4).reshape(experts, blocks, 16, padded_k)
    raw = data[..., padded_k * 16 :].contiguous()
    if format == "mxfp8":
        scales = decode_ue8m0(raw[..., : groups * 16].reshape(experts, blocks, groups, 16))
        addend_at = -(-groups * 16 // 64) * 64
        addend = raw[..., addend_at : addend_at + 64].view(torch.float32).reshape(experts, blocks, 16, 1)
    else:
        scales = raw[..., : groups * 64].view(torch.float32).reshape(experts, blocks, groups, 16)
        addend = torch.zeros(())
    per_k = scales.permute(0, 1, 3, 2).repeat_interleave(group, dim=-1)[..., :padded_k]
    return (w * per_k + addend).reshape(experts, blocks * 16, padded_k)


def _fp8_scale_bytes(k: int, format: str) -> int:
    """Bytes of scales per 16-row block of an fp8-format matrix with row length ``k``."""
    group = {"fp8": 128, "mxfp8": 32}.get(format, -(-k // 32) * 32)
    groups = -(-k // group)
    return -(-groups * 16 // 64) * 64 + 64 if format == "mxfp8" else groups * 64


def dequantize(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weights a packed blob (``PackedExperts.data``) holds, as fp32 Hugging Face
    tensors ``gate [E, I, H]``, ``up [E, I, H]``, ``down [E, H, I]``.

    Decodes the byte layout of docs/formats.md in torch, independently of the C++
    kernels, so tests can compare a kernel with :func:`moe_forward` on exactly the
    weights it multiplies. bf16 blobs are supported too; gguf blobs are decoded by the
    ``gguf`` package's own ``gguf.quants.dequantize`` (MXFP4 matrices by
    :func:`dequantize_mxfp4`, which agrees with it except that exponent 255 is NaN).
    """
    from kt_ops._native import _C

    info = _C.packed_info(packed)
    packed = _aligned(packed)
    if info["format"] == "gguf":
        return _gguf_dequantize(packed, info)
    fmt, E, H, I, G = (info[key] for key in ("format", "num_experts", "hidden_size", "intermediate_size", "group_size"))
    i16, h16 = -(-I // 16) * 16, -(-H // 16) * 16
    gate_up_offset = 256
    if fmt == "bf16":
        hp, ip = -(-H // 2), i16 // 2
        gu = packed[gate_up_offset : gate_up_offset + E * (2 * i16 // 16) * hp * 64]
        gu = gu.view(torch.bfloat16).reshape(E, 2 * i16 // 16, hp, 16, 2).permute(0, 1, 3, 2, 4)
        gu = gu.reshape(E, i16 // 16, 2, 16, 2 * hp)
        down_offset = gate_up_offset + gu.numel() * 2
        d = packed[down_offset : down_offset + E * (h16 // 16) * ip * 64].view(torch.bfloat16)
        d = d.reshape(E, h16 // 16, ip, 16, 2).permute(0, 1, 3, 2, 4).reshape(E, h16, 2 * ip)
        gate = gu[:, :, 0].reshape(E, i16, 2 * hp)[:, :I, :H].float()
        up = gu[:, :, 1].reshape(E, i16, 2 * hp)[:, :I, :H].float()
        return gate, up, d[:, :H, :I].float()
    gate_up_blocks, down_blocks = 2 * i16 // 16, h16 // 16
    if fmt in FP8_FORMATS:
        gu = _fp8_matrix(packed, gate_up_offset, E, gate_up_blocks, H, fmt)
        hk = gu.shape[-1]
        down_offset = gate_up_offset + E * gate_up_blocks * (hk * 16 + _fp8_scale_bytes(H, fmt))
        d = _fp8_matrix(packed, down_offset, E, down_blocks, I, fmt)
        gu = gu.reshape(E, i16 // 16, 2, 16, hk)
        gate = gu[:, :, 0].reshape(E, i16, hk)[:, :I, :H]
        up = gu[:, :, 1].reshape(E, i16, hk)[:, :I, :H]
        return gate.contiguous(), up.contiguous(), d[:, :H, :I].contiguous()
    gu = _int_matrix(packed, gate_up_offset, E, gate_up_blocks, H, fmt, G)
    hk = gu.shape[-1]
    down_offset = gate_up_offset + E * gate_up_blocks * _int_block_bytes(fmt, H, G)
    d = _int_matrix(packed, down_offset, E, down_blocks, I, fmt, G)
    gu = gu.reshape(E, i16 // 16, 2, 16, hk)
    gate = gu[:, :, 0].reshape(E, i16, hk)[:, :I, :H]
    up = gu[:, :, 1].reshape(E, i16, hk)[:, :I, :H]
    return gate.contiguous(), up.contiguous(), d[:, :H, :I].contiguous()


def gguf_activation_blocks(packed: torch.Tensor) -> tuple[int | None, int | None, int | None]:
    """The activation block sizes the GGUF kernel uses for a gguf blob's gate, up and down
    (``quantize_activations`` of :func:`moe_forward`): the weight type's block, ``None``
    for float types."""
    from kt_ops._native import _C

    import gguf

    types = _C.packed_info(packed)["gguf_types"]
    blocks = tuple(None if t in ("F32", "F16", "BF16") else gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0]
                   for t in types)
    return blocks[0], blocks[1], blocks[2]


def _gguf_dequantize(packed: torch.Tensor, info: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import gguf
    import numpy as np

    E, H, I = info["num_experts"], info["hidden_size"], info["intermediate_size"]
    out = []
    for name, offset, rows, k in zip(info["gguf_types"], info["matrix_offsets"], (I, I, H), (H, H, I)):
        qtype = gguf.GGMLQuantizationType[name]
        block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = E * rows * k // block * type_bytes
        raw = packed[offset : offset + nbytes].numpy()
        if qtype == gguf.GGMLQuantizationType.F32:
            data = raw.view(np.float32)
        elif qtype == gguf.GGMLQuantizationType.F16:
            data = raw.view(np.float16)
        else:
            data = raw
        if qtype == gguf.GGMLQuantizationType.MXFP4:  # e = 255 is NaN here, 2^127 in gguf.quants
            out.append(dequantize_mxfp4(packed[offset : offset + nbytes].reshape(E, rows, -1), k))
            continue
        values = gguf.quants.dequantize(data.reshape(E * rows, -1), qtype)
        out.append(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(E, rows, k))
    return out[0], out[1], out[2]
