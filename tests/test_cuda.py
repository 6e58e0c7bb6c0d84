"""The CUDA side of kt::moe_forward, kt::moe_forward_parts and HybridMoE.

Runs everywhere: live_tokens on the CPU key, and tracing the hybrid layer with fake CUDA
tensors (the fake implementation handles CUDA inputs with packed weights on the CPU).
Needs a GPU and a build with the CUDA key (skipped otherwise, with the reason): eager
CUDA calls against the CPU key, CUDA graph capture and replay at two batch sizes with a
live batch size, the side-stream overlap with GPU experts, host-function errors,
bounded pinned memory, the op kept once per layer under torch.compile, and the parts
operator's CUDA key (bit-equal to its CPU key, its parts run at once, opcheck, errors).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import kt_ops
import kt_ops.cuda
from conftest import make_experts, random_routing

E, H, I = 8, 64, 32


def hybrid_layer(gpu_experts: int = 2, shared: bool = True, seed: int = 0) -> kt_ops.HybridMoE:
    generator = torch.Generator().manual_seed(seed)
    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.1).to(torch.bfloat16)
    return kt_ops.HybridMoE(
        rand(E, H) * 10, rand(E, I, H), rand(E, I, H), rand(E, H, I), kt_ops.Routing(2, norm_topk_prob=True),
        gpu_experts_mask=torch.arange(E) < gpu_experts,
        shared_experts=torch.nn.Linear(H, H, bias=False).to(torch.bfloat16) if shared else None,
    )


# ---- everywhere ----------------------------------------------------------------------

def test_live_tokens_computes_only_the_live_rows() -> None:
    experts = make_experts(E, H, I)
    ids, weights = random_routing(9, E, 2)
    x = torch.randn(9, H)
    full = kt_ops.moe_forward(x, ids, weights, experts.packed)
    for live in (0, 4, 9):
        out = kt_ops.moe_forward(x, ids, weights, experts.packed, torch.tensor([live], dtype=torch.int32))
        torch.testing.assert_close(out[:live], full[:live], rtol=0, atol=0)
        assert not out[live:].any()
    with pytest.raises(ValueError, match=r"live_tokens = 10 is outside \[0, 9\]"):
        kt_ops.moe_forward(x, ids, weights, experts.packed, torch.tensor([10]))
    with pytest.raises(TypeError, match="live_tokens"):
        kt_ops.moe_forward(x, ids, weights, experts.packed, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="one value"):
        kt_ops.moe_forward(x, ids, weights, experts.packed, torch.tensor([1, 2]))
    torch.library.opcheck(torch.ops.kt.moe_forward.default,
                          (x, ids, weights, experts.packed.data, torch.tensor([5], dtype=torch.int64)))


def test_live_tokens_layer_matches_forward_on_the_live_rows() -> None:
    layer = hybrid_layer()
    x = torch.randn(6, H, dtype=torch.bfloat16)
    with torch.no_grad():
        full = layer(x)
        padded = layer(x, torch.tensor([4]))
        weights, ids = layer.route(x)
        local = layer._local_experts(x, ids, weights)
    torch.testing.assert_close(padded[:4], full[:4], rtol=0, atol=0)
    torch.testing.assert_close(padded[4:], local[4:], rtol=0, atol=0)


def test_live_tokens_given_as_an_int() -> None:
    """HybridMoE(x, live_tokens=4) with a Python or numpy int reached the operator's schema: a
    RuntimeError "Expected a value of type 'Optional[Tensor]'". An int is now taken as the
    int64 tensor [1] on the input's device; a float or a bool is a TypeError naming it."""
    layer = hybrid_layer()
    x = torch.randn(6, H, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = layer(x, torch.tensor([4]))
        for live in (4, np.int64(4), np.int32(4)):
            torch.testing.assert_close(layer(x, live), expected, rtol=0, atol=0)
        for bad in (4.0, True, "4"):
            with pytest.raises(TypeError, match="live_tokens"):
                layer(x, bad)
        with pytest.raises(ValueError, match=r"live_tokens = 7 is outside \[0, 6\]"):  # the operator's range check
            layer(x, 7)


@pytest.mark.parametrize("gpu_experts", [2, E])
def test_int_live_tokens_out_of_range(gpu_experts: int) -> None:
    """An int live_tokens outside [0, T] is a ValueError naming it, also when every expert is on
    the GPU: no operator runs there, and -1 or 7 went through silently."""
    layer = hybrid_layer(gpu_experts=gpu_experts)
    x = torch.randn(6, H, dtype=torch.bfloat16)
    with torch.no_grad():
        for bad in (-1, 7, np.int64(7)):
            with pytest.raises(ValueError, match=rf"live_tokens = {int(bad)} is outside \[0, 6\]"):
                layer(x, bad)
        torch.testing.assert_close(layer(x, 6), layer(x), rtol=0, atol=0)
        layer(x, 0)


def test_hidden_states_that_are_not_a_tensor_are_named() -> None:
    """HybridMoE(x) with x a list or numpy array is a TypeError naming hidden_states (was an AttributeError:
    "'list' object has no attribute 'shape'")."""
    layer = hybrid_layer()
    x = torch.randn(6, H)
    for bad in (x.tolist(), x.numpy()):
        with pytest.raises(TypeError, match="hidden_states must be a torch.Tensor"):
            layer(bad)


def test_fake_cuda_trace_of_the_hybrid_layer() -> None:
    """make_fx over fake CUDA tensors: routing, GPU and shared experts on CUDA, one
    kt.moe_forward taking CUDA activations and the host-resident packed experts."""
    layer = hybrid_layer()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        state = {name: (t if name == "packed" else torch.empty(t.shape, dtype=t.dtype, device="cuda"))
                 for name, t in {**dict(layer.named_parameters()), **dict(layer.named_buffers())}.items()}
        x = torch.empty(5, H, dtype=torch.bfloat16, device="cuda")
        graph = make_fx(lambda x: torch.func.functional_call(layer, state, (x,)), tracing_mode="real")(x)
        out = graph(x)
    assert out.device.type == "cuda" and out.shape == (5, H) and out.dtype == torch.bfloat16
    calls = [n for n in graph.graph.nodes if n.target == torch.ops.kt.moe_forward.default]
    assert len(calls) == 1
    hidden, ids, weights, packed = (arg.meta["val"] for arg in calls[0].args[:4])
    assert hidden.device.type == ids.device.type == weights.device.type == "cuda"
    assert packed.device.type == "cpu" and packed.dtype == torch.uint8
    assert calls[0].meta["val"].device.type == "cuda"
    assert any(n.target == torch.ops.aten.sigmoid.default or "einsum" in str(n.target) or "bmm" in str(n.target)
               for n in graph.graph.nodes)


def test_cuda_build_status_is_reported() -> None:
    assert isinstance(kt_ops.cuda.is_built(), bool)
    if not kt_ops.cuda.is_built():
        with pytest.raises(RuntimeError, match="no CUDA key"):
            kt_ops.cuda.reserve_cuda_graph_buffers([1], H, 2)
        assert kt_ops.cuda.pinned_staging_bytes() == 0
        assert kt_ops.cuda.captured_host_calls() == 0


# ---- on a GPU ------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not kt_ops.cuda.is_built(),
    reason="needs a GPU (torch.cuda.is_available() is False here) and kt_ops built with its CUDA key",
)


@needs_gpu
def test_cuda_eager_matches_the_cpu_key() -> None:
    experts = make_experts(E, H, I)
    for tokens in (1, 7, 33):
        ids, weights = random_routing(tokens, E, 2)
        x = torch.randn(tokens, H, dtype=torch.bfloat16)
        expected = kt_ops.moe_forward(x, ids, weights, experts.packed)
        actual = kt_ops.moe_forward(x.cuda(), ids.cuda(), weights.cuda(), experts.packed)
        assert actual.device.type == "cuda"
        torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0)


@needs_gpu
def test_cuda_call_does_not_block_the_python_thread() -> None:
    experts = make_experts(E, 256, 512)
    ids, weights = random_routing(64, E, 2)
    x = torch.randn(64, 256, device="cuda")
    ids, weights = ids.cuda(), weights.cuda()
    torch.cuda._sleep(200_000_000)  # the stream is busy: the op must only enqueue
    out = kt_ops.moe_forward(x, ids, weights, experts.packed)
    assert not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), kt_ops.moe_forward(x.cpu(), ids.cpu(), weights.cpu(), experts.packed))


@needs_gpu
def test_cuda_graph_capture_and_replay_at_two_batch_sizes() -> None:
    layer = hybrid_layer().cuda()
    layer.set_capture_batch_sizes([4, 8])
    graphs = {}
    for size in (4, 8):
        static_x = torch.zeros(size, H, dtype=torch.bfloat16, device="cuda")
        live = torch.tensor([size], dtype=torch.int32, device="cuda")
        with torch.no_grad():
            layer(static_x, live)  # warm-up (allocations) outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = layer(static_x, live)
        graphs[size] = (graph, static_x, live, static_out)
    for step in range(3):
        for size, (graph, static_x, live, static_out) in graphs.items():
            x = torch.randn(size, H, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(step * 10 + size))
            n = size - step  # fewer live tokens than captured
            static_x.copy_(x.cuda())
            live.fill_(n)
            held = kt_ops.cuda.pinned_staging_bytes()
            graph.replay()
            torch.cuda.synchronize()
            assert kt_ops.cuda.pinned_staging_bytes() == held  # replay allocates nothing
            with torch.no_grad():
                expected = layer(x[:n].cuda())
            torch.testing.assert_close(static_out[:n], expected, rtol=1e-2, atol=1e-2)


@needs_gpu
def test_captured_host_calls_are_freed_with_their_graph() -> None:
    import gc
    import time

    layer = hybrid_layer().cuda()
    layer.set_capture_batch_sizes([2])
    x = torch.zeros(2, H, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        layer(x)
    torch.cuda.synchronize()
    before = kt_ops.cuda.captured_host_calls()
    for _ in range(3):  # capture, replay, drop: the count returns each time
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            layer(x)
        assert kt_ops.cuda.captured_host_calls() == before + 1
        graph.replay()
        torch.cuda.synchronize()
        del graph
        gc.collect()
        deadline = time.monotonic() + 5  # CUDA runs user-object destructors on its own thread
        while kt_ops.cuda.captured_host_calls() != before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert kt_ops.cuda.captured_host_calls() == before


@needs_gpu
def test_capture_without_reserved_buffers_says_what_to_do() -> None:
    layer = hybrid_layer().cuda()
    x = torch.zeros(3, H, dtype=torch.bfloat16, device="cuda")
    live = torch.tensor([3], device="cuda")
    with torch.no_grad():
        layer(x, live)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(Exception, match="reserve_cuda_graph_buffers"):
        with torch.cuda.graph(graph), torch.no_grad():
            layer(x, live)


@needs_gpu
def test_side_stream_overlap_with_gpu_experts_matches_cpu() -> None:
    layer = hybrid_layer(gpu_experts=3)
    x = torch.randn(10, H, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = layer(x)
        layer.cuda()
        assert layer.packed.device.type == "cpu" and layer.gpu_gate_up.device.type == "cuda"
        actual = layer(x.cuda())
        layer.overlap = False
        serial = layer(x.cuda())
    torch.testing.assert_close(actual, serial, rtol=0, atol=0)
    torch.testing.assert_close(actual.cpu(), expected, rtol=2e-2, atol=2e-2)


@needs_gpu
def test_host_function_errors_are_raised_on_the_next_call() -> None:
    experts = make_experts(E, H, I)
    x = torch.randn(2, H, device="cuda")
    weights = torch.ones(2, 2, device="cuda")
    bad = torch.tensor([[0, E + 3], [1, 2]], device="cuda")
    out = kt_ops.moe_forward(x, bad, weights, experts.packed)  # the check runs on the host thread
    torch.cuda.synchronize()
    assert not out.any()
    with pytest.raises(RuntimeError, match=r"topk_ids\[0, 1\] = 11 is outside"):
        kt_ops.cuda.raise_pending_error()
    kt_ops.moe_forward(x, bad.clamp(max=E - 1), weights, experts.packed)  # error consumed


@needs_gpu
def test_cuda_parts_match_the_cpu_key() -> None:
    """kt::moe_forward_parts on CUDA activations: the CPU key's result bit for bit, each
    part run by the engine on its node (its record), opcheck, and a bad id zeroing the
    output and raised on the next call, named by the operator."""
    from kt_ops._native import _C
    from kt_ops.numa import resolve_nodes
    from kt_ops.parts import pack_parts

    experts = make_experts(E, H, I)
    parts = pack_parts(experts.gate, experts.up, experts.down, "BF16", 2)
    nodes = resolve_nodes(None, 2)
    for tokens, dtype in ((1, torch.bfloat16), (9, torch.float32), (33, torch.float16)):
        ids, weights = random_routing(tokens, E, 2, seed=tokens)
        x = torch.randn(tokens, H).to(dtype)
        expected = kt_ops.ops.moe_forward_parts(x, ids, weights, parts, nodes)
        actual = kt_ops.ops.moe_forward_parts(x.cuda(), ids.cuda(), weights.cuda(), parts, nodes)
        assert actual.device.type == "cuda" and actual.dtype == dtype
        torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0)
        assert [run[0] for run in _C.last_parts()] == nodes
        torch.library.opcheck(torch.ops.kt.moe_forward_parts.default,
                              (x.cuda(), ids.cuda(), weights.cuda(), [p.data for p in parts], nodes))
    bad = torch.tensor([[0, E + 3], [1, 2]], device="cuda")
    out = kt_ops.ops.moe_forward_parts(torch.randn(2, H, device="cuda"), bad, torch.ones(2, 2, device="cuda"),
                                       parts, nodes)
    torch.cuda.synchronize()
    assert not out.any()
    with pytest.raises(RuntimeError, match=r"kt::moe_forward_parts \(CUDA host function\): topk_ids\[0, 1\] = 11"):
        kt_ops.cuda.raise_pending_error()


@needs_gpu
def test_eager_pinned_memory_is_bounded() -> None:
    experts = make_experts(E, H, I)
    for tokens in range(1, 40):
        ids, weights = random_routing(tokens, E, 2)
        kt_ops.moe_forward(torch.randn(tokens, H, device="cuda"), ids.cuda(), weights.cuda(), experts.packed)
    torch.cuda.synchronize()
    held = kt_ops.cuda.pinned_staging_bytes()
    for tokens in range(1, 40):
        ids, weights = random_routing(tokens, E, 2)
        kt_ops.moe_forward(torch.randn(tokens, H, device="cuda"), ids.cuda(), weights.cuda(), experts.packed)
    torch.cuda.synchronize()
    assert kt_ops.cuda.pinned_staging_bytes() == held


@needs_gpu
def test_compiled_cuda_layer_keeps_the_op_once() -> None:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    layer = hybrid_layer().cuda()
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(6, H, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        out, code = run_and_get_code(lambda: compiled(x))
        expected = layer(x)
    assert sum(c.count("torch.ops.kt.moe_forward.default(") for c in code) == 1
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
