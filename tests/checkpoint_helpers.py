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
        if convention == "mistral":  # Mistral's native naming: no model. prefix, no block name
            prefix, names = f"layers.{L}", ("w1", "w3", "w2")
        else:
            block, names = (("mlp", ("gate_proj", "up_proj", "down_proj")) if convention == "per_expert"
                            else ("block_sparse_moe", ("w1", "w3", "w2")))
            prefix = f"model.layers.{L}.{block}"
        for e in range(E):
            for name, w in zip(names, (gate[e], up[e], down[e])):
                put(f"{prefix}.experts.{e}.{name}.weight", w)
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
    if convention == "mistral":  # params.json, as Mistral's native checkpoints carry instead of config.json
        params = {"dim": H, "n_layers": layers, "moe": {"num_experts": E, "num_experts_per_tok": top_k}}
        (path / "params.json").write_text(json.dumps(params))
        return path
    config = {"model_type": "qwen3_moe", "num_hidden_layers": layers, "hidden_size": H, "num_experts_per_tok": top_k}
    if convention == "w123":
        config.update(model_type="mixtral", num_local_experts=E, intermediate_size=I)
    else:
        config.update(num_experts=E, moe_intermediate_size=I)
    (path / "config.json").write_text(json.dumps(config))
    return path


# ---- FP8 checkpoints stored in place (fp8 blocks, fp8_perchannel, mxfp8) ---------------------

FP8_LAYOUTS = {  # layout: (expert naming convention, key prefix of layer L)
    "per_expert": ("per_expert", "model.layers.{L}"),
    "w123": ("w123", "model.layers.{L}"),
    "fused": ("fused", "model.layers.{L}"),
    "vl_per_expert": ("per_expert", "model.language_model.layers.{L}"),  # Qwen3-VL style prefix
    "vl_fused": ("fused", "model.language_model.layers.{L}"),  # Qwen3.5: fused under the VL prefix
    "m3_w123": ("w123", "language_model.model.layers.{L}"),  # MiniMax-M3
    "mistral": ("mistral", "layers.{L}"),  # Mistral's native consolidated*.safetensors
}
SPECIAL_E4M3 = (0x7F, 0xFF, 0x01, 0x81, 0x07, 0x00, 0x80)  # NaN, -NaN, subnormals, +-0


def e4m3_codes(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random e4m3 bytes (uint8) of every value, NaN codes 0x7F / 0xFF and subnormals
    certainly among them."""
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    flat = codes.view(-1)
    flat[: len(SPECIAL_E4M3)] = torch.tensor(SPECIAL_E4M3, dtype=torch.uint8)
    return codes


def fp8_scales(kind: str, lead: tuple[int, ...], n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random scales of a ``[*lead, n, k]`` weight: fp8 fp32 ``[*lead, ceil(n/128), ceil(k/128)]``,
    fp8_perchannel fp32 ``[*lead, n]``, mxfp8 uint8 ``[*lead, n, ceil(k/32)]`` (codes 0 and 255
    (NaN) included)."""
    if kind == "fp8":
        return torch.rand(*lead, -(-n // 128), -(-k // 128), generator=g) * 0.02 + 1e-3
    if kind == "fp8_perchannel":
        return torch.rand(*lead, n, generator=g) * 0.02 + 1e-3
    codes = torch.randint(100, 140, (*lead, n, -(-k // 32)), generator=g, dtype=torch.uint8)
    codes.view(-1)[:3] = torch.tensor([0, 255, 127], dtype=torch.uint8)
    return codes


def _stored_scale(kind: str, scale: torch.Tensor, scale_dtype: torch.dtype, column: bool) -> torch.Tensor:
    if kind == "mxfp8":
        return scale.view(scale_dtype).contiguous()
    stored = scale.to(scale_dtype)
    return (stored.unsqueeze(-1) if column and kind == "fp8_perchannel" else stored).contiguous()


def write_fp8_layer(
    path: Path,
    kind: str,
    layout: str,
    E: int = 3,
    H: int = 160,
    I: int = 96,
    layer: int = 1,
    seed: int = 0,
    scale_dtype: torch.dtype | None = None,
    scale_name: str | None = None,
    index: bool = False,
) -> tuple[Path, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A one-layer FP8 checkpoint of ``kind`` in ``layout`` (:data:`FP8_LAYOUTS`); returns it
    and ``{matrix: (codes uint8 [E, N, K], scale)}`` for ``gate``/``up``/``down`` (fused
    layouts: ``gate_up`` [E, 2I, H] and ``down``), scales as :func:`fp8_scales` makes them
    (float kinds: the stored values in fp32).

    ``scale_dtype``: F32 (default), BF16 or F16 for float kinds, uint8 (default) or
    float8_e8m0fnu for mxfp8. ``scale_name``: ``weight_scale_inv`` (default; per channel:
    ``weight_scale``) or ``weight_scale``; fused keys take ``_scale_inv`` / ``_scale``.
    Per-channel scales alternate between ``[N]`` and ``[N, 1]``. ``index``: two shards and
    ``model.safetensors.index.json``, else one ``model.safetensors``."""
    g = torch.Generator().manual_seed(seed)
    convention, prefix = FP8_LAYOUTS[layout]
    base = prefix.format(L=layer)
    scale_dtype = scale_dtype or (torch.uint8 if kind == "mxfp8" else torch.float32)
    scale_name = scale_name or ("weight_scale" if kind == "fp8_perchannel" else "weight_scale_inv")
    shapes = {"gate_up": (2 * I, H)} if convention == "fused" else {"gate": (I, H), "up": (I, H)}
    shapes["down"] = (H, I)
    mats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, (n, k) in shapes.items():
        scale = fp8_scales(kind, (E,), n, k, g)
        if kind != "mxfp8":
            scale = scale.to(scale_dtype).float()  # what the checkpoint holds
        mats[name] = (e4m3_codes((E, n, k), g), scale)
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.zeros(4, H, dtype=torch.bfloat16)}
    if convention == "fused":
        suffix = "_scale_inv" if scale_name.endswith("_inv") else "_scale"
        for name, (codes, scale) in mats.items():
            key = f"{base}.mlp.experts.{name}_proj"
            tensors[key] = codes.view(torch.float8_e4m3fn)
            tensors[key + suffix] = _stored_scale(kind, scale, scale_dtype, name == "down")
    else:
        w123 = {"gate": "w1", "up": "w3", "down": "w2"}
        block, names = {"per_expert": (".mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
                        "mistral": ("", w123)}.get(convention, (".block_sparse_moe", w123))
        for name, (codes, scale) in mats.items():
            for e in range(E):
                key = f"{base}{block}.experts.{e}.{names[name]}"
                tensors[f"{key}.weight"] = codes[e].view(torch.float8_e4m3fn).contiguous()
                tensors[f"{key}.{scale_name}"] = _stored_scale(kind, scale[e], scale_dtype, e % 2 == 1)
    path.mkdir(parents=True, exist_ok=True)
    if index:
        keys = list(tensors)
        weight_map = {}
        for s in range(2):
            name = f"model-{s + 1:05d}-of-00002.safetensors"
            save_file({k: tensors[k] for k in keys[s::2]}, str(path / name))
            weight_map.update({k: name for k in keys[s::2]})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "test", "hidden_size": H, "moe_intermediate_size": I,
                                                  "num_experts": E, "num_hidden_layers": layer + 1}))
    return path, mats


def e4m3_to_fp32(codes: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes decoded from their bits (kt-kernel spec 1.3), not by torch's float8:
    ``e == 0``: ``(-1)^s 2^-6 m/8``, else ``(-1)^s 2^(e-7) (1 + m/8)``; 0x7F / 0xFF NaN."""
    values = []
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 15, b & 7
        v = (-1.0) ** s * (2.0**-6 * m / 8 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8))
        values.append(float("nan") if b & 0x7F == 0x7F else v)
    return torch.tensor(values, dtype=torch.float64)[codes.view(torch.uint8).long()].float()


def fp8_expected(codes: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """What a dequantizing loader must return for ``codes [..., N, K]`` (uint8) and their
    ``scale`` (shapes of :func:`fp8_scales`): e4m3 value times the element's scale in fp32,
    then bf16 — indexed element by element, independently of kt_ops."""
    n, k = codes.shape[-2:]
    rows, cols = torch.arange(n), torch.arange(k)
    if kind == "fp8":
        per = scale.float()[..., rows // 128, :][..., cols // 128]
    elif kind == "fp8_perchannel":
        per = scale.float()[..., rows].unsqueeze(-1)
    else:
        e = scale.view(torch.uint8).double()
        decoded = torch.where(e == 255, torch.full_like(e, float("nan")), 2.0 ** (e - 127)).float()
        per = decoded[..., cols // 32]
    return (e4m3_to_fp32(codes) * per).bfloat16()


def save_quantized_layer(path: Path, tensors: dict[str, torch.Tensor], hidden: int, intermediate: int,
                         quantization_config: dict) -> Path:
    """Writes ``tensors`` as ``model.safetensors`` and a config.json giving the sizes and
    ``quantization_config`` (the INT4 / INT8 checkpoint tests' one-layer files)."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "test", "hidden_size": hidden,
                                                  "moe_intermediate_size": intermediate,
                                                  "quantization_config": quantization_config}))
    return path
