"""INT8 (W8A8 / W8A16, compressed-tensors ``int-quantized``) checkpoints read in place as
format int8 (``kt_ops.hf_int8``): levels copied, -128 included, every naming, parts,
method detection, bad files, ``kt-ops inspect``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import kt_ops
from checkpoint_helpers import save_quantized_layer
from conftest import random_routing, rel_err
from kt_ops import reference
from kt_ops.hf_checkpoint import HfCheckpoint
from kt_ops.hf_int8 import is_int8_layer, load_int8_experts
from kt_ops.wrappers import KTMoEWrapper

E, H, I, LAYER = 4, 160, 96, 1  # K not a multiple of 32 nor of 64: the packer pads
CONFIG = {"quant_method": "compressed-tensors", "format": "int-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"],
                                        "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                    "strategy": "channel"},
                                        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                              "dynamic": True, "strategy": "token"}}}}
# llm-compressor's W8A16 scheme: weight-only 8-bit int is saved pack-quantized (int32 words)
PACKED_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                 "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                               "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                           "strategy": "channel"}}}}
_BASES = {"per_expert": (f"model.layers.{LAYER}.mlp", ("gate_proj", "up_proj", "down_proj")),
          "w123": (f"model.layers.{LAYER}.block_sparse_moe", ("w1", "w3", "w2")),
          "mistral": (f"layers.{LAYER}", ("w1", "w3", "w2"))}


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-compressor's symmetric int8 per channel: scale = max|w| / 127.5, levels rounded
    to nearest even and clamped to [-128, 127] (a row whose extreme is negative gets -128)."""
    scale = w.abs().amax(dim=1, keepdim=True) / 127.5
    return torch.round(w / scale).clamp(-128, 127).to(torch.int8), scale


def pack_int8_words(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``pack_to_int32`` for 8 bits (its W8A16 ``pack-quantized`` format):
    ``q + 128`` as bytes, four consecutive k per int32, the first in the low byte."""
    return (q.to(torch.int16) + 128).to(torch.uint8).contiguous().view(torch.int32)


def write_int8_checkpoint(path: Path, convention: str = "per_expert", scale_shape: str = "column",
                          scale_dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                          edit=None, packed: bool = False) -> tuple[Path, list[torch.Tensor]]:
    """A one-layer INT8 checkpoint; returns it and the oracle's [E, N, K] gate, up, down
    (levels times the stored scales). ``edit(tensors)`` may damage it first. ``packed``:
    llm-compressor's W8A16 layout (``pack-quantized``: ``weight_packed`` int32 ``[N, K/4]``
    and ``weight_shape``) instead of ``int-quantized``'s int8 ``weight``."""
    g = torch.Generator().manual_seed(seed)
    base, names = _BASES[convention]
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.zeros(4, H, dtype=torch.bfloat16)}
    expected = []
    for name, (N, K) in zip(names, ((I, H), (I, H), (H, I))):
        per_expert = []
        for e in range(E):
            q, scale = quantize(torch.randn(N, K, generator=g) * 0.05)
            scale = scale.to(scale_dtype)
            per_expert.append(q.float() * scale.float())
            stem = f"{base}.experts.{e}.{name}"
            if packed:
                tensors[f"{stem}.weight_packed"] = pack_int8_words(q)
                tensors[f"{stem}.weight_shape"] = torch.tensor([N, K])
            else:
                tensors[f"{stem}.weight"] = q
            tensors[f"{stem}.weight_scale"] = scale if scale_shape == "column" else scale.reshape(N)
        expected.append(torch.stack(per_expert))
    if edit is not None:
        edit(tensors)
    return save_quantized_layer(path, tensors, H, I, PACKED_CONFIG if packed else CONFIG), expected


def assert_wrapper_matches_oracle(path: Path, dense: list[torch.Tensor], tokens: int, seed: int,
                                  method: str | None = "AMXINT8") -> None:
    """The wrapper's layer read from ``path`` against the oracle on ``dense`` (gate, up,
    down), with AMXINT8's int8 activations."""
    wrapper = KTMoEWrapper(LAYER, E, 2, H, I, weight_path=path, method=method)
    wrapper.load_weights()
    x = torch.randn(tokens, H)
    ids, weights = random_routing(tokens, E, 2, seed=seed)
    ref = reference.moe_forward(x, ids, weights, *dense, quantize_activations=True)
    assert rel_err(wrapper.forward(x, ids, weights), ref) <= 3e-3


@pytest.mark.parametrize("scale_shape,scale_dtype", [("column", torch.bfloat16), ("vector", torch.float32),
                                                     ("column", torch.float16)])
@pytest.mark.parametrize("convention", list(_BASES))
def test_read_in_place_keeps_the_levels(tmp_path: Path, convention: str, scale_shape: str,
                                        scale_dtype: torch.dtype) -> None:
    path, expected = write_int8_checkpoint(tmp_path, convention, scale_shape, scale_dtype)
    checkpoint = HfCheckpoint(path)
    every = load_int8_experts(checkpoint, LAYER, range(E), H, I)
    assert any(bool((q == -128).any()) for q in (every.gate, every.up, every.down))  # llm-compressor's rounding
    assert is_int8_layer(checkpoint, LAYER)
    picked = [2, 0, 2]
    experts = load_int8_experts(checkpoint, LAYER, picked, H, I)
    packed = kt_ops.PackedExperts(torch.ops.kt.pack_int8_experts(experts.gate, experts.up, experts.down,
                                                                 *experts.scales))
    assert packed.format == "int8"
    for got, want in zip(reference.dequantize(packed.data), expected):
        torch.testing.assert_close(got[:, :want.shape[1], :want.shape[2]], want[picked], rtol=0, atol=0)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        stored = sum(f.get_tensor(k).nbytes for k in f.keys() if ".experts." in k)
    # levels (K padded to 32: 160 -> 160, 96 -> 96) plus fp32 scales, against levels plus bf16/fp32 scales
    assert packed.nbytes <= 1.15 * stored * len(picked) / E + 4096


def test_the_level_minus_128_is_multiplied_as_minus_128(variant: str) -> None:
    """-128 (byte 0 of the packed offset-binary levels) on every variant, decode and prefill
    tiles: the output is the oracle's with -128, not with -127 (it was refused before W8A8)."""
    g = torch.Generator().manual_seed(1)
    levels = [torch.randint(-127, 128, shape, generator=g, dtype=torch.int8) for shape in ((3, 64, 96),) * 2]
    levels.append(torch.randint(-127, 128, (3, 96, 64), generator=g, dtype=torch.int8))
    for q in levels:
        q.view(-1)[::5] = -128
    scales = [torch.rand(3, q.shape[1], generator=g) * 0.02 + 1e-3 for q in levels]
    packed = torch.ops.kt.pack_int8_experts(*levels, *scales)
    dense = [q.float() * s[:, :, None] for q, s in zip(levels, scales)]
    for got, want in zip(reference.dequantize(packed), dense):
        assert torch.equal(got[:, :want.shape[1], :want.shape[2]], want)
    clipped = [q.clamp(min=-127).float() * s[:, :, None] for q, s in zip(levels, scales)]
    for tokens in (1, 5, 90):  # decode tiles; AMX / prefill tiles at 90 tokens over 3 experts
        x = torch.randn(tokens, 96, generator=g)
        ids, weights = random_routing(tokens, 3, 2, seed=tokens)
        out = kt_ops.moe_forward(x, ids, weights, packed)
        right = reference.moe_forward(x, ids, weights, *dense, quantize_activations=True)
        wrong = reference.moe_forward(x, ids, weights, *clipped, quantize_activations=True)
        assert rel_err(out, right) <= 3e-3 < rel_err(out, wrong), (tokens, rel_err(out, right), rel_err(out, wrong))


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_wrapper_matches_the_oracle(tmp_path: Path, parts: int, variant: str) -> None:
    path, (gate, up, down) = write_int8_checkpoint(tmp_path)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(3)).bfloat16()
    ids, weights = random_routing(9, E, 2, seed=4)
    outs = []
    for given in ("AMXINT8", None, "MOE_INT8"):
        wrapper = KTMoEWrapper(LAYER, E, 2, H, I, weight_path=path, method=given, threadpool_count=parts)
        wrapper.load_weights()
        assert wrapper.method in ("AMXINT8", "MOE_INT8") and len(wrapper._parts) == parts
        assert all(part.format == "int8" for part in wrapper._parts)
        outs.append(wrapper.forward(x, ids, weights))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    step = I // parts  # each part quantizes its own slice of the intermediate: the oracle sums the parts'
    ref = sum(reference.moe_forward(x, ids, weights, gate[:, a:a + step], up[:, a:a + step], down[:, :, a:a + step],
                                    quantize_activations=True) for a in range(0, I, step))
    assert rel_err(outs[0], ref) <= 3e-3


def test_a_method_the_file_does_not_hold_is_refused(tmp_path: Path) -> None:
    path, _ = write_int8_checkpoint(tmp_path)
    for method in ("BF16", "AMXINT4", "FP8"):
        with pytest.raises(ValueError, match=f"holds INT8 experts .* method {method} cannot read them: use "
                                             "method='AMXINT8'"):
            KTMoEWrapper(LAYER, E, 2, H, I, weight_path=path, method=method).load_weights()


def _replace(key_end: str, value):
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        key = next(k for k in tensors if k.endswith(key_end))
        tensors[key] = value(tensors[key])
    return edit


def _add(suffix: str, value: torch.Tensor):
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"model.layers.{LAYER}.mlp.experts.1.up_proj.{suffix}"] = value
    return edit


@pytest.mark.parametrize("edit,match", [
    (_replace("experts.1.up_proj.weight_scale", lambda s: s.expand(-1, 5).contiguous()),
     r"up_proj.weight_scale' is \[96, 5\]; kt_ops reads per-channel INT8 .*, not group-wise scales"),
    (_replace("experts.1.up_proj.weight_scale", lambda s: s.to(torch.int32)),
     r"up_proj.weight_scale' is I32; scales are F32, BF16 or F16"),
    (_replace("experts.2.down_proj.weight_scale", lambda s: torch.where(s > s.median(), torch.inf, s)),
     r"down_proj.weight_scale' holds a non-finite scale"),
    (_replace("experts.0.down_proj.weight", lambda q: q[:, :-1].contiguous()),
     r"down_proj.weight' is I8 \[160, 95\]; an INT8 layer needs I8 \[160, 96\]"),
    (lambda tensors: tensors.pop(f"model.layers.{LAYER}.mlp.experts.3.gate_proj.weight_scale"),
     r"experts.3.gate_proj.weight_scale' is missing: int8 weights need their scales"),
    (_add("weight_zero_point", torch.ones(I, 1, dtype=torch.int8)),
     r"up_proj.weight_zero_point' holds zero points other than 0 \(asymmetric INT8\)"),
    (_add("weight_g_idx", torch.zeros(H, dtype=torch.int32)), r"up_proj.weight_g_idx' \(act-order\) is not read"),
    (_add("bias", torch.zeros(I, dtype=torch.bfloat16)), r"experts have biases"),
])
def test_bad_files_name_the_tensor(tmp_path: Path, edit, match: str) -> None:
    path, _ = write_int8_checkpoint(tmp_path, edit=edit)
    with pytest.raises(ValueError, match=match):
        KTMoEWrapper(LAYER, E, 2, H, I, weight_path=path, method="AMXINT8").load_weights()


def test_zero_points_of_zero_are_read(tmp_path: Path) -> None:
    path, dense = write_int8_checkpoint(tmp_path, edit=_add("weight_zero_point", torch.zeros(I, 1, dtype=torch.int8)))
    assert_wrapper_matches_oracle(path, dense, 3, seed=1)


def test_inspect_reads_an_int8_checkpoint(tmp_path: Path) -> None:
    from safetensors import safe_open

    from kt_ops.formats import format_info
    from kt_ops.inspection import format_inspection, inspect_weights

    path, _ = write_int8_checkpoint(tmp_path, "w123")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        expected = sum(f.get_tensor(k).nbytes for k in f.keys() if ".experts." in k)
    report = inspect_weights(path)
    [layer] = report.layers
    assert (layer.layer, layer.num_experts, layer.hidden_size, layer.intermediate_size) == (LAYER, E, H, I)
    assert layer.nbytes == expected and all(m.type == "int8" for m in layer.matrices)
    facts = dict(report.facts)
    assert facts["stored as"] == "int8 (a scale per row, W8A8: method AMXINT8 reads it in place)"
    assert facts["expert tensors"] == "INT8 w123 naming"
    text = format_inspection(report)
    assert f"method AMXINT8 (read in place): {format_info('int8').kernels[kt_ops.cpu_variant()]}" in text, text
    key = f"model.layers.{LAYER}.block_sparse_moe.experts.2.w2.weight_scale"
    broken, _ = write_int8_checkpoint(tmp_path / "broken", "w123", edit=lambda tensors: tensors.pop(key))
    report = inspect_weights(broken)
    assert report.layers == () and f"layer {LAYER}: 1 expert tensor(s) missing, e.g. {key!r}" in report.notes


def test_the_converter_points_to_reading_in_place(tmp_path: Path, capsys) -> None:
    """The converter said only "tensor ... is I8; expert weights must be BF16, F16, F32 or F8_E4M3"."""
    from kt_ops import convert

    path, _ = write_int8_checkpoint(tmp_path / "model")
    args = ["--input-path", str(path), "--input-type", "bf16", "--output", str(tmp_path / "out"), "--quant-method",
            "int4"]
    assert convert.main(args) == 2 and not (tmp_path / "out").exists()
    assert f"layer {LAYER} holds INT8 experts" in capsys.readouterr().err


def test_w8a16_pack_quantized_experts_are_read_as_int8(tmp_path: Path, variant: str) -> None:
    """llm-compressor saves W8A16 (weight-only int8) as ``pack-quantized``: four levels + 128
    per int32 ``weight_packed [N, K/4]``. It was taken for RAWINT4 (method None detected
    RAWINT4 and failed on the shape; AMXINT8 was told to use RAWINT4; inspect showed int4
    with H doubled)."""
    from kt_ops.inspection import inspect_weights

    path, (gate, up, down) = write_int8_checkpoint(tmp_path, packed=True)
    checkpoint = HfCheckpoint(path)
    assert is_int8_layer(checkpoint, LAYER)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(3))
    ids, weights = random_routing(5, E, 2, seed=4)
    ref = reference.moe_forward(x, ids, weights, gate, up, down, quantize_activations=True)
    for given in ("AMXINT8", None):
        wrapper = KTMoEWrapper(LAYER, E, 2, H, I, weight_path=path, method=given)
        wrapper.load_weights()
        assert wrapper.method == "AMXINT8"
        assert rel_err(wrapper.forward(x, ids, weights), ref) <= 3e-3
    report = inspect_weights(path)
    [layer] = report.layers
    assert (layer.hidden_size, layer.intermediate_size) == (H, I) and all(m.type == "int8" for m in layer.matrices)
    assert dict(report.facts)["stored as"] == "int8 (a scale per row, W8A16, packed: method AMXINT8 reads it in place)"


def test_w8a16_pack_quantized_linears_dequantize_as_int8(tmp_path: Path) -> None:
    """``KtOpsConfig(method="native")``'s non-expert linears of a W8A16 checkpoint (8-bit
    ``weight_packed``) were taken for RAWINT4 and refused on their shape."""
    from torch import nn

    from kt_ops.hf_native import dequantize_linear, quantized_linears

    g = torch.Generator().manual_seed(7)
    q, scale = quantize(torch.randn(24, H, generator=g) * 0.05)
    name = f"model.layers.{LAYER}.self_attn.q_proj"

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{name}.weight_packed"] = pack_int8_words(q)
        tensors[f"{name}.weight_shape"] = torch.tensor([24, H])
        tensors[f"{name}.weight_scale"] = scale.to(torch.bfloat16)

    path, _ = write_int8_checkpoint(tmp_path, packed=True, edit=edit)
    layers = nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleDict({str(LAYER): nn.ModuleDict(
        {"self_attn": nn.ModuleDict({"q_proj": nn.Linear(H, 24, bias=False)})})})})})
    checkpoint = HfCheckpoint(path)
    assert quantized_linears(layers, checkpoint, (f"model.layers.{LAYER}.mlp.experts",)) == {name: "int8"}
    torch.testing.assert_close(dequantize_linear(checkpoint, name, "int8", 24, H),
                               q.float() * scale.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_static_activation_scales_are_ignored(tmp_path: Path) -> None:
    """A W8A8 checkpoint calibrated with static activation scales (``input_scale`` /
    ``input_zero_point`` per tensor beside each linear) runs with the kernels' dynamic
    per-token int8 activations, as docs/formats.md says: the same output as without them."""
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for stem in [k.removesuffix(".weight") for k in tensors if ".experts." in k and k.endswith(".weight")]:
            tensors[f"{stem}.input_scale"] = torch.tensor([1e-4])  # would clip every activation if applied
            tensors[f"{stem}.input_zero_point"] = torch.tensor([3], dtype=torch.int8)

    path, dense = write_int8_checkpoint(tmp_path, edit=edit)
    assert_wrapper_matches_oracle(path, dense, 4, seed=2, method=None)


@pytest.mark.parametrize("shape", [(1,), (), (1, 1)])
def test_a_per_tensor_scale_is_read_as_one_per_row(tmp_path: Path, shape: tuple[int, ...]) -> None:
    """compressed-tensors' ``tensor`` weight strategy stores one ``weight_scale`` ``[1]`` per
    linear; it was refused as not per-channel, though it is that scale on every row."""
    key = f"model.layers.{LAYER}.mlp.experts.1.up_proj.weight_scale"
    stored: list[torch.Tensor] = []

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        stored.append(tensors[key].amax().reshape(shape))
        tensors[key] = stored[0]

    path, (gate, up, down) = write_int8_checkpoint(tmp_path, edit=edit)
    experts = load_int8_experts(HfCheckpoint(path), LAYER, range(E), H, I)
    assert torch.equal(experts.scales[1][1], stored[0].float().reshape(1).expand(I))
    up[1] = experts.up[1].float() * stored[0].float().reshape(())
    assert_wrapper_matches_oracle(path, [gate, up, down], 4, seed=2)


def test_inspect_names_fused_int8_experts(tmp_path: Path) -> None:
    """Fused int8 ``gate_up_proj`` (which the loader refuses) crashed ``kt-ops inspect`` with
    KeyError: 'fused'; it is a note naming the tensor, as the loader's ValueError does."""
    from kt_ops.inspection import inspect_weights

    base = f"model.layers.{LAYER}.mlp.experts"
    save_file({f"{base}.gate_up_proj": torch.zeros(E, 2 * I, H, dtype=torch.int8),
               f"{base}.gate_up_proj_scale": torch.ones(E, 2 * I, 1),
               f"{base}.down_proj": torch.zeros(E, H, I, dtype=torch.int8),
               f"{base}.down_proj_scale": torch.ones(E, H, 1)}, str(tmp_path / "model.safetensors"))
    report = inspect_weights(tmp_path)
    assert report.layers == ()
    assert any(f"layer {LAYER}: int8 experts are fused ('{base}.gate_up_proj')" in note for note in report.notes)
    with pytest.raises(ValueError, match="int8 experts are fused"):
        KTMoEWrapper(LAYER, E, 2, H, I, weight_path=tmp_path, method=None).load_weights()
