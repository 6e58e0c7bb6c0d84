"""Checkpoint readers fed published variants they must not misread: each case gives the
oracle's values or a ValueError naming the tensor, never a silent wrong answer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kt_ops.hf_checkpoint import HfCheckpoint
from kt_ops.hf_native import dequantize_linear
from test_int4_checkpoint import rawint4_tensors


@pytest.mark.parametrize("extra,match", [
    ("weight_zero_point", "weight_zero_point"),
    ("weight_g_idx", "weight_g_idx"),
])
def test_native_rawint4_linear_with_zero_points_or_act_order_is_refused(tmp_path: Path, extra: str,
                                                                         match: str) -> None:
    """A compressed-tensors linear layer (attention, shared expert) quantized asymmetrically
    (``weight_zero_point``) or with act-order (``weight_g_idx``): dequantize_linear read the
    nibbles as symmetric, in k order, and returned wrong weights silently. Now a ValueError
    naming the tensor, as the routed experts' reader gives."""
    N, K, gs = 64, 128, 32
    tensors = {f"attn.{k}": v for k, v in rawint4_tensors(torch.randn(N, K, generator=torch.Generator().manual_seed(0)),
                                                         gs).items()}
    if extra == "weight_zero_point":
        tensors["attn.weight_zero_point"] = torch.full((N, K // gs), 3, dtype=torch.int8)
    else:
        tensors["attn.weight_g_idx"] = torch.randperm(K, generator=torch.Generator().manual_seed(1)).int() // gs
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        dequantize_linear(HfCheckpoint(tmp_path), "attn", "rawint4", N, K)


def test_native_rawint4_linear_with_symmetric_zero_points_is_read(tmp_path: Path) -> None:
    N, K, gs = 64, 128, 32
    t = rawint4_tensors(torch.randn(N, K, generator=torch.Generator().manual_seed(0)), gs)
    tensors = {f"attn.{k}": v for k, v in t.items()}
    tensors["attn.weight_zero_point"] = torch.zeros((N, K // gs), dtype=torch.int8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    from kt_ops import reference

    got = dequantize_linear(HfCheckpoint(tmp_path), "attn", "rawint4", N, K)
    assert torch.equal(got, reference.dequantize_rawint4(t["weight_packed"], t["weight_scale"]))


@pytest.mark.parametrize("shape", [(), (4,), (4, 64, 2)])
def test_gpt_oss_blocks_of_the_wrong_rank_name_the_tensor(tmp_path: Path, shape: tuple[int, ...]) -> None:
    """A ``gate_up_proj_blocks`` that is not ``[E, 2I, H/32, 16]``: a 0-d one was an
    IndexError (``tuple index out of range``) in find_mxfp4_layer, before any shape check.
    Now a ValueError naming the tensor and the shape expected."""
    from kt_ops.hf_mxfp4 import find_mxfp4_layer

    save_file({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(shape, dtype=torch.uint8)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"gate_up_proj_blocks.*\[E, 2I, H/32, 16\]"):
        find_mxfp4_layer(HfCheckpoint(tmp_path), 0)


def _gptq_linear(N: int, K: int) -> dict[str, torch.Tensor]:
    from test_int4_checkpoint import gptq_tensors

    return gptq_tensors(torch.randn(N, K, generator=torch.Generator().manual_seed(2)))


def _awq_linear(N: int, K: int) -> dict[str, torch.Tensor]:
    from test_int4_checkpoint import awq_tensors

    return awq_tensors(torch.randn(N, K, generator=torch.Generator().manual_seed(3)))


def _raw_linear(N: int, K: int) -> dict[str, torch.Tensor]:
    return rawint4_tensors(torch.randn(N, K, generator=torch.Generator().manual_seed(4)))


@pytest.mark.parametrize("kind,make,edit,match", [
    ("gptq", _gptq_linear, lambda t: t.update(scales=torch.tensor(1.0).half()), r"'attn\.scales' is F16 \[\]"),
    ("gptq", _gptq_linear, lambda t: t.update(scales=t["scales"][:, :32].contiguous()), r"'attn\.scales' is F16"),
    ("gptq", _gptq_linear, lambda t: t.update(qzeros=t["qzeros"][:, :2].contiguous()), r"'attn\.qzeros' is I32"),
    ("gptq", _gptq_linear, lambda t: t.update(g_idx=torch.tensor(0, dtype=torch.int32)), r"'attn\.g_idx'"),
    ("gptq", _gptq_linear, lambda t: t.update(g_idx=t["g_idx"] + 5), r"'attn\.g_idx'"),
    ("awq", _awq_linear, lambda t: t.pop("qzeros"), r"'attn\.qzeros'.* is missing"),
    ("awq", _awq_linear, lambda t: t.update(scales=torch.tensor(1.0).half()), r"'attn\.scales' is F16 \[\]"),
    ("rawint4", _raw_linear, lambda t: t.update(weight_scale=torch.ones(64)), r"'attn\.weight_scale' is F32 \[64\]"),
    ("rawint4", _raw_linear, lambda t: t.update(weight_scale=torch.ones(64, 3)), r"'attn\.weight_scale' is F32"),
])
def test_native_linear_with_damaged_tensors_names_them(tmp_path: Path, kind: str, make, edit, match: str) -> None:
    """A quantized linear layer whose tensors do not fit its [N, K]: dequantize_linear raised
    IndexError / RuntimeError / KeyError from the dequantizers, and a 0-d GPTQ g_idx (every
    input in group 0) was read silently. Now a ValueError naming the tensor."""
    N, K = 64, 256
    tensors = make(N, K)
    edit(tensors)
    save_file({f"attn.{k}": v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        dequantize_linear(HfCheckpoint(tmp_path), "attn", kind, N, K)


def test_native_linear_with_a_0d_qweight_names_it(tmp_path: Path) -> None:
    """quantized_linears told GPTQ from AWQ by qweight's first dimension: a 0-d qweight
    was an IndexError (tuple index out of range). Now it is listed as GPTQ and
    dequantize_linear's ValueError names it."""
    from kt_ops.hf_native import quantized_linears

    tensors = {f"attn.{k}": v for k, v in _gptq_linear(64, 256).items()}
    tensors["attn.qweight"] = torch.tensor(1, dtype=torch.int32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = torch.nn.Module()
    model.attn = torch.nn.Linear(256, 64)
    checkpoint = HfCheckpoint(tmp_path)
    found = quantized_linears(model, checkpoint, ())
    assert found == {"attn": "gptq"}
    with pytest.raises(ValueError, match=r"'attn\.qweight' is I32 \[\]"):
        dequantize_linear(checkpoint, "attn", found["attn"], 64, 256)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "gptq"])
def test_per_expert_biases_are_refused_naming_them(tmp_path: Path, kind: str) -> None:
    """A per-expert checkpoint whose expert linears carry biases (``experts.{e}.down_proj.bias``):
    load_experts, load_fp8_experts and load_int4_experts returned the weights alone, and
    the layer computed without its biases, silently wrong. Now a ValueError naming the bias."""
    from kt_ops.hf_int4 import load_int4_experts
    from test_int4_checkpoint import E, H, I, LAYER, write_int4_checkpoint

    bias = f"model.layers.{LAYER}.mlp.experts.{E - 1}.down_proj.bias"
    if kind == "gptq":
        path, _ = write_int4_checkpoint(tmp_path, "GPTQ_INT4", edit=lambda t: t.update({bias: torch.zeros(H)}))
        with pytest.raises(ValueError, match=f"biases.*{bias}"):
            load_int4_experts(HfCheckpoint(path), LAYER, [0], H, I)
        return
    tensors = {}
    for e in range(E):
        for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            stem = f"model.layers.{LAYER}.mlp.experts.{e}.{name}"
            if kind == "fp8":
                tensors[f"{stem}.weight"] = torch.zeros(shape).to(torch.float8_e4m3fn)
                tensors[f"{stem}.weight_scale_inv"] = torch.ones(-(-shape[0] // 128), -(-shape[1] // 128))
            else:
                tensors[f"{stem}.weight"] = torch.zeros(shape, dtype=torch.bfloat16)
    tensors[bias] = torch.ones(H, dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    checkpoint = HfCheckpoint(tmp_path)
    with pytest.raises(ValueError, match=f"biases.*{bias}"):
        checkpoint.load_experts(LAYER, [0], H, I)
    if kind == "fp8":
        with pytest.raises(ValueError, match=f"biases.*{bias}"):
            checkpoint.load_fp8_experts(LAYER, [0], H, I)


def test_native_asymmetric_gptq_linear_without_qzeros_is_refused(tmp_path: Path) -> None:
    """config.json says ``sym: false`` but a GPTQ linear has no ``qzeros``: dequantize_linear
    took the zero as 8 (symmetric) and returned wrong weights silently, where the experts'
    reader refuses. Now a ValueError naming the tensor."""
    import json

    tensors = {f"attn.{k}": v for k, v in _gptq_linear(64, 256).items() if k != "qzeros"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4,
                                                                               "sym": False}}))
    with pytest.raises(ValueError, match=r"'attn\.qzeros' is missing.*sym: false"):
        dequantize_linear(HfCheckpoint(tmp_path), "attn", "gptq", 64, 256)
