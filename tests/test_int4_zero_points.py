"""int4_asym with integer zero points (AWQ, asymmetric GPTQ, online round-to-nearest).

When every minimum of an ``int4_asym`` blob is ``-z * scale`` for an integer ``z`` in
[0, 16], the packers set the header's integer-zero flag and the kernels compute each
group as ``scale * sum (q - z) a``, one exact integer sum (on AMX tiles: ``q - z`` as
signed bytes, ``tdpbssd``), instead of adding ``minimum * sum a`` in fp32
(docs/formats.md, "Integer zero points"). Checked here: when the flag is set (and when
not), that both arithmetics compute the layer the blob describes, on every variant,
bit-identical between a token decoded alone and the same token in a batch (AMX tiles
included), and the online quantizer's zero points.
"""

from __future__ import annotations

import pytest
import torch

import kt_ops
from kt_ops import _C
from kt_ops import reference as ref

from test_hostile import put, rechecksum

FLAG_OFFSET = 168  # the header's weight flags (bit 0: integer zero points)


def integer_zeros(packed: kt_ops.PackedExperts) -> bool:
    return bool(_C.packed_info(packed.data)["integer_zeros"])


def checkpoint_like(E: int, H: int, I: int, group: int, seed: int, max_zero: int = 16):
    """Random levels, fp16-valued scales and integer zeros in [0, max_zero] as
    :func:`kt_ops.pack_int4_experts` takes them (minimum = -scale * zero), AWQ-style."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in ((I, H), (I, H), (H, I)):
        levels = torch.randint(0, 16, (E, n, k), generator=g, dtype=torch.uint8)
        nibbles = levels[..., 0::2] | (levels[..., 1::2] << 4)
        scale = (torch.rand(E, n, k // group, generator=g) * 0.02 + 0.001).half().float()
        zero = torch.randint(0, max_zero + 1, (E, n, k // group), generator=g).float()
        out.append((nibbles, scale, -scale * zero))
    return out


def pack(parts, group: int) -> kt_ops.PackedExperts:
    (gn, gs, gm), (un, us, um), (dn, ds, dm) = parts
    return kt_ops.pack_int4_experts(gn, un, dn, (gs, us, ds), (gm, um, dm), group)


def without_flag(packed: kt_ops.PackedExperts) -> kt_ops.PackedExperts:
    """The same blob with the integer-zero flag cleared: the minimum arithmetic."""
    blob = packed.data.clone()
    put(blob, FLAG_OFFSET, 4, 0)
    rechecksum(blob)
    return kt_ops.PackedExperts(blob)


def routing(T: int, E: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    return ids, torch.rand(T, 2, generator=g)


@pytest.mark.parametrize("group", [32, 128])
def test_flagged_layer_matches_the_oracle_and_its_unflagged_twin(variant: str, group: int) -> None:
    E, H, I, T = 4, 640, 384, 40
    packed = pack(checkpoint_like(E, H, I, group, seed=group), group)
    assert packed.format == "int4_asym" and integer_zeros(packed)
    twin = without_flag(packed)
    assert not integer_zeros(twin)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    ids, w = routing(T, E, 2)
    out, out_twin = kt_ops.moe_forward(x, ids, w, packed), kt_ops.moe_forward(x, ids, w, twin)
    gate, up, down = ref.dequantize(packed.data)
    oracle = ref.moe_forward(x, ids, w, gate, up, down, quantize_activations=True)
    for got in (out, out_twin):
        assert torch.isfinite(got).all()
        assert float((got - oracle).norm() / oracle.norm()) < 4e-2
    # Both are the same layer: they differ only in the rounding of the minimum term.
    assert float((out - out_twin).norm() / out_twin.norm()) < 1e-4


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("flagged", [True, False], ids=["integer", "minimum"])
def test_batched_rows_equal_rows_decoded_alone(variant: str, group: int, flagged: bool) -> None:
    """40 tokens on 2 experts (the AMX tiles on amx, the k-blocked GEMM elsewhere) give
    each token's 1-token (decode) row bit for bit, with both arithmetics."""
    E, H, I, T = 2, 640, 384, 40
    packed = pack(checkpoint_like(E, H, I, group, seed=3), group)
    if not flagged:
        packed = without_flag(packed)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=g)
    ids = torch.tensor([[0, 1]] * T)
    w = torch.rand(T, 2, generator=g)
    batch = kt_ops.moe_forward(x, ids, w, packed)
    alone = torch.cat([kt_ops.moe_forward(x[t:t + 1], ids[t:t + 1], w[t:t + 1], packed) for t in range(T)])
    assert torch.equal(batch.view(torch.int32), alone.view(torch.int32))


def test_the_packers_set_the_flag_only_for_integer_zeros() -> None:
    E, H, I, group = 2, 64, 64, 32
    parts = checkpoint_like(E, H, I, group, seed=5)
    assert integer_zeros(pack(parts, group))

    def edited(edit) -> kt_ops.PackedExperts:
        copy = [tuple(t.clone() for t in p) for p in parts]
        edit(copy)
        return pack(copy, group)

    def set_(i, j, value):
        return lambda c: c[0][i].view(-1).__setitem__(j, value)

    scale0 = float(parts[0][1].view(-1)[0])
    cases = {
        "zero 17": (set_(2, 0, -17 * scale0), False),
        "zero -1": (set_(2, 0, scale0), False),
        "half zero": (set_(2, 0, -2.5 * scale0), False),
        "zero scale, zero minimum": (lambda c: (set_(1, 0, 0.0)(c), set_(2, 0, 0.0)(c)), True),
        "zero scale, minimum": (lambda c: (set_(1, 0, 0.0)(c), set_(2, 0, -0.01)(c)), False),
        "nan scale": (set_(1, 0, float("nan")), False),
        "subnormal scale": (lambda c: (set_(1, 0, 2.0**-140)(c), set_(2, 0, -(2.0**-139))(c)), False),
        "zero 16": (set_(2, 0, -16 * scale0), True),
    }
    for name, (edit, expected) in cases.items():
        assert integer_zeros(edited(edit)) == expected, name
    symmetric = kt_ops.pack_int4_experts(parts[0][0], parts[1][0], parts[2][0], (parts[0][1], parts[1][1], parts[2][1]),
                                         None, group)
    assert symmetric.format == "int4" and not integer_zeros(symmetric)


def test_online_round_to_nearest_has_integer_zero_points() -> None:
    """pack_experts' int4_asym (AWQ_INT4, zero_point=True) quantizes as GPTQ / AWQ do:
    a range holding 0, minimum = -z * scale with z in [0, 15]; the scale search fits any
    minimum (no flag)."""
    g = torch.Generator().manual_seed(6)
    E, H, I = 2, 256, 128
    gate, up, down = (torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g) + 0.5,
                      torch.randn(E, H, I, generator=g).abs())  # up and down: groups of one sign
    for method, kwargs in (("AWQ_INT4", {}), ("AMXINT4", {"zero_point": True, "group_size": 64})):
        packed = kt_ops.pack_experts(gate, up, down, method=method, **kwargs)
        assert packed.format == "int4_asym" and integer_zeros(packed), method
        for w, q in zip((gate, up, down), ref.dequantize(packed.data)):
            assert float((q - w).norm() / w.norm()) < 0.12, method
    searched = kt_ops.pack_experts(gate, up, down, method="AWQ_INT4", scale_search=True)
    assert not integer_zeros(searched)


def test_flag_on_another_format_is_refused() -> None:
    g = torch.Generator().manual_seed(7)
    E, H, I = 2, 64, 64
    w = (torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g))
    for method in ("AMXINT4", "AMXINT8", "BF16", "MXFP4"):
        blob = kt_ops.pack_experts(*w, method=method, **({"group_size": 32} if method == "AMXINT4" else {})).data.clone()
        put(blob, FLAG_OFFSET, 4, 1)
        rechecksum(blob)
        with pytest.raises(ValueError, match="integer-zero-point flag"):
            kt_ops.PackedExperts(blob)
    blob = kt_ops.pack_experts(*w, method="AWQ_INT4", group_size=32).data.clone()
    put(blob, FLAG_OFFSET, 4, 2)
    rechecksum(blob)
    with pytest.raises(ValueError, match="unknown weight flags"):
        kt_ops.PackedExperts(blob)
