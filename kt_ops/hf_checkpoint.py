"""Hugging Face safetensors checkpoints: one layer's routed experts at a time.

Three naming conventions are detected per layer (``{base}`` is whatever precedes
``layers.{L}``, e.g. ``model.layers.3`` or ``model.language_model.layers.3``):

- ``per_expert`` (Qwen, DeepSeek): ``{base}.mlp.experts.{e}.{gate,up,down}_proj.weight``
- ``w123`` (Mixtral, MiniMax): ``{base}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``
  (w1 = gate, w3 = up, w2 = down)
- ``fused`` (transformers v5, Qwen3.5): ``{base}.mlp.experts.gate_up_proj`` ``[E, 2I, H]``
  (gate rows first) and ``{base}.mlp.experts.down_proj`` ``[E, H, I]``

Tensors are bf16, fp16, fp32 or FP8 (``float8_e4m3fn``) with a scale tensor beside
each weight (``X.weight_scale_inv`` or ``X.weight_scale``; fused: ``key + "_scale_inv"`` /
``"_scale"``), of one of three kinds told apart by the scale's dtype and shape:

- ``fp8`` (DeepSeek, Qwen3-FP8, MiniMax-M2): float ``[ceil(N/128), ceil(K/128)]``, one per
  128 x 128 block (a multiplier despite the name ``scale_inv``);
- ``fp8_perchannel`` (GLM-4.x-FP8): float ``[N]`` or ``[N, 1]``;
- ``mxfp8`` (MiniMax-M3): ue8m0 exponent bytes (``U8`` or ``F8_E8M0``) ``[N, ceil(K/32)]``.

:meth:`HfCheckpoint.load_experts` dequantizes FP8 to bf16; :meth:`HfCheckpoint.load_fp8_experts`
returns the e4m3 bytes and scales as stored, for :func:`kt_ops.pack_fp8_experts`. The
checkpoint is a directory of ``*.safetensors`` files, with or without
``model.safetensors.index.json``; a file that cannot be read (truncated, corrupt) is a
``ValueError`` naming it.
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

from kt_ops.reference import decode_ue8m0

FP8_BLOCK = 128  # DeepSeek block-FP8: one scale per 128 x 128 weights
MX_BLOCK = 32  # MXFP8: one exponent per 32 weights along k
FP8_KINDS = ("fp8", "fp8_perchannel", "mxfp8")
_FLOAT_SCALES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_BYTE_SCALES = ("U8", "F8_E8M0")

_PATTERNS = {
    "per_expert": re.compile(r"^(?P<base>.*layers\.(?P<layer>\d+))\.mlp\.experts\.(?P<e>\d+)\.(?P<m>gate_proj|up_proj|down_proj)\.weight$"),
    "w123": re.compile(r"^(?P<base>.*layers\.(?P<layer>\d+))\.block_sparse_moe\.experts\.(?P<e>\d+)\.(?P<m>w1|w3|w2)\.weight$"),
    "fused": re.compile(r"^(?P<base>.*layers\.(?P<layer>\d+))\.mlp\.experts\.(?P<m>gate_up_proj|down_proj)$"),
}
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}
_NAMES = {"per_expert": ("gate_proj", "up_proj", "down_proj"), "w123": ("w1", "w3", "w2")}


@dataclass(frozen=True)
class Fp8Experts:
    """One layer's FP8 experts as the checkpoint stores them (nothing widened).

    ``gate``, ``up``: ``[n, I, H]``, ``down``: ``[n, H, I]`` ``torch.float8_e4m3fn``. Scales per
    matrix ``[n, N, K]``: ``fp8`` fp32 ``[n, ceil(N/128), ceil(K/128)]`` — or one row per
    output row ``[n, N, ceil(K/128)]`` where a fused gate_up tensor split at row I leaves
    128-row blocks straddling gate and up (``kt_ops.pack_fp8_experts`` takes both);
    ``fp8_perchannel`` fp32 ``[n, N]``; ``mxfp8`` uint8 ue8m0 ``[n, N, ceil(K/32)]``.
    """

    kind: str  # "fp8", "fp8_perchannel" or "mxfp8"
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_scale: torch.Tensor
    up_scale: torch.Tensor
    down_scale: torch.Tensor


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
                try:
                    with safe_open(os.fspath(file), framework="pt") as handle:
                        keys = list(handle.keys())
                except Exception as error:  # safetensors' own error types are not ValueErrors
                    raise ValueError(f"{file}: cannot read safetensors header ({error})") from None
                for key in keys:
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

    def _header(self, key: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype name, shape) of a tensor, from its file's header."""
        file = self._file(key)
        try:
            with safe_open(os.fspath(file), framework="pt") as handle:
                view = handle.get_slice(key)
                return view.get_dtype(), tuple(view.get_shape())
        except Exception as error:  # safetensors' own error types are not ValueErrors
            raise ValueError(f"{file}: cannot read tensor {key!r} ({error})") from None

    def _shape(self, key: str) -> tuple[int, ...]:
        return self._header(key)[1]

    def _tensor(self, key: str) -> torch.Tensor:
        file = self._file(key)
        try:
            with safe_open(os.fspath(file), framework="pt") as handle:
                return handle.get_tensor(key)
        except Exception as error:
            raise ValueError(f"{file}: cannot read tensor {key!r} (truncated or corrupt file?) ({error})") from None

    def dtype(self, layer: int) -> torch.dtype:
        """The stored dtype of the layer's gate tensor (e.g. ``torch.float8_e4m3fn``)."""
        key = self.layer(layer).key(0)
        name = self._header(key)[0]
        if name not in _DTYPES:
            raise ValueError(f"tensor {key!r} is {name}; expert weights must be BF16, F16, F32 or F8_E4M3")
        return _DTYPES[name]

    def _scale(self, key: str, shape: tuple[int, ...]) -> tuple[str, str]:
        """(scale key, FP8 kind) of the FP8 weight ``key`` of ``shape`` ([N, K] or fused
        [E, N, K]); ``ValueError`` naming what was looked for or found."""
        stem = key[: -len(".weight")] if key.endswith(".weight") else key
        sep = "." if key.endswith(".weight") else "_"
        candidates = [f"{stem}{sep}weight_scale_inv", f"{stem}{sep}weight_scale"] if sep == "." else \
            [f"{stem}_scale_inv", f"{stem}_scale"]
        found = [c for c in candidates if c in self.key_file]
        if not found:
            raise ValueError(f"{self.path}: FP8 weight {key!r} has no scale tensor (looked for "
                             f"{' and '.join(map(repr, candidates))})")
        scale_key = found[0]
        dtype, scale_shape = self._header(scale_key)
        lead, (n, k) = shape[:-2], shape[-2:]
        blocks = (*lead, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
        channels = ((*lead, n), (*lead, n, 1))
        mx = (*lead, n, -(-k // MX_BLOCK))
        if dtype in _BYTE_SCALES:
            if scale_shape == mx:
                return scale_key, "mxfp8"
            raise ValueError(f"{self.path}: scale {scale_key!r} ({dtype} {list(scale_shape)}) of FP8 weight {key!r} "
                             f"{list(shape)}: ue8m0 exponents must be {list(mx)} (one per {MX_BLOCK} weights along k)")
        if dtype not in _FLOAT_SCALES:
            raise ValueError(f"{self.path}: scale {scale_key!r} of FP8 weight {key!r} is {dtype}; expected a float "
                             f"scale (F32, BF16, F16) or ue8m0 exponents (U8, F8_E8M0)")
        is_block, is_channel = scale_shape == blocks, scale_shape in channels
        if is_block and is_channel:  # a single row: the name decides
            return scale_key, "fp8" if scale_key.endswith("_inv") else "fp8_perchannel"
        if is_block or is_channel:
            return scale_key, "fp8" if is_block else "fp8_perchannel"
        raise ValueError(f"{self.path}: scale {scale_key!r} ({dtype} {list(scale_shape)}) of FP8 weight {key!r} "
                         f"{list(shape)} fits no FP8 kind: expected {list(blocks)} (128 x 128 blocks), "
                         f"{list(channels[0])} or {list(channels[1])} (per channel)")

    def fp8_kind(self, layer: int) -> str | None:
        """``"fp8"``, ``"fp8_perchannel"`` or ``"mxfp8"`` for a layer whose experts are FP8
        (read from the first gate tensor's scale, headers only); None otherwise."""
        key = self.layer(layer).key(0)
        dtype, shape = self._header(key)
        if dtype != "F8_E4M3":
            return None
        return self._scale(key, shape)[1]

    def _read_fp8(self, key: str) -> tuple[torch.Tensor, torch.Tensor, str]:
        """(e4m3 weight, scale as the packer takes it, kind) of an FP8 tensor: float
        scales fp32 (per channel: the trailing 1 dropped), ue8m0 ones uint8."""
        dtype, shape = self._header(key)
        if dtype != "F8_E4M3":
            raise ValueError(f"{self.path}: tensor {key!r} is {dtype}, not F8_E4M3; FP8 methods read e4m3 experts")
        scale_key, kind = self._scale(key, shape)
        weight, scale = self._tensor(key), self._tensor(scale_key)
        if kind == "mxfp8":
            scale = scale.view(torch.uint8)
        else:
            scale = scale.float()
            if kind == "fp8_perchannel":
                scale = scale.reshape(shape[:-1])
        return weight, scale, kind

    def _read(self, key: str) -> torch.Tensor:
        """A tensor; FP8 dequantized to bf16 with its scales (any of the three kinds)."""
        if self._header(key)[0] != "F8_E4M3":
            return self._tensor(key)
        weight, scale, kind = self._read_fp8(key)
        if kind == "fp8":
            return dequantize_block_fp8(weight, scale)
        if kind == "fp8_perchannel":
            return dequantize_fp8_perchannel(weight, scale)
        return dequantize_mxfp8(weight, scale)

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

    def load_fp8_experts(
        self, layer: int, experts: Sequence[int], hidden_size: int, intermediate_size: int
    ) -> Fp8Experts:
        """The listed experts (logical indices, repeats allowed) of an FP8 layer as stored:
        e4m3 bytes and scales, nothing widened (:class:`Fp8Experts`).

        Peak extra memory is the outputs plus one stored tensor. Raises ``KeyError`` for a
        missing layer or expert tensor, ``ValueError`` for a shape that disagrees with
        ``hidden_size`` / ``intermediate_size``, weights that are not F8_E4M3, a missing,
        misshapen or wrongly typed scale, or matrices of different FP8 kinds, naming the
        tensor.
        """
        where = self.layer(layer)
        H, I = hidden_size, intermediate_size
        for e in experts:
            if not 0 <= e < where.num_experts:
                raise KeyError(f"{self.path}: layer {layer} has {where.num_experts} experts; expert {e} is missing "
                               f"(e.g. {where.key(0, e)!r})")
        index = torch.tensor(list(experts), dtype=torch.long)
        kinds: dict[str, str] = {}
        weights: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        if where.convention == "fused":
            fused, fused_scale, kinds[where.key(0)] = self._read_fp8(where.key(0))
            down, down_scale, kinds[where.key(2)] = self._read_fp8(where.key(2))
            _check_shape(where.key(0), fused.shape, (where.num_experts, 2 * I, H))
            _check_shape(where.key(2), down.shape, (where.num_experts, H, I))
            fused = fused.view(torch.uint8).index_select(0, index)
            fused_scale = fused_scale.index_select(0, index)
            kind = kinds[where.key(0)]
            if kind == "fp8" and I % FP8_BLOCK:  # 128-row blocks straddle gate and up: one scale row per row
                fused_scale = fused_scale.repeat_interleave(FP8_BLOCK, dim=1)[:, : 2 * I]
            split = I // FP8_BLOCK if kind == "fp8" and fused_scale.shape[1] != 2 * I else I
            weights = [fused[:, :I].contiguous(), fused[:, I:].contiguous(),
                       down.view(torch.uint8).index_select(0, index)]
            scales = [fused_scale[:, :split].contiguous(), fused_scale[:, split:].contiguous(),
                      down_scale.index_select(0, index)]
        else:
            shapes = ((I, H), (I, H), (H, I))
            for m, shape in enumerate(shapes):
                matrix: torch.Tensor | None = None
                matrix_scale: torch.Tensor | None = None
                for i, e in enumerate(experts):
                    key = where.key(m, e)
                    tensor, scale, kinds[key] = self._read_fp8(key)
                    _check_shape(key, tensor.shape, shape)
                    if matrix is None:
                        matrix = torch.empty((len(experts), *shape), dtype=torch.uint8)
                        matrix_scale = torch.empty((len(experts), *scale.shape), dtype=scale.dtype)
                    matrix[i].copy_(tensor.view(torch.uint8))
                    assert matrix_scale is not None
                    matrix_scale[i].copy_(scale)
                weights.append(matrix if matrix is not None else torch.empty((0, *shape), dtype=torch.uint8))
                scales.append(matrix_scale if matrix_scale is not None else torch.empty((0,)))
        if len(set(kinds.values())) > 1:
            listed = ", ".join(f"{key!r}: {kind}" for key, kind in kinds.items())
            raise ValueError(f"{self.path}: layer {layer} mixes FP8 kinds ({listed}); one kind per layer")
        kind = next(iter(kinds.values()), "fp8")
        e4m3 = [w.view(torch.float8_e4m3fn) for w in weights]
        return Fp8Experts(kind, e4m3[0], e4m3[1], e4m3[2], scales[0], scales[1], scales[2])


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


def dequantize_fp8_perchannel(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-channel FP8 ``weight [..., rows, cols]`` (e4m3) times ``scale [..., rows]`` (or
    ``[..., rows, 1]``), as bf16."""
    return (weight.float() * scale.float().reshape(*weight.shape[:-1], 1)).to(torch.bfloat16)


def dequantize_mxfp8(weight: torch.Tensor, exponents: torch.Tensor, block: int = MX_BLOCK) -> torch.Tensor:
    """MXFP8 ``weight [..., rows, cols]`` (e4m3) times ``2^(e - 127)`` per ``block`` weights
    along cols (``exponents [..., rows, ceil(cols / block)]``, ue8m0), as bf16."""
    cols = weight.shape[-1]
    scale = decode_ue8m0(exponents).repeat_interleave(block, dim=-1)[..., :cols]
    return (weight.float() * scale).to(torch.bfloat16)
