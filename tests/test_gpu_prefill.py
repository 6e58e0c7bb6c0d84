"""GPU-assisted prefill (kt_ops.gpu_prefill): long prompts' CPU experts computed on the GPU.

Everywhere: what travels expands on the device to exactly the weights the CPU kernels
multiply (``kt_ops.dequantize_experts``): the rows of every row format (kt-kernel's, INT4
with fp32 scales, INT8, asymmetric INT4) and the GGUF blocks of every type
``kt_ops.gguf_torch`` decodes; the chunked pipeline, run on the CPU device (same code, no
streams), computes the fp32 oracle on those weights for every packing case (within fp32
rounding, 1e-5), with biases and the clamped/alpha SwiGLU, ``-1`` slots and
``live_tokens``; bad input is refused; the threshold plumbing (HybridMoE, patch_model,
KtOpsConfig, the setter), that CPU inputs never take the path, (the path forced on the
CPU) dynamic layers moving their GPU experts to a prefill batch's hottest, and the next
layer's first chunk staged ahead, taken by that layer's call without changing a bit.

On a GPU (kt_ops built with its CUDA key): the same against the oracle for every case
(fp32 activations 1e-4; bf16 activations 1e-2: bf16 weights and intermediates, 5.1e-3 at
most when this code runs on the CPU device), chunking that does not change a bit, and
HybridMoE / a transformers model switching at the threshold.
"""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

import kt_ops
import kt_ops.cuda
from conftest import logits_bound, make_experts, random_routing, rel_err
from format_cases import format_cases
from gguf_helpers import F16_FIELDS, FLOAT_TYPES, T, dequantize
from kt_ops import gguf_torch, gpu_prefill, reference
from kt_ops.staging import stage_expert, stage_rows_into

CASES = format_cases(min_hidden=90, min_intermediate=70)
STAGED = {"bf16", "fp8", "fp8_perchannel", "mxfp8", "int4", "int8", "int4_asym", "mxfp4"}
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not kt_ops.cuda.is_built(),
    reason="needs a GPU (torch.cuda.is_available() is False here) and kt_ops built with its CUDA key",
)


def packed_case(case, experts: int = 5, seed: int = 0, activation: bool = False) -> kt_ops.PackedExperts:
    g = torch.Generator().manual_seed(seed)
    H, I = case.hidden, case.intermediate
    gate = (torch.randn(experts, I, H, generator=g) / H**0.5).bfloat16()
    up = (torch.randn(experts, I, H, generator=g) / H**0.5).bfloat16()
    down = (torch.randn(experts, H, I, generator=g) / I**0.5).bfloat16()
    packed = case.pack(gate, up, down)
    if activation:  # gpt-oss: biases, clamp and alpha
        biases = (torch.randn(experts, I, generator=g) * 0.1, torch.randn(experts, I, generator=g) * 0.1,
                  torch.randn(experts, H, generator=g) * 0.1)
        packed = kt_ops.set_activation(packed, swiglu_limit=0.7, swiglu_alpha=1.702, biases=biases)
    return packed


def oracle(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, packed: kt_ops.PackedExperts) -> torch.Tensor:
    gate, up, down = kt_ops.dequantize_experts(packed)
    return reference.moe_forward(x, ids, weights, gate, up, down, **reference.activation_of(packed.data))


@pytest.mark.parametrize("case", [c for c in CASES if c.format in STAGED or c.id == "gguf-MXFP4"], ids=lambda c: c.id)
def test_staged_rows_expand_to_the_kernels_weights(case) -> None:
    packed = packed_case(case)
    layout = gpu_prefill.row_layout(packed)
    assert layout is not None and layout.format == ("mxfp4" if case.format == "gguf" else case.format)
    gate, up, down = kt_ops.dequantize_experts(packed)
    H, I = case.hidden, case.intermediate
    outs = layout.buffers(packed.num_experts)
    for e in range(packed.num_experts):
        stage_rows_into(packed, e, [t[e] for t in outs], layout.int4_fp32_scales)
    r = layout.views(outs)
    assert torch.equal(gpu_prefill.expand_rows(layout, r.gate, r.gate_scale, H, torch.float32), gate)
    assert torch.equal(gpu_prefill.expand_rows(layout, r.up, r.up_scale, H, torch.float32), up)
    assert torch.equal(gpu_prefill.expand_rows(layout, r.down, r.down_scale, I, torch.float32), down)


def test_int4_scales_travel_in_fp32() -> None:
    """kt-kernel's INT4 staging truncates the scales to bf16; the prefill rows keep them in
    fp32, so a layer quantized from fp32 weights (scales bf16 cannot hold) is exact too."""
    g = torch.Generator().manual_seed(1)
    E, H, I = 3, 128, 64
    w = [torch.randn(E, I, H, generator=g) * 0.37, torch.randn(E, I, H, generator=g) * 0.37,
         torch.randn(E, H, I, generator=g) * 0.29]
    packed = kt_ops.pack_experts(*w, method="RAWINT4", group_size=32)
    layout = gpu_prefill.row_layout(packed)
    assert layout is not None and layout.int4_fp32_scales and layout.scale_dtype == torch.float32
    assert stage_expert(packed, 0)[0].w13_scale.dtype == torch.bfloat16  # kt-kernel's layout unchanged
    x = torch.randn(9, H, generator=g)
    ids, weights = random_routing(9, E, 2)
    assert rel_err(gpu_prefill.moe_forward_on_device(x, ids, weights, packed), oracle(x, ids, weights, packed)) <= 1e-5


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_pipeline_on_the_cpu_computes_the_oracle(case) -> None:
    activation = case.id in ("bf16", "int8", "gguf-MXFP4")
    packed = packed_case(case, activation=activation)
    ids, weights = random_routing(13, packed.num_experts, 3)
    ids[2, 1] = -1
    x = torch.randn(13, case.hidden)
    want = oracle(x, ids, weights, packed)
    one = gpu_prefill.moe_forward_on_device(x, ids, weights, packed)
    per_expert = gpu_prefill.moe_forward_on_device(x, ids, weights, packed, chunk_bytes=1)
    assert one.dtype == torch.float32 and one.shape == x.shape
    assert rel_err(one, want) <= 1e-5, case.id
    # chunking moves no bit on a GPU (test_gpu_pipeline_matches_the_cpu_key); the CPU's
    # elementwise kernels round sigmoid in a vector body and its scalar tail differently,
    # so there the activation of a row depends on its place in the chunk
    assert rel_err(per_expert, one) <= 1e-6
    live = gpu_prefill.moe_forward_on_device(x, ids, weights, packed, torch.tensor([5]))
    # the GEMMs' blocking follows the rows per expert: a row's bits may depend on the others
    assert rel_err(live[:5], one[:5]) <= 1e-6 and not live[5:].any()


def test_bf16_inputs_compute_in_bf16() -> None:
    experts = make_experts(6, 96, 80)
    ids, weights = random_routing(11, 6, 2)
    x = torch.randn(11, 96).bfloat16()
    got = gpu_prefill.moe_forward_on_device(x, ids, weights, experts.packed)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, kt_ops.moe_forward(x, ids, weights, experts.packed)) <= 1e-2


GGUF_CASES = [c for c in CASES if c.format == "gguf" and c.id != "gguf-MXFP4"]


@pytest.mark.parametrize("case", GGUF_CASES, ids=lambda c: c.id)
def test_gguf_blocks_decode_on_the_device_to_the_kernels_weights(case) -> None:
    """GGUF layers travel as their blocks; kt_ops.gguf_torch decodes them to exactly the
    weights the CPU kernels use (gguf.quants' arithmetic), Q2_K/Q3_K excepted."""
    packed = packed_case(case)
    found = gpu_prefill.transport(packed)
    types = [t if isinstance(t, str) else None for t in ([case.kwargs["gguf_type"]] * 3
                                                        if isinstance(case.kwargs["gguf_type"], str)
                                                        else case.kwargs["gguf_type"])]
    if any(t in ("Q2_K", "Q3_K") for t in types):
        assert found is None
        return
    assert isinstance(found, gpu_prefill.GgufRows)
    host = gpu_prefill._host_chunk(packed, list(range(packed.num_experts)), found, torch.float32, pin=False)
    got = gpu_prefill._weights(host, found, case.hidden, case.intermediate, torch.float32)
    for name, a, b in zip(("gate", "up", "down"), got, kt_ops.dequantize_experts(packed)):
        assert torch.equal(a, b), f"{case.id} {name}"


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bit for bit, any NaN equal to any NaN."""
    nan = torch.isnan(got) & torch.isnan(want)
    return bool(((got.view(torch.int32) == want.view(torch.int32)) | nan).all())


@pytest.mark.parametrize("name", sorted(gguf_torch.DEVICE_TYPES))
def test_gguf_torch_decodes_any_bytes_as_gguf_quants(name) -> None:
    """Every byte pattern (inf / NaN / subnormal / -0 fp16 scales, all-zero and all-0xFF
    blocks), odd row counts, strided rows and an odd storage offset: gguf.quants' values
    (MXFP4: exponent 255 is NaN, docs/formats.md)."""
    rng = np.random.default_rng(3)
    block, type_bytes = gguf.GGML_QUANT_SIZES[T[name]]
    k = 2 * max(block, 32)
    row_bytes = k // block * type_bytes
    if name in FLOAT_TYPES:
        values = rng.standard_normal((5, k)).astype(np.float32)
        values[0, :4] = (np.inf, -np.inf, np.nan, -0.0)
        raw = gguf.quants.quantize(values, T[name]).view(np.uint8).reshape(5, row_bytes)
    else:
        raw = rng.integers(0, 256, size=(7, row_bytes), dtype=np.uint8)
        raw[0], raw[1] = 0, 255
        fields = (0,) if name == "MXFP4" else F16_FIELDS[name][0]
        specials = np.array([np.inf, -np.inf, np.nan, -0.0, 6e-8], np.float16).view(np.uint8).reshape(5, 1, 2)
        for offset in fields:
            if name != "MXFP4":
                raw.reshape(7, -1, type_bytes)[2:7, :, offset:offset + 2] = specials
    with np.errstate(all="ignore"):  # inf and NaN scales
        want = dequantize(raw, name, raw.shape[:1] + (k,))
    if name == "MXFP4":
        want[np.repeat(raw.reshape(raw.shape[0], -1, type_bytes)[:, :, 0] == 255, 32, axis=1)] = float("nan")
    rows = torch.from_numpy(raw)
    got = gguf_torch.dequantize_rows(rows, int(T[name]), k)
    assert got.dtype == torch.float32 and got.shape == want.shape and _same_bits(got, want)
    strided = torch.from_numpy(np.ascontiguousarray(raw.T)).t()  # same values, column-major
    assert not strided.is_contiguous() and _same_bits(gguf_torch.dequantize_rows(strided, int(T[name]), k), want)
    odd = torch.cat((torch.zeros(1, dtype=torch.uint8), rows[:1].flatten()))[1:].view(1, row_bytes)  # offset 1
    assert _same_bits(gguf_torch.dequantize_rows(odd, int(T[name]), k), want[:1])
    assert _same_bits(gguf_torch.dequantize_rows(rows[0], int(T[name]), k), want[0])
    assert gguf_torch.dequantize_rows(rows[:0], int(T[name]), k).shape == (0, k)


def test_gguf_torch_refuses_rows_that_do_not_fit() -> None:
    """A row length or byte count that does not match the type was a reshape error or,
    where the bytes still fit whole blocks, rows silently cut or short; bytes of another
    dtype (int8 nibbles shift in their sign) were decoded."""
    q8 = int(T.Q8_0)
    raw = torch.randint(0, 256, (3, 68), dtype=torch.uint8)
    for k, match in ((96, "row of 96 weights takes 102 bytes, got rows of 68"),
                     (32, "row of 32 weights takes 34 bytes, got rows of 68"),
                     (40, "multiple of 32, got 40"), (-1, "multiple of 32, got -1")):
        with pytest.raises(ValueError, match=match):
            gguf_torch.dequantize_rows(raw, q8, k)
    # random fp16 scales may be NaN: compared with NaNs equal
    numpy_k, int_k = gguf_torch.dequantize_rows(raw, q8, np.int64(64)), gguf_torch.dequantize_rows(raw, q8, 64)
    torch.testing.assert_close(numpy_k, int_k, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="multiple of 32, got 64.0"):
        gguf_torch.dequantize_rows(raw, q8, 64.0)
    with pytest.raises(ValueError, match="takes 68 bytes, got rows of 67"):
        gguf_torch.dequantize_rows(raw[:, :67], q8, 64)
    with pytest.raises(ValueError, match="0-d"):
        gguf_torch.dequantize_rows(raw[0, 0], q8, 64)
    with pytest.raises(ValueError, match="F32 row of 20 weights takes 80 bytes"):
        gguf_torch.dequantize_rows(raw[:, :64], int(T.F32), 20)
    with pytest.raises(TypeError, match="uint8"):
        gguf_torch.dequantize_rows(raw.view(torch.int8), int(T.Q4_0), 128)
    for name in ("Q2_K", "Q3_K"):
        with pytest.raises(ValueError, match=f"GGUF type {name} is not decoded on the device"):
            gguf_torch.dequantize_rows(torch.zeros(1, gguf.GGML_QUANT_SIZES[T[name]][1], dtype=torch.uint8),
                                       int(T[name]), 256)


def test_formats_without_a_staging_layout_travel_dequantized() -> None:
    for case in CASES:
        if case.format not in STAGED and case.id != "gguf-MXFP4":
            assert gpu_prefill.row_layout(packed_case(case)) is None, case.id


def test_bad_input_is_refused() -> None:
    experts = make_experts(4, 64, 48)
    ids, weights = random_routing(5, 4, 2)
    x = torch.randn(5, 64)
    for bad, match in ((ids + 4, r"in \[-1, 4\)"), (ids - 3, r"in \[-1, 4\)")):
        with pytest.raises(ValueError, match=match):
            gpu_prefill.moe_forward_on_device(x, bad, weights, experts.packed)
    with pytest.raises(ValueError, match="H = 32"):
        gpu_prefill.moe_forward_on_device(torch.randn(5, 32), ids, weights, experts.packed)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        gpu_prefill.moe_forward_on_device(x, ids[:3], weights, experts.packed)
    for threshold in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="gpu_prefill_token_threshold"):
            gpu_prefill.checked_threshold(threshold)
    with pytest.raises(ValueError, match="no kt_ops MoE layer"):
        kt_ops.set_gpu_prefill_token_threshold(torch.nn.Linear(2, 2), 8)
    # live_tokens as the operator checks it: -1 dropped every row and 6 kept all five, silently
    for live, error, match in ((torch.tensor([-1]), ValueError, r"live_tokens = -1 is outside \[0, 5\]"),
                               (torch.tensor([6]), ValueError, r"live_tokens = 6 is outside \[0, 5\]"),
                               (torch.tensor([2, 3]), ValueError, "one value"),
                               (torch.tensor([2.0]), TypeError, "int32 or int64")):
        with pytest.raises(error, match=match):
            gpu_prefill.moe_forward_on_device(x, ids, weights, experts.packed, live)
        if error is ValueError and live.numel() == 1:
            with pytest.raises(ValueError, match=match):  # the operator's own message
                kt_ops.moe_forward(x, ids, weights, experts.packed, live)
    empty = gpu_prefill.moe_forward_on_device(x[:0], ids[:0], weights[:0], experts.packed)
    assert empty.shape == (0, 64)
    none = gpu_prefill.moe_forward_on_device(x, ids[:, :0], weights[:, :0], experts.packed)  # top-k 0: zeros,
    assert torch.equal(none, kt_ops.moe_forward(x, ids[:, :0], weights[:, :0], experts.packed))  # as the operator


def test_dtypes_the_operator_refuses_are_refused() -> None:
    """Float, bool or uint8 ids were cast to int64 (1.7 computed expert 1), integer or
    fp64 activations and integer weights computed: the operator's TypeError instead."""
    experts = make_experts(4, 64, 48)
    ids, weights = random_routing(5, 4, 2)
    x = torch.randn(5, 64)
    for args, match in (((x, ids.float() + 0.7, weights), "topk_ids must have dtype"),
                        ((x, ids.bool(), weights), "topk_ids must have dtype"),
                        ((x, ids.to(torch.uint8), weights), "topk_ids must have dtype"),
                        ((x.int(), ids, weights), "hidden_states must have dtype"),
                        ((x.double(), ids, weights), "hidden_states must have dtype"),
                        ((x, ids, weights.int()), "topk_weights must have dtype")):
        with pytest.raises(TypeError, match=match):
            kt_ops.moe_forward(*args, experts.packed)
        with pytest.raises(TypeError, match=match):
            gpu_prefill.moe_forward_on_device(*args, experts.packed)


def hybrid(threshold: int = 0) -> kt_ops.HybridMoE:
    experts = make_experts(8, 64, 48)
    g = torch.Generator().manual_seed(5)
    return kt_ops.HybridMoE(torch.randn(8, 64, generator=g).bfloat16(), experts.gate, experts.up, experts.down,
                            kt_ops.Routing(2), gpu_experts_mask=torch.arange(8) < 2,
                            gpu_prefill_token_threshold=threshold)


def test_cpu_inputs_never_take_the_path(monkeypatch) -> None:
    layer = hybrid(threshold=1)
    calls = []
    monkeypatch.setattr(gpu_prefill, "moe_forward_on_device", lambda *a, **k: calls.append(a))
    with torch.no_grad():
        layer(torch.randn(16, 64).bfloat16())
    assert not calls
    assert not gpu_prefill.should_run_on_device(torch.randn(16, 64), 1)
    with pytest.raises(ValueError, match="gpu_prefill_token_threshold"):
        hybrid(threshold=-2)
    assert kt_ops.set_gpu_prefill_token_threshold(layer, 7) == 1 and layer.gpu_prefill_token_threshold == 7


def test_patch_model_and_config_set_the_threshold() -> None:
    transformers = pytest.importorskip("transformers")
    from hf_models import tiny_model
    from kt_ops import hf_experts

    for arch in ("qwen3_moe", "gpt_oss"):  # HybridMoE blocks; the experts interface
        model = kt_ops.patch_model(tiny_model(arch, dtype=torch.bfloat16), "BF16", gpu_prefill_token_threshold=64)
        layers = [m for m in model.modules() if isinstance(m, kt_ops.HybridMoE)]
        layers += [m for m in model.modules() if hf_experts.is_experts_module(m)]
        assert layers and all(getattr(m, "gpu_prefill_token_threshold", None) == 64
                              or m.__dict__.get(gpu_prefill.PREFILL_ATTRIBUTE) == 64 for m in layers), arch
    assert kt_ops.KtOpsConfig(gpu_prefill_token_threshold=4096).gpu_prefill_token_threshold == 4096
    with pytest.raises(ValueError, match="gpu_prefill_token_threshold"):
        kt_ops.KtOpsConfig(gpu_prefill_token_threshold=-1)
    assert transformers is not None


# ---- on a GPU ------------------------------------------------------------------------

@needs_gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gpu_pipeline_matches_the_cpu_key(case) -> None:
    packed = packed_case(case, activation=case.id == "bf16")
    ids, weights = random_routing(40, packed.num_experts, 3)
    x = torch.randn(40, case.hidden).bfloat16()
    got = gpu_prefill.moe_forward_on_device(x.cuda(), ids.cuda(), weights.cuda(), packed)
    chunked = gpu_prefill.moe_forward_on_device(x.cuda(), ids.cuda(), weights.cuda(), packed, chunk_bytes=1)
    assert got.device.type == "cuda" and got.dtype == torch.bfloat16
    assert rel_err(got.cpu(), oracle(x, ids, weights, packed)) <= 1e-2, case.id  # 5.1e-3 at most on the CPU device
    assert torch.equal(got, chunked)
    x32 = x.float()
    got32 = gpu_prefill.moe_forward_on_device(x32.cuda(), ids.cuda(), weights.cuda(), packed)
    assert rel_err(got32.cpu(), oracle(x32, ids, weights, packed)) <= 1e-4  # TF32 off by default


@needs_gpu
def test_hybrid_layer_switches_at_the_threshold(monkeypatch) -> None:
    layer = hybrid(threshold=32).cuda()
    taken = []
    real = gpu_prefill.moe_forward_on_device
    monkeypatch.setattr(gpu_prefill, "moe_forward_on_device", lambda *a, **k: taken.append(a[0].shape[0]) or real(*a, **k))
    reference_layer = hybrid(threshold=0).cuda()
    for tokens in (31, 32, 200):
        x = torch.randn(tokens, 64, device="cuda").bfloat16()
        with torch.no_grad():
            got, want = layer(x), reference_layer(x)
        assert rel_err(got, want) <= 2e-2
    assert taken == [32, 200]


@needs_gpu
def test_transformers_model_switches_at_the_threshold(monkeypatch) -> None:
    pytest.importorskip("transformers")
    from hf_models import tiny_model
    from test_hf_patch import TOKENS, logits

    model = kt_ops.patch_model(tiny_model("gpt_oss", dtype=torch.bfloat16).float(), "BF16").cuda()
    tokens = TOKENS.cuda()
    want = logits(model, tokens)
    taken = []
    real = gpu_prefill.moe_forward_on_device
    monkeypatch.setattr(gpu_prefill, "moe_forward_on_device", lambda *a, **k: taken.append(1) or real(*a, **k))
    kt_ops.set_gpu_prefill_token_threshold(model, 4)
    got = logits(model, tokens)
    assert len(taken) == 2  # one per MoE layer
    assert rel_err(got, want) <= logits_bound(1e-4)  # the CPU kernels round activations on avx512_bf16/amx


def test_a_layers_row_layout_is_found_once(monkeypatch) -> None:
    experts = make_experts(4, 64, 48)
    ids, weights = random_routing(6, 4, 2)
    calls = []
    real = gpu_prefill.row_layout
    monkeypatch.setattr(gpu_prefill, "row_layout", lambda p: calls.append(1) or real(p))
    for _ in range(3):
        gpu_prefill.moe_forward_on_device(torch.randn(6, 64), ids, weights, experts.packed)
    assert len(calls) == 1
    other = make_experts(4, 64, 48, seed=1)
    gpu_prefill.moe_forward_on_device(torch.randn(6, 64), ids, weights, other.packed)
    assert len(calls) == 2


@pytest.fixture
def prefill_on_the_cpu(monkeypatch):
    """The GPU-prefill path taken by CPU inputs too (the same code; no GPU here)."""
    monkeypatch.setattr(gpu_prefill, "should_run_on_device", lambda x, threshold: 0 < threshold <= x.shape[0])


def dynamic_hybrid(gpu: list[int], dynamic: bool = True, threshold: int = 0) -> kt_ops.HybridMoE:
    experts = make_experts(8, 64, 48)
    g = torch.Generator().manual_seed(5)
    mask = torch.zeros(8, dtype=torch.bool)
    mask[gpu] = True
    return kt_ops.HybridMoE(torch.randn(8, 64, generator=g).bfloat16(), experts.gate, experts.up, experts.down,
                            kt_ops.Routing(2), gpu_experts_mask=mask, dynamic=dynamic,
                            gpu_prefill_token_threshold=threshold)


def test_prefill_moves_a_dynamic_layers_gpu_experts_to_the_batchs_hottest(prefill_on_the_cpu) -> None:
    layer = dynamic_hybrid([0, 1])
    assert kt_ops.set_gpu_prefill_token_threshold(layer, 16, update_gpu_experts=True) == 1
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    with torch.no_grad():
        _, ids = layer.route(x)
        hottest = sorted(torch.topk(torch.bincount(ids.reshape(-1), minlength=8).double(), 2).indices.tolist())
        assert hottest != [0, 1]
        first = layer(x)
        assert torch.equal(first, dynamic_hybrid([0, 1], threshold=16)(x))  # with the placement it started with
        assert layer.gpu_experts.tolist() == hottest
        assert torch.equal(layer(x[:15]), dynamic_hybrid(hottest)(x[:15]))  # decode-sized: no update
        assert layer.gpu_experts.tolist() == hottest


def test_prefill_updates_need_a_dynamic_layer() -> None:
    with pytest.raises(ValueError, match="dynamic_gpu_experts=True"):
        kt_ops.set_gpu_prefill_token_threshold(dynamic_hybrid([0, 1], dynamic=False), 16, update_gpu_experts=True)
    assert kt_ops.set_gpu_prefill_token_threshold(dynamic_hybrid([0, 1], dynamic=False), 16) == 1


def test_prefill_moves_the_experts_paths_local_experts(prefill_on_the_cpu) -> None:
    pytest.importorskip("transformers")
    from hf_models import tiny_model
    from kt_ops import hf_experts
    from test_hf_patch import TOKENS, logits

    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[:, [0, 1]] = True
    model = kt_ops.patch_model(tiny_model("gpt_oss", dtype=torch.bfloat16).float(), "BF16", gpu_experts_mask=mask,
                               dynamic_gpu_experts=True)
    with kt_ops.ExpertStats(num_hidden_layers=2) as stats:
        logits(model, TOKENS)
    kt_ops.set_gpu_prefill_token_threshold(model, 4, update_gpu_experts=True)
    logits(model, TOKENS)
    for module in (m for m in model.modules() if hf_experts.is_experts_module(m)):
        counts = stats.counts[hf_experts.layer_id(module)]
        assert hf_experts.local_experts(module)[0].tolist() == sorted(torch.topk(counts.double(), 2).indices.tolist())


def test_a_row_may_route_one_expert_twice() -> None:
    experts = make_experts(4, 64, 48)
    x = torch.randn(3, 64)
    ids = torch.tensor([[1, 1], [0, 2], [3, -1]])
    weights = torch.rand(3, 2)
    got = gpu_prefill.moe_forward_on_device(x, ids, weights, experts.packed)
    assert rel_err(got, oracle(x, ids, weights, experts.packed)) <= 1e-5


def test_ranks_order_each_tokens_experts() -> None:
    E = 9  # a skipped slot's id: last
    slots = torch.tensor([3, 1, E, 2, 2, 0])
    assert gpu_prefill._ranks(slots, 3).tolist() == [1, 0, 2, 1, 2, 0]


class _RecordingOut:
    """An accumulator that records each ``index_add_`` (a stand-in for a GPU tensor, whose
    atomics would add one call's repeated rows in any order)."""

    def __init__(self, rows: int, width: int) -> None:
        self.values = torch.zeros(rows, width)
        self.calls: list[list[int]] = []

    def index_add_(self, dim: int, index: torch.Tensor, source: torch.Tensor) -> None:
        self.calls.append(index.tolist())
        self.values.index_add_(dim, index, source)


def test_accumulate_adds_no_token_twice_in_one_call_and_keeps_the_expert_order() -> None:
    # one chunk's rows in expert order: token 0 routes experts 1, 2, 2 (ranks 0, 1, 2),
    # token 1 experts 1, 2 (ranks 0, 1); fp32 sums whose value depends on their order
    tokens = torch.tensor([0, 1, 0, 0, 1])
    ranks = torch.tensor([0, 0, 1, 2, 1])
    y = torch.tensor([[1e8], [2.0], [-1e8], [1.0], [3.0]])
    out = _RecordingOut(2, 1)
    gpu_prefill._accumulate(out, y, tokens, ranks, [2, 2, 1])
    assert all(len(set(call)) == len(call) for call in out.calls) and len(out.calls) == 3
    assert out.values[:, 0].tolist() == [1.0, 5.0]  # (1e8 - 1e8) + 1, not (1e8 + 1) - 1e8
    single = _RecordingOut(2, 1)
    gpu_prefill._accumulate(single, y[:2], tokens[:2], ranks[:2], [2, 0, 0])
    assert single.calls == [[0, 1]]


def test_bf16_chunks_run_grouped_gemms(monkeypatch) -> None:
    experts = make_experts(6, 96, 80)
    ids, weights = random_routing(21, 6, 3)
    ids[4, :] = torch.tensor([2, 2, -1])  # a token routing one expert twice
    x = torch.randn(21, 96).bfloat16()
    calls = []
    grouped = torch._grouped_mm

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return grouped(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    got = gpu_prefill.moe_forward_on_device(x, ids, weights, experts.packed)
    assert len(calls) == 3  # gate, up and down of the one chunk
    monkeypatch.setattr(gpu_prefill, "_grouped_mm_fits", lambda h, w: False)
    per_expert = gpu_prefill.moe_forward_on_device(x, ids, weights, experts.packed)
    assert len(calls) == 3
    assert rel_err(got, per_expert) <= 1e-2
    assert rel_err(got, oracle(x, ids, weights, experts.packed)) <= 1e-2


def test_a_refused_grouped_gemm_falls_back_per_expert(monkeypatch) -> None:
    experts = make_experts(5, 64, 48)
    ids, weights = random_routing(9, 5, 2)
    x = torch.randn(9, 64).bfloat16()
    want = gpu_prefill.moe_forward_on_device(x, ids, weights, experts.packed)

    def refused(*args, **kwargs):
        raise RuntimeError("grouped_mm: no kernel for this device")

    monkeypatch.setattr(torch, "_grouped_mm", refused)
    monkeypatch.setattr(gpu_prefill, "_NO_GROUPED_MM", set())
    got = gpu_prefill.moe_forward_on_device(x, ids, weights, experts.packed)
    assert torch.device("cpu") in gpu_prefill._NO_GROUPED_MM
    assert rel_err(got, want) <= 1e-2

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(torch, "_grouped_mm", out_of_memory)
    monkeypatch.setattr(gpu_prefill, "_NO_GROUPED_MM", set())
    with pytest.raises(torch.OutOfMemoryError):  # not taken for a missing kernel
        gpu_prefill.moe_forward_on_device(x, ids, weights, experts.packed)
    assert not gpu_prefill._NO_GROUPED_MM


def _prefill_in_child(queue) -> None:
    torch.set_num_threads(1)  # torch's own OpenMP regions hang in a forked child (GNU OpenMP)
    experts = make_experts(4, 64, 48)
    ids, weights = random_routing(5, 4, 2)
    queue.put(gpu_prefill.moe_forward_on_device(torch.randn(5, 64), ids, weights, experts.packed).shape[0])


def test_a_forked_child_stages_on_its_own_thread() -> None:
    import multiprocessing

    experts = make_experts(4, 64, 48)
    ids, weights = random_routing(5, 4, 2)
    gpu_prefill.moe_forward_on_device(torch.randn(5, 64), ids, weights, experts.packed)  # the parent's thread
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_prefill_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the child's GPU-prefill call never finished (its staging queue had no thread)")
    assert child.exitcode == 0 and queue.get(timeout=5) == 5


def test_a_forked_child_does_not_wait_for_the_parents_staging() -> None:
    """The next layer's first chunk still being staged on the parent's thread when the
    process forks is never finished in the child (that thread is not there): the child's
    call on that layer stages it again instead of waiting forever for it."""
    code = """
import os, signal, sys, threading, torch
sys.path.insert(0, %r)
from conftest import make_experts, random_routing
from kt_ops import gpu_prefill
torch.set_num_threads(1)  # torch's own OpenMP regions hang in a forked child (GNU OpenMP)
first, second = make_experts(6, 64, 48), make_experts(6, 64, 48, seed=1)
x = torch.randn(8, 64)
ids, w = random_routing(8, 6, 2)
want = gpu_prefill.moe_forward_on_device(x, ids, w, second.packed)
release, real = threading.Event(), gpu_prefill._host_chunk
def held_back(packed, *args, **kwargs):
    if packed is second.packed:
        release.wait(30)
    return real(packed, *args, **kwargs)
gpu_prefill._host_chunk = held_back
gpu_prefill.moe_forward_on_device(x, ids, w, first.packed, next_layer=second.packed)  # second's chunk in flight
pid = os.fork()
if pid == 0:
    signal.alarm(30)
    gpu_prefill._host_chunk = real
    os._exit(0 if torch.equal(gpu_prefill.moe_forward_on_device(x, ids, w, second.packed), want) else 3)
release.set()
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
""" % os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "0", "the forked child hung (-14: killed by its alarm) or computed other bits"


def test_a_thread_outliving_the_main_thread_still_stages_chunks() -> None:
    """The staging thread's executor is shut down by the interpreter's exit before it joins
    the threads still running: a serving thread's next call raised "cannot schedule new
    futures after shutdown" from its chunk staging. It must still compute (on itself)."""
    code = """
import sys, threading, time
sys.path.insert(0, "tests")
import torch
from conftest import make_experts, random_routing
from kt_ops import gpu_prefill
experts = make_experts(8, 64, 48)
ids, weights = random_routing(9, 8, 2)
x = torch.randn(9, 64)
expected = gpu_prefill.moe_forward_on_device(x, ids, weights, experts.packed, chunk_bytes=1)
main_done = threading.Event()
def serve():
    assert main_done.wait(30)
    time.sleep(0.5)  # the main thread is in the interpreter's shutdown now
    for _ in range(2):
        out = gpu_prefill.moe_forward_on_device(x, ids, weights, experts.packed, chunk_bytes=1)
        assert torch.equal(out, expected)
    print("served", flush=True)
threading.Thread(target=serve).start()
main_done.set()
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0 and result.stdout.strip() == "served", result.stderr[-2000:]


# ---- the next layer's first chunk, staged ahead ---------------------------------------

@needs_gpu
def test_gpu_next_layer_staged_ahead_changes_no_bit() -> None:
    first, second = make_experts(6, 64, 48), make_experts(6, 64, 48, seed=1)
    x = torch.randn(40, 64, device="cuda").bfloat16()
    ids, weights = (t.cuda() for t in random_routing(40, 6, 2))
    chunk = 2 * second.packed.nbytes // 6
    want = gpu_prefill.moe_forward_on_device(x, ids, weights, second.packed, chunk_bytes=chunk)
    gpu_prefill.moe_forward_on_device(x, ids, weights, first.packed, chunk_bytes=chunk, next_layer=second.packed)
    assert id(second.packed.data) in gpu_prefill._PREFETCHED
    got = gpu_prefill.moe_forward_on_device(x, ids, weights, second.packed, chunk_bytes=chunk)
    assert id(second.packed.data) not in gpu_prefill._PREFETCHED
    assert torch.equal(got, want)


def test_the_next_layers_first_chunk_is_staged_ahead_and_taken(monkeypatch) -> None:
    """A call given ``next_layer`` stages that layer's first chunk (its lowest expert ids)
    in the background; the next layer's call takes it instead of staging it again and
    computes the same bits as without it, also when it routes to none of those experts;
    a chunk staged for another dtype or chunk size is dropped."""
    first, second = make_experts(6, 64, 48), make_experts(6, 64, 48, seed=1)
    staged: list[tuple[int, list[int]]] = []
    real = gpu_prefill._host_chunk
    monkeypatch.setattr(gpu_prefill, "_host_chunk",
                        lambda packed, experts, *rest, **kw: staged.append((id(packed.data), list(experts)))
                        or real(packed, experts, *rest, **kw))
    chunk = 2 * second.packed.nbytes // 6  # two experts a chunk
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(3))
    for ids in (random_routing(12, 6, 2)[0], torch.randint(2, 6, (12, 2), generator=torch.Generator().manual_seed(4))):
        weights = torch.rand(12, 2, generator=torch.Generator().manual_seed(5))
        want = gpu_prefill.moe_forward_on_device(x, ids, weights, second.packed, chunk_bytes=chunk)
        staged.clear()
        gpu_prefill.moe_forward_on_device(x, ids, weights, first.packed, chunk_bytes=chunk, next_layer=second.packed)
        got = gpu_prefill.moe_forward_on_device(x, ids, weights, second.packed, chunk_bytes=chunk)
        ahead = [experts for blob, experts in staged if blob == id(second.packed.data)]
        assert ahead[0] == [0, 1] and all(0 not in e and 1 not in e for e in ahead[1:])  # staged once, ahead
        assert torch.equal(got, want)
        assert id(second.packed.data) not in gpu_prefill._PREFETCHED  # taken
    for kind, kwargs in (("dtype", {}), ("chunk size", {"chunk_bytes": 1})):
        gpu_prefill.prefetch_first_chunk(second.packed, torch.bfloat16 if kind == "dtype" else torch.float32,
                                         x.device, chunk)
        staged.clear()
        got = gpu_prefill.moe_forward_on_device(x, ids, weights, second.packed, **({"chunk_bytes": chunk} | kwargs))
        assert [0] in [e for _, e in staged] or [0, 1] in [e for _, e in staged], kind  # staged again
        assert rel_err(got, want) <= 1e-6, kind


def test_the_threshold_links_the_layers_in_order(prefill_on_the_cpu) -> None:
    """set_gpu_prefill_token_threshold(prefetch_next_layer=True) links each kt_ops MoE
    layer to the next (module order; off by default, 0 unlinks), and a prefill call of a
    layer stages the next one's first chunk."""
    layers = torch.nn.ModuleList([dynamic_hybrid([0], dynamic=False) for _ in range(3)])
    assert kt_ops.set_gpu_prefill_token_threshold(layers, 4) == 3
    assert all(gpu_prefill.next_layer(layer) is None for layer in layers)
    kt_ops.set_gpu_prefill_token_threshold(layers, 4, prefetch_next_layer=True)
    packs = [gpu_prefill.next_layer(layer) for layer in layers]
    assert [p.data is layer.packed for p, layer in zip(packs[:2], layers[1:])] == [True, True] and packs[2] is None
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    with torch.no_grad():
        want = layers[1](x)
        layers[0](x)
        assert id(layers[1].packed) in gpu_prefill._PREFETCHED
        assert torch.equal(layers[1](x), want)
    kt_ops.set_gpu_prefill_token_threshold(layers, 0, prefetch_next_layer=True)
    assert all(gpu_prefill.next_layer(layer) is None for layer in layers)


# ---- KTMoEWrapper ------------------------------------------------------------------------

def prefill_wrapper(threadpool_count: int = 1, **kw) -> kt_ops.KTMoEWrapper:
    """E 8, K 3, H 64, I 64, BF16; slots 2 and 5 on the GPU; physical slot p holds logical
    expert 7 - p."""
    experts = make_experts(8, 64, 64, seed=2)
    mask = torch.zeros(8, dtype=torch.bool)
    mask[[2, 5]] = True
    wr = kt_ops.KTMoEWrapper(1, 8, 3, 64, 64, gpu_experts_mask=mask, method="BF16", threadpool_count=threadpool_count,
                             deferral_group=object(), **kw)
    wr.load_weights_from_tensors(experts.gate, experts.up, experts.down, physical_to_logical_map=torch.arange(8).flip(0))
    return wr


@pytest.mark.parametrize("threadpool_count", [1, 2])
def test_wrapper_prefill_computes_every_cpu_expert_at_once(prefill_on_the_cpu, threadpool_count: int) -> None:
    """KTMoEWrapper(gpu_prefill_token_threshold=N): a forward of at least N tokens takes
    the GPU-prefill path (forced on the CPU here) over every part, none of its experts
    deferred; shorter forwards keep the kernels' path, bit for bit; a bad id is refused."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(12, 64, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(12)])
    ids[0, 0] = -1
    w = torch.rand(12, 3, generator=g)
    plain = prefill_wrapper(threadpool_count)
    want = plain.forward(x, ids, w)
    for kw in ({}, {"max_deferred_experts_per_token": 1}):
        wr = prefill_wrapper(threadpool_count, gpu_prefill_token_threshold=8, **kw)
        got = wr.forward(x, ids, w)
        assert got.dtype == x.dtype and rel_err(got, want) <= 1e-2 and not torch.equal(got, want), kw
        assert (wr.deferral_group, 2) not in kt_ops.KTMoEWrapper._thread_pending()  # nothing deferred to layer 2
        if not kw:
            assert torch.equal(wr.forward(x[:7], ids[:7], w[:7]), plain.forward(x[:7], ids[:7], w[:7]))
    bad = ids.clone()
    bad[4, 2] = 8
    with pytest.raises(ValueError, match="topk_ids must be in"):
        prefill_wrapper(threadpool_count, gpu_prefill_token_threshold=8).forward(x, bad, w)


def test_wrapper_prefill_threshold_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("KT_OPS_GPU_PREFILL_TOKEN_THRESHOLD", "4096")
    assert prefill_wrapper().gpu_prefill_token_threshold == 4096
    assert prefill_wrapper(gpu_prefill_token_threshold=16).gpu_prefill_token_threshold == 16
    # The error names the variable the value came from: "-1" was refused as gpu_prefill_token_threshold, a
    # keyword the caller never passed.
    for value in ("many", "-1", "2.5"):
        monkeypatch.setenv("KT_OPS_GPU_PREFILL_TOKEN_THRESHOLD", value)
        with pytest.raises(ValueError, match=f"KT_OPS_GPU_PREFILL_TOKEN_THRESHOLD must be an int >= 0.*'{value}'"):
            prefill_wrapper()
    monkeypatch.delenv("KT_OPS_GPU_PREFILL_TOKEN_THRESHOLD")
    assert prefill_wrapper().gpu_prefill_token_threshold == 0


@needs_gpu
@pytest.mark.parametrize("threadpool_count", [1, 2])
def test_gpu_wrapper_prefill_matches_the_cpu_wrapper(threadpool_count: int) -> None:
    g = torch.Generator().manual_seed(10)
    x = torch.randn(40, 64, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(40)])
    w = torch.rand(40, 3, generator=g)
    want = prefill_wrapper(threadpool_count).forward(x, ids, w)
    wr = prefill_wrapper(threadpool_count, gpu_prefill_token_threshold=32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    got = wr.forward(x.cuda(), ids.cuda(), w.cuda(), stream)
    torch.cuda.current_stream().wait_stream(stream)
    assert got.device.type == "cuda" and got.dtype == torch.bfloat16
    assert rel_err(got.cpu(), want) <= 1e-2
