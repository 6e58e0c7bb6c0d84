"""MXFP4 (OCP MX e2m1 codes with one E8M0 exponent per 32 weights) in its two packings:
format ``mxfp4`` (``pack_experts(..., method="MXFP4")`` and Hugging Face checkpoints: the
codes in INT4-style lines with bf16 half-scales, dotted by the INT4 kernels through a level
table) and GGUF's blocks (ggml type 39 of format gguf: ``method="LLAMAFILE",
gguf_type="MXFP4"`` and GGUF files). The block decode against the ``gguf`` package's own
dequantizer, our quantizer against ``gguf.quants.quantize`` byte for byte, both packings
holding the same codes and exponents, exponent 255 as NaN, and the kernels of every CPU
variant this machine runs against ``kt_ops.reference`` on odd shapes, random blocks, and
the activation variants with expert biases.

Kernel bounds: 1e-3 against the reference that simulates the kernels' 8-bit activations
(format mxfp4: one scale per token row, as INT4; gguf: blocks of 32, as tests/test_gguf.py
states them), 3e-2 against the plain fp32 reference on the dequantized weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gguf import assert_prefill_matches_decode, check_kernel

import gguf
import kt_ops
from conftest import random_routing, rel_err
from kt_ops import reference
from kt_ops._native import _C

MXFP4 = gguf.GGMLQuantizationType.MXFP4
BLOCK_BYTES = 17

# (E, top_k, H, I, tokens): rows off the 4-row groups, k past a partial 4-block step
# (H = 96, 160: 3 and 5 blocks) and a partial 256 unit, experts with > 4 and > 64 tokens.
SHAPES = [(4, 2, 96, 160, 1), (3, 3, 288, 96, 7), (6, 2, 1120, 64, 70), (5, 2, 32, 32, 3)]


def random_mxfp4_blocks(rows: int, k: int, rng: np.random.Generator, exponents: tuple[int, int] = (118, 124)) -> np.ndarray:
    """``[rows, k / 32 * 17]`` valid MXFP4 bytes: exponents uniform in ``exponents``
    (inclusive), every nibble random (both zero codes, both signs, +-12)."""
    data = rng.integers(0, 256, size=(rows, k // 32, BLOCK_BYTES), dtype=np.uint8)
    data[:, :, 0] = rng.integers(exponents[0], exponents[1] + 1, size=(rows, k // 32), dtype=np.uint8)
    return data.reshape(rows, -1)


def test_block_decode_matches_gguf() -> None:
    """reference.dequantize_mxfp4 == gguf.quants.dequantize bit for bit, every exponent
    but 255 (0 and 1: subnormal scales) and every code, in ggml's nibble order."""
    rng = np.random.default_rng(0)
    blocks = random_mxfp4_blocks(255, 32 * 4, rng, exponents=(0, 254))
    blocks[:, 0] = np.arange(255, dtype=np.uint8)  # every exponent 0..254 once
    ours = reference.dequantize_mxfp4(torch.from_numpy(blocks), k=128)
    theirs = torch.from_numpy(gguf.quants.dequantize(blocks, MXFP4))
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    one = np.zeros((1, 17), dtype=np.uint8)
    one[0, 0] = 127  # scale 2^0 / 2 on doubled values: the e2m1 values themselves
    one[0, 1:] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    w = reference.dequantize_mxfp4(torch.from_numpy(one))[0]
    assert w[:16].tolist() == list(reference.MXFP4_VALUES)  # weight j: low nibble of byte j
    assert w[16:].tolist() == list(reference.MXFP4_VALUES)[::-1]  # weight j + 16: its high nibble


def raw_blocks(E: int, H: int, I: int, seed: int) -> list[np.ndarray]:
    """Random MXFP4 blocks of gate, up [E * I, H / 32 * 17] and down [E * H, I / 32 * 17]."""
    rng = np.random.default_rng(seed)
    return [random_mxfp4_blocks(E * rows, k, rng) for rows, k in ((I, H), (I, H), (H, I))]


def blob_of(raws: list[np.ndarray], packing: str, E: int, H: int, I: int) -> torch.Tensor:
    """The blocks as a packed layer: format gguf (the blocks themselves) or mxfp4 (re-laid)."""
    tensors = [torch.from_numpy(r.reshape(-1).copy()) for r in raws]
    if packing == "gguf":
        return _C.gguf_experts_from_blocks(*tensors, [int(MXFP4)] * 3, E, H, I)
    return _C.mxfp4_experts_from_blocks(*tensors, E, H, I)


def decoded(raws: list[np.ndarray], E: int, H: int, I: int) -> list[torch.Tensor]:
    """gguf.quants' decode of the blocks: gate, up [E, I, H], down [E, H, I]."""
    return [torch.from_numpy(gguf.quants.dequantize(r, MXFP4)).reshape(E, rows, k)
            for r, (rows, k) in zip(raws, ((I, H), (I, H), (H, I)))]


def gguf_matrices(blob: torch.Tensor) -> list[torch.Tensor]:
    """The three matrices' bytes of a gguf MXFP4 blob."""
    info = _C.packed_info(blob)
    E, H, I = info["num_experts"], info["hidden_size"], info["intermediate_size"]
    sizes = (E * I * H // 32 * BLOCK_BYTES,) * 2 + (E * H * I // 32 * BLOCK_BYTES,)
    return [blob[o : o + n] for o, n in zip(info["matrix_offsets"], sizes)]


def check_int_kernel(blob: torch.Tensor, gate, up, down, E: int, k: int, H: int, tokens: int, seed: int) -> None:
    """Format mxfp4 through the kernel: int8 activations per token row, as the INT4 formats."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    ids, weights = random_routing(tokens, E, k, seed)
    out = kt_ops.moe_forward(x, ids, weights, blob)
    assert torch.isfinite(out).all()
    tight = reference.moe_forward(x, ids, weights, gate, up, down, quantize_activations=True)
    plain = reference.moe_forward(x, ids, weights, gate, up, down)
    assert rel_err(out, tight) <= 1e-3
    assert rel_err(out, plain) <= 3e-2


PACKINGS = ["mxfp4", "gguf"]


@pytest.mark.parametrize("packing", PACKINGS)
def test_nan_exponent_makes_the_rows_nan(variant: str, packing: str) -> None:
    """Exponent 255 is NaN (OCP MX) in the reference and in every kernel: a gate row with
    it makes the outputs of the tokens routed to that expert NaN, the others stay finite."""
    E, H, I = 3, 96, 64
    raws = raw_blocks(E, H, I, seed=1)
    # expert 1, row 5, block 1: exponent 255 over all-zero codes, NaN * 0 (2^127 * 0 would be 0)
    raws[0][1 * I + 5, BLOCK_BYTES] = 255
    raws[0][1 * I + 5, BLOCK_BYTES + 1 : 2 * BLOCK_BYTES] = 0
    blob = blob_of(raws, packing, E, H, I)
    dq = reference.dequantize(blob)
    assert torch.isnan(dq[0][1, 5, 32:64]).all() and torch.isfinite(dq[0][1, 5, :32]).all()
    assert torch.isfinite(dq[0][0]).all() and torch.isfinite(dq[0][2]).all()
    x = torch.randn(4, H)
    ids = torch.tensor([[1, 0], [0, 2], [2, 1], [0, 2]], dtype=torch.int32)
    out = kt_ops.moe_forward(x, ids, torch.full((4, 2), 0.5), blob)
    assert torch.isnan(out).all(dim=1).tolist() == [True, False, True, False]
    assert torch.isfinite(out[[1, 3]]).all()


def test_gguf_prefill_rows_match_decode_rows(variant: str) -> None:
    """GGUF MXFP4 on the AVX-512 variants' repacked tile (experts with >= 8 tokens) gives the
    in-place kernel's bits (H = 1056, I = 160: partial 4-block steps)."""
    E, H, I = 5, 1056, 160
    raws = raw_blocks(E, H, I, seed=3)
    assert_prefill_matches_decode(blob_of(raws, "gguf", E, H, I), *decoded(raws, E, H, I), E, H)


def test_gguf_subnormal_exponents_on_the_prefill_tile(variant: str) -> None:
    """Exponents 0 and 1 (subnormal half scales 2^-128, 2^-127) on the tile path: down rows 3
    and 7 of every expert carry only them, so those outputs are sums of subnormal-scaled
    products alone and show any difference from the in-place kernel's bits."""
    E, H, I = 5, 1056, 160
    raws = raw_blocks(E, H, I, seed=4)
    down = raws[2].reshape(E, H, -1)
    down[:, 3, 0::BLOCK_BYTES] = 0
    down[:, 7, 0::BLOCK_BYTES] = 1
    blob = blob_of(raws, "gguf", E, H, I)
    gate, up, dn = decoded(raws, E, H, I)
    assert (dn[:, 3] != 0).any() and (dn[:, 7] != 0).any()
    assert dn[:, 7].abs().max() < 1e-37
    assert_prefill_matches_decode(blob, gate, up, dn, E, H)


def test_gguf_nan_exponent_on_the_prefill_tile(variant: str) -> None:
    """Exponent 255 in a gate row makes every token of that expert NaN on the tile path
    too (40 tokens, expert 1 with >= 8), the other experts' tokens stay finite."""
    E, H, I = 3, 96, 64
    raws = raw_blocks(E, H, I, seed=1)
    raws[0][1 * I + 5, BLOCK_BYTES] = 255
    raws[0][1 * I + 5, BLOCK_BYTES + 1 : 2 * BLOCK_BYTES] = 0
    blob = blob_of(raws, "gguf", E, H, I)
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[1, 0], [0, 2], [2, 1], [0, 2]] * 10, dtype=torch.int32)
    out = kt_ops.moe_forward(torch.randn(40, H, generator=g), ids, torch.full((40, 2), 0.5), blob)
    assert torch.isnan(out).all(dim=1).tolist() == [True, False, True, False] * 10


def test_both_packings_hold_the_same_weights() -> None:
    """Every exponent (0, 1: subnormal scales; 255: NaN) and every code: format mxfp4 made
    from GGUF blocks decodes (reference and C++ decoders) exactly as the blocks do."""
    E, H, I = 2, 256, 128
    raws = raw_blocks(E, H, I, seed=2)
    raws[0][:, 0::BLOCK_BYTES] = np.arange(raws[0][:, 0::BLOCK_BYTES].size).reshape(E * I, -1) % 256
    blob, blocks = blob_of(raws, "mxfp4", E, H, I), blob_of(raws, "gguf", E, H, I)
    assert _C.packed_info(blob)["format"] == "mxfp4"
    ours, theirs = reference.dequantize(blob), reference.dequantize(blocks)
    native = kt_ops.dequantize_experts(blob)
    for a, b, c in zip(ours, theirs, native):
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.isnan(c), torch.isnan(b))
        assert torch.equal(a.nan_to_num(7.0).view(torch.int32), b.nan_to_num(7.0).view(torch.int32))
        assert torch.equal(c.nan_to_num(7.0).view(torch.int32), b.nan_to_num(7.0).view(torch.int32))
    assert torch.isnan(ours[0]).any()  # exponent 255 is among them
    # 17 bytes per 32 weights in GGUF; 16 + 2 per 32 (codes, bf16 scale) here, plus block padding
    weights = E * (2 * I * H + H * I)
    assert blob.numel() <= 256 + weights * 18 // 32 + E * (2 * I + H) // 16 * 64


@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_quantizer_matches_gguf_bit_for_bit(scale: float) -> None:
    """pack_experts(method="LLAMAFILE", gguf_type="MXFP4") writes gguf.quants.quantize's
    bytes (ggml's quantize_row_mxfp4_ref) for every matrix; method "MXFP4" holds the same
    codes and exponents in its own layout."""
    E, H, I = 3, 64, 96
    g = torch.Generator().manual_seed(5)
    gate, up, down = (torch.randn(E, r, c, generator=g) * scale for r, c in ((I, H), (I, H), (H, I)))
    gate[0, 0, :32] = 0.0  # an all-zero block: exponent 0
    packed = kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type="MXFP4")
    assert packed.format == "gguf" and _C.packed_info(packed.data)["gguf_types"] == ["MXFP4"] * 3
    matrices = gguf_matrices(packed.data)
    for m, (tensor, ours) in enumerate(zip((gate, up, down), matrices)):
        theirs = gguf.quants.quantize(tensor.reshape(-1, tensor.shape[-1]).numpy(), MXFP4).reshape(-1)
        np.testing.assert_array_equal(ours.numpy(), theirs, err_msg=f"matrix {m}")
    mx = kt_ops.pack_experts(gate, up, down, method="MXFP4")
    assert mx.format == "mxfp4"
    assert torch.equal(mx.data, _C.mxfp4_experts_from_blocks(*matrices, E, H, I))


def test_quantizer_ties_and_saturation_match_gguf() -> None:
    """Values exactly between two e2m1 magnitudes (ties go to the smaller), past the
    largest (saturate at 6 x scale), signed zeros and tiny values, as gguf does."""
    # max|x| = 12 -> e = floor(log2 12) - 2 + 127 = 128: scale 1 on the e2m1 values x 2.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
            12.0, -11.9, 7.9, -0.0, 0.0, 1e-30, -1e-30, 0.24, 0.26, 2.49, 2.51, 4.99, 5.01, 6.0, -6.0, 3.0, 1.0, -1.0]
    x = torch.tensor(ties, dtype=torch.float32).reshape(1, 1, 32)
    # [1, 32, 32]: the ties scaled by powers of two from 2^-60 to 2^64, and reversed x 0.7
    rows = torch.cat([x * 2.0**s for s in range(-60, 68, 8)] + [x.flip(-1) * 0.7 * 2.0**s for s in range(-60, 68, 8)],
                     dim=1)
    down = torch.randn(1, 32, 32)
    packed = kt_ops.pack_experts(rows, rows, down, method="LLAMAFILE", gguf_type="MXFP4")
    ours = gguf_matrices(packed.data)[0].numpy()
    theirs = gguf.quants.quantize(rows.reshape(32, 32).numpy(), MXFP4).reshape(-1)
    np.testing.assert_array_equal(ours, theirs)
    mx = kt_ops.pack_experts(rows, rows, down, method="MXFP4")
    assert torch.equal(mx.data, _C.mxfp4_experts_from_blocks(*gguf_matrices(packed.data), 1, 32, 32))


def test_quantizer_exponent_just_below_powers_of_two_matches_gguf() -> None:
    """max|x| one to three ulps below 2^k, k in [-100, 100): log2f rounds some of these up to
    k, and the exponent must follow ggml's log2f, not the exact binary exponent."""
    rows = []
    for k in range(-100, 100):
        v = np.float32(2.0**k)
        for _ in range(3):
            v = np.nextafter(v, np.float32(0))
            rows.append(np.array([v, -v / 3, v / 7] + [0.0] * 29, dtype=np.float32))
    x = torch.from_numpy(np.stack(rows)[:576]).reshape(1, 576, 32)
    packed = kt_ops.pack_experts(x, x, torch.zeros(1, 32, 576), method="LLAMAFILE", gguf_type="MXFP4")
    ours = gguf_matrices(packed.data)[0].numpy()
    theirs = gguf.quants.quantize(x.reshape(576, 32).numpy(), MXFP4).reshape(-1)
    np.testing.assert_array_equal(ours, theirs)
    mx = kt_ops.pack_experts(x, x, torch.zeros(1, 32, 576), method="MXFP4")
    assert torch.equal(mx.data, _C.mxfp4_experts_from_blocks(*gguf_matrices(packed.data), 1, 32, 576))


def cases() -> list:
    return [pytest.param(*s, p, id="{}-E{}k{}H{}I{}T{}".format(p, *s)) for s in SHAPES for p in PACKINGS]


@pytest.mark.parametrize("E,k,H,I,tokens,packing", cases())
def test_random_blocks(variant: str, E: int, k: int, H: int, I: int, tokens: int, packing: str) -> None:
    """Random MXFP4 blocks (every code) through the kernel == the reference on gguf's decode."""
    raws = raw_blocks(E, H, I, seed=H + I)
    gate, up, down = decoded(raws, E, H, I)
    blob = blob_of(raws, packing, E, H, I)
    if packing == "gguf":
        check_kernel(blob, gate, up, down, E, k, H, tokens, seed=tokens)
    else:
        check_int_kernel(blob, gate, up, down, E, k, H, tokens, seed=tokens)


@pytest.mark.parametrize("E,k,H,I,tokens", [pytest.param(*s, id="E{}k{}H{}I{}T{}".format(*s)) for s in SHAPES])
def test_packed_weights(variant: str, E: int, k: int, H: int, I: int, tokens: int) -> None:
    """pack_experts(method="MXFP4") from bf16 through the kernel == the reference on
    reference.dequantize of the blob; the quantization error of Gaussian weights."""
    g = torch.Generator().manual_seed(E * H)
    gate, up, down = (torch.randn(E, r, c, generator=g).bfloat16() for r, c in ((I, H), (I, H), (H, I)))
    packed = kt_ops.pack_experts(gate, up, down, method="MXFP4")
    dq = reference.dequantize(packed.data)
    for original, dequantized in zip((gate, up, down), dq):
        assert rel_err(dequantized, original.float()) <= 0.12  # e2m1 with power-of-two scales: measured ~0.10
    check_int_kernel(packed.data, *dq, E, k, H, tokens, seed=tokens)


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("limit,alpha", [(0.0, 0.0), (10.0, 0.0), (7.0, 1.702)], ids=["silu", "clamp", "gpt-oss"])
def test_activations_with_biases(variant: str, limit: float, alpha: float, packing: str) -> None:
    E, k, H, I, tokens = 4, 2, 160, 96, 9
    g = torch.Generator().manual_seed(3)
    gate, up, down = (torch.randn(E, r, c, generator=g) / c**0.5 for r, c in ((I, H), (I, H), (H, I)))
    biases = (torch.randn(E, I, generator=g), torch.randn(E, I, generator=g), torch.randn(E, H, generator=g))
    kwargs = {"method": "MXFP4"} if packing == "mxfp4" else {"method": "LLAMAFILE", "gguf_type": "MXFP4"}
    packed = kt_ops.pack_experts(gate, up, down, swiglu_limit=limit, swiglu_alpha=alpha, biases=biases, **kwargs)
    assert packed.format == packing
    dq = reference.dequantize(packed.data)
    x = torch.randn(tokens, H, generator=g) * 3
    ids, weights = random_routing(tokens, E, k, seed=4)
    out = kt_ops.moe_forward(x, ids, weights, packed)
    blocks = True if packing == "mxfp4" else reference.gguf_activation_blocks(packed.data)
    tight = reference.moe_forward(x, ids, weights, *dq, quantize_activations=blocks,
                                  swiglu_limit=limit, swiglu_alpha=alpha, biases=biases)
    plain = reference.moe_forward(x, ids, weights, *dq, swiglu_limit=limit, swiglu_alpha=alpha, biases=biases)
    assert rel_err(out, tight) <= 1e-3
    assert rel_err(out, plain) <= 3e-2


def test_method_arguments() -> None:
    E, H, I = 2, 64, 32
    gate, up, down = torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)
    same = kt_ops.pack_experts(gate, up, down, method="MXFP4")
    assert same.format == "mxfp4" and same.group_size == 32
    for kwargs in ({}, {"gguf_type": "MXFP4"}, {"group_size": 32}):
        assert torch.equal(kt_ops.pack_experts(gate, up, down, method="mxfp4", **kwargs).data, same.data)
    with pytest.raises(ValueError, match="gguf_type"):
        kt_ops.pack_experts(gate, up, down, method="MXFP4", gguf_type="Q4_0")
    with pytest.raises(ValueError, match="group_size"):
        kt_ops.pack_experts(gate, up, down, method="MXFP4", group_size=64)
    with pytest.raises(ValueError, match="scale_search"):
        kt_ops.pack_experts(gate, up, down, method="MXFP4", scale_search=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        kt_ops.pack_experts(torch.randn(E, I, 48), torch.randn(E, I, 48), torch.randn(E, 48, I), method="MXFP4")
    with pytest.raises(ValueError, match="multiple of 32"):
        kt_ops.pack_experts(torch.randn(E, 40, H), torch.randn(E, 40, H), torch.randn(E, H, 40), method="MXFP4")
    assert kt_ops.METHOD_FORMATS["MXFP4"] == "mxfp4"


def test_blocks_of_the_wrong_size_are_refused() -> None:
    E, H, I = 2, 64, 32
    raws = [torch.from_numpy(r.reshape(-1).copy()) for r in raw_blocks(E, H, I, seed=3)]
    with pytest.raises(ValueError, match="down"):
        _C.mxfp4_experts_from_blocks(raws[0], raws[1], raws[2][:-1], E, H, I)
    with pytest.raises(ValueError):
        _C.mxfp4_experts_from_blocks(raws[0], raws[1], raws[2], E, H + 16, I)
    with pytest.raises(TypeError, match="gate must have dtype Byte"):
        _C.mxfp4_experts_from_blocks(raws[0].to(torch.int16), raws[1], raws[2], E, H, I)


def test_operator_packs_non_finite_weights_as_nan_blocks() -> None:
    """The operators pack non-finite weights as the format can hold them: a 32-block with a
    NaN or an infinity is the NaN block (exponent 255), in both packings; the others as usual."""
    E, H, I = 1, 64, 32
    gate, up, down = torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)
    gate[0, 3, 40] = float("nan")
    gate[0, 5, 2] = float("inf")
    up[0, 0, 63] = float("-inf")
    for blob in (torch.ops.kt.pack_experts(gate, up, down, "mxfp4", 32, False),
                 torch.ops.kt.pack_gguf_experts(gate, up, down, [int(MXFP4)] * 3)):
        g, u, d = reference.dequantize(blob)
        assert torch.isnan(g[0, 3, 32:]).all() and torch.isnan(g[0, 5, :32]).all() and torch.isnan(u[0, 0, 32:]).all()
        assert int(torch.isnan(g).sum()) == 64 and int(torch.isnan(u).sum()) == 32 and not torch.isnan(d).any()


def test_parts_off_the_32_groups_are_refused() -> None:
    from kt_ops.parts import pack_parts

    gate, up, down = torch.randn(2, 96, 64), torch.randn(2, 96, 64), torch.randn(2, 64, 96)
    with pytest.raises(ValueError, match="threadpool_count 2 splits moe_intermediate_size 96 into parts of 48; MXFP4"):
        pack_parts(gate, up, down, "MXFP4", 2)
    assert [p.format for p in pack_parts(gate, up, down, "MXFP4", 3)] == ["mxfp4"] * 3


SPAN = 16  # groups of 32 per span: kMxfp4SpanGroups (csrc/cpu/kernels/quant/mxfp4_span.h)


def span_exponents(rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, k / 32]`` exponents for the spans of SPAN groups that every kernel adds up
    on their own: per 32-row pair of blocks and span, either every row's exponents within
    3 of each other (AMX tiles: one integer sum with shifted levels) or one exponent 4-6
    above the least of its span or a subnormal scale (0, 1) (AMX tiles: group by group).
    A row's spans lie 0, 8 or 16 apart, so a span's partial is small beside what the row
    holds by then (adding its groups one by one to that total would round differently)."""
    groups = k // 32
    base = rng.integers(108, 122, size=(rows, 1))
    lift = np.repeat(rng.choice([0, 8, 16], size=(rows, (groups + SPAN - 1) // SPAN)), SPAN, axis=1)[:, :groups]
    e = base + lift + rng.integers(0, 4, size=(rows, groups))
    for r0 in range(0, rows, 32):
        for s in range(0, groups, SPAN):
            kind = rng.integers(0, 4)
            row, group = r0 + rng.integers(0, 32), s + rng.integers(0, min(SPAN, groups - s))
            if kind == 1:  # 4 above the span's least: the first spread past kMxfp4MaxShift, then more
                span = e[row, s : s + SPAN]
                e[row, group] = span.min() + 4 + (rng.integers(0, 3) if r0 % 64 else 0)
            elif kind == 2:
                e[row, group] = rng.integers(0, 2)
    return e.astype(np.uint8)


def test_tile_spans_match_the_vector_path(variant: str) -> None:
    """Format mxfp4 with spans of every kind (span_exponents) on odd k (H = 1120: 35
    groups, a k tail past the AMX tiles; I = 576: a last span of 2 groups): each of 40
    tokens on two experts gets the bits it gets alone (decode), with fp32 and bf16 inputs,
    and the call matches the oracle."""
    E, H, I, tokens = 2, 1120, 576, 40
    rng = np.random.default_rng(11)
    raws = raw_blocks(E, H, I, seed=12)
    for raw, (rows, k) in zip(raws, ((E * I, H), (E * I, H), (E * H, I))):
        raw.reshape(rows, k // 32, BLOCK_BYTES)[:, :, 0] = span_exponents(rows, k, rng)
    blob = blob_of(raws, "mxfp4", E, H, I)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.tensor([[0, 1]] * tokens, dtype=torch.int32)
    weights = torch.rand(tokens, 2, generator=g) + 0.1
    gate, up, down = decoded(raws, E, H, I)
    for dtype in (torch.float32, torch.bfloat16):
        out = kt_ops.moe_forward(x.to(dtype), ids, weights, blob)
        assert torch.isfinite(out).all()
        if dtype == torch.float32:
            tight = reference.moe_forward(x, ids, weights, gate, up, down, quantize_activations=True)
            assert rel_err(out, tight) <= 1e-3
        for t in range(tokens):
            alone = kt_ops.moe_forward(x[t : t + 1].to(dtype), ids[t : t + 1], weights[t : t + 1], blob)[0]
            assert torch.equal(out[t], alone), f"token {t} ({dtype})"
