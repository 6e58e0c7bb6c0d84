"""Autograd of kt::moe_forward (issue 22, part 1): gradients w.r.t. hidden_states and
topk_weights for every packed format, activation variant and bias, against fp64 autograd
on the blob's dequantized weights; a finite-difference check in fp32 for BF16; live_tokens
and skipped slots; opcheck of kt::moe_backward; a compiled training step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kt_ops
from conftest import bf16_activations, make_experts, random_routing, rel_err
from format_cases import format_cases
from kt_ops import reference

CASES = format_cases(min_hidden=40, min_intermediate=24)


def glu64(g: torch.Tensor, u: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return g * torch.sigmoid(alpha * g) * (u + 1) if alpha > 0 else F.silu(g) * u


def fp64_forward(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, packed: torch.Tensor,
                 gate_up: torch.Tensor | None = None) -> torch.Tensor:
    """The layer in fp64 on the blob's dequantized weights (autograd does the backward).
    gate_up: moe_forward_train's [T, K, 2I]: g and u take those values (the kernel's), their
    gradients still those of x Wg^T + bg and x Wu^T + bu."""
    gate, up, down = (t.double() for t in reference.dequantize(packed))
    act = reference.activation_of(packed)
    biases = act["biases"] or (None, None, None)
    I = gate.shape[1]
    out = torch.zeros_like(x)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tokens, slots = torch.nonzero(ids == e, as_tuple=True)
        g, u = x[tokens] @ gate[e].T, x[tokens] @ up[e].T
        if biases[0] is not None:
            g = g + biases[0][e].double()
        if biases[1] is not None:
            u = u + biases[1][e].double()
        if gate_up is not None:
            saved = gate_up[tokens, slots].double()
            g = g + (saved[:, :I] - g).detach()
            u = u + (saved[:, I:] - u).detach()
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
    """Both backward paths against fp64 autograd: kt::moe_forward's (g and u recomputed in
    fp32: the ideal layer's gradient) and kt_ops.moe_forward's under autograd
    (kt::moe_forward_train: g and u saved by the kernel, the gradient at those values)."""
    info = kt_ops.PackedExperts(packed)
    E, H, I = info.num_experts, info.hidden_size, info.intermediate_size
    ids, w = random_routing(T, E, K, seed)
    ids[1, 0] = -1  # a skipped slot: no gradient for its weight
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed))
    probe = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        out, gate_up = torch.ops.kt.moe_forward_train(x, ids, w, packed, I)
        assert torch.equal(out, torch.ops.kt.moe_forward(x, ids, w, packed))
    assert gate_up.shape == (T, K, 2 * I) and gate_up.dtype == torch.float32
    assert gate_up[1, 0].abs().sum() == 0  # the skipped slot
    for fn, gu in ((lambda a, b: torch.ops.kt.moe_forward(a, ids, b, packed), None),
                   (lambda a, b: kt_ops.moe_forward(a, ids, b, packed), gate_up)):
        gx, gw = grads(fn, x, w, probe)
        rx, rw = grads(lambda a, b: fp64_forward(a, ids, b, packed, gu), x.double(), w.double(), probe)
        assert gx.dtype == x.dtype and gw.dtype == w.dtype
        assert rel_err(gx, rx.float()) <= bound, (gu is None, rel_err(gx, rx.float()))
        assert rel_err(gw, rw.float()) <= bound, (gu is None, rel_err(gw, rw.float()))
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


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_saved_gate_up_is_the_kernels_preactivation(case) -> None:
    """moe_forward_train's gate_up: each slot's g and u as the kernel's activation saw them,
    within the format's forward tolerance of the fp32 values on the dequantized weights."""
    experts = make_experts(4, case.hidden, case.intermediate, seed=7)
    packed = case.pack(experts.gate, experts.up, experts.down).data
    info = kt_ops.PackedExperts(packed)
    ids, w = random_routing(6, 4, 3, seed=7)
    x = torch.randn(6, case.hidden, generator=torch.Generator().manual_seed(8))
    _, gate_up = torch.ops.kt.moe_forward_train(x, ids, w, packed, info.intermediate_size)
    gate, up, _ = reference.dequantize(packed)
    want = torch.cat([torch.einsum("th,tkih->tki", x, gate[ids]), torch.einsum("th,tkih->tki", x, up[ids])], -1)
    assert rel_err(gate_up, want) <= 4e-2, rel_err(gate_up, want)


def test_gate_up_delta_is_added_before_the_activation_and_gets_the_gradient() -> None:
    """gate_up_delta shifts g and u before the activation (the LoRA hook); its gradient is
    the one w.r.t. g and u, checked against fp64 autograd."""
    experts = make_experts(4, 48, 24, seed=9)
    packed = experts.packed.data
    ids, w = random_routing(5, 4, 2, seed=9)
    g = torch.Generator().manual_seed(10)
    x, probe = torch.randn(5, 48, generator=g), torch.randn(5, 48, generator=g)
    delta = (torch.randn(5, 2, 48, generator=g) * 0.3).requires_grad_()
    out, gate_up = torch.ops.kt.moe_forward_train(x, ids, w, packed, 24, delta)
    _, plain = torch.ops.kt.moe_forward_train(x, ids, w, packed, 24)
    assert rel_err(gate_up, plain + delta.detach()) <= 1e-6
    (out * probe).sum().backward()
    got = delta.grad.clone()

    gate, up, down = (t.double() for t in reference.dequantize(packed))
    d64 = delta.detach().double().requires_grad_()
    ref = torch.zeros(5, 48, dtype=torch.float64)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            gg = x[t].double() @ gate[e].T + d64[t, j, :24]
            uu = x[t].double() @ up[e].T + d64[t, j, 24:]
            ref[t] = ref[t] + w[t, j].double() * (F.silu(gg) * uu) @ down[e].T
    (ref * probe.double()).sum().backward()
    bound = 1e-2 if bf16_activations() else 1e-4  # 1.7e-3 measured on amx (Xeon, 2026-11-26)
    assert rel_err(got, d64.grad.float()) <= bound, rel_err(got, d64.grad.float())


def test_forward_train_rejects_bad_arguments() -> None:
    experts = make_experts(4, 32, 16)
    ids, w = random_routing(3, 4, 2)
    x = torch.randn(3, 32)
    with pytest.raises(ValueError, match="intermediate_size = 17"):
        torch.ops.kt.moe_forward_train(x, ids, w, experts.packed.data, 17)
    with pytest.raises(ValueError, match=r"gate_up_delta must be \[T, K, 2 \* I\]"):
        torch.ops.kt.moe_forward_train(x, ids, w, experts.packed.data, 16, torch.zeros(3, 2, 16))
    with pytest.raises(ValueError, match="gate_up must be"):
        torch.ops.kt.moe_train_backward(x, x, ids, w, experts.packed.data, torch.zeros(3, 2, 16))


@pytest.mark.parametrize("value", ["False", 0, None])
def test_set_save_gate_up_refuses_what_is_not_a_bool(value) -> None:
    """set_save_gate_up("False") turned saving on (bool("False") is True), silently."""
    with pytest.raises(ValueError, match="save must be a bool"):
        kt_ops.autograd.set_save_gate_up(value)
    assert kt_ops.autograd._save_gate_up is True  # unchanged


def forward_saving(save: bool, *args: object) -> torch.Tensor:
    """``kt_ops.moe_forward(*args)`` with gate/up saved for backward (True) or recomputed."""
    kt_ops.autograd.set_save_gate_up(save)
    try:
        return kt_ops.moe_forward(*args)
    finally:
        kt_ops.autograd.set_save_gate_up(True)


def test_set_save_gate_up_false_recomputes() -> None:
    experts = make_experts(4, 32, 16)
    ids, w = random_routing(3, 4, 2)
    x = torch.randn(3, 32, requires_grad=True)
    kt_ops.autograd.set_save_gate_up(False)
    try:
        out = kt_ops.moe_forward(x, ids, w, experts.packed)
        assert "MoeForwardFunction" in out.grad_fn.name()  # csrc/ops/autograd.cpp
    finally:
        kt_ops.autograd.set_save_gate_up(True)
    out = kt_ops.moe_forward(x, ids, w, experts.packed)
    assert "kt_moe_forward_train_default" in str(out.grad_fn)
    with torch.no_grad():
        assert torch.equal(out, kt_ops.moe_forward(x, ids, w, experts.packed))


def test_finite_differences_bf16_fp32_inputs() -> None:
    """Directional derivatives of the BF16 kernel's own output (fp32 inputs) agree with
    the gradients: <grad_x, v> ~ (L(x + eps v) - L(x - eps v)) / 2 eps. On the avx2
    variant (every x86 CPU we run has it): variants that round activations to bf16 make the
    loss a step function on a 2^-8-relative grid, finer than no eps a difference can use
    (on amx: numeric 37.6 vs analytic 42.7 at eps = 1e-2)."""
    previous = kt_ops.cpu_variant()
    kt_ops.set_cpu_variant("avx2")
    try:
        _finite_differences_agree()
    finally:
        kt_ops.set_cpu_variant(previous)


def _finite_differences_agree() -> None:
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


@pytest.mark.parametrize("save", [True, False], ids=["saved", "recomputed"])
def test_rows_past_live_tokens_get_no_gradient(save: bool) -> None:
    experts = make_experts(4, 32, 16)
    ids, w = random_routing(6, 4, 2)
    x = torch.randn(6, 32, requires_grad=True)
    wr = w.clone().requires_grad_()
    out = forward_saving(save, x, ids, wr, experts.packed, torch.tensor([4]))
    out.sum().backward()
    assert x.grad[4:].abs().sum() == 0 and wr.grad[4:].abs().sum() == 0
    assert x.grad[:4].abs().sum() > 0


@pytest.mark.parametrize("save", [True, False], ids=["saved", "recomputed"])
@pytest.mark.parametrize("tokens,top_k", [(0, 2), (3, 0)], ids=["no-tokens", "no-slots"])
def test_a_call_that_routes_nothing_gets_zero_gradients(save: bool, tokens: int, top_k: int) -> None:
    """An empty batch (T = 0) or top-k 0: the backward gives zero gradients of the inputs'
    shapes (the saving path's backward used to fail viewing an empty [T, K, 2I] as
    [T * K, -1])."""
    experts = make_experts(4, 32, 16)
    x = torch.randn(tokens, 32, requires_grad=True)
    w = torch.rand(tokens, top_k, requires_grad=True)
    ids = torch.zeros(tokens, top_k, dtype=torch.int64)
    out = forward_saving(save, x, ids, w, experts.packed)
    out.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert x.grad.abs().sum() == 0 and w.grad.abs().sum() == 0


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
    _, gate_up = torch.ops.kt.moe_forward_train(x, ids, w, experts.packed.data, 32)
    torch.library.opcheck(torch.ops.kt.moe_train_backward.default,
                          (torch.randn(5, 48), x, ids, w, experts.packed.data, gate_up))
    torch.library.opcheck(torch.ops.kt.moe_forward_train.default,
                          (x.clone().requires_grad_(), ids, w.clone().requires_grad_(), experts.packed.data, 32))
    torch.library.opcheck(torch.ops.kt.moe_forward_train.default,
                          (x, ids, w, experts.packed.data, 32, torch.randn(5, 2, 64, requires_grad=True)))


@pytest.mark.parametrize("save", [True, False])
def test_double_backward_is_refused_not_silently_zero(save: bool) -> None:
    """A gradient penalty through the layer: the backward operators have no derivative,
    and torch's not-implemented fallback gave the penalty's graph no edge to the inputs
    (x.grad and w.grad None: a second derivative of zero, silently). Now an error."""
    experts = make_experts(4, 32, 16)
    ids, w = random_routing(3, 4, 2)
    x = torch.randn(3, 32, requires_grad=True)
    w = w.clone().requires_grad_()
    out = forward_saving(save, x, ids, w, experts.packed)
    grad_x, = torch.autograd.grad(out.sum(), x, create_graph=True)  # the first order still works
    with pytest.raises(RuntimeError, match="double backward"):
        grad_x.square().sum().backward()
    lora = kt_ops.LoraExperts(4, 32, 16, rank=2)
    grad_x, = torch.autograd.grad(lora(x, ids, w, experts.packed).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        grad_x.square().sum().backward()


@pytest.mark.parametrize("blob", ["tensor", "PackedExperts"])
def test_compiled_training_step_has_no_graph_break(blob: str) -> None:
    """A raw blob compiles through kt::moe_forward (recomputing backward), a PackedExperts
    through kt::moe_forward_train (saving): both without a graph break, both as eager."""
    experts = make_experts(4, 48, 32)
    ids, w = random_routing(5, 4, 2)
    linear = torch.nn.Linear(48, 48)
    x = torch.randn(5, 48)
    packed = experts.packed.data if blob == "tensor" else experts.packed

    def step(inp: torch.Tensor) -> torch.Tensor:
        return kt_ops.moe_forward(linear(inp), ids, w, packed).square().mean()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    compiled(x).backward()
    got = linear.weight.grad.clone()
    linear.weight.grad = None
    step(x).backward()
    bound = 1e-2 if bf16_activations() else 1e-5  # amx: 8e-4 measured (Xeon, 2026-11-26)
    assert rel_err(got, linear.weight.grad) <= bound


@pytest.mark.parametrize("op", ["moe_forward", "moe_forward_parts"])
def test_inference_ops_have_cpp_autograd_kernels(op: str) -> None:
    """An inference call runs no Python: the Autograd kernels of the inference ops are the
    C++ ones (a Python registration cost ~10 us per call), and inputs that need no gradient
    give an output without history."""
    table = torch._C._dispatch_dump(f"kt::{op}")
    autograd_rows = [line for line in table.splitlines() if line.startswith("Autograd[alias]")]
    assert len(autograd_rows) == 1 and "csrc/ops/autograd.cpp" in autograd_rows[0], table
    experts = make_experts(4, 32, 16)
    ids, w = random_routing(3, 4, 2)
    x = torch.randn(3, 32)
    out = torch.ops.kt.moe_forward(x, ids, w, experts.packed.data)
    assert out.grad_fn is None and not out.requires_grad


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
    bound = 1e-2 if bf16_activations() else 1e-5  # amx: 2.1e-3 measured (Xeon, 2026-11-26)
    assert rel_err(gx, rx) <= bound and rel_err(gw, rw) <= bound


@pytest.mark.parametrize("method", ["BF16", "AMXINT4"])
def test_gradients_do_not_depend_on_the_thread_count(method: str) -> None:
    """The backward runs one expert per job on the Engine's threads and adds their rows in
    expert order: the same bits with 1 or 2 threads (and enough experts to share)."""
    experts = make_experts(16, 256, 128, seed=11)
    packed = kt_ops.pack_experts(experts.gate, experts.up, experts.down, method=method)
    ids, w = random_routing(40, 16, 4, seed=11)
    g = torch.Generator().manual_seed(12)
    x, probe = torch.randn(40, 256, generator=g), torch.randn(40, 256, generator=g)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            for fn in (kt_ops.moe_forward, torch.ops.kt.moe_forward):  # saved, recomputed
                results.append(grads(lambda a, b: fn(a, ids, b, packed if fn is kt_ops.moe_forward else packed.data),
                                     x, w, probe))
    finally:
        torch.set_num_threads(before)
    for (gx, gw), (hx, hw) in zip(results[:2], results[2:]):
        assert torch.equal(gx, hx) and torch.equal(gw, hw)
