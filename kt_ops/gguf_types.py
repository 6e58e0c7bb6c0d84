"""GGUF (ggml) tensor types of the ``LLAMAFILE`` method: parsing user input and sizes.

The types come from the ggml-type sub-table of the C++ format table
(``csrc/cpu/formats/gguf_types.h``, exposed as ``kt_ops._C.ggml_type_table()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import gguf

from kt_ops._native import _C
from kt_ops._validate import is_integral

GgufTypeLike = Union[gguf.GGMLQuantizationType, str, int]


@dataclass(frozen=True)
class GgmlTypeInfo:
    """A ggml tensor type kt_ops computes on (format ``gguf``, docs/formats.md)."""

    id: int
    """The ggml type id GGUF files store (``gguf.GGMLQuantizationType`` value)."""
    name: str
    """As ``gguf.GGMLQuantizationType`` names it, e.g. ``"Q4_K"``."""
    block_elems: int
    """Elements per block: 1 (float types), 32 or 256; a row length must be a multiple."""
    block_bytes: int
    """Bytes per block."""
    is_float: bool
    """F32 / F16 / BF16: plain values, no quantization blocks."""
    llama_cpp_fallback: str | None
    """The type llama.cpp stores a tensor in instead when its row length is not a multiple
    of ``block_elems`` (K-quants), or None; it need not be one kt_ops computes."""
    in_place_variants: tuple[str, ...]
    """CPU variants whose kernel dots this type straight from its bytes."""


# The rows of the C++ ggml-type table (docs/formats.md has a row for each).
GGML_TYPES: tuple[GgmlTypeInfo, ...] = tuple(
    GgmlTypeInfo(**{**row, "in_place_variants": tuple(row["in_place_variants"])}) for row in _C.ggml_type_table()
)

# The ggml types kt_ops computes on (docs/formats.md).
SUPPORTED_TYPES: tuple[str, ...] = tuple(t.name for t in GGML_TYPES)

# llama.cpp's replacement when a K-quant does not fit a row length (not a multiple of
# 256), where kt_ops computes it. (Q2_K and Q3_K fall back to IQ4_NL there, which kt_ops
# does not compute.)
LLAMA_CPP_FALLBACK: dict[str, str] = {
    t.name: t.llama_cpp_fallback for t in GGML_TYPES if t.llama_cpp_fallback in SUPPORTED_TYPES
}


def gguf_type_id(value: GgufTypeLike) -> int:
    """The ggml type id of a ``gguf.GGMLQuantizationType``, its name (``"Q4_K"``, any
    case) or its integer value; ``ValueError`` naming the supported types otherwise."""
    if isinstance(value, gguf.GGMLQuantizationType):
        qtype = value
    elif isinstance(value, str):
        try:
            qtype = gguf.GGMLQuantizationType[value.upper()]
        except KeyError:
            raise ValueError(f"unknown GGUF type {value!r}; supported: {', '.join(SUPPORTED_TYPES)}") from None
    elif is_integral(value):  # numpy's integers too (a type id read from a GGUF file's array)
        try:
            qtype = gguf.GGMLQuantizationType(int(value))
        except ValueError:
            raise ValueError(f"{value} is not a ggml type id; supported: {', '.join(SUPPORTED_TYPES)}") from None
    else:
        raise TypeError(f"a GGUF type must be a GGMLQuantizationType, name or int, got {type(value).__name__}")
    if qtype.name not in SUPPORTED_TYPES:
        raise ValueError(f"GGUF type {qtype.name} is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
    return int(qtype)


def gguf_type_ids(gguf_type: GgufTypeLike | tuple[GgufTypeLike, GgufTypeLike, GgufTypeLike]) -> tuple[int, int, int]:
    """``(gate, up, down)`` ggml type ids from one type or a 3-tuple of types."""
    if isinstance(gguf_type, (tuple, list)):
        if len(gguf_type) != 3:
            raise ValueError(f"gguf_type tuple must be (gate, up, down), got {len(gguf_type)} entries")
        ids = tuple(gguf_type_id(t) for t in gguf_type)
        return ids[0], ids[1], ids[2]
    one = gguf_type_id(gguf_type)
    return one, one, one


def ggml_type_info(type_id: int) -> GgmlTypeInfo:
    """The :class:`GgmlTypeInfo` of a supported ggml type id; ``ValueError`` otherwise."""
    for info in GGML_TYPES:
        if info.id == type_id:
            return info
    raise ValueError(f"{type_id} is not a ggml type id kt_ops computes; supported: {', '.join(SUPPORTED_TYPES)}")


def type_name(type_id: int) -> str:
    return gguf.GGMLQuantizationType(type_id).name


def llama_cpp_types(types: tuple[int, int, int], hidden: int, intermediate: int) -> tuple[str, str, str] | None:
    """The ``(gate, up, down)`` type names a llama.cpp GGUF file of these sizes stores for
    ``types``: each K-quant whose 256-weight block does not divide its row length (``hidden``
    for gate and up, ``intermediate`` for down) replaced by llama.cpp's fallback type (Q4_K
    -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0); None where such a fallback is one kt_ops does not
    compute (Q2_K, Q3_K: IQ4_NL) or a type of another kind does not fit."""
    names = []
    for type_id, k in zip(types, (hidden, hidden, intermediate)):
        info = ggml_type_info(type_id)
        name = info.name
        if k % info.block_elems:
            name = LLAMA_CPP_FALLBACK.get(name)
            if name is None or k % ggml_type_info(gguf_type_id(name)).block_elems:
                return None
        names.append(name)
    return names[0], names[1], names[2]


def check_row_lengths(types: tuple[int, int, int], hidden: int, intermediate: int) -> None:
    """``ValueError`` if a matrix's row length is not a multiple of its type's block,
    naming the llama.cpp fallback type for K-quants (and the ``gguf_type`` triple that
    applies it to every matrix that needs it, :func:`llama_cpp_types`)."""
    for matrix, type_id, k in (("gate_proj", types[0], hidden), ("up_proj", types[1], hidden),
                               ("down_proj", types[2], intermediate)):
        info = ggml_type_info(type_id)
        name, block, fallback = info.name, info.block_elems, info.llama_cpp_fallback
        if k % block:
            hint = ""
            if fallback in SUPPORTED_TYPES:
                hint = f"; llama.cpp stores such tensors as {fallback}"
                suggestion = llama_cpp_types(types, hidden, intermediate)
                hint += (f": pass gguf_type={suggestion!r} (gate, up, down)" if suggestion is not None
                         else " (pass gguf_type as a (gate, up, down) tuple)")
            elif fallback is not None:
                hint = (f"; llama.cpp stores such tensors as {fallback}, which kt_ops does not compute: "
                        "use a 32-weight type such as Q4_0 for that matrix")
            raise ValueError(f"{matrix}: GGUF type {name} needs a row length that is a multiple of "
                             f"{block}, got {k}{hint}")
