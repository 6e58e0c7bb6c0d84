"""The oracle (kt_ops.reference) against independent sources: transformers' own expert
modules and activations, decoders written here from the published specifications (OCP
MX, e4m3fn bits, compressed-tensors / GPTQ / AutoAWQ packing) element by element, and a
plain per-token loop. Plus the other direction: weights corrupted as a kernel bug would
corrupt them (a sign flip of one expert, gate and up swapped, a missing bias, a
transposed group scale) move the oracle's output far past the bounds the kernel tests use."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kt_ops

from conftest import rel_err
from kt_ops import reference

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # transformers' awq: column j is unpacked nibble AWQ_REVERSE_ORDER[j]


def wide_values(n: int, limit: float, g: torch.Generator) -> torch.Tensor:
    """``n`` fp32 values spread over [-3L, 3L], with -L, L, 0 and just past +-L among them."""
    v = (torch.rand(n, generator=g) * 6 - 3) * limit
    v[:6] = torch.tensor([-limit, limit, 0.0, limit * 1.001, -limit * 1.001, -3 * limit])
    return v


# ---- activations -----------------------------------------------------------------------------


def test_glu_matches_transformers_gpt_oss_gate() -> None:
    """gpt-oss: ``GptOssExperts._apply_gate`` (interleaved gate/up: even columns gate, odd up)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(num_local_experts=2, hidden_size=8, intermediate_size=4)
    module = GptOssExperts(config)
    g = torch.Generator().manual_seed(0)
    gate_up = wide_values(2 * 4096, config.swiglu_limit, g).reshape(-1, 64)
    want = module._apply_gate(gate_up)
    got = reference.glu(gate_up[:, 0::2], gate_up[:, 1::2], config.swiglu_limit, config.swiglu_alpha)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_glu_matches_transformers_deepseek_v4_and_minimax_m3_gates() -> None:
    """DeepSeek-V4's clamped SiLU-GLU and MiniMax-M3's alpha-SwiGLU (chunked gate | up)."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLExperts

    g = torch.Generator().manual_seed(1)
    v4 = DeepseekV4Experts(DeepseekV4Config(num_local_experts=2, hidden_size=8, intermediate_size=4,
                                            hidden_act="silu"))
    gate_up = wide_values(2 * 4096, v4.limit, g).reshape(-1, 64)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(reference.glu(gate, up, v4.limit), v4._apply_gate(gate_up), rtol=1e-6, atol=1e-6)

    m3 = MiniMaxM3VLExperts.__new__(MiniMaxM3VLExperts)  # only _apply_gate's two numbers are needed
    torch.nn.Module.__init__(m3)
    m3.swiglu_alpha, m3.swiglu_limit = 1.702, 7.0
    gate_up = wide_values(2 * 4096, 7.0, g).reshape(-1, 64)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(reference.glu(gate, up, 7.0, 1.702), m3._apply_gate(gate_up), rtol=1e-6, atol=1e-6)


def test_glu_plain_is_silu_times_up_and_keeps_nan() -> None:
    g = torch.Generator().manual_seed(2)
    gate, up = torch.randn(256, generator=g) * 20, torch.randn(256, generator=g)
    gate[0], up[1] = float("nan"), float("nan")
    want = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(reference.glu(gate, up), want, rtol=1e-6, atol=1e-6, equal_nan=True)
    for limit, alpha in ((7.0, 0.0), (7.0, 1.702)):
        out = reference.glu(gate, up, limit, alpha)
        assert out[:2].isnan().all() and out[2:].isfinite().all()


# ---- moe_forward -----------------------------------------------------------------------------


def per_token_loop(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor, limit: float = 0.0, alpha: float = 0.0,
                   biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The layer one (token, slot) at a time in float64, written from the models' definition."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            xt = x[t].double()
            g_, u_ = gate[e].double() @ xt, up[e].double() @ xt
            if biases is not None:
                g_, u_ = g_ + biases[0][e].double(), u_ + biases[1][e].double()
            if limit > 0:
                g_, u_ = torch.minimum(g_, torch.tensor(limit, dtype=torch.float64)), u_.clamp(-limit, limit)
            h = g_ * torch.sigmoid(alpha * g_) * (u_ + 1) if alpha > 0 else g_ * torch.sigmoid(g_) * u_
            y = down[e].double() @ h
            if biases is not None:
                y = y + biases[2][e].double()
            out[t] += float(weights[t, j]) * y
    return out.float()


def random_layer(E: int, H: int, I: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
            torch.randn(E, H, I, generator=g) / I**0.5)


def test_moe_forward_matches_a_per_token_loop_with_skipped_and_repeated_slots() -> None:
    """``-1`` slots add nothing, an expert named twice in a row adds twice, a token with
    every slot ``-1`` is zero; also with the gpt-oss activation and biases."""
    E, H, I, T = 5, 48, 40, 9
    gate, up, down = random_layer(E, H, I, 3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=g) * 2
    ids = torch.randint(0, E, (T, 3), generator=g, dtype=torch.int32)
    ids[0] = torch.tensor([2, 2, 2])
    ids[1] = torch.tensor([-1, 4, -1])
    ids[2] = -1
    weights = torch.rand(T, 3, generator=g) + 0.1
    biases = (torch.randn(E, I, generator=g), torch.randn(E, I, generator=g), torch.randn(E, H, generator=g))
    for limit, alpha, b in ((0.0, 0.0, None), (1.5, 0.0, None), (1.5, 1.702, biases), (0.0, 1.702, biases)):
        got = reference.moe_forward(x, ids, weights, gate, up, down, swiglu_limit=limit, swiglu_alpha=alpha, biases=b)
        want = per_token_loop(x, ids, weights, gate, up, down, limit, alpha, b)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[2], torch.zeros(H))


def test_moe_forward_matches_transformers_qwen3_moe_and_gpt_oss_experts() -> None:
    """The same weights through transformers' ``Qwen3MoeExperts`` (gate | up fused, routing
    weight after down) and ``GptOssExperts`` (interleaved, biased, alpha-SwiGLU)."""
    from transformers import GptOssConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    E, H, I, T, K = 4, 32, 24, 7, 2
    gate, up, down = random_layer(E, H, I, 5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, H, generator=g) * 3
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g) + 0.1

    qwen = Qwen3MoeExperts(Qwen3MoeConfig(num_experts=E, hidden_size=H, moe_intermediate_size=I))
    with torch.no_grad():
        qwen.gate_up_proj.copy_(torch.cat((gate, up), dim=1))
        qwen.down_proj.copy_(down)
        want = qwen(x, ids, weights)
    torch.testing.assert_close(reference.moe_forward(x, ids, weights, gate, up, down), want, rtol=1e-5, atol=1e-5)

    oss = GptOssExperts(GptOssConfig(num_local_experts=E, hidden_size=H, intermediate_size=I))
    gate_bias, up_bias, down_bias = torch.randn(E, I, generator=g), torch.randn(E, I, generator=g), torch.randn(E, H)
    with torch.no_grad():
        oss.gate_up_proj.copy_(torch.stack((gate, up), dim=2).reshape(E, 2 * I, H).transpose(1, 2))  # even gate, odd up
        oss.gate_up_proj_bias.copy_(torch.stack((gate_bias, up_bias), dim=2).reshape(E, 2 * I))
        oss.down_proj.copy_(down.transpose(1, 2))
        oss.down_proj_bias.copy_(down_bias)
        want = oss(x, ids, weights)
    got = reference.moe_forward(x, ids, weights, gate, up, down, swiglu_limit=oss.limit, swiglu_alpha=oss.alpha,
                                biases=(gate_bias, up_bias, down_bias))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


# ---- activation fake-quantization -------------------------------------------------------------


def test_fake_quantize_activations_is_symmetric_int8_with_ties_to_even() -> None:
    """Levels in [-127, 127] (never -128), one scale max|x| / 127 per row or block, ties
    (x * 127 / max|x| = n + 0.5) rounded to the even level as ``lrint`` does."""
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -127.0]])
    assert reference.fake_quantize_activations(x).tolist() == [[127.0, 0.0, 2.0, 2.0, -0.0, -2.0, -2.0, -127.0]]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 256, generator=g) * torch.logspace(-30, 30, 6)[:, None]
    for block in (0, 32, 256):
        rows = x.reshape(-1, block or 256)
        scale = rows.abs().amax(-1, keepdim=True).double() / 127
        levels = reference.fake_quantize_activations(x, block).reshape(rows.shape).double() / scale
        assert (levels - levels.round()).abs().max() < 1e-3 and levels.abs().max() <= 127 + 1e-3
        assert torch.equal(levels.abs().amax(-1).round(), torch.full((rows.shape[0],), 127.0, dtype=torch.float64))
        assert (levels - rows.double() / scale).abs().max() <= 0.5 + 1e-3


def test_fake_quantize_activations_takes_127_over_max_correctly_rounded_as_the_kernels() -> None:
    """The levels are ``lrint(x * inv)`` with ``inv = 127.0f / amax`` correctly rounded, as the
    kernels compute them (activation_quant.h, gguf_act.h). torch's ``127.0 / tensor`` is
    ``127 * (1 / tensor)``, one ulp off for about a quarter of the values: with max|x| =
    3.720703125 it gives 34.133331 instead of 34.133335, and x = -0.6884765625 (x * 127 /
    max|x| = -23.5 exactly) came out level -23 against the kernels' -24. fp16 activations
    hit such ties often enough that the int8/int4 kernels missed the tight bound by 10x
    (fuzz seed 2732: GPTQ_INT4, fp16 input, 1.1e-2 on one row)."""
    amax = np.float32(3.720703125)
    x = torch.tensor([[3.720703125, -0.6884765625, 1.1572265625, 0.6298828125, -0.8056640625]])
    levels = (reference.fake_quantize_activations(x) / (x.abs().max() / 127)).round()
    want = np.rint(x.numpy() * (np.float32(127.0) / amax))
    assert levels.tolist() == want.tolist() == [[127.0, -24.0, 40.0, 22.0, -28.0]]
    g = torch.Generator().manual_seed(11)
    rows = torch.randn(64, 96, generator=g).half().float()
    amaxes = rows.abs().amax(-1, keepdim=True).numpy()
    want = np.clip(np.rint(rows.numpy() * (np.float32(127.0) / amaxes)), -127, 127)
    got = (reference.fake_quantize_activations(rows) / torch.from_numpy(amaxes / np.float32(127.0))).round()
    assert np.array_equal(got.numpy(), want)
    # the kernels agree: one int8 expert on the tie row, against the tight reference
    w = torch.randn(3, 32, 32, generator=g).bfloat16() / 6
    packed = kt_ops.pack_experts(w[:1], w[1:2], w[2:].clone(), method="AMXINT8")
    xs = torch.zeros(1, 32)
    xs[0, :5] = x[0]
    ids, weights = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    dq = reference.dequantize(packed.data)
    tight = reference.moe_forward(xs, ids, weights, *dq, quantize_activations=True)
    out = kt_ops.moe_forward(xs, ids, weights, packed)
    assert float((out - tight).norm() / tight.norm()) <= 1e-5


# ---- scalar codes: e4m3fn, ue8m0, e2m1 ---------------------------------------------------------


def e4m3fn_from_bits(code: int) -> float:
    """OCP FP8 E4M3 (fn: no infinities, only S.1111.111 NaN), from the bits."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return math.nan
    return (-1.0) ** s * (math.ldexp(m / 8, -6) if e == 0 else math.ldexp(1 + m / 8, e - 7))


def test_every_e4m3fn_code_decodes_as_the_spec_says() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    torch_values = codes.view(torch.float8_e4m3fn).float()
    want = torch.tensor([e4m3fn_from_bits(c) for c in range(256)], dtype=torch.float32)
    torch.testing.assert_close(torch_values, want, rtol=0, atol=0, equal_nan=True)
    from checkpoint_helpers import e4m3_to_fp32

    torch.testing.assert_close(e4m3_to_fp32(codes), want, rtol=0, atol=0, equal_nan=True)
    assert torch_values.isnan().sum() == 2


def test_every_ue8m0_code_decodes_as_the_ocp_mx_spec_says() -> None:
    """``2^(e - 127)`` for 0..254 (2^-127 a subnormal fp32), 255 NaN."""
    got = reference.decode_ue8m0(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    want = torch.tensor([math.ldexp(1.0, e - 127) if e < 255 else math.nan for e in range(256)], dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_mxfp4_values_are_ocp_e2m1() -> None:
    """e2m1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; subnormal exponent 0."""
    for code in range(16):
        s, e, m = code >> 3, (code >> 1) & 3, code & 1
        value = (m / 2 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)) * (-1.0) ** s
        assert reference.MXFP4_VALUES[code] == value  # -0 == 0
    blocks = torch.zeros(1, 17, dtype=torch.uint8)
    blocks[0, 0] = 129  # 2^2
    blocks[0, 1:] = torch.arange(16, dtype=torch.uint8) | (torch.arange(16, dtype=torch.uint8).flip(0) << 4)
    w = reference.dequantize_mxfp4(blocks)[0]
    assert w[:16].tolist() == [4 * v for v in reference.MXFP4_VALUES]  # low nibbles: weights 0-15
    assert w[16:].tolist() == [4 * v for v in reversed(reference.MXFP4_VALUES)]  # high nibbles: 16-31


# ---- INT4 checkpoints: element-by-element unpackers written from the formats ---------------------


def nibble(word: int, i: int) -> int:
    return (word >> (4 * i)) & 0xF


def random_words(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """int32 words of random bits, sign bit included."""
    return torch.randint(0, 2**32, shape, generator=g, dtype=torch.int64).to(torch.int32)


def test_dequantize_rawint4_element_by_element() -> None:
    """compressed-tensors pack-quantized int4: value ``k`` of row ``n`` is bits 4 (k % 8) of
    ``weight_packed[n, k // 8]`` plus 8 (offset binary); ``W = (nib - 8) * scale[n, k // gs]``."""
    g = torch.Generator().manual_seed(8)
    N, K, gs = 6, 64, 16
    packed, scale = random_words((N, K // 8), g), torch.randn(N, K // gs, generator=g).bfloat16()
    want = torch.empty(N, K)
    for n in range(N):
        for k in range(K):
            want[n, k] = (nibble(int(packed[n, k // 8]) & 0xFFFFFFFF, k % 8) - 8) * float(scale[n, k // gs])
    assert torch.equal(reference.dequantize_rawint4(packed, scale), want)
    as_bytes = packed.view(torch.uint8).reshape(N, K // 2)  # byte k // 2: even k low nibble
    assert int(as_bytes[0, 0]) & 15 == nibble(int(packed[0, 0]) & 0xFFFFFFFF, 0)
    assert torch.equal(reference.dequantize_rawint4(as_bytes, scale), want)


@pytest.mark.parametrize("v2", [False, True])
def test_dequantize_gptq_element_by_element(v2: bool) -> None:
    """GPTQ: ``qweight[k // 8, n]`` nibble k % 8, ``qzeros[g, n // 8]`` nibble n % 8 storing
    ``z - 1`` (v1, AutoGPTQ's) or ``z`` (gptq_v2); a shuffled ``g_idx`` (desc_act) picks the group."""
    g = torch.Generator().manual_seed(9)
    K, N, gs = 64, 16, 16
    qweight, qzeros = random_words((K // 8, N), g), random_words((K // gs, N // 8), g)
    scales = torch.randn(K // gs, N, generator=g).half()
    g_idx = (torch.arange(K) // gs)[torch.randperm(K, generator=g)].to(torch.int32)
    want, want_sym = torch.empty(N, K), torch.empty(N, K)
    for k in range(K):
        for n in range(N):
            q = nibble(int(qweight[k // 8, n]) & 0xFFFFFFFF, k % 8)
            group = int(g_idx[k])
            z = nibble(int(qzeros[group, n // 8]) & 0xFFFFFFFF, n % 8) + (0 if v2 else 1)
            want[n, k] = (q - z) * float(scales[group, n])
            want_sym[n, k] = (q - 8) * float(scales[k // gs, n])
    got = reference.dequantize_gptq(qweight, scales, qzeros, g_idx, zero_offset=0 if v2 else 1)
    assert torch.equal(got, want)
    assert torch.equal(reference.dequantize_gptq(qweight, scales), want_sym)


def test_dequantize_awq_as_transformers_unpacks_it() -> None:
    """AutoAWQ GEMM: unpack nibbles 0..7 of each word in order, then reorder columns by
    ``AWQ_REVERSE_ORDER`` (transformers' ``reverse_awq_order``); ``W = (q - z) * s``, no offset."""
    g = torch.Generator().manual_seed(10)
    K, N, gs = 64, 16, 32
    qweight, qzeros = random_words((K, N // 8), g), random_words((K // gs, N // 8), g)
    scales = torch.randn(K // gs, N, generator=g).half()

    def unpack(words: torch.Tensor) -> torch.Tensor:  # [R, C] -> [R, 8 C]
        shifts = torch.arange(0, 32, 4)
        raw = ((words.to(torch.int64)[:, :, None] >> shifts) & 0xF).reshape(words.shape[0], -1)
        order = torch.arange(raw.shape[1]).view(-1, 8)[:, list(AWQ_REVERSE_ORDER)].reshape(-1)
        return raw[:, order]

    q, z = unpack(qweight), unpack(qzeros)
    want = ((q - z.repeat_interleave(gs, 0)).float() * scales.float().repeat_interleave(gs, 0)).t()
    assert torch.equal(reference.dequantize_awq(qweight, qzeros, scales), want)


# ---- the tolerances catch real bugs ---------------------------------------------------------------


def test_weight_corruptions_move_the_oracle_past_the_kernel_bounds() -> None:
    """Each corruption a kernel bug could make changes the layer's output by far more than
    the loosest bound the kernel tests accept against the plain oracle (3e-2, tests/test_gguf.py
    and tests/test_accuracy.py)."""
    E, H, I, T, K = 8, 256, 128, 32, 2
    gate, up, down = random_layer(E, H, I, 11)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, K, generator=g) + 0.1
    biases = (torch.randn(E, I, generator=g) * 0.3, torch.randn(E, I, generator=g) * 0.3,
              torch.randn(E, H, generator=g) * 0.3)
    activation = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}
    good = reference.moe_forward(x, ids, weights, gate, up, down, **activation, biases=biases)

    def flipped(w: torch.Tensor) -> torch.Tensor:
        w = w.clone()
        w[3] = -w[3]
        return w

    def scale_transposed(w: torch.Tensor, gs: int = 32) -> torch.Tensor:  # a group scale read [K/gs, N] as [N, K/gs]
        rows, k = w.shape[-2:]
        blocks = w.reshape(E, rows, k // gs, gs)
        scale = blocks.abs().amax(-1, keepdim=True) + 1e-6
        wrong = scale.reshape(E, k // gs, rows).transpose(1, 2).reshape(scale.shape)
        return (blocks / scale * wrong).reshape(w.shape)

    corrupted = {
        "down of one expert negated": (gate, up, flipped(down), biases),
        "gate and up swapped": (up, gate, down, biases),
        "down bias missing": (gate, up, down, (biases[0], biases[1], torch.zeros(E, H))),
        "up bias missing": (gate, up, down, (biases[0], torch.zeros(E, I), biases[2])),
        "gate group scales transposed": (scale_transposed(gate), up, down, biases),
        "down group scales transposed": (gate, up, scale_transposed(down), biases),
    }
    for name, (gt, u, d, b) in corrupted.items():
        err = rel_err(reference.moe_forward(x, ids, weights, gt, u, d, **activation, biases=b), good)
        assert err > 0.1, f"{name}: {err:.3g}"


def test_fake_quantize_names_an_unknown_format_whatever_the_row_length() -> None:
    """``ValueError`` for an unknown format; a row shorter than the group (64 < 128) was a
    RuntimeError from the grouping reshape before the format was looked at."""
    with pytest.raises(ValueError, match="unknown format 'int5'"):
        reference.fake_quantize(torch.randn(2, 64), "int5")
