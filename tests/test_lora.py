"""LoRA on every routed expert over a frozen packed base (issue 22, part 2):
kt::moe_lora_forward / kt::moe_lora_backward against fp64 autograd on the dequantized base
weights, for several formats, activation variants and biases; PEFT-style initialisation
(B = 0: the frozen layer); kt-kernel-style dropout; opcheck; a compiled training step; a
few optimizer steps that learn."""

from __future__ import annotations

import pytest
import torch

import kt_ops
from conftest import make_experts, random_routing, rel_err
from kt_ops import reference
from kt_ops.lora import LORA_NAMES
from test_autograd import glu64

E, H, I, R = 5, 64, 32, 4


def fp64_lora_forward(x, ids, w, packed, lora, scaling, gate_up=None):
    """gate_up: the operator's saved [T, K, 2I]: g and u take those values (the inference
    kernel's), their gradients those of the fp64 expressions."""
    gate, up, down = (t.double() for t in reference.dequantize(packed))
    act = reference.activation_of(packed)
    b = act["biases"] or (None, None, None)
    ga, gb, ua, ub, da, db = lora
    out = torch.zeros_like(x)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tokens, slots = torch.nonzero(ids == e, as_tuple=True)
        xe = x[tokens]
        g = xe @ gate[e].T + scaling * (xe @ ga[e].T) @ gb[e].T
        u = xe @ up[e].T + scaling * (xe @ ua[e].T) @ ub[e].T
        if b[0] is not None:
            g, u = g + b[0][e].double(), u + b[1][e].double()
        if gate_up is not None:
            saved = gate_up[tokens, slots].double()
            g = g + (saved[:, :I] - g).detach()
            u = u + (saved[:, I:] - u).detach()
        h = glu64(g, u, act["swiglu_limit"], act["swiglu_alpha"])
        d = h @ down[e].T + scaling * (h @ da[e].T) @ db[e].T
        if b[2] is not None:
            d = d + b[2][e].double()
        out = out.index_add(0, tokens, d * w[tokens, slots, None])
    return out


def random_lora(dtype=torch.float32, seed: int = 0) -> kt_ops.LoraExperts:
    lora = kt_ops.LoraExperts(E, H, I, rank=R, alpha=8.0, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in LORA_NAMES:  # B non-zero so every term matters
            p = getattr(lora, name)
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return lora


def pack(method: str, limit: float = 0.0, alpha: float = 0.0, biases: bool = False) -> torch.Tensor:
    experts = make_experts(E, H, I, seed=7)
    kwargs = {"AMXINT4": {"group_size": 32}, "LLAMAFILE": {"gguf_type": "Q8_0"}}.get(method, {})
    packed = kt_ops.pack_experts(experts.gate, experts.up, experts.down, method=method, **kwargs)
    if limit or alpha or biases:
        g = torch.Generator().manual_seed(8)
        b = (torch.randn(E, I, generator=g) * 0.1, torch.randn(E, I, generator=g) * 0.1,
             torch.randn(E, H, generator=g) * 0.1) if biases else None
        packed = kt_ops.set_activation(packed, limit, alpha, b)
    return packed.data


@pytest.mark.parametrize("method,limit,alpha,biases", [
    ("BF16", 0.0, 0.0, False), ("AMXINT8", 0.0, 0.0, False), ("AMXINT4", 0.3, 0.0, True),
    ("LLAMAFILE", 0.3, 1.702, True), ("FP8", 0.0, 1.702, False), ("BF16", 0.0, 0.0, True)])
def test_lora_gradients_match_fp64(method: str, limit: float, alpha: float, biases: bool) -> None:
    packed = pack(method, limit, alpha, biases)
    lora = random_lora()
    ids, w = random_routing(9, E, 2, seed=1)
    ids[2, 1] = -1
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
    w.requires_grad_()
    probe = torch.randn(9, H, generator=torch.Generator().manual_seed(3))
    out = lora(x, ids, w, packed)
    (out * probe).sum().backward()
    with torch.no_grad():
        mats32 = [getattr(lora, n) for n in LORA_NAMES]
        _, gate_up = torch.ops.kt.moe_lora_forward(x, ids, w, packed, *mats32, lora.scaling)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    mats = [getattr(lora, n).detach().double().requires_grad_() for n in LORA_NAMES]
    ref = fp64_lora_forward(x64, ids, w64, packed, mats, lora.scaling, gate_up)
    # the forward runs the inference kernel: within its format's error of the fp64 layer
    assert rel_err(out, fp64_lora_forward(x64, ids, w64, packed, mats, lora.scaling).float()) <= 4e-2
    (ref * probe.double()).sum().backward()
    assert rel_err(x.grad, x64.grad.float()) <= 1e-4
    assert rel_err(w.grad, w64.grad.float()) <= 1e-4
    for name, ref in zip(LORA_NAMES, mats):
        assert rel_err(getattr(lora, name).grad, ref.grad.float()) <= 1e-4, name


def test_peft_initialisation_is_the_frozen_layer() -> None:
    """B = 0 at initialisation: the LoRA layer computes the base layer (the inference kernel,
    bit for bit; the oracle within the format's error)."""
    packed = pack("AMXINT4")
    lora = kt_ops.LoraExperts(E, H, I, rank=R)
    ids, w = random_routing(6, E, 2)
    x = torch.randn(6, H)
    out = lora(x, ids, w, packed)
    gate, up, down = reference.dequantize(packed)
    assert torch.equal(out, kt_ops.moe_forward(x, ids, w, packed))
    assert rel_err(out, reference.moe_forward(x, ids, w, gate, up, down)) <= 4e-2
    assert all(getattr(lora, n).abs().sum() == 0 for n in ("gate_b", "up_b", "down_b"))


def test_dropout_masks_input_features_while_training() -> None:
    packed = pack("BF16")
    lora = random_lora()
    lora.dropout = 0.5
    ids, w = random_routing(6, E, 2)
    x = torch.randn(6, H)
    torch.manual_seed(0)
    a, b = lora(x, ids, w, packed), lora(x, ids, w, packed)
    assert not torch.equal(a, b)  # a new mask per call
    lora.eval()
    evaluated = lora(x, ids, w, packed)
    lora.dropout = 0.0
    assert torch.equal(evaluated, lora(x, ids, w, packed))  # eval: no dropout
    with pytest.raises(ValueError, match="dropout"):
        kt_ops.LoraExperts(E, H, I, dropout=1.0)
    with pytest.raises(ValueError, match="dropout"):
        kt_ops.LoraExperts(E, H, I, dropout="0.1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="alpha"):
        kt_ops.LoraExperts(E, H, I, alpha=True)  # was scaling 1 / rank, silently
    for dtype in (torch.int32, torch.float8_e4m3fn):  # were torch's RuntimeError / NotImplementedError
        with pytest.raises(ValueError, match="dtype must be one of"):
            kt_ops.LoraExperts(E, H, I, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dropout_scales_half_precision_parameters_by_exactly_one_over_keep(dtype: torch.dtype) -> None:
    """bf16/fp16 parameters: the kept features of A are A / (1 - p) in fp32, the dtype the products run in.
    The mask was built in the parameters' dtype: kept features were scaled by bf16(1 / 0.9) = 1.109375, not
    1.1111 (the training-time LoRA branch 0.16% smaller in expectation than the eval one), and each masked entry
    rounded to bf16 again (up to 0.5% off). The gradients still reach the parameters in their dtype."""
    packed = pack("BF16")
    lora = random_lora(dtype)
    lora.dropout = 0.1
    torch.manual_seed(0)
    mats = lora.matrices()
    for index in (0, 2, 4):
        a, want = mats[index], getattr(lora, LORA_NAMES[index]).detach().float() / 0.9
        kept = a != 0
        assert 0 < kept.sum() < a.numel()
        assert rel_err(a[kept], want[kept]) <= 1e-6, LORA_NAMES[index]
    ids, w = random_routing(6, E, 2)
    lora(torch.randn(6, H), ids, w, packed).square().sum().backward()
    for name in LORA_NAMES:
        grad = getattr(lora, name).grad
        assert grad is not None and grad.dtype == dtype and grad.abs().sum() > 0, name


def test_fp64_lora_parameters_run_as_fp32() -> None:
    """LoraExperts(dtype=torch.float64), which the constructor takes, runs (its products in fp32, as every dtype's):
    the fp32 layer's output, and fp64 gradients equal to the fp32 layer's (its forward was the kernel's TypeError
    "gate_a must have dtype Float, BFloat16, Half; got Double")."""
    packed = pack("BF16")
    lora32 = random_lora()
    lora64 = random_lora(torch.float64)
    ids, w = random_routing(6, E, 2)
    x = torch.randn(6, H)
    out32, out64 = lora32(x, ids, w, packed), lora64(x, ids, w, packed)
    assert out64.dtype == torch.float32 and torch.equal(out64, out32)
    out32.sum().backward()
    out64.sum().backward()
    for name in LORA_NAMES:
        grad = getattr(lora64, name).grad
        assert grad.dtype == torch.float64 and torch.equal(grad.float(), getattr(lora32, name).grad), name


def test_bad_lora_shapes_name_the_tensor() -> None:
    packed = pack("BF16")
    lora = random_lora()
    ids, w = random_routing(3, E, 2)
    mats = list(lora.matrices())
    mats[3] = mats[3][:, :, :2]
    with pytest.raises(ValueError, match="up_b must be"):
        kt_ops.moe_lora_forward(torch.randn(3, H), ids, w, packed, tuple(mats), 2.0)
    for scaling in (float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="scaling must be a finite number"):
            kt_ops.moe_lora_forward(torch.randn(3, H), ids, w, packed, lora.matrices(), scaling)
    with pytest.raises(ValueError, match="hidden size"):
        lora(torch.randn(3, H + 1), ids, w, packed)


@pytest.mark.parametrize("tokens,top_k", [(0, 2), (3, 0)], ids=["no-tokens", "no-slots"])
def test_a_lora_call_that_routes_nothing_gets_zero_gradients(tokens: int, top_k: int) -> None:
    """T = 0 or K = 0: zero gradients for the inputs and the six LoRA matrices (the
    backward used to fail viewing the empty saved gate and up as [T * K, -1])."""
    experts = make_experts(4, 32, 16)
    lora = kt_ops.LoraExperts(4, 32, 16, rank=4)
    x = torch.randn(tokens, 32, requires_grad=True)
    w = torch.rand(tokens, top_k, requires_grad=True)
    lora(x, torch.zeros(tokens, top_k, dtype=torch.int64), w, experts.packed).sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    for name in LORA_NAMES:
        grad = getattr(lora, name).grad
        assert grad is not None and grad.shape == getattr(lora, name).shape and grad.abs().sum() == 0


def test_opcheck_lora_operators() -> None:
    packed = pack("BF16")
    lora = random_lora()
    ids, w = random_routing(5, E, 2)
    x = torch.randn(5, H)
    mats = [getattr(lora, n).detach() for n in LORA_NAMES]
    torch.library.opcheck(torch.ops.kt.moe_lora_forward.default,
                          (x.requires_grad_(), ids, w, packed, *(m.clone().requires_grad_() for m in mats), 2.0))
    torch.library.opcheck(torch.ops.kt.moe_lora_backward.default,
                          (torch.randn(5, H), x.detach(), ids, w, packed, *mats, 2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_backward_fake_has_the_kernels_strides_for_strided_lora_matrices(dtype: torch.dtype) -> None:
    """The kernel's LoRA gradients take their matrices' strides (zeros_like of each, in fp32,
    cast back); the fake returned contiguous ones, so opcheck's fake-vs-real check failed
    for transposed (e.g. ``B^T`` stored) adapters and compiled code assumed wrong strides."""
    packed = pack("BF16")
    lora = random_lora()
    ids, w = random_routing(5, E, 2)
    mats = [getattr(lora, n).detach().to(dtype).transpose(1, 2).contiguous().transpose(1, 2) for n in LORA_NAMES]
    mats[0] = getattr(lora, LORA_NAMES[0]).detach().to(dtype).repeat(1, 1, 2)[:, :, ::2]  # not dense
    torch.library.opcheck(torch.ops.kt.moe_lora_backward.default,
                          (torch.randn(5, H), torch.randn(5, H), ids, w, packed, *mats, 2.0),
                          test_utils=("test_faketensor",))


def test_compiled_lora_training_step() -> None:
    packed = pack("AMXINT8")
    lora = random_lora()
    ids, w = random_routing(7, E, 2)
    x = torch.randn(7, H)

    def step(inp: torch.Tensor) -> torch.Tensor:
        return lora(inp, ids, w, packed).square().mean()

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True)(x).backward()
    got = {n: getattr(lora, n).grad.clone() for n in LORA_NAMES}
    lora.zero_grad()
    step(x).backward()
    for n in LORA_NAMES:
        assert rel_err(got[n], getattr(lora, n).grad) <= 1e-5, n


def test_compiled_lora_training_step_with_dynamic_shapes() -> None:
    """fullgraph=True with dynamic=True: the layer's scaling (alpha / rank) is traced as a
    SymFloat there, whose math.isfinite check was a graph break; one trace for all batch
    sizes, gradients those of eager."""
    packed = pack("BF16")
    lora = random_lora()

    def step(inp: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return lora(inp, ids, w, packed).square().mean()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    for tokens in (3, 6, 11):
        ids, w = random_routing(tokens, E, 2, seed=tokens)
        x = torch.randn(tokens, H)
        lora.zero_grad()
        with torch._dynamo.config.patch(error_on_recompile=tokens > 3):
            compiled(x, ids, w).backward()
        got = {n: getattr(lora, n).grad.clone() for n in LORA_NAMES}
        lora.zero_grad()
        step(x, ids, w).backward()
        for n in LORA_NAMES:
            assert rel_err(got[n], getattr(lora, n).grad) <= 1e-5, (tokens, n)


def test_adamw_steps_fit_a_target() -> None:
    """The base frozen, 20 AdamW steps on the LoRA matrices move the layer toward a target
    made by other LoRA weights (the loss falls by more than half)."""
    packed = pack("AMXINT4")
    ids, w = random_routing(16, E, 2, seed=4)
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        target = random_lora(seed=9)(x, ids, w, packed)
    lora = kt_ops.LoraExperts(E, H, I, rank=R, alpha=8.0)
    optimizer = torch.optim.AdamW(lora.parameters(), lr=2e-2)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = (lora(x, ids, w, packed) - target).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses



@pytest.mark.parametrize("threads", [3, 8])
def test_lora_steps_on_more_threads_than_cores(threads: int) -> None:
    """The LoRA forward and backward run their per-expert ATen ops on the engine's threads
    under the caller's thread-local state (autograd off there, as on the caller). With
    autograd on in the workers, the in-place adds of two experts' gradients raced: "a leaf
    Variable that requires grad is being used in an in-place operation" in 2-50% of the
    calls (seen with 16 threads on a 16-core Xeon, 3 and 8 on 2 cores). 100 steps; the
    gradients are the same bits as on one thread."""
    packed = pack("AMXINT4")
    ids, w = random_routing(16, E, 2, seed=2)
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(3))

    def grads() -> dict[str, torch.Tensor]:
        lora = random_lora(seed=4)
        for _ in range(100):
            lora.zero_grad()
            lora(x, ids, w, packed).square().mean().backward()
        return {n: getattr(lora, n).grad.clone() for n in LORA_NAMES}

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = grads()
        torch.set_num_threads(threads)
        got = grads()
    finally:
        torch.set_num_threads(previous)
    for name in LORA_NAMES:
        assert torch.equal(got[name], want[name]), name
