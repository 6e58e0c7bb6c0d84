"""Hugging Face safetensors checkpoints: one layer's routed experts at a time.

Three naming conventions are detected per layer (``{base}`` is whatever precedes
``layers.{L}``, e.g. ``model.layers.3`` or ``model.language_model.layers.3``):

- ``per_expert`` (Qwen, DeepSeek): ``{base}.mlp.experts.{e}.{gate,up,down}_proj.weight``
- ``w123`` (Mixtral, MiniMax): ``{base}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``
  (w1 = gate, w3 = up, w2 = down)
- ``fused`` (transformers v5, Qwen3.5): ``{base}.mlp.experts.gate_up_proj`` ``[E, 2I, H]``
  (gate rows first) and ``{base}.mlp.experts.down_proj`` ``[E, H, I]``

Tensors are bf16, fp16, fp32, or DeepSeek block-FP8 (``float8_e4m3fn`` with a
``weight_scale_inv`` of one fp32 per 128 x 128 block), which is dequantized to bf16.
The checkpoint is a directory of ``*.safetensors`` files, with or without
``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open

FP8_BLOCK = 128  # DeepSeek block-FP8: one scale per 128 x 128 weights

_PATTERNS = {
    "per_expert": re.compile(r"^(?P<base>.*layers\.(?P<layer>\d+))\.mlp\.experts\.(?P<e>\d+)\.(?P<m>gate_proj|up_proj|down_proj)\.weight$"),
    "w123": re.compile(r"^(?P<base>.*layers\.(?P<layer>\d+))\.block_sparse_moe\.experts\.(?P<e>\d+)\.(?P<m>w1|w3|w2)\.weight$"),
    "fused": re.compile(r"^(?P<base>.*layers\.(?P<layer>\d+))\.mlp\.experts\.(?P<m>gate_up_proj|down_proj)$"),
}
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}
_NAMES = {"per_expert": ("gate_proj", "up_proj", "down_proj"), "w123": ("w1", "w3", "w2")}


@dataclass(frozen=True)
class LayerExperts:
    """Where one layer's routed experts are: convention, key prefix and expert count."""

    layer: int
    convention: str  # "per_expert", "w123" or "fused"
    base: str  # key prefix up to and including "layers.{layer}"
    num_experts: int  # experts found (per-expert conventions: highest index + 1)

    def key(self, matrix: int, expert: int = 0) -> str:
        """The tensor key of matrix 0 (gate), 1 (up) or 2 (down); fused: 0/1 -> gate_up_proj."""
        if self.convention == "fused":
            return f"{self.base}.mlp.experts.{'down_proj' if matrix == 2 else 'gate_up_proj'}"
        block = "mlp" if self.convention == "per_expert" else "block_sparse_moe"
        return f"{self.base}.{block}.experts.{expert}.{_NAMES[self.convention][matrix]}.weight"


class HfCheckpoint:
    """The safetensors files of a Hugging Face model directory, indexed by tensor key.

    Only file headers are read when opening; :meth:`load_experts` reads one layer.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: not a directory of safetensors files")
        index = self.path / "model.safetensors.index.json"
        self.key_file: dict[str, Path] = {}
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.key_file = {key: self.path / name for key, name in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.path}: no *.safetensors files")
            for file in files:
                with safe_open(os.fspath(file), framework="pt") as handle:
                    for key in handle.keys():
                        self.key_file[key] = file
        self._layers: dict[int, LayerExperts] | None = None

    def moe_layers(self) -> dict[int, LayerExperts]:
        """Every layer with routed experts, by layer index."""
        if self._layers is None:
            found: dict[tuple[int, str, str], int] = {}
            for key in self.key_file:
                for convention, pattern in _PATTERNS.items():
                    match = pattern.match(key)
                    if match:
                        ident = (int(match["layer"]), convention, match["base"])
                        expert = int(match["e"]) + 1 if "e" in match.groupdict() and match["e"] else 0
                        found[ident] = max(found.get(ident, 0), expert)
            layers: dict[int, LayerExperts] = {}
            for (layer, convention, base), count in sorted(found.items()):
                if layer in layers:
                    other = layers[layer]
                    raise ValueError(
                        f"{self.path}: layer {layer} has experts under two names ({other.base} "
                        f"[{other.convention}] and {base} [{convention}]); cannot tell which to load"
                    )
                if convention == "fused":
                    count = self._shape(LayerExperts(layer, convention, base, 0).key(0))[0]
                layers[layer] = LayerExperts(layer, convention, base, count)
            self._layers = layers
        return self._layers

    def layer(self, layer: int) -> LayerExperts:
        """The routed experts of ``layer``; ``KeyError`` naming the keys looked for."""
        layers = self.moe_layers()
        if layer not in layers:
            have = ", ".join(map(str, sorted(layers))) or "none"
            raise KeyError(
                f"{self.path}: no routed-expert tensors for layer {layer} (looked for "
                f"'*layers.{layer}.mlp.experts.{{e}}.gate_proj.weight', "
                f"'*layers.{layer}.block_sparse_moe.experts.{{e}}.w1.weight' and "
                f"'*layers.{layer}.mlp.experts.gate_up_proj'); layers with experts: {have}"
            )
        return layers[layer]

    def _file(self, key: str) -> Path:
        if key not in self.key_file:
            raise KeyError(f"{self.path}: tensor {key!r} is missing")
        return self.key_file[key]

    def _shape(self, key: str) -> tuple[int, ...]:
        with safe_open(os.fspath(self._file(key)), framework="pt") as handle:
            return tuple(handle.get_slice(key).get_shape())

    def dtype(self, layer: int) -> torch.dtype:
        """The stored dtype of the layer's gate tensor (e.g. ``torch.float8_e4m3fn``)."""
        key = self.layer(layer).key(0)
        with safe_open(os.fspath(self._file(key)), framework="pt") as handle:
            name = handle.get_slice(key).get_dtype()
        if name not in _DTYPES:
            raise ValueError(f"tensor {key!r} is {name}; expert weights must be BF16, F16, F32 or F8_E4M3")
        return _DTYPES[name]

    def _read(self, key: str) -> torch.Tensor:
        """A tensor, FP8 dequantized to bf16 with its block scales."""
        with safe_open(os.fspath(self._file(key)), framework="pt") as handle:
            tensor = handle.get_tensor(key)
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale_key = key[: -len(".weight")] + ".weight_scale_inv" if key.endswith(".weight") else key + "_scale_inv"
            with safe_open(os.fspath(self._file(scale_key)), framework="pt") as handle:
                scale = handle.get_tensor(scale_key)
            tensor = dequantize_block_fp8(tensor, scale)
        return tensor

    def load_experts(
        self, layer: int, experts: Sequence[int], hidden_size: int, intermediate_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``gate [n, I, H]``, ``up [n, I, H]``, ``down [n, H, I]`` of the listed experts
        (logical indices, repeats allowed) in their stored dtype (FP8: bf16).

        Peak extra memory is the three outputs plus one stored tensor. Raises
        ``KeyError`` for a missing layer or expert tensor and ``ValueError`` for a shape
        that disagrees with ``hidden_size`` / ``intermediate_size``, naming the key.
        """
        where = self.layer(layer)
        H, I = hidden_size, intermediate_size
        for e in experts:
            if not 0 <= e < where.num_experts:
                raise KeyError(f"{self.path}: layer {layer} has {where.num_experts} experts; expert {e} is missing "
                               f"(e.g. {where.key(0, e)!r})")
        shapes = ((I, H), (I, H), (H, I))
        out: list[torch.Tensor] = []
        if where.convention == "fused":
            fused = self._read(where.key(0))
            down = self._read(where.key(2))
            _check_shape(where.key(0), fused.shape, (where.num_experts, 2 * I, H))
            _check_shape(where.key(2), down.shape, (where.num_experts, H, I))
            index = torch.tensor(list(experts), dtype=torch.long)
            picked = fused.index_select(0, index)
            return picked[:, :I].contiguous(), picked[:, I:].contiguous(), down.index_select(0, index)
        for m, shape in enumerate(shapes):
            matrix: torch.Tensor | None = None
            for i, e in enumerate(experts):
                key = where.key(m, e)
                tensor = self._read(key)
                _check_shape(key, tensor.shape, shape)
                if matrix is None:
                    matrix = torch.empty((len(experts), *shape), dtype=tensor.dtype)
                matrix[i].copy_(tensor)
            out.append(matrix if matrix is not None else torch.empty((0, *shape)))
        return out[0], out[1], out[2]


def _check_shape(key: str, got: torch.Size | tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != want:
        raise ValueError(f"tensor {key!r} has shape {tuple(got)}, expected {want} from the layer's sizes")


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """DeepSeek block-FP8 ``weight [..., rows, cols]`` (e4m3) times its ``scale_inv
    [..., ceil(rows / block), ceil(cols / block)]`` (fp32), as bf16."""
    rows, cols = weight.shape[-2:]
    expected = (-(-rows // block), -(-cols // block))
    if tuple(scale_inv.shape[-2:]) != expected:
        raise ValueError(f"FP8 scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(weight.shape)} "
                         f"in {block}x{block} blocks (expected {expected})")
    scale = scale_inv.float().repeat_interleave(block, dim=-2)[..., :rows, :].repeat_interleave(block, dim=-1)[..., :cols]
    return (weight.float() * scale).to(torch.bfloat16)
