"""Helpers for the GGUF tests: valid random blocks and tiny GGUF models on disk."""

from __future__ import annotations

import os

import gguf
import numpy as np
import torch

T = gguf.GGMLQuantizationType

# Byte offsets of the fp16 scale fields in each type's block, and a magnitude for them
# that keeps the dequantized weights ~1 / sqrt(K) (levels x sub-block scales ~ 1).
F16_FIELDS: dict[str, tuple[tuple[int, ...], float]] = {
    "Q4_0": ((0,), 1 / 8),
    "Q4_1": ((0, 2), 1 / 16),
    "Q5_0": ((0,), 1 / 16),
    "Q5_1": ((0, 2), 1 / 32),
    "Q8_0": ((0,), 1 / 128),
    "Q2_K": ((80, 82), 1 / 45),
    "Q3_K": ((108,), 1 / 128),
    "Q4_K": ((0, 2), 1 / 945),
    "Q5_K": ((0, 2), 1 / 1953),
    "Q6_K": ((208,), 1 / 2048),
}
FLOAT_TYPES = ("F32", "F16", "BF16")


def random_blocks(type_name: str, rows: int, k: int, generator: np.random.Generator) -> np.ndarray:
    """``rows`` rows of ``k`` weights of ``type_name`` as GGUF bytes ``[rows, row_bytes]``:
    random level bytes with sane random fp16 scales (float types: random values)."""
    if type_name in FLOAT_TYPES:
        values = (generator.standard_normal((rows, k)) / np.sqrt(k)).astype(np.float32)
        return gguf.quants.quantize(values, T[type_name]).view(np.uint8).reshape(rows, -1)
    block, type_bytes = gguf.GGML_QUANT_SIZES[T[type_name]]
    data = generator.integers(0, 256, size=(rows, k // block, type_bytes), dtype=np.uint8)
    fields, magnitude = F16_FIELDS[type_name]
    for offset in fields:
        scale = (generator.uniform(0.5, 1.5, size=(rows, k // block)) * magnitude / np.sqrt(k)).astype(np.float16)
        if type_name in ("Q4_1", "Q5_1") and offset == 2:  # the minimum: about -half the range
            scale = (-scale * (8 if type_name == "Q4_1" else 16)).astype(np.float16)
        data[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(rows, k // block, 2)
    return data.reshape(rows, -1)


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """gguf's own dequantizer: GGUF bytes -> fp32 tensor of ``shape``."""
    qtype = T[type_name]
    data = raw
    if qtype == T.F32:
        data = raw.view(np.float32)
    elif qtype == T.F16:
        data = raw.view(np.float16)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)).reshape(shape)


def moe_writer(path: str | os.PathLike[str], arch: str = "qwen3moe", experts: int | None = None,
               hidden: int | None = None, intermediate: int | None = None, top_k: int = 2,
               blocks: int = 1) -> gguf.GGUFWriter:
    """A GGUFWriter for ``path`` with an MoE model's sizes in its metadata: the block count,
    and each of the expert count (with ``top_k`` used per token), embedding length and
    expert feed-forward length that is not None."""
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    writer.add_block_count(blocks)
    if experts is not None:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(top_k)
    if hidden is not None:
        writer.add_embedding_length(hidden)
    if intermediate is not None:
        writer.add_expert_feed_forward_length(intermediate)
    return writer


def finish(writer: gguf.GGUFWriter) -> None:
    """Writes ``writer``'s header, metadata and tensors, and closes the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_model(
    path: str | os.PathLike[str],
    layers: list[dict[str, tuple[str, np.ndarray]] | None],
    num_experts: int,
    hidden: int,
    intermediate: int,
    top_k: int = 2,
    split_max_tensors: int = 0,
    metadata_experts: int | None = None,
) -> None:
    """A tiny qwen3moe GGUF: per layer ``{"ffn_gate_exps": (type, bytes [E, rows, row_bytes]), ...}``
    (None: a layer without experts, given a dense ffn_gate instead)."""
    writer = gguf.GGUFWriter(os.fspath(path), "qwen3moe", split_max_tensors=split_max_tensors)
    writer.add_block_count(len(layers))
    writer.add_expert_count(metadata_experts or num_experts)
    writer.add_expert_used_count(top_k)
    writer.add_embedding_length(hidden)
    writer.add_expert_feed_forward_length(intermediate)
    for index, layer in enumerate(layers):
        writer.add_tensor(f"blk.{index}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        if layer is None:
            writer.add_tensor(f"blk.{index}.ffn_gate.weight", np.zeros((intermediate, hidden), dtype=np.float32))
            continue
        for name, (type_name, raw) in layer.items():
            writer.add_tensor(f"blk.{index}.{name}.weight", raw, raw_dtype=T[type_name])
    finish(writer)
