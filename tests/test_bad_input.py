"""Bad input raises a clear Python exception naming the argument; nothing crashes."""

from __future__ import annotations

import pytest
import torch

import kt_ops
from conftest import make_experts, random_routing

E, H, I = 4, 32, 16


@pytest.fixture(scope="module")
def experts():
    return make_experts(E, H, I)


def good_args(experts, tokens: int = 3) -> dict:
    ids, weights = random_routing(tokens, E, 2)
    return {"hidden_states": torch.randn(tokens, H).bfloat16(), "topk_ids": ids, "topk_weights": weights,
            "packed": experts.packed.data}


def call(args: dict) -> torch.Tensor:
    return torch.ops.kt.moe_forward(args["hidden_states"], args["topk_ids"], args["topk_weights"], args["packed"])


CASES = [
    ("hidden dtype", lambda a: a.update(hidden_states=a["hidden_states"].double()), TypeError, "hidden_states must have dtype"),
    ("hidden int", lambda a: a.update(hidden_states=a["hidden_states"].int()), TypeError, "hidden_states"),
    ("ids dtype", lambda a: a.update(topk_ids=a["topk_ids"].float()), TypeError, "topk_ids must have dtype"),
    ("ids int16", lambda a: a.update(topk_ids=a["topk_ids"].short()), TypeError, "topk_ids"),
    ("weights dtype", lambda a: a.update(topk_weights=a["topk_weights"].double()), TypeError, "topk_weights must have dtype"),
    ("hidden rank", lambda a: a.update(hidden_states=a["hidden_states"][None]), ValueError, "hidden_states must be 2-D"),
    ("ids rank", lambda a: a.update(topk_ids=a["topk_ids"].flatten()), ValueError, "topk_ids must be 2-D"),
    ("weights shape", lambda a: a.update(topk_weights=a["topk_weights"][:, :1].contiguous()), ValueError, "topk_weights must have the shape"),
    ("token count", lambda a: a.update(topk_ids=a["topk_ids"][:2], topk_weights=a["topk_weights"][:2]), ValueError, "topk_ids has 2 rows"),
    ("hidden size", lambda a: a.update(hidden_states=torch.randn(3, H + 2).bfloat16()), ValueError, "hidden size 34"),
    ("id too large", lambda a: a["topk_ids"].__setitem__((1, 0), E), ValueError, r"topk_ids\[1, 0\] = 4 is outside \[-1, 4\)"),
    ("id below -1", lambda a: a["topk_ids"].__setitem__((2, 1), -2), ValueError, r"topk_ids\[2, 1\] = -2"),
    ("hidden not contiguous", lambda a: a.update(hidden_states=torch.randn(H, 3).bfloat16().t()), ValueError, "hidden_states must be contiguous"),
    ("ids not contiguous", lambda a: a.update(topk_ids=a["topk_ids"].t().contiguous().t()), ValueError, "topk_ids must be contiguous"),
    ("weights not contiguous", lambda a: a.update(topk_weights=a["topk_weights"].t().contiguous().t()), ValueError, "topk_weights must be contiguous"),
    ("packed dtype", lambda a: a.update(packed=a["packed"].float()), TypeError, "packed must have dtype"),
    ("packed rank", lambda a: a.update(packed=a["packed"][None]), ValueError, "packed must be 1-D"),
    ("packed not contiguous", lambda a: a.update(packed=a["packed"][::2]), ValueError, "packed must be contiguous"),
    ("packed truncated", lambda a: a.update(packed=a["packed"][:-64].clone()), ValueError, "truncated"),
    ("packed too small", lambda a: a.update(packed=a["packed"][:100].clone()), ValueError, "less than the 256-byte header"),
    ("packed bad magic", lambda a: a.update(packed=torch.zeros_like(a["packed"])), ValueError, "bad magic"),
    ("packed random", lambda a: a.update(packed=torch.randint(0, 255, (5000,), dtype=torch.uint8)), ValueError, "packed experts"),
]


@pytest.mark.parametrize("mutate,error,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_moe_forward_rejects(experts, mutate, error, match) -> None:
    args = good_args(experts)
    args["topk_ids"] = args["topk_ids"].clone()
    mutate(args)
    with pytest.raises(error, match=match):
        call(args)


@pytest.mark.parametrize("offset,what", [(8, "version"), (16, "checksum"), (20, "checksum"), (250, "checksum")])
def test_corrupted_header_is_detected(experts, offset: int, what: str) -> None:
    corrupted = experts.packed.data.clone()
    corrupted[offset] ^= 0x5A
    with pytest.raises(ValueError, match=what):
        kt_ops.PackedExperts(corrupted)
    args = good_args(experts)
    args["packed"] = corrupted
    with pytest.raises(ValueError, match=what):
        call(args)


@pytest.mark.parametrize("offset,what", [(8, "version"), (16, "checksum"), (250, "checksum")])
def test_header_changed_in_place_after_a_call_is_detected(experts, offset: int, what: str) -> None:
    """The operators keep the headers they read (csrc/ops/packed_blob.cpp): a blob whose
    header is changed in place after good calls is read, and rejected, again; restored, it
    runs again with the same result."""
    blob = experts.packed.data.clone()
    args = good_args(experts)
    args["packed"] = blob
    expected = call(args)
    assert torch.equal(call(args), expected)
    original = int(blob[offset])
    blob[offset] ^= 0x5A
    with pytest.raises(ValueError, match=what):
        call(args)
    blob[offset] = original
    assert torch.equal(call(args), expected)


def test_empty_batch_with_bad_ids_dtype_still_raises(experts) -> None:
    with pytest.raises(TypeError, match="topk_ids"):
        torch.ops.kt.moe_forward(torch.empty(0, H), torch.empty(0, 2), torch.empty(0, 2), experts.packed.data)


def test_meta_input_runs_the_fake_not_the_cpu_kernel(experts) -> None:
    args = good_args(experts)
    args["hidden_states"] = args["hidden_states"].to("meta")
    # A meta input dispatches to the fake kernel (shape only), never to the CPU kernel.
    assert call(args).device.type == "meta"


@pytest.mark.parametrize("name", ["packed", "topk_ids", "topk_weights"])
def test_a_meta_tensor_beside_real_activations_is_refused(experts, name: str) -> None:
    """One argument on the meta device (say a model's packed buffer never loaded) beside
    CPU activations dispatches to the fake kernel: a ValueError naming it, not a CPU
    tensor of uninitialized memory returned as the result."""
    args = good_args(experts)
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=f"{name} is on the meta device"):
        call(args)


def test_a_meta_weight_beside_real_ones_is_refused_by_the_pack_operator(experts) -> None:
    with pytest.raises(ValueError, match="up_proj is on the meta device"):
        torch.ops.kt.pack_experts(experts.gate, experts.up.to("meta"), experts.down, "bf16")
    with pytest.raises(ValueError, match="expert_ids is on the meta device"):
        torch.ops.kt.dequantize_experts(experts.packed.data, torch.arange(E).to("meta"))


PACK_CASES = [
    ("gate rank", lambda g, u, d: (g[0], u, d), ValueError, "gate_proj must be 3-D"),
    ("up shape", lambda g, u, d: (g, u[:, :-1], d), ValueError, "up_proj must have the shape of gate_proj"),
    ("down shape", lambda g, u, d: (g, u, d.transpose(1, 2)), ValueError, "down_proj must have shape"),
    ("down experts", lambda g, u, d: (g, u, d[:-1]), ValueError, "down_proj must have shape"),
    ("gate dtype", lambda g, u, d: (g.int(), u, d), TypeError, "gate_proj must have dtype"),
    ("down dtype", lambda g, u, d: (g, u, d.double()), TypeError, "down_proj must have dtype"),
    ("empty", lambda g, u, d: (g[:0], u[:0], d[:0]), ValueError, "E, I, H"),
]


@pytest.mark.parametrize("mutate,error,match", [c[1:] for c in PACK_CASES], ids=[c[0] for c in PACK_CASES])
def test_pack_experts_rejects(experts, mutate, error, match) -> None:
    g, u, d = mutate(experts.gate, experts.up, experts.down)
    with pytest.raises(error, match=match):
        kt_ops.pack_experts(g, u, d)


def test_unknown_method_and_format(experts) -> None:
    with pytest.raises(ValueError, match="method 'INT3' is not available; implemented: BF16"):
        kt_ops.pack_experts(experts.gate, experts.up, experts.down, method="INT3")
    with pytest.raises(ValueError, match="unknown packed format 'int3'"):
        torch.ops.kt.pack_experts(experts.gate, experts.up, experts.down, "int3")


@pytest.mark.parametrize("group_size", [64.0, True, "64"])
def test_a_group_size_that_is_not_an_int_is_a_value_error(experts, group_size) -> None:
    """It was a RuntimeError from the operator's schema (64.0) or a confusing message about
    group size 1 (True)."""
    with pytest.raises(ValueError, match="group_size must be an int"):
        kt_ops.pack_experts(experts.gate, experts.up, experts.down, method="AMXINT4", group_size=group_size)


def test_pack_accepts_any_float_dtype_and_strides(experts) -> None:
    """fp32 and non-contiguous inputs are converted, giving the same blob as bf16."""
    reference = experts.packed.data
    fp32 = kt_ops.pack_experts(experts.gate.float(), experts.up.float(), experts.down.float())
    strided = kt_ops.pack_experts(
        experts.gate.transpose(1, 2).contiguous().transpose(1, 2), experts.up, experts.down
    )
    assert torch.equal(fp32.data, reference) and torch.equal(strided.data, reference)


@pytest.mark.parametrize("option", ["zero_point", "scale_search"])
@pytest.mark.parametrize("value", ["no", None, 1])
def test_a_pack_option_that_is_not_a_bool_is_a_value_error(experts, option, value) -> None:
    """zero_point="no" packed asymmetric INT4 silently (a string is truthy); scale_search="no"
    was a RuntimeError from the operator's schema."""
    with pytest.raises(ValueError, match=f"{option} must be a bool"):
        kt_ops.pack_experts(experts.gate, experts.up, experts.down, method="AMXINT4", **{option: value})


@pytest.mark.parametrize("method", ["BF16", "FP8", "FP8_PERCHANNEL", "MXFP8"])
def test_scale_search_with_a_method_without_one_is_refused_before_any_tensor(method) -> None:
    """KtOpsConfig(method="BF16", scale_search=True) was accepted when built and failed only
    at the first expert tensor while loading (check_pack_arguments did not check it)."""
    with pytest.raises(ValueError, match="scale_search applies to quantized formats"):
        kt_ops.ops.check_pack_arguments(method, None, False, True, None)
    with pytest.raises(ValueError, match="scale_search applies to quantized formats"):
        kt_ops.KtOpsConfig(method=method, scale_search=True)
    kt_ops.ops.check_pack_arguments("AMXINT8", None, False, True, None)  # INT8/INT4 take it


def backward_calls(experts, live_tokens: torch.Tensor | None, grad_dtype: torch.dtype | None = None) -> dict:
    args = good_args(experts)
    x, ids, w, packed = args["hidden_states"], args["topk_ids"], args["topk_weights"], args["packed"]
    grad = torch.randn_like(x) if grad_dtype is None else torch.ones(x.shape, dtype=grad_dtype)
    gate_up = torch.ops.kt.moe_forward_train(x, ids, w, packed, I)[1]
    lora = [torch.zeros(E, 2, H), torch.zeros(E, I, 2), torch.zeros(E, 2, H), torch.zeros(E, I, 2),
            torch.zeros(E, 2, I), torch.zeros(E, H, 2)]
    return {
        "moe_backward": lambda: torch.ops.kt.moe_backward(grad, x, ids, w, packed, live_tokens),
        "moe_train_backward": lambda: torch.ops.kt.moe_train_backward(grad, x, ids, w, packed, gate_up, live_tokens),
        "moe_lora_backward": lambda: torch.ops.kt.moe_lora_backward(grad, x, ids, w, packed, *lora, 1.0, live_tokens),
    }


@pytest.mark.parametrize("op", ["moe_backward", "moe_train_backward", "moe_lora_backward"])
@pytest.mark.parametrize("live,error", [(torch.tensor([-1]), ValueError), (torch.tensor([4]), ValueError),
                                        (torch.tensor([1.5]), TypeError), (torch.tensor([1, 2]), ValueError)],
                         ids=["negative", "above T", "float", "two values"])
def test_backward_operators_refuse_the_live_tokens_the_forward_refuses(experts, op: str, live, error) -> None:
    """kt::moe_forward (and moe_forward_train, moe_lora_forward) refuse live_tokens outside
    [0, T], of another dtype or with more than one value; the backwards took -1 as 0 (all
    gradients zero), 4 as T = 3, 1.5 as 1 and [1, 2] as 1, with no word."""
    with pytest.raises(error, match="live_tokens"):
        backward_calls(experts, live)[op]()


@pytest.mark.parametrize("op", ["moe_backward", "moe_train_backward", "moe_lora_backward"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.float64])
def test_backward_operators_refuse_a_grad_output_of_another_dtype(experts, op: str, dtype) -> None:
    """grad_output is the forward output's gradient: float32, bfloat16 or float16; an int32
    or float64 one was converted to fp32 without a word."""
    with pytest.raises(ValueError, match="grad_output must be float32, bfloat16 or float16"):
        backward_calls(experts, None, dtype)[op]()
