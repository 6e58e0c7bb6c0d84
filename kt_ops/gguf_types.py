"""GGUF (ggml) tensor types of the ``LLAMAFILE`` method: parsing user input and sizes."""

from __future__ import annotations

from typing import Union

import gguf

from kt_ops._native import _C

GgufTypeLike = Union[gguf.GGMLQuantizationType, str, int]

# The ggml types kt_ops computes on (docs/formats.md).
SUPPORTED_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)

# llama.cpp's replacement when a K-quant does not fit a row length (not a multiple of
# 256), where kt_ops computes it. (Q2_K and Q3_K fall back to IQ4_NL there, which kt_ops
# does not compute.)
LLAMA_CPP_FALLBACK: dict[str, str] = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


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
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            qtype = gguf.GGMLQuantizationType(value)
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


def type_name(type_id: int) -> str:
    return gguf.GGMLQuantizationType(type_id).name


def check_row_lengths(types: tuple[int, int, int], hidden: int, intermediate: int) -> None:
    """``ValueError`` if a matrix's row length is not a multiple of its type's block,
    naming the llama.cpp fallback type for K-quants."""
    for matrix, type_id, k in (("gate_proj", types[0], hidden), ("up_proj", types[1], hidden),
                               ("down_proj", types[2], intermediate)):
        name, block, _ = _C.ggml_type(type_id)
        if k % block:
            hint = ""
            if name in LLAMA_CPP_FALLBACK:
                hint = (f"; llama.cpp stores such tensors as {LLAMA_CPP_FALLBACK[name]} "
                        f"(pass gguf_type as a (gate, up, down) tuple)")
            elif name in ("Q2_K", "Q3_K"):
                hint = ("; llama.cpp stores such tensors as IQ4_NL, which kt_ops does not compute: "
                        "use a 32-weight type such as Q4_0 for that matrix")
            raise ValueError(f"{matrix}: GGUF type {name} needs a row length that is a multiple of "
                             f"{block}, got {k}{hint}")
