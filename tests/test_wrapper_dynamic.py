"""KTMoEWrapper(dynamic_gpu_experts=True): every slot packed and ``gpu_experts_mask`` read at
each forward, so an in-place ``wrapper.gpu_experts_mask.copy_(mask)`` (kt-kernel's
semantics, SGLang's dynamic expert update) moves experts between GPU and CPU; without it an
in-place change is refused at the next forward instead of computing with stale slots."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_helpers import make_weights, write_checkpoint

import kt_ops.cuda
from kt_ops import KTMoEWrapper

E, K, H, I = 8, 3, 64, 64
FIRST, LATER = [1, 5], [0, 5]  # slot 5 stays on the GPU, 1 comes back to the CPU, 0 leaves it


@pytest.fixture(scope="module")
def weights():
    return make_weights([1], E, H, I, seed=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, weights) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("dyn") / "model", weights)


@pytest.fixture(autouse=True)
def _no_pending():
    yield
    KTMoEWrapper.clear_buffer_cache()


def mask(slots: list[int]) -> torch.Tensor:
    m = torch.zeros(E, dtype=torch.bool)
    m[slots] = True
    return m


def wrapper(weights, slots: list[int], dynamic: bool | None = False, method: str = "BF16", **kw) -> KTMoEWrapper:
    wr = KTMoEWrapper(1, E, K, H, I, gpu_experts_mask=mask(slots), method=method, dynamic_gpu_experts=dynamic, **kw)
    if "weight_path" in kw:
        wr.load_weights()
    else:
        wr.load_weights_from_tensors(*weights[1], physical_to_logical_map=torch.arange(E).roll(3))
    return wr


def inputs(T: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, ids, torch.rand(T, K, generator=g)


def test_an_in_place_mask_update_moves_experts(weights):
    dyn = wrapper(weights, FIRST, dynamic=True)
    x, ids, w = inputs()
    torch.testing.assert_close(dyn.forward(x, ids, w), wrapper(weights, FIRST).forward(x, ids, w), rtol=0, atol=0)
    dyn.gpu_experts_mask.copy_(mask(LATER))  # as SGLang's update_kt_wrapper_masks does
    torch.testing.assert_close(dyn.forward(x, ids, w), wrapper(weights, LATER).forward(x, ids, w), rtol=0, atol=0)
    assert kt_ops.PackedExperts(dyn._parts[0].data).num_experts == E  # every slot packed


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
def test_dynamic_slots_from_a_checkpoint(weights, checkpoint, method: str):
    dyn = wrapper(weights, FIRST, dynamic=True, method=method, weight_path=checkpoint, threadpool_count=2, group_size=32)
    x, ids, w = inputs(seed=1)
    dyn.gpu_experts_mask.copy_(mask(LATER))
    fixed = wrapper(weights, LATER, method=method, weight_path=checkpoint, threadpool_count=2, group_size=32)
    torch.testing.assert_close(dyn.forward(x, ids, w), fixed.forward(x, ids, w), rtol=0, atol=0)


def test_an_in_place_change_without_dynamic_is_refused(weights):
    fixed = wrapper(weights, FIRST)
    x, ids, w = inputs()
    fixed.forward(x, ids, w)
    fixed.gpu_experts_mask.copy_(mask(LATER))
    with pytest.raises(RuntimeError, match="dynamic_gpu_experts=True"):
        fixed.forward(x, ids, w)
    fixed.gpu_experts_mask.copy_(mask(FIRST))  # back to what was loaded: fine again
    fixed.forward(x, ids, w)
    with pytest.raises(ValueError, match="dynamic_gpu_experts must be a bool"):
        KTMoEWrapper(1, E, K, H, I, dynamic_gpu_experts=1)



@pytest.mark.parametrize("dynamic", [True, False])
def test_a_replaced_mask_of_another_type_is_named(weights, dynamic: bool):
    """A mask replaced by an int tensor, a shorter one or a list failed inside torch.where /
    torch.equal (RuntimeError, TypeError)."""
    wr = wrapper(weights, FIRST, dynamic=dynamic)
    x, ids, w = inputs()
    for bad in (mask(FIRST).long(), mask(FIRST)[:-1], mask(FIRST).tolist()):
        wr.gpu_experts_mask = bad
        with pytest.raises(ValueError, match=rf"gpu_experts_mask must be a bool tensor of shape \[{E}\]"):
            wr.forward(x, ids, w)
    # every slot on the GPU, none packed: the list failed in ~mask before the check (TypeError)
    every = wrapper(weights, list(range(E)), dynamic=dynamic)
    every.gpu_experts_mask = mask(list(range(E))).tolist()
    with pytest.raises(ValueError, match=rf"gpu_experts_mask must be a bool tensor of shape \[{E}\]"):
        every.forward(x, ids, w)

def test_a_dynamic_gpu_slot_can_be_staged(weights):
    """kt-kernel stages any slot (every expert is in host memory): so does a dynamic wrapper."""
    dyn, fixed = wrapper(weights, FIRST, dynamic=True), wrapper(weights, [])
    got, want = (kt_ops.staging.stage_expert(w._parts, int(w._route_all[5]), 1)[0] for w in (dyn, fixed))
    assert torch.equal(got.w13_weight, want.w13_weight) and torch.equal(got.w2_weight, want.w2_weight)
    dyn.submit_write_weight_scale_to_buffer(1, 5, [torch.empty_like(got.w13_weight)], [None],
                                            [torch.empty_like(got.w2_weight)], [None])
    dyn.sync_write_weight_scale_to_buffer()
    with pytest.raises(ValueError, match="GPU expert"):
        wrapper(weights, FIRST).submit_write_weight_scale_to_buffer(1, 5, [0], [0], [0], [0])


def test_the_environment_turns_it_on(weights, monkeypatch: pytest.MonkeyPatch):
    """KT_OPS_DYNAMIC_GPU_EXPERTS=1: for wrappers a serving engine constructs (SGLang does not
    pass kt_ops' keyword); an explicit keyword wins."""
    monkeypatch.setenv("KT_OPS_DYNAMIC_GPU_EXPERTS", "1")
    assert KTMoEWrapper(1, E, K, H, I).dynamic_gpu_experts
    assert not KTMoEWrapper(1, E, K, H, I, dynamic_gpu_experts=False).dynamic_gpu_experts
    via_env = wrapper(weights, FIRST, dynamic=None)
    x, ids, w = inputs()
    via_env.gpu_experts_mask.copy_(mask(LATER))
    torch.testing.assert_close(via_env.forward(x, ids, w), wrapper(weights, LATER).forward(x, ids, w), rtol=0, atol=0)
    monkeypatch.setenv("KT_OPS_DYNAMIC_GPU_EXPERTS", "yes")
    with pytest.raises(ValueError, match="KT_OPS_DYNAMIC_GPU_EXPERTS must be 0 or 1"):
        KTMoEWrapper(1, E, K, H, I)
    monkeypatch.setenv("KT_OPS_DYNAMIC_GPU_EXPERTS", "0")
    assert not KTMoEWrapper(1, E, K, H, I).dynamic_gpu_experts


needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not kt_ops.cuda.is_built(),
    reason="needs a GPU (torch.cuda.is_available() is False here) and kt_ops built with its CUDA key",
)


@needs_gpu
def test_mask_update_reaches_a_captured_graph(weights):
    dyn = wrapper(weights, FIRST, dynamic=True)
    assert dyn.gpu_experts_mask.is_pinned()
    KTMoEWrapper.set_capture_batch_sizes([9])
    static = [t.cuda() for t in inputs()]
    dyn.forward(*static)  # eager warm-up: routing state on the device
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dyn.forward(*static)
    dyn.gpu_experts_mask.copy_(mask(LATER))
    graph.replay()
    torch.cuda.synchronize()
    x, ids, w = inputs()
    torch.testing.assert_close(out.cpu(), wrapper(weights, LATER).forward(x, ids, w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("parts", [1, 2])
def test_dynamic_slots_from_an_mxfp4_checkpoint(tmp_path: Path, parts: int):
    """A gpt-oss MXFP4 checkpoint (biases, alpha-SwiGLU) read in place into format mxfp4:
    after an in-place mask change, the same bits as a wrapper built with the new mask."""
    from test_mxfp4_checkpoint import E as ME, H as MH, I as MI, write_gpt_oss

    write_gpt_oss(tmp_path, torch.Generator().manual_seed(11))

    def make(slots: list[int], dynamic: bool) -> KTMoEWrapper:
        m = torch.zeros(ME, dtype=torch.bool)
        m[slots] = True
        wr = KTMoEWrapper(1, ME, 2, MH, MI, gpu_experts_mask=m, method="MXFP4", weight_path=tmp_path,
                          dynamic_gpu_experts=dynamic, threadpool_count=parts)
        wr.load_weights()
        return wr

    dyn = make([1], True)
    assert {p.format for p in dyn._parts} == {"mxfp4"} and dyn._parts[0].num_experts == ME
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, MH, generator=g)
    ids = torch.stack([torch.randperm(ME, generator=g)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=g)
    dyn.gpu_experts_mask.copy_(torch.tensor([True, False, False, False]))
    torch.testing.assert_close(dyn.forward(x, ids, w), make([0], False).forward(x, ids, w), rtol=0, atol=0)
