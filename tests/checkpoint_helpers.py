"""Tiny synthetic Hugging Face MoE checkpoints on disk, in each expert naming convention."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

Weights = dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # layer -> (gate, up, down) fp32


def make_weights(layers: list[int], E: int, H: int, I: int, seed: int = 0) -> Weights:
    """Gaussian experts ``gate/up [E, I, H]``, ``down [E, H, I]`` scaled by 1/sqrt(k)."""
    g = torch.Generator().manual_seed(seed)
    return {L: (torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
                torch.randn(E, H, I, generator=g) / I**0.5) for L in layers}


def fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek block-FP8 of a 2-D weight: (e4m3 weight, fp32 scale_inv per block)."""
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    scale = torch.empty(br, bc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(br):
        for j in range(bc):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = float(tile.abs().max()) / 448.0 or 1.0
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale


def fp8_dequantized(w: torch.Tensor, block: int = 128) -> torch.Tensor:
    """What a loader must see for ``w`` stored as block-FP8 (bf16, computed independently)."""
    q, scale = fp8_blocks(w, block)
    out = torch.empty(w.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out.bfloat16()


def write_checkpoint(
    path: Path,
    weights: Weights,
    convention: str = "per_expert",
    dtype: torch.dtype = torch.bfloat16,
    shards: int = 1,
    index: bool = True,
    dense_layers: tuple[int, ...] = (),
    skip: tuple[str, ...] = (),
    top_k: int = 2,
) -> Path:
    """Writes ``config.json`` and the experts as ``model-0000i-of-0000N.safetensors``
    (plus ``model.safetensors.index.json`` if ``index``). ``dtype=torch.float8_e4m3fn``
    stores DeepSeek block-FP8 with ``weight_scale_inv``. Keys named in ``skip`` are left
    out (a broken checkpoint)."""
    path.mkdir(parents=True, exist_ok=True)
    some = next(iter(weights.values()))
    E, I, H = some[0].shape
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.zeros(4, H, dtype=torch.bfloat16)}

    def put(key: str, w: torch.Tensor) -> None:
        if dtype == torch.float8_e4m3fn:
            q, scale = fp8_blocks(w)
            tensors[key] = q
            tensors[key[: -len(".weight")] + ".weight_scale_inv"] = scale
        else:
            tensors[key] = w.to(dtype).contiguous()

    for L in dense_layers:
        tensors[f"model.layers.{L}.mlp.gate_proj.weight"] = torch.zeros(I, H, dtype=torch.bfloat16)
    for L, (gate, up, down) in sorted(weights.items()):
        tensors[f"model.layers.{L}.input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        if convention == "fused":
            tensors[f"model.layers.{L}.mlp.experts.gate_up_proj"] = torch.cat((gate, up), dim=1).to(dtype)
            tensors[f"model.layers.{L}.mlp.experts.down_proj"] = down.to(dtype).contiguous()
            continue
        block, names = (("mlp", ("gate_proj", "up_proj", "down_proj")) if convention == "per_expert"
                        else ("block_sparse_moe", ("w1", "w3", "w2")))
        for e in range(E):
            for name, w in zip(names, (gate[e], up[e], down[e])):
                put(f"model.layers.{L}.{block}.experts.{e}.{name}.weight", w)
    for key in skip:
        del tensors[key]
    keys = list(tensors)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[s::shards]}
        save_file(part, str(path / name))
        weight_map.update({k: name for k in part})
    if index:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    layers = max(list(weights) + list(dense_layers)) + 1
    config = {"model_type": "qwen3_moe", "num_hidden_layers": layers, "hidden_size": H, "num_experts_per_tok": top_k}
    if convention == "w123":
        config.update(model_type="mixtral", num_local_experts=E, intermediate_size=I)
    else:
        config.update(num_experts=E, moe_intermediate_size=I)
    (path / "config.json").write_text(json.dumps(config))
    return path
