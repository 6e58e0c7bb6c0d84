"""FP8 checkpoints read in place: kt_ops.hf_checkpoint finds the e4m3 experts and their
scales (fp8 128 x 128 blocks, fp8_perchannel, mxfp8) under every expert naming,
KTMoEWrapper packs them without widening, the converter keeps them, and bad files are
ValueErrors naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import kt_ops
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


def test_bad_checkpoints_are_value_errors(tmp_path: Path) -> None:
    key = "model.layers.1.mlp.experts.0.up_proj"
    path, _ = write_fp8_checkpoint(tmp_path / "missing", "fp8", "per_expert", skip=(f"{key}.weight_scale_inv",))
    with pytest.raises(ValueError, match=f"FP8 weight '{key}.weight' has no scale tensor"):
        HfCheckpoint(path).load_fp8_experts(1, [0], 160, 96)

    def rewrite(name: str, edit) -> Path:
        src, _ = write_fp8_checkpoint(tmp_path / name, "fp8", "per_expert")
        from safetensors.torch import load_file
        tensors = load_file(str(src / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(src / "model.safetensors"))
        return src

    shape = rewrite("shape", lambda t: t.__setitem__(f"{key}.weight_scale_inv", torch.ones(3, 3)))
    with pytest.raises(ValueError, match=rf"scale '{key}.weight_scale_inv' \(F32 \[3, 3\]\).* fits no FP8 kind"):
        HfCheckpoint(shape).load_fp8_experts(1, [0], 160, 96)
    ints = rewrite("int", lambda t: t.__setitem__(f"{key}.weight_scale_inv", torch.ones(1, 2, dtype=torch.int32)))
    with pytest.raises(ValueError, match=f"scale '{key}.weight_scale_inv' of FP8 weight .* is I32"):
        HfCheckpoint(ints).load_fp8_experts(1, [0], 160, 96)
    bf16 = rewrite("bf16", lambda t: t.__setitem__(f"{key}.weight", torch.zeros(96, 160, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match=f"tensor '{key}.weight' is BF16, not F8_E4M3"):
        HfCheckpoint(bf16).load_fp8_experts(1, [0], 160, 96)
    mixed = rewrite("mixed", lambda t: t.__setitem__(f"{key}.weight_scale_inv", torch.ones(96, 5, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="mixes FP8 kinds"):
        HfCheckpoint(mixed).load_fp8_experts(1, [0], 160, 96)
    byte_shape = rewrite("bytes", lambda t: t.__setitem__(f"{key}.weight_scale_inv", torch.ones(96, 4, dtype=torch.uint8)))
    with pytest.raises(ValueError, match=r"ue8m0 exponents must be \[96, 5\]"):
        HfCheckpoint(byte_shape).load_fp8_experts(1, [0], 160, 96)
    truncated, _ = write_fp8_checkpoint(tmp_path / "cut", "fp8", "per_expert")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) - 4096])
    with pytest.raises(ValueError, match="model.safetensors"):
        HfCheckpoint(truncated).load_fp8_experts(1, [0, 1, 2], 160, 96)


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
