"""Typed Python entry points to the ``torch.ops.kt`` operators."""

from __future__ import annotations

import math
import operator
from typing import Sequence

import torch

from kt_ops import autograd, fakes  # noqa: F401  (fakes: registers the fake implementations)
from kt_ops._native import _C
from kt_ops._validate import is_integral, is_real, require_bools
from kt_ops.formats import (CHECKPOINT_METHODS, DEFAULT_GROUP_SIZE, GROUPED_FORMATS, default_group_size,
                            format_for_method, format_info)
from kt_ops.gguf_types import GgufTypeLike, check_row_lengths, gguf_type_ids
from kt_ops.packed import PackedExperts

MXFP4_TYPE = 39  # GGML_TYPE_MXFP4, the ggml type method "MXFP4" packs


def pack_experts(
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    method: str = "BF16",
    group_size: int | None = None,
    zero_point: bool = False,
    scale_search: bool = False,
    gguf_type: GgufTypeLike | tuple[GgufTypeLike, GgufTypeLike, GgufTypeLike] | None = None,
    swiglu_limit: float = 0.0,
    swiglu_alpha: float = 0.0,
    biases: Biases | None = None,
) -> PackedExperts:
    """Packs (and, for INT8/INT4, quantizes) one layer's routed experts for :func:`moe_forward`.

    Formats are described in docs/formats.md; each runs on every CPU variant.

    Args:
        gate_proj: ``[E, I, H]`` (Hugging Face ``nn.Linear`` layout), bf16/fp16/fp32, CPU.
        up_proj: ``[E, I, H]``, same dtype rules.
        down_proj: ``[E, H, I]``.
        method: kt-kernel method name. ``"BF16"`` stores bf16 (fp16/fp32 inputs rounded);
            ``"AMXINT8"``/``"MOE_INT8"`` int8 symmetric per output channel;
            ``"AMXINT4"``/``"MOE_INT4"`` int4 in k-groups of ``group_size``;
            ``"LLAMAFILE"`` GGUF blocks of ``gguf_type`` (round-to-nearest);
            ``"MXFP4"`` format ``mxfp4``: e2m1 codes with one power-of-two scale per 32
            weights along k (OCP MXFP4), quantized as ggml quantizes MXFP4 (its codes and
            exponents byte for byte as ``gguf.quants.quantize``), laid out in INT4-style
            lines with bf16 scales (0.5625 bytes per weight): H and I must be multiples
            of 32 (``gguf_type="MXFP4"`` under ``"LLAMAFILE"`` keeps GGUF's blocks);
            the INT4 checkpoint methods quantize as their checkpoints are written
            (round-to-nearest): ``"RAWINT4"`` symmetric int4 in groups of 32,
            ``"GPTQ_INT4"`` symmetric in groups of 128, ``"AWQ_INT4"`` with zero points
            (int4_asym) in groups of 128. To keep a checkpoint's own nibbles, load it
            (:mod:`kt_ops.hf_int4`, ``KTMoEWrapper(weight_path=...)``).
        group_size: INT4 k-group, 32, 64 or 128; None: the method's default (128;
            RAWINT4 32). It must divide H and I (``ValueError`` otherwise). MXFP4 takes
            32 or none (its groups are fixed at 32). Other methods take none; 128, the
            default that ``HybridMoE`` and ``patch_model`` pass along, is ignored there
            (and by MXFP4).
        zero_point: INT4 only: asymmetric groups (``w = scale * q + minimum``).
        scale_search: INT8/INT4 methods only (``ValueError`` for BF16, LLAMAFILE, the FP8
            methods and MXFP4): per row/group, try candidate scales (with a
            least-squares refit) and keep the one with the smallest squared error,
            instead of round-to-nearest from the extreme value. Slower to pack.
        gguf_type: ``LLAMAFILE`` only (and required there): a ``gguf.GGMLQuantizationType``,
            its name (``"Q4_K"``) or integer value, or a ``(gate, up, down)`` tuple of
            those (as Q4_K_M files mix Q4_K and Q6_K). A row length (H for gate/up, I for
            down) must be a multiple of the type's block (32, or 256 for K-quants);
            otherwise ``ValueError`` names llama.cpp's fallback type.
        swiglu_limit, swiglu_alpha, biases: the layer's activation and expert biases, for
            every method; see :func:`set_activation`.

    ``"FP8"``, ``"FP8_PERCHANNEL"`` and ``"MXFP8"`` quantize to e4m3 (round to nearest
    even): FP8 with one fp32 scale per 128 x 128 block, FP8_PERCHANNEL per output row
    (scale = max|w| / 448), MXFP8 with a power-of-two scale per 32 weights along k, the
    smallest that maps the group's max|w| to at most 448 (nothing saturates). To keep an
    FP8 checkpoint's own bytes use :func:`pack_fp8_experts`.

    Returns:
        A :class:`PackedExperts` whose ``data`` is a new uint8 CPU tensor.

    Raises:
        ValueError: a bad argument, a weight on the meta device, a NaN or infinite
            weight (naming the matrix, expert and row), and a finite weight the format
            would store as infinity or NaN (naming the matrix and expert: e.g. above
            65504 in GGUF F16, or a GGUF block whose fp16 scale overflows). The operators themselves
            (``torch.ops.kt.pack_experts`` and the others) pack non-finite weights as
            given (NaN where the format holds one).
    """
    largest: dict[str, list[float]] = {}
    for name, weight in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
        if isinstance(weight, torch.Tensor) and weight.is_meta:
            raise ValueError(f"{name} is on the meta device (a shape without values): pack_experts quantizes the "
                             "weights' values; load them first (from_pretrained, or to_empty() + load_state_dict)")
        largest[name] = check_finite(name, weight)
    packed = _pack(gate_proj, up_proj, down_proj, method, group_size, zero_point, scale_search, gguf_type)
    check_stored_finite(packed, largest, method)
    return set_activation(packed, swiglu_limit, swiglu_alpha, biases)


# Every format stores weights with |w| <= 65504 as finite values (the GGUF types' fp16 block
# scales and minimums, and F16, are the narrowest); only experts beyond it are checked.
_ALWAYS_HELD = 65504.0


def check_stored_finite(packed: PackedExperts, largest: dict[str, list[float]], method: str) -> None:
    """``ValueError`` naming the matrix and expert whose finite weights ``packed`` holds as
    infinity or NaN (a weight beyond the format's range: bf16 or F16 overflow, a GGUF block
    scale or minimum beyond fp16, an int4 range ``max - min`` beyond fp32). ``largest``:
    each matrix's largest ``|w|`` per expert (:func:`check_finite`); the experts above
    65504 are dequantized one at a time and checked."""
    experts = sorted({e for values in largest.values() for e, value in enumerate(values) if value > _ALWAYS_HELD})
    for expert in experts:
        stored = torch.ops.kt.dequantize_experts(packed.data, torch.tensor([expert], dtype=torch.int64),
                                                 torch.float32)
        for name, matrix in zip(("gate_proj", "up_proj", "down_proj"), stored):
            if not bool(torch.isfinite(matrix).all()):
                value = largest[name][expert] if expert < len(largest.get(name, [])) else float("nan")
                raise ValueError(f"{name}: expert {expert} holds weights up to {value:g} in magnitude, beyond what "
                                 f"method {method!r} (format {packed.format}) can store: they would be packed as "
                                 "infinity or NaN (scale the weights down, or pick a format of wider range)")


_MINMAX_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_finite(name: str, weight: torch.Tensor) -> list[float]:
    """``ValueError`` naming the matrix, expert and row of the first NaN or infinity in
    ``weight [E, N, K]`` (a float tensor; other tensors are left to the operator's checks).
    One expert at a time, so the check needs no copy of the layer: a NaN-propagating
    ``aminmax`` (one pass, no mask; 15x faster than ``isfinite`` on bf16 here), and the
    element mask only for an expert that fails it. Returns each expert's largest ``|w|``
    (infinity where it was not measured; empty for a tensor left to the operator)."""
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 3:
        return []
    largest: list[float] = []
    for expert in range(weight.shape[0]):
        if weight.dtype in _MINMAX_DTYPES and weight[expert].numel() > 0:
            low, high = torch.aminmax(weight[expert])
            if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
                largest.append(max(-float(low), float(high)))
                continue
        finite = torch.isfinite(weight[expert])
        if not bool(finite.all()):
            row = int((~finite.all(dim=1)).nonzero()[0, 0])
            bad = weight[expert, row][~finite[row]][0].item()
            raise ValueError(f"{name}: expert {expert}, row {row} holds {bad} (non-finite weights are refused; "
                             "a NaN or infinite weight is a corrupted checkpoint)")
        largest.append(0.0 if weight[expert].numel() == 0 else float("inf"))
    return largest


def check_pack_arguments(
    method: str,
    group_size: int | None = None,
    zero_point: bool = False,
    scale_search: bool = False,
    gguf_type: GgufTypeLike | tuple[GgufTypeLike, GgufTypeLike, GgufTypeLike] | None = None,
) -> str:
    """The packed format of ``method`` (:func:`kt_ops.formats.format_for_method`);
    ``ValueError`` where the other :func:`pack_experts` arguments do not apply to it (a
    ``gguf_type`` outside LLAMAFILE, a ``group_size`` for a method without k-groups, a
    ``zero_point`` or ``scale_search`` that is not a bool, ...).
    Needs no tensor: ``KtOpsConfig`` checks its arguments with it before a model loads."""
    if group_size is not None and not is_integral(group_size):  # 64.0 or True reached the operator's schema check
        raise ValueError(f"group_size must be an int (32, 64 or 128) or None, got {group_size!r}")
    require_bools(zero_point=zero_point, scale_search=scale_search)  # zero_point="no" selected int4_asym silently
    fmt = format_for_method(method, zero_point)
    if fmt == "mxfp4":
        # e2m1 codes + power-of-two scales per 32 k in the INT4 lines (docs/formats.md); the
        # same codes and exponents as GGUF's MXFP4 blocks (gguf_type="MXFP4" keeps those).
        if gguf_type is not None and gguf_type_ids(gguf_type) != (MXFP4_TYPE,) * 3:
            raise ValueError(f"method 'MXFP4' has e2m1 codes with an exponent per 32 weights; got gguf_type="
                             f"{gguf_type!r} (method 'LLAMAFILE' with gguf_type='MXFP4' keeps GGUF's 17-byte blocks)")
        if group_size not in (None, DEFAULT_GROUP_SIZE, 32) or scale_search:
            raise ValueError(f"method 'MXFP4' has fixed groups of 32 and no scale_search; got group_size="
                             f"{group_size}, scale_search={scale_search}")
    elif fmt == "gguf":
        if gguf_type is None:
            raise ValueError("method 'LLAMAFILE' needs gguf_type, e.g. 'Q4_K' or ('Q4_K', 'Q4_K', 'Q6_K')")
        if group_size not in (None, DEFAULT_GROUP_SIZE) or scale_search:
            raise ValueError("method 'LLAMAFILE' takes neither group_size nor scale_search")
        gguf_type_ids(gguf_type)  # ValueError naming an unknown type or a tuple of another length
    else:
        if gguf_type is not None:
            raise ValueError(f"gguf_type applies to method 'LLAMAFILE', not {method!r}")
        if fmt not in GROUPED_FORMATS and group_size not in (None, DEFAULT_GROUP_SIZE):
            raise ValueError(f"method {method!r} has no k-groups; group_size applies to the INT4 methods")
        sizes = format_info(fmt).group_sizes
        if fmt in GROUPED_FORMATS and group_size is not None and group_size not in sizes:
            # (KtOpsConfig read 0 as the default 128 and passed -32 on as 4294967264)
            choices = " or ".join(filter(None, (", ".join(map(str, sizes[:-1])), str(sizes[-1]))))
            raise ValueError(f"method {method!r} needs group_size {choices} (or None), got {group_size}")
        if scale_search and not format_info(fmt).scale_search:  # else KtOpsConfig let it through to the first tensor
            raise ValueError(f"scale_search applies to quantized formats with a scale search (INT8, INT4), not {fmt} "
                             f"(method {method!r})")
    return fmt


def _pack(
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    method: str,
    group_size: int | None,
    zero_point: bool,
    scale_search: bool,
    gguf_type: GgufTypeLike | tuple[GgufTypeLike, GgufTypeLike, GgufTypeLike] | None,
) -> PackedExperts:
    fmt = check_pack_arguments(method, group_size, zero_point, scale_search, gguf_type)
    group_size = None if group_size is None else int(group_size)  # numpy's integers too, as KTMoEWrapper's
    if fmt == "mxfp4":
        for name, size in (("hidden_size", int(gate_proj.shape[-1])), ("intermediate_size", int(down_proj.shape[-1]))):
            if gate_proj.dim() == 3 and down_proj.dim() == 3 and size % 32:
                raise ValueError(f"method 'MXFP4' needs {name} to be a multiple of 32, got {size}")
        return PackedExperts(torch.ops.kt.pack_experts(gate_proj, up_proj, down_proj, fmt, 32, False))
    if fmt == "gguf":
        types = gguf_type_ids(gguf_type)
        if gate_proj.dim() == 3 and down_proj.dim() == 3:
            check_row_lengths(types, int(gate_proj.shape[2]), int(down_proj.shape[2]))
        return PackedExperts(torch.ops.kt.pack_gguf_experts(gate_proj, up_proj, down_proj, list(types)))
    group = (default_group_size(method) if group_size is None else group_size) if fmt in GROUPED_FORMATS else 0
    return PackedExperts(
        torch.ops.kt.pack_experts(gate_proj, up_proj, down_proj, fmt, group, scale_search)
    )


Biases = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def set_activation(
    packed: PackedExperts | torch.Tensor,
    swiglu_limit: float = 0.0,
    swiglu_alpha: float = 0.0,
    biases: Biases | None = None,
) -> PackedExperts:
    """The layer's activation between gate/up and down, and its expert biases, for any format.

    Chosen as kt-kernel chooses it, by two numbers (``g``, ``u``: gate and up outputs,
    biases included):

    - ``swiglu_alpha == 0, swiglu_limit == 0``: ``h = silu(g) * u`` (the default);
    - ``swiglu_alpha == 0, swiglu_limit = L > 0``: ``g = min(g, L)``,
      ``u = clamp(u, -L, L)``, ``h = silu(g) * u`` (DeepSeek-V4);
    - ``swiglu_alpha = a > 0``: if ``L > 0``, ``g = min(g, L)`` and ``u = clamp(u, -L, L)``;
      ``h = g * sigmoid(a * g) * (u + 1)`` (gpt-oss: ``a = 1.702, L = 7``). The gate is
      clamped from above only, as gpt-oss and transformers define it (kt-kernel also
      clamps it from below at ``-L``).

    Args:
        packed: a layer of any format (a :class:`PackedExperts` or its ``data``).
        swiglu_limit, swiglu_alpha: finite, ``>= 0``, held as float32 in the header: below
            3e38, and a positive one not 0 there (1e-50 is refused).
        biases: ``(gate_bias [E, I], up_bias [E, I], down_bias [E, H])``, fp32, bf16, fp16
            or fp64 (stored as fp32), each may be ``None`` (zero). Gate and up biases are added
            before the activation, down's before the routing weight. ``None``: no biases.

    Returns:
        ``packed`` itself (a ``data`` tensor: wrapped, not copied) when it already holds
        exactly this (no activation, no biases asked and none held); otherwise a new
        :class:`PackedExperts` with the same weights (copied; a memory-mapped GGUF layer
        becomes resident) and the activation in its header (version 2: builds before these fields refuse it rather than computing
        plain SwiGLU). Raises ``ValueError`` for negative or non-finite numbers and for a
        bias of the wrong shape or dtype.
    """
    if not isinstance(packed, PackedExperts):
        packed = PackedExperts(packed)
    for name, value in (("swiglu_limit", swiglu_limit), ("swiglu_alpha", swiglu_alpha)):
        scalar = isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool \
            and not value.is_complex()  # a 0-d tensor, as float() took it before
        if not is_real(value) and not scalar:  # True or "7" passed float() silently
            raise ValueError(f"swiglu_limit and swiglu_alpha must be finite and >= 0 (0: off); {name} is {value!r}")
    if biases is not None:
        if not isinstance(biases, (tuple, list)) or len(biases) != 3:
            raise ValueError("biases must be a (gate_bias, up_bias, down_bias) tuple; any entry may be None")
        for name, bias in zip(("gate_bias", "up_bias", "down_bias"), biases):
            # as pack_experts refuses non-finite weights: a NaN bias made every output of its expert NaN;
            # checked as stored (fp32): a float64 bias beyond fp32's range became inf
            # (a 1-byte float, which isfinite does not take, is refused by the operator as a wrong dtype)
            if isinstance(bias, torch.Tensor) and bias.is_floating_point() and bias.dtype.itemsize >= 2 \
                    and not bias.is_meta \
                    and not bool(torch.isfinite(bias.to(torch.float32) if bias.dtype == torch.float64 else bias).all()):
                raise ValueError(f"{name} holds non-finite values (NaN or infinity are refused, as in the weights; biases are "
                                 "stored as float32, so a float64 value beyond its range counts as infinite)")
        if all(b is None for b in biases):
            biases = None
    if swiglu_limit == 0 and swiglu_alpha == 0 and biases is None and not packed.has_biases \
            and packed.swiglu_limit == 0 and packed.swiglu_alpha == 0:
        return packed
    gate_bias, up_bias, down_bias = biases if biases is not None else (None, None, None)
    return PackedExperts(_C.set_activation(packed.data, float(swiglu_limit), float(swiglu_alpha),
                                           gate_bias, up_bias, down_bias))


FP8_METHODS: dict[str, str] = {"FP8": "fp8", "FP8_PERCHANNEL": "fp8_perchannel", "MXFP8": "mxfp8"}


def pack_fp8_experts(
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_scale: torch.Tensor,
    up_scale: torch.Tensor,
    down_scale: torch.Tensor,
    method: str = "FP8",
) -> PackedExperts:
    """Packs an FP8 checkpoint's experts *in place*: the e4m3 bytes are re-tiled for the
    kernels, never widened (a layer's blob is the checkpoint's bytes plus 3-12%).

    Args:
        gate_proj, up_proj: ``[E, I, H]`` ``torch.float8_e4m3fn`` (or ``uint8`` codes), CPU.
        down_proj: ``[E, H, I]``, the same.
        gate_scale, up_scale, down_scale: each matrix ``[E, N, K]``'s scales as the
            checkpoint stores them: ``"FP8"`` float ``[E, ceil(N/128), ceil(K/128)]``
            (``weight_scale_inv``: it multiplies), or one row per output row
            ``[E, N, ceil(K/128)]``; ``"FP8_PERCHANNEL"`` float ``[E, N]`` or ``[E, N, 1]``;
            ``"MXFP8"`` ue8m0 exponents ``uint8`` (or ``float8_e8m0fnu``) ``[E, N, ceil(K/32)]``.
        method: ``"FP8"``, ``"FP8_PERCHANNEL"`` or ``"MXFP8"``.

    Raises ``ValueError`` naming the tensor for a wrong dtype or shape, and for mxfp8
    exponents the kernels do not take (above 2^119, or below 2^-117 on nonzero weights).
    A NaN or infinite float scale makes its rows' outputs NaN (infinite scales are stored as
    NaN: ``0 * inf`` weights are NaN).
    """
    if not isinstance(method, str):  # as format_for_method: 3 was an AttributeError (no .upper())
        raise TypeError(f"method must be a str, got {type(method).__name__}")
    if method.upper() not in FP8_METHODS:
        raise ValueError(f"pack_fp8_experts packs methods {', '.join(FP8_METHODS)}; got {method!r}")
    gate_scale, up_scale, down_scale = (_infinite_scales_as_nan(s) for s in (gate_scale, up_scale, down_scale))
    return PackedExperts(torch.ops.kt.pack_fp8_experts(gate_proj, up_proj, down_proj, gate_scale, up_scale, down_scale,
                                                       FP8_METHODS[method.upper()]))


def _infinite_scales_as_nan(scale: torch.Tensor | None) -> torch.Tensor | None:
    """A float checkpoint scale (or int4 minimum) with +-inf entries as NaN there: an infinite
    scale makes its weights +-inf and its zero levels NaN (0 * inf), so the oracle's rows are
    NaN; the kernels, which multiply their sums by the scale, gave +-inf. NaN gives NaN rows."""
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point() or scale.dtype.itemsize < 2 \
            or scale.is_meta or not bool(torch.isinf(scale).any()):
        return scale
    return scale.masked_fill(torch.isinf(scale), math.nan)


def pack_int4_experts(
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    minimums: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    group_size: int,
) -> PackedExperts:
    """Packs an INT4 checkpoint's experts *in place*: the levels are re-tiled, never
    re-quantized (:mod:`kt_ops.hf_int4` reads RAWINT4, GPTQ and AWQ checkpoints into these
    arguments).

    Args:
        gate_proj, up_proj: uint8 ``[E, I, H/2]``, down_proj ``[E, H, I/2]``: two levels
            0..15 per byte, element k of a row in byte k // 2 (the low nibble for even k).
        scales: fp32/bf16/fp16 ``[E, N, K / group_size]`` per matrix (N, K = I, H for gate
            and up, H, I for down).
        minimums: None (format int4: ``w = scale * (q - 8)``) or the same shapes (format
            int4_asym: ``w = scale * q + minimum``).
        group_size: 32, 64 or 128, dividing H and I.

    Raises ``TypeError`` naming the tensor for a wrong dtype (as :func:`pack_experts`), and
    ``ValueError`` for a wrong shape or a bad group size. A NaN or infinite scale or minimum
    makes its rows' outputs NaN (infinite ones are stored as NaN: ``0 * inf`` weights are
    NaN).
    """
    gate_min, up_min, down_min = minimums if minimums is not None else (None, None, None)
    if isinstance(scales, (tuple, list)):
        scales = tuple(_infinite_scales_as_nan(s) for s in scales)
    gate_min, up_min, down_min = (_infinite_scales_as_nan(m) for m in (gate_min, up_min, down_min))
    return PackedExperts(torch.ops.kt.pack_int4_experts(gate_proj, up_proj, down_proj, *scales, gate_min, up_min,
                                                        down_min, group_size))


def moe_forward(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: PackedExperts | torch.Tensor,
    live_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed-experts MoE forward on the CPU.

    ``out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with
    ``e = topk_ids[t, j]``; slots with id ``-1`` are skipped. A layer packed with another
    activation or expert biases (:func:`set_activation`) computes that instead.

    Args:
        hidden_states: ``[T, H]`` bf16, fp16 or fp32, contiguous, CPU.
        topk_ids: ``[T, K]`` int32 or int64, values in ``[-1, E)`` (any K, also above E: an id may repeat, ``-1`` pads).
        topk_weights: ``[T, K]`` fp32, bf16 or fp16.
        packed: a :class:`PackedExperts` or its ``data`` tensor (host memory).
        live_tokens: optional int32/int64 one-element tensor on the inputs' device: only
            the first ``live_tokens`` tokens are computed, the other output rows are
            zero (a CUDA graph captured at a padded batch size replays for fewer tokens).

    With CUDA ``hidden_states``/``topk_ids``/``topk_weights`` (``packed`` stays on the
    CPU) the operator's CUDA key stages the inputs into pinned host buffers on the
    current stream, runs the experts in a ``cudaLaunchHostFunc`` host function and copies
    the result back: stream-ordered, asynchronous to the Python thread, capturable in a
    CUDA graph once :func:`kt_ops.cuda.reserve_cuda_graph_buffers` has reserved the batch size.

    Under autograd (a gradient needed for ``hidden_states`` or ``topk_weights``) this runs
    ``kt::moe_forward_train``, which also saves each slot's gate and up for the backward
    (:mod:`kt_ops.autograd`).

    Returns:
        ``[T, H]`` in the dtype and on the device of ``hidden_states`` (a new tensor).
    """
    data = packed.data if isinstance(packed, PackedExperts) else packed
    if not autograd.saves_gate_up(hidden_states, topk_weights):
        return autograd.MOE_FORWARD(hidden_states, topk_ids, topk_weights, data, live_tokens)
    size = packed.intermediate_size if isinstance(packed, PackedExperts) else autograd.blob_intermediate_size(packed)
    return autograd.moe_forward(hidden_states, topk_ids, topk_weights, data, size, live_tokens)


def moe_forward_parts(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    parts: Sequence[PackedExperts | torch.Tensor],
    nodes: Sequence[int],
) -> torch.Tensor:
    """:func:`moe_forward` of a layer split into parts over its intermediate dimension
    (:mod:`kt_ops.parts`): the sum of the parts' outputs, every part at once on the
    threads of its NUMA node.

    Args:
        hidden_states, topk_ids, topk_weights: as :func:`moe_forward`'s, on the CPU.
        parts: the packed parts (:class:`PackedExperts` or their ``data``), one E and H.
        nodes: the NUMA node id each part runs on (:mod:`kt_ops.numa`; ids, not
            positions), one per part. Parts of different nodes run at once, each on its
            node's threads; parts of one node one after another. An id the machine (or
            ``KT_OPS_NUMA_SIMULATE``) does not have is a ``ValueError``.

    The parts' fp32 outputs are summed in part order (whichever part finishes first), then
    rounded once to the output dtype.

    Returns:
        ``[T, H]`` in the dtype of ``hidden_states`` (a new tensor).
    """
    blobs = [part.data if isinstance(part, PackedExperts) else part for part in parts]
    ids = []
    for node in nodes:  # int(n) ran 0.7 on node 0 and "1" or True on node 1
        try:
            if isinstance(node, bool):
                raise TypeError
            ids.append(operator.index(node))
        except TypeError:
            raise TypeError(f"nodes must hold int node ids, got {node!r}") from None
    return torch.ops.kt.moe_forward_parts(hidden_states, topk_ids, topk_weights, blobs, ids)


def dequantize_experts(
    packed: PackedExperts | torch.Tensor,
    expert_ids: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chosen experts of a packed layer, any format, back as Hugging Face weights: the
    values the kernels multiply (bit for bit :func:`kt_ops.reference.dequantize`'s), for
    the backward GEMMs of fine-tuning, GPU-slot refills and staging.

    Args:
        packed: a :class:`PackedExperts` or its ``data`` tensor (host memory).
        expert_ids: int32/int64 ``[n]`` expert ids in ``[0, E)``, repeats allowed, CPU;
            ``None``: every expert, ``0 .. E - 1`` (reads the header: pass ids under
            ``torch.compile``).
        dtype: ``torch.float32`` (exact) or ``torch.bfloat16`` (those values rounded to
            nearest even).

    Returns:
        ``gate [n, I, H]``, ``up [n, I, H]``, ``down [n, H, I]`` of ``dtype`` (new CPU
        tensors; padding removed, biases not included). ``ValueError`` for an id out of
        range or a blob on the meta device, ``TypeError`` for another ``dtype`` or id dtype.

    Under ``torch.compile`` I and H come from the blob's header, so the traced sizes are
    data-dependent; given a :class:`PackedExperts` (whose header is read eagerly) they are
    pinned to its sizes.
    """
    data = packed.data if isinstance(packed, PackedExperts) else packed
    fakes.refuse_meta_blob(data)  # before PackedExperts(data) reads a header it has not got
    if expert_ids is None:
        info = packed if isinstance(packed, PackedExperts) else PackedExperts(data)
        expert_ids = torch.arange(info.num_experts, dtype=torch.int64)
    gate, up, down = torch.ops.kt.dequantize_experts(data, expert_ids, dtype)
    if isinstance(packed, PackedExperts):
        torch._check(gate.shape[1] == packed.intermediate_size)
        torch._check(gate.shape[2] == packed.hidden_size)
    return gate, up, down
