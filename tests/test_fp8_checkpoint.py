"""FP8 checkpoints read in place: kt_ops.hf_checkpoint finds the e4m3 experts and their
scales (fp8 128 x 128 blocks, fp8_perchannel, mxfp8) under every expert naming,
KTMoEWrapper packs them without widening, the converter keeps them, and bad files are
ValueErrors naming the tensor."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import kt_ops
import kt_ops.hf_checkpoint as hf
from checkpoint_helpers import (FP8_LAYOUTS, e4m3_codes, fp8_expected, fp8_scales, make_weights, write_checkpoint,
                                write_fp8_layer)
from conftest import random_routing, rel_err
from kt_ops import reference
from kt_ops.hf_checkpoint import HfCheckpoint
from kt_ops.wrappers import KTMoEWrapper
from test_fp8 import weights_of

KINDS = {"fp8": "FP8", "fp8_perchannel": "FP8_PERCHANNEL", "mxfp8": "MXFP8"}
PREFIXES = {  # (convention, the key prefix of layer L)
    "per_expert": "model.layers.{L}",
    "w123": "model.layers.{L}",
    "fused": "model.layers.{L}",
    "vl": "model.language_model.layers.{L}",  # per_expert under Qwen3.5's VL prefix
    "m3": "language_model.model.layers.{L}",  # w123 under MiniMax-M3's prefix
}


def fp8_matrix(kind: str, E: int, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 codes [E, n, k] (no NaN codes) and scales in the checkpoint's shapes."""
    codes = torch.randint(0, 256, (E, n, k), generator=g, dtype=torch.uint8)
    codes = torch.where(codes & 0x7F == 0x7F, codes & 0x80, codes).view(torch.float8_e4m3fn)
    if kind == "fp8":
        return codes, torch.rand(E, -(-n // 128), -(-k // 128), generator=g) * 0.02 + 1e-3
    if kind == "fp8_perchannel":
        return codes, torch.rand(E, n, 1, generator=g) * 0.02 + 1e-3
    return codes, torch.randint(115, 122, (E, n, -(-k // 32)), generator=g, dtype=torch.uint8)


def write_fp8_checkpoint(path: Path, kind: str, convention: str, E: int = 3, H: int = 160, I: int = 96,
                         layer: int = 1, skip: tuple[str, ...] = (), seed: int = 0) -> tuple[Path, list]:
    """A one-layer FP8 checkpoint; returns it and [(codes, scale)] for gate, up, down [E, N, K]."""
    g = torch.Generator().manual_seed(seed)
    mats = [fp8_matrix(kind, E, I, H, g), fp8_matrix(kind, E, I, H, g), fp8_matrix(kind, E, H, I, g)]
    base = PREFIXES[convention].format(L=layer)
    scale_name = "weight_scale" if kind == "fp8_perchannel" else "weight_scale_inv"
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.zeros(4, H, dtype=torch.bfloat16)}
    if convention == "fused":
        (gq, gs), (uq, us), (dq, ds) = mats
        if kind == "fp8":  # gate and up blocks of the fused tensor: I is a multiple of 128 here
            assert I % 128 == 0
        fused = torch.cat((gq.view(torch.uint8), uq.view(torch.uint8)), 1).view(torch.float8_e4m3fn)
        tensors[f"{base}.mlp.experts.gate_up_proj"] = fused
        tensors[f"{base}.mlp.experts.gate_up_proj_scale_inv"] = torch.cat((gs, us), 1)
        tensors[f"{base}.mlp.experts.down_proj"] = dq
        tensors[f"{base}.mlp.experts.down_proj_scale_inv"] = ds
    else:
        block, names = (("block_sparse_moe", ("w1", "w3", "w2")) if convention in ("w123", "m3")
                        else ("mlp", ("gate_proj", "up_proj", "down_proj")))
        for (q, s), name in zip(mats, names):
            for e in range(E):
                key = f"{base}.{block}.experts.{e}.{name}"
                tensors[f"{key}.weight"] = q[e].contiguous()
                tensors[f"{key}.{scale_name}"] = (s[e, :, 0] if kind == "fp8_perchannel" and e % 2 else s[e]).contiguous()
    for key in skip:
        del tensors[key]
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "test", "hidden_size": H, "moe_intermediate_size": I,
                                                  "num_experts": E, "num_hidden_layers": layer + 1}))
    return path, mats


def cases() -> list:
    out = []
    for kind in KINDS:
        for convention in PREFIXES:
            if convention == "fused" and kind == "fp8":
                continue  # covered by test_fused_fp8_blocks (needs I % 128 == 0)
            out.append(pytest.param(kind, convention, id=f"{kind}-{convention}"))
    return out


@pytest.mark.parametrize("kind,convention", cases())
def test_load_in_place(tmp_path: Path, kind: str, convention: str) -> None:
    path, mats = write_fp8_checkpoint(tmp_path, kind, convention)
    checkpoint = HfCheckpoint(path)
    assert checkpoint.fp8_kind(1) == kind
    picked = [2, 0, 2]
    got = checkpoint.load_fp8_experts(1, picked, 160, 96)
    assert got.kind == kind
    for q, s, (want_q, want_s) in zip((got.gate, got.up, got.down), (got.gate_scale, got.up_scale, got.down_scale), mats):
        assert q.dtype == torch.float8_e4m3fn
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)[picked])
        want = want_s[picked]
        assert torch.equal(s.reshape(want.shape), want.to(s.dtype))
    # the dequantizing path (BF16 / INT8 / INT4 / GGUF conversion) applies the same scales
    deq = checkpoint.load_experts(1, picked, 160, 96)
    for w, (q, s) in zip(deq, mats):
        torch.testing.assert_close(w.float(), weights_of(q[picked], s[picked], kind).bfloat16().float(), rtol=0, atol=0)


def test_fused_fp8_blocks(tmp_path: Path) -> None:
    """Fused gate_up with 128 x 128 block scales (I a multiple of 128), then I = 96 where the
    blocks straddle gate and up: per-row scales."""
    path, mats = write_fp8_checkpoint(tmp_path / "a", "fp8", "fused", H=160, I=128)
    got = HfCheckpoint(path).load_fp8_experts(1, [1, 0], 160, 128)
    assert torch.equal(got.up.view(torch.uint8), mats[1][0].view(torch.uint8)[[1, 0]])
    assert torch.equal(got.up_scale, mats[1][1][[1, 0]])
    # straddling blocks: write a fused tensor with I = 96 and scales over the 192 fused rows
    g = torch.Generator().manual_seed(1)
    E, H, I = 2, 160, 96
    fused, fused_scale = fp8_matrix("fp8", E, 2 * I, H, g)
    down, down_scale = fp8_matrix("fp8", E, H, I, g)
    tensors = {"model.layers.0.mlp.experts.gate_up_proj": fused, "model.layers.0.mlp.experts.gate_up_proj_scale_inv": fused_scale,
               "model.layers.0.mlp.experts.down_proj": down, "model.layers.0.mlp.experts.down_proj_scale_inv": down_scale}
    (tmp_path / "b").mkdir()
    save_file(tensors, str(tmp_path / "b" / "model.safetensors"))
    got = HfCheckpoint(tmp_path / "b").load_fp8_experts(0, [0, 1], H, I)
    rows = fused_scale.repeat_interleave(128, 1)[:, : 2 * I]
    assert torch.equal(got.gate_scale, rows[:, :I]) and torch.equal(got.up_scale, rows[:, I:])
    packed = kt_ops.pack_fp8_experts(got.gate, got.up, got.down, got.gate_scale, got.up_scale, got.down_scale)
    gate, up, _ = reference.dequantize(packed.data)
    full = weights_of(fused, fused_scale, "fp8")
    torch.testing.assert_close(gate, full[:, :I], rtol=0, atol=0)
    torch.testing.assert_close(up, full[:, I:], rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("parts", [1, 2])
def test_wrapper_packs_in_place(tmp_path: Path, kind: str, parts: int) -> None:
    E, H, I = 4, 160, 256  # I splits at 128: on a scale column for every kind
    path, mats = write_fp8_checkpoint(tmp_path, kind, "per_expert", E=E, H=H, I=I)
    wrapper = KTMoEWrapper(layer_idx=1, num_experts=E, num_experts_per_tok=2, hidden_size=H, moe_intermediate_size=I,
                           weight_path=path, method=KINDS[kind], threadpool_count=parts)
    wrapper.load_weights()
    assert [p.format for p in wrapper._parts] == [kind] * parts
    checkpoint_bytes = sum(q.numel() + s.numel() * s.element_size() for q, s in mats)
    assert sum(p.nbytes for p in wrapper._parts) <= 1.15 * checkpoint_bytes
    if parts == 1:
        direct = kt_ops.pack_fp8_experts(*(q for q, _ in mats), *(s for _, s in mats), KINDS[kind])
        assert torch.equal(wrapper._parts[0].data, direct.data)
    T = 9
    ids, weights = random_routing(T, E, 2)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = wrapper.forward(x, ids.long(), weights)
    ref = reference.moe_forward(x, ids, weights, *(weights_of(q, s, kind) for q, s in mats))
    assert rel_err(out, ref) <= 1e-2


def test_wrapper_method_must_match_the_kind(tmp_path: Path) -> None:
    path, _ = write_fp8_checkpoint(tmp_path, "fp8_perchannel", "per_expert")
    wrapper = KTMoEWrapper(layer_idx=1, num_experts=3, num_experts_per_tok=2, hidden_size=160, moe_intermediate_size=96,
                           weight_path=path, method="FP8")
    with pytest.raises(ValueError, match="holds FP8_PERCHANNEL experts .* use method='FP8_PERCHANNEL'"):
        wrapper.load_weights()
    # another method dequantizes and requantizes
    other = KTMoEWrapper(layer_idx=1, num_experts=3, num_experts_per_tok=2, hidden_size=160, moe_intermediate_size=96,
                         weight_path=path, method="AMXINT8")
    other.load_weights()
    assert other._parts[0].format == "int8"


def test_fp8_method_on_a_bf16_checkpoint_quantizes_online(tmp_path: Path) -> None:
    from checkpoint_helpers import make_weights, write_checkpoint

    ws = make_weights([0], E=3, H=64, I=32)
    path = write_checkpoint(tmp_path, ws)
    wrapper = KTMoEWrapper(layer_idx=0, num_experts=3, num_experts_per_tok=2, hidden_size=64, moe_intermediate_size=32,
                           weight_path=path, method="MXFP8")
    wrapper.load_weights()
    gate, up, down = ws[0]
    expected = kt_ops.pack_experts(gate.bfloat16(), up.bfloat16(), down.bfloat16(), method="MXFP8")
    assert torch.equal(wrapper._parts[0].data, expected.data)


def test_convert_keeps_fp8_and_writes_fp8(tmp_path: Path) -> None:
    from kt_ops.convert import main

    src, mats = write_fp8_checkpoint(tmp_path / "src", "mxfp8", "per_expert", E=3, H=160, I=96)
    out = tmp_path / "out"
    args = ["--input-path", str(src), "--input-type", "fp8", "--output", str(out), "--quant-method", "mxfp8"]
    assert main(args) == 0
    wrapper = KTMoEWrapper(layer_idx=1, num_experts=3, num_experts_per_tok=2, hidden_size=160, moe_intermediate_size=96,
                           weight_path=out, method="MXFP8")
    wrapper.load_weights()
    direct = kt_ops.pack_fp8_experts(*(q for q, _ in mats), *(s for _, s in mats), "MXFP8")
    assert torch.equal(wrapper._parts[0].data, direct.data)  # the checkpoint's bytes, not a requantization
    out8 = tmp_path / "int8"
    assert main(["--input-path", str(src), "--input-type", "fp8", "--output", str(out8), "--quant-method", "int8"]) == 0


# ---- kt_ops.hf_checkpoint on its own: every kind x every naming, in place and dequantized ------

SIZES = [(160, 96), (150, 72), (136, 128)]  # (H, I): 150, 72, 136 are not multiples of 32; I = 128 fills fused blocks
FLOAT_SCALES = [torch.float32, torch.bfloat16, torch.float16]
BYTE_SCALES = [torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)]


def scale_options(kind: str, i: int) -> dict:
    """Stored scale dtype and name by case: fp8 under ``weight_scale`` (Mistral) once,
    per-channel under ``weight_scale_inv`` once, ue8m0 as U8 and F8_E8M0."""
    if kind == "mxfp8":
        return {"scale_dtype": BYTE_SCALES[i % 2]}
    name = {"fp8": {1: "weight_scale"}, "fp8_perchannel": {2: "weight_scale_inv"}}[kind].get(i)
    return {"scale_dtype": FLOAT_SCALES[i], "scale_name": name}


def expected_experts(mats: dict, kind: str, experts: list[int], I: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(codes, scale) of gate, up, down for ``experts`` as :class:`Fp8Experts` must hold them."""
    down = (mats["down"][0][experts], mats["down"][1][experts])
    if "gate_up" not in mats:
        return [(mats[m][0][experts], mats[m][1][experts]) for m in ("gate", "up")] + [down]
    codes, scale = mats["gate_up"][0][experts], mats["gate_up"][1][experts]
    if kind == "fp8" and I % 128:  # blocks straddle gate and up: each weight row's block-scale row
        scale = scale[:, torch.arange(2 * I) // 128]
    split = I // 128 if kind == "fp8" and not I % 128 else I
    return [(codes[:, :I], scale[:, :split]), (codes[:, I:], scale[:, split:]), down]


def expected_dequantized(mats: dict, kind: str, experts: list[int], I: int) -> list[torch.Tensor]:
    if "gate_up" not in mats:
        return [fp8_expected(mats[m][0][experts], mats[m][1][experts], kind) for m in ("gate", "up", "down")]
    full = fp8_expected(mats["gate_up"][0][experts], mats["gate_up"][1][experts], kind)
    return [full[:, :I], full[:, I:], fp8_expected(mats["down"][0][experts], mats["down"][1][experts], kind)]


@pytest.mark.parametrize("size", range(len(SIZES)), ids=[f"H{h}-I{i}" for h, i in SIZES])
@pytest.mark.parametrize("layout", FP8_LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_bytes_in_place_and_dequantized(tmp_path: Path, kind: str, layout: str, size: int) -> None:
    H, I = SIZES[size]
    path, mats = write_fp8_layer(tmp_path, kind, layout, E=3, H=H, I=I, layer=2, seed=size, index=size == 1,
                                 **scale_options(kind, size))
    checkpoint = HfCheckpoint(path)
    assert checkpoint.fp8_kind(2) == kind
    assert checkpoint.dtype(2) == torch.float8_e4m3fn
    experts = [2, 0, 2, 1]
    got = checkpoint.load_fp8_experts(2, experts, H, I)
    assert got.kind == kind
    scale_dtype = torch.uint8 if kind == "mxfp8" else torch.float32
    for codes, scale, (want_codes, want_scale) in zip((got.gate, got.up, got.down),
                                                      (got.gate_scale, got.up_scale, got.down_scale),
                                                      expected_experts(mats, kind, experts, I)):
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == want_codes.shape
        assert torch.equal(codes.view(torch.uint8), want_codes)
        assert scale.dtype == scale_dtype and scale.shape == want_scale.shape
        assert torch.equal(scale, want_scale)
    dequantized = checkpoint.load_experts(2, experts, H, I)
    for tensor, want in zip(dequantized, expected_dequantized(mats, kind, experts, I)):
        assert tensor.dtype == torch.bfloat16 and tensor.shape == want.shape
        torch.testing.assert_close(tensor, want, rtol=0, atol=0, equal_nan=True)
    assert all(t.isnan().any() for t in dequantized)  # the NaN codes came through as NaN


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("kind", KINDS)
def test_no_experts_listed(tmp_path: Path, kind: str, layout: str) -> None:
    path, _ = write_fp8_layer(tmp_path, kind, layout)
    got = HfCheckpoint(path).load_fp8_experts(1, [], 160, 96)
    assert got.kind == kind and got.gate.shape == (0, 96, 160) and got.down.shape == (0, 160, 96)
    rows = {"fp8": (0, 96, 2) if layout == "fused" else (0, 1, 2), "fp8_perchannel": (0, 96), "mxfp8": (0, 96, 5)}
    assert got.gate_scale.shape == got.up_scale.shape == rows[kind]


def test_a_single_row_scale_is_told_by_its_name(tmp_path: Path) -> None:
    """I = 1: a gate scale [1, 1] fits both fp8 blocks and per-channel; weight_scale_inv
    means fp8, weight_scale per channel (down [64, 1] is unambiguous)."""
    for kind in ("fp8", "fp8_perchannel"):
        path, mats = write_fp8_layer(tmp_path / kind, kind, "per_expert", E=2, H=64, I=1)
        checkpoint = HfCheckpoint(path)
        assert checkpoint.fp8_kind(1) == kind
        got = checkpoint.load_fp8_experts(1, [1, 0], 64, 1)
        assert got.kind == kind and torch.equal(got.down_scale, mats["down"][1][[1, 0]])
        for tensor, want in zip(checkpoint.load_experts(1, [1, 0], 64, 1), expected_dequantized(mats, kind, [1, 0], 1)):
            torch.testing.assert_close(tensor, want, rtol=0, atol=0, equal_nan=True)


def test_dequantize_helpers() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    want = torch.tensor([2.0 ** (e - 127) for e in range(255)] + [float("nan")], dtype=torch.float64).float()
    for stored in BYTE_SCALES:
        torch.testing.assert_close(hf.decode_ue8m0(codes.view(stored)), want, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="uint8 or float8_e8m0fnu"):
        hf.decode_ue8m0(codes.int())
    g = torch.Generator().manual_seed(3)
    weight = e4m3_codes((2, 150, 72), g)
    for kind, dequantize in (("fp8", hf.dequantize_block_fp8), ("fp8_perchannel", hf.dequantize_fp8_perchannel),
                             ("mxfp8", hf.dequantize_mxfp8)):
        scale = fp8_scales(kind, (2,), 150, 72, g)
        got = dequantize(weight.view(torch.float8_e4m3fn), scale)
        torch.testing.assert_close(got, fp8_expected(weight, scale, kind), rtol=0, atol=0, equal_nan=True)
        assert torch.equal(hf.dequantize_fp8(weight.view(torch.float8_e4m3fn), scale, kind).view(torch.int16),
                           got.view(torch.int16))
        with pytest.raises(ValueError, match="does not match weight"):
            dequantize(weight.view(torch.float8_e4m3fn), scale[..., :1, :] if kind == "fp8" else scale[..., :1])
    column = fp8_scales("fp8_perchannel", (2,), 150, 72, g)
    torch.testing.assert_close(hf.dequantize_fp8_perchannel(weight.view(torch.float8_e4m3fn), column.unsqueeze(-1)),
                               fp8_expected(weight, column, "fp8_perchannel"), rtol=0, atol=0, equal_nan=True)


# ---- bad checkpoints: ValueErrors naming the tensor (KeyError only for what is missing) --------

UP = "model.layers.1.mlp.experts.0.up_proj"


def rewrite(path: Path, changes: dict[str, torch.Tensor | None]) -> Path:
    """``path``'s model.safetensors with tensors replaced or added (None: removed)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    for key, tensor in changes.items():
        if tensor is None:
            del tensors[key]
        else:
            tensors[key] = tensor
    save_file(tensors, str(path / "model.safetensors"))
    return path


def both_loads_raise(path: Path, match: str, error: type[Exception] = ValueError, experts: list[int] = [0]) -> None:
    """load_fp8_experts and the dequantizing load_experts raise ``error`` matching ``match``
    (a ValueError that is no KeyError, unless ``error`` is KeyError)."""
    for load in (HfCheckpoint(path).load_fp8_experts, HfCheckpoint(path).load_experts):
        with pytest.raises(error, match=match) as info:
            load(1, experts, 160, 96)
        assert error is KeyError or not isinstance(info.value, KeyError)


def test_scale_of_the_wrong_shape(tmp_path: Path) -> None:
    path = rewrite(write_fp8_layer(tmp_path, "fp8", "per_expert")[0], {f"{UP}.weight_scale_inv": torch.ones(3, 3)})
    both_loads_raise(path, rf"scale '{UP}.weight_scale_inv' \(F32 \[3, 3\]\) of FP8 weight '{UP}.weight' \[96, 160\]: "
                           rf"fits no FP8 kind; expected fp8: F32/BF16/F16 \[1, 2\] .* \[96\] or \[96, 1\], "
                           rf"mxfp8: U8/F8_E8M0 \[96, 5\]")


def test_integer_scale_for_a_float_kind(tmp_path: Path) -> None:
    path = rewrite(write_fp8_layer(tmp_path, "fp8", "per_expert")[0],
                   {f"{UP}.weight_scale_inv": torch.ones(1, 2, dtype=torch.int32)})
    both_loads_raise(path, rf"scale '{UP}.weight_scale_inv' \(I32 \[1, 2\]\) of FP8 weight '{UP}.weight'.*: I32 is "
                           rf"neither a float scale .* nor ue8m0 exponents")


def test_float_scale_where_ue8m0_exponents_belong(tmp_path: Path) -> None:
    path = rewrite(write_fp8_layer(tmp_path, "mxfp8", "per_expert")[0], {f"{UP}.weight_scale_inv": torch.ones(96, 5)})
    both_loads_raise(path, rf"scale '{UP}.weight_scale_inv' \(F32 \[96, 5\]\) of FP8 weight '{UP}.weight' .*fits no "
                           rf"FP8 kind \(the mxfp8 shape, but ue8m0 exponents are U8 or F8_E8M0, not F32\)")


def test_ue8m0_exponents_of_the_wrong_shape(tmp_path: Path) -> None:
    down = "model.layers.1.block_sparse_moe.experts.0.w2.weight_scale_inv"
    path = rewrite(write_fp8_layer(tmp_path, "mxfp8", "w123")[0], {down: torch.ones(160, 2, dtype=torch.uint8)})
    both_loads_raise(path, r"scale 'model.layers.1.block_sparse_moe.experts.0.w2.weight_scale_inv' \(U8 \[160, 2\]\) .*"
                           r"ue8m0 exponents must be \[160, 3\]")


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_missing_scale(tmp_path: Path, layout: str) -> None:
    path, _ = write_fp8_layer(tmp_path, "fp8", layout)
    if layout == "fused":
        key = "model.layers.1.mlp.experts.down_proj"
        rewrite(path, {f"{key}_scale_inv": None})
        match = rf"FP8 weight '{key}' has no scale tensor \(looked for '{key}_scale_inv' and '{key}_scale'\)"
    else:
        rewrite(path, {f"{UP}.weight_scale_inv": None})
        match = (rf"FP8 weight '{UP}.weight' has no scale tensor "
                 rf"\(looked for '{UP}.weight_scale_inv' and '{UP}.weight_scale'\)")
    both_loads_raise(path, match)


def test_missing_gate_scale_fails_fp8_kind(tmp_path: Path) -> None:
    gate = "model.layers.1.mlp.experts.0.gate_proj"
    path = rewrite(write_fp8_layer(tmp_path, "mxfp8", "per_expert")[0], {f"{gate}.weight_scale_inv": None})
    with pytest.raises(ValueError, match=f"FP8 weight '{gate}.weight' has no scale tensor"):
        HfCheckpoint(path).fp8_kind(1)


def test_weights_that_are_not_fp8(tmp_path: Path) -> None:
    path = rewrite(write_fp8_layer(tmp_path / "one", "fp8", "per_expert")[0],
                   {f"{UP}.weight": torch.zeros(96, 160, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match=f"tensor '{UP}.weight' is BF16, not F8_E4M3"):
        HfCheckpoint(path).load_fp8_experts(1, [0], 160, 96)
    bf16 = write_checkpoint(tmp_path / "bf16", make_weights([1], E=3, H=160, I=96))
    assert HfCheckpoint(bf16).fp8_kind(1) is None
    with pytest.raises(ValueError, match="tensor 'model.layers.1.mlp.experts.0.gate_proj.weight' is BF16, not F8_E4M3"):
        HfCheckpoint(bf16).load_fp8_experts(1, [0, 1], 160, 96)


def test_mixed_kinds_in_one_layer(tmp_path: Path) -> None:
    down = "model.layers.1.mlp.experts.{e}.down_proj.weight_scale_inv"
    path = rewrite(write_fp8_layer(tmp_path / "down", "fp8", "per_expert")[0],
                   {down.format(e=e): torch.ones(160) for e in range(3)})
    with pytest.raises(ValueError, match=rf"layer 1 mixes FP8 kinds \(.*'{UP}.weight': fp8, .*"
                                         rf"'model.layers.1.mlp.experts.0.down_proj.weight': fp8_perchannel"):
        HfCheckpoint(path).load_fp8_experts(1, [0, 1], 160, 96)
    # expert 0's gate (the one fp8_kind reads) differs from the experts loaded
    gate = "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"
    path = rewrite(write_fp8_layer(tmp_path / "gate", "fp8", "per_expert")[0],
                   {gate: torch.ones(96, 5, dtype=torch.uint8)})
    assert HfCheckpoint(path).fp8_kind(1) == "mxfp8"
    with pytest.raises(ValueError, match=r"mixes FP8 kinds \('model.layers.1.mlp.experts.0.gate_proj.weight': mxfp8"):
        HfCheckpoint(path).load_fp8_experts(1, [1, 2], 160, 96)


def test_missing_and_misshapen_experts(tmp_path: Path) -> None:
    path, _ = write_fp8_layer(tmp_path, "fp8_perchannel", "per_expert")
    for load in (HfCheckpoint(path).load_fp8_experts, HfCheckpoint(path).load_experts):
        with pytest.raises(ValueError, match=r"tensor 'model.layers.1.mlp.experts.0.gate_proj.weight' has shape "
                                             r"\(96, 160\), expected \(96, 150\)"):
            load(1, [0], 150, 96)
        with pytest.raises(KeyError, match="layer 1 has 3 experts; expert 3 is missing"):
            load(1, [0, 3], 160, 96)
        with pytest.raises(KeyError, match="no routed-expert tensors for layer 0"):
            load(0, [0], 160, 96)
    rewrite(path, {"model.layers.1.mlp.experts.1.up_proj.weight": None})
    both_loads_raise(path, "tensor 'model.layers.1.mlp.experts.1.up_proj.weight' is missing", KeyError, experts=[1])


@pytest.mark.parametrize("index", [False, True], ids=["single-file", "indexed"])
def test_truncated_or_corrupt_file(tmp_path: Path, index: bool) -> None:
    path, _ = write_fp8_layer(tmp_path, "fp8", "per_expert", index=index)
    file = sorted(path.glob("*.safetensors"))[-1]
    intact = file.read_bytes()
    early = HfCheckpoint(path)  # headers read while the file was whole: the cut shows when reading tensors
    early.fp8_kind(1)
    for damaged in (intact[:-4096], b"\xff" * 8 + intact[8:]):
        file.write_bytes(damaged)
        match = re.escape(str(file))
        with pytest.raises(ValueError, match=match):
            early.load_fp8_experts(1, [0, 1, 2], 160, 96)
        with pytest.raises(ValueError, match=match):
            early.load_experts(1, [0, 1, 2], 160, 96)
        if not index:  # the constructor reads every header itself
            with pytest.raises(ValueError, match=match):
                HfCheckpoint(path)
            continue
        for call in (lambda c: c.fp8_kind(1), lambda c: c.load_fp8_experts(1, [0, 1, 2], 160, 96),
                     lambda c: c.load_experts(1, [0, 1, 2], 160, 96)):
            with pytest.raises(ValueError, match=match):
                call(HfCheckpoint(path))


@pytest.mark.parametrize("kind", KINDS)
def test_inspect_names_the_fp8_kind_and_counts_its_scales(tmp_path: Path, kind: str) -> None:
    from kt_ops.inspection import inspect_weights

    path, mats = write_fp8_checkpoint(tmp_path, kind, "per_expert")
    report = inspect_weights(path)
    stored = dict(report.facts)["stored as"]
    assert f"method {KINDS[kind]} reads it in place" in stored, stored
    expected = sum(q.numel() + s.numel() * s.element_size() for q, s in mats)
    assert report.layers[0].nbytes == expected


@pytest.mark.parametrize("matrix,parts", [("gate", 1), ("gate", 2), ("down", 2)])
def test_a_bad_mxfp8_exponent_is_named_by_the_layers_row_and_expert(tmp_path: Path, matrix: str, parts: int) -> None:
    """An exponent code the kernels do not take was named by its position in the part and
    among the CPU experts: "expert 3, row 8" for the checkpoint's expert 2, row 200 of a
    layer split in two parts of 192 rows and read with a permuted expert map."""
    En, Hn, In = 4, 256, 384
    g = torch.Generator().manual_seed(4)
    codes = {name: (torch.randn(En, n, k, generator=g) * 2).to(torch.float8_e4m3fn)
             for name, (n, k) in (("gate", (In, Hn)), ("up", (In, Hn)), ("down", (Hn, In)))}
    scales = {name: torch.randint(118, 124, (En, c.shape[1], c.shape[2] // 32), generator=g, dtype=torch.uint8)
              for name, c in codes.items()}
    codes[matrix][2].view(torch.uint8).bitwise_or_(1)  # nonzero weights throughout (e4m3 code 1: 2^-9)
    row, group = (200, 3) if matrix == "gate" else (5, 7)  # down's group 7: k 224..255, in part 1
    scales[matrix][2, row, group] = 0
    experts = hf.Fp8Experts("mxfp8", codes["gate"][[1, 0, 3, 2]], codes["up"][[1, 0, 3, 2]],
                            codes["down"][[1, 0, 3, 2]], scales["gate"][[1, 0, 3, 2]], scales["up"][[1, 0, 3, 2]],
                            scales["down"][[1, 0, 3, 2]])
    with pytest.raises(ValueError, match=rf"^mxfp8 {matrix} scale of expert 2, row {row}, group {group}: exponent "
                                         "code 0"):
        kt_ops.parts.pack_fp8_parts(experts, parts, [1, 0, 3, 2])
