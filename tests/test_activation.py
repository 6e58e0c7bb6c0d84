"""The layer's activation (SwiGLU, clamped SwiGLU, alpha-SwiGLU) and expert biases, on
every format and CPU variant: ``kt_ops.set_activation`` / ``pack_experts(swiglu_limit=,
swiglu_alpha=, biases=)`` against ``kt_ops.reference.moe_forward`` with the same
activation on the blob's dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from format_cases import FormatCase, format_cases

import kt_ops
from kt_ops import reference
from kt_ops._native import _C

E, T, TOP_K = 4, 7, 2
CASES = format_cases(min_hidden=64, min_intermediate=48)
# (swiglu_limit, swiglu_alpha, biases): DeepSeek-V4's clamp, gpt-oss's alpha with clamp
GLUS = {"clamped": (0.6, 0.0, True), "alpha-clamped": (0.8, 1.702, True)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def layer(H: int, I: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(E, I, H, generator=g) / H**0.5 * 3, torch.randn(E, I, H, generator=g) / H**0.5 * 3
    down = torch.randn(E, H, I, generator=g) / I**0.5
    biases = (torch.randn(E, I, generator=g), torch.randn(E, I, generator=g), torch.randn(E, H, generator=g))
    return gate, up, down, biases


def routing(H: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(T)])
    ids[0, 1] = -1  # a skipped slot
    return x, ids, torch.rand(T, TOP_K, generator=g)


@pytest.mark.parametrize("glu", list(GLUS))
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_format_matches_the_reference(case: FormatCase, glu: str, variant: str) -> None:
    limit, alpha, with_biases = GLUS[glu]
    gate, up, down, biases = layer(case.hidden, case.intermediate, seed=len(case.id))
    packed = kt_ops.set_activation(case.pack(gate, up, down), limit, alpha, biases if with_biases else None)
    assert (packed.swiglu_limit, packed.has_biases) == (pytest.approx(limit), with_biases)
    x, ids, weights = routing(case.hidden, seed=7)
    out = kt_ops.moe_forward(x, ids, weights, packed)
    dq = reference.dequantize(packed.data)
    ref = reference.moe_forward(x, ids, weights, *dq, **reference.activation_of(packed.data))
    # int8 activations (INT8/INT4/GGUF) bound the error at 4e-2, float ones at 1e-2
    bound = 1e-2 if case.format in ("bf16", "fp8", "fp8_perchannel", "mxfp8") else 4e-2
    assert rel_err(out, ref) <= bound
    plain = reference.moe_forward(x, ids, weights, *dq)  # the activation must matter
    assert rel_err(out, plain) > 5 * bound


@pytest.mark.parametrize("limit", [0.0, 0.5])
@pytest.mark.parametrize("method", ["BF16", "AMXINT8", "FP8"])
def test_alpha_swiglu_without_biases(method: str, limit: float, variant: str) -> None:
    gate, up, down, _ = layer(96, 80, seed=3)
    packed = kt_ops.pack_experts(gate, up, down, method=method, swiglu_alpha=1.702, swiglu_limit=limit)
    assert not packed.has_biases and packed.swiglu_alpha == pytest.approx(1.702)
    x, ids, weights = routing(96, seed=5)
    dq = reference.dequantize(packed.data)
    ref = reference.moe_forward(x, ids, weights, *dq, swiglu_limit=limit, swiglu_alpha=1.702)
    assert rel_err(kt_ops.moe_forward(x, ids, weights, packed), ref) <= (1e-2 if method != "AMXINT8" else 4e-2)


@pytest.mark.parametrize("method", ["BF16", "AMXINT8", "FP8"])
def test_only_some_biases(method: str, variant: str) -> None:
    """A missing bias is zero: only down's, or only gate's."""
    gate, up, down, (gb, ub, db) = layer(64, 48, seed=4)
    x, ids, weights = routing(64, seed=6)
    for biases in [(None, None, db), (gb, None, None)]:
        packed = kt_ops.pack_experts(gate, up, down, method=method, biases=biases)
        dq = reference.dequantize(packed.data)
        ref = reference.moe_forward(x, ids, weights, *dq, biases=biases)
        assert rel_err(kt_ops.moe_forward(x, ids, weights, packed), ref) <= 4e-2


def test_the_reference_activations() -> None:
    g = torch.tensor([-20.0, -1.0, 0.0, 2.0, 9.0, float("nan")])
    u = torch.tensor([-9.0, 0.5, 1.0, -3.0, 9.0, 1.0])
    torch.testing.assert_close(reference.glu(g, u), torch.nn.functional.silu(g) * u, equal_nan=True)
    clamped = reference.glu(g, u, swiglu_limit=7.0)
    gc, uc = torch.tensor([-20.0, -1.0, 0.0, 2.0, 7.0, float("nan")]), torch.tensor([-7.0, 0.5, 1.0, -3.0, 7.0, 1.0])
    torch.testing.assert_close(clamped, torch.nn.functional.silu(gc) * uc, equal_nan=True)
    oai = reference.glu(g, u, swiglu_limit=7.0, swiglu_alpha=1.702)  # gpt-oss: the gate clamped from above only
    torch.testing.assert_close(oai, gc * torch.sigmoid(1.702 * gc) * (uc + 1), equal_nan=True)


@pytest.mark.parametrize("alpha", [0.0, 1.702])
def test_nan_stays_nan_through_the_clamps(alpha: float, variant: str) -> None:
    """A NaN gate weight of one expert makes NaN the tokens routed to it, as in the
    reference; the clamps do not turn it into the limit."""
    gate, up, down, _ = layer(64, 48, seed=9)
    gate[2, 5, 7] = float("nan")  # the operator packs it (kt_ops.pack_experts would refuse it)
    packed = kt_ops.set_activation(torch.ops.kt.pack_experts(gate, up, down, "bf16", 0, False), 0.5, alpha)
    x, ids, weights = routing(64, seed=8)
    out = kt_ops.moe_forward(x, ids, weights, packed)
    routed = (ids == 2).any(dim=1)
    assert routed.any() and (~routed).any()
    assert torch.isnan(out[routed]).all(dim=1).all() and torch.isfinite(out[~routed]).all()


@pytest.mark.parametrize("method", ["BF16", "AMXINT4", "FP8"])
def test_a_row_does_not_depend_on_the_other_rows(method: str, variant: str) -> None:
    gate, up, down, biases = layer(128, 96, seed=2)
    extra = {"group_size": 32} if method == "AMXINT4" else {}
    packed = kt_ops.pack_experts(gate, up, down, method=method, swiglu_limit=0.7, swiglu_alpha=1.702, biases=biases,
                                 **extra)
    x, ids, weights = routing(128, seed=3)
    together = kt_ops.moe_forward(x, ids, weights, packed)
    for t in range(T):
        alone = kt_ops.moe_forward(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], packed)
        assert torch.equal(alone[0], together[t])


def test_set_activation_keeps_the_weights_and_round_trips() -> None:
    gate, up, down, biases = layer(64, 48, seed=1)
    plain = kt_ops.pack_experts(gate, up, down, method="AMXINT8")
    assert kt_ops.set_activation(plain) is plain  # nothing asked, nothing held
    assert _C.packed_info(plain.data)["bias_offset"] == 0 and int(plain.data[8]) == 1  # header version 1
    active = kt_ops.set_activation(plain, 7.0, 1.702, biases)
    assert int(active.data[8]) == 2  # version 2: older builds refuse it
    assert torch.equal(active.data[256:plain.nbytes], plain.data[256:])  # the same weights
    got = reference.activation_of(active.data)
    assert got["swiglu_limit"] == 7.0 and got["swiglu_alpha"] == pytest.approx(1.702)
    for b, want in zip(got["biases"], biases):
        torch.testing.assert_close(b, want)
    # replaced, then removed: back to the plain blob's bytes
    again = kt_ops.set_activation(active, 0.0, 0.0, (None, biases[1].bfloat16(), None))
    assert again.has_biases and torch.equal(reference.activation_of(again.data)["biases"][0], torch.zeros(E, 48))
    back = kt_ops.set_activation(again)
    assert torch.equal(back.data, plain.data)


def test_gguf_blobs_take_biases() -> None:
    gate, up, down, biases = layer(64, 64, seed=5)
    packed = kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type="Q8_0", biases=biases,
                                 swiglu_limit=1.0)
    info = _C.packed_info(packed.data)
    assert info["biases"] and info["bias_offset"] >= max(info["matrix_offsets"])
    x, ids, weights = routing(64, seed=1)
    dq = reference.dequantize(packed.data)
    ref = reference.moe_forward(x, ids, weights, *dq, swiglu_limit=1.0, biases=biases)
    assert rel_err(kt_ops.moe_forward(x, ids, weights, packed), ref) <= 4e-2


def test_bad_activation_input() -> None:
    gate, up, down, (gb, ub, db) = layer(64, 48, seed=1)
    packed = kt_ops.pack_experts(gate, up, down, method="BF16")
    for limit, alpha in [(-1.0, 0.0), (0.0, -0.5), (float("nan"), 0.0), (0.0, float("inf"))]:
        with pytest.raises(ValueError, match="swiglu_limit and swiglu_alpha"):
            kt_ops.set_activation(packed, limit, alpha)
    with pytest.raises(ValueError, match=r"gate_bias must be \[4, 48\]"):
        kt_ops.set_activation(packed, biases=(gb[:, :40], None, None))
    with pytest.raises(ValueError, match=r"down_bias must be \[4, 64\]"):
        kt_ops.set_activation(packed, biases=(None, None, db.T))
    with pytest.raises(ValueError, match="up_bias must be a float tensor"):
        kt_ops.set_activation(packed, biases=(None, ub.to(torch.int32), None))
    with pytest.raises(ValueError, match="tuple"):
        kt_ops.set_activation(packed, biases=gb)  # type: ignore[arg-type]
    # a bool or a string passed float() silently; a NaN bias made its expert's outputs NaN
    for limit, alpha in [(True, 0.0), ("7", 0.0), (0.0, True)]:
        with pytest.raises(ValueError, match="swiglu_limit and swiglu_alpha"):
            kt_ops.set_activation(packed, limit, alpha)  # type: ignore[arg-type]
    for bad in [(gb.masked_fill(gb > 0, float("nan")), None, None), (None, None, db.masked_fill(db > 0, float("inf")))]:
        with pytest.raises(ValueError, match="non-finite"):
            kt_ops.set_activation(packed, biases=bad)
        with pytest.raises(ValueError, match="non-finite"):
            kt_ops.pack_experts(gate, up, down, method="BF16", biases=bad)
    assert kt_ops.set_activation(packed, np.float32(7.0), np.float64(0.0)).swiglu_limit == 7.0
    assert kt_ops.set_activation(packed, torch.tensor(7.0)).swiglu_limit == 7.0
    with pytest.raises(ValueError, match="swiglu_limit and swiglu_alpha"):
        kt_ops.set_activation(packed, torch.tensor(True))


@pytest.mark.parametrize("limit,alpha", [(0.0, 1e-300), (1e-300, 0.0), (1e-46, 1.702)])
def test_a_nonzero_activation_number_that_is_zero_in_fp32_is_refused(limit: float, alpha: float) -> None:
    """The header holds fp32: a positive swiglu_alpha or swiglu_limit below fp32's range
    was stored as 0, silently switching alpha-SwiGLU to plain SiLU (or the clamp off) —
    0.88 relative error against the reference with the asked activation."""
    gate, up, down, _ = layer(64, 48, seed=1)
    packed = kt_ops.pack_experts(gate, up, down, method="BF16")
    with pytest.raises(ValueError, match="swiglu_limit and swiglu_alpha"):
        kt_ops.set_activation(packed, limit, alpha)
    with pytest.raises(ValueError, match="swiglu_limit and swiglu_alpha"):
        kt_ops.pack_experts(gate, up, down, method="BF16", swiglu_limit=limit, swiglu_alpha=alpha)
    with pytest.raises(ValueError, match="nonzero in float32"):  # the operator itself, for direct callers
        kt_ops._C.set_activation(packed.data, limit, alpha)
    assert kt_ops.set_activation(packed, 0.0, 1e-40).swiglu_alpha > 0  # subnormal in fp32: still held
    # KTMoEWrapper: without biases its parts were kept as they were (plain SiLU), the value
    # compared as fp32 0 with the header's 0
    for name, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if value == 0 or np.float32(value) != 0:
            continue
        with pytest.raises(ValueError, match=f"{name} must be a finite number"):
            kt_ops.KTMoEWrapper(0, E, TOP_K, 64, 48, method="BF16", swiglu_limit=limit, swiglu_alpha=alpha)


def test_a_float64_bias_beyond_fp32_range_is_refused() -> None:
    """Biases are stored as fp32: a finite float64 bias of 1e300 was stored as inf, every
    output of its expert infinite, though non-finite biases are refused."""
    gate, up, down, (gb, ub, db) = layer(64, 48, seed=1)
    big = gb.double()
    big[1, 3] = 1e300
    with pytest.raises(ValueError, match="non-finite"):
        kt_ops.pack_experts(gate, up, down, method="BF16", biases=(big, None, None))
    held = kt_ops.set_activation(kt_ops.pack_experts(gate, up, down, method="BF16"), biases=(gb.double(), None, None))
    assert torch.equal(reference.activation_of(held.data)["biases"][0], gb)  # in range: kept


def test_headers_whose_version_disagrees_with_the_activation_are_refused() -> None:
    gate, up, down, biases = layer(64, 48, seed=1)
    active = kt_ops.set_activation(kt_ops.pack_experts(gate, up, down, method="BF16"), 1.0, 0.0, biases)
    forged = active.data.clone()
    forged[8] = 1  # claims version 1 with activation fields set; re-checksum it
    _rechecksum(forged)
    with pytest.raises(ValueError, match="disagrees with its activation"):
        kt_ops.PackedExperts(forged)
    truncated = active.data[:-4].clone()
    with pytest.raises(ValueError, match="truncated"):
        kt_ops.PackedExperts(truncated)


def _rechecksum(blob: torch.Tensor) -> None:
    """FNV-1a over the header's first 248 bytes into bytes 248..255 (packed_header.cpp)."""
    h = 1469598103934665603
    for byte in blob[:248].tolist():
        h = ((h ^ byte) * 1099511628211) & (2**64 - 1)
    blob[248:256] = torch.tensor(list(h.to_bytes(8, "little")), dtype=torch.uint8)


@pytest.mark.parametrize("threadpool_count", [1, 2])
@pytest.mark.parametrize("method", ["BF16", "AMXINT8"])
def test_wrapper_activation_and_biases(method: str, threadpool_count: int) -> None:
    """KTMoEWrapper's swiglu_limit/swiglu_alpha keywords and load_weights_from_tensors'
    biases, with the layer split into parts (down's bias added once) and some experts on
    the GPU side (their slots contribute nothing here)."""
    H, I = 64, 96
    gate, up, down, biases = layer(H, I, seed=11)
    mask = torch.tensor([False, True, False, False])
    wr = kt_ops.KTMoEWrapper(0, E, TOP_K, H, I, gpu_experts_mask=mask, threadpool_count=threadpool_count,
                             method=method, swiglu_limit=7.0, swiglu_alpha=1.702)
    wr.load_weights_from_tensors(gate, up, down, biases=biases)
    x, ids, weights = routing(H, seed=12)
    out = wr.forward(x.bfloat16(), ids, weights).float()
    cpu_ids = torch.where(mask[ids.clamp(min=0)] | (ids < 0), -1, ids)
    ref = reference.moe_forward(x.bfloat16(), cpu_ids, weights, gate, up, down, swiglu_limit=7.0, swiglu_alpha=1.702,
                                biases=biases)
    assert rel_err(out, ref) <= 4e-2
    with pytest.raises(ValueError, match="swiglu_alpha must be a finite number"):
        kt_ops.KTMoEWrapper(0, E, TOP_K, H, I, method=method, swiglu_alpha=-1.0)
    with pytest.raises(ValueError, match="swiglu_limit must be a finite number"):
        kt_ops.KTMoEWrapper(0, E, TOP_K, H, I, method=method, swiglu_limit=True)
    with pytest.raises(ValueError, match=r"down_bias must be \[4, 64\]"):
        wr.load_weights_from_tensors(gate, up, down, biases=(None, None, biases[0]))
    with pytest.raises(ValueError, match="gate_bias must be a tensor"):
        wr.load_weights_from_tensors(gate, up, down, biases=(biases[0].tolist(), None, None))
