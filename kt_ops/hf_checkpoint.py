"""Hugging Face safetensors checkpoints: one layer's routed experts at a time.

Four naming conventions are detected per layer (``{base}`` is whatever precedes
``layers.{L}``, e.g. ``model.layers.3``, ``model.language_model.layers.3`` or ``layers.3``):

- ``per_expert`` (Qwen, DeepSeek): ``{base}.mlp.experts.{e}.{gate,up,down}_proj.weight``
- ``w123`` (Mixtral, MiniMax): ``{base}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``
  (w1 = gate, w3 = up, w2 = down)
- ``mistral`` (Mistral's native format, ``consolidated*.safetensors``):
  ``{base}.experts.{e}.{w1,w3,w2}.weight``, usually without the ``model.`` prefix
- ``fused`` (transformers v5, Qwen3.5): ``{base}.mlp.experts.gate_up_proj`` ``[E, 2I, H]``
  (gate rows first) and ``{base}.mlp.experts.down_proj`` ``[E, H, I]``

A multi-token-prediction head's experts (``mtp.layers.{L}...``, Qwen3-Next / Qwen3.5) are not
a decoder layer and are left out.

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
``model.safetensors.index.json``; a file that cannot be read (truncated, corrupt), or a
missing ``*-0000i-of-0000N.safetensors`` shard of a directory without the index, is a
``ValueError`` naming it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import KeysView, Sequence

import torch
from safetensors import safe_open

from kt_ops._validate import names_file_inside, regular_file_stat

FP8_BLOCK = 128  # DeepSeek block-FP8: one scale per 128 x 128 weights
MX_BLOCK = 32  # MXFP8: one exponent per 32 weights along k
FP8_KINDS = ("fp8", "fp8_perchannel", "mxfp8")
_FLOAT_SCALES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_BYTE_SCALES = ("U8", "F8_E8M0")

_PATTERNS = {
    "per_expert": re.compile(r"^(?P<base>.*layers\.(?P<layer>\d+))\.mlp\.experts\.(?P<e>\d+)\.(?P<m>gate_proj|up_proj|down_proj)\.(?P<suffix>weight|weight_packed|qweight)$"),
    "w123": re.compile(r"^(?P<base>.*layers\.(?P<layer>\d+))\.block_sparse_moe\.experts\.(?P<e>\d+)\.(?P<m>w1|w3|w2)\.(?P<suffix>weight|weight_packed|qweight)$"),
    "mistral": re.compile(r"^(?P<base>.*layers\.(?P<layer>\d+))\.experts\.(?P<e>\d+)\.(?P<m>w1|w3|w2)\.(?P<suffix>weight|weight_packed|qweight)$"),
    "fused": re.compile(r"^(?P<base>.*layers\.(?P<layer>\d+))\.mlp\.experts\.(?P<m>gate_up_proj|down_proj)$"),
}
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}
# A multi-token-prediction head's layers (Qwen3-Next/Qwen3.5 ``mtp.layers.0``, ``model.mtp_layers.0``): not
# decoder layers, and numbered from 0 again.
_MTP = re.compile(r"(?:^|\.)mtp[._]")
_SHARD = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.safetensors$")
_NAMES = {"per_expert": ("gate_proj", "up_proj", "down_proj"), "w123": ("w1", "w3", "w2"),
          "mistral": ("w1", "w3", "w2")}
_BLOCKS = {"per_expert": ".mlp", "w123": ".block_sparse_moe", "mistral": ""}  # between base and .experts


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
    convention: str  # "per_expert", "w123", "mistral" or "fused"
    base: str  # key prefix up to and including "layers.{layer}"
    num_experts: int  # experts found (per-expert conventions: highest index + 1)
    suffix: str = "weight"  # per-expert weight name: "weight", INT4 "weight_packed" / "qweight"

    def stem(self, matrix: int, expert: int = 0) -> str:
        """The per-expert module of matrix 0 (gate), 1 (up) or 2 (down), e.g.
        ``model.layers.3.mlp.experts.7.up_proj`` (not for the fused convention)."""
        return f"{self.base}{_BLOCKS[self.convention]}.experts.{expert}.{_NAMES[self.convention][matrix]}"

    def key(self, matrix: int, expert: int = 0) -> str:
        """The tensor key of matrix 0 (gate), 1 (up) or 2 (down); fused: 0/1 -> gate_up_proj."""
        if self.convention == "fused":
            return f"{self.base}.mlp.experts.{'down_proj' if matrix == 2 else 'gate_up_proj'}"
        return f"{self.stem(matrix, expert)}.{self.suffix}"


class HfCheckpoint:
    """The safetensors files of a Hugging Face model directory, indexed by tensor key.

    Only file headers are read when opening (each file's once, then kept);
    :meth:`load_experts` and :meth:`load_fp8_experts` read one layer.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: not a directory of safetensors files")
        index = self.path / "model.safetensors.index.json"
        self.key_file: dict[str, Path] = {}
        self._headers: dict[Path, dict[str, tuple[str, tuple[int, ...]]]] = {}
        if index.is_file():
            weight_map = _read_weight_map(index)
            outside = [name for name in weight_map.values() if not names_file_inside(name)]
            if outside:  # e.g. /dev/stdin or a FIFO: reading it would hang
                raise ValueError(f"{index}: shard {outside[0]!r} is not a file of the checkpoint directory (the index "
                                 "names shards relative to it)")
            self.key_file = {key: self.path / name for key, name in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.path}: no *.safetensors files")
            _check_shards_complete(self.path, files)
            for file in files:
                for key in self._file_headers(file):
                    if key in self.key_file:  # which copy is the model's? without an index nothing says
                        raise ValueError(f"{self.path}: tensor {key!r} is in both {self.key_file[key].name} and "
                                         f"{file.name}, and no model.safetensors.index.json says which to read; "
                                         "remove the stale file (or add the index)")
                    self.key_file[key] = file
        self._layers: dict[int, LayerExperts] | None = None

    def moe_layers(self) -> dict[int, LayerExperts]:
        """Every layer with routed experts, by layer index."""
        if self._layers is None:
            found: dict[tuple[int, str, str, str], int] = {}
            for key in self.key_file:
                for convention, pattern in _PATTERNS.items():
                    match = pattern.match(key)
                    if match and not _MTP.search(match["base"]):
                        groups = match.groupdict()
                        ident = (int(match["layer"]), convention, match["base"], groups.get("suffix") or "weight")
                        expert = int(match["e"]) + 1 if groups.get("e") else 0
                        found[ident] = max(found.get(ident, 0), expert)
            layers: dict[int, LayerExperts] = {}
            for (layer, convention, base, suffix), count in sorted(found.items()):
                if layer in layers:
                    other = layers[layer]
                    raise ValueError(
                        f"{self.path}: layer {layer} has experts under two names ({other.key(0)} "
                        f"[{other.convention}] and {LayerExperts(layer, convention, base, 0, suffix).key(0)} "
                        f"[{convention}]); cannot tell which to load"
                    )
                if convention == "fused":
                    key = LayerExperts(layer, convention, base, 0).key(0)
                    shape = self._shape(key)
                    if len(shape) != 3:  # a 0-dim tensor was IndexError here; others failed later, less clearly
                        raise ValueError(f"{self.path}: {key!r} has shape {list(shape)}; a fused gate_up_proj is "
                                         "[E, 2I, H]")
                    count = shape[0]
                layers[layer] = LayerExperts(layer, convention, base, count, suffix)
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
                f"'*layers.{layer}.block_sparse_moe.experts.{{e}}.w1.weight', "
                f"'*layers.{layer}.experts.{{e}}.w1.weight' and "
                f"'*layers.{layer}.mlp.experts.gate_up_proj'); layers with experts: {have}"
            )
        return layers[layer]

    def keys(self) -> KeysView[str]:
        """Every tensor key of the checkpoint (from the index or the file headers)."""
        return self.key_file.keys()

    def tensor_info(self, key: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype name such as ``"U8"``, shape) of tensor ``key``, from its
        file's header; ``KeyError`` if the checkpoint has no such tensor."""
        return self._header(key)

    def read_tensor(self, key: str) -> torch.Tensor:
        """Tensor ``key`` as stored (nothing converted); ``KeyError`` if absent,
        ``ValueError`` naming the file if it cannot be read."""
        return self._tensor(key)

    def _file(self, key: str) -> Path:
        if key not in self.key_file:
            raise KeyError(f"{self.path}: tensor {key!r} is missing")
        return self.key_file[key]

    def _file_headers(self, file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every tensor of ``file`` as (safetensors dtype name, shape), read once per file."""
        if file not in self._headers:
            _check_regular_file(file)
            entries: dict[str, tuple[str, tuple[int, ...]]] = {}
            try:
                with safe_open(os.fspath(file), framework="pt") as handle:
                    for key in handle.keys():
                        view = handle.get_slice(key)
                        entries[key] = (view.get_dtype(), tuple(view.get_shape()))
            except MemoryError:
                raise
            except Exception as error:  # safetensors' own error types are not ValueErrors
                raise ValueError(f"{file}: cannot read the safetensors header (truncated or corrupt file?): "
                                 f"{error}") from None
            self._headers[file] = entries
        return self._headers[file]

    def _header(self, key: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype name, shape) of a tensor, from its file's header."""
        file = self._file(key)
        headers = self._file_headers(file)
        if key not in headers:
            raise ValueError(f"{file}: the index names tensor {key!r} for this file, which does not hold it")
        return headers[key]

    def _shape(self, key: str) -> tuple[int, ...]:
        return self._header(key)[1]

    def _tensor(self, key: str) -> torch.Tensor:
        """A stored tensor as is; ``ValueError`` naming the file if it cannot be read."""
        file = self._file(key)
        _check_regular_file(file)
        try:
            with safe_open(os.fspath(file), framework="pt") as handle:
                return handle.get_tensor(key)
        except MemoryError:
            raise
        except Exception as error:  # safetensors' own error types are not ValueErrors
            raise ValueError(f"{file}: cannot read tensor {key!r} (truncated or corrupt file?): {error}") from None

    def dtype(self, layer: int) -> torch.dtype:
        """The stored dtype of the layer's expert weights (e.g. ``torch.float8_e4m3fn``);
        ``ValueError`` naming two of them when they differ (one dtype per layer)."""
        where = self._float_layer(layer)
        key = where.key(0)
        name = self._header(key)[0]
        keys = ([where.key(m) for m in range(3)] if where.convention == "fused" else
                [where.key(m, e) for e in range(where.num_experts) for m in range(3)])
        for other in keys:
            other_name = self._header(other)[0] if other in self.key_file else name
            if other_name not in _DTYPES:
                raise ValueError(f"tensor {other!r} is {other_name}; expert weights must be BF16, F16, F32 or F8_E4M3")
            if other_name != name:
                raise ValueError(f"{self.path}: layer {layer} mixes dtypes: {key!r} is {name}, {other!r} is "
                                 f"{other_name}; one dtype per layer (a tensor read into another dtype's matrix "
                                 "would be rounded)")
        return _DTYPES[name]

    def _float_layer(self, layer: int) -> LayerExperts:
        """:meth:`layer`, or ``ValueError`` when its experts are INT4 (``weight_packed`` /
        ``qweight``), which :mod:`kt_ops.hf_int4` reads."""
        where = self.layer(layer)
        if where.suffix != "weight":
            raise ValueError(f"{self.path}: layer {layer} holds INT4 experts ({where.key(0)!r}); read them with "
                             "method RAWINT4, GPTQ_INT4 or AWQ_INT4 (kt_ops.hf_int4)")
        if where.convention == "fused" and where.key(0) + "_bias" in self.key_file:
            raise ValueError(f"{self.path}: layer {layer} stores gpt-oss's experts ({where.key(0)!r} [E, H, 2I] with "
                             "gate and up rows interleaved, expert biases and its clamped alpha-SwiGLU), which this "
                             "reader does not take: convert an MXFP4 gpt-oss checkpoint with --input-type mxfp4, or "
                             "load the model with transformers (experts_implementation=\"kt_ops\" or KtOpsConfig), "
                             "which packs its experts with their activation and biases")
        self.check_no_biases(where)
        return where

    def check_no_biases(self, where: LayerExperts) -> None:
        """``ValueError`` naming the tensor when a per-expert layer's linears carry biases
        (``{stem}.bias``): the readers return weights only, and an expert computed without
        its biases would be silently wrong."""
        if where.convention == "fused":
            return
        for e in range(where.num_experts):
            for m in range(3):
                key = f"{where.stem(m, e)}.bias"
                if key in self.key_file:
                    raise ValueError(f"{self.path}: layer {where.layer}'s experts have biases ({key!r}), which kt_ops' "
                                     "checkpoint readers do not apply; load the model with transformers "
                                     "(experts_implementation=\"kt_ops\" or KtOpsConfig), whose experts class "
                                     "carries them")

    def _scale(self, key: str, shape: tuple[int, ...]) -> tuple[str, str]:
        """(scale key, FP8 kind) of the FP8 weight ``key`` of ``shape`` (``[N, K]``, fused
        ``[E, N, K]``), from the scale's header: ue8m0 bytes ``[N, ceil(K/32)]`` are mxfp8,
        float ``[ceil(N/128), ceil(K/128)]`` fp8, float ``[N]`` / ``[N, 1]`` fp8_perchannel
        (a shape that fits both: ``weight_scale_inv`` is fp8). ``ValueError`` naming the
        weight and the scale keys looked for, or the scale, its dtype and shape and the
        shapes expected."""
        if key.endswith(".weight"):
            stem = key[: -len(".weight")]
            candidates = [f"{stem}.weight_scale_inv", f"{stem}.weight_scale"]
        else:
            candidates = [f"{key}_scale_inv", f"{key}_scale"]
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

        def error(problem: str) -> ValueError:
            return ValueError(
                f"{self.path}: scale {scale_key!r} ({dtype} {list(scale_shape)}) of FP8 weight {key!r} "
                f"{list(shape)}: {problem}; expected fp8: F32/BF16/F16 {list(blocks)} (128 x 128 blocks), "
                f"fp8_perchannel: F32/BF16/F16 {list(channels[0])} or {list(channels[1])}, mxfp8: U8/F8_E8M0 "
                f"{list(mx)} (one ue8m0 exponent per {MX_BLOCK} weights along k)")

        if dtype in _BYTE_SCALES:
            if scale_shape == mx:
                return scale_key, "mxfp8"
            raise error(f"fits no FP8 kind (ue8m0 exponents must be {list(mx)})")
        if dtype not in _FLOAT_SCALES:
            raise error(f"{dtype} is neither a float scale (F32, BF16, F16) nor ue8m0 exponents (U8, F8_E8M0)")
        is_block, is_channel = scale_shape == blocks, scale_shape in channels
        if is_block and is_channel:  # a single row: the name decides
            return scale_key, "fp8" if scale_key.endswith("_inv") else "fp8_perchannel"
        if is_block or is_channel:
            return scale_key, "fp8" if is_block else "fp8_perchannel"
        if scale_shape == mx:
            raise error(f"fits no FP8 kind (the mxfp8 shape, but ue8m0 exponents are U8 or F8_E8M0, not {dtype})")
        raise error("fits no FP8 kind")

    def _fp8_header(self, key: str, want: tuple[int, ...] | None = None,
                    dtypes: tuple[str, ...] = ("F8_E4M3",)) -> tuple[str, str]:
        """(scale key, kind) of an FP8 weight, from headers only: ``ValueError`` if the
        weight is not one of ``dtypes``, is not of shape ``want`` or its scale is wrong."""
        dtype, shape = self._header(key)
        if dtype not in dtypes:
            raise ValueError(f"{self.path}: tensor {key!r} is {dtype}, not {' or '.join(dtypes)}; FP8 expert "
                             f"weights are e4m3 with a scale beside them")
        if want is not None:
            _check_shape(key, shape, want)
        return self._scale(key, shape)

    def fp8_kind(self, layer: int) -> str | None:
        """``"fp8"``, ``"fp8_perchannel"`` or ``"mxfp8"`` for a layer whose experts are FP8
        (read from the first gate tensor's scale, headers only); None otherwise. A missing,
        misshapen or wrongly typed scale is a ``ValueError``."""
        key = self.layer(layer).key(0)
        if self._header(key)[0] != "F8_E4M3":
            return None
        return self._fp8_header(key)[1]

    def _read_fp8(self, key: str, want: tuple[int, ...] | None = None,
                  dtypes: tuple[str, ...] = ("F8_E4M3",)) -> tuple[torch.Tensor, torch.Tensor, str]:
        """(weight as stored, scale as :class:`Fp8Experts` holds it, kind) of an FP8 tensor
        of shape ``want`` (checked before reading): float scales fp32 (per channel: the
        trailing 1 dropped), ue8m0 exponents uint8."""
        scale_key, kind = self._fp8_header(key, want, dtypes)
        shape = self._header(key)[1]
        weight, scale = self._tensor(key), self._tensor(scale_key)
        if kind == "mxfp8":
            scale = scale.view(torch.uint8)
        else:
            scale = scale.float()
            if kind == "fp8_perchannel":
                scale = scale.reshape(shape[:-1])
        return weight, scale, kind

    def _read_stored(self, key: str, want: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None, str | None]:
        """(tensor, scale, kind) of a weight of shape ``want`` (checked from the header):
        FP8 (e4m3; e5m2 too, as block FP8 has always been read) with its scale and kind,
        anything else with None, None."""
        dtype, shape = self._header(key)
        if dtype not in ("F8_E4M3", "F8_E5M2"):
            if dtype not in _DTYPES:  # e.g. an integer tensor: copied into the float matrix, it would be wrong weights
                raise ValueError(f"{self.path}: tensor {key!r} is {dtype}; expert weights must be BF16, F16, F32 "
                                 "or F8_E4M3")
            _check_shape(key, shape, want)
            return self._tensor(key), None, None
        return self._read_fp8(key, want, ("F8_E4M3", "F8_E5M2"))

    def _read(self, key: str, want: tuple[int, ...]) -> torch.Tensor:
        """A weight of shape ``want``; FP8 of any kind dequantized to bf16 with its scale."""
        tensor, scale, kind = self._read_stored(key, want)
        return tensor if kind is None else dequantize_fp8(tensor, scale, kind)

    def _check_experts(self, where: LayerExperts, experts: Sequence[int]) -> None:
        for e in experts:
            if not 0 <= e < where.num_experts:
                raise KeyError(f"{self.path}: layer {where.layer} has {where.num_experts} experts; expert {e} is "
                               f"missing (e.g. {where.key(0, e)!r})")

    def load_experts(
        self, layer: int, experts: Sequence[int], hidden_size: int, intermediate_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``gate [n, I, H]``, ``up [n, I, H]``, ``down [n, H, I]`` of the listed experts
        (logical indices, repeats allowed) in their stored dtype; FP8 of any kind (fp8,
        fp8_perchannel, mxfp8) is dequantized to bf16 (NaN codes stay NaN).

        Peak extra memory is the three outputs plus one stored tensor (and one expert's
        fp32 temporaries when dequantizing). Raises ``KeyError`` for a missing layer or
        expert tensor and ``ValueError`` for a shape that disagrees with ``hidden_size`` /
        ``intermediate_size``, a bad FP8 scale, an unreadable file or experts of different
        dtypes in one layer (e.g. one F32 tensor among BF16 ones, or FP8 beside BF16:
        :meth:`dtype`) or expert biases (:meth:`check_no_biases`), naming the key.
        """
        where = self._float_layer(layer)
        self._check_experts(where, experts)
        self.dtype(layer)  # one dtype per layer, from the headers: a tensor copied into another's would round
        H, I, n = hidden_size, intermediate_size, len(experts)
        if where.convention == "fused":
            stored, scale, kind = self._read_stored(where.key(0), (where.num_experts, 2 * I, H))
            dtype = stored.dtype if kind is None else torch.bfloat16
            gate, up = torch.empty((n, I, H), dtype=dtype), torch.empty((n, I, H), dtype=dtype)
            for i, e in enumerate(experts):  # blocks of the fused rows: dequantize before splitting
                w = stored[e] if kind is None else dequantize_fp8(stored[e], scale[e], kind)
                gate[i].copy_(w[:I])
                up[i].copy_(w[I:])
            del stored, scale
            stored, scale, kind = self._read_stored(where.key(2), (where.num_experts, H, I))
            down = torch.empty((n, H, I), dtype=stored.dtype if kind is None else torch.bfloat16)
            for i, e in enumerate(experts):
                down[i].copy_(stored[e] if kind is None else dequantize_fp8(stored[e], scale[e], kind))
            return gate, up, down
        out: list[torch.Tensor] = []
        for m, shape in enumerate(((I, H), (I, H), (H, I))):
            matrix: torch.Tensor | None = None
            for i, e in enumerate(experts):
                tensor = self._read(where.key(m, e), shape)
                if matrix is None:
                    matrix = torch.empty((n, *shape), dtype=tensor.dtype)
                matrix[i].copy_(tensor)
            out.append(matrix if matrix is not None else torch.empty((0, *shape)))
        return out[0], out[1], out[2]

    def load_fp8_experts(
        self, layer: int, experts: Sequence[int], hidden_size: int, intermediate_size: int
    ) -> Fp8Experts:
        """The listed experts (logical indices, repeats allowed) of an FP8 layer as stored:
        e4m3 bytes and scales, nothing widened (:class:`Fp8Experts` has the shapes).

        Peak extra memory is the outputs plus one stored tensor. Raises ``KeyError`` for a
        missing layer or expert tensor; ``ValueError`` naming the tensor for a shape that
        disagrees with ``hidden_size`` / ``intermediate_size``, weights that are not
        F8_E4M3, a missing, misshapen or wrongly typed scale, matrices of different FP8
        kinds (the loaded ones and the layer's first gate, which :meth:`fp8_kind` reads),
        expert biases (:meth:`check_no_biases`) or an unreadable file.
        """
        where = self.layer(layer)
        self._check_experts(where, experts)
        self.check_no_biases(where)
        H, I, n = hidden_size, intermediate_size, len(experts)
        index = torch.tensor(list(experts), dtype=torch.long)
        first = where.key(0, 0)
        kinds: dict[str, str] = {}
        if first in self.key_file:
            want = (where.num_experts, 2 * I, H) if where.convention == "fused" else (I, H)
            kinds[first] = self._fp8_header(first, want)[1]
        weights: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        if where.convention == "fused":
            key = where.key(0)
            stored, scale, kinds[key] = self._read_fp8(key, (where.num_experts, 2 * I, H))
            codes = stored.view(torch.uint8)
            weights = [codes.narrow(1, 0, I).index_select(0, index), codes.narrow(1, I, I).index_select(0, index)]
            scale = scale.index_select(0, index)
            split = I
            if kinds[key] == "fp8":
                if I % FP8_BLOCK:  # 128-row blocks straddle gate and up: one scale row per weight row
                    scale = scale.repeat_interleave(FP8_BLOCK, dim=1)[:, : 2 * I]
                else:
                    split = I // FP8_BLOCK
            scales = [scale[:, :split].contiguous(), scale[:, split:].contiguous()]
            del stored, codes, scale
            key = where.key(2)
            stored, scale, kinds[key] = self._read_fp8(key, (where.num_experts, H, I))
            weights.append(stored.view(torch.uint8).index_select(0, index))
            scales.append(scale.index_select(0, index))
            del stored
        else:
            for m, shape in enumerate(((I, H), (I, H), (H, I))):
                matrix = torch.empty((n, *shape), dtype=torch.uint8)
                matrix_scale: torch.Tensor | None = None
                for i, e in enumerate(experts):
                    key = where.key(m, e)
                    tensor, scale, kinds[key] = self._read_fp8(key, shape)
                    matrix[i].copy_(tensor.view(torch.uint8))
                    if matrix_scale is None:
                        matrix_scale = torch.empty((n, *scale.shape), dtype=scale.dtype)
                    matrix_scale[i].copy_(scale)
                weights.append(matrix)
                if matrix_scale is None:  # no experts listed: the first gate's kind
                    matrix_scale = _empty_scale(next(iter(kinds.values()), "fp8"), *shape)
                scales.append(matrix_scale)
        if len(set(kinds.values())) > 1:
            listed = ", ".join(f"{key!r}: {kind}" for key, kind in kinds.items())
            raise ValueError(f"{self.path}: layer {layer} mixes FP8 kinds ({listed}); one kind per layer")
        if not kinds:
            raise KeyError(f"{self.path}: tensor {first!r} is missing")
        kind = next(iter(kinds.values()))
        e4m3 = [w.view(torch.float8_e4m3fn) for w in weights]
        return Fp8Experts(kind, e4m3[0], e4m3[1], e4m3[2], scales[0], scales[1], scales[2])


def _check_shards_complete(path: Path, files: list[Path]) -> None:
    """``ValueError`` naming the missing files when ``files`` (a directory without an index)
    hold shards ``{stem}-0000i-of-0000N.safetensors`` of which some are absent: the
    tensors of a missing shard (whole layers) would otherwise just not be there."""
    present: dict[tuple[str, int], set[int]] = {}
    for file in files:
        match = _SHARD.match(file.name)
        if match:
            present.setdefault((match["stem"], int(match["count"])), set()).add(int(match["index"]))
    for (stem, count), indices in sorted(present.items()):
        missing = sorted(set(range(1, count + 1)) - indices)
        if missing:
            names = ", ".join(f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in missing[:3])
            names += f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ValueError(f"{path}: sharded checkpoint is incomplete: missing {names} (and there is no "
                             "model.safetensors.index.json); download the missing shards")


def _check_regular_file(file: Path) -> None:
    """``ValueError`` naming ``file`` unless it is a regular file (after symlinks): opening
    a FIFO or a device to read a safetensors header blocks or never ends."""
    try:
        regular_file_stat(file, "; a checkpoint's shards are files")
    except OSError as error:
        raise ValueError(f"{file}: cannot read the safetensors file ({error.strerror or error})") from None


def read_config_json(folder: str | os.PathLike[str]) -> dict:
    """``folder/config.json`` as a dict (``{}`` where there is none); ``ValueError`` naming
    the file when it is not a JSON object or not a regular file (a FIFO or device there
    was read as no config at all)."""
    file = Path(folder) / "config.json"
    if not file.exists():
        return {}
    regular_file_stat(file)
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{file}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: not a model config (expected a JSON object, got {type(config).__name__})")
    return config


def with_text_config(config: dict) -> dict:
    """``config`` with the keys of its ``text_config`` (a multimodal model's language model:
    Qwen3-VL, Qwen3.5) where the top level has none of its own."""
    text = config.get("text_config")
    return {**text, **config} if isinstance(text, dict) else config


def whole_number(value: object) -> int | None:
    """A config.json value as an int: an int, a whole float (``128.0``) or a numeric string;
    None for anything else (``1.5``, ``true``, ``"x"``, ``{}``, NaN)."""
    if isinstance(value, bool):
        return None
    try:
        count = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return None
    return None if isinstance(value, float) and count != value else count


def config_layer_count(config: dict, folder: str | os.PathLike[str]) -> int | None:
    """``num_hidden_layers`` of ``folder``'s config.json (already read: ``config``) as a count;
    None where it is absent or null. ``ValueError`` naming the file and the key for a value
    that is no whole non-negative number (``-3``, ``1.5``, ``true``, ``"x"``, ``{}``)."""
    value = config.get("num_hidden_layers")
    if value is None:
        return None
    count = whole_number(value)
    if count is None or count < 0:
        raise ValueError(f"{Path(folder) / 'config.json'}: num_hidden_layers {value!r} is not a layer count")
    return count


def _read_weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor key -> shard file name) of ``model.safetensors.index.json``;
    ``ValueError`` naming the file when it is not JSON or has no such mapping."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError) as error:  # JSONDecodeError, or JSON that is not an object
        raise ValueError(f"{index}: not a safetensors index (expected a JSON object with a \"weight_map\"): "
                         f"{error}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: not a safetensors index (\"weight_map\" must map tensor keys to shard file "
                         f"names, got {type(weight_map).__name__})")
    return weight_map


def _check_shape(key: str, got: torch.Size | tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != want:
        raise ValueError(f"tensor {key!r} has shape {tuple(got)}, expected {want} from the layer's sizes")


def _empty_scale(kind: str, n: int, k: int) -> torch.Tensor:
    """The scales of no experts for a ``[n, k]`` matrix of ``kind`` (shape ``[0, ...]``)."""
    if kind == "mxfp8":
        return torch.empty((0, n, -(-k // MX_BLOCK)), dtype=torch.uint8)
    if kind == "fp8_perchannel":
        return torch.empty((0, n))
    return torch.empty((0, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)))


def decode_ue8m0(codes: torch.Tensor) -> torch.Tensor:
    """OCP MX scale exponents ``codes`` (uint8 or ``torch.float8_e8m0fnu``, any shape) as
    fp32 ``2^(e - 127)`` of the same shape, built exactly from the bits: code 0 is
    ``2^-127`` (an fp32 subnormal), code 255 is NaN."""
    if codes.dtype != torch.uint8 and codes.dtype != getattr(torch, "float8_e8m0fnu", torch.uint8):
        raise ValueError(f"ue8m0 exponents must be uint8 or float8_e8m0fnu, not {codes.dtype}")
    e = codes.view(torch.uint8).to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)  # 2^(e-127): exponent field e
    bits = torch.where(e == 255, torch.full_like(e, 0x7FC00000), bits)
    return bits.view(torch.float32)


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """DeepSeek block-FP8 ``weight [..., rows, cols]`` (e4m3) times its ``scale_inv
    [..., ceil(rows / block), ceil(cols / block)]`` (float), as bf16 (computed in fp32)."""
    rows, cols = weight.shape[-2:]
    expected = (-(-rows // block), -(-cols // block))
    if tuple(scale_inv.shape[-2:]) != expected:
        raise ValueError(f"FP8 scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(weight.shape)} "
                         f"in {block}x{block} blocks (expected {expected})")
    scale = scale_inv.float().repeat_interleave(block, dim=-2)[..., :rows, :].repeat_interleave(block, dim=-1)[..., :cols]
    return (weight.float() * scale).to(torch.bfloat16)


def dequantize_fp8_perchannel(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-channel FP8 ``weight [..., rows, cols]`` (e4m3) times ``scale [..., rows]`` or
    ``[..., rows, 1]`` (float) on every row, as bf16 (computed in fp32)."""
    rows = weight.shape[:-1]
    if tuple(scale.shape) not in (tuple(rows), (*rows, 1)):
        raise ValueError(f"per-channel FP8 scale shape {tuple(scale.shape)} does not match weight "
                         f"{tuple(weight.shape)} (expected {tuple(rows)} or {(*rows, 1)})")
    return (weight.float() * scale.float().reshape(*rows, 1)).to(torch.bfloat16)


def dequantize_mxfp8(weight: torch.Tensor, exponents: torch.Tensor, block: int = MX_BLOCK) -> torch.Tensor:
    """MXFP8 ``weight [..., rows, cols]`` (e4m3) times ``2^(e - 127)`` per ``block`` weights
    along cols (``exponents [..., rows, ceil(cols / block)]``, uint8 or float8_e8m0fnu;
    code 255 gives NaN), as bf16 (computed in fp32)."""
    cols = weight.shape[-1]
    expected = (*weight.shape[:-1], -(-cols // block))
    if tuple(exponents.shape) != expected:
        raise ValueError(f"MXFP8 exponent shape {tuple(exponents.shape)} does not match weight {tuple(weight.shape)} "
                         f"(expected {expected}: one per {block} weights along cols)")
    scale = decode_ue8m0(exponents).repeat_interleave(block, dim=-1)[..., :cols]
    return (weight.float() * scale).to(torch.bfloat16)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """``weight`` (e4m3) and its ``scale`` of FP8 ``kind`` (``"fp8"``, ``"fp8_perchannel"``
    or ``"mxfp8"``, shapes as in :class:`Fp8Experts` without the expert dimension or with
    it) as bf16."""
    if kind == "fp8":
        return dequantize_block_fp8(weight, scale)
    if kind == "fp8_perchannel":
        return dequantize_fp8_perchannel(weight, scale)
    if kind == "mxfp8":
        return dequantize_mxfp8(weight, scale)
    raise ValueError(f"unknown FP8 kind {kind!r}; expected one of {FP8_KINDS}")
