"""INT4 checkpoints read in place (kt_ops.hf_int4): RAWINT4 (compressed-tensors), GPTQ
(symmetric, asymmetric, v2) and AWQ, written here by independent quantizers in every
naming; the packed blob must dequantize exactly to the checkpoint's own formula
(kt_ops.reference.dequantize_*), the wrapper's output must match the oracle, and bad
files are ValueErrors naming the tensor."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import kt_ops
from checkpoint_helpers import save_quantized_layer
from conftest import random_routing, rel_err
from kt_ops import _C, reference
from kt_ops.hf_checkpoint import HfCheckpoint
from kt_ops.hf_int4 import int4_method, load_int4_experts
from kt_ops.wrappers import KTMoEWrapper

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
E, H, I, LAYER = 3, 256, 128, 1


def words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] nibbles -> int32 words, nibble i at bits 4i."""
    out = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for i in range(8):
        out |= nibbles[..., i].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def quantize(w: torch.Tensor, gs: int, asym: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [N, K] -> (q [N, K] 0..15, scale [N, K/gs] fp16-rounded, zero [N, K/gs] 0..15)."""
    N, K = w.shape
    g = w.reshape(N, K // gs, gs).double()
    if asym:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6).half().double()
        zero = torch.round(-lo / scale).clamp(0, 15)
    else:
        scale = (g.abs().amax(-1) / 7).clamp(min=1e-6).half().double()
        zero = torch.full_like(scale, 8.0)
    q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, 15).reshape(N, K)
    return q.long().numpy(), scale.float().numpy(), zero.long().numpy()


def rawint4_tensors(w: torch.Tensor, gs: int = 32, as_bytes: bool = False) -> dict[str, torch.Tensor]:
    q, scale, _ = quantize(w, gs, asym=False)
    N, K = q.shape
    packed = torch.from_numpy(words(q.reshape(N, K // 8, 8)).copy())
    if as_bytes:
        packed = packed.view(torch.uint8).reshape(N, K // 2)
    return {"weight_packed": packed, "weight_scale": torch.from_numpy(scale).bfloat16(),
            "weight_shape": torch.tensor([N, K], dtype=torch.int32)}


def gptq_tensors(w: torch.Tensor, gs: int = 128, asym: bool = False, v2: bool = False) -> dict[str, torch.Tensor]:
    q, scale, zero = quantize(w, gs, asym)
    N, K = q.shape
    qweight = words(q.T.reshape(K // 8, 8, N).transpose(0, 2, 1))  # [K/8, N]
    stored = zero if v2 else zero - 1  # v1 stores zero - 1
    qzeros = words((stored.T & 0xF).reshape(K // gs, N // 8, 8))  # [K/gs, N/8]
    return {"qweight": torch.from_numpy(qweight.copy()), "qzeros": torch.from_numpy(qzeros.copy()),
            "scales": torch.from_numpy(scale.T.copy()).half(),
            "g_idx": torch.arange(K, dtype=torch.int32) // gs}


def awq_tensors(w: torch.Tensor, gs: int = 128) -> dict[str, torch.Tensor]:
    q, scale, zero = quantize(w, gs, asym=True)
    N, K = q.shape

    def pack(values: np.ndarray) -> np.ndarray:  # [R, N] -> [R, N/8], nibble i = column AWQ_ORDER[i]
        grouped = values.reshape(values.shape[0], N // 8, 8)
        return words(grouped[:, :, list(AWQ_ORDER)])

    return {"qweight": torch.from_numpy(pack(q.T).copy()), "qzeros": torch.from_numpy(pack(zero.T).copy()),
            "scales": torch.from_numpy(scale.T.copy()).half()}


def dequantized(method: str, t: dict[str, torch.Tensor], v2: bool = False) -> torch.Tensor:
    """The oracle's [N, K] for one matrix's checkpoint tensors."""
    if method == "RAWINT4":
        return reference.dequantize_rawint4(t["weight_packed"], t["weight_scale"])
    if method == "GPTQ_INT4":
        return reference.dequantize_gptq(t["qweight"], t["scales"], t.get("qzeros"), t.get("g_idx"),
                                         zero_offset=0 if v2 else 1)
    return reference.dequantize_awq(t["qweight"], t["qzeros"], t["scales"])


CONFIGS = {
    "RAWINT4": {"quant_method": "compressed-tensors", "format": "pack-quantized"},
    "GPTQ_INT4": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False},
    "GPTQ_INT4-asym": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False, "desc_act": False},
    "GPTQ_INT4-v2": {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": False, "checkpoint_format": "gptq_v2"},
    "AWQ_INT4": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
}


def write_int4_checkpoint(path: Path, case: str, convention: str = "per_expert", seed: int = 0,
                          edit=None) -> tuple[Path, list[torch.Tensor]]:
    """A one-layer INT4 checkpoint of ``case`` (a CONFIGS key); returns it and the oracle's
    dequantized [E, N, K] gate, up, down. ``edit(tensors)`` may damage it first."""
    method = case.split("-")[0]
    g = torch.Generator().manual_seed(seed)
    base = f"model.layers.{LAYER}"
    block, names = (("block_sparse_moe", ("w1", "w3", "w2")) if convention == "w123"
                    else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.zeros(4, H, dtype=torch.bfloat16)}
    expected = []
    for name, (N, K) in zip(names, ((I, H), (I, H), (H, I))):
        per_expert = []
        for e in range(E):
            w = torch.randn(N, K, generator=g) * 0.05
            if method == "RAWINT4":
                t = rawint4_tensors(w, as_bytes=e == 1)
            elif method == "GPTQ_INT4":
                t = gptq_tensors(w, gs=64 if case.endswith("v2") else 128, asym=case != "GPTQ_INT4",
                                 v2=case.endswith("v2"))
            else:
                t = awq_tensors(w)
            per_expert.append(dequantized(method, t, v2=case.endswith("v2")))
            for suffix, tensor in t.items():
                tensors[f"{base}.{block}.experts.{e}.{name}.{suffix}"] = tensor
        expected.append(torch.stack(per_expert))
    if edit is not None:
        edit(tensors)
    return save_quantized_layer(path, tensors, H, I, CONFIGS[case]), expected


@pytest.mark.parametrize("convention", ["per_expert", "w123"])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_read_in_place_dequantizes_exactly(tmp_path: Path, case: str, convention: str) -> None:
    path, expected = write_int4_checkpoint(tmp_path, case, convention)
    method = case.split("-")[0]
    checkpoint = HfCheckpoint(path)
    assert int4_method(checkpoint, LAYER) == method
    picked = [2, 0, 2]
    experts = load_int4_experts(checkpoint, LAYER, picked, H, I)
    packed = kt_ops.pack_int4_experts(experts.gate, experts.up, experts.down, experts.scales, experts.minimums,
                                      experts.group_size)
    assert packed.format == ("int4" if case in ("RAWINT4", "GPTQ_INT4") else "int4_asym")
    # zero points are integers: the kernels' exact integer path (tests/test_int4_zero_points.py)
    assert _C.packed_info(packed.data)["integer_zeros"] == (packed.format == "int4_asym")
    for got, want in zip(reference.dequantize(packed.data), expected):
        torch.testing.assert_close(got[:, :want.shape[1], :want.shape[2]], want[picked], rtol=0, atol=0)
    # resident size: nibbles plus fp32 scales (and minimums), against the checkpoint's bytes
    stored = sum(t.numel() * t.element_size() for t in _layer_tensors(path))
    limit = 1.15 if packed.format == "int4" or experts.group_size >= 64 else 1.35
    assert packed.nbytes <= limit * stored * len(picked) / E + 4096


def _layer_tensors(path: Path) -> list[torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return [f.get_tensor(k) for k in f.keys() if ".experts." in k and not k.endswith(("g_idx", "weight_shape"))]


@pytest.mark.parametrize("case", list(CONFIGS))
def test_wrapper_matches_the_oracle(tmp_path: Path, case: str, variant: str) -> None:
    path, (gate, up, down) = write_int4_checkpoint(tmp_path, case)
    method = case.split("-")[0]
    for given in (method, None):
        wrapper = KTMoEWrapper(LAYER, E, 2, H, I, weight_path=path, method=given, threadpool_count=1)
        wrapper.load_weights()
        assert wrapper.method == method
        x = torch.randn(7, H, generator=torch.Generator().manual_seed(3)).bfloat16()
        ids, weights = random_routing(7, E, 2, seed=4)
        out = wrapper.forward(x, ids, weights)
        ref = reference.moe_forward(x, ids, weights, gate, up, down)
        assert rel_err(out, ref) <= 4e-2


def test_parts_and_activation(tmp_path: Path) -> None:
    """threadpool_count splits the intermediate dimension at group boundaries; the
    activation variants and biases apply to INT4 checkpoints like any format."""
    path, (gate, up, down) = write_int4_checkpoint(tmp_path, "GPTQ_INT4-v2")
    g = torch.Generator().manual_seed(5)
    biases = (torch.randn(E, I, generator=g) * 0.1, torch.randn(E, I, generator=g) * 0.1, torch.randn(E, H, generator=g) * 0.1)
    x = torch.randn(6, H, generator=g)
    ids, weights = random_routing(6, E, 2, seed=6)
    outs = []
    for parts in (1, 2):  # gptq_v2 groups of 64: I = 128 splits into two parts of one group each
        wrapper = KTMoEWrapper(LAYER, E, 2, H, I, weight_path=path, method="GPTQ_INT4", threadpool_count=parts,
                               swiglu_limit=7.0, swiglu_alpha=1.702)
        wrapper.load_weights()
        assert len(wrapper._parts) == parts and wrapper._parts[0].group_size == 64
        outs.append(wrapper.forward(x, ids, weights))
    four = KTMoEWrapper(LAYER, E, 2, H, I, weight_path=path, method="GPTQ_INT4", threadpool_count=4,
                        swiglu_limit=7.0, swiglu_alpha=1.702)
    four.load_weights()  # parts of 32: each group of 64 stored as two groups of 32
    assert four._parts[0].group_size == 32
    outs.append(four.forward(x, ids, weights))
    with pytest.raises(ValueError, match="parts of 16, not a multiple of 32"):
        KTMoEWrapper(LAYER, E, 2, H, I, weight_path=path, method="GPTQ_INT4", threadpool_count=8).load_weights()
    ref = reference.moe_forward(x, ids, weights, gate, up, down, swiglu_limit=7.0, swiglu_alpha=1.702)
    for out in outs:
        assert rel_err(out, ref) <= 4e-2
    experts = load_int4_experts(HfCheckpoint(path), LAYER, range(E), H, I)
    packed = kt_ops.set_activation(kt_ops.pack_int4_experts(experts.gate, experts.up, experts.down, experts.scales,
                                                            experts.minimums, experts.group_size),
                                   swiglu_limit=7.0, biases=biases)
    out = kt_ops.moe_forward(x, ids, weights, packed)
    ref = reference.moe_forward(x, ids, weights, gate, up, down, swiglu_limit=7.0, biases=biases)
    assert rel_err(out, ref) <= 4e-2


@pytest.mark.parametrize("method,fmt,group", [("RAWINT4", "int4", 32), ("GPTQ_INT4", "int4", 128),
                                              ("AWQ_INT4", "int4_asym", 128)])
def test_quantize_online(method: str, fmt: str, group: int) -> None:
    g = torch.Generator().manual_seed(7)
    I = 96  # a multiple of 32, not of 128
    gate, up, down = (torch.randn(2, I, 256, generator=g), torch.randn(2, I, 256, generator=g),
                      torch.randn(2, 256, I, generator=g))
    if group == 128:  # I = 96 is not a multiple of 128
        with pytest.raises(ValueError, match="group"):
            kt_ops.pack_experts(gate, up, down, method=method)
        down = torch.randn(2, 256, 128, generator=g)
        gate, up = torch.randn(2, 128, 256, generator=g), torch.randn(2, 128, 256, generator=g)
    packed = kt_ops.pack_experts(gate, up, down, method=method)
    assert (packed.format, packed.group_size) == (fmt, group)
    x = torch.randn(5, 256, generator=g)
    ids, weights = random_routing(5, 2, 2, seed=8)
    out = kt_ops.moe_forward(x, ids, weights, packed)
    assert rel_err(out, reference.moe_forward(x, ids, weights, gate, up, down)) <= 0.25  # 4-bit rounding
    assert rel_err(out, reference.moe_forward(x, ids, weights, *reference.dequantize(packed.data))) <= 4e-2


def _drop(key_end: str):
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.endswith(key_end)]:
            del tensors[key]
    return edit


def _replace(key_end: str, value):
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.endswith(key_end)]:
            tensors[key] = value(tensors[key]).contiguous()
    return edit


@pytest.mark.parametrize("case,edit,match", [
    ("GPTQ_INT4-asym", _drop("qzeros"), "qzeros.*missing.*sym: false"),
    ("AWQ_INT4", _drop("qzeros"), "qzeros.*missing"),
    ("GPTQ_INT4", _replace("gate_proj.g_idx", lambda t: t.flip(0)), "act-order"),
    ("GPTQ_INT4", _replace("up_proj.scales", lambda t: t[:, :-8]), "up_proj.scales"),
    ("GPTQ_INT4", _replace("down_proj.qweight", lambda t: t[:-1]), "down_proj.qweight"),
    ("RAWINT4", _replace("gate_proj.weight_scale", lambda t: t[:, :3]), "group size must divide K"),
    ("RAWINT4", _replace("down_proj.weight_shape", lambda t: t + 1), "weight_shape"),
    ("RAWINT4", _replace("up_proj.weight_packed", lambda t: t.float()), "up_proj.weight_packed"),
    ("RAWINT4", _replace("gate_proj.weight_scale", lambda t: t * float("nan")), "NaN"),
    ("AWQ_INT4", _replace("gate_proj.qweight", lambda t: t[:, :-1]), "gate_proj.qweight"),
])
def test_bad_files_name_the_tensor(tmp_path: Path, case: str, edit, match: str) -> None:
    path, _ = write_int4_checkpoint(tmp_path, case, edit=edit)
    wrapper = KTMoEWrapper(LAYER, E, 2, H, I, weight_path=path, method=case.split("-")[0])
    with pytest.raises(ValueError, match=match):
        wrapper.load_weights()


def _add_rawint4(suffix: str, value):
    """Adds ``{stem}.{suffix}`` = ``value(N, K)`` beside every RAWINT4 ``weight_packed``."""
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.endswith(".weight_packed")]:
            N, K = (int(v) for v in tensors[key.replace("weight_packed", "weight_shape")])
            tensors[key.replace("weight_packed", suffix)] = value(N, K)
    return edit


@pytest.mark.parametrize("edit,match", [
    # asymmetric compressed-tensors: zero points packed 8 per int32 along N, a nibble 9 is zero point 1
    (_add_rawint4("weight_zero_point", lambda N, K: torch.full((N // 8, K // 32), 0x99999999 - 2**32,
                                                               dtype=torch.int32)), "weight_zero_point"),
    (_add_rawint4("weight_zero_point", lambda N, K: torch.ones((N, K // 32), dtype=torch.int8)), "weight_zero_point"),
    (_add_rawint4("weight_g_idx", lambda N, K: (torch.arange(K, dtype=torch.int32) // 32).flip(0)), "act-order"),
])
def test_rawint4_zero_points_and_act_order_are_refused(tmp_path: Path, edit, match: str) -> None:
    """A compressed-tensors pack-quantized checkpoint quantized asymmetrically (a
    ``weight_zero_point`` beside ``weight_packed``) or with act-order (``weight_g_idx``):
    both tensors were ignored, the nibbles read as symmetric in k order — silently wrong
    weights. Now a ValueError naming the tensor."""
    path, _ = write_int4_checkpoint(tmp_path, "RAWINT4", edit=edit)
    with pytest.raises(ValueError, match=match):
        load_int4_experts(HfCheckpoint(path), LAYER, [0, 2], H, I)


@pytest.mark.parametrize("edit", [
    _add_rawint4("weight_zero_point", lambda N, K: torch.full((N // 8, K // 32), 0x88888888 - 2**32,
                                                              dtype=torch.int32)),
    _add_rawint4("weight_zero_point", lambda N, K: torch.zeros((N, K // 32), dtype=torch.int8)),
    _add_rawint4("weight_g_idx", lambda N, K: torch.arange(K, dtype=torch.int32) // 32),
])
def test_rawint4_symmetric_zero_points_and_plain_g_idx_are_read(tmp_path: Path, edit) -> None:
    """A stored zero point of 0 (packed: nibbles 8) and a g_idx in k order change nothing."""
    path, expected = write_int4_checkpoint(tmp_path, "RAWINT4", edit=edit)
    experts = load_int4_experts(HfCheckpoint(path), LAYER, [0, 2], H, I)
    packed = kt_ops.pack_int4_experts(experts.gate, experts.up, experts.down, experts.scales, experts.minimums,
                                      experts.group_size)
    for got, want in zip(reference.dequantize(packed.data), expected):
        torch.testing.assert_close(got, want[[0, 2]], rtol=0, atol=0)


def _fp4_scales(dtype: torch.dtype, per: int, global_scale: bool):
    """Turns a RAWINT4 checkpoint into compressed-tensors' NVFP4 / MXFP4 naming: U8 codes
    ``[N, K/2]``, scales of ``dtype`` one per ``per`` weights (NVFP4: a global scale too)."""
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.endswith(".weight_packed")]:
            stem = key[: -len(".weight_packed")]
            N, K = (int(v) for v in tensors[f"{stem}.weight_shape"])
            tensors[key] = tensors[key].view(torch.uint8).reshape(N, K // 2).contiguous()
            tensors[f"{stem}.weight_scale"] = torch.full((N, K // per), 120, dtype=torch.uint8).view(dtype)
            if global_scale:
                tensors[f"{stem}.weight_global_scale"] = torch.ones(1)
    return edit


@pytest.mark.parametrize("edit,name", [(_fp4_scales(torch.float8_e4m3fn, 16, True), "NVFP4"),
                                       (_fp4_scales(torch.uint8, 32, False), "MXFP4")])
def test_compressed_tensors_fp4_is_not_taken_for_rawint4(tmp_path: Path, edit, name: str) -> None:
    """compressed-tensors' NVFP4 and MXFP4 checkpoints name their tensors as RAWINT4 does
    (``weight_packed``, ``weight_scale``): int4_method said RAWINT4, and the errors that
    followed spoke of a group size or a scale dtype (the converter: "layer 1's tensors are
    RAWINT4"). Now a ValueError naming the scale and the FP4 format."""
    path, _ = write_int4_checkpoint(tmp_path, "RAWINT4", edit=edit)
    with pytest.raises(ValueError, match=f"weight_scale.*{name}"):
        int4_method(HfCheckpoint(path), LAYER)


@pytest.mark.parametrize("bits", [8, 3, 2])
def test_a_gptq_checkpoint_of_other_bits_is_refused_naming_them(tmp_path: Path, bits: int) -> None:
    """A GPTQ checkpoint quantized to 8 (3, 2) bits: qweight ``[K * bits / 32, N]`` is laid out
    as GPTQ, and the error spoke of qweight's shape only ("expected I32 [K/8, N]"). Now a
    ValueError naming config.json's bits."""
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.endswith(".qweight")]:
            K = tensors[key].shape[0] * 8
            tensors[key] = torch.zeros(K * bits // 32, tensors[key].shape[1], dtype=torch.int32)

    path, _ = write_int4_checkpoint(tmp_path, "GPTQ_INT4", edit=edit)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["bits"] = bits
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"bits {bits}"):
        load_int4_experts(HfCheckpoint(path), LAYER, [0], H, I)


def test_a_method_the_file_does_not_hold_is_refused(tmp_path: Path) -> None:
    path, _ = write_int4_checkpoint(tmp_path, "AWQ_INT4")
    for method in ("GPTQ_INT4", "AMXINT4", "BF16", "FP8"):
        wrapper = KTMoEWrapper(LAYER, E, 2, H, I, weight_path=path, method=method)
        with pytest.raises(ValueError, match="holds AWQ_INT4 experts"):
            wrapper.load_weights()
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ValueError, match="config.json says GPTQ_INT4"):
        int4_method(HfCheckpoint(tmp_path), LAYER)


def test_converter_reads_the_sizes_of_a_nested_text_config(tmp_path: Path) -> None:
    """A multimodal model's config.json (Qwen3-VL, Qwen3.5) nests the language model's
    sizes in ``text_config``: the converter said "config.json must give hidden_size and
    moe_intermediate_size for an INT4 checkpoint" (exit 2) though it does. Now the nested
    values are read where the top level has none."""
    from kt_ops import convert
    from kt_ops.converted import Manifest

    path, _ = write_int4_checkpoint(tmp_path / "src", "AWQ_INT4")
    config = json.loads((path / "config.json").read_text())
    text = {"hidden_size": config.pop("hidden_size"), "moe_intermediate_size": config.pop("moe_intermediate_size"),
            "num_experts": E, "num_hidden_layers": 5}
    (path / "config.json").write_text(json.dumps({**config, "text_config": text}))
    out = tmp_path / "out"
    assert convert.main(["--input-path", str(path), "--input-type", "int4", "--output", str(out),
                         "--quant-method", "awq_int4"]) == 0
    manifest = Manifest.read(out)
    assert (manifest.num_experts, manifest.hidden_size, manifest.intermediate_size, manifest.num_layers) == (E, H, I, 5)


@pytest.mark.parametrize("case", ["AWQ_INT4", "RAWINT4"])
def test_converter_keeps_the_nibbles(tmp_path: Path, case: str, capsys) -> None:
    """kt_ops.convert --input-type int4 --quant-method <own method>: the converted layer
    computes exactly what reading the checkpoint in place computes; another method or
    input type is refused before anything is written."""
    from kt_ops import convert

    path, _ = write_int4_checkpoint(tmp_path / "src", case)
    quant = case.lower()
    out = tmp_path / "out"
    args = ["--input-path", str(path), "--input-type", "int4", "--output", str(out), "--threadpool-count", "2"]
    assert convert.main([*args, "--quant-method", quant]) == 0
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(9))
    ids, weights = random_routing(5, E, 2, seed=10)
    outs = []
    for source in (out, path):
        wrapper = KTMoEWrapper(LAYER, E, 2, H, I, weight_path=source, method=case, threadpool_count=2)
        wrapper.load_weights()
        outs.append(wrapper.forward(x, ids, weights))
    assert torch.equal(outs[0], outs[1])
    for bad in (["--quant-method", "int4"], ["--quant-method", "gptq_int4" if case != "GPTQ_INT4" else "awq_int4"]):
        assert convert.main([*args[:-2], *bad, "--output", str(tmp_path / "o2")]) == 2
        assert f"holds {case} experts" in capsys.readouterr().err
    bf16 = ["--input-path", str(path), "--input-type", "bf16", "--output", str(tmp_path / "o3"), "--quant-method", "int8"]
    assert convert.main(bf16) == 2 and not (tmp_path / "o3").exists()


@pytest.mark.parametrize("case", ["RAWINT4", "GPTQ_INT4", "GPTQ_INT4-asym", "AWQ_INT4"])
def test_inspect_reads_an_int4_checkpoint(tmp_path: Path, case: str) -> None:
    """kt-ops inspect names the layout, its group size and the kernel that reads it in place,
    and counts every tensor of the experts (codes, scales, zeros) from the headers alone."""
    from safetensors import safe_open

    from kt_ops.formats import format_info
    from kt_ops.inspection import format_inspection, inspect_weights

    path, _ = write_int4_checkpoint(tmp_path / case, case)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        expected = sum(f.get_tensor(k).nbytes for k in f.keys() if ".experts." in k)
    report = inspect_weights(path)
    [layer] = report.layers
    assert (layer.layer, layer.num_experts, layer.hidden_size, layer.intermediate_size) == (LAYER, E, H, I)
    method = case.split("-")[0]
    assert layer.nbytes == expected and all(m.type == method.lower() for m in layer.matrices)
    gs = 32 if case == "RAWINT4" else 128
    zeros = case in ("GPTQ_INT4-asym", "AWQ_INT4")
    assert dict(report.facts)["stored as"] == (f"{method.lower()} (groups of {gs}, {'zero points' if zeros else 'symmetric'}"
                                               f": method {method} reads it in place)")
    fmt = "int4_asym" if zeros else "int4"  # the format the wrapper packs (the symmetric GPTQ's zeros are all 8)
    wrapper = KTMoEWrapper(layer_idx=LAYER, num_experts=E, num_experts_per_tok=2, hidden_size=H,
                           moe_intermediate_size=I, weight_path=path, method=method)
    wrapper.load_weights()
    assert [p.format for p in wrapper._parts] == [fmt]
    text = format_inspection(report)
    assert f"method {method} (read in place): {format_info(fmt).kernels[kt_ops.cpu_variant()]}" in text, text


def test_inspect_names_a_missing_int4_tensor(tmp_path: Path) -> None:
    from kt_ops.inspection import inspect_weights

    key = f"model.layers.{LAYER}.mlp.experts.1.up_proj.weight_scale"
    path, _ = write_int4_checkpoint(tmp_path, "RAWINT4", edit=lambda tensors: tensors.pop(key))
    report = inspect_weights(path)
    assert report.layers == () and f"layer {LAYER}: 1 expert tensor(s) missing, e.g. {key!r}" in report.notes


@pytest.mark.parametrize("field", ["scale", "minimum"])
@pytest.mark.parametrize("asym", [False, True], ids=["int4", "int4_asym"])
def test_infinite_scale_or_minimum_gives_the_oracles_nan(asym: bool, field: str) -> None:
    """kt_ops.pack_int4_experts with an infinite scale (or minimum) in one group of a down
    row: the oracle's weights there are +-inf and NaN (0 * inf at level 8), so the row's
    outputs are NaN; the kernels multiplied their sums by the infinite scale and gave +-inf."""
    if field == "minimum" and not asym:
        pytest.skip("int4 has no minimums")
    n, h, i, group = 1, 64, 32, 32
    g = torch.Generator().manual_seed(32)
    nibbles, scales, minimums = [], [], []
    for rows, k in ((i, h), (i, h), (h, i)):
        levels = torch.randint(0, 16, (n, rows, k), dtype=torch.uint8, generator=g)
        levels[0, 3, :4] = 8
        nibbles.append((levels[..., 0::2] | (levels[..., 1::2] << 4)).contiguous())
        scales.append(torch.rand(n, rows, k // group, generator=g) * 0.01 + 1e-3)
        minimums.append(-8 * scales[-1])
    (scales if field == "scale" else minimums)[2][0, 3, 0] = -math.inf if asym else math.inf
    packed = kt_ops.pack_int4_experts(*nibbles, tuple(scales), tuple(minimums) if asym else None, group)
    x = torch.randn(3, h, generator=g)
    ids, weights = torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1)
    ref = reference.moe_forward(x, ids, weights, *reference.dequantize(packed.data), quantize_activations=True)
    out = kt_ops.moe_forward(x, ids, weights, packed)
    assert torch.isnan(ref[:, 3]).all()
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.equal(torch.isinf(out), torch.isinf(ref))
