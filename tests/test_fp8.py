"""FP8 formats (fp8, fp8_perchannel, mxfp8): online quantization (C++ vs torch's own
float8_e4m3fn cast), in-place packing of checkpoint codes and scales (decoded
independently by kt_ops.reference.dequantize), and the kernels of every CPU variant
against the fp32 reference on the dequantized weights.

Per kernel case two comparisons, each able to fail on its own:
- tight: the reference with the kernel's activation rounding simulated (bf16 on
  avx512_bf16 / amx, whose vdpbf16ps multiplies bf16; none on the fp32 variants): only the
  summation order differs (and, on the bf16 variants, an intermediate's bf16 rounding
  can flip with it), bound 1e-4;
- the issue's bound: the plain fp32 reference on the dequantized weights, relative
  (Frobenius) error <= 1e-2, as for BF16.
"""

from __future__ import annotations

import math

import pytest
import torch

import kt_ops
from conftest import long_k_prefill, random_routing, rel_err
from kt_ops import reference
from test_quantized import make_weights

FORMATS = {"FP8": "fp8", "FP8_PERCHANNEL": "fp8_perchannel", "MXFP8": "mxfp8"}

# (E, top_k, H, I, tokens): H and I off 16 rows, 32 k and 128 k; one expert; tokens past
# one row tile (4 / 6) and past the 96-row chunk; k over several of fp8's 256-k decode
# blocks (the 2048-k blocks of prefill and of the other formats' decode:
# test_prefill_k_blocks_past_2048); decode
# experts (at most 6 tokens) with jobs of several 4-block groups (16 gate/up, 32 down
# blocks here), the last group partial.
SHAPES = [
    (4, 2, 64, 32, 1),
    (3, 3, 96, 48, 5),
    (1, 1, 200, 72, 9),
    (6, 2, 328, 136, 40),
    (4, 2, 600, 264, 300),
    (8, 4, 520, 1032, 5),
]


def torch_quantize(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """What pack_experts must store for ``w [E, N, K]``, computed with torch's own e4m3
    cast (round to nearest even), dequantized to fp32."""
    w = w.float()
    E, N, K = w.shape
    if fmt == "fp8_perchannel":
        s = w.abs().amax(dim=-1, keepdim=True) / 448.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        return (w / s).to(torch.float8_e4m3fn).float() * s
    group = 128 if fmt == "fp8" else 32
    Kp = -(-K // group) * group
    g = torch.nn.functional.pad(w, (0, Kp - K)).reshape(E, N, Kp // group, group)
    if fmt == "fp8":
        Np = -(-N // 128) * 128
        blocks = torch.nn.functional.pad(g, (0, 0, 0, 0, 0, Np - N)).reshape(E, Np // 128, 128, Kp // group, group)
        amax = blocks.abs().amax(dim=(2, 4), keepdim=True)
        s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        out = ((blocks / s).to(torch.float8_e4m3fn).float() * s).reshape(E, Np, Kp)
        return out[:, :N, :K]
    amax = g.abs().amax(dim=-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax.double() / 448.0)).clamp_min(10 - 127)  # smallest 2^e >= amax / 448
    exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent))
    s = torch.exp2(exponent).float()
    return ((g / s).to(torch.float8_e4m3fn).float() * s).reshape(E, N, Kp)[:, :, :K]


# amx: an AMX-tile row (prefill) against the same token's vector row (decode), fp32
# outputs; tdpbf16ps sums the same bf16 products in another order.
AMX_TILE_BOUND = 1e-5


def activation_rounding(variant: str) -> tuple | bool:
    return ("bf16", "bf16", "bf16") if variant in ("avx512_bf16", "amx") else False


def cases() -> list:
    return [pytest.param(m, f, *shape, id=f"{f}-E{shape[0]}k{shape[1]}H{shape[2]}I{shape[3]}T{shape[4]}")
            for m, f in FORMATS.items() for shape in SHAPES]


@pytest.mark.parametrize("method,fmt,E,top_k,H,I,T", cases())
def test_kernel_matches_reference(variant: str, method: str, fmt: str, E: int, top_k: int, H: int, I: int,
                                  T: int) -> None:
    gate, up, down = make_weights(E, H, I, seed=E * 1000 + H + I)
    packed = kt_ops.pack_experts(gate, up, down, method=method)
    assert packed.format == fmt
    dq = reference.dequantize(packed.data)
    for got, w in zip(dq, (gate, up, down)):
        torch.testing.assert_close(got, torch_quantize(w, fmt), rtol=0, atol=0)
    ids, weights = random_routing(T, E, top_k, seed=T + H)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))  # fp32: no output rounding
    out = kt_ops.moe_forward(x, ids, weights, packed)
    assert out.dtype == x.dtype and torch.isfinite(out).all()
    tight = reference.moe_forward(x, ids, weights, *dq, quantize_activations=activation_rounding(variant))
    plain = reference.moe_forward(x, ids, weights, *dq)
    assert rel_err(out, tight) <= 1e-4, f"vs the reference with the kernel's activations: {rel_err(out, tight):.3g}"
    assert rel_err(out, plain) <= 1e-2, f"vs the fp32 reference: {rel_err(out, plain):.3g}"


@pytest.mark.parametrize("H,I", [(2200, 48), (48, 2100)], ids=["gate_up_k2200", "down_k2100"])
@pytest.mark.parametrize("method,fmt", list(FORMATS.items()), ids=list(FORMATS.values()))
def test_prefill_k_blocks_past_2048(variant: str, method: str, fmt: str, H: int, I: int) -> None:
    """Prefill runs k in blocks of 2048 (so does the decode of fp8_perchannel and mxfp8;
    fp8's: 256): a k of 2200 (gate/up) or 2100 (down) is one whole block and a partial
    one. Each token's row equals, bit for bit, the row of the same token computed alone
    (the decode path; on amx, where prefill runs on AMX tiles that sum in their own order,
    within AMX_TILE_BOUND), and the layer matches the reference."""
    E, T = 2, 20
    gate, up, down = make_weights(E, H, I, seed=H + I)
    packed = kt_ops.pack_experts(gate, up, down, method=method)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    amx = variant == "amx"
    out, ids, weights = long_k_prefill(packed, x, E, tile_bound=AMX_TILE_BOUND if amx else None, tiles_must_differ=amx)
    dq = reference.dequantize(packed.data)
    tight = reference.moe_forward(x, ids, weights, *dq, quantize_activations=activation_rounding(variant))
    assert rel_err(out, tight) <= 1e-4, f"vs the reference with the kernel's activations: {rel_err(out, tight):.3g}"


def test_quantizer_codes_equal_torch_cast() -> None:
    """Every e4m3 code value, the midpoints between them (ties to even) and values below
    the smallest subnormal: the C++ round-to-nearest-even agrees with torch's cast."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    values = torch.cat([finite, mids, torch.tensor([447.9, 2.0**-10, -(2.0**-10) * 1.5, 1e-9, -1e-9])])
    n = values.numel()
    K = 32 * math.ceil(n / 32)
    w = torch.nn.functional.pad(values, (0, K - n)).reshape(1, 1, K)
    # one row with max|w| = 448 exactly: per-channel scale 1, so the codes are the values' own
    w[0, 0, -1] = 448.0
    packed = kt_ops.pack_experts(w, w, w.transpose(1, 2).contiguous().expand(1, K, 1).contiguous(),
                                 method="FP8_PERCHANNEL")
    gate = reference.dequantize(packed.data)[0][0, 0]
    expected = values.to(torch.float8_e4m3fn).float()
    torch.testing.assert_close(gate[:n], expected, rtol=0, atol=0)


def checkpoint_tensors(fmt: str, E: int, H: int, I: int, seed: int = 0, codes_from: torch.Tensor | None = None):
    """Random e4m3 codes (every code value, NaN and subnormal codes included) and scales in
    the checkpoint's own shapes, and the fp32 weights they mean."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in ((I, H), (I, H), (H, I)):
        codes = torch.randint(0, 256, (E, n, k), generator=g, dtype=torch.uint8)
        if fmt == "fp8":
            scale = torch.rand(E, -(-n // 128), -(-k // 128), generator=g) + 0.5
            per_k = scale.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]
        elif fmt == "fp8_perchannel":
            scale = torch.rand(E, n, 1, generator=g) + 0.5
            per_k = scale.expand(E, n, k)
        else:
            scale = torch.randint(100, 140, (E, n, -(-k // 32)), generator=g, dtype=torch.uint8)
            per_k = reference.decode_ue8m0(scale).repeat_interleave(32, 2)[:, :, :k]
        w = codes.view(torch.float8_e4m3fn).float() * per_k
        out.append((codes.view(torch.float8_e4m3fn), scale, w))
    return out


@pytest.mark.parametrize("method,fmt", FORMATS.items())
def test_in_place_packing_keeps_the_codes(method: str, fmt: str) -> None:
    E, H, I = 3, 288, 160  # multiples of 32 as real checkpoints' sizes (fp8: partial 128-blocks)
    (gq, gs, gw), (uq, us, uw), (dq_, ds, dw) = checkpoint_tensors(fmt, E, H, I)
    packed = kt_ops.pack_fp8_experts(gq, uq, dq_, gs, us, ds, method=method)
    assert packed.format == fmt
    source_bytes = sum(t.numel() * t.element_size() for t in (gq, uq, dq_, gs, us, ds))
    assert packed.nbytes <= 1.15 * source_bytes, (packed.nbytes, source_bytes)
    # a NaN code makes its (row, group) NaN in the blob; elsewhere the values are exact
    group = {"fp8": 128, "mxfp8": 32}.get(fmt, 10**9)
    for got, w, q in zip(reference.dequantize(packed.data), (gw, uw, dw), (gq, uq, dq_)):
        nan = q.view(torch.uint8) & 0x7F == 0x7F
        K = w.shape[-1]
        groups = -(-K // group)
        pad = groups * min(group, K) - K if group < 10**9 else 0
        grouped = torch.nn.functional.pad(nan, (0, pad)).reshape(*nan.shape[:-1], groups, -1).any(-1)
        nan_region = grouped.repeat_interleave(min(group, K), -1)[..., :K]
        if fmt == "mxfp8":  # the row addend: the whole row
            nan_region = nan_region.any(-1, keepdim=True).expand_as(nan_region)
        assert torch.equal(torch.isnan(got), nan_region | torch.isnan(w))
        torch.testing.assert_close(got[~nan_region], w[~nan_region], rtol=0, atol=0)


def finite_codes(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` with every NaN code replaced by zero."""
    c = codes.view(torch.uint8)
    return torch.where(c & 0x7F == 0x7F, torch.zeros_like(c), c).view(torch.float8_e4m3fn)


def weights_of(codes: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """The fp32 weights a checkpoint's codes ``[E, N, K]`` and scales mean (torch's decode)."""
    E, N, K = codes.shape
    if fmt == "fp8":
        per_k = scale.repeat_interleave(128, 1)[:, :N].repeat_interleave(128, 2)[:, :, :K]
    elif fmt == "fp8_perchannel":
        per_k = scale.reshape(E, N, 1)
    else:
        per_k = reference.decode_ue8m0(scale).repeat_interleave(32, 2)[:, :, :K]
    return codes.view(torch.float8_e4m3fn).float() * per_k


@pytest.mark.parametrize("method,fmt", FORMATS.items())
def test_nan_and_subnormal_codes_through_the_kernel(variant: str, method: str, fmt: str) -> None:
    """Every finite code value (subnormals included) and one NaN weight: the kernel matches
    the reference on the checkpoint's own fp32 weights, NaN in exactly the same places."""
    E, H, I = 2, 96, 64
    tensors = checkpoint_tensors(fmt, E, H, I, seed=5)
    codes, scales = [], []
    for q, s, _ in tensors:
        c = q.view(torch.uint8).clone()
        c[c & 0x7F == 0x7F] = 0x03  # finite everywhere (a subnormal) ...
        codes.append(c)
        scales.append(s)
    codes[0][1, 3, 17] = 0x7F  # ... but one NaN weight: gate row 3 of expert 1
    assert len({int(v) for v in torch.cat([c.flatten() for c in codes])}) == 255  # every other code
    packed = kt_ops.pack_fp8_experts(*(c.view(torch.float8_e4m3fn) for c in codes), *scales, method=method)
    T = 12
    ids = torch.zeros(T, 2, dtype=torch.int32)
    ids[:, 1] = 1
    ids[::3] = torch.tensor([1, 0], dtype=torch.int32)
    ids[1::4] = torch.tensor([0, -1], dtype=torch.int32)  # tokens that never meet expert 1
    weights = torch.rand(T, 2, generator=torch.Generator().manual_seed(1)) + 0.1
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    out = kt_ops.moe_forward(x, ids, weights, packed)
    ref = reference.moe_forward(x, ids, weights, *(weights_of(c, s, fmt) for c, s in zip(codes, scales)))
    nan_rows = torch.isnan(ref).any(-1)
    assert nan_rows.any() and not nan_rows.all()
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert rel_err(out[~nan_rows], ref[~nan_rows]) <= 1e-2


@pytest.mark.parametrize("method,fmt", FORMATS.items())
def test_subnormal_codes_decode_exactly(variant: str, method: str, fmt: str) -> None:
    """Weights made only of zero, the subnormal codes (m 2^-9) and the smallest normals,
    scaled to O(1): a wrong decode of any of them shows against the tight reference."""
    E, H, I, T = 2, 128, 64, 7
    g = torch.Generator().manual_seed(7)
    table = torch.tensor([0x00, 0x80, *range(0x01, 0x10), *range(0x81, 0x90)], dtype=torch.uint8)
    codes, scales = [], []
    for n, k in ((I, H), (I, H), (H, I)):
        codes.append(table[torch.randint(0, len(table), (E, n, k), generator=g)])
        if fmt == "fp8":
            scales.append(torch.full((E, -(-n // 128), -(-k // 128)), 2.0**9 / k**0.5))
        elif fmt == "fp8_perchannel":
            scales.append(torch.full((E, n), 2.0**9 / k**0.5))
        else:
            scales.append(torch.full((E, n, k // 32), 127 + 9 - int(math.log2(k)) // 2, dtype=torch.uint8))
    packed = kt_ops.pack_fp8_experts(*(c.view(torch.float8_e4m3fn) for c in codes), *scales, method=method)
    ids, weights = random_routing(T, E, 2, seed=3)
    x = torch.randn(T, H, generator=g)
    out = kt_ops.moe_forward(x, ids, weights, packed)
    w = [weights_of(c, s, fmt) for c, s in zip(codes, scales)]
    ref = reference.moe_forward(x, ids, weights, *w, quantize_activations=activation_rounding(variant))
    assert rel_err(out, ref) <= 1e-4, rel_err(out, ref)
    for t in range(T):  # each token alone: the decode path (7 tokens per expert above: prefill)
        alone = kt_ops.moe_forward(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], packed)
        assert rel_err(alone, ref[t:t + 1]) <= 1e-4, f"token {t} alone: {rel_err(alone, ref[t:t + 1]):.3g}"


@pytest.mark.parametrize("method,fmt", FORMATS.items())
def test_activation_scales_from_tiny_to_huge(variant: str, method: str, fmt: str) -> None:
    """Tokens of magnitude 2^-50 ... 2^50 in one call, decoded (one token per expert) and in
    prefill tiles: each row within 1e-4 of the tight reference on its own scale (the AVX2
    decode multiplies w * 2^-120 by activations normalized per row: without that, a small
    token's products would underflow), prefill rows equal to the same token alone, and a
    token holding an infinity non-finite where the reference is."""
    E, H, I = 8, 256, 96
    gate, up, down = make_weights(E, H, I, seed=11)
    packed = kt_ops.pack_experts(gate, up, down, method=method)
    dq = reference.dequantize(packed.data)
    exponents = torch.tensor([-50.0, -20.0, 0.0, 20.0, 50.0])
    g = torch.Generator().manual_seed(12)
    x = torch.randn(len(exponents), H, generator=g) * torch.exp2(exponents)[:, None]
    rounding = activation_rounding(variant)
    routings = {"decode": random_routing(len(exponents), E, 2, seed=13),  # <= 4 tokens per expert
                "prefill": (torch.zeros(len(exponents), 1, dtype=torch.int32), torch.ones(len(exponents), 1))}
    for path, (ids, weights) in routings.items():
        out = kt_ops.moe_forward(x, ids, weights, packed)
        ref = reference.moe_forward(x, ids, weights, *dq, quantize_activations=rounding)
        assert torch.isfinite(ref).all()
        for t, e in enumerate(exponents.tolist()):  # in fp64: a 2^50 row's squares overflow fp32
            err = float((out[t].double() - ref[t].double()).norm() / ref[t].double().norm())
            assert err <= 1e-4, f"{path}, token 2^{e:g}: {err:.3g}"
            if path == "prefill" and variant != "amx":
                alone = kt_ops.moe_forward(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], packed)
                assert torch.equal(out[t:t + 1], alone), f"token 2^{e:g}: prefill and decode rows differ"
    x[2, 5] = math.inf
    ids, weights = routings["decode"]
    out = kt_ops.moe_forward(x, ids, weights, packed)
    ref = reference.moe_forward(x, ids, weights, *dq, quantize_activations=rounding)
    assert not torch.isfinite(ref[2]).all()
    assert torch.equal(torch.isfinite(out), torch.isfinite(ref))
    assert rel_err(out[[0, 1, 3]], ref[[0, 1, 3]]) <= 1e-4


@pytest.mark.parametrize("method", ["FP8", "FP8_PERCHANNEL"])
@pytest.mark.parametrize("tokens", [1, 9], ids=["decode", "prefill"])
def test_sums_larger_than_fp32_before_their_scale_stay_finite(variant: str, method: str, tokens: int) -> None:
    """Activations ~1e18 into small down weights (scale ~2e-9): the down sums of w / 256 are
    ~1e37, 256 times that is not an fp32 number, the scaled output (~1e31) is. The decode
    unit goes onto the scale (s * 256), not onto the sum: finite, within the bf16 bound
    (every variant; AVX-512's came out inf before)."""
    E, H, I = 1, 32, 32
    g = torch.Generator().manual_seed(21)
    gate, up = (torch.randn(E, I, H, generator=g) * 0.1 for _ in range(2))
    down = torch.randn(E, H, I, generator=g) * 1e-6
    packed = kt_ops.pack_experts(gate, up, down, method=method)
    x = torch.randn(tokens, H, generator=g) * 4e18
    ids, weights = torch.zeros(tokens, 1, dtype=torch.int64), torch.ones(tokens, 1)
    ref = reference.moe_forward(x, ids, weights, *reference.dequantize(packed.data))
    out = kt_ops.moe_forward(x, ids, weights, packed)
    assert torch.isfinite(ref).all() and ref.abs().max() > 1e30
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} of {out.numel()} outputs not finite"
    err = float((out.double() - ref.double()).norm() / ref.double().norm())  # fp64: fp32 squares overflow
    assert err <= 1e-2, err


def test_scale_shapes_and_dtypes_accepted() -> None:
    """fp8 block scales per 128 rows or per row, bf16 scales; per-channel [E, N] or
    [E, N, 1]; mxfp8 uint8 or float8_e8m0fnu: the same blob."""
    E, H, I = 2, 160, 96
    (gq, gs, _), (uq, us, _), (dq_, ds, _) = checkpoint_tensors("fp8", E, H, I, seed=1)
    base = kt_ops.pack_fp8_experts(gq, uq, dq_, gs, us, ds, "FP8").data

    def rows(s: torch.Tensor, n: int) -> torch.Tensor:
        return s.repeat_interleave(128, 1)[:, :n]

    per_row = kt_ops.pack_fp8_experts(gq, uq, dq_, rows(gs, I), rows(us, I), rows(ds, H), "FP8").data
    assert torch.equal(per_row, base)
    uint8 = kt_ops.pack_fp8_experts(gq.view(torch.uint8), uq, dq_, gs, us, ds, "FP8").data
    assert torch.equal(uint8, base)
    bf16 = kt_ops.pack_fp8_experts(gq, uq, dq_, gs.bfloat16(), us.bfloat16(), ds.bfloat16(), "FP8").data
    exact = kt_ops.pack_fp8_experts(gq, uq, dq_, gs.bfloat16().float(), us.bfloat16().float(), ds.bfloat16().float(),
                                    "FP8").data
    assert torch.equal(bf16, exact)
    (gq, gs, _), (uq, us, _), (dq_, ds, _) = checkpoint_tensors("fp8_perchannel", E, H, I, seed=1)
    a = kt_ops.pack_fp8_experts(gq, uq, dq_, gs, us, ds, "FP8_PERCHANNEL").data
    b = kt_ops.pack_fp8_experts(gq, uq, dq_, gs[..., 0], us[..., 0], ds[..., 0], "FP8_PERCHANNEL").data
    assert torch.equal(a, b)
    (gq, gs, _), (uq, us, _), (dq_, ds, _) = checkpoint_tensors("mxfp8", E, H, I, seed=1)
    a = kt_ops.pack_fp8_experts(gq, uq, dq_, gs, us, ds, "MXFP8").data
    if hasattr(torch, "float8_e8m0fnu"):
        e8 = [s.view(torch.float8_e8m0fnu) for s in (gs, us, ds)]
        assert torch.equal(kt_ops.pack_fp8_experts(gq, uq, dq_, *e8, "MXFP8").data, a)


def test_mxfp8_exponent_limits() -> None:
    E, H, I = 1, 64, 32
    (gq, gs, _), (uq, us, _), (dq_, ds, _) = (
        (finite_codes(q), s, w) for q, s, w in checkpoint_tensors("mxfp8", E, H, I, seed=2))
    high = gs.clone()
    high[0, 5, 1] = 250
    with pytest.raises(ValueError, match=r"mxfp8 gate scale of expert 0, row 5, group 1: exponent code 250"):
        kt_ops.pack_fp8_experts(gq, uq, dq_, high, us, ds, "MXFP8")
    low = us.clone()
    low[0, 2, 0] = 3
    with pytest.raises(ValueError, match="mxfp8 up scale of expert 0, row 2, group 0: exponent code 3"):
        kt_ops.pack_fp8_experts(gq, uq, dq_, gs, low, ds, "MXFP8")
    zero_group = uq.view(torch.uint8).clone()
    zero_group[0, 2, :32] = torch.tensor([0x00, 0x80] * 16, dtype=torch.uint8)
    packed = kt_ops.pack_fp8_experts(gq, zero_group.view(torch.float8_e4m3fn), dq_, gs, low, ds, "MXFP8")
    up = reference.dequantize(packed.data)[1]
    assert torch.equal(up[0, 2, :32], torch.zeros(32))
    nan = gs.clone()
    nan[0, 1, 0] = 255
    packed = kt_ops.pack_fp8_experts(gq, uq, dq_, nan, us, ds, "MXFP8")
    assert torch.isnan(reference.dequantize(packed.data)[0][0, 1]).all()


def test_mxfp8_every_exponent_code_through_the_kernel(variant: str) -> None:
    """Exponent codes over the whole range the packer takes (10 ... 246), activations
    scaled against them so every product is O(1): the AVX2 decode multiplies w * 2^-120 by
    2^(e - 7) where a k block's codes are all <= 134 and decodes through fp16 where one is
    larger (gate/up: k blocks all low, one with a single high code, all high; down: rows
    all low, rows mixed). Each output column within 1e-4 of the tight reference on its own
    scale, decode (one token alone) equal bit for bit to the same token's prefill row."""
    E, H, I, T = 2, 768, 64, 9
    g = torch.Generator().manual_seed(21)

    def codes(n: int, k: int) -> torch.Tensor:
        c = torch.randint(0, 256, (E, n, k), generator=g, dtype=torch.uint8)
        return torch.where(c & 0x7F == 0x7F, torch.full_like(c, 0x38), c)  # finite (NaN -> 1.0)

    group_exp = torch.cat([torch.linspace(13, 131, 8), torch.linspace(13, 131, 8), torch.linspace(138, 243, 8)])
    group_exp = group_exp.round().long()  # gate/up: one per 32-k group, k blocks of 8 groups
    jitter = torch.randint(-3, 4, (E, I, H // 32), generator=g)
    gate_up_scales = []
    for _ in range(2):
        e = (group_exp + jitter).clamp(10, 246)
        assert int(e[:, :, :16].max()) <= 134 and int(e[:, :, 16:].min()) >= 135
        e[:, 5, 15] = 135  # k block 1: one high code among low ones
        gate_up_scales.append(e.to(torch.uint8))
    down_exp = torch.randint(110, 151, (E, H, I // 32), generator=g)
    down_exp[:, : H // 2] = down_exp[:, : H // 2].clamp(max=134)  # the first half of the rows: all low
    scales = [*gate_up_scales, down_exp.to(torch.uint8)]
    all_codes = [codes(I, H), codes(I, H), codes(H, I)]
    assert int(scales[0].min()) <= 12 and int(scales[0].max()) >= 240
    packed = kt_ops.pack_fp8_experts(*(c.view(torch.float8_e4m3fn) for c in all_codes), *scales, method="MXFP8")
    w = [weights_of(c, s, "mxfp8") for c, s in zip(all_codes, scales)]
    # x[k] ~ 2^(127 - e) of its group: gate/up sums O(1) per group whatever the scale.
    x = torch.randn(T, H, generator=g) * torch.exp2(127.0 - group_exp.double()).float().repeat_interleave(32)
    rounding = activation_rounding(variant)
    routings = {"decode": random_routing(T, E, 2, seed=22),
                "prefill": (torch.zeros(T, 1, dtype=torch.int32), torch.ones(T, 1))}
    for path, (ids, weights) in routings.items():
        out = kt_ops.moe_forward(x, ids, weights, packed)
        ref = reference.moe_forward(x, ids, weights, *w, quantize_activations=rounding)
        assert torch.isfinite(ref).all() and torch.isfinite(out).all(), path
        col_err = (out.double() - ref.double()).norm(dim=0) / ref.double().norm(dim=0)
        assert col_err.max() <= 1e-4, f"{path}: output column {int(col_err.argmax())}: {float(col_err.max()):.3g}"
        if path == "prefill" and variant != "amx":
            for t in (0, 4, 8):
                alone = kt_ops.moe_forward(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], packed)
                assert torch.equal(out[t:t + 1], alone), f"token {t}: prefill and decode rows differ"


def test_bad_fp8_input_is_a_value_error() -> None:
    E, H, I = 2, 64, 32
    (gq, gs, _), (uq, us, _), (dq_, ds, _) = checkpoint_tensors("fp8", E, H, I, seed=3)
    with pytest.raises(ValueError, match=r"gate_scale of format fp8 must be \[E, ceil\(N / 128\), ceil\(K / 128\)\]"):
        kt_ops.pack_fp8_experts(gq, uq, dq_, gs[:, :, :0], us, ds, "FP8")
    with pytest.raises(ValueError, match="down_scale of format fp8 must be a float tensor"):
        kt_ops.pack_fp8_experts(gq, uq, dq_, gs, us, ds.to(torch.int32), "FP8")
    # A floating type outside the allowlist (float4 failed in the kernel's copy, NotImplementedError).
    with pytest.raises(ValueError, match="up_scale of format fp8 must be a float tensor"):
        kt_ops.pack_fp8_experts(gq, uq, dq_, gs, torch.zeros(us.shape[:2] + (2,), dtype=torch.uint8).view(
            torch.float4_e2m1fn_x2), ds, "FP8")
    with pytest.raises(ValueError, match="up_proj must hold e4m3 codes"):
        kt_ops.pack_fp8_experts(gq, uq.float().bfloat16(), dq_, gs, us, ds, "FP8")
    with pytest.raises(ValueError, match=r"down_proj must be \[2, 64, 32\]"):
        kt_ops.pack_fp8_experts(gq, uq, dq_[:, :, :16], gs, us, ds, "FP8")
    with pytest.raises(ValueError, match="gate_scale of format mxfp8 must hold ue8m0 exponent bytes"):
        kt_ops.pack_fp8_experts(gq, uq, dq_, gs, us, ds, "MXFP8")
    with pytest.raises(ValueError, match=r"gate_scale of format fp8_perchannel must be \[E, N\] or \[E, N, 1\]"):
        kt_ops.pack_fp8_experts(gq, uq, dq_, gs, us, ds, "FP8_PERCHANNEL")
    with pytest.raises(ValueError, match="packs methods FP8, FP8_PERCHANNEL, MXFP8"):
        kt_ops.pack_fp8_experts(gq, uq, dq_, gs, us, ds, "AMXINT8")
    with pytest.raises(ValueError, match="packs the FP8 formats"):
        torch.ops.kt.pack_fp8_experts(gq, uq, dq_, gs, us, ds, "int8")
    gate, up, down = make_weights(E, H, I, seed=1)
    with pytest.raises(ValueError, match="no k-groups"):
        kt_ops.pack_experts(gate, up, down, method="FP8", group_size=32)
    with pytest.raises(ValueError, match="group_size must be 0"):
        torch.ops.kt.pack_experts(gate, up, down, "fp8", 128)


def test_packed_sizes() -> None:
    """About one byte per weight: fp8 + 4 bytes per 128-k group and row, fp8_perchannel +
    4 per row, mxfp8 + 1 per 32 k (padded to 64 per block) + 4 per row."""
    E, H, I = 2, 512, 256
    gate, up, down = make_weights(E, H, I, seed=1)
    weights = 3 * E * H * I
    sizes = {m: kt_ops.pack_experts(gate, up, down, method=m).nbytes - 256 for m in FORMATS}
    assert sizes["FP8_PERCHANNEL"] == weights + E * (2 * I + H) * 4
    assert sizes["FP8"] == weights + E * (2 * I * (H // 128) + H * (I // 128)) * 4
    assert sizes["MXFP8"] == weights + E * (2 * I * (H // 32) + H * (I // 32)) + E * (2 * I + H) * 4


@pytest.mark.parametrize("method", FORMATS)
def test_non_finite_weights_quantize_to_nan_rows(method: str) -> None:
    """The packer operator: NaN and inf weights get the NaN code and stay out of the scale:
    their rows are NaN, the rest of the block is quantized as without them
    (kt_ops.pack_experts refuses them first, tests/test_hostile.py)."""
    gate, up, down = (w.float() for w in make_weights(1, 64, 32, seed=4))
    clean = reference.dequantize(kt_ops.pack_experts(gate, up, down, method=method).data)[0]
    gate[0, 3, 5], gate[0, 7, 9] = float("nan"), float("inf")
    fmt = kt_ops.formats.format_for_method(method)
    dq = reference.dequantize(torch.ops.kt.pack_experts(gate, up, down, fmt, 0, False))[0]
    bad = torch.isnan(dq).any(-1)[0]
    assert bad[3] and bad[7] and bad.sum() == 2
    rows = [r for r in range(32) if r not in (3, 7)]
    torch.testing.assert_close(dq[0, rows], clean[0, rows], rtol=0, atol=0)


@pytest.mark.parametrize("method", ["FP8", "FP8_PERCHANNEL"])
def test_tiny_finite_weights_are_not_packed_as_nan(method: str) -> None:
    """A row (FP8_PERCHANNEL) or a 128 x 128 block (FP8) whose largest |w| is a few fp32
    subnormals is finite and must stay finite: its scale max|w| / 448 underflowed to 0 (under
    ~6e-43) and w / 0 took the NaN code, so every token routed to the expert gave NaN."""
    H = I = 128
    gate = torch.ones(1, I, H)
    if method == "FP8":
        gate[0] = 1e-44
    else:
        gate[0, 0] = torch.linspace(-1, 1, H) * 1e-43
    packed = kt_ops.pack_experts(gate, torch.ones(1, I, H), torch.ones(1, H, I), method=method)
    held = reference.dequantize(packed.data)[0]
    assert torch.isfinite(held).all()
    assert (held[0] - gate[0]).abs().max() <= gate[0].abs().max() / 8  # the tiny values kept, to e4m3's precision
    out = kt_ops.moe_forward(torch.ones(1, H), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1), packed)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("method", ["FP8", "FP8_PERCHANNEL"])
def test_infinite_checkpoint_scale_gives_the_oracles_nan(method: str) -> None:
    """A checkpoint scale of +-inf makes its weights +-inf, and its zero codes NaN (0 * inf):
    the oracle's rows are NaN, as a NaN scale's. The kernels multiplied their sums by the
    infinite scale and gave +-inf where the oracle has NaN."""
    E, H, I = 1, 64, 32
    g = torch.Generator().manual_seed(31)
    codes = [torch.randint(0, 0x7e, shape, dtype=torch.uint8, generator=g)
             for shape in ((E, I, H), (E, I, H), (E, H, I))]
    codes[2][0, 3, :4] = 0  # zero codes in the row: 0 * inf is NaN
    if method == "FP8":
        scales = [torch.full((E, 1, 1), 1e-3) for _ in range(3)]
        scales[2][0, 0, 0] = -math.inf
    else:
        scales = [torch.full((E, n), 1e-3) for n in (I, I, H)]
        scales[2][0, 3] = math.inf
    packed = kt_ops.pack_fp8_experts(*codes, *scales, method)
    x = torch.randn(3, H, generator=g)
    ids, weights = torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1)
    ref = reference.moe_forward(x, ids, weights, *reference.dequantize(packed.data))
    out = kt_ops.moe_forward(x, ids, weights, packed)
    assert torch.isnan(ref[:, 3]).all()
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.equal(torch.isinf(out), torch.isinf(ref))
