"""torch.library.opcheck on every operator: schema, fake vs real, autograd registration,
dispatch to the fake under FakeTensorMode."""

from __future__ import annotations

import pytest
import torch

import kt_ops
from conftest import make_experts, random_routing


def moe_samples() -> list[tuple]:
    experts = make_experts(6, 48, 40)
    samples = []
    for tokens, dtype, ids_dtype, weights_dtype in [
        (1, torch.bfloat16, torch.int32, torch.float32),
        (9, torch.float32, torch.int64, torch.bfloat16),
        (20, torch.float16, torch.int32, torch.float16),
        (0, torch.bfloat16, torch.int64, torch.float32),
    ]:
        ids, weights = random_routing(tokens, 6, 3)
        samples.append(
            (torch.randn(tokens, 48).to(dtype), ids.to(ids_dtype), weights.to(weights_dtype), experts.packed.data)
        )
    return samples


@pytest.mark.parametrize("index", range(4))
def test_opcheck_moe_forward(index: int) -> None:
    torch.library.opcheck(torch.ops.kt.moe_forward.default, moe_samples()[index])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt,group,search", [("bf16", 0, False), ("int8", 0, True), ("int4", 32, False), ("int4_asym", 64, True),
                                              ("fp8", 0, False), ("fp8_perchannel", 0, False), ("mxfp8", 0, False)])
def test_opcheck_pack_experts(dtype: torch.dtype, fmt: str, group: int, search: bool) -> None:
    experts = make_experts(3, 128, 64)
    args = (experts.gate.to(dtype), experts.up.to(dtype), experts.down.to(dtype), fmt, group, search)
    torch.library.opcheck(torch.ops.kt.pack_experts.default, args)


@pytest.mark.parametrize("method,group,zero_point", [("AMXINT8", 128, False), ("AMXINT4", 32, True), ("FP8", 128, False),
                                                     ("MXFP8", 128, False)])
def test_opcheck_moe_forward_quantized(method: str, group: int, zero_point: bool) -> None:
    experts = make_experts(6, 128, 64)
    packed = kt_ops.pack_experts(experts.gate, experts.up, experts.down, method=method, group_size=group,
                                 zero_point=zero_point)
    ids, weights = random_routing(9, 6, 2)
    torch.library.opcheck(torch.ops.kt.moe_forward.default, (torch.randn(9, 128), ids, weights, packed.data))


@pytest.mark.parametrize("types", [["Q4_K", "Q4_K", "Q6_K"], ["Q8_0", "F16", "Q4_0"]])
def test_opcheck_gguf(types: list[str]) -> None:
    import gguf

    experts = make_experts(4, 256, 256)
    ids_ = [int(gguf.GGMLQuantizationType[t]) for t in types]
    torch.library.opcheck(torch.ops.kt.pack_gguf_experts.default, (experts.gate, experts.up, experts.down, ids_))
    packed = torch.ops.kt.pack_gguf_experts(experts.gate, experts.up, experts.down, ids_)
    ids, weights = random_routing(5, 4, 2)
    torch.library.opcheck(torch.ops.kt.moe_forward.default, (torch.randn(5, 256), ids, weights, packed))


@pytest.mark.parametrize("fmt", ["fp8", "fp8_perchannel", "mxfp8"])
def test_opcheck_pack_fp8_experts(fmt: str) -> None:
    """The in-place FP8 packer (checkpoint codes and scales), then the kernel on its blob."""
    g = torch.Generator().manual_seed(3)
    E, I, H = 3, 72, 160

    def codes(n: int, k: int) -> torch.Tensor:  # uint8 (opcheck cannot compare float8 tensors), no NaN codes
        c = torch.randint(0, 256, (E, n, k), generator=g, dtype=torch.uint8)
        return torch.where(c & 0x7F == 0x7F, c & 0x80, c)

    def scale(n: int, k: int) -> torch.Tensor:
        if fmt == "fp8":
            return torch.rand(E, -(-n // 128), -(-k // 128), generator=g)
        if fmt == "fp8_perchannel":
            return torch.rand(E, n, generator=g)
        return torch.randint(110, 130, (E, n, -(-k // 32)), generator=g, dtype=torch.uint8)

    args = (codes(I, H), codes(I, H), codes(H, I), scale(I, H), scale(I, H), scale(H, I), fmt)
    torch.library.opcheck(torch.ops.kt.pack_fp8_experts.default, args)
    packed = torch.ops.kt.pack_fp8_experts(*args)
    ids, weights = random_routing(7, E, 2)
    torch.library.opcheck(torch.ops.kt.moe_forward.default, (torch.randn(7, H), ids, weights, packed))


@pytest.mark.parametrize("asym", [False, True])
def test_opcheck_pack_int4_experts(asym: bool) -> None:
    """The in-place INT4 packer (checkpoint levels, scales, minimums), then the kernel."""
    g = torch.Generator().manual_seed(4)
    E, I, H, G = 3, 64, 96, 32

    def levels(n: int, k: int) -> torch.Tensor:
        return torch.randint(0, 256, (E, n, k // 2), generator=g, dtype=torch.uint8)

    def groups(n: int, k: int) -> torch.Tensor:
        return torch.rand(E, n, k // G, generator=g)

    mins = (groups(I, H), groups(I, H), groups(H, I)) if asym else (None, None, None)
    args = (levels(I, H), levels(I, H), levels(H, I), groups(I, H), groups(I, H), groups(H, I), *mins, G)
    torch.library.opcheck(torch.ops.kt.pack_int4_experts.default, args)
    packed = torch.ops.kt.pack_int4_experts(*args)
    ids, weights = random_routing(7, E, 2)
    torch.library.opcheck(torch.ops.kt.moe_forward.default, (torch.randn(7, H), ids, weights, packed))


def _int8_args(**replace: torch.Tensor) -> tuple:
    """pack_int8_experts' arguments (E 2, I 64, H 96), ``replace`` overriding some by name."""
    g = torch.Generator().manual_seed(5)
    E, I, H = 2, 64, 96
    args = {"gate_proj": torch.randint(-127, 128, (E, I, H), generator=g, dtype=torch.int8),
            "up_proj": torch.randint(-127, 128, (E, I, H), generator=g, dtype=torch.int8),
            "down_proj": torch.randint(-127, 128, (E, H, I), generator=g, dtype=torch.int8),
            "gate_scale": torch.rand(E, I, generator=g), "up_scale": torch.rand(E, I, generator=g),
            "down_scale": torch.rand(E, H, generator=g)}
    return tuple({**args, **replace}.values())


def test_opcheck_pack_int8_experts() -> None:
    """The INT8 levels packer (kt-kernel's converted AMXINT8 weights), then the kernel: the
    blob holds w = scale * q exactly."""
    args = _int8_args()
    torch.library.opcheck(torch.ops.kt.pack_int8_experts.default, args)
    packed = kt_ops.PackedExperts(torch.ops.kt.pack_int8_experts(*args))
    for got, levels, scale in zip(kt_ops.dequantize_experts(packed), args[:3], args[3:]):
        assert torch.equal(got.float(), levels.float() * scale[..., None])
    ids, weights = random_routing(7, 2, 2)
    torch.library.opcheck(torch.ops.kt.moe_forward.default, (torch.randn(7, 96), ids, weights, packed.data))


PACK_INT8_REFUSALS = {
    "uint8_levels": (lambda: _int8_args(gate_proj=torch.zeros(2, 64, 96, dtype=torch.uint8)), "gate_proj"),
    "up_shape": (lambda: _int8_args(up_proj=torch.zeros(2, 64, 80, dtype=torch.int8)), "up_proj"),
    "down_shape": (lambda: _int8_args(down_proj=torch.zeros(2, 96, 32, dtype=torch.int8)), "down_proj"),
    "scale_shape": (lambda: _int8_args(gate_scale=torch.rand(2, 64, 1)), "gate_scale"),
    "int_scale": (lambda: _int8_args(down_scale=torch.ones(2, 96, dtype=torch.int32)), "down_scale"),
}


@pytest.mark.parametrize("case", PACK_INT8_REFUSALS)
def test_pack_int8_experts_fake_refuses_what_the_kernel_refuses(case: str) -> None:
    build, match = PACK_INT8_REFUSALS[case]
    fake_and_meta_refuse_like_real(torch.ops.kt.pack_int8_experts.default, build(), match)


@pytest.mark.parametrize("method,kwargs", [("BF16", {}), ("AMXINT4", {"group_size": 32, "zero_point": True}),
                                           ("MXFP8", {}), ("LLAMAFILE", {"gguf_type": ("Q4_K", "Q4_K", "Q6_K")})])
def test_opcheck_dequantize_experts(method: str, kwargs: dict) -> None:
    """The fake's I and H are data-dependent sizes (the blob's header); n is expert_ids'."""
    experts = make_experts(4, 256, 256)
    packed = kt_ops.pack_experts(experts.gate, experts.up, experts.down, method=method, **kwargs).data
    for args in [(packed, torch.tensor([3, 0, 3], dtype=torch.int32)), (packed, torch.tensor([1]), torch.bfloat16),
                 (packed, torch.zeros(0, dtype=torch.int64), torch.float32)]:
        torch.library.opcheck(torch.ops.kt.dequantize_experts.default, args)


def fake_and_meta_refuse_like_real(op, args: tuple, match: str, meta: bool = True) -> None:
    """The real CPU kernel refuses ``args`` with an error matching ``match`` (naming the
    argument); the fake, under FakeTensorMode and (``meta``) on meta tensors, raises the
    same type matching the same pattern instead of returning a size."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map_only

    with pytest.raises((ValueError, TypeError, RuntimeError), match=match) as real:
        op(*args)
    expected = type(real.value)
    with FakeTensorMode() as mode:
        fake_args = tree_map_only(torch.Tensor, mode.from_tensor, args)
        with pytest.raises(expected, match=match) as fake:
            op(*fake_args)
    assert type(fake.value) is expected, f"fake raised {type(fake.value).__name__}, the kernel {expected.__name__}"
    if not meta:
        return
    with pytest.raises(expected, match=match) as on_meta:
        op(*tree_map_only(torch.Tensor, lambda t: t.to("meta"), args))
    got = type(on_meta.value)
    assert got is expected, f"meta raised {got.__name__}, the kernel {expected.__name__}"


def _float_experts(E: int = 2, I: int = 64, H: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)


PACK_EXPERTS_REFUSALS = {
    "up_shape": (lambda g, u, d: (g, torch.randn(2, 64, 160), d, "bf16", 0, False), "up_proj"),
    "down_shape": (lambda g, u, d: (g, u, torch.randn(2, 128, 96), "bf16", 0, False), "down_proj"),
    "gate_2d": (lambda g, u, d: (g[0], u, d, "bf16", 0, False), "gate_proj"),
    "int_gate": (lambda g, u, d: (g.to(torch.int32), u, d, "bf16", 0, False), "gate_proj"),
    "int_up": (lambda g, u, d: (g, u.to(torch.int64), d, "int8", 0, False), "up_proj"),
    "float64_down": (lambda g, u, d: (g, u, d.double(), "bf16", 0, False), "down_proj"),
    "gguf_format": (lambda g, u, d: (g, u, d, "gguf", 0, False), "pack_gguf_experts"),
    "scale_search_bf16": (lambda g, u, d: (g, u, d, "bf16", 0, True), "scale_search"),
    "no_experts": (lambda g, u, d: (g[:0], u[:0], d[:0], "bf16", 0, False), "gate_proj"),
    "group_2_32": (lambda g, u, d: (g, u, d, "int4", 2**32 + 32, False), "group_size"),
}


@pytest.mark.parametrize("case", PACK_EXPERTS_REFUSALS)
def test_pack_experts_fake_refuses_what_the_kernel_refuses(case: str) -> None:
    """The fake returned a blob size for weights the kernel refuses (gate and up of
    different shapes, integer weights, format "gguf", scale_search for bf16, ...)."""
    build, match = PACK_EXPERTS_REFUSALS[case]
    fake_and_meta_refuse_like_real(torch.ops.kt.pack_experts.default, build(*_float_experts()), match)


@pytest.mark.parametrize("case", ["up_shape", "int_gate", "gate_2d"])
def test_pack_gguf_experts_fake_refuses_what_the_kernel_refuses(case: str) -> None:
    g, u, d = _float_experts(2, 256, 256)
    args, match = {
        "up_shape": ((g, torch.randn(2, 256, 512), d), "up_proj"),
        "int_gate": ((g.to(torch.int32), u, d), "gate_proj"),
        "gate_2d": ((g[0], u, d), "gate_proj"),
    }[case]
    fake_and_meta_refuse_like_real(torch.ops.kt.pack_gguf_experts.default, (*args, [12, 12, 14]), match)


def _int4_args(mins: bool = False, **replace) -> tuple:
    E, I, H, G = 2, 64, 128, 32
    levels = lambda n, k: torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8)  # noqa: E731
    groups = lambda n, k: torch.rand(E, n, k // G)  # noqa: E731
    args = {"gate_proj": levels(I, H), "up_proj": levels(I, H), "down_proj": levels(H, I),
            "gate_scale": groups(I, H), "up_scale": groups(I, H), "down_scale": groups(H, I),
            "gate_min": groups(I, H) if mins else None, "up_min": groups(I, H) if mins else None,
            "down_min": groups(H, I) if mins else None, "group_size": G}
    args.update(replace)
    return tuple(args.values())


PACK_INT4_REFUSALS = {
    "one_min": (lambda: _int4_args(gate_min=torch.rand(2, 64, 4)), "gate_min, up_min, down_min"),
    "float_levels": (lambda: _int4_args(gate_proj=torch.rand(2, 64, 64)), "gate_proj"),
    "gate_2d": (lambda: _int4_args(gate_proj=torch.zeros(64, 64, dtype=torch.uint8)), "gate_proj"),
    "up_shape": (lambda: _int4_args(up_proj=torch.zeros(2, 64, 80, dtype=torch.uint8)), "up_proj"),
    "down_rows": (lambda: _int4_args(down_proj=torch.zeros(2, 96, 32, dtype=torch.uint8)), "down_proj"),
    "down_levels": (lambda: _int4_args(down_proj=torch.zeros(2, 128, 48, dtype=torch.uint8)), "down_proj"),
    "scale_shape": (lambda: _int4_args(gate_scale=torch.rand(2, 64, 5)), "gate_scale"),
    "int_scale": (lambda: _int4_args(up_scale=torch.ones(2, 64, 4, dtype=torch.int32)), "up_scale"),
    "min_shape": (lambda: _int4_args(True, down_min=torch.rand(2, 128, 3)), "down_min"),
    "int_min": (lambda: _int4_args(True, up_min=torch.ones(2, 64, 4, dtype=torch.int32)), "up_min"),
    "group_0": (lambda: _int4_args(group_size=0), "group_size"),
}


@pytest.mark.parametrize("case", PACK_INT4_REFUSALS)
def test_pack_int4_experts_fake_refuses_what_the_kernel_refuses(case: str) -> None:
    """The fake returned a blob size for one minimum of three, float levels, mismatched
    shapes and wrong scales (it read gate_proj's shape and gate_min's presence only)."""
    build, match = PACK_INT4_REFUSALS[case]
    fake_and_meta_refuse_like_real(torch.ops.kt.pack_int4_experts.default, build(), match)


def _fp8_args(fmt: str = "fp8", **replace) -> tuple:
    E, I, H = 2, 72, 160
    codes = lambda n, k: torch.randint(0, 120, (E, n, k), dtype=torch.uint8)  # noqa: E731

    def scale(n: int, k: int) -> torch.Tensor:
        if fmt == "fp8_perchannel":
            return torch.rand(E, n)
        if fmt == "mxfp8":
            return torch.full((E, n, -(-k // 32)), 127, dtype=torch.uint8)
        return torch.rand(E, -(-n // 128), -(-k // 128))

    args = {"gate_proj": codes(I, H), "up_proj": codes(I, H), "down_proj": codes(H, I), "gate_scale": scale(I, H),
            "up_scale": scale(I, H), "down_scale": scale(H, I), "format": fmt}
    args.update(replace)
    return tuple(args.values())


PACK_FP8_REFUSALS = {
    "format_bf16": (lambda: _fp8_args(format="bf16"), "bf16"),
    "float_codes": (lambda: _fp8_args(gate_proj=torch.rand(2, 72, 160)), "gate_proj"),
    "gate_2d": (lambda: _fp8_args(gate_proj=torch.zeros(72, 160, dtype=torch.uint8)), "gate_proj"),
    "up_shape": (lambda: _fp8_args(up_proj=torch.zeros(2, 72, 161, dtype=torch.uint8)), "up_proj"),
    "down_shape": (lambda: _fp8_args(down_proj=torch.zeros(2, 160, 73, dtype=torch.uint8)), "down_proj"),
    "scale_shape": (lambda: _fp8_args(gate_scale=torch.rand(2, 1, 3)), "gate_scale"),
    "int_scale": (lambda: _fp8_args(down_scale=torch.ones(2, 2, 1, dtype=torch.int32)), "down_scale"),
    "e4m3_scale": (lambda: _fp8_args(up_scale=torch.rand(2, 1, 2).to(torch.float8_e4m3fn)), "up_scale"),
    "perchannel_shape": (lambda: _fp8_args("fp8_perchannel", up_scale=torch.rand(2, 72, 2)), "up_scale"),
    "mxfp8_float_scale": (lambda: _fp8_args("mxfp8", gate_scale=torch.rand(2, 72, 5)), "gate_scale"),
    "mxfp8_scale_shape": (lambda: _fp8_args("mxfp8", down_scale=torch.zeros(2, 160, 2, dtype=torch.uint8)),
                          "down_scale"),
}


@pytest.mark.parametrize("case", PACK_FP8_REFUSALS)
def test_pack_fp8_experts_fake_refuses_what_the_kernel_refuses(case: str) -> None:
    """The fake returned a blob size for a non-FP8 format, float weights, mismatched
    shapes and scales of the wrong dtype or shape (it read gate_proj's shape only)."""
    build, match = PACK_FP8_REFUSALS[case]
    fake_and_meta_refuse_like_real(torch.ops.kt.pack_fp8_experts.default, build(), match)


GATE_UP_REFUSALS = {
    "bf16": (lambda T, K, I: torch.zeros(T, K, 2 * I, dtype=torch.bfloat16), "gate_up"),
    "rows": (lambda T, K, I: torch.zeros(T + 1, K, 2 * I), "gate_up"),
    "slots": (lambda T, K, I: torch.zeros(T, K + 1, 2 * I), "gate_up"),
    "flat": (lambda T, K, I: torch.zeros(T * K, 2 * I), "gate_up"),
    "odd": (lambda T, K, I: torch.zeros(T, K, 2 * I + 1), "gate_up"),
}


@pytest.mark.parametrize("op", ["moe_train_backward", "moe_lora_backward"])
@pytest.mark.parametrize("case", GATE_UP_REFUSALS)
def test_backward_fakes_check_gate_up_like_the_kernel(op: str, case: str) -> None:
    """The fakes did not check gate_up (a 3-D one of any dtype and shape passed, the
    lora fake took any) where the kernel wants float32 [T, K, 2 * I]."""
    E, H, I, T, K, r = 4, 32, 16, 3, 2, 2
    experts = make_experts(E, H, I)
    ids, w = random_routing(T, E, K)
    x = torch.randn(T, H)
    gate_up = GATE_UP_REFUSALS[case][0](T, K, I)
    if op == "moe_train_backward":
        args = (x, x, ids, w, experts.packed.data, gate_up)
    else:
        lora = [torch.zeros(E, r, H), torch.zeros(E, I, r), torch.zeros(E, r, H), torch.zeros(E, I, r),
                torch.zeros(E, r, I), torch.zeros(E, H, r)]
        args = (x, x, ids, w, experts.packed.data, *lora, 1.0, None, gate_up)
    fake_and_meta_refuse_like_real(getattr(torch.ops.kt, op).default, args, GATE_UP_REFUSALS[case][1])


def _moe_args() -> dict:
    """Good arguments of every MoE operator (E, H, I = 4, 32, 16; 3 tokens, top-2, rank-2
    LoRA), by argument name."""
    E, H, I, T, K, r = 4, 32, 16, 3, 2, 2
    ids, w = random_routing(T, E, K)
    x = torch.randn(T, H)
    return {"grad_output": x, "hidden_states": x, "topk_ids": ids, "topk_weights": w,
            "packed": make_experts(E, H, I).packed.data, "intermediate_size": I, "gate_up_delta": None,
            "gate_a": torch.zeros(E, r, H), "gate_b": torch.zeros(E, I, r), "up_a": torch.zeros(E, r, H),
            "up_b": torch.zeros(E, I, r), "down_a": torch.zeros(E, r, I), "down_b": torch.zeros(E, H, r),
            "scaling": 1.0, "live_tokens": None, "gate_up": torch.zeros(T, K, 2 * I)}


_ARGUMENTS = {
    "moe_forward": ("hidden_states", "topk_ids", "topk_weights", "packed", "live_tokens"),
    "moe_forward_train": ("hidden_states", "topk_ids", "topk_weights", "packed", "intermediate_size",
                          "gate_up_delta", "live_tokens"),
    "moe_backward": ("grad_output", "hidden_states", "topk_ids", "topk_weights", "packed", "live_tokens"),
    "moe_train_backward": ("grad_output", "hidden_states", "topk_ids", "topk_weights", "packed", "gate_up",
                           "live_tokens"),
    "moe_lora_forward": ("hidden_states", "topk_ids", "topk_weights", "packed", "gate_a", "gate_b", "up_a", "up_b",
                         "down_a", "down_b", "scaling", "live_tokens"),
    "moe_lora_backward": ("grad_output", "hidden_states", "topk_ids", "topk_weights", "packed", "gate_a", "gate_b",
                          "up_a", "up_b", "down_a", "down_b", "scaling", "live_tokens", "gate_up"),
}

# name: (what to change, the pattern both errors match); the kernel's error type is the
# expected one (fake_and_meta_refuse_like_real).
MOE_CALL_REFUSALS = {
    "hidden_f64": (lambda a: {"hidden_states": a["hidden_states"].double()}, "hidden_states must have dtype"),
    "ids_float": (lambda a: {"topk_ids": a["topk_ids"].float()}, "topk_ids must have dtype"),
    "weights_f64": (lambda a: {"topk_weights": a["topk_weights"].double()}, "topk_weights must have dtype"),
    "hidden_3d": (lambda a: {"hidden_states": a["hidden_states"][None], "grad_output": a["grad_output"][None]},
                  "hidden_states must be 2-D"),
    "ids_1d": (lambda a: {"topk_ids": a["topk_ids"].flatten()}, "topk_ids must be 2-D"),
    "weights_shape": (lambda a: {"topk_weights": a["topk_weights"][:, :1].contiguous()},
                      "topk_weights must have the shape of topk_ids"),
    "rows": (lambda a: {"topk_ids": a["topk_ids"][:2], "topk_weights": a["topk_weights"][:2]},
             "topk_ids has 2 rows but hidden_states has 3 tokens"),
    "packed_f32": (lambda a: {"packed": a["packed"].float()}, "packed must have dtype"),
    "packed_2d": (lambda a: {"packed": a["packed"][None]}, "packed must be 1-D"),
    "live_float": (lambda a: {"live_tokens": torch.tensor([1.5])}, "live_tokens must have dtype"),
    "live_two": (lambda a: {"live_tokens": torch.tensor([1, 2])}, "live_tokens must hold one value"),
}


def _call(op: str, **replace) -> tuple:
    args = _moe_args()
    args.update(replace)
    return getattr(torch.ops.kt, op).default, tuple(args[name] for name in _ARGUMENTS[op])


@pytest.mark.parametrize("op", list(_ARGUMENTS))
@pytest.mark.parametrize("case", MOE_CALL_REFUSALS)
def test_moe_fakes_refuse_the_calls_the_kernels_refuse(op: str, case: str) -> None:
    """The fakes took activations, ids and weights of any dtype, a float32 or 2-D packed
    and a float or two-valued live_tokens (all refused by the kernels), and refused bad
    ranks and row counts with torch._check's RuntimeError where the kernels raise a
    ValueError."""
    change, match = MOE_CALL_REFUSALS[case]
    fn, args = _call(op, **change(_moe_args()))
    fake_and_meta_refuse_like_real(fn, args, match)


OP_REFUSALS = {
    "moe_forward_train I 0": ("moe_forward_train", lambda a: {"intermediate_size": 0}, "intermediate_size"),
    "moe_forward_train delta int32": ("moe_forward_train", lambda a: {
        "gate_up_delta": torch.zeros(3, 2, 32, dtype=torch.int32)}, "gate_up_delta must have dtype"),
    "moe_forward_train delta f64": ("moe_forward_train", lambda a: {
        "gate_up_delta": torch.zeros(3, 2, 32, dtype=torch.float64)}, "gate_up_delta must have dtype"),
    "moe_forward_train delta 2I + 2": ("moe_forward_train", lambda a: {"gate_up_delta": torch.zeros(3, 2, 34)},
                                       r"gate_up_delta must be \[T, K, 2 \* I\]"),
    "moe_backward grad rows": ("moe_backward", lambda a: {"grad_output": a["grad_output"][:2]},
                               "grad_output must have"),
    "moe_backward grad int": ("moe_backward", lambda a: {"grad_output": a["grad_output"].int()},
                              "grad_output must"),
    "moe_train_backward grad f64": ("moe_train_backward", lambda a: {"grad_output": a["grad_output"].double()},
                                    "grad_output must"),
    "moe_lora_backward grad int": ("moe_lora_backward", lambda a: {"grad_output": a["grad_output"].int()},
                                   "grad_output must"),
    "moe_lora_forward gate_a 2-D": ("moe_lora_forward", lambda a: {"gate_a": a["gate_a"][0]}, "gate_a must be 3-D"),
    "moe_lora_backward down_a 2-D": ("moe_lora_backward", lambda a: {"down_a": a["down_a"][0]},
                                     "down_a must be 3-D"),
    "moe_lora_forward up_b I + 1": ("moe_lora_forward", lambda a: {"up_b": torch.zeros(4, 17, 2)}, "up_b must be"),
    "moe_lora_forward gate_b rank 3": ("moe_lora_forward", lambda a: {"gate_b": torch.zeros(4, 16, 3)},
                                       "gate_b must be"),
    "moe_lora_forward gate_a H + 1": ("moe_lora_forward", lambda a: {"gate_a": torch.zeros(4, 2, 33)},
                                      "gate_a must be"),
    "moe_lora_backward down_b H + 1": ("moe_lora_backward", lambda a: {"down_b": torch.zeros(4, 33, 2)},
                                       "down_b must be"),
    "moe_lora_backward down_a E - 1": ("moe_lora_backward", lambda a: {"down_a": torch.zeros(3, 2, 16)},
                                       "down_a must be"),
    "moe_lora_backward gate_up 2I + 2": ("moe_lora_backward", lambda a: {"gate_up": torch.zeros(3, 2, 34)},
                                         r"gate_up must be \[T, K, 2 \* I\]"),
    # The kernel checked the adapters' fp32 copies (an int32 one passed, its gradient int32).
    "moe_lora_forward gate_a int32": ("moe_lora_forward", lambda a: {"gate_a": a["gate_a"].int()},
                                      "gate_a must have dtype"),
    "moe_lora_backward down_b int64": ("moe_lora_backward", lambda a: {"down_b": a["down_b"].long()},
                                       "down_b must have dtype"),
}


@pytest.mark.parametrize("case", OP_REFUSALS)
def test_training_fakes_refuse_what_the_kernels_refuse(case: str) -> None:
    """The training fakes passed a gate_up_delta of any dtype, a grad_output of any dtype,
    LoRA matrices of mismatched shapes and a LoRA gate_up of the wrong even width, and
    raised torch._check's RuntimeError for the bad intermediate_size, gate_up_delta and
    grad_output shapes and 2-D LoRA matrices where the kernels raise a ValueError."""
    op, change, match = OP_REFUSALS[case]
    fn, args = _call(op, **change(_moe_args()))
    fake_and_meta_refuse_like_real(fn, args, match)


PARTS_REFUSALS = {
    "no_parts": (lambda x, ids, w, p: (x, ids, w, [], []), "parts must hold at least one packed blob"),
    "nodes_len": (lambda x, ids, w, p: (x, ids, w, [p], [0, 1]), "nodes has 2 entries but parts has 1"),
    "node_negative": (lambda x, ids, w, p: (x, ids, w, [p], [-1]), r"nodes\[0\] = -1 is not a NUMA node id"),
    "node_2_30": (lambda x, ids, w, p: (x, ids, w, [p, p], [0, 1 << 30]), r"nodes\[1\] = 1073741824"),
    "ids_float": (lambda x, ids, w, p: (x, ids.float(), w, [p], [0]), "topk_ids must have dtype"),
    "rows": (lambda x, ids, w, p: (x[:2], ids, w, [p], [0]), "topk_ids has 3 rows"),
    "part_f32": (lambda x, ids, w, p: (x, ids, w, [p, p.float()], [0, 0]), r"parts\[1\] must have dtype"),
    "hidden_strided": (lambda x, ids, w, p: (x.t().contiguous().t(), ids, w, [p], [0]), "hidden_states must be contig"),
}


@pytest.mark.parametrize("case", PARTS_REFUSALS)
def test_moe_forward_parts_fake_refuses_what_the_kernel_refuses(case: str) -> None:
    """The parts fake raised torch._check's RuntimeError for no parts and a nodes list of
    another length (the kernel: ValueError), took any node id, and checked part 0 only,
    without the dtypes."""
    a = _moe_args()
    build, match = PARTS_REFUSALS[case]
    args = build(a["hidden_states"], a["topk_ids"], a["topk_weights"], a["packed"])
    fake_and_meta_refuse_like_real(torch.ops.kt.moe_forward_parts.default, args, match)


@pytest.mark.parametrize("name", ["hidden_states", "topk_ids", "topk_weights"])
def test_moe_forward_fakes_refuse_strided_activations_as_the_kernels_do(name: str) -> None:
    """The kernels refuse a non-contiguous hidden_states, topk_ids or topk_weights (checks.cpp, and the CUDA kernel);
    the fakes accepted them, so a traced graph failed only when it first ran."""
    a = _moe_args()
    a[name] = a[name].t().contiguous().t()
    args = (a["hidden_states"], a["topk_ids"], a["topk_weights"], a["packed"])
    fake_and_meta_refuse_like_real(torch.ops.kt.moe_forward.default, args, f"{name} must be contiguous")
    fake_and_meta_refuse_like_real(torch.ops.kt.moe_forward_train.default, (*args, a["intermediate_size"]),
                                   f"{name} must be contiguous")


@pytest.mark.parametrize("name", ["hidden_states", "topk_ids", "topk_weights"])
@pytest.mark.parametrize("op", ["moe_backward", "moe_train_backward", "moe_lora_forward", "moe_lora_backward"])
def test_training_fakes_take_strided_activations_as_the_kernels_do(op: str, name: str) -> None:
    """The backward and LoRA kernels (moe_train_cpu.cpp) make hidden_states, topk_ids and topk_weights contiguous
    themselves; their fakes refused them as moe_forward's do, so a compiled LoRA layer fed a transposed or sliced
    hidden_states failed at trace time where eager ran. The fake's outputs are the kernel's, strides included."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map_only

    a = _moe_args()
    a[name] = a[name].t().contiguous().t()
    assert not a[name].is_contiguous()
    args = tuple(a[arg] for arg in _ARGUMENTS[op])
    real = getattr(torch.ops.kt, op).default(*args)
    with FakeTensorMode() as mode:
        fake = getattr(torch.ops.kt, op).default(*tree_map_only(torch.Tensor, mode.from_tensor, args))
    real, fake = (t if isinstance(t, tuple) else (t,) for t in (real, fake))
    assert [(t.shape, t.dtype, t.stride()) for t in fake] == [(t.shape, t.dtype, t.stride()) for t in real]


@pytest.mark.parametrize("op", list(_ARGUMENTS) + ["moe_forward_parts", "dequantize_experts"])
def test_fakes_refuse_a_strided_blob_as_the_kernels_do(op: str) -> None:
    """Every kernel refuses a non-contiguous packed blob (read_packed); the fakes returned sizes, so a traced graph
    failed only when it first ran."""
    a = _moe_args()
    spread = torch.zeros(2 * a["packed"].numel(), dtype=torch.uint8)
    spread[::2] = a["packed"]
    a["packed"] = spread[::2]
    if op == "moe_forward_parts":
        args, match = (a["hidden_states"], a["topk_ids"], a["topk_weights"], [a["packed"]], [0]), r"parts\[0\]"
    elif op == "dequantize_experts":
        args, match = (a["packed"], torch.tensor([0, 1])), "packed"
    else:
        args, match = tuple(a[arg] for arg in _ARGUMENTS[op]), "packed"
    fake_and_meta_refuse_like_real(getattr(torch.ops.kt, op).default, args, f"{match} must be contiguous", meta=False)


DEQUANTIZE_REFUSALS = {
    "ids_2d": (lambda p: (p, torch.tensor([[0, 1]])), "expert_ids must be 1-D"),
    "ids_float": (lambda p: (p, torch.tensor([0.0, 1.0])), "expert_ids must have dtype"),
    "dtype_f16": (lambda p: (p, torch.tensor([0, 1]), torch.float16), "dtype must be float32 or bfloat16"),
    "packed_f32": (lambda p: (p.float(), torch.tensor([0, 1])), "packed must have dtype"),
    "packed_2d": (lambda p: (p[None], torch.tensor([0, 1])), "packed must be 1-D"),
}


@pytest.mark.parametrize("case", DEQUANTIZE_REFUSALS)
def test_dequantize_experts_fake_refuses_what_the_kernel_refuses(case: str) -> None:
    """The fake raised torch._check's RuntimeError for 2-D expert_ids (the kernel:
    ValueError) and a float16 dtype (TypeError), and went on to a data-dependent size for
    float ids and a float blob. Under FakeTensorMode only: a meta blob is refused first
    (test_dequantize_experts_op_names_a_meta_blob)."""
    build, match = DEQUANTIZE_REFUSALS[case]
    fake_and_meta_refuse_like_real(torch.ops.kt.dequantize_experts.default, build(make_experts(2, 64, 32).packed.data),
                                   match, meta=False)


def test_dequantize_experts_op_names_a_meta_blob() -> None:
    """torch.ops.kt.dequantize_experts on a meta blob said torch's generic "data-dependent
    output" (I and H are in the blob's bytes); it names packed and the meta device, as
    kt_ops.dequantize_experts does."""
    packed = make_experts(2, 64, 32).packed.data.to("meta")
    for ids in (torch.tensor([0, 1]).to("meta"), torch.tensor([0, 1])):
        with pytest.raises(ValueError, match="packed is on the meta device"):
            torch.ops.kt.dequantize_experts(packed, ids)
