"""KTMoEWrapper (kt-kernel's API): weights from Hugging Face checkpoints in each naming
convention, from tensors and from GGUF; GPU-expert masks, physical-to-logical maps,
deferred experts across two layers, threadpool_count parts, submit/sync, bad input.

Expected outputs come from kt_ops.reference on the original weights, with the routing
rewritten independently in the test (physical -> logical, GPU slots dropped).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_helpers import fp8_dequantized, make_weights, write_checkpoint
from conftest import rel_err
from gguf_helpers import random_blocks, write_model

import kt_ops
from kt_ops import KTMoEWrapper, generate_gpu_experts_masks, reference

E, K, H, I = 8, 3, 64, 64
# Kernel error vs the reference on the weights the kernel holds (bf16 rounding; int8
# activations for INT8/INT4: 1-2% at H = 2048, up to ~3.5% at these tiny sizes).
TOL = {"BF16": 1e-2, "AMXINT8": 5e-2, "AMXINT4": 5e-2}


@pytest.fixture(scope="module")
def weights():
    return make_weights([1, 2], E, H, I, seed=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, weights) -> Path:
    """per_expert naming, layer 0 dense (no experts), 3 shards with an index."""
    return write_checkpoint(tmp_path_factory.mktemp("hf") / "model", weights, shards=3, dense_layers=(0,))


@pytest.fixture(autouse=True)
def _no_pending():
    yield
    KTMoEWrapper.clear_buffer_cache()


def inputs(T: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return x, ids, w


def held(layer_weights, method: str = "BF16"):
    """The weights a wrapper of ``method`` holds for these originals: bf16-rounded, or
    quantized by pack_experts and decoded by the reference's independent decoder."""
    if method == "BF16":
        return tuple(t.bfloat16().float() for t in layer_weights)
    packed = kt_ops.pack_experts(*(t.bfloat16() for t in layer_weights), method=method,
                                 **({"group_size": 32} if method == "AMXINT4" else {}))
    return reference.dequantize(packed.data)


def expected(x, ids, w, layer_weights, mapping=None, mask=None, method="BF16"):
    """Reference on logical weights: physical ids mapped through ``mapping``, GPU slots -1."""
    mapping = torch.arange(E) if mapping is None else torch.as_tensor(mapping)
    valid = ids >= 0
    logical = torch.where(valid, mapping[ids.clamp(min=0)], -1)
    if mask is not None:
        logical = torch.where(valid & mask[ids.clamp(min=0)], -1, logical)
    return reference.moe_forward(x, logical, w, *held(layer_weights, method))


def wrapper(path=None, layer=1, **kw) -> KTMoEWrapper:
    kw.setdefault("method", "BF16")
    kw.setdefault("group_size", 32)
    return KTMoEWrapper(layer, kw.pop("num_experts", E), kw.pop("top_k", K), H, I, weight_path=path, **kw)


@pytest.mark.parametrize("method", ["BF16", "AMXINT8", "AMXINT4"])
def test_methods_from_hf_checkpoint(checkpoint, weights, method):
    x, ids, w = inputs()
    for layer in (1, 2):
        wr = wrapper(checkpoint, layer, method=method)
        wr.load_weights()
        out = wr.forward(x, ids, w)
        assert out.dtype == x.dtype and out.shape == x.shape
        assert rel_err(out, expected(x, ids, w, weights[layer], method=method)) <= TOL[method]


@pytest.mark.parametrize("convention,index", [("per_expert", False), ("w123", True), ("w123", False),
                                              ("fused", True), ("fused", False), ("mistral", False)])
def test_naming_conventions(tmp_path, weights, convention, index):
    path = write_checkpoint(tmp_path / "m", weights, convention=convention, shards=2, index=index)
    x, ids, w = inputs()
    wr = wrapper(path, 2)
    wr.load_weights()
    assert rel_err(wr.forward(x, ids, w), expected(x, ids, w, weights[2])) <= 1e-2


def test_fp8_checkpoint_is_dequantized_with_block_scales(tmp_path):
    H8, I8 = 256, 192  # two 128-blocks along H, a partial one along I
    ws = make_weights([0], E, H8, I8, seed=4)
    path = write_checkpoint(tmp_path / "fp8", ws, dtype=torch.float8_e4m3fn)
    deq = [torch.stack([fp8_dequantized(m[e]) for e in range(E)]).float() for m in ws[0]]
    x = torch.randn(5, H8)
    ids = torch.randint(0, E, (5, 2))
    w = torch.rand(5, 2)
    wr = KTMoEWrapper(0, E, 2, H8, I8, weight_path=path, method="BF16")
    wr.load_weights()
    out = wr.forward(x, ids, w)
    assert rel_err(out, reference.moe_forward(x, ids, w, *deq)) <= 1e-2
    # and the scales matter: without them the output is far off
    raw = [torch.stack([fp8_dequantized(m[e], block=10**6) for e in range(E)]).float() for m in ws[0]]
    assert rel_err(out, reference.moe_forward(x, ids, w, *raw)) > 0.05


@pytest.mark.parametrize("method", ["BF16", "AMXINT8", "AMXINT4"])
def test_gpu_mask_and_physical_map(checkpoint, weights, method):
    mapping = torch.tensor([3, 0, 7, 1, 6, 2, 5, 4])
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[1, 4, 6]] = True
    x, ids, w = inputs(9, seed=1)
    want = expected(x, ids, w, weights[1], mapping, mask, method=method)
    wr = wrapper(checkpoint, 1, method=method, gpu_experts_mask=mask)
    wr.load_weights(mapping)
    assert rel_err(wr.forward(x, ids, w), want) <= TOL[method]
    tensors = wrapper(None, 1, method=method, gpu_experts_mask=mask)
    tensors.load_weights_from_tensors(*weights[1], physical_to_logical_map=mapping)
    assert rel_err(tensors.forward(x, ids, w), want) <= TOL[method]
    # the case is not trivial: without the mask, or the map, the result differs a lot
    assert rel_err(want, expected(x, ids, w, weights[1], mapping, method=method)) > 0.2
    assert rel_err(want, expected(x, ids, w, weights[1], mask=mask, method=method)) > 0.2


def test_kt_kernel_keyword_names(checkpoint, weights):
    """kt-kernel's keyword names are taken: ``physical_to_logical_map_cpu=`` (load_weights,
    load_weights_from_tensors: callers pass it by name) and ``capture_bs=``
    (set_capture_batch_sizes) were a TypeError."""
    mapping = torch.tensor([3, 0, 7, 1, 6, 2, 5, 4])
    x, ids, w = inputs()
    want = expected(x, ids, w, weights[1], mapping)
    wr = wrapper(checkpoint, 1)
    wr.load_weights(physical_to_logical_map_cpu=mapping)
    assert rel_err(wr.forward(x, ids, w), want) <= 1e-2
    tensors = wrapper(None, 1)
    tensors.load_weights_from_tensors(gate_proj=weights[1][0], up_proj=weights[1][1], down_proj=weights[1][2],
                                      physical_to_logical_map_cpu=mapping)
    assert rel_err(tensors.forward(x, ids, w), want) <= 1e-2
    with pytest.raises(TypeError, match="not both"):
        wr.load_weights(mapping, physical_to_logical_map_cpu=mapping)
    with pytest.raises(TypeError, match="not both"):
        tensors.load_weights_from_tensors(*weights[1], physical_to_logical_map=mapping,
                                          physical_to_logical_map_cpu=mapping)
    try:
        KTMoEWrapper.set_capture_batch_sizes(capture_bs=[2, 1])
        assert KTMoEWrapper.get_capture_batch_sizes() == [1, 2]
    finally:
        KTMoEWrapper.set_capture_batch_sizes([])


def test_max_deferred_experts_per_token_none_is_zero():
    """kt-kernel's default for max_deferred_experts_per_token is None (no deferral); None was a ValueError."""
    assert wrapper(None, 1, max_deferred_experts_per_token=None).max_deferred_experts_per_token == 0


def test_num_gpu_experts_attribute():
    """kt-kernel's wrapper has ``num_gpu_experts`` (the mask's count at construction); it was missing."""
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[1, 4]] = True
    assert wrapper(None, 1, gpu_experts_mask=mask).num_gpu_experts == 2
    assert wrapper(None, 1, num_gpu_experts=3).num_gpu_experts == 3
    assert wrapper(None, 1).num_gpu_experts == 0


@pytest.mark.parametrize("mapping", [
    torch.tensor([3, 0, 7, 1, 6, 2, 5.5, 4]),  # a fraction: truncated it would load expert 5 silently
    torch.tensor([3, 0, 7, 1, 6, 2, float("nan"), 4]),
    torch.tensor([True, False] * 4),  # a mask where a map belongs
    ["3", "0", "7", "1", "6", "2", "5", "4"],
])
def test_physical_map_must_hold_integers(checkpoint, weights, mapping):
    with pytest.raises(ValueError, match="physical_to_logical_map must be integer expert indices"):
        wrapper(checkpoint, 1).load_weights(mapping)
    with pytest.raises(ValueError, match="physical_to_logical_map must be integer expert indices"):
        wrapper(None, 1).load_weights_from_tensors(*weights[1], physical_to_logical_map=mapping)
    whole = [3, 0, 7, 1, 6, 2, 5.0, 4]  # floats of whole numbers are indices
    wr = wrapper(checkpoint, 1)
    wr.load_weights(whole)
    x, ids, w = inputs()
    assert rel_err(wr.forward(x, ids, w), expected(x, ids, w, weights[1], torch.tensor(whole).long())) <= 1e-2


def test_physical_map_must_be_one_dimensional(checkpoint, weights):
    """A [2, E / 2] table was flattened and loaded as a map of E slots."""
    table = torch.arange(E).reshape(2, -1)
    with pytest.raises(ValueError, match=r"must be 1-D \[num_experts = 8\], got shape \[2, 4\]"):
        wrapper(checkpoint, 1).load_weights(table)
    with pytest.raises(ValueError, match="physical_to_logical_map must be 1-D"):
        wrapper(None, 1).load_weights_from_tensors(*weights[1], physical_to_logical_map=table)


@pytest.mark.parametrize("name", ["hidden_states", "topk_ids", "topk_weights"])
@pytest.mark.parametrize("call", ["forward", "submit_forward"])
def test_meta_inputs_to_forward_are_named(weights, name, call):
    """A meta input was NotImplementedError "Cannot copy out of meta tensor" or a RuntimeError from .item()."""
    wr = wrapper()
    wr.load_weights_from_tensors(*weights[1])
    args = dict(zip(("hidden_states", "topk_ids", "topk_weights"), inputs()))
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=f"{name} is on the meta device"):
        getattr(wr, call)(**args)
    x, ids, w = inputs()
    assert rel_err(wr.forward(x, ids, w), expected(x, ids, w, weights[1])) <= 1e-2  # the wrapper still serves


@pytest.mark.parametrize("count", [1.5, True, -1, E + 1])
def test_num_gpu_experts_must_be_an_int_in_range(count):
    with pytest.raises(ValueError, match=rf"num_gpu_experts must be an int in \[0, {E}\], got {count!r}"):
        wrapper(num_gpu_experts=count)


def test_num_gpu_experts_and_all_on_gpu(weights):
    x, ids, w = inputs()
    wr = wrapper(num_gpu_experts=3)
    wr.load_weights_from_tensors(*weights[1])
    assert rel_err(wr.forward(x, ids, w), expected(x, ids, w, weights[1], mask=torch.arange(E) < 3)) <= 1e-2
    everything = wrapper(num_gpu_experts=E)
    everything.load_weights_from_tensors(*weights[1])
    assert torch.count_nonzero(everything.forward(x, ids, w)) == 0


def test_numpy_integers_are_taken_as_ints(weights):
    """Sizes as numpy integers (read from an array): "num_gpu_experts must be an int in [0, 8],
    got np.int64(3)" and the like, where kt-kernel takes them; now the same layer as with ints
    (bools and floats stay refused above)."""
    x, ids, w = inputs()
    wr = KTMoEWrapper(np.int64(1), np.int32(E), np.int64(K), np.int64(H), np.int64(I), method="AMXINT4",
                      group_size=np.int64(32), num_gpu_experts=np.int64(3), threadpool_count=np.int64(2),
                      chunked_prefill_size=np.int64(4), max_deferred_experts_per_token=np.int64(1),
                      cpuinfer_threads=np.int64(2))
    wr.load_weights_from_tensors(*weights[1])
    plain = wrapper(method="AMXINT4", num_gpu_experts=3, threadpool_count=2, chunked_prefill_size=4,
                    max_deferred_experts_per_token=1, cpuinfer_threads=2)
    plain.load_weights_from_tensors(*weights[1])
    assert type(wr.num_experts) is int and type(wr.threadpool_count) is int
    assert torch.equal(wr.forward(x, ids, w), plain.forward(x, ids, w))


@pytest.mark.parametrize("call", ["forward", "submit_forward"])
def test_forward_before_load_weights_with_every_slot_on_the_gpu(call: str) -> None:
    """Every slot on the GPU and no weights loaded: the forward says to load them, as with CPU slots (was a
    RuntimeError from the empty routing table: "The size of tensor a (8) must match ...")."""
    with pytest.raises(RuntimeError, match="call load_weights first"):
        getattr(wrapper(num_gpu_experts=E), call)(*inputs())


def test_arguments_that_are_not_tensors_are_named(weights) -> None:
    """A numpy array or a list where a tensor belongs is a TypeError naming the argument (was an AttributeError:
    "'numpy.ndarray' object has no attribute 'dim'")."""
    with pytest.raises(TypeError, match="up_proj must be a torch.Tensor, got ndarray"):
        wrapper().load_weights_from_tensors(weights[1][0], weights[1][1].numpy(), weights[1][2])
    wr = wrapper()
    wr.load_weights_from_tensors(*weights[1])
    x, ids, w = inputs()
    for call in (wr.forward, wr.submit_forward):
        with pytest.raises(TypeError, match="hidden_states must be a torch.Tensor, got list"):
            call(x.tolist(), ids, w)
        with pytest.raises(TypeError, match="topk_ids must be a torch.Tensor, got ndarray"):
            call(x, ids.numpy(), w)
        with pytest.raises(TypeError, match="topk_weights must be a torch.Tensor, got list"):
            call(x, ids, w.tolist())
    assert rel_err(wr.forward(x, ids, w), expected(x, ids, w, weights[1])) <= 1e-2  # the wrapper is free again


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_online_quantization_takes_fp16_fp32_and_an_int32_map(weights, method, dtype):
    """kt-kernel 0.7.2 reads load_weights_from_tensors' tensors as bf16 bytes and its map as
    int64 (fp16 weights: zeros out, an int32 map: SIGSEGV); kt_ops converts both."""
    mapping = torch.tensor([3, 1, 0, 2, 7, 6, 5, 4], dtype=torch.int32)
    x, ids, w = inputs(9, seed=3)
    wr = wrapper(method=method)
    wr.load_weights_from_tensors(*(t.to(dtype) for t in weights[1]), physical_to_logical_map=mapping)
    want = expected(x, ids, w, weights[1], mapping=mapping.long(), method=method)
    assert rel_err(wr.forward(x, ids, w), want) <= TOL[method]


def test_redundant_physical_slots(weights):
    """EPLB-style maps: more physical slots than logical experts, replicas of one expert."""
    mapping = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 2, 5])
    x, ids, w = inputs(6, seed=2)
    ids = torch.stack([torch.randperm(10)[:K] for _ in range(6)])
    wr = KTMoEWrapper(1, 10, K, H, I, method="BF16")
    wr.load_weights_from_tensors(*weights[1], physical_to_logical_map=mapping)
    g, u, d = (t.bfloat16().float() for t in weights[1])
    assert rel_err(wr.forward(x, ids, w), reference.moe_forward(x, mapping[ids], w, g, u, d)) <= 1e-2


@pytest.mark.parametrize("method,tol", [("BF16", 1e-5), ("AMXINT8", 3e-2), ("AMXINT4", 5e-2)])
def test_threadpool_count_2_matches_1(checkpoint, method, tol):
    x, ids, w = inputs(11)
    one = wrapper(checkpoint, 1, method=method)
    one.load_weights()
    two = wrapper(checkpoint, 1, method=method, threadpool_count=2, cpuinfer_threads=kt_ops.get_num_threads())
    two.load_weights()
    assert len(two._parts) == 2 and two._parts[0].intermediate_size == I // 2
    assert rel_err(two.forward(x, ids, w), one.forward(x, ids, w)) <= tol  # int8/int4: down requantized per part


def deferred_split(ids: torch.Tensor, w: torch.Tensor, protected_k: int):
    """kt-kernel's rule, written as a loop: experts in any token's top protected_k are protected."""
    protected = set()
    for t in range(ids.shape[0]):
        order = sorted(range(ids.shape[1]), key=lambda j: -float(w[t, j]))
        protected |= {int(ids[t, j]) for j in order[:protected_k]}
    keep = torch.tensor([[int(v) in protected for v in row] for row in ids])
    return torch.where(keep, ids, -1), torch.where(keep, -1, ids)


def test_deferred_experts_go_to_the_next_layer(checkpoint, weights):
    x, ids, w = inputs(4, seed=3)
    layer1 = wrapper(checkpoint, 1, max_deferred_experts_per_token=1)
    layer2 = wrapper(checkpoint, 2)
    layer1.load_weights()
    layer2.load_weights()
    immediate, deferred = deferred_split(ids, w, K - 1)
    got_imm, got_def = layer1.select_deferred_experts(ids, w, K - 1)
    assert torch.equal(got_imm, immediate) and torch.equal(got_def, deferred)
    assert (deferred >= 0).any() and (immediate >= 0).any()  # the case is not trivial
    x2 = torch.randn(4, H)
    out1 = layer1.forward(x, ids, w)
    out2 = layer2.forward(x2, ids, w)
    assert rel_err(out1, expected(x, immediate, w, weights[1])) <= 1e-2
    late = expected(x, deferred, w, weights[1])
    assert rel_err(out2, expected(x2, ids, w, weights[2]) + late) <= 1e-2
    # the two layers together computed every expert of layer 1
    assert rel_err(out1 + out2, expected(x, ids, w, weights[1]) + expected(x2, ids, w, weights[2])) <= 1e-2


@pytest.mark.parametrize("offset", [E, -2 - E])
def test_select_deferred_experts_names_ids_out_of_range(offset: int) -> None:
    """select_deferred_experts (public, as kt-kernel's) on CPU ids outside [-1, num_experts) is the forward's
    ValueError (was a RuntimeError from its scatter, "index 13 is out of bounds for dimension 0 with size 9")."""
    _, ids, w = inputs()
    with pytest.raises(ValueError, match=r"topk_ids must be in \[-1, num_experts = 8\)"):
        wrapper(max_deferred_experts_per_token=1).select_deferred_experts(ids + offset, w, K - 1)


def test_deferred_results_stay_in_their_model(checkpoint, weights):
    """Two models built one after the other, run interleaved: model A's layer-1 deferred
    experts go to A's layer 2 only, never to B's (issue 23, case 6)."""
    x, ids, w = inputs(4, seed=3)
    a1, a2 = wrapper(checkpoint, 1, max_deferred_experts_per_token=1), wrapper(checkpoint, 2)
    b1, b2 = wrapper(checkpoint, 1), wrapper(checkpoint, 2)
    assert a1.deferral_group is a2.deferral_group and b1.deferral_group is b2.deferral_group
    assert a1.deferral_group is not b1.deferral_group
    for wr in (a1, a2, b1, b2):
        wr.load_weights()
    x2 = torch.randn(4, H)
    a1.forward(x, ids, w)
    out_b2 = b2.forward(x2, ids, w)  # B has nothing deferred
    assert rel_err(out_b2, expected(x2, ids, w, weights[2])) <= 1e-2
    immediate, deferred = deferred_split(ids, w, K - 1)
    out_a2 = a2.forward(x2, ids, w)
    assert rel_err(out_a2, expected(x2, ids, w, weights[2]) + expected(x, deferred, w, weights[1])) <= 1e-2
    # an explicit group joins wrappers whatever their construction order
    group = object()
    c2, c1 = wrapper(checkpoint, 2, deferral_group=group), wrapper(checkpoint, 1, deferral_group=group)
    assert c1.deferral_group is c2.deferral_group is group


@pytest.mark.parametrize("bad", ["minus5", "float", "big"])
def test_wrapper_ids_checked_as_moe_forward_checks_them(checkpoint, bad):
    """ids below -1, float ids and ids >= E are refused, not skipped or truncated (issue 23, case 5)."""
    wr = wrapper(checkpoint, 1)
    wr.load_weights()
    x, ids, w = inputs(3)
    if bad == "minus5":
        ids[1, 0] = -5
    elif bad == "big":
        ids[0, 0] = E
    else:
        ids = ids.float() + 0.7
    with pytest.raises(ValueError, match="topk_ids"):
        wr.forward(x, ids, w)


def test_submit_sync_interleaved_across_layers(checkpoint, weights):
    layers = [wrapper(checkpoint, L) for L in (1, 2)]
    for wr in layers:
        wr.load_weights()
    batches = [inputs(5, seed=s) for s in (5, 6)]
    for wr, (x, ids, w) in zip(layers, batches):
        wr.submit_forward(x, ids, w, None)
    outs = [wr.sync_forward(b[0], None) for wr, b in zip(layers, batches)]
    for L, out, (x, ids, w) in zip((1, 2), outs, batches):
        assert rel_err(out, expected(x, ids, w, weights[L])) <= 1e-2
    with pytest.raises(RuntimeError, match="without submit_forward"):
        layers[0].sync_forward(batches[0][0])
    layers[0].submit_forward(*batches[0])
    with pytest.raises(RuntimeError, match="submit_forward is not collected yet"):
        layers[0].submit_forward(*batches[0])
    layers[0].sync_forward()


def test_submit_returns_before_the_experts_finish(weights, monkeypatch):
    wr = wrapper()
    wr.load_weights_from_tensors(*weights[1])
    release = threading.Event()
    compute = wr._compute

    def gated(*args):
        assert release.wait(10)
        return compute(*args)

    monkeypatch.setattr(wr, "_compute", gated)
    x, ids, w = inputs()
    wr.submit_forward(x, ids, w)  # would deadlock if it waited for the experts
    assert not wr._inflight.result.done()
    release.set()
    assert rel_err(wr.sync_forward(x), expected(x, ids, w, weights[1])) <= 1e-2


def test_forward_computes_cpu_inputs_on_the_calling_thread(weights, monkeypatch):
    """forward() (submit then sync at once) runs the experts on the caller's thread, so on
    torch's OpenMP team; submit_forward on the worker thread, and so does forward while
    the worker is busy. Same result either way; an error is raised by forward and leaves
    the wrapper usable."""
    wr = wrapper()
    wr.load_weights_from_tensors(*weights[1])
    threads = []

    def recording(method):
        def recorded(*args):
            result = method(*args)
            if result is not None:  # _direct_cpu_forward returns None where it does not compute
                threads.append(threading.current_thread())
            return result
        return recorded

    monkeypatch.setattr(wr, "_compute", recording(wr._compute))
    monkeypatch.setattr(wr, "_direct_cpu_forward", recording(wr._direct_cpu_forward))
    x, ids, w = inputs()
    inline = wr.forward(x, ids, w)
    assert threads == [threading.current_thread()]
    wr.submit_forward(x, ids, w)
    worker = wr.sync_forward(x)
    assert threads[1] is not threading.current_thread() and threads[1].name.startswith("kt_ops_moe")
    assert torch.equal(inline, worker)
    assert rel_err(inline, expected(x, ids, w, weights[1])) <= 1e-2

    release = threading.Event()
    busy = KTMoEWrapper._run_on_worker(release.wait, 10)  # another layer's work on the worker
    try:
        assert KTMoEWrapper._pool_tasks == 1
        queued = threading.Thread(target=lambda: threads.append(wr.forward(x, ids, w)))
        queued.start()
        queued.join(0.5)
        assert queued.is_alive()  # waits behind the busy worker instead of running beside it
    finally:
        release.set()
    queued.join(10)
    assert busy.result() and threads[2].name.startswith("kt_ops_moe") and torch.equal(threads[3], inline)
    assert KTMoEWrapper._pool_tasks == 0

    bad = ids.clone()
    bad[0, 0] = E
    with pytest.raises(ValueError, match="topk_ids"):
        wr.forward(x, bad, w)
    assert len(threads) == 4  # raised on the calling thread, by the operator's id check
    assert torch.equal(wr.forward(x, ids, w), inline) and threads[4] is threading.current_thread()


@contextlib.contextmanager
def forward_running_on_another_thread(wr, monkeypatch, x, ids, w):
    """Runs ``wr.forward(x, ids, w)`` on a second thread, held inside its one operator call
    (the direct path's ``moe_forward``) while the block runs; then lets it finish and
    yields the list its result is appended to."""
    module = sys.modules[KTMoEWrapper.__module__]
    entered, release = threading.Event(), threading.Event()
    operator = module.moe_forward

    def gated(*args):
        if threading.current_thread() is not threading.main_thread():  # the other caller's call waits
            entered.set()
            assert release.wait(10)
        return operator(*args)

    monkeypatch.setattr(module, "moe_forward", gated)
    results: list = []
    first = threading.Thread(target=lambda: results.append(wr.forward(x, ids, w)))
    first.start()
    try:
        assert entered.wait(10)
        yield results
    finally:
        release.set()
        first.join(10)
        monkeypatch.setattr(module, "moe_forward", operator)


def test_one_wrapper_serves_one_caller_at_a_time(weights, monkeypatch):
    """While one thread's forward is in progress on a wrapper (inside forward, or between
    its submit_forward and sync_forward), another thread's forward, submit_forward or
    sync_forward is a RuntimeError saying so: the direct path ran both at once on the
    wrapper's state, the general path failed as "submit_forward called twice". The first
    caller's result is unchanged and the wrapper serves the next caller."""
    wr = wrapper()
    wr.load_weights_from_tensors(*weights[1])
    x, ids, w = inputs()
    alone = wr.forward(x, ids, w)
    with forward_running_on_another_thread(wr, monkeypatch, x, ids, w) as results:
        for call in (lambda: wr.forward(x, ids, w), lambda: wr.submit_forward(x, ids, w), wr.sync_forward):
            with pytest.raises(RuntimeError, match="one caller at a time"):
                call()
    assert len(results) == 1 and torch.equal(results[0], alone)

    submitted = threading.Thread(target=wr.submit_forward, args=(x, ids, w))  # the general path
    submitted.start()
    submitted.join(10)
    for call in (lambda: wr.forward(x, ids, w), lambda: wr.submit_forward(x, ids, w)):
        with pytest.raises(RuntimeError, match="one caller at a time"):
            call()
    assert torch.equal(wr.sync_forward(x), alone)  # collected by any thread once submitted
    assert torch.equal(wr.forward(x, ids, w), alone)
    wr.submit_forward(x, ids, w)
    with pytest.raises(RuntimeError, match="submit_forward is not collected yet: call sync_forward"):  # its own message
        wr.forward(x, ids, w)
    assert torch.equal(wr.sync_forward(x), alone)


def run_on_threads(jobs, timeout: float = 60.0) -> list:
    """Runs each job on its own thread, all at once; returns their results (raising the first error)."""
    results: list = [None] * len(jobs)
    errors: list = []
    start = threading.Barrier(len(jobs))

    def run(i, job):
        try:
            start.wait(10)
            results[i] = job()
        except BaseException as error:  # noqa: BLE001 (re-raised on the test's thread)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread did not finish (deadlock?)"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("mode", ["forward", "submit_sync"])
def test_two_layers_of_one_model_on_two_threads(weights, mode):
    """Layer 1 (deferring one expert per token) and layer 2 of one model (one deferral
    group), each used alone on its own thread, many times at once: each output is the one
    the layer gives alone, bit for bit. With one map of deferred outputs for all threads,
    layer 2 took layer 1's deferred experts whenever they were there, at random."""
    layer1, layer2 = wrapper(layer=1, max_deferred_experts_per_token=1), wrapper(layer=2)
    assert layer1.deferral_group is layer2.deferral_group
    layer1.load_weights_from_tensors(*weights[1])
    layer2.load_weights_from_tensors(*weights[2])
    batches = [inputs(5, seed=s) for s in range(4)]

    def call(wr, batch):
        if mode == "forward":
            return wr.forward(*batch)
        wr.submit_forward(*batch)
        return wr.sync_forward(batch[0])

    rounds = 60
    alone = {}
    for wr in (layer1, layer2):
        alone[wr] = [call(wr, batches[i % 4]) for i in range(rounds)]
        KTMoEWrapper.clear_buffer_cache()
    got = run_on_threads([lambda wr=wr: [call(wr, batches[i % 4]) for i in range(rounds)] for wr in (layer1, layer2)])
    for wr, outs in zip((layer1, layer2), got):
        for i, out in enumerate(outs):
            assert torch.equal(out, alone[wr][i]), (wr.layer_idx, i)


def test_two_models_on_two_threads(weights):
    """Two models (layer 1 deferring one expert per token, then layer 2), constructed on
    two threads at once and each run on its thread many times: each thread's outputs are
    those of its model run alone, bit for bit. The default deferral group followed the
    last wrapper constructed on any thread, so interleaved construction joined one
    model's layer 2 to the other's group (its deferred experts lost or stolen)."""
    built = threading.Barrier(2)

    def build():
        layers = []
        for L in (1, 2):
            built.wait(10)  # the two threads construct layer L, then layer L + 1, together
            layers.append(wrapper(layer=L, max_deferred_experts_per_token=1 if L == 1 else 0))
            built.wait(10)
        for wr, L in zip(layers, (1, 2)):
            wr.load_weights_from_tensors(*weights[L])
        return layers

    models = run_on_threads([build, build])
    for a, b in models:
        assert a.deferral_group is b.deferral_group
    assert models[0][0].deferral_group is not models[1][0].deferral_group
    batches = [inputs(5, seed=s) for s in range(4)]

    def run_model(layers, rounds=40, offset=0):
        outs = []
        for i in range(rounds):
            x, ids, w = batches[(i + offset) % 4]
            for wr in layers:
                x = wr.forward(x, ids, w)
            outs.append(x)
        return outs

    alone = [run_model(m, offset=k) for k, m in enumerate(models)]
    KTMoEWrapper.clear_buffer_cache()
    got = run_on_threads([lambda k=k, m=m: run_model(m, offset=k) for k, m in enumerate(models)])
    for k in range(2):
        for i in range(len(got[k])):
            assert torch.equal(got[k][i], alone[k][i]), (k, i)


def test_weights_are_not_replaced_under_a_forward(weights, checkpoint, monkeypatch):
    """load_weights and load_weights_from_tensors refuse at once (RuntimeError naming what
    is in flight) while a forward is submitted and not collected (on this thread too: the
    worker reads the weights when it runs it, so the forward got the new weights) or
    running on another thread; a forward on another thread while weights load is refused
    likewise. Afterwards the wrapper loads and computes as before."""
    wr = wrapper(checkpoint, 1)
    wr.load_weights_from_tensors(*weights[1])
    x, ids, w = inputs()
    alone = wr.forward(x, ids, w)
    release = threading.Event()
    compute = wr._compute
    monkeypatch.setattr(wr, "_compute", lambda *args: (release.wait(10), compute(*args))[1])
    wr.submit_forward(x, ids, w)  # queued on the worker, waiting for `release`
    for load in (lambda: wr.load_weights_from_tensors(*weights[2]), wr.load_weights):
        with pytest.raises(RuntimeError, match="forward submitted"):
            load()
    release.set()
    assert torch.equal(wr.sync_forward(x), alone)  # computed with the weights it was submitted with

    with forward_running_on_another_thread(wr, monkeypatch, x, ids, w) as results:
        with pytest.raises(RuntimeError, match="forward running"):
            wr.load_weights_from_tensors(*weights[2])
    assert len(results) == 1 and torch.equal(results[0], alone)

    loading, release = threading.Event(), threading.Event()
    pack = wr._pack_cpu_experts

    def slow_pack(*args):
        loading.set()
        assert release.wait(10)
        return pack(*args)

    monkeypatch.setattr(wr, "_pack_cpu_experts", slow_pack)
    loader = threading.Thread(target=wr.load_weights_from_tensors, args=weights[2])
    loader.start()
    try:
        assert loading.wait(10)
        for call in (lambda: wr.forward(x, ids, w), lambda: wr.submit_forward(x, ids, w),
                     lambda: wr.load_weights_from_tensors(*weights[2])):
            with pytest.raises(RuntimeError, match="being loaded|a load of its weights"):
                call()
    finally:
        release.set()
        loader.join(10)
    assert rel_err(wr.forward(x, ids, w), expected(x, ids, w, weights[2])) <= 1e-2
    wr.load_weights()  # the checkpoint's layer 1 again: free after the refused calls
    assert rel_err(wr.forward(x, ids, w), expected(x, ids, w, weights[1])) <= 1e-2


def test_submit_forward_runs_on_the_submitters_thread_count(weights, monkeypatch):
    """The worker thread runs submit_forward's kernels on as many threads as the caller
    set (kt_ops.set_num_threads, cpuinfer_threads): torch's count is per thread and was
    read once, on the worker's first torch call, so a later change was ignored there."""
    previous = kt_ops.get_num_threads()
    wr = wrapper()
    wr.load_weights_from_tensors(*weights[1])
    seen = []
    compute = wr._compute
    monkeypatch.setattr(wr, "_compute", lambda *args: (seen.append(kt_ops.get_num_threads()), compute(*args))[1])
    x, ids, w = inputs()
    try:
        for n in (2, 1, 3):
            kt_ops.set_num_threads(n)
            wr.submit_forward(x, ids, w)
            wr.sync_forward(x)
        KTMoEWrapper(2, E, K, H, I, method="BF16", cpuinfer_threads=1)
        wr.submit_forward(x, ids, w)
        wr.sync_forward(x)
    finally:
        kt_ops.set_num_threads(previous)
    assert seen == [2, 1, 3, 1]


def test_submit_forward_runs_in_the_submitters_grad_mode(weights):
    """The worker thread computes under the caller's autograd mode: under no_grad (and
    inference_mode) a submitted forward of rows that require grad returned a result that
    required grad, computed by the training operator (which also saves every slot's gate
    and up), as the worker thread's own mode is grad enabled."""
    wr = wrapper()
    wr.load_weights_from_tensors(*weights[1])
    x, ids, w = inputs()
    x.requires_grad_()
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            inline = wr.forward(x, ids, w)
            wr.submit_forward(x, ids, w)
            out = wr.sync_forward(x)
        assert not out.requires_grad and out.grad_fn is None, mode
        assert torch.equal(out, inline)
    wr.submit_forward(x, ids, w)
    assert wr.sync_forward(x).requires_grad  # with grad enabled the graph is kept, as forward keeps it


@pytest.mark.parametrize("method", ["BF16", "AMXINT8", "AMXINT4", "FP8", "MXFP4"])
def test_direct_forward_matches_the_general_path_bit_for_bit(weights, method):
    """forward()'s one-operator path (_direct_cpu_forward: inputs in their own dtype, one
    rounding of the operator's fp32 sums) gives the general path's bits (fp32 rows into
    the kernels, ``.to(dtype)`` after), for every input dtype, skipped slots, int64 ids,
    bf16 routing weights and non-contiguous rows; and is taken only where the call is one
    operator call: not with GPU slots, deferral or chunks."""
    H2 = 256  # FP8's 128-blocks, MXFP4's 32-groups
    layer = make_weights([0], E, H2, I, seed=3)[0]

    def built(**extra):
        wr = KTMoEWrapper(0, E, K, H2, I, method=method, group_size=None if method == "MXFP4" else 32, **extra)
        wr.load_weights_from_tensors(*layer)
        return wr

    wr = built()
    g = torch.Generator().manual_seed(5)
    for T in (1, 3, 17, 64):  # 64: 24 rows per expert, the tile paths
        rows = torch.randn(T, 2 * H2, generator=g)[:, ::2]  # non-contiguous
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        ids[0, -1] = -1
        routing = torch.rand(T, K, generator=g)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for id_dtype, w_dtype in ((torch.int32, torch.float32), (torch.int64, torch.bfloat16)):
                args = (rows.to(dtype), ids.to(id_dtype), routing.to(w_dtype))
                direct = wr._direct_cpu_forward(*args)
                assert direct is not None and direct.dtype == dtype
                general = wr._compute(*(t.contiguous() for t in args)).to(dtype)  # forward's other path
                assert torch.equal(wr.forward(*args), direct)
                assert torch.equal(direct, general), (T, dtype, id_dtype)
    _, ids, w = inputs()
    x = torch.randn(7, H2)
    mask = torch.zeros(E, dtype=torch.bool)
    mask[1] = True
    for other in (built(gpu_experts_mask=mask), built(max_deferred_experts_per_token=1), built(chunked_prefill_size=4)):
        assert other._direct_cpu_forward(x, ids, w) is None
    assert built(chunked_prefill_size=7)._direct_cpu_forward(x, ids, w) is not None


# A wrapper of 4 experts with weights and one call's inputs, for the fork() tests' scripts.
FORK_PRELUDE = """
import os, signal, torch
from kt_ops import KTMoEWrapper
E, H, I = 4, 64, 32
wr = KTMoEWrapper(0, E, 2, H, I, method="BF16")
wr.load_weights_from_tensors(torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I))
x, ids, w = torch.randn(2, H), torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2)
"""


def run_fork_script(code: str) -> subprocess.CompletedProcess:
    """Runs a fork() test's script (one OpenMP thread, 120 s at most); asserts it exited 0."""
    result = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, OMP_NUM_THREADS="1"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result


def test_forked_child_gets_its_own_worker_thread() -> None:
    """A fork()ed child has none of the parent's threads: submit_forward there must start a
    worker of its own, not queue on the parent's (which never runs: the child hung)."""
    code = FORK_PRELUDE + """
wr.submit_forward(x, ids, w)
expected = wr.sync_forward(x)  # the parent's worker thread exists now
pid = os.fork()
if pid == 0:
    signal.alarm(30)
    wr.submit_forward(x, ids, w)
    ok = torch.equal(wr.sync_forward(x), expected) and torch.equal(wr.forward(x, ids, w), expected)
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    result = run_fork_script(code)
    assert result.stdout.strip() == "0", "forked child hung (-14: killed by its alarm) or computed a different result"


def test_a_thread_outliving_the_main_thread_keeps_submitting() -> None:
    """A (non-daemon) serving thread still running layers when the main thread returns:
    the interpreter's exit shuts the worker thread's executor down before joining the
    thread, and every later submit_forward raised "cannot schedule new futures after
    shutdown". They must still compute, on the calling thread."""
    code = FORK_PRELUDE + """
import threading
wr.submit_forward(x, ids, w)
expected = wr.sync_forward(x)  # the worker thread exists
main_done = threading.Event()
def serve():
    assert main_done.wait(30)
    time.sleep(0.5)  # the main thread is in the interpreter's shutdown now
    for _ in range(3):
        wr.submit_forward(x, ids, w)
        assert torch.equal(wr.sync_forward(x), expected)
    print("served", flush=True)
threading.Thread(target=serve).start()
main_done.set()
"""
    result = subprocess.run([sys.executable, "-c", code.replace("import os", "import os, time", 1)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "served", result.stderr[-2000:]


def test_forked_child_fails_work_in_flight_at_fork_clearly() -> None:
    """Work on the parent's worker thread when fork() runs is never finished in the child
    (that thread is not there): sync_forward there must raise, not wait forever; the
    wrapper stays usable in the child and the parent gets its result."""
    code = FORK_PRELUDE + """
import threading
expected = wr.forward(x, ids, w)
release, compute = threading.Event(), wr._compute
wr._compute = lambda *args: (release.wait(30), compute(*args))[1]
wr.submit_forward(x, ids, w)  # in flight on the worker thread until released
pid = os.fork()
if pid == 0:
    signal.alarm(30)
    try:
        wr.sync_forward(x)
        os._exit(3)
    except RuntimeError as error:
        if "fork" not in str(error):
            os._exit(4)
    wr._compute = compute
    wr.submit_forward(x, ids, w)
    os._exit(0 if torch.equal(wr.sync_forward(x), expected) else 5)
release.set()
assert torch.equal(wr.sync_forward(x), expected)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    result = run_fork_script(code)
    assert result.stdout.strip() == "0", "forked child hung (-14: killed by its alarm) or did not raise"


def test_output_is_fresh_in_input_dtype_and_chunked(weights):
    x, ids, w = inputs(9)
    wr = wrapper(chunked_prefill_size=4)
    wr.load_weights_from_tensors(*weights[1])
    out = wr.forward(x.bfloat16(), ids, w)
    assert out.dtype == torch.bfloat16 and out.data_ptr() != x.data_ptr()
    assert rel_err(out, expected(x.bfloat16().float(), ids, w, weights[1])) <= 1e-2


def test_gguf_directory_with_map_and_mask(tmp_path):
    rng = np.random.default_rng(0)
    Hg, Ig = 256, 256
    layers = [{name: ("Q4_K" if name != "ffn_down_exps" else "Q6_K",
                      random_blocks("Q4_K" if name != "ffn_down_exps" else "Q6_K", E * r, k, rng).reshape(E, r, -1))
               for name, (r, k) in (("ffn_gate_exps", (Ig, Hg)), ("ffn_up_exps", (Ig, Hg)), ("ffn_down_exps", (Hg, Ig)))}
              for _ in range(2)]
    write_model(tmp_path / "m.gguf", layers, E, Hg, Ig)
    mapping = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0])
    mask = torch.zeros(E, dtype=torch.bool)
    mask[2] = True
    wr = KTMoEWrapper(1, E, 2, Hg, Ig, gpu_experts_mask=mask, weight_path=tmp_path, method="LLAMAFILE")
    wr.load_weights(mapping)
    x = torch.randn(5, Hg)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(5)])
    w = torch.rand(5, 2)
    logical = torch.where(mask[ids], -1, mapping[ids])
    want = kt_ops.moe_forward(x, logical, w, kt_ops.load_gguf_experts(tmp_path, 1))
    assert torch.allclose(wr.forward(x, ids, w), want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="LLAMAFILE"):
        KTMoEWrapper(1, E, 2, Hg, Ig, weight_path=tmp_path, method="AMXINT8").load_weights()


def test_cpu_save_keeps_the_weights_of_the_last_load(tmp_path, checkpoint, weights):
    """cpu_save's source_weights are those of the weights loaded last: a load of packed
    weights (a converted directory) left the tensors of the load before it there."""
    from kt_ops import convert

    out = tmp_path / "int8"
    assert convert.main([str(a) for a in ("--input-path", checkpoint, "--input-type", "bf16", "--output", out,
                                          "--quant-method", "int8")]) == 0
    wr = KTMoEWrapper(1, E, K, H, I, method="AMXINT8", cpu_save=True, weight_path=out, num_gpu_experts=2)
    wr.load_weights_from_tensors(*weights[2])
    assert wr.source_weights is not None and torch.equal(wr.source_weights[0], weights[2][0][2:])
    wr.load_weights()
    assert wr.source_weights is None
    wr.load_weights_from_tensors(*weights[1])
    assert torch.equal(wr.source_weights[2], weights[1][2][2:])


def test_generate_gpu_experts_masks_is_global():
    freq = torch.tensor([[0.1, 0.5, 0.3, 0.8], [0.2, 0.4, 0.9, 0.1]])
    masks = generate_gpu_experts_masks(freq, 3)
    assert masks.dtype == torch.bool
    assert masks.tolist() == [[False, True, False, True], [False, False, True, False]]
    assert not generate_gpu_experts_masks(freq, 0).any() and generate_gpu_experts_masks(freq, 8).all()
    # kt-kernel clamps the count to [0, L * E] (its test_generate_gpu_experts_masks.py)
    assert generate_gpu_experts_masks(freq, 9).all() and generate_gpu_experts_masks(freq, 1000).all()
    assert not generate_gpu_experts_masks(freq, -1).any()
    with pytest.raises(TypeError):
        generate_gpu_experts_masks(freq, 2.5)
    with pytest.raises(ValueError):
        generate_gpu_experts_masks(freq[0], 2)


def test_capture_batch_sizes():
    KTMoEWrapper.set_capture_batch_sizes([8, 1, 4, 4])
    assert KTMoEWrapper.get_capture_batch_sizes() == [1, 4, 8]
    with pytest.raises(ValueError):
        KTMoEWrapper.set_capture_batch_sizes([0])
    KTMoEWrapper.set_capture_batch_sizes([])


@pytest.mark.parametrize("sizes", [[2.5], [True], ["4"], [8, 1.0]])
def test_capture_batch_sizes_must_be_ints(sizes: list) -> None:
    """A batch size that is not an int is a ValueError naming it (2.5 was reserved as 2, True as 1 and "4" as 4,
    silently: graphs captured at the size the caller meant found no staging); the sizes kept are unchanged."""
    KTMoEWrapper.set_capture_batch_sizes([4])
    try:
        with pytest.raises(ValueError, match="batch sizes must be positive ints"):
            KTMoEWrapper.set_capture_batch_sizes(sizes)
        assert KTMoEWrapper.get_capture_batch_sizes() == [4]
        KTMoEWrapper.set_capture_batch_sizes([np.int64(2), torch.tensor(3)])  # integer scalars are ints
        assert KTMoEWrapper.get_capture_batch_sizes() == [2, 3]
    finally:
        KTMoEWrapper.set_capture_batch_sizes([])


@pytest.mark.parametrize("kwargs,match", [
    ({"top_k": 9}, "exceeds num_experts"),
    ({"gpu_experts_mask": torch.zeros(7, dtype=torch.bool)}, "shape \\[8\\]"),
    ({"gpu_experts_mask": torch.zeros(8, dtype=torch.bool), "num_gpu_experts": 2}, "not both"),
    ({"method": "GGML_Q4"}, "not available"),
    ({"method": "NOPE"}, "not available"),
    ({"threadpool_count": 2, "cpuinfer_threads": 1}, "cpuinfer_threads"),
    ({"cpuinfer_threads": True}, "cpuinfer_threads"),  # set torch's threads to 1
    ({"cpuinfer_threads": 2.0}, "cpuinfer_threads"),
    ({"cpuinfer_threads": 10**6}, "cpuinfer_threads .* must be at most"),  # torch's pool segfaulted starting them
    ({"threadpool_count": 3}, "must divide"),
    ({"numa_nodes": [0, 1]}, "numa_nodes"),
    ({"max_deferred_experts_per_token": 4}, "max_deferred"),
    # a fraction or a bool deferred a rounded number of experts silently
    ({"max_deferred_experts_per_token": 1.5}, "max_deferred_experts_per_token must be an int"),
    ({"max_deferred_experts_per_token": True}, "max_deferred_experts_per_token must be an int"),
    # these failed only at the first forward, with a TypeError from inside the chunking
    ({"chunked_prefill_size": 2.5}, "chunked_prefill_size must be a positive int"),
    ({"chunked_prefill_size": True}, "chunked_prefill_size must be a positive int"),
    ({"num_experts": 0}, "num_experts"),
    # accepted here, refused only by load_weights
    ({"method": "AMXINT4", "group_size": 64.0}, "group_size must be an int"),
    ({"method": "AMXINT4", "group_size": True}, "group_size must be an int"),
    # a string kept the source tensors (cpu_save="no", "False"): every non-empty one is truthy
    ({"cpu_save": "no"}, "cpu_save must be a bool"),
    ({"cpu_save": None}, "cpu_save must be a bool"),
    ({"mode": "sft"}, "mode must be 'inference'"),
])
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        wrapper(**kwargs)


def test_mode_inference_is_kt_kernels_default(weights) -> None:
    """kt-kernel 0.7.2's KTMoEWrapper takes ``mode="inference"`` (its default; keyword or the argument after
    numa_nodes) and the same forward as without it; kt_ops raised TypeError (unexpected keyword 'mode')."""
    gate, up, down = weights[1]
    plain = wrapper()
    plain.load_weights_from_tensors(gate, up, down)
    given = wrapper(mode="inference")
    given.load_weights_from_tensors(gate, up, down)
    positional = KTMoEWrapper(1, E, K, H, I, None, 1, 1, None, 512, False, 0, "BF16", None, "inference")
    positional.load_weights_from_tensors(gate, up, down)
    x = torch.randn(3, H).bfloat16()
    ids = torch.tensor([[0, 1, 5], [2, 3, 6], [4, -1, 7]])
    w = torch.rand(3, K)
    expected = plain.forward(x, ids, w, None)
    assert torch.equal(given.forward(x, ids, w, None), expected)
    assert torch.equal(positional.forward(x, ids, w, None), expected)


@pytest.mark.parametrize("mask", ["01010101", [[True], [False, True]], torch.zeros(E, dtype=torch.bool, device="meta")])
def test_a_gpu_experts_mask_torch_cannot_read_is_named(mask: object) -> None:
    """A gpu_experts_mask torch cannot make a tensor of (a string, ragged lists) or read (meta) is a ValueError naming
    it (was torch's TypeError "new(): invalid data type 'str'", ValueError or NotImplementedError)."""
    with pytest.raises(ValueError, match=r"gpu_experts_mask must be a bool tensor of shape \[8\]"):
        wrapper(gpu_experts_mask=mask)


def test_numa_nodes_that_is_not_a_sequence_is_named():
    with pytest.raises(TypeError, match="numa_nodes must be a sequence"):  # was "'int' object is not iterable"
        wrapper(numa_nodes=0)


def test_bad_weights(tmp_path, checkpoint, weights):
    with pytest.raises(KeyError, match="layer 0"):  # dense layer: no experts
        wrapper(checkpoint, 0).load_weights()
    with pytest.raises(ValueError, match="hold 8 experts"):
        wrapper(checkpoint, 1, num_experts=9).load_weights()
    with pytest.raises(ValueError, match="physical_to_logical_map"):
        wrapper(checkpoint, 1).load_weights(torch.arange(7))
    with pytest.raises(ValueError, match="gate_proj.weight' has shape"):
        KTMoEWrapper(1, E, K, 32, I, weight_path=checkpoint, method="BF16").load_weights()
    broken = write_checkpoint(tmp_path / "broken", weights, skip=("model.layers.1.mlp.experts.5.up_proj.weight",))
    with pytest.raises(KeyError, match="experts.5.up_proj.weight"):
        wrapper(broken, 1).load_weights()
    with pytest.raises(FileNotFoundError):
        wrapper(tmp_path / "nowhere", 1).load_weights()
    with pytest.raises(ValueError, match="gate_proj must be"):
        wrapper().load_weights_from_tensors(weights[1][1][:, :, :32], *weights[1][1:])
    with pytest.raises(ValueError, match="up_proj is on the meta device"):  # was NotImplementedError from .cpu()
        wrapper().load_weights_from_tensors(weights[1][0], weights[1][1].to("meta"), weights[1][2])
    wr = wrapper()
    with pytest.raises(RuntimeError, match="load_weights"):
        wr.forward(*inputs())
    wr.load_weights_from_tensors(*weights[1])
    x, ids, w = inputs()
    with pytest.raises(ValueError, match="num_experts"):
        wr.forward(x, ids + E, w)
    deferring = wrapper(max_deferred_experts_per_token=1)
    deferring.load_weights_from_tensors(*weights[1])
    with pytest.raises(ValueError, match="num_experts"):  # was RuntimeError from the deferral's scatter
        deferring.forward(x, ids + 2 * E, w)
    with pytest.raises(ValueError, match="hidden_states"):
        wr.forward(x[:, :32], ids, w)
    for k in (K - 1, K + 1):  # K other than num_experts_per_tok: deferral and graph buffers are sized by it
        with pytest.raises(ValueError, match=f"num_experts_per_tok = {K}"):
            wr.forward(x, torch.zeros(x.shape[0], k, dtype=ids.dtype), torch.full((x.shape[0], k), 0.5))


@pytest.mark.parametrize("which", [1, 2])
def test_weights_of_unequal_expert_counts_are_named(weights, which: int) -> None:
    """gate_proj, up_proj and down_proj holding different expert counts is a ValueError naming
    them (was an IndexError from indexing the shorter one by the slots of gate_proj's)."""
    tensors = list(weights[1])
    tensors[which] = tensors[which][: E // 2]
    with pytest.raises(ValueError, match="gate_proj, up_proj and down_proj must hold the same number of experts"):
        wrapper().load_weights_from_tensors(*tensors)


MEMORY_PROBE = r"""
import sys, torch, kt_ops
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
wr = kt_ops.KTMoEWrapper(3, 8, 2, 1024, 512, weight_path=sys.argv[1], method="AMXINT8")
torch.zeros(1)
base = rss("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM)
wr.load_weights()
print(rss("VmHWM:") - base)
"""


@pytest.mark.slow
def test_loading_streams_one_layer(tmp_path):
    """Peak extra memory while loading one layer stays a small multiple of that layer."""
    layers = list(range(8))
    ws = make_weights(layers, 8, 1024, 512, seed=9)
    path = write_checkpoint(tmp_path / "big", ws, shards=4)
    del ws
    layer_bytes = 3 * 8 * 1024 * 512 * 2  # bf16 on disk
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    peak = int(done.stdout.split()[-1])
    assert peak < 4 * layer_bytes < len(layers) * layer_bytes, f"peak {peak / 2**20:.0f} MiB"


def test_a_wrapper_says_what_it_is_and_refuses_to_be_copied() -> None:
    """copy.deepcopy / pickle of a KTMoEWrapper failed deep inside with "cannot pickle
    '_thread.lock' object", naming no wrapper; its repr was Python's default."""
    import copy
    import pickle

    wr = KTMoEWrapper(3, E, 2, H, I, method="AMXINT8", threadpool_count=1)
    assert repr(wr) == (f"KTMoEWrapper(layer_idx=3, num_experts={E}, num_experts_per_tok=2, hidden_size={H}, "
                        f"moe_intermediate_size={I}, method='AMXINT8', threadpool_count=1, cpu_parts=0)")
    for copier in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match="a KTMoEWrapper cannot be pickled or copied.*load_weights"):
            copier(wr)


@pytest.mark.parametrize("threadpool_count", [1, 2])
@pytest.mark.parametrize("placement", ["map", "mask"])
def test_a_non_finite_weight_names_the_weights_expert(threadpool_count: int, placement: str) -> None:
    """A NaN in expert 5 of the weights given was named by its position among the CPU
    experts packed ("expert 6" under a reversing map, "expert 2" with three GPU slots)."""
    g = torch.Generator().manual_seed(2)
    gate, up, down = (torch.randn(E, *shape, generator=g) * 0.1 for shape in ((I, H), (I, H), (H, I)))
    gate[5, 40, 3] = float("nan")
    wr = KTMoEWrapper(0, E, K, H, I, method="BF16", threadpool_count=threadpool_count,
                      num_gpu_experts=3 if placement == "mask" else None)
    with pytest.raises(ValueError, match=r"^gate_proj: expert 5, row 40 holds nan"):
        wr.load_weights_from_tensors(gate, up, down, list(range(E))[::-1] if placement == "map" else None)
