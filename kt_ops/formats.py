"""The packed weight formats and the kt-kernel method names that select them.

Everything here is read from the C++ format table (``csrc/cpu/format_table.h``, exposed as
``kt_ops._C.format_table()``), the one list of formats: :data:`FORMATS` holds its rows,
and :data:`METHOD_FORMATS`, :data:`GROUPED_FORMATS`, :data:`GROUP_SIZES` and
:data:`DEFAULT_GROUP_SIZE` are views of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from kt_ops._native import _C


@dataclass(frozen=True)
class FormatInfo:
    """One row of the format table: a packed weight format (docs/formats.md).

    Weights are stored in blocks of ``block_rows`` output rows; a block holds 64-byte
    lines (``line_bytes``) of ``line_k`` k values of each of its rows, then
    ``scale_bytes`` bytes of fp32 scale (and minimum) per row and group (int8: per row).
    ``gguf`` stores each row as ggml blocks instead (``block_rows`` 1, ``line_k`` 0; see
    :data:`kt_ops.gguf_types.GGML_TYPES`).
    """

    name: str
    """The format name: ``kt::pack_experts``' ``format`` and ``packed_info()["format"]``."""
    id: int
    """The format id a packed header stores."""
    methods: tuple[str, ...]
    """kt-kernel method names that select it (with :attr:`zero_point`)."""
    zero_point: bool
    """True when the methods select it with ``zero_point=True`` (asymmetric INT4)."""
    block_rows: int
    """Output rows per block (16; gguf: 1)."""
    line_k: int
    """k values of each row per 64-byte line (bf16 2, int8 4, int4 8; gguf: 0, per ggml type)."""
    line_bytes: int
    """Bytes per line (64; gguf: 0, per ggml type)."""
    scale_bytes: int
    """Scale (and minimum) bytes per row and group (int8, fp8_perchannel: per row; mxfp8:
    1, a ue8m0 exponent; bf16, gguf: 0)."""
    scale_group_k: int
    """k per scale group where the format fixes it (fp8 128, mxfp8 32): ceil(K /
    scale_group_k) groups; 0: by ``group_size`` or one per row."""
    scale_pad: int
    """A block's scales are padded to a multiple of this many bytes (mxfp8: 64)."""
    row_tail_bytes: int
    """Bytes per row after the scales (mxfp8: 4, a NaN addend)."""
    k_rule: str
    """What a row length K (H for gate/up, I for down) must be a multiple of: ``"any"``,
    ``"group_size"`` or ``"ggml_block"`` (the matrix's ggml type's block)."""
    k_pad: int
    """K is padded with zero weights to a multiple of this (1: not padded); down's K (the
    intermediate, produced in whole blocks by gate and up) to ``block_rows`` too."""
    max_k: int
    """The largest H and I the format takes (0: no limit)."""
    group_sizes: tuple[int, ...]
    """The k-group sizes it takes (empty: no groups, ``group_size`` 0)."""
    default_group_size: int
    """``pack_experts``' default group size (0: no groups)."""
    scale_search: bool
    """True when ``pack_experts(..., scale_search=True)`` applies."""
    packer: str
    """The C++ packing function (``csrc/cpu/formats/``)."""
    dequantizer: str
    """The C++ "dequantize rows" micro-kernel (``csrc/cpu/formats/dequantize_*``) that
    :func:`kt_ops.dequantize_experts` runs: the oracle's values, bit for bit."""
    activations: str
    """What the kernels do to activations: ``"none"``, ``"int8_per_token"`` or
    ``"int8_ggml_blocks"`` (8-bit blocks of the weight type's block)."""
    oracle: str
    """The :mod:`kt_ops.reference` function that decodes a blob of this format."""
    kernels: Mapping[str, str] = field(hash=False)
    """CPU variant name -> the MoE kernel it runs for this format."""

    @classmethod
    def from_row(cls, row: dict) -> "FormatInfo":
        values = {key: row[key] for key in cls.__dataclass_fields__}
        values["methods"] = tuple(row["methods"])
        values["group_sizes"] = tuple(row["group_sizes"])
        values["kernels"] = MappingProxyType(dict(row["kernels"]))
        return cls(**values)


# The rows of the C++ format table, in header-id order.
FORMATS: tuple[FormatInfo, ...] = tuple(FormatInfo.from_row(row) for row in _C.format_table())

# kt-kernel method name -> packed format of the native kernels (zero_point=False).
METHOD_FORMATS: dict[str, str] = {
    method: fmt.name for fmt in FORMATS if not fmt.zero_point for method in fmt.methods
}

# kt-kernel method name -> packed format it selects with zero_point=True.
ZERO_POINT_FORMATS: dict[str, str] = {method: fmt.name for fmt in FORMATS if fmt.zero_point for method in fmt.methods}

# INT4 checkpoint methods (kt_ops.hf_int4) -> (the format pack_experts quantizes them into
# from float weights, its default group size). A checkpoint read in place becomes int4
# when symmetric and int4_asym when it has zero points, whatever its method.
CHECKPOINT_METHODS: dict[str, tuple[str, int]] = {
    "RAWINT4": ("int4", 32),
    "GPTQ_INT4": ("int4", 128),
    "AWQ_INT4": ("int4_asym", 128),
}

# Formats quantized in k-groups (they take group_size; mxfp4's is fixed at 32).
GROUPED_FORMATS: tuple[str, ...] = tuple(fmt.name for fmt in FORMATS if fmt.group_sizes)
GROUP_SIZES: tuple[int, ...] = tuple(sorted({size for fmt in FORMATS for size in fmt.group_sizes}))


def default_group_size(method: str) -> int:
    """``pack_experts``' group size for ``method`` when none is given: the checkpoint
    method's own (RAWINT4 32, GPTQ/AWQ 128), a format's only one (MXFP4 32), else
    :data:`DEFAULT_GROUP_SIZE` (0 for formats without groups is decided by the caller)."""
    entry = CHECKPOINT_METHODS.get(method.upper()) if isinstance(method, str) else None
    if entry:
        return entry[1]
    fmt = METHOD_FORMATS.get(method.upper()) if isinstance(method, str) else None
    sizes = next((f.group_sizes for f in FORMATS if f.name == fmt), ())
    return sizes[0] if len(sizes) == 1 else DEFAULT_GROUP_SIZE


def _default_group_size() -> int:
    """The default of the formats that offer a choice of group sizes (INT4: kt-kernel's 128)."""
    defaults = {fmt.default_group_size for fmt in FORMATS if len(fmt.group_sizes) > 1}
    if len(defaults) != 1:
        raise RuntimeError(f"the format table's grouped formats disagree on the default group size: {defaults}")
    return defaults.pop()


DEFAULT_GROUP_SIZE: int = _default_group_size()


def format_info(name: str) -> FormatInfo:
    """The :class:`FormatInfo` of a format name (``"int4_asym"``); ``ValueError`` naming
    the formats that exist otherwise."""
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    raise ValueError(f"unknown packed format {name!r}; expected one of: {', '.join(f.name for f in FORMATS)}")


def format_for_method(method: str, zero_point: bool = False) -> str:
    """The packed format for a kt-kernel method name, e.g. ``"AMXINT8" -> "int8"``;
    ``zero_point=True`` selects the asymmetric INT4 format (``"int4_asym"``). The INT4
    checkpoint methods give the format they quantize into (:data:`CHECKPOINT_METHODS`).

    Raises ``ValueError`` naming the methods that exist when ``method`` is unknown, or
    when ``zero_point`` is asked of a method without an asymmetric format.
    """
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, got {type(method).__name__}")
    if method.upper() in CHECKPOINT_METHODS:
        if zero_point:
            raise ValueError(f"method {method!r} fixes its own symmetry; zero_point does not apply")
        return CHECKPOINT_METHODS[method.upper()][0]
    try:
        fmt = METHOD_FORMATS[method.upper()]
    except KeyError:
        raise ValueError(
            f"method {method!r} is not available; implemented: {', '.join([*METHOD_FORMATS, *CHECKPOINT_METHODS])}"
        ) from None
    if zero_point:
        if method.upper() not in ZERO_POINT_FORMATS:
            base = sorted({METHOD_FORMATS[m].upper() for m in ZERO_POINT_FORMATS})
            raise ValueError(f"zero_point applies to the {'/'.join(base)} methods ({', '.join(ZERO_POINT_FORMATS)}), "
                             f"not {method!r}")
        return ZERO_POINT_FORMATS[method.upper()]
    return fmt
