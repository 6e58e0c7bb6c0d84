"""The public API's docstrings taken at their word: each test checks one claim a
docstring (or a type hint) makes, where the code once disagreed with it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import kt_ops
from conftest import make_experts

E, H, I = 2, 64, 64


def test_pack_experts_takes_numpy_ints_as_its_siblings_do():
    # group_size: int, as KTMoEWrapper's group_size and pack_int4_experts' (which take numpy's
    # integers); gguf_type: "its name or integer value". np.int64 was refused by both.
    ex = make_experts(E, H, I)
    packed = kt_ops.pack_experts(ex.gate, ex.up, ex.down, "AMXINT4", group_size=np.int64(64))
    assert packed.group_size == 64
    gguf = kt_ops.pack_experts(ex.gate, ex.up, ex.down, "LLAMAFILE", gguf_type=np.int64(8))
    assert gguf.gguf_types == ("Q8_0", "Q8_0", "Q8_0")
    with pytest.raises(ValueError, match="group_size"):
        kt_ops.pack_experts(ex.gate, ex.up, ex.down, "AMXINT4", group_size=np.bool_(True))


def test_kt_ops_config_takes_numpy_ints_and_saves_them_as_ints():
    pytest.importorskip("transformers")
    config = kt_ops.KtOpsConfig(method="LLAMAFILE", gguf_type=(np.int64(8), "Q8_0", 8))
    assert json.loads(config.to_json_string())["gguf_type"] == [8, "Q8_0", 8]  # np.int64: a TypeError
    assert type(kt_ops.KtOpsConfig(method="AMXINT4", group_size=np.int64(64)).group_size) is int


def test_lora_experts_takes_numpy_ints_as_kt_moe_wrapper_does():
    lora = kt_ops.LoraExperts(np.int64(E), np.int64(H), np.int32(I), rank=np.int64(4))
    assert lora.gate_a.shape == (E, 4, H) and type(lora.rank) is int
    with pytest.raises(ValueError, match="rank"):
        kt_ops.LoraExperts(E, H, I, rank=True)


def test_pack_fp8_experts_refuses_a_method_that_is_not_a_str_as_pack_experts_does():
    weights = torch.zeros(E, I, H, dtype=torch.float8_e4m3fn)
    scale = torch.ones(E, 1, 1)
    with pytest.raises(TypeError, match="method must be a str"):  # was AttributeError: no .upper()
        kt_ops.pack_fp8_experts(weights, weights, weights, scale, scale, scale, 3)


@pytest.mark.parametrize("flag", ["norm_topk_prob", "logits_fp32", "weights_in_logits_dtype"])
def test_routing_refuses_a_switch_that_is_not_a_bool(flag):
    # documented as switches (bool); "no" is truthy: the weights were renormalised silently
    with pytest.raises(ValueError, match=flag):
        kt_ops.Routing(2, **{flag: "no"})


def test_set_activation_refuses_a_float8_bias_with_a_value_error():
    # "a bias of the wrong dtype" is a ValueError; float8 was a NotImplementedError from isfinite
    packed = make_experts(E, H, I).packed
    bias = torch.zeros(E, I).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="gate_bias"):
        kt_ops.set_activation(packed, biases=(bias, None, None))


def test_expert_stats_takes_numpy_sizes_as_placement_masks_does():
    # num_hidden_layers: int; placement_masks(num_hidden_layers=np.int64(...)) takes numpy's too
    stats = kt_ops.ExpertStats(num_hidden_layers=np.int64(3), num_experts=np.int32(8))
    assert stats.counts.shape == (3, 8) and type(stats.num_hidden_layers) is int
    with pytest.raises(ValueError, match="num_experts"):
        kt_ops.ExpertStats(num_experts=True)


def test_packed_experts_load_refuses_a_copy_switch_that_is_not_a_bool(tmp_path):
    # copy: bool; "no" is truthy: the file was read into RAM instead of mapped, silently
    path = tmp_path / "experts.safetensors"
    make_experts(E, H, I).packed.save(path)
    with pytest.raises(ValueError, match="copy must be a bool"):
        kt_ops.PackedExperts.load(path, copy="no")


def test_kt_moe_wrapper_takes_a_numpy_gpu_prefill_threshold_as_its_other_ints():
    wrapper = kt_ops.KTMoEWrapper(0, np.int64(E), 1, H, I, method="BF16", gpu_prefill_token_threshold=np.int64(64))
    assert wrapper.gpu_prefill_token_threshold == 64 and type(wrapper.gpu_prefill_token_threshold) is int
    with pytest.raises(ValueError, match="gpu_prefill_token_threshold"):
        kt_ops.KTMoEWrapper(0, E, 1, H, I, method="BF16", gpu_prefill_token_threshold=True)


def test_kt_ops_config_takes_a_numpy_num_gpu_experts_as_patch_model_does():
    pytest.importorskip("transformers")
    config = kt_ops.KtOpsConfig(method="BF16", num_gpu_experts=np.int64(2))
    assert json.loads(config.to_json_string())["num_gpu_experts"] == 2


@pytest.mark.parametrize("switch", ["update_gpu_experts", "prefetch_next_layer"])
def test_set_gpu_prefill_token_threshold_refuses_a_switch_that_is_not_a_bool(switch):
    # "no" is truthy: it moved the GPU experts after each call (or linked the layers), silently
    ex = make_experts(E, H, I)
    layer = kt_ops.HybridMoE(torch.randn(E, H), ex.gate, ex.up, ex.down, kt_ops.Routing(1))
    with pytest.raises(ValueError, match=f"{switch} must be a bool"):
        kt_ops.set_gpu_prefill_token_threshold(layer, 64, **{switch: "no"})
    assert layer.gpu_prefill_token_threshold == 0  # refused before any layer changed


def test_hybrid_moe_and_routing_take_numpy_ints_as_kt_moe_wrapper_does():
    ex = make_experts(E, H, I)
    routing = kt_ops.Routing(np.int64(1), num_groups=np.int64(1), topk_groups=np.int64(1))
    assert type(routing.top_k) is int
    layer = kt_ops.HybridMoE(torch.randn(E, H), ex.gate, ex.up, ex.down, routing, layer_idx=np.int64(3))
    assert layer.layer_idx == 3 and type(layer.layer_idx) is int
    with pytest.raises(ValueError, match="top_k must be an int"):
        kt_ops.Routing(True)
