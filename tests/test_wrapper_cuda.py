"""KTMoEWrapper with CUDA inputs (kt_ops/wrappers/wrapper_cuda.py).

Runs everywhere: the device-side id mapping and expert sums on the CPU key against the
wrapper's CPU path, a trace with fake CUDA tensors (one moe_forward per part and chunk,
CUDA activations, no host synchronisation), and set_capture_batch_sizes reserving the
pinned staging of every wrapper (the CUDA functions replaced by recorders). Needs a GPU
and the CUDA key (skipped otherwise, with the reason): eager CUDA == CPU wrapper,
submit_forward not blocking, deferred experts across layers, cuda_stream handles, and
CUDA graph capture and replay at two batch sizes.
"""

from __future__ import annotations

import pytest
import torch
from checkpoint_helpers import make_weights
from conftest import rel_err
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import kt_ops
import kt_ops.cuda
from kt_ops import KTMoEWrapper
from kt_ops.wrappers import kt_moe_wrapper
from kt_ops.wrappers.wrapper_cuda import capture_call_sizes, experts_on_device, packed_ids, route_table

E, K, H, I = 8, 3, 64, 64


@pytest.fixture(scope="module")
def weights():
    return make_weights([1, 2], E, H, I, seed=3)


@pytest.fixture(autouse=True)
def _clean_state():
    sizes = KTMoEWrapper.get_capture_batch_sizes()
    yield
    KTMoEWrapper.clear_buffer_cache()
    KTMoEWrapper._capture_batch_sizes = sizes


def make_wrapper(weights, layer: int = 1, **kw) -> KTMoEWrapper:
    kw.setdefault("method", "BF16")
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[2, 5]] = True  # two GPU slots
    wr = KTMoEWrapper(layer, E, K, H, I, gpu_experts_mask=mask, **kw)
    wr.load_weights_from_tensors(*weights[layer], physical_to_logical_map=torch.arange(E).flip(0))
    return wr


def inputs(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[0, 0] = -1
    return x, ids, torch.rand(T, K, generator=g)


# ---- everywhere ----------------------------------------------------------------------

def test_capture_call_sizes_follow_the_chunking() -> None:
    assert capture_call_sizes([8, 1, 4], None) == [1, 4, 8]
    assert capture_call_sizes([2, 6, 8], 4) == [2, 4]
    assert capture_call_sizes([9], 4) == [1, 4]
    assert capture_call_sizes([], 4) == []


def test_packed_ids_map_on_the_device_without_checks() -> None:
    route = torch.tensor([3, -1, 0, 1, -1, 2], dtype=torch.int32)  # slots 1 and 4 on the GPU
    table = route_table(route, bad_id=4, device=torch.device("cpu"))
    ids = torch.tensor([[0, 1, -1], [5, 6, 2], [4, 3, 100]])
    assert packed_ids(ids, table).tolist() == [[3, -1, -1], [2, 4, 0], [-1, 1, 4]]
    assert packed_ids(ids.int(), table).dtype == torch.int32


@pytest.mark.parametrize("threadpool_count,chunk", [(1, None), (2, 3)])
def test_device_path_on_the_cpu_key_matches_the_reference(weights, threadpool_count: int, chunk: int | None) -> None:
    """The expert computation both paths share, on CPU tensors, against kt_ops.reference
    on the bf16 weights with the routing rewritten independently (physical slot p holds
    logical expert E - 1 - p; slots 2 and 5 are on the GPU)."""
    wr = make_wrapper(weights, threadpool_count=threadpool_count, chunked_prefill_size=chunk)
    x, ids, w = inputs(7)
    ids[3, 1] = E + 2  # out of range: the operator must refuse it, not silently skip it
    table = route_table(wr._route, wr._parts[0].num_experts, torch.device("cpu"))
    with pytest.raises(ValueError, match="outside"):
        experts_on_device(wr._parts, x, ids, w, table, chunk)
    ids[3, 1] = 0
    logical = torch.where((ids < 0) | (ids == 2) | (ids == 5), -1, E - 1 - ids)
    held = [t.bfloat16().float() for t in weights[1]]
    expected = kt_ops.reference.moe_forward(x, logical, w, *held)
    got = experts_on_device(wr._parts, x, ids, w, table, chunk)
    assert got.dtype == torch.float32 and rel_err(got, expected) <= 1e-2
    torch.testing.assert_close(wr.forward(x, ids, w), got, rtol=0, atol=0)  # the CPU path is this code
    assert experts_on_device(wr._parts, x[:0], ids[:0], w[:0], table, chunk).shape == (0, H)


@pytest.mark.parametrize("threadpool_count,chunk,tokens", [(1, None, 5), (2, 4, 9)])
def test_fake_cuda_trace_has_no_host_sync(weights, threadpool_count: int, chunk: int | None, tokens: int) -> None:
    """make_fx over fake CUDA tensors of the wrapper's device path (deferred split
    included): one kt.moe_forward per chunk (kt.moe_forward_parts where the layer is in
    parts: every part at once), CUDA activations, packed experts on the CPU, and nothing
    that copies to the host or reads a value back."""
    wr = make_wrapper(weights, threadpool_count=threadpool_count, chunked_prefill_size=chunk,
                      max_deferred_experts_per_token=1)
    route = wr._route

    def step(x, ids, w, table):
        immediate, deferred = wr.select_deferred_experts(ids, w, K - 1)
        now = experts_on_device(wr._parts, x, immediate, w, table, chunk)
        later = experts_on_device(wr._parts, x, deferred, w, table, chunk)
        return (now + later).to(x.dtype)

    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(tokens, H, dtype=torch.bfloat16, device="cuda")
        ids = torch.empty(tokens, K, dtype=torch.int64, device="cuda")
        w = torch.empty(tokens, K, dtype=torch.float32, device="cuda")
        table = torch.empty(route.numel() + 1, dtype=torch.int32, device="cuda")
        graph = make_fx(step, tracing_mode="real")(x, ids, w, table)
        out = graph(x, ids, w, table)
    assert out.device.type == "cuda" and out.shape == (tokens, H) and out.dtype == torch.bfloat16
    op = torch.ops.kt.moe_forward.default if threadpool_count == 1 else torch.ops.kt.moe_forward_parts.default
    calls = [n for n in graph.graph.nodes if n.target in (torch.ops.kt.moe_forward.default,
                                                         torch.ops.kt.moe_forward_parts.default)]
    chunks = -(-tokens // (chunk or tokens))
    assert len(calls) == 2 * chunks and all(call.target == op for call in calls)
    for call in calls:
        hidden, routed, scores = (arg.meta["val"] for arg in call.args[:3])
        assert hidden.device.type == routed.device.type == scores.device.type == "cuda"
        packed = call.args[3]  # a node, or a list of them (the parts)
        blobs = [node.meta["val"] for node in (packed if isinstance(packed, (list, tuple)) else [packed])]
        assert len(blobs) == threadpool_count and all(blob.device.type == "cpu" for blob in blobs)
    for node in graph.graph.nodes:
        assert node.target not in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and node.op == "call_function" and node.target != op:
            assert value.device.type == "cuda", f"{node.target} leaves the GPU"


def test_set_capture_batch_sizes_reserves_for_every_wrapper(weights, monkeypatch: pytest.MonkeyPatch) -> None:
    reserved: list[tuple[tuple[int, ...], int, int, int]] = []
    monkeypatch.setattr(kt_ops.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(kt_ops.cuda, "reserve_cuda_graph_buffers",
                        lambda sizes, hidden, top_k, device: reserved.append((tuple(sizes), hidden, top_k, device)))
    KTMoEWrapper.set_capture_batch_sizes([])
    first = KTMoEWrapper(1, E, K, H, I, chunked_prefill_size=4)
    assert reserved == []  # nothing to reserve yet
    KTMoEWrapper.set_capture_batch_sizes([2, 6])
    assert (( 2, 4), H, K, 0) in reserved
    count = len(reserved)
    KTMoEWrapper(2, E, 2, 128, I)  # constructed later: reserves its own shape
    assert reserved[count:] == [((2, 6), 128, 2, 0)]
    first._reserve_capture_buffers()  # once per device and sizes
    assert len(reserved) == count + 1


def test_without_cuda_sizes_are_only_recorded(weights) -> None:
    if torch.cuda.is_available() and kt_ops.cuda.is_built():
        pytest.skip("this machine reserves real buffers")
    wr = make_wrapper(weights)
    KTMoEWrapper.set_capture_batch_sizes([1, 4])
    assert KTMoEWrapper.get_capture_batch_sizes() == [1, 4] and not wr._reserved
    assert kt_ops.cuda.pinned_staging_bytes() == 0


def test_cuda_stream_argument_is_checked() -> None:
    with pytest.raises(TypeError, match="cuda_stream"):
        kt_moe_wrapper.resolve_stream("stream 0", torch.device("cuda", 0))


# ---- on a GPU ------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not kt_ops.cuda.is_built(),
    reason="needs a GPU (torch.cuda.is_available() is False here) and kt_ops built with its CUDA key",
)


@needs_gpu
@pytest.mark.parametrize("threadpool_count,chunk", [(1, None), (2, 3)])
def test_cuda_forward_equals_the_cpu_wrapper(weights, threadpool_count: int, chunk: int | None) -> None:
    wr = make_wrapper(weights, threadpool_count=threadpool_count, chunked_prefill_size=chunk)
    for tokens in (1, 7):
        x, ids, w = inputs(tokens, seed=tokens)
        expected = wr.forward(x.bfloat16(), ids, w)
        actual = wr.forward(x.bfloat16().cuda(), ids.cuda(), w.cuda())
        assert actual.device.type == "cuda" and actual.dtype == torch.bfloat16
        torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0)


@needs_gpu
def test_cuda_submit_does_not_block(weights) -> None:
    wr = make_wrapper(weights)
    x, ids, w = inputs(16)
    expected = wr.forward(x, ids, w)
    x, ids, w = x.cuda(), ids.cuda(), w.cuda()
    torch.cuda._sleep(200_000_000)  # the stream is busy: submit must only enqueue
    wr.submit_forward(x, ids, w)
    out = wr.sync_forward(x)
    assert not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-6, atol=1e-6)


@needs_gpu
def test_cuda_deferred_experts_and_stream_handles(weights) -> None:
    cpu = [make_wrapper(weights, 1, max_deferred_experts_per_token=1), make_wrapper(weights, 2)]
    x, ids, w = inputs(5)
    expected = [cpu[0].forward(x, ids, w), cpu[1].forward(x, ids, w)]
    KTMoEWrapper.clear_buffer_cache()
    stream = torch.cuda.Stream()
    gpu = [make_wrapper(weights, 1, max_deferred_experts_per_token=1), make_wrapper(weights, 2)]
    xc, idc, wc = x.cuda(), ids.cuda(), w.cuda()
    stream.wait_stream(torch.cuda.current_stream())
    first = gpu[0].forward(xc, idc, wc, stream)  # a torch.cuda.Stream
    queued_on = KTMoEWrapper._thread_pending()[(gpu[0].deferral_group, 2)][2]  # layer 1's deferred experts, for layer 2
    assert queued_on is not None and queued_on.cuda_stream != stream.cuda_stream  # eager: on the side stream
    second = gpu[1].forward(xc, idc, wc, stream.cuda_stream)  # a raw cudaStream_t
    torch.cuda.current_stream().wait_stream(stream)
    for got, want in zip((first, second), expected):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


@needs_gpu
def test_cuda_graph_capture_and_replay_at_two_batch_sizes(weights) -> None:
    wr = make_wrapper(weights, threadpool_count=2)
    KTMoEWrapper.set_capture_batch_sizes([4, 8])
    graphs = {}
    for size in (4, 8):
        static = [t.cuda() for t in inputs(size, seed=100 + size)]
        wr.forward(*static)  # eager warm-up: routing table on the device
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = wr.forward(*static)
        graphs[size] = (graph, static, out)
    for step in range(3):
        for size, (graph, static, out) in graphs.items():
            fresh = inputs(size, seed=step * 10 + size)
            for buffer, value in zip(static, fresh):
                buffer.copy_(value.cuda())
            held = kt_ops.cuda.pinned_staging_bytes()
            graph.replay()
            torch.cuda.synchronize()
            assert kt_ops.cuda.pinned_staging_bytes() == held
            torch.testing.assert_close(out.cpu(), wr.forward(*fresh), rtol=1e-6, atol=1e-6)
