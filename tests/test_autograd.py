"""Autograd of kt::moe_forward (issue 22, part 1): gradients w.r.t. hidden_states and
topk_weights for every packed format, activation variant and bias, against fp64 autograd
on the blob's dequantized weights; a finite-difference check in fp32 for BF16; live_tokens
and skipped slots; opcheck of kt::moe_backward; a compiled training step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kt_ops
from conftest import make_experts, random_routing, rel_err
from format_cases import format_cases
from kt_ops import reference

CASES = format_cases(min_hidden=40, min_intermediate=24)


def glu64(g: torch.Tensor, u: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return g * torch.sigmoid(alpha * g) * (u + 1) if alpha > 0 else F.silu(g) * u


def fp64_forward(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """The layer in fp64 on the blob's dequantized weights (autograd does the backward)."""
    gate, up, down = (t.double() for t in reference.dequantize(packed))
    act = reference.activation_of(packed)
    biases = act["biases"] or (None, None, None)
    out = torch.zeros_like(x)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tokens, slots = torch.nonzero(ids == e, as_tuple=True)
        g, u = x[tokens] @ gate[e].T, x[tokens] @ up[e].T
        if biases[0] is not None:
            g = g + biases[0][e].double()
        if biases[1] is not None:
            u = u + biases[1][e].double()
        y = glu64(g, u, act["swiglu_limit"], act["swiglu_alpha"]) @ down[e].T
        if biases[2] is not None:
            y = y + biases[2][e].double()
        out = out.index_add(0, tokens, y * w[tokens, slots, None])
    return out


def grads(fn, x: torch.Tensor, w: torch.Tensor, probe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (fn(x, w) * probe.to(x.dtype)).sum().backward()
    return x.grad, w.grad


def check(packed: torch.Tensor, T: int = 7, K: int = 2, bound: float = 1e-4, seed: int = 0) -> None:
    info = kt_ops.PackedExperts(packed)
    E, H = info.num_experts, info.hidden_size
    ids, w = random_routing(T, E, K, seed)
    ids[1, 0] = -1  # a skipped slot: no gradient for its weight
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed))
    probe = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1))
    gx, gw = grads(lambda a, b: kt_ops.moe_forward(a, ids, b, packed), x, w, probe)
    rx, rw = grads(lambda a, b: fp64_forward(a, ids, b, packed), x.double(), w.double(), probe)
    assert gx.dtype == x.dtype and gw.dtype == w.dtype
    assert rel_err(gx, rx.float()) <= bound, rel_err(gx, rx.float())
    assert rel_err(gw, rw.float()) <= bound, rel_err(gw, rw.float())
    assert gw[1, 0] == 0


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gradients_match_fp64_on_the_dequantized_weights(case) -> None:
    experts = make_experts(4, case.hidden, case.intermediate)
    check(case.pack(experts.gate, experts.up, experts.down).data)


@pytest.mark.parametrize("method", ["BF16", "AMXINT4", "LLAMAFILE"])
@pytest.mark.parametrize("limit,alpha", [(0.0, 0.0), (0.3, 0.0), (0.3, 1.702), (0.0, 1.702)])
def test_activation_variants_and_biases(method: str, limit: float, alpha: float) -> None:
    """DeepSeek-V4's clamp and gpt-oss's alpha-SwiGLU (a limit small enough that the clamps
    bite), with gate/up/down biases."""
    experts = make_experts(5, 64, 32, seed=3)
    kwargs = {"gguf_type": "Q8_0"} if method == "LLAMAFILE" else ({"group_size": 32} if method == "AMXINT4" else {})
    packed = kt_ops.pack_experts(experts.gate, experts.up, experts.down, method=method, **kwargs)
    g = torch.Generator().manual_seed(4)
    biases = (torch.randn(5, 32, generator=g) * 0.1, torch.randn(5, 32, generator=g) * 0.1,
              torch.randn(5, 64, generator=g) * 0.1)
    check(kt_ops.set_activation(packed, limit, alpha, biases).data, T=9)


def test_finite_differences_bf16_fp32_inputs() -> None:
    """Directional derivatives of the BF16 kernel's own output (fp32 inputs) agree with
    the gradients: <grad_x, v> ~ (L(x + eps v) - L(x - eps v)) / 2 eps."""
    experts = make_experts(4, 96, 48, seed=5)
    ids, w = random_routing(6, 4, 2, seed=5)
    g = torch.Generator().manual_seed(6)
    x, probe = torch.randn(6, 96, generator=g), torch.randn(6, 96, generator=g)

    def loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (kt_ops.moe_forward(a, ids, b, experts.packed) * probe).sum()

    gx, gw = grads(lambda a, b: kt_ops.moe_forward(a, ids, b, experts.packed), x, w, probe)
    for seed in range(3):
        vx = torch.randn(6, 96, generator=torch.Generator().manual_seed(10 + seed))
        vw = torch.randn(6, 2, generator=torch.Generator().manual_seed(20 + seed))
        eps = 1e-2
        with torch.no_grad():
            numeric = (loss(x + eps * vx, w + eps * vw) - loss(x - eps * vx, w - eps * vw)) / (2 * eps)
        analytic = (gx * vx).sum() + (gw * vw).sum()
        assert abs(float(numeric - analytic)) <= 2e-2 * abs(float(analytic)) + 1e-3


def test_rows_past_live_tokens_get_no_gradient() -> None:
    experts = make_experts(4, 32, 16)
    ids, w = random_routing(6, 4, 2)
    x = torch.randn(6, 32, requires_grad=True)
    wr = w.clone().requires_grad_()
    out = kt_ops.moe_forward(x, ids, wr, experts.packed, torch.tensor([4]))
    out.sum().backward()
    assert x.grad[4:].abs().sum() == 0 and wr.grad[4:].abs().sum() == 0
    assert x.grad[:4].abs().sum() > 0


def test_bf16_inputs_get_bf16_gradients() -> None:
    experts = make_experts(4, 32, 16)
    ids, w = random_routing(5, 4, 2)
    x = torch.randn(5, 32).bfloat16().requires_grad_()
    wr = w.bfloat16().requires_grad_()
    kt_ops.moe_forward(x, ids, wr, experts.packed).float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and wr.grad.dtype == torch.bfloat16


def test_opcheck_moe_backward_and_forward_with_grad() -> None:
    experts = make_experts(4, 48, 32)
    ids, w = random_routing(5, 4, 2)
    x = torch.randn(5, 48)
    torch.library.opcheck(torch.ops.kt.moe_backward.default, (torch.randn(5, 48), x, ids, w, experts.packed.data))
    torch.library.opcheck(torch.ops.kt.moe_forward.default,
                          (x.clone().requires_grad_(), ids, w.clone().requires_grad_(), experts.packed.data))


def test_compiled_training_step_has_no_graph_break() -> None:
    experts = make_experts(4, 48, 32)
    ids, w = random_routing(5, 4, 2)
    linear = torch.nn.Linear(48, 48)
    x = torch.randn(5, 48)

    def step(inp: torch.Tensor) -> torch.Tensor:
        return kt_ops.moe_forward(linear(inp), ids, w, experts.packed.data).square().mean()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    compiled(x).backward()
    got = linear.weight.grad.clone()
    linear.weight.grad = None
    step(x).backward()
    assert rel_err(got, linear.weight.grad) <= 1e-5


def test_parts_backward_is_the_sum_of_the_parts() -> None:
    """moe_forward_parts (threadpool_count parts over I) differentiates like the whole layer."""
    experts = make_experts(4, 48, 64, seed=2)
    whole = kt_ops.pack_experts(experts.gate, experts.up, experts.down, method="BF16")
    parts = [kt_ops.pack_experts(experts.gate[:, a:b], experts.up[:, a:b], experts.down[:, :, a:b].contiguous(),
                                 method="BF16") for a, b in ((0, 32), (32, 64))]
    ids, w = random_routing(6, 4, 2)
    probe = torch.randn(6, 48)
    x = torch.randn(6, 48)
    gx, gw = grads(lambda a, b: kt_ops.moe_forward_parts(a, ids, b, parts, [0, 0]), x, w, probe)
    rx, rw = grads(lambda a, b: kt_ops.moe_forward(a, ids, b, whole), x, w, probe)
    assert rel_err(gx, rx) <= 1e-5 and rel_err(gw, rw) <= 1e-5
