"""KtOpsConfig(method="native"): pre-quantized checkpoints loaded with transformers'
``from_pretrained``, their experts read as stored (FP8 block / per-channel / MXFP8,
compressed-tensors RAWINT4 and W8A8 int8, GPTQ, AWQ, MXFP4 of gpt-oss and DeepSeek-V4), their quantized
attention layers dequantized; compared with transformers eager on the same weights
dequantized and saved as a float checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

import kt_ops  # noqa: E402
from checkpoint_helpers import fp8_blocks  # noqa: E402
from conftest import logits_bound  # noqa: E402
from hf_models import tiny_model  # noqa: E402
from kt_ops import hf_experts  # noqa: E402
from test_int4_checkpoint import awq_tensors, dequantized, gptq_tensors, rawint4_tensors  # noqa: E402
from test_int8_checkpoint import quantize as quantize_int8  # noqa: E402
from test_mxfp4_checkpoint import hf_codes, hf_weights  # noqa: E402

Quantize = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def fp8(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, scale = fp8_blocks(w)
    full = scale.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    return {"weight": q, "weight_scale_inv": scale}, q.float() * full


def fp8_perchannel(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = w.abs().amax(1, keepdim=True).clamp(min=1e-6) / 448
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def mxfp8(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    groups = w.reshape(w.shape[0], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 448)).clamp(-127, 127)
    scale = torch.exp2(exponent)
    q = (groups / scale[..., None]).to(torch.float8_e4m3fn)
    codes = (exponent + 127).to(torch.uint8)
    return {"weight": q.reshape(w.shape), "weight_scale_inv": codes}, (q.float() * scale[..., None]).reshape(w.shape)


def int8(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors W8A8 (llm-compressor's rounding, -128 included)."""
    q, scale = quantize_int8(w)
    return {"weight": q, "weight_scale": scale.bfloat16()}, q.float() * scale.bfloat16().float()


def int4(method: str, gs: int = 32, asym: bool = True) -> Quantize:
    def quantize(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if method == "RAWINT4":
            t = rawint4_tensors(w, gs)
        elif method == "GPTQ_INT4":
            t = gptq_tensors(w, gs, asym=asym)
        else:
            t = awq_tensors(w, gs)
        return t, dequantized(method, t)
    return quantize


QUANT_CONFIGS = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    "fp8_perchannel": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"},
    "mxfp8": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [1, 32], "activation_scheme": "dynamic"},
    "RAWINT4": {"quant_method": "compressed-tensors", "format": "pack-quantized"},
    "int8": {"quant_method": "compressed-tensors", "format": "int-quantized"},
    "GPTQ_INT4": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False},
    "AWQ_INT4": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                   "model.embed_tokens", "lm_head"]},
}
QUANTIZERS: dict[str, Quantize] = {"fp8": fp8, "fp8_perchannel": fp8_perchannel, "mxfp8": mxfp8,
                                   "RAWINT4": int4("RAWINT4"), "GPTQ_INT4": int4("GPTQ_INT4"),
                                   "AWQ_INT4": int4("AWQ_INT4"), "int8": int8}


def is_expert(key: str) -> bool:
    return ".experts." in key and key.endswith(".weight") and ".shared_experts." not in key


def is_attention(key: str) -> bool:
    return ".self_attn." in key and key.endswith("_proj.weight")


def write_pair(root: Path, arch: str, kind: str, attention: bool) -> tuple[Path, Path]:
    """The tiny ``arch`` model saved twice: its experts (and, with ``attention``, its
    attention projections) quantized as ``kind`` with config.json's quantization_config,
    and the same weights dequantized as a float checkpoint (transformers' reference)."""
    torch.manual_seed(0)
    source = root / f"{arch}-float"
    if not source.exists():
        tiny_model(arch).float().save_pretrained(source)
    tensors = load_file(str(source / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if is_expert(key) or (attention and is_attention(key)):
            parts, weight = QUANTIZERS[kind](value.float())
            stem = key.removesuffix(".weight")
            quantized.update({f"{stem}.{suffix}": t for suffix, t in parts.items()})
            plain[key] = weight.float()
        else:
            quantized[key] = plain[key] = value
    return save_pair(root / f"{arch}-{kind}-{attention}", source, quantized, plain, QUANT_CONFIGS[kind])


def save_pair(folder: Path, source: Path, quantized: dict[str, torch.Tensor], plain: dict[str, torch.Tensor],
              quant_config: dict) -> tuple[Path, Path]:
    config = json.loads((source / "config.json").read_text())
    for name, tensors, extra in (("quantized", quantized, {"quantization_config": quant_config}), ("float", plain, {})):
        (folder / name).mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / name / "model.safetensors"), metadata={"format": "pt"})
        (folder / name / "config.json").write_text(json.dumps({**config, **extra}))
    return folder / "quantized", folder / "float"


def load_native(path: Path, **config) -> tuple[torch.nn.Module, dict]:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True,
        quantization_config=kt_ops.KtOpsConfig(method="native", progress=False, **config))
    return model.eval(), info


def compare(ours: torch.nn.Module, float_path: Path) -> float:
    """Relative error of ``ours``' logits vs transformers eager on the float checkpoint;
    checks every experts module ran ``kt::moe_forward``."""
    eager = transformers.AutoModelForCausalLM.from_pretrained(float_path, dtype=torch.float32,
                                                              experts_implementation="eager").eval()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        got = ours(ids).logits
    calls = sum(1 for e in prof.events() if e.name == "kt::moe_forward")
    assert calls == len([m for m in ours.modules() if hf_experts.is_experts_module(m)])
    with torch.no_grad():
        want = eager(ids).logits
    return float((got - want).norm() / want.norm())


FORMATS = {"fp8": "fp8", "fp8_perchannel": "fp8_perchannel", "mxfp8": "mxfp8", "RAWINT4": "int4",
           "GPTQ_INT4": "int4_asym", "AWQ_INT4": "int4_asym", "int8": "int8"}
BOUNDS = {"fp8": 1e-2, "fp8_perchannel": 1e-2, "mxfp8": 1e-2, "RAWINT4": 4e-2, "GPTQ_INT4": 4e-2, "AWQ_INT4": 4e-2,
          "int8": 4e-2}
CASES = [("qwen3_moe", "fp8", True), ("glm4_moe", "fp8_perchannel", True), ("mixtral", "mxfp8", False),
         ("qwen3_moe", "RAWINT4", False), ("qwen3_moe", "GPTQ_INT4", True), ("olmoe", "AWQ_INT4", True),
         ("qwen3_moe", "int8", True)]


@pytest.mark.parametrize("arch,kind,attention", CASES, ids=[f"{a}-{k}" for a, k, _ in CASES])
def test_native_checkpoint_matches_eager(tmp_path_factory: pytest.TempPathFactory, arch: str, kind: str,
                                         attention: bool) -> None:
    quantized, plain = write_pair(tmp_path_factory.mktemp("native"), arch, kind, attention)
    ours, info = load_native(quantized)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert ours.config.quantization_config.checkpoint_quantization["quant_method"] == QUANT_CONFIGS[kind]["quant_method"]
    for module in (m for m in ours.modules() if hf_experts.is_experts_module(m)):
        assert kt_ops.PackedExperts(hf_experts.packed_blob(module)).format == FORMATS[kind]
    assert not any(".experts." in name for name, _ in ours.named_parameters())
    assert compare(ours, plain) <= BOUNDS[kind]


def test_gpt_oss_mxfp4(tmp_path: Path) -> None:
    """gpt-oss as published: fused, interleaved MXFP4 blocks with biases, attention in bf16."""
    source = tmp_path / "float-source"
    tiny_model("gpt_oss").float().save_pretrained(source)
    tensors = load_file(str(source / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    quantized, plain = dict(tensors), dict(tensors)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, K, N = tensors[key].shape  # stored transposed: [E, K, N]
        codes, exps = hf_codes((E, N), K, g)
        del quantized[key]
        quantized[f"{key}_blocks"], quantized[f"{key}_scales"] = codes, exps
        plain[key] = convert_moe_packed_tensors(codes, exps, dtype=torch.float32)
    quantized_path, float_path = save_pair(tmp_path / "gpt_oss", source, quantized, plain, QUANT_CONFIGS["mxfp4"])
    ours, info = load_native(quantized_path)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert ours.config.quantization_config.packed_methods == ["MXFP4"]
    assert compare(ours, float_path) <= 4e-2


def test_deepseek_v4_mxfp4(tmp_path: Path) -> None:
    """DeepSeek-V4-Flash's per-expert w1/w3/w2 int8 codes with E8M0 scales."""
    source = tmp_path / "float-source"
    tiny_model("deepseek_v4").float().save_pretrained(source)
    tensors = load_file(str(source / "model.safetensors"))
    g = torch.Generator().manual_seed(2)
    quantized, plain = dict(tensors), dict(tensors)
    for key in [k for k in tensors if is_expert(k)]:
        n, k = tensors[key].shape
        codes, exps = hf_codes((n,), k, g)
        quantized[key] = codes.reshape(n, k // 2).view(torch.int8)
        quantized[key.removesuffix("weight") + "scale"] = exps.view(torch.float8_e8m0fnu)
        plain[key] = hf_weights(codes, exps).contiguous()
    quantized_path, float_path = save_pair(tmp_path / "v4", source, quantized, plain,
                                           {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    ours, info = load_native(quantized_path)
    assert ours.config.quantization_config.packed_methods == ["MXFP4"]
    assert compare(ours, float_path) <= 4e-2


def test_native_on_a_float_checkpoint_packs_bf16(tmp_path: Path) -> None:
    tiny_model("qwen3_moe").float().save_pretrained(tmp_path)
    ours, _ = load_native(tmp_path)
    for module in (m for m in ours.modules() if hf_experts.is_experts_module(m)):
        assert kt_ops.PackedExperts(hf_experts.packed_blob(module)).format == "bf16"
    assert compare(ours, tmp_path) <= logits_bound()


def test_native_refusals(tmp_path_factory: pytest.TempPathFactory) -> None:
    quantized, _ = write_pair(tmp_path_factory.mktemp("refuse"), "qwen3_moe", "fp8", True)
    with pytest.raises(ValueError, match="already quantized .*method='native'"):
        transformers.AutoModelForCausalLM.from_pretrained(quantized, quantization_config=kt_ops.KtOpsConfig("AMXINT4"))
    with pytest.raises(ValueError, match="num_gpu_experts"):
        load_native(quantized, num_gpu_experts=2)
    with pytest.raises(ValueError, match="group_size cannot apply"):
        kt_ops.KtOpsConfig("native", group_size=64)
    assert kt_ops.KtOpsConfig("NATIVE").method == "native"


def test_unmatched_quantized_tensors_are_named(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A quantized non-expert layer under a name the model does not have would load as
    random weights: a ValueError naming it instead."""
    quantized, _ = write_pair(tmp_path_factory.mktemp("unmatched"), "qwen3_moe", "fp8", True)
    tensors = load_file(str(quantized / "model.safetensors"))
    for suffix in ("weight", "weight_scale_inv"):
        tensors[f"model.layers.0.self_attn.q_lin.{suffix}"] = tensors.pop(f"model.layers.0.self_attn.q_proj.{suffix}")
    save_file(tensors, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_lin.*belong to no linear layer"):
        load_native(quantized)


def test_a_damaged_expert_names_the_layer(tmp_path_factory: pytest.TempPathFactory) -> None:
    quantized, _ = write_pair(tmp_path_factory.mktemp("damaged"), "qwen3_moe", "RAWINT4", False)
    tensors = load_file(str(quantized / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight_scale"]
    save_file(tensors, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts \(layer 1\).*up_proj\.weight_scale"):
        load_native(quantized)


def test_kt_ops_generate_reads_a_native_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> None:
    """kt-ops generate (default --method native) on an FP8 checkpoint: the tokens transformers
    eager generates from the same weights dequantized."""
    import subprocess
    import sys

    from test_hf_experts import save_tokenizer

    quantized, plain = write_pair(tmp_path_factory.mktemp("generate"), "qwen3_moe", "fp8", True)
    save_tokenizer(quantized)
    prompt = "w5 w17 w42 w3"
    result = subprocess.run([sys.executable, "-m", "kt_ops", "generate", str(quantized), "--prompt", prompt,
                             "--max-new-tokens", "8", "--dtype", "float32"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kt_ops FP8: loaded" in result.stderr
    eager = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(quantized)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    want = eager.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert result.stdout.split() == tokenizer.decode(want[0, ids.shape[1]:], skip_special_tokens=True).split()


def test_quantized_experts_without_a_config_are_still_read_as_stored(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A checkpoint whose config.json names a quant_method transformers does not know (so it
    is not treated as pre-quantized) but whose experts are FP8: native still reads them with
    their scales, never as bare e4m3 values."""
    quantized, plain = write_pair(tmp_path_factory.mktemp("unknown"), "qwen3_moe", "fp8", True)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "some-future-method"}
    (quantized / "config.json").write_text(json.dumps(config))
    ours, info = load_native(quantized)
    assert ours.config.quantization_config.packed_methods == ["FP8"]
    assert compare(ours, plain) <= 1e-2


def test_device_map_places_the_dequantized_layers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """device_map (accelerate's dispatch): the dequantized attention goes where the map says
    (here the CPU device, the only one), the experts stay packed in host memory."""
    pytest.importorskip("accelerate")
    quantized, plain = write_pair(tmp_path_factory.mktemp("device_map"), "qwen3_moe", "GPTQ_INT4", True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        quantized, dtype=torch.float32, device_map={"": "cpu"},
        quantization_config=kt_ops.KtOpsConfig(method="native", progress=False)).eval()
    assert model.model.layers[1].self_attn.o_proj.weight.device.type == "cpu"
    assert model.model.layers[1].self_attn.o_proj.weight.dtype == torch.float32
    assert compare(model, plain) <= BOUNDS["GPTQ_INT4"]


@pytest.mark.parametrize("device_map", ["auto", "cpu", torch.device("cpu")])
def test_a_device_map_other_than_a_dict_places_the_dequantized_layers(tmp_path_factory: pytest.TempPathFactory,
                                                                       device_map: str | torch.device) -> None:
    """device_map given as a string or a device (transformers hands the quantizer the map
    as given): the dequantized attention goes where the rest of its layer went — not
    AttributeError ("'str' object has no attribute 'keys'") from transformers' get_device."""
    pytest.importorskip("accelerate")
    quantized, plain = write_pair(tmp_path_factory.mktemp("device_map_str"), "qwen3_moe", "fp8", True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        quantized, dtype=torch.float32, device_map=device_map,
        quantization_config=kt_ops.KtOpsConfig(method="native", progress=False)).eval()
    weight = model.model.layers[1].self_attn.o_proj.weight
    assert weight.device == model.model.layers[1].self_attn.q_norm.weight.device
    assert weight.dtype == torch.float32 and weight.shape == (64, 64)
    assert compare(model, plain) <= BOUNDS["fp8"]
