"""MXFP4 (ggml type 39 of format gguf; ``pack_experts(..., method="MXFP4")``): the block
decode against the ``gguf`` package's own dequantizer, our quantizer against
``gguf.quants.quantize`` byte for byte, exponent 255 as NaN, and the kernels of every
CPU variant this machine runs against ``kt_ops.reference`` on odd shapes, random blocks,
and the activation variants with expert biases.

Kernel bounds as tests/test_gguf.py states them: 1e-3 against the reference that
simulates the kernels' 8-bit activation blocks of 32, 3e-2 against the plain fp32
reference on the dequantized weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gguf import check_kernel

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


def blob_from_blocks(E: int, H: int, I: int, seed: int):
    """Random MXFP4 blocks -> (blob, gate, up, down decoded by gguf.quants)."""
    rng = np.random.default_rng(seed)
    raws = [random_mxfp4_blocks(E * rows, k, rng) for rows, k in ((I, H), (I, H), (H, I))]
    blob = _C.gguf_experts_from_blocks(*(torch.from_numpy(r.reshape(-1).copy()) for r in raws), [int(MXFP4)] * 3,
                                       E, H, I)
    weights = [torch.from_numpy(gguf.quants.dequantize(r, MXFP4)).reshape(E, rows, k)
               for r, (rows, k) in zip(raws, ((I, H), (I, H), (H, I)))]
    return blob, *weights


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


def test_nan_exponent_makes_the_rows_nan(variant: str) -> None:
    """Exponent 255 is NaN (OCP MX) in the reference and in every kernel: a gate row with
    it makes the outputs of the tokens routed to that expert NaN, the others stay finite."""
    E, H, I = 3, 96, 64
    blob, gate, up, down = blob_from_blocks(E, H, I, seed=1)
    info = _C.packed_info(blob)
    row_bytes = H // 32 * BLOCK_BYTES
    blob = blob.clone()
    # expert 1, row 5, block 1: exponent 255 over all-zero codes, NaN * 0 (2^127 * 0 would be 0)
    at = info["matrix_offsets"][0] + 1 * I * row_bytes + 5 * row_bytes + BLOCK_BYTES
    blob[at] = 255
    blob[at + 1 : at + BLOCK_BYTES] = 0
    dq = reference.dequantize(blob)
    assert torch.isnan(dq[0][1, 5, 32:64]).all() and torch.isfinite(dq[0][1, 5, :32]).all()
    assert torch.isfinite(dq[0][0]).all() and torch.isfinite(dq[0][2]).all()
    x = torch.randn(4, H)
    ids = torch.tensor([[1, 0], [0, 2], [2, 1], [0, 2]], dtype=torch.int32)
    out = kt_ops.moe_forward(x, ids, torch.full((4, 2), 0.5), blob)
    assert torch.isnan(out).all(dim=1).tolist() == [True, False, True, False]
    assert torch.isfinite(out[[1, 3]]).all()


@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_quantizer_matches_gguf_bit_for_bit(scale: float) -> None:
    """pack_experts(method="MXFP4") writes gguf.quants.quantize's bytes (ggml's
    quantize_row_mxfp4_ref) for every matrix."""
    E, H, I = 3, 64, 96
    g = torch.Generator().manual_seed(5)
    gate, up, down = (torch.randn(E, r, c, generator=g) * scale for r, c in ((I, H), (I, H), (H, I)))
    gate[0, 0, :32] = 0.0  # an all-zero block: exponent 0
    packed = kt_ops.pack_experts(gate, up, down, method="MXFP4")
    info = _C.packed_info(packed.data)
    assert packed.format == "gguf" and info["gguf_types"] == ["MXFP4"] * 3
    for m, (tensor, offset) in enumerate(zip((gate, up, down), info["matrix_offsets"])):
        ours = packed.data[offset : offset + tensor.numel() // 32 * BLOCK_BYTES].numpy()
        theirs = gguf.quants.quantize(tensor.reshape(-1, tensor.shape[-1]).numpy(), MXFP4).reshape(-1)
        np.testing.assert_array_equal(ours, theirs, err_msg=f"matrix {m}")


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
    packed = kt_ops.pack_experts(rows, rows, down, method="MXFP4")
    offset = _C.packed_info(packed.data)["matrix_offsets"][0]
    ours = packed.data[offset : offset + 32 * BLOCK_BYTES].numpy()
    theirs = gguf.quants.quantize(rows.reshape(32, 32).numpy(), MXFP4).reshape(-1)
    np.testing.assert_array_equal(ours, theirs)


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
    packed = kt_ops.pack_experts(x, x, torch.zeros(1, 32, 576), method="MXFP4")
    offset = _C.packed_info(packed.data)["matrix_offsets"][0]
    ours = packed.data[offset : offset + 576 * BLOCK_BYTES].numpy()
    theirs = gguf.quants.quantize(x.reshape(576, 32).numpy(), MXFP4).reshape(-1)
    np.testing.assert_array_equal(ours, theirs)


def cases() -> list:
    return [pytest.param(*s, id="E{}k{}H{}I{}T{}".format(*s)) for s in SHAPES]


@pytest.mark.parametrize("E,k,H,I,tokens", cases())
def test_random_blocks(variant: str, E: int, k: int, H: int, I: int, tokens: int) -> None:
    """Random MXFP4 blocks (every code) through the kernel == the reference on gguf's decode."""
    blob, gate, up, down = blob_from_blocks(E, H, I, seed=H + I)
    check_kernel(blob, gate, up, down, E, k, H, tokens, seed=tokens)


@pytest.mark.parametrize("E,k,H,I,tokens", cases())
def test_packed_weights(variant: str, E: int, k: int, H: int, I: int, tokens: int) -> None:
    """pack_experts(method="MXFP4") from bf16 through the kernel == the reference on
    reference.dequantize of the blob; the quantization error of Gaussian weights."""
    g = torch.Generator().manual_seed(E * H)
    gate, up, down = (torch.randn(E, r, c, generator=g).bfloat16() for r, c in ((I, H), (I, H), (H, I)))
    packed = kt_ops.pack_experts(gate, up, down, method="MXFP4")
    dq = reference.dequantize(packed.data)
    for original, decoded in zip((gate, up, down), dq):
        assert rel_err(decoded, original.float()) <= 0.12  # e2m1 with power-of-two scales: measured ~0.10
    check_kernel(packed.data, *dq, E, k, H, tokens, seed=tokens)


@pytest.mark.parametrize("limit,alpha", [(0.0, 0.0), (10.0, 0.0), (7.0, 1.702)], ids=["silu", "clamp", "gpt-oss"])
def test_activations_with_biases(variant: str, limit: float, alpha: float) -> None:
    E, k, H, I, tokens = 4, 2, 160, 96, 9
    g = torch.Generator().manual_seed(3)
    gate, up, down = (torch.randn(E, r, c, generator=g) / c**0.5 for r, c in ((I, H), (I, H), (H, I)))
    biases = (torch.randn(E, I, generator=g), torch.randn(E, I, generator=g), torch.randn(E, H, generator=g))
    packed = kt_ops.pack_experts(gate, up, down, method="MXFP4", swiglu_limit=limit, swiglu_alpha=alpha, biases=biases)
    dq = reference.dequantize(packed.data)
    x = torch.randn(tokens, H, generator=g) * 3
    ids, weights = random_routing(tokens, E, k, seed=4)
    out = kt_ops.moe_forward(x, ids, weights, packed)
    tight = reference.moe_forward(x, ids, weights, *dq, quantize_activations=reference.gguf_activation_blocks(packed.data),
                                  swiglu_limit=limit, swiglu_alpha=alpha, biases=biases)
    plain = reference.moe_forward(x, ids, weights, *dq, swiglu_limit=limit, swiglu_alpha=alpha, biases=biases)
    assert rel_err(out, tight) <= 1e-3
    assert rel_err(out, plain) <= 3e-2


def test_method_arguments() -> None:
    E, H, I = 2, 64, 32
    gate, up, down = torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)
    same = kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type="MXFP4")
    for kwargs in ({}, {"gguf_type": "MXFP4"}, {"group_size": 32}):
        assert torch.equal(kt_ops.pack_experts(gate, up, down, method="mxfp4", **kwargs).data, same.data)
    with pytest.raises(ValueError, match="gguf_type"):
        kt_ops.pack_experts(gate, up, down, method="MXFP4", gguf_type="Q4_0")
    with pytest.raises(ValueError, match="group_size"):
        kt_ops.pack_experts(gate, up, down, method="MXFP4", group_size=64)
    with pytest.raises(ValueError, match="multiple of 32"):
        kt_ops.pack_experts(torch.randn(E, I, 48), torch.randn(E, I, 48), torch.randn(E, 48, I), method="MXFP4")
    assert kt_ops.METHOD_FORMATS["MXFP4"] == "gguf"
