"""``KtOpsConfig(method="native")``: a pre-quantized checkpoint's experts packed as they are stored.

For a checkpoint whose routed experts are FP8 (block, per-channel, MXFP8), INT4
(compressed-tensors ``RAWINT4``, ``GPTQ_INT4``, ``AWQ_INT4``), INT8 (compressed-tensors
W8A8 / W8A16, as ``AMXINT8``) or MXFP4 (gpt-oss, DeepSeek-V4-Flash),
:class:`kt_ops.hf_quantizer.KtOpsHfQuantizer` reads each layer's experts straight from the
safetensors files with kt_ops' own readers (never widened, as :class:`kt_ops.KTMoEWrapper`
reads them) before transformers loads the rest: the experts modules' parameters are
removed first, so transformers neither reads nor holds the experts. Non-expert linear
layers the checkpoint stores quantized (attention and shared experts of FP8 / GPTQ / AWQ /
W8A8 checkpoints) are removed the same way and dequantized into the model's dtype once the
others have loaded (:func:`dequantize_linear`); their names must be the model's own
(``ValueError`` listing the ones that are not).
"""

from __future__ import annotations

import re
import torch
from torch import nn

from kt_ops import hf_experts
from kt_ops.hf_checkpoint import HfCheckpoint, dequantize_fp8
from kt_ops.hf_int4 import check_rawint4_symmetric, int4_method, load_int4_experts, quantization_config
from kt_ops.hf_int8 import INT8_DTYPE, is_int8_layer, is_packed_int8, load_int8_experts, read_int8_linear
from kt_ops.hf_mxfp4 import find_mxfp4_layer, load_mxfp4_experts, pack_mxfp4_parts
from kt_ops.parts import FP8_KIND_METHODS, activate_parts, pack_fp8_parts, pack_int4_parts, pack_int8_parts

# checkpoint tensor names that only a quantized linear layer has
_QUANTIZED_SUFFIXES = ("weight_packed", "qweight", "weight_scale_inv", "weight_scale", "blocks", "scales", "qzeros")
_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")


def layer_of(name: str) -> int:
    """The decoder-layer index in a module name (``model.layers.3.mlp.experts`` -> 3);
    ``ValueError`` when the name has none."""
    layer = hf_experts.layer_index(name)
    if layer is None:
        raise ValueError(f"{name}: cannot tell which decoder layer (layers.N) this experts module belongs to")
    return layer


def native_method(checkpoint: HfCheckpoint, layer: int) -> str:
    """The kt_ops method of a layer's experts as stored: ``MXFP4``, ``RAWINT4`` /
    ``GPTQ_INT4`` / ``AWQ_INT4``, ``AMXINT8`` (int8 levels, W8A8: :mod:`kt_ops.hf_int8`),
    ``FP8`` / ``FP8_PERCHANNEL`` / ``MXFP8``, or ``BF16`` for float experts (bf16, fp16,
    fp32)."""
    if find_mxfp4_layer(checkpoint, layer) is not None:
        return "MXFP4"
    int4 = int4_method(checkpoint, layer)
    if int4 is not None:
        return int4
    if is_int8_layer(checkpoint, layer):
        return "AMXINT8"
    kind = checkpoint.fp8_kind(layer)
    return FP8_KIND_METHODS[kind] if kind is not None else "BF16"


def pack_native_layer(checkpoint: HfCheckpoint, layer: int, module: nn.Module) -> str:
    """Packs experts module ``module`` (decoder layer ``layer``) from the checkpoint as
    stored, with the class's own activation, and installs the blob on it; returns the
    method. The module's expert parameters must still carry their shapes (meta is fine)."""
    down = module.down_proj.shape
    H, I = (int(down[2]), int(down[1])) if module.is_transposed else (int(down[1]), int(down[2]))
    E = int(down[0])
    limit, alpha = hf_experts.activation_of(module, I)
    method = native_method(checkpoint, layer)
    experts = range(E)
    biases = None
    if method == "MXFP4":
        mxfp4 = load_mxfp4_experts(checkpoint, layer, experts, H, I)
        parts, biases = pack_mxfp4_parts(mxfp4, 1), mxfp4.biases
    elif method in ("RAWINT4", "GPTQ_INT4", "AWQ_INT4"):
        parts = pack_int4_parts(load_int4_experts(checkpoint, layer, experts, H, I, method), 1)
    elif method == "AMXINT8":
        parts = pack_int8_parts(load_int8_experts(checkpoint, layer, experts, H, I), 1)
    elif method != "BF16":
        parts = pack_fp8_parts(checkpoint.load_fp8_experts(layer, experts, H, I), 1)
    else:
        from kt_ops.ops import pack_experts

        gate, up, down_w = checkpoint.load_experts(layer, experts, H, I)
        parts = [pack_experts(gate, up, down_w, method="BF16")]
    if getattr(module, "has_bias", False) and biases is None:
        raise ValueError(f"{type(module).__name__} (layer {layer}) has expert biases; the checkpoint's {method} "
                         "experts come without them")
    packed = activate_parts(parts, limit, alpha, biases)[0]
    hf_experts.install_blob(module, packed.data)
    return method


def quantized_linears(model: nn.Module, checkpoint: HfCheckpoint, skip: tuple[str, ...]) -> dict[str, str]:
    """``{module name: kind}`` of the ``nn.Linear`` layers the checkpoint stores quantized
    (``fp8``: e4m3 weight + scale; ``int8``: int8 weight, or 8-bit ``weight_packed``, + row
    scales; ``rawint4`` / ``gptq`` / ``awq``), outside the module names in ``skip``.
    ``ValueError`` listing quantized checkpoint tensors that belong to no linear layer of
    the model (outside ``skip`` and the routed experts)."""
    keys = checkpoint.keys()
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or any(name == s or name.startswith(f"{s}.") for s in skip):
            continue
        if f"{name}.weight_packed" in keys:
            found[name] = "int8" if is_packed_int8(checkpoint, name) else "rawint4"
        elif f"{name}.qweight" in keys:
            shape = tuple(checkpoint.tensor_info(f"{name}.qweight")[1])  # 0-d: gptq, and dequantize_linear names it
            found[name] = "awq" if shape[:1] == (module.in_features,) else "gptq"
        elif f"{name}.weight" in keys and checkpoint.tensor_info(f"{name}.weight")[0] in _FP8_DTYPES:
            found[name] = "fp8"
        elif f"{name}.weight" in keys and checkpoint.tensor_info(f"{name}.weight")[0] == INT8_DTYPE:
            found[name] = "int8"
    stems = {key.rsplit(".", 1)[0] for key in keys if key.rsplit(".", 1)[-1] in _QUANTIZED_SUFFIXES
             or key.endswith(("_blocks", "_scales"))}
    unmatched = sorted(s for s in stems if s not in found and ".experts." not in f".{s}."
                       and not any(s == k or s.startswith(f"{k}.") for k in skip))
    if unmatched:
        raise ValueError(f"{checkpoint.path}: quantized tensors {unmatched[:6]}{' ...' if len(unmatched) > 6 else ''} "
                         "belong to no linear layer of the model transformers built (their names differ from the "
                         "model's); KtOpsConfig(method='native') dequantizes non-expert layers under the model's own "
                         "names only")
    return found


def dequantize_linear(checkpoint: HfCheckpoint, name: str, kind: str, out_features: int,
                      in_features: int) -> torch.Tensor:
    """The fp32 ``[out_features, in_features]`` weight of linear layer ``name`` stored
    quantized as ``kind`` (:func:`quantized_linears`). GPTQ's act-order ``g_idx`` is
    honoured (a dense layer is dequantized whole); ``ValueError`` naming the tensor for a
    tensor that is missing or does not fit (its dtype, shape, or a GPTQ ``g_idx`` out of
    range; a GPTQ layer without ``qzeros`` where config.json says ``sym: false``), and for a
    compressed-tensors layer with zero points other than 0
    (``weight_zero_point``) or an act-order ``weight_g_idx``, which
    :func:`kt_ops.reference.dequantize_rawint4` does not apply."""
    from kt_ops import reference

    N, K = out_features, in_features
    read = checkpoint.read_tensor
    keys = checkpoint.keys()
    if kind == "fp8":
        return checkpoint._read(f"{name}.weight", (N, K)).float()
    if kind == "int8":
        levels, scale = read_int8_linear(checkpoint, name, N, K)
        return levels.float() * scale[:, None]
    groups = _check_linear(checkpoint, name, kind, N, K)
    if kind == "rawint4":
        check_rawint4_symmetric(checkpoint, name, N, K, K // groups)
        weight = reference.dequantize_rawint4(read(f"{name}.weight_packed"), read(f"{name}.weight_scale"))
    elif kind == "gptq":
        config = quantization_config(checkpoint.path)
        offset = 0 if str(config.get("checkpoint_format", "")).lower() == "gptq_v2" else 1
        if f"{name}.qzeros" not in keys and not bool(config.get("sym", True)):  # zero 8 would be read silently
            raise ValueError(f"{checkpoint.path}: tensor '{name}.qzeros' is missing but config.json says sym: false "
                             "(asymmetric GPTQ needs its zero points)")
        weight = reference.dequantize_gptq(read(f"{name}.qweight"), read(f"{name}.scales"),
                                           read(f"{name}.qzeros") if f"{name}.qzeros" in keys else None,
                                           read(f"{name}.g_idx") if f"{name}.g_idx" in keys else None, offset)
    elif kind == "awq":
        weight = reference.dequantize_awq(read(f"{name}.qweight"), read(f"{name}.qzeros"), read(f"{name}.scales"))
    else:
        raise ValueError(f"{name}: unknown quantized kind {kind!r}")
    if tuple(weight.shape) != (N, K):
        raise ValueError(f"{checkpoint.path}: {name}'s {kind} tensors dequantize to {list(weight.shape)}; the model's "
                         f"layer is [{N}, {K}]")
    return weight


def _check_linear(checkpoint: HfCheckpoint, name: str, kind: str, N: int, K: int) -> int:
    """The group count of linear layer ``name`` stored as ``kind`` (``rawint4``, ``gptq``,
    ``awq``) ``[N, K]``, its tensors checked from the headers (a GPTQ ``g_idx`` read too):
    ``ValueError`` naming the tensor, its dtype and shape and the ones expected, where the
    dequantizers would raise IndexError / RuntimeError or read a 0-d ``g_idx`` silently."""
    keys = checkpoint.keys()

    def info(suffix: str) -> tuple[str, str, tuple[int, ...]]:
        key = f"{name}.{suffix}"
        if key not in keys:
            raise ValueError(f"{checkpoint.path}: tensor {key!r} of the {kind} layer {name} is missing")
        return (key, *checkpoint.tensor_info(key))

    def expect(key: str, dtype: str, shape: tuple[int, ...], wanted: list[tuple[str, tuple[int, ...]]]) -> None:
        if (dtype, tuple(shape)) not in wanted:
            listed = " or ".join(f"{d} {list(s)}" for d, s in wanted)
            raise ValueError(f"{checkpoint.path}: tensor {key!r} is {dtype} {list(shape)}; the {kind} layer [{N}, {K}] "
                             f"needs {listed}")

    scale_key, scale_dtype, scale_shape = info("weight_scale" if kind == "rawint4" else "scales")
    count = (scale_shape[-1] if kind == "rawint4" else scale_shape[0]) if len(scale_shape) == 2 else 0
    if count < 1 or K % count or (kind != "rawint4" and N % 8) or K % 8:
        raise ValueError(f"{checkpoint.path}: tensor {scale_key!r} is {scale_dtype} {list(scale_shape)}; the {kind} "
                         f"layer [{N}, {K}] needs scales {'[N, K/gs]' if kind == 'rawint4' else '[K/gs, N]'} with gs "
                         f"dividing K (and K{'' if kind == 'rawint4' else ', N'} a multiple of 8)")
    scale_want = (N, count) if kind == "rawint4" else (count, N)
    expect(scale_key, scale_dtype, scale_shape, [(dtype, scale_want) for dtype in ("F32", "BF16", "F16")])
    if kind == "rawint4":
        expect(*info("weight_packed"), [("I32", (N, K // 8)), ("U8", (N, K // 2))])
        return count
    expect(*info("qweight"), [("I32", (K // 8, N) if kind == "gptq" else (K, N // 8))])
    if kind == "awq" or f"{name}.qzeros" in keys:
        expect(*info("qzeros"), [("I32", (count, N // 8))])
    if kind == "gptq" and f"{name}.g_idx" in keys:
        g_idx = checkpoint.read_tensor(f"{name}.g_idx")
        if tuple(g_idx.shape) != (K,) or g_idx.is_floating_point() or not bool(((g_idx >= 0) & (g_idx < count)).all()):
            raise ValueError(f"{checkpoint.path}: tensor '{name}.g_idx' ({list(g_idx.shape)}) must give each of the "
                             f"{K} inputs a group in [0, {count})")
    return count


def remove_parameters(module: nn.Module, names: tuple[str, ...]) -> None:
    """Takes parameters ``names`` out of ``module``'s state (so a checkpoint load neither
    reads nor expects them), leaving empty plain tensors under the same attribute names."""
    for name in names:
        param = module._parameters.pop(name, None)
        if param is not None:
            setattr(module, name, torch.empty(0, dtype=param.dtype))


def ignore_patterns(experts: list[str], linears: list[str]) -> set[str]:
    """Regexes of the checkpoint keys native loading reads itself (transformers' loader
    then does not report them as unexpected)."""
    return {rf"(^|\.){re.escape(name)}\." for name in experts + linears}
