"""MXFP4 checkpoints through KTMoEWrapper(method="MXFP4"): tiny gpt-oss-style
(fused, gate/up rows interleaved, biased) and DeepSeek-V4-Flash-style (per expert
w1/w3/w2 + E8M0 scales) safetensors directories, and a gpt-oss GGUF with MXFP4 experts
and expert biases, against kt_ops.reference on the weights transformers' own
``convert_moe_packed_tensors`` decodes (gpt-oss's alpha-SwiGLU and biases included);
bad input is a ValueError naming the tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import kt_ops
from conftest import random_routing, rel_err
from gguf_helpers import finish, moe_writer
from kt_ops import KTMoEWrapper, reference
from kt_ops._native import _C
from kt_ops.hf_checkpoint import HfCheckpoint
from kt_ops.hf_mxfp4 import load_mxfp4_experts
from kt_ops.inspection import inspect_weights

E, H, I = 4, 96, 64


def hf_codes(lead: tuple[int, ...], k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Hugging Face MXFP4 groups: codes uint8 [*lead, k/32, 16], exponents uint8 [*lead, k/32] in [119, 124]."""
    codes = torch.randint(0, 256, (*lead, k // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    exps = torch.randint(119, 125, (*lead, k // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    return codes, exps


def hf_weights(codes: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """transformers' decode of [..., N, k/32, 16] groups -> fp32 [..., N, k] (its output is [.., k, N])."""
    lead = codes.dim() == 3
    c, e = (codes[None], exps[None]) if lead else (codes, exps)
    out = convert_moe_packed_tensors(c, e, dtype=torch.float32).transpose(1, 2)
    return out[0] if lead else out


def write_gpt_oss(path: Path, g: torch.Generator, layer: int = 1, config: dict | None = None, bias: bool = True):
    """A gpt-oss layer: fused interleaved gate_up (+ bias), down (+ bias). Returns the
    dequantized (gate, up, down) and biases as the model uses them."""
    path.mkdir(parents=True, exist_ok=True)
    gu_codes, gu_exps = hf_codes((E, 2 * I), H, g)
    d_codes, d_exps = hf_codes((E, H), I, g)
    gu_bias = torch.randn(E, 2 * I, generator=g).bfloat16()
    d_bias = torch.randn(E, H, generator=g).bfloat16()
    prefix = f"model.layers.{layer}.mlp.experts"
    tensors = {f"{prefix}.gate_up_proj_blocks": gu_codes, f"{prefix}.gate_up_proj_scales": gu_exps,
               f"{prefix}.down_proj_blocks": d_codes, f"{prefix}.down_proj_scales": d_exps,
               f"model.layers.{layer}.mlp.router.weight": torch.zeros(E, H)}
    if bias:
        tensors.update({f"{prefix}.gate_up_proj_bias": gu_bias, f"{prefix}.down_proj_bias": d_bias})
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config if config is not None else {"model_type": "gpt_oss",
                                                                                     "swiglu_limit": 7.0}))
    gate_up = hf_weights(gu_codes, gu_exps)  # [E, 2I, H]
    weights = (gate_up[:, 0::2], gate_up[:, 1::2], hf_weights(d_codes, d_exps))
    biases = (gu_bias[:, 0::2].float(), gu_bias[:, 1::2].float(), d_bias.float()) if bias else None
    return weights, biases, sum(t.numel() for t in (gu_codes, gu_exps, d_codes, d_exps))


def write_deepseek_v4(path: Path, g: torch.Generator, layer: int = 0, scale_dtype: torch.dtype = torch.float8_e8m0fnu):
    """DeepSeek-V4-Flash layer keys (no ``model.`` prefix): int8 codes [N, K/2], E8M0 scales [N, K/32]."""
    path.mkdir(parents=True, exist_ok=True)
    tensors, mats = {}, [[], [], []]
    for e in range(E):
        for m, (name, (n, k)) in enumerate(zip(("w1", "w3", "w2"), ((I, H), (I, H), (H, I)))):
            codes, exps = hf_codes((n,), k, g)
            key = f"layers.{layer}.ffn.experts.{e}.{name}"
            tensors[f"{key}.weight"] = codes.reshape(n, k // 2).view(torch.int8)
            tensors[f"{key}.scale"] = exps.view(scale_dtype) if scale_dtype != torch.uint8 else exps
            mats[m].append(hf_weights(codes, exps))
    save_file(tensors, str(path / "model.safetensors"))
    return tuple(torch.stack(m) for m in mats)


def run_wrapper(path: Path, layer: int, **kwargs) -> tuple[KTMoEWrapper, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    wrapper = KTMoEWrapper(layer_idx=layer, num_experts=E, num_experts_per_tok=2, hidden_size=H,
                           moe_intermediate_size=I, weight_path=path, method=kwargs.pop("method", "MXFP4"), **kwargs)
    wrapper.load_weights()
    T = 7
    ids, weights = random_routing(T, E, 2, seed=3)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(8))
    return wrapper, x, ids, weights, wrapper.forward(x, ids.long(), weights)


@pytest.mark.parametrize("parts", [1, 2])
def test_gpt_oss_checkpoint(tmp_path: Path, parts: int) -> None:
    (gate, up, down), biases, checkpoint_bytes = write_gpt_oss(tmp_path, torch.Generator().manual_seed(1))
    wrapper, x, ids, weights, out = run_wrapper(tmp_path, 1, threadpool_count=parts)
    assert (wrapper.swiglu_alpha, wrapper.swiglu_limit) == (pytest.approx(1.702), 7.0)
    assert [p.format for p in wrapper._parts] == ["mxfp4"] * parts
    # never widened: the parts' weight regions (header and fp32 bias region aside) hold 18 bytes
    # per 32 weights against the checkpoint's 17, plus block padding (measured 1.09x, 2 parts 1.12x)
    weight_bytes = sum((_C.packed_info(p.data)["bias_offset"] or p.nbytes) - 256 for p in wrapper._parts)
    assert weight_bytes <= 1.15 * checkpoint_bytes
    if parts == 1:  # the blob holds exactly the checkpoint's weights (nibble order, interleave)
        dq = reference.dequantize(wrapper._parts[0].data)
        for ours, theirs in zip(dq, (gate, up, down)):
            assert torch.equal(ours, theirs)
    ref = reference.moe_forward(x, ids, weights, gate, up, down, swiglu_limit=7.0, swiglu_alpha=1.702, biases=biases)
    assert rel_err(out, ref) <= 3e-2


def test_gpt_oss_activation_keeps_user_values_and_reads_config(tmp_path: Path) -> None:
    write_gpt_oss(tmp_path, torch.Generator().manual_seed(2), config={"model_type": "gpt_oss", "swiglu_limit": 5.0})
    wrapper, *_ = run_wrapper(tmp_path, 1, swiglu_alpha=1.5)
    assert (wrapper.swiglu_alpha, wrapper.swiglu_limit) == (1.5, 5.0)  # the user's alpha, config.json's limit


@pytest.mark.parametrize("value", [None, "abc", [7.0]])
def test_gpt_oss_activation_of_a_damaged_config(tmp_path: Path, value: object) -> None:
    """config.json's swiglu_limit null, not a number or a list: a TypeError from float()
    deep in the loader (the converter's traceback). Now null counts as absent (gpt-oss's
    7), anything else that is not a number is a ValueError naming config.json."""
    from kt_ops.hf_mxfp4 import load_mxfp4_experts

    write_gpt_oss(tmp_path, torch.Generator().manual_seed(2), config={"model_type": "gpt_oss", "swiglu_limit": value})
    if value is None:
        experts = load_mxfp4_experts(HfCheckpoint(tmp_path), 1, [0], H, I)
        assert (experts.swiglu_limit, experts.swiglu_alpha) == (7.0, pytest.approx(1.702))
        return
    with pytest.raises(ValueError, match="config.json: swiglu_limit"):
        load_mxfp4_experts(HfCheckpoint(tmp_path), 1, [0], H, I)


def test_gpt_oss_without_biases(tmp_path: Path) -> None:
    (gate, up, down), _, _ = write_gpt_oss(tmp_path, torch.Generator().manual_seed(6), bias=False)
    wrapper, x, ids, weights, out = run_wrapper(tmp_path, 1)
    assert not wrapper._parts[0].has_biases
    ref = reference.moe_forward(x, ids, weights, gate, up, down, swiglu_limit=7.0, swiglu_alpha=1.702)
    assert rel_err(out, ref) <= 3e-2


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.uint8], ids=["e8m0", "u8"])
def test_deepseek_v4_checkpoint(tmp_path: Path, scale_dtype: torch.dtype) -> None:
    gate, up, down = write_deepseek_v4(tmp_path, torch.Generator().manual_seed(3), scale_dtype=scale_dtype)
    wrapper, x, ids, weights, out = run_wrapper(tmp_path, 0, num_gpu_experts=1)
    assert (wrapper.swiglu_alpha, wrapper.swiglu_limit) == (0.0, 10.0)  # DeepSeek-V4's clamp, applied by default
    dq = reference.dequantize(wrapper._parts[0].data)  # CPU experts 1..3
    for ours, theirs in zip(dq, (gate[1:], up[1:], down[1:])):
        assert torch.equal(ours, theirs)
    cpu_ids = torch.where(ids == 0, -1, ids)  # expert 0 runs on the GPU: skipped here
    ref = reference.moe_forward(x, cpu_ids, weights, gate, up, down, swiglu_limit=10.0)
    assert rel_err(out, ref) <= 3e-2


def test_bf16_checkpoint_and_tensors_quantize_online(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(4)
    gate, up, down = torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g)
    wrapper = KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=2, hidden_size=H, moe_intermediate_size=I,
                           method="MXFP4")
    wrapper.load_weights_from_tensors(gate, up, down)
    assert torch.equal(wrapper._parts[0].data, kt_ops.pack_experts(gate, up, down, method="MXFP4").data)


def test_wrong_method_on_an_mxfp4_checkpoint(tmp_path: Path) -> None:
    write_gpt_oss(tmp_path, torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="holds MXFP4 experts .*use method='MXFP4'"):
        run_wrapper(tmp_path, 1, method="BF16")


def test_method_none_detects_mxfp4(tmp_path: Path) -> None:
    write_gpt_oss(tmp_path, torch.Generator().manual_seed(6))
    wrapper, x, ids, weights, out = run_wrapper(tmp_path, 1, method=None)
    assert wrapper.method == "MXFP4" and (wrapper.swiglu_alpha, wrapper.swiglu_limit) == (pytest.approx(1.702), 7.0)
    assert torch.equal(out, run_wrapper(tmp_path, 1)[4])


def test_bad_checkpoints(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(7)
    prefix = "model.layers.0.mlp.experts"
    gu_codes, gu_exps = hf_codes((E, 2 * I), H, g)
    d_codes, d_exps = hf_codes((E, H), I, g)
    good = {f"{prefix}.gate_up_proj_blocks": gu_codes, f"{prefix}.gate_up_proj_scales": gu_exps,
            f"{prefix}.down_proj_blocks": d_codes, f"{prefix}.down_proj_scales": d_exps}
    cases = {
        "missing": ({k: v for k, v in good.items() if k != f"{prefix}.down_proj_scales"},
                    r"down_proj_scales' \(down scales\) is missing"),
        "shape": ({**good, f"{prefix}.gate_up_proj_scales": gu_exps[:, :, :2].contiguous()},
                  r"gate_up_proj_scales' \(gate/up scales\) has shape \[4, 128, 2\]; expected \[4, 128, 3\]"),
        "dtype": ({**good, f"{prefix}.down_proj_blocks": d_codes.float()}, r"down_proj_blocks' \(down codes\) is F32"),
        "bias": ({**good, f"{prefix}.down_proj_bias": torch.zeros(E, H + 1)}, r"down_proj_bias' \(expert bias\) has shape"),
    }
    for name, (tensors, message) in cases.items():
        path = tmp_path / name
        path.mkdir()
        save_file(tensors, str(path / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            run_wrapper(path, 0)
    v4 = tmp_path / "v4"
    write_deepseek_v4(v4, g)
    tensors = {k: v for k, v in load_file(str(v4 / "model.safetensors")).items() if k != "layers.0.ffn.experts.2.w2.scale"}
    save_file(tensors, str(v4 / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.experts\.2\.w2\.scale' \(scales\) is missing"):
        run_wrapper(v4, 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        load_mxfp4_experts(HfCheckpoint(v4), 0, [0], 48, I)


# --- GGUF ------------------------------------------------------------------------------


def write_gpt_oss_gguf(path: Path, g: torch.Generator, arch: str = "gpt-oss"):
    """A one-layer GGUF with MXFP4 experts (ggml block order) and F32 expert biases."""
    rng = np.random.default_rng(int(torch.randint(0, 1000, (1,), generator=g)))
    writer = moe_writer(path, arch, E, H, I)
    weights, biases = [], []
    for name, (rows, k) in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), ((I, H), (I, H), (H, I))):
        raw = rng.integers(0, 256, size=(E, rows, k // 32, 17), dtype=np.uint8)
        raw[..., 0] = rng.integers(119, 125, size=(E, rows, k // 32), dtype=np.uint8)
        writer.add_tensor(f"blk.0.{name}.weight", raw.reshape(E, rows, -1), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        bias = rng.standard_normal((E, rows)).astype(np.float32)
        writer.add_tensor(f"blk.0.{name}.bias", bias)
        weights.append(torch.from_numpy(gguf.quants.dequantize(raw.reshape(E * rows, -1), gguf.GGMLQuantizationType.MXFP4))
                       .reshape(E, rows, k))
        biases.append(torch.from_numpy(bias))
    finish(writer)
    return tuple(weights), tuple(biases)


def test_gpt_oss_gguf(tmp_path: Path) -> None:
    path = tmp_path / "gpt-oss.gguf"
    (gate, up, down), biases = write_gpt_oss_gguf(path, torch.Generator().manual_seed(9))
    got = kt_ops.load_gguf_expert_biases(path, 0)
    for ours, theirs in zip(got, biases):
        assert torch.equal(ours, theirs)
    outs = {}
    for method, parts, fmt in (("LLAMAFILE", 1, "gguf"), ("MXFP4", 1, "mxfp4"), ("MXFP4", 2, "mxfp4")):
        wrapper, x, ids, weights, out = run_wrapper(path, 0, method=method, threadpool_count=parts)
        assert (wrapper.swiglu_alpha, wrapper.swiglu_limit) == (pytest.approx(1.702), 7.0)
        assert [p.format for p in wrapper._parts] == [fmt] * (1 if fmt == "gguf" else parts)  # GGUF blobs: one part
        assert all(p.has_biases for p in wrapper._parts)
        if fmt == "mxfp4" and parts == 1:  # the file's codes and exponents, re-laid
            for ours, theirs in zip(reference.dequantize(wrapper._parts[0].data), (gate, up, down)):
                assert torch.equal(ours, theirs)
        ref = reference.moe_forward(x, ids, weights, gate, up, down, swiglu_limit=7.0, swiglu_alpha=1.702, biases=biases)
        assert rel_err(out, ref) <= 3e-2
        outs[method, parts] = out
    assert not torch.equal(outs["LLAMAFILE", 1], outs["MXFP4", 1])  # 8-bit activation blocks vs rows


def test_a_gguf_of_gelu_experts_is_refused(tmp_path: Path) -> None:
    """grok's experts are GELU-gated (llama.cpp's build_moe_ffn with LLM_FFN_GELU): they
    loaded as any GGUF and ran SwiGLU, silently wrong. Every loader names the activation."""
    path = tmp_path / "grok.gguf"
    write_gpt_oss_gguf(path, torch.Generator().manual_seed(9), arch="grok")
    with pytest.raises(ValueError, match=r"\(grok\): its experts use GELU-gated"):
        kt_ops.load_gguf_experts(path, 0)
    for method in ("LLAMAFILE", "MXFP4"):
        with pytest.raises(ValueError, match="GELU-gated"):
            KTMoEWrapper(0, E, 2, H, I, weight_path=path, method=method).load_weights()
    report = inspect_weights(path)
    assert report.layers == () and any("grok's experts use GELU-gated" in note for note in report.notes)
    assert dict(report.facts)["method"].startswith("none")


@pytest.mark.parametrize("with_weights", [True, False])
def test_gguf_biases_without_the_intermediate_size_key_are_checked_against_the_experts(tmp_path: Path,
                                                                                   with_weights: bool) -> None:
    """No {arch}.expert_feed_forward_length: each gate/up bias was taken at its own width, so a
    gate bias [E, 7] and an up bias [E, 9] beside experts of I = 64 came back without an error."""
    from gguf_helpers import random_blocks

    path = tmp_path / "m.gguf"
    writer = moe_writer(path, "gpt-oss", E, H)
    rng = np.random.default_rng(0)
    if with_weights:
        for name, rows, k in (("ffn_gate_exps", I, H), ("ffn_up_exps", I, H), ("ffn_down_exps", H, I)):
            raw = random_blocks("Q8_0", E * rows, k, rng).reshape(E, rows, -1)
            writer.add_tensor(f"blk.0.{name}.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_gate_exps.bias", np.zeros((E, I if with_weights else 7), np.float32))
    writer.add_tensor("blk.0.ffn_up_exps.bias", np.zeros((E, 9), np.float32))
    finish(writer)
    with pytest.raises(ValueError, match=r"ffn_up_exps\.bias in m\.gguf has ggml shape \[9, "):
        kt_ops.load_gguf_expert_biases(path, 0)


def test_a_gguf_bias_declared_f32_over_f16_values_is_refused(tmp_path: Path) -> None:
    """An F16 bias whose type field was changed to F32 read the next tensor's bytes as its second half."""
    import struct

    path = tmp_path / "m.gguf"
    writer = moe_writer(path, "gpt-oss", E, H, I)
    writer.add_tensor("blk.0.ffn_gate_exps.bias", np.ones((E, I // 2), np.float32).view(np.float16).reshape(E, I))
    writer.add_tensor("blk.0.ffn_up_exps.bias", np.zeros((E, I), np.float32))
    finish(writer)
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_gate_exps.bias"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    struct.pack_into("<I", data, at + 4 + 8 * struct.unpack_from("<I", data, at)[0], int(gguf.GGMLQuantizationType.F32))
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"ffn_gate_exps\.bias in m\.gguf is declared F32.*disagrees with the bytes"):
        kt_ops.load_gguf_expert_biases(path, 0)


def test_mxfp4_method_refuses_other_gguf_types(tmp_path: Path) -> None:
    from gguf_helpers import random_blocks, write_model

    path = tmp_path / "q8.gguf"
    rng = np.random.default_rng(3)
    layer = {name: ("Q8_0", random_blocks("Q8_0", E * rows, k, rng).reshape(E, rows, -1))
             for name, rows, k in (("ffn_gate_exps", I, H), ("ffn_up_exps", I, H), ("ffn_down_exps", H, I))}
    write_model(path, [layer], E, H, I)
    with pytest.raises(ValueError, match=r"gguf \(Q8_0/Q8_0/Q8_0\).*method='LLAMAFILE'"):
        run_wrapper(path, 0)


def test_other_gguf_architectures_keep_their_activation(tmp_path: Path) -> None:
    path = tmp_path / "qwen.gguf"
    (gate, up, down), _ = write_gpt_oss_gguf(path, torch.Generator().manual_seed(10), arch="qwen3moe")
    wrapper, x, ids, weights, out = run_wrapper(path, 0, method="LLAMAFILE")
    assert (wrapper.swiglu_alpha, wrapper.swiglu_limit) == (0.0, 0.0) and not wrapper._parts[0].has_biases
    assert rel_err(out, reference.moe_forward(x, ids, weights, gate, up, down)) <= 3e-2


# --- kt_ops.convert --------------------------------------------------------------------


@pytest.mark.parametrize("layout,parts", [("gpt_oss", 1), ("gpt_oss", 2), ("deepseek_v4", 2)])
def test_convert_keeps_the_checkpoints_codes(tmp_path: Path, layout: str, parts: int) -> None:
    """``--input-type mxfp4 --quant-method mxfp4``: each layer's codes and exponents laid out
    as format mxfp4 with its activation and biases; the converted directory computes what
    the checkpoint read in place computes, bit for bit."""
    from kt_ops import convert

    src, out = tmp_path / "src", tmp_path / "out"
    layer = 1 if layout == "gpt_oss" else 0
    if layout == "gpt_oss":
        write_gpt_oss(src, torch.Generator().manual_seed(21),
                      config={"model_type": "gpt_oss", "num_local_experts": E, "hidden_size": H,
                              "intermediate_size": I, "swiglu_limit": 7.0})
    else:
        write_deepseek_v4(src, torch.Generator().manual_seed(22))
        (src / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "n_routed_experts": E,
                                                     "hidden_size": H, "moe_intermediate_size": I}))
    args = ["--input-path", src, "--input-type", "mxfp4", "--output", out, "--quant-method", "mxfp4",
            "--threadpool-count", parts]
    assert convert.main([str(a) for a in args]) == 0
    direct, x, ids, weights, want = run_wrapper(src, layer, threadpool_count=parts)
    converted, *_, got = run_wrapper(out, layer, threadpool_count=parts)
    assert [p.format for p in converted._parts] == ["mxfp4"] * parts
    assert (converted.swiglu_limit, converted.swiglu_alpha) == pytest.approx((direct.swiglu_limit, direct.swiglu_alpha))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="converted with its checkpoint's activation"):
        run_wrapper(out, layer, threadpool_count=parts, swiglu_limit=3.0)
    same, *_, again = run_wrapper(out, layer, threadpool_count=parts, swiglu_limit=direct.swiglu_limit,
                                  swiglu_alpha=direct.swiglu_alpha)  # the values it holds: accepted
    assert torch.equal(again, want)


def test_convert_refuses_mxfp4_mixups(tmp_path: Path, capsys) -> None:
    from kt_ops import convert

    src = tmp_path / "src"
    write_gpt_oss(src, torch.Generator().manual_seed(23),
                  config={"model_type": "gpt_oss", "num_local_experts": E, "hidden_size": H, "intermediate_size": I})
    base = ["--input-path", str(src), "--output", str(tmp_path / "o")]
    assert convert.main([*base, "--input-type", "bf16", "--quant-method", "int8"]) == 2
    assert "holds MXFP4 experts: use --input-type mxfp4 --quant-method mxfp4" in capsys.readouterr().err
    assert convert.main([*base, "--input-type", "mxfp4", "--quant-method", "int4"]) == 2
    assert "--input-type mxfp4 converts only to --quant-method mxfp4" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("layout", ["gpt_oss", "deepseek_v4"])
def test_inspect_reads_an_mxfp4_checkpoint(tmp_path: Path, layout: str) -> None:
    """kt-ops inspect on gpt-oss's and DeepSeek-V4's MXFP4 experts: the layer's shape, its
    bytes (codes, exponents, biases) and the kernel of method MXFP4, from the headers."""
    from kt_ops.formats import format_info
    from kt_ops.inspection import format_inspection, inspect_weights

    g = torch.Generator().manual_seed(2)
    (write_gpt_oss if layout == "gpt_oss" else write_deepseek_v4)(tmp_path, g)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    expected = sum(t.nbytes for k, t in tensors.items() if ".experts." in k)
    report = inspect_weights(tmp_path)
    [layer] = report.layers
    assert (layer.layer, layer.num_experts, layer.hidden_size, layer.intermediate_size) == (
        1 if layout == "gpt_oss" else 0, E, H, I)
    assert layer.nbytes == expected and [m.type for m in layer.matrices] == ["mxfp4"] * 3
    assert ("expert tensors", f"MXFP4 {layout} naming") in report.facts
    text = format_inspection(report)
    assert f"method MXFP4 (read in place): {format_info('mxfp4').kernels[kt_ops.cpu_variant()]}" in text, text


def test_weights_loaded_after_a_gpt_oss_checkpoint_get_the_constructors_activation(tmp_path: Path) -> None:
    """A wrapper loaded from gpt-oss (alpha-SwiGLU taken from the checkpoint), then given other weights with
    load_weights_from_tensors, computes the constructor's activation on them (it kept alpha 1.702 and limit 7: a
    SiLU layer computed as gpt-oss's, silently)."""
    write_gpt_oss(tmp_path, torch.Generator().manual_seed(1))
    wrapper, x, ids, weights, _ = run_wrapper(tmp_path, 1)
    g = torch.Generator().manual_seed(4)
    gate, up = (torch.randn(E, I, H, generator=g) * 0.05 for _ in range(2))
    down = torch.randn(E, H, I, generator=g) * 0.05
    wrapper.load_weights_from_tensors(gate, up, down)
    assert (wrapper.swiglu_alpha, wrapper.swiglu_limit) == (0.0, 0.0) and not wrapper._parts[0].has_biases
    held = reference.dequantize(wrapper._parts[0].data)
    assert rel_err(wrapper.forward(x, ids.long(), weights), reference.moe_forward(x, ids, weights, *held)) <= 3e-2
