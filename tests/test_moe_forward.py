"""torch.ops.kt.moe_forward against the fp32 reference: every CPU variant, odd shapes,
skip slots, repeated experts, every input dtype.

Tolerances. The weights are bf16 and stored exactly, so only the kernel's arithmetic
differs from the reference:
- avx512_bf16 / amx round activations and the SiLU*up intermediate to bf16 for
  vdpbf16ps: each rounding is <= 2^-9 relative, so the output's relative Frobenius
  error is a few 1e-3 (measured 1.7e-3 to 2.5e-3); the bound is 1e-2.
- avx512 / avx_vnni / avx2 compute in fp32 end to end: with fp32 in and out only the summation
  order differs (measured ~1e-7); the bound is 1e-5. A bf16 or fp16 output adds one
  rounding (<= 2^-9 / 2^-11 relative).
The elementwise bound (largest error / largest |ref| <= 3e-2) catches a single wrong
row or column that a Frobenius norm over many elements would dilute.
"""

from __future__ import annotations

import pytest
import torch

import kt_ops
from conftest import long_k_prefill, make_experts, max_err, random_routing, rel_err

FP32_ACTIVATION_VARIANTS = {"avx512", "avx512_vnni", "avx_vnni", "avx2"}  # BF16 by fp32 FMA (the avx512 / avx2 kernels)

# (E, top_k, H, I, tokens): H and I off every tile multiple (16 rows, pairs, 4-block
# tiles, AVX2's 128-pair k blocks; AVX-512's 1024-pair blocks: test_prefill_k_blocks_past_2048),
# one expert, top-k = E, tokens from 0 to past the
# 48-row chunk, and experts with more tokens than one micro-tile.
SHAPES = [
    (8, 2, 64, 32, 1),
    (8, 3, 70, 40, 3),
    (1, 1, 33, 17, 17),
    (4, 4, 48, 24, 5),
    (6, 2, 130, 100, 17),
    (4, 2, 300, 260, 300),
    (16, 4, 96, 48, 300),
    (3, 2, 2, 1, 7),
]


def tolerance(variant: str, dtype: torch.dtype) -> float:
    if variant in FP32_ACTIVATION_VARIANTS:
        return {torch.float32: 1e-5, torch.bfloat16: 6e-3, torch.float16: 2e-3}[dtype]
    return 1e-2


def check(out: torch.Tensor, ref: torch.Tensor, bound: float) -> None:
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= bound, f"relative error {rel_err(out, ref):.3g} > {bound}"
    assert max_err(out, ref) <= max(3 * bound, 3e-2), f"max error {max_err(out, ref):.3g}"


@pytest.mark.parametrize("E,top_k,H,I,T", SHAPES, ids=[f"E{s[0]}k{s[1]}H{s[2]}I{s[3]}T{s[4]}" for s in SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
def test_matches_reference(variant: str, E: int, top_k: int, H: int, I: int, T: int, dtype: torch.dtype) -> None:
    experts = make_experts(E, H, I, seed=E * 1000 + H)
    ids, weights = random_routing(T, E, top_k, seed=T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dtype)
    out = kt_ops.moe_forward(x, ids, weights, experts.packed)
    assert out.dtype == dtype
    ref = kt_ops.reference.moe_forward(x, ids, weights, experts.gate, experts.up, experts.down)
    check(out, ref, tolerance(variant, dtype))


@pytest.mark.parametrize("H,I", [(2200, 48), (48, 2100)], ids=["gate_up_k2200", "down_k2100"])
def test_prefill_k_blocks_past_2048(variant: str, H: int, I: int) -> None:
    """Prefill runs k in blocks of 1024 pairs on the AVX-512 variants (128 on AVX2): a k of
    2200 (gate/up) or 2100 (down) is one whole block and a partial one. Each token's row
    equals, bit for bit, the row of the same token computed alone (the decode path; on amx,
    whose prefill runs on AMX tiles that sum in their own order, within 1e-5), and the
    layer matches the reference."""
    E, T = 2, 20
    experts = make_experts(E, H, I, seed=H + I)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    out, ids, weights = long_k_prefill(experts.packed, x, E, tile_bound=1e-5 if variant == "amx" else None)
    ref = kt_ops.reference.moe_forward(x, ids, weights, experts.gate, experts.up, experts.down)
    check(out, ref, tolerance(variant, torch.float32))


def test_skip_slots_and_repeated_experts(variant: str) -> None:
    E, H, I, T = 5, 72, 56, 40
    experts = make_experts(E, H, I, seed=3)
    ids = torch.randint(-1, E, (T, 4), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    ids[0] = -1  # a token whose every slot is skipped gives zeros
    ids[1] = torch.tensor([2, 2, 2, -1])  # the same expert in several slots counts each time
    weights = torch.rand(T, 4)
    x = torch.randn(T, H).bfloat16()
    out = kt_ops.moe_forward(x, ids, weights, experts.packed)
    ref = kt_ops.reference.moe_forward(x, ids, weights, experts.gate, experts.up, experts.down)
    assert torch.equal(out[0], torch.zeros(H, dtype=out.dtype))
    check(out, ref, tolerance(variant, torch.bfloat16))


def test_top_k_above_the_expert_count(variant: str) -> None:
    """top-k may exceed E: the slots beyond a row's experts are -1 (an expert computed
    elsewhere) or repeat one. The operator refused such calls ("top-k exceeds the number
    of experts"), which layers with most experts on the GPU made (one packed expert, top-k
    2). A row equals the same row computed alone with its -1 slots removed, bit for bit."""
    E, H, I, T = 2, 48, 40, 5  # at most 6 tokens per expert: no AMX tiles (see test_invariants)
    experts = make_experts(E, H, I, seed=11)
    ids = torch.tensor([[1, -1, -1, -1, 0], [0, 1, 1, -1, -1], [-1] * 5] + [[-1, 0, -1, 1, -1]] * (T - 3))
    ids = ids.to(torch.int32)
    weights = torch.rand(T, 5, generator=torch.Generator().manual_seed(2))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = kt_ops.moe_forward(x, ids, weights, experts.packed)
    ref = kt_ops.reference.moe_forward(x, ids, weights, experts.gate, experts.up, experts.down)
    assert torch.equal(out[2], torch.zeros(H, dtype=out.dtype))
    check(out, ref, tolerance(variant, torch.bfloat16))
    for t in (0, 1, 3):
        kept = ids[t] >= 0
        alone = kt_ops.moe_forward(x[t:t + 1], ids[t:t + 1, kept], weights[t:t + 1, kept], experts.packed)
        assert torch.equal(out[t:t + 1], alone), t


def test_all_slots_skipped_gives_zeros(variant: str) -> None:
    experts = make_experts(4, 32, 16)
    ids = torch.full((3, 2), -1, dtype=torch.int32)
    out = kt_ops.moe_forward(torch.randn(3, 32), ids, torch.rand(3, 2), experts.packed)
    assert torch.equal(out, torch.zeros(3, 32))


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_routing_weights(variant: str, weights_dtype: torch.dtype) -> None:
    experts = make_experts(6, 64, 48)
    ids, weights = random_routing(9, 6, 3)
    weights = weights.to(weights_dtype)
    x = torch.randn(9, 64)
    out = kt_ops.moe_forward(x, ids, weights, experts.packed)
    ref = kt_ops.reference.moe_forward(x, ids, weights, experts.gate, experts.up, experts.down)
    check(out, ref, tolerance(variant, torch.float32))


def test_empty_batch_returns_empty(variant: str) -> None:
    experts = make_experts(4, 32, 16)
    out = kt_ops.moe_forward(
        torch.empty(0, 32, dtype=torch.bfloat16), torch.empty(0, 2, dtype=torch.int32), torch.empty(0, 2), experts.packed
    )
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16


def test_variants_agree_with_each_other() -> None:
    """Every supported variant gives the same answer within the bf16 tolerance."""
    experts = make_experts(8, 96, 80)
    ids, weights = random_routing(20, 8, 2)
    x = torch.randn(20, 96)
    previous = kt_ops.cpu_variant()
    outputs = {}
    try:
        for name in kt_ops.supported_cpu_variants():
            kt_ops.set_cpu_variant(name)
            outputs[name] = kt_ops.moe_forward(x, ids, weights, experts.packed)
    finally:
        kt_ops.set_cpu_variant(previous)
    first = next(iter(outputs.values()))
    for name, out in outputs.items():
        assert rel_err(out, first) <= 1e-2, name


def test_output_is_fresh_and_input_untouched() -> None:
    experts = make_experts(4, 32, 16)
    ids, weights = random_routing(6, 4, 2)
    x = torch.randn(6, 32).bfloat16()
    x_copy = x.clone()
    out = kt_ops.moe_forward(x, ids, weights, experts.packed)
    assert out.data_ptr() != x.data_ptr()
    assert torch.equal(x, x_copy)


def test_reference_matches_independent_loop() -> None:
    """The oracle itself, against the Hugging Face-style loop of the benchmark in fp32."""
    from kt_ops.bench.baseline import torch_moe_forward

    experts = make_experts(6, 40, 24)
    ids, weights = random_routing(11, 6, 3)
    x = torch.randn(11, 40)
    ref = kt_ops.reference.moe_forward(x, ids, weights, experts.gate, experts.up, experts.down)
    loop = torch_moe_forward(x, ids, weights, experts.gate.float(), experts.up.float(), experts.down.float())
    torch.testing.assert_close(ref, loop, rtol=1e-5, atol=1e-5)
