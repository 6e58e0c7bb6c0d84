"""MXFP4 expert checkpoints in Hugging Face safetensors, read into format ``mxfp4``.

Two layouts are recognised per layer (``{base}`` is whatever precedes and includes
``layers.{L}``), each with e2m1 codes two per byte (byte ``i`` of a 32-weight group:
weight ``2i`` in the low nibble, ``2i + 1`` in the high one; codes 0-7 = 0, 0.5, 1, 1.5,
2, 3, 4, 6, codes 8-15 their negatives) and one E8M0 exponent ``e`` per 32 weights along
k (``w = e2m1 * 2^(e - 127)``):

- ``gpt_oss`` (transformers' gpt-oss): ``{base}.mlp.experts.gate_up_proj_blocks`` uint8
  ``[E, 2I, H/32, 16]`` + ``gate_up_proj_scales`` uint8 ``[E, 2I, H/32]``, gate and up
  rows interleaved (even rows gate, odd rows up), ``gate_up_proj_bias`` ``[E, 2I]``
  interleaved the same way; ``down_proj_blocks`` ``[E, H, I/32, 16]`` +
  ``down_proj_scales`` ``[E, H, I/32]``, ``down_proj_bias`` ``[E, H]`` (biases optional);
- ``deepseek_v4`` (DeepSeek-V4-Flash): ``{base}.ffn.experts.{e}.{w1,w3,w2}.weight``
  (gate, up, down) int8/uint8 ``[N, K/2]`` + ``.scale`` float8_e8m0fnu/uint8 ``[N, K/32]``.

The codes are first re-ordered into GGUF's MXFP4 blocks (ggml type 39: the exponent byte,
then byte ``j`` = weight ``j`` | weight ``j + 16`` << 4; ``csrc/cpu/formats/mxfp4_block.h``),
then laid out as format ``mxfp4`` (``csrc/cpu/formats/int_layout.h``: the codes in the INT4
kernels' lines, each exponent as its bf16 power of two): nothing is widened to float, the
packed layer holds 18 bytes per 32 weights against the checkpoint's 17 (1.06x). gpt-oss layers also carry the
model's activation: alpha-SwiGLU with ``swiglu_alpha`` 1.702 and ``swiglu_limit`` 7
(``config.json``'s values where it has them; transformers' ``GptOssExperts`` clamps the
gate from above only, as kt_ops does).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

import torch

from kt_ops._native import _C
from kt_ops.gguf_loader import GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT
from kt_ops.hf_checkpoint import HfCheckpoint, read_config_json
from kt_ops.ops import Biases
from kt_ops.packed import PackedExperts
from kt_ops.parts import part_bounds

MXFP4_GROUP = 32  # weights per exponent along k

_GPT_OSS = re.compile(r"^(?P<base>.*layers\.(?P<layer>\d+))\.mlp\.experts\.gate_up_proj_blocks$")
_DEEPSEEK_V4 = re.compile(r"^(?P<base>.*layers\.(?P<layer>\d+))\.ffn\.experts\.(?P<e>\d+)\.w1\.weight$")
_V4_NAMES = ("w1", "w3", "w2")
_CODE_DTYPES = ("U8", "I8")
_EXPONENT_DTYPES = ("U8", "F8_E8M0")


DEEPSEEK_V4_SWIGLU_LIMIT = 10.0  # transformers' DeepseekV4Config default

@dataclass(frozen=True)
class Mxfp4Layer:
    """Where one layer's MXFP4 experts are: layout kind, key prefix and expert count."""

    kind: str  # "gpt_oss" or "deepseek_v4"
    base: str  # key prefix up to and including "layers.{layer}"
    num_experts: int


@dataclass(frozen=True)
class Mxfp4Experts:
    """One layer's experts as GGUF MXFP4 rows (ggml type 39), ``n`` experts.

    ``gate``, ``up``: uint8 ``[n, I, H / 32 * 17]``; ``down``: uint8 ``[n, H, I / 32 * 17]``;
    ``biases``: fp32 ``(gate [n, I], up [n, I], down [n, H])`` (entries None where the
    checkpoint has none; DeepSeek-V4: all None); ``swiglu_limit``, ``swiglu_alpha``: the
    layout's activation (gpt-oss: 7 and 1.702; DeepSeek-V4: its clamp, 10, and 0; both from
    config.json where it has them). ``kind``: ``"gpt_oss"``, ``"deepseek_v4"`` or ``"gguf"``
    (:func:`gguf_mxfp4_experts`).
    """

    kind: str
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    biases: Biases
    swiglu_limit: float
    swiglu_alpha: float


def repack_to_gguf(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """Hugging Face MXFP4 groups -> GGUF MXFP4 blocks (bytes only, no float values).

    Args:
        codes: uint8 ``[..., G, 16]``: 16 bytes per group of 32 weights, byte ``i`` =
            weight ``2i`` (low nibble) | weight ``2i + 1`` << 4.
        exponents: uint8 ``[..., G]``: the groups' E8M0 exponents.

    Returns:
        uint8 ``[..., G * 17]``: per group the exponent, then byte ``j`` = weight ``j`` |
        weight ``j + 16`` << 4.
    """
    low, high = codes & 15, codes >> 4
    ordered = torch.stack((low, high), dim=-1).reshape(*codes.shape[:-1], 32)  # weight order
    packed = ordered[..., :16] | (ordered[..., 16:] << 4)
    return torch.cat((exponents.unsqueeze(-1), packed), dim=-1).reshape(*codes.shape[:-2], -1)


def find_mxfp4_layer(checkpoint: HfCheckpoint, layer: int) -> Mxfp4Layer | None:
    """The MXFP4 experts of ``layer`` in either layout, or None if the checkpoint has none there;
    ``ValueError`` naming the tensor when gpt-oss's ``gate_up_proj_blocks`` is not 4-D."""
    v4_experts: dict[str, int] = {}
    for key in checkpoint.keys():
        match = _GPT_OSS.match(key)
        if match and int(match["layer"]) == layer:
            shape = checkpoint.tensor_info(key)[1]
            if len(shape) != 4:  # a 0-d one was IndexError here
                raise ValueError(f"{checkpoint.path}: {key!r} has shape {list(shape)}; gpt-oss's gate/up codes are "
                                 "[E, 2I, H/32, 16]")
            return Mxfp4Layer("gpt_oss", match["base"], shape[0])
        match = _DEEPSEEK_V4.match(key)
        if match and int(match["layer"]) == layer:
            v4_experts[match["base"]] = max(v4_experts.get(match["base"], 0), int(match["e"]) + 1)
    if len(v4_experts) > 1:
        raise ValueError(f"{checkpoint.path}: layer {layer} has MXFP4 experts under several names "
                         f"({', '.join(sorted(v4_experts))}); cannot tell which to load")
    for base, count in v4_experts.items():
        return Mxfp4Layer("deepseek_v4", base, count)
    return None


def mxfp4_layers(checkpoint: HfCheckpoint) -> list[int]:
    """The layers with MXFP4 experts in either layout, ascending."""
    found = set()
    for key in checkpoint.keys():
        match = _GPT_OSS.match(key) or _DEEPSEEK_V4.match(key)
        if match:
            found.add(int(match["layer"]))
    return sorted(found)


def _read(checkpoint: HfCheckpoint, key: str, dtypes: tuple[str, ...], shape: tuple[int, ...], what: str) -> torch.Tensor:
    """Tensor ``key`` as uint8 (int8 / e8m0 bytes viewed), checked against ``dtypes`` and
    ``shape``; ``ValueError`` naming the tensor otherwise."""
    if key not in checkpoint.keys():
        raise ValueError(f"{checkpoint.path}: tensor {key!r} ({what}) is missing")
    dtype, stored = checkpoint.tensor_info(key)
    if dtype not in dtypes:
        raise ValueError(f"{checkpoint.path}: tensor {key!r} ({what}) is {dtype}; MXFP4 needs {' or '.join(dtypes)}")
    if tuple(stored) != shape:
        raise ValueError(f"{checkpoint.path}: tensor {key!r} ({what}) has shape {list(stored)}; "
                         f"expected {list(shape)}")
    return checkpoint.read_tensor(key).view(torch.uint8)


def _bias(checkpoint: HfCheckpoint, key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    if key not in checkpoint.keys():
        return None
    dtype, stored = checkpoint.tensor_info(key)
    if tuple(stored) != shape:
        raise ValueError(f"{checkpoint.path}: tensor {key!r} (expert bias) has shape {list(stored)}; "
                         f"expected {list(shape)}")
    bias = checkpoint.read_tensor(key)
    if not bias.is_floating_point():
        raise ValueError(f"{checkpoint.path}: tensor {key!r} (expert bias) is {dtype}; expected a float type")
    return bias.float()


def _config_number(checkpoint: HfCheckpoint, config: dict, key: str, default: float) -> float:
    """config.json's ``key`` as a float (``default`` where absent or null); ``ValueError``
    naming the file and the key when it is not a number."""
    value = config.get(key)
    if value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{checkpoint.path / 'config.json'}: {key} {value!r} is not a number") from None


def _gpt_oss_activation(checkpoint: HfCheckpoint) -> tuple[float, float]:
    """(swiglu_limit, swiglu_alpha) from config.json (gpt-oss's 7 and 1.702 where absent)."""
    config = read_config_json(checkpoint.path)
    return (_config_number(checkpoint, config, "swiglu_limit", GPT_OSS_SWIGLU_LIMIT),
            _config_number(checkpoint, config, "swiglu_alpha", GPT_OSS_SWIGLU_ALPHA))


def _deepseek_v4_limit(checkpoint: HfCheckpoint) -> float:
    """DeepSeek-V4's clamped SwiGLU limit: config.json's ``swiglu_limit`` (10, transformers'
    DeepseekV4Config default, where absent)."""
    config = read_config_json(checkpoint.path)
    return _config_number(checkpoint, config, "swiglu_limit", DEEPSEEK_V4_SWIGLU_LIMIT)


def load_mxfp4_experts(checkpoint: HfCheckpoint, layer: int, experts: Sequence[int], hidden: int,
                       intermediate: int) -> Mxfp4Experts:
    """Experts ``experts`` (in that order) of ``layer`` as GGUF MXFP4 rows.

    Raises:
        ValueError: no MXFP4 experts in the layer, H or I not a multiple of 32, a missing
            weight or scale tensor, a wrong dtype or shape (each naming the tensor), an
            expert index outside the layer.
    """
    where = find_mxfp4_layer(checkpoint, layer)
    if where is None:
        raise ValueError(f"{checkpoint.path}: layer {layer} has no MXFP4 experts (looked for "
                         f"'*layers.{layer}.mlp.experts.gate_up_proj_blocks' and "
                         f"'*layers.{layer}.ffn.experts.{{e}}.w1.weight')")
    for name, size in (("hidden_size", hidden), ("moe_intermediate_size", intermediate)):
        if size % MXFP4_GROUP:
            raise ValueError(f"MXFP4 needs {name} to be a multiple of {MXFP4_GROUP}, got {size}")
    bad = [e for e in experts if not 0 <= e < where.num_experts]
    if bad:
        raise ValueError(f"{checkpoint.path}: layer {layer} has {where.num_experts} experts; asked for {bad}")
    H, I, index = hidden, intermediate, torch.tensor(list(experts), dtype=torch.long)
    if where.kind == "gpt_oss":
        E, prefix = where.num_experts, f"{where.base}.mlp.experts"
        gate_up = repack_to_gguf(
            _read(checkpoint, f"{prefix}.gate_up_proj_blocks", ("U8",), (E, 2 * I, H // 32, 16), "gate/up codes")[index],
            _read(checkpoint, f"{prefix}.gate_up_proj_scales", ("U8",), (E, 2 * I, H // 32), "gate/up scales")[index])
        down = repack_to_gguf(
            _read(checkpoint, f"{prefix}.down_proj_blocks", ("U8",), (E, H, I // 32, 16), "down codes")[index],
            _read(checkpoint, f"{prefix}.down_proj_scales", ("U8",), (E, H, I // 32), "down scales")[index])
        gate_up_bias = _bias(checkpoint, f"{prefix}.gate_up_proj_bias", (E, 2 * I))
        down_bias = _bias(checkpoint, f"{prefix}.down_proj_bias", (E, H))
        biases = (None if gate_up_bias is None else gate_up_bias[index, 0::2].contiguous(),
                  None if gate_up_bias is None else gate_up_bias[index, 1::2].contiguous(),
                  None if down_bias is None else down_bias[index])
        limit, alpha = _gpt_oss_activation(checkpoint)
        return Mxfp4Experts("gpt_oss", gate_up[:, 0::2].contiguous(), gate_up[:, 1::2].contiguous(), down,
                            biases, limit, alpha)
    matrices = []
    for m, (name, (n, k)) in enumerate(zip(_V4_NAMES, ((I, H), (I, H), (H, I)))):
        rows = []
        for e in experts:
            key = f"{where.base}.ffn.experts.{e}.{name}"
            codes = _read(checkpoint, f"{key}.weight", _CODE_DTYPES, (n, k // 2), "codes")
            scale = _read(checkpoint, f"{key}.scale", _EXPONENT_DTYPES, (n, k // 32), "scales")
            rows.append(repack_to_gguf(codes.reshape(n, k // 32, 16), scale))
        width = k // 32 * 17
        matrices.append(torch.stack(rows) if rows else torch.empty(0, n, width, dtype=torch.uint8))
    return Mxfp4Experts("deepseek_v4", *matrices, (None, None, None), _deepseek_v4_limit(checkpoint), 0.0)


def gguf_mxfp4_experts(packed: PackedExperts, biases: Biases, swiglu_limit: float,
                       swiglu_alpha: float) -> Mxfp4Experts:
    """A GGUF layer (format gguf, e.g. :func:`kt_ops.load_gguf_experts`'s) whose three
    matrices are MXFP4 as :class:`Mxfp4Experts` views of its blocks (no copy), so
    :func:`pack_mxfp4_parts` can lay them out as format mxfp4. ``ValueError`` naming the
    types for any other layer."""
    info = _C.packed_info(packed.data)
    types = list(info.get("gguf_types") or [])
    if info["format"] != "gguf" or types != ["MXFP4"] * 3:
        held = f"gguf ({'/'.join(types)})" if info["format"] == "gguf" else info["format"]
        raise ValueError(f"method 'MXFP4' reads GGUF layers whose experts are all MXFP4; this one is {held} "
                         "(use method='LLAMAFILE')")
    E, H, I = info["num_experts"], info["hidden_size"], info["intermediate_size"]
    shapes = ((E, I, H // 32 * 17), (E, I, H // 32 * 17), (E, H, I // 32 * 17))
    gate, up, down = (packed.data[o : o + math.prod(s)].view(s) for o, s in zip(info["matrix_offsets"], shapes))
    return Mxfp4Experts("gguf", gate, up, down, biases, swiglu_limit, swiglu_alpha)


def pack_mxfp4_parts(experts: Mxfp4Experts, parts: int) -> list[PackedExperts]:
    """GGUF MXFP4 rows (:func:`load_mxfp4_experts`) as ``parts`` packed layers of format
    ``mxfp4``, parts of the intermediate dimension (:func:`kt_ops.parts.part_bounds`; each part's I a multiple of
    32, ``ValueError`` otherwise). Activation and biases are left to the caller
    (:func:`kt_ops.parts.activate_parts`)."""
    n, I = int(experts.gate.shape[0]), int(experts.gate.shape[1])
    H = int(experts.down.shape[1])
    out = []
    for a, b in part_bounds(I, parts):
        if a % MXFP4_GROUP or b % MXFP4_GROUP:
            raise ValueError(f"threadpool_count {parts} splits moe_intermediate_size {I} at {a}..{b}; MXFP4 needs "
                             f"each part's bounds to be multiples of {MXFP4_GROUP}")
        down = experts.down[:, :, a // 32 * 17 : b // 32 * 17]
        blob = _C.mxfp4_experts_from_blocks(experts.gate[:, a:b].contiguous(), experts.up[:, a:b].contiguous(),
                                            down.contiguous(), n, H, b - a)
        out.append(PackedExperts(blob))
    return out
