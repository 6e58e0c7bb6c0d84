"""Dynamic GPU experts (issue 21, part 3): HybridMoE(dynamic=True) moves experts between the
torch ("GPU") side and the packed CPU side at run time — every expert packed, slots refilled
from host weights, expert lists and slot map updated in place — so a compiled function or a
captured CUDA graph keeps computing the right layer; rebalancing from ExpertStats as SGLang
picks the hot experts. The same for the experts modules of the transformers path
(patch_model's other architectures, kt_ops.hf_experts). On this machine the "GPU" side is
torch on the CPU device; the CUDA graph tests run where a GPU is present."""

from __future__ import annotations

import re

import pytest
import torch

import kt_ops
from conftest import logits_bound

E, K, H, I = 8, 2, 64, 32


def weights(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    def rand(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).float()  # bf16-exact
    return rand(E, H, scale=1.0), rand(E, I, H), rand(E, I, H), rand(E, H, I)


def layer(mask: list[int], dynamic: bool = False, device: str = "cpu") -> kt_ops.HybridMoE:
    router, gate, up, down = weights()
    gpu = torch.zeros(E, dtype=torch.bool)
    gpu[mask] = True
    return kt_ops.HybridMoE(router, gate, up, down, kt_ops.Routing(K), gpu_experts_mask=gpu, dynamic=dynamic,
                            layer_idx=0).to(device)


def tokens(n: int = 9, device: str = "cpu") -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(1)).to(device)


def close(a: torch.Tensor, b: torch.Tensor, bound: float = 1e-5) -> bool:
    return float((a - b).norm() / b.norm()) <= bound


def test_dynamic_layer_computes_what_a_fixed_one_computes():
    x = tokens()
    assert close(layer([0, 1], dynamic=True)(x), layer([0, 1])(x))
    dyn = layer([0, 1], dynamic=True)
    assert kt_ops.PackedExperts(dyn.packed).num_experts == E  # every expert packed for the CPU
    assert dyn.cpu_index.tolist() == [-1, -1, 2, 3, 4, 5, 6, 7]


def test_update_moves_experts_in_place():
    x = tokens()
    dyn = layer([0, 1], dynamic=True)
    buffers = {name: t.data_ptr() for name, t in dyn.named_buffers()}
    dyn.update_gpu_experts([6, 3])
    assert dyn.gpu_experts.tolist() == [3, 6]
    assert dyn.cpu_index.tolist() == [0, 1, 2, -1, 4, 5, -1, 7]
    assert {name: t.data_ptr() for name, t in dyn.named_buffers()} == buffers  # nothing reallocated
    assert close(dyn(x), layer([3, 6])(x))
    dyn.update_gpu_experts(torch.tensor([3, 7]))  # slot 0 keeps expert 3, slot 1 refilled
    assert close(dyn(x), layer([3, 7])(x))


def test_rebalance_picks_the_most_activated():
    dyn = layer([0, 1], dynamic=True)
    counts = torch.tensor([5, 0, 9, 1, 9, 3, 2, 8])
    assert dyn.rebalance(counts).tolist() == [2, 4]
    assert dyn.gpu_experts.tolist() == [2, 4]


def test_bad_updates_are_refused():
    with pytest.raises(RuntimeError, match="dynamic=True"):
        layer([0, 1]).update_gpu_experts([2, 3])
    dyn = layer([0, 1], dynamic=True)
    for ids, match in (([2], "2 integer expert ids"), ([2, 2], "distinct"), ([2, 8], r"in \[0, 8\)"),
                       (torch.tensor([1.0, 2.0]), "integer")):
        with pytest.raises(ValueError, match=match):
            dyn.update_gpu_experts(ids)
    with pytest.raises(ValueError, match=r"counts must be \[8\]"):
        dyn.rebalance(torch.ones(7))
    # complex ids and counts: the imaginary part was dropped (a UserWarning), the rest taken
    with pytest.raises(ValueError, match="integer"):
        dyn.update_gpu_experts(torch.tensor([2, 3]) + 0.5j)
    with pytest.raises(ValueError, match="real"):
        dyn.rebalance(torch.arange(8) * 1j)
    with pytest.raises(ValueError, match="NaN"):  # topk ranked NaN first: expert 0 went to the GPU silently
        dyn.rebalance(torch.tensor([float("nan"), 0, 9, 1, 9, 3, 2, 8]))
    assert dyn.gpu_experts.tolist() == [0, 1]  # unchanged by the refusals


@pytest.mark.parametrize("bad", [-1, -0.5, float("inf"), float("-inf")])
def test_negative_or_infinite_counts_are_refused(bad):
    """Activation counts are finite and non-negative: a negative count (a stats row gone
    wrong) ranked its expert below the idle ones and an infinite one above every other,
    silently; most_activated refused only NaN and complex counts."""
    dyn = layer([0, 1], dynamic=True)
    counts = torch.tensor([bad, 0, 9, 1, 9, 3, 2, 8], dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"counts must be finite and non-negative.*{bad}"):
        dyn.rebalance(counts)
    if isinstance(bad, int):
        with pytest.raises(ValueError, match="non-negative"):
            dyn.rebalance(counts.long())
    assert dyn.gpu_experts.tolist() == [0, 1]  # unchanged by the refusals


def test_a_dynamic_that_is_not_a_bool_is_refused():
    """HybridMoE(dynamic="no") packed every expert and kept host copies (bool("no") is True)."""
    router, gate, up, down = weights()
    with pytest.raises(ValueError, match="dynamic must be a bool"):
        kt_ops.HybridMoE(router, gate, up, down, kt_ops.Routing(K), dynamic="no")


@pytest.mark.parametrize("kwargs", [{"top_k": True}, {"top_k": 1.5}, {"top_k": 2, "num_groups": 2.0},
                                    {"top_k": 2, "routed_scaling_factor": float("nan")}])
def test_bad_routing_is_refused(kwargs):
    """A bool or fractional count passed the comparisons (True: one expert per token; 1.5:
    a TypeError from topk at the first forward); a NaN scale made every output NaN."""
    with pytest.raises(ValueError, match="must be"):
        kt_ops.Routing(**kwargs)
    routing = kt_ops.Routing(2, scoring="sigmoid", num_groups=8, topk_groups=2)  # groups of one expert
    with pytest.raises(ValueError, match="at least 2 experts per group"):  # was RuntimeError from topk(2)
        routing.select(torch.randn(3, 8))


@pytest.mark.parametrize("routing, match", [
    (dict(top_k=2, num_groups=3, topk_groups=1), "8 experts do not split into 3 groups"),
    (dict(top_k=2, scoring="sigmoid", num_groups=8, topk_groups=2), "at least 2 experts per group"),
    (dict(top_k=3, num_groups=4, topk_groups=1), r"top_k \(3\) exceeds the 2 experts of the 1 kept group"),
    (dict(top_k=5, scoring="sigmoid", num_groups=4, topk_groups=2), r"top_k \(5\) exceeds the 4 experts"),
])
def test_bad_groups_are_refused_when_the_layer_is_built(routing: dict, match: str):
    """Groups that do not split the experts were refused only at the first forward, and a
    top_k above the experts the kept groups hold never: the rest were taken from dropped
    groups (weight 0 with softmax, the unbiased score with a bias), silently. Both are a
    ValueError from the HybridMoE constructor (E known) and still from Routing.select."""
    router, gate, up, down = weights()
    bias = torch.zeros(E) if routing.get("scoring") == "sigmoid" else None
    with pytest.raises(ValueError, match=match):
        kt_ops.HybridMoE(router, gate, up, down, kt_ops.Routing(**routing), e_score_correction_bias=bias)
    with pytest.raises(ValueError, match=match):
        kt_ops.Routing(**routing).select(torch.randn(3, E), bias)
    good = kt_ops.Routing(**{**routing, "top_k": 2, "num_groups": 4, "topk_groups": 2})  # 4 kept experts
    assert kt_ops.HybridMoE(router, gate, up, down, good, e_score_correction_bias=bias)(tokens()).shape == (9, H)


def test_update_fills_slots_from_the_weights_the_layer_was_built_with():
    """The host weights GPU slots are refilled from are a copy: without CUDA they were the
    caller's tensors themselves, so a caller reusing them (the next layer's weights read
    into the same buffers) changed what an update moved to the GPU slots, silently."""
    x = tokens()
    router, gate, up, down = weights()
    dyn = kt_ops.HybridMoE(router, gate, up, down, kt_ops.Routing(K), gpu_experts_mask=torch.arange(E) < 2,
                           dynamic=True, layer_idx=0)
    for tensor in (gate, up, down):
        tensor.mul_(-3.0)  # the caller's buffers, reused
    dyn.update_gpu_experts([3, 6])
    assert close(dyn(x), layer([3, 6])(x))


def test_update_after_loading_other_experts_is_refused():
    """The host copies GPU slots are refilled from are the constructor's weights, not in the
    state dict: after load_state_dict of other experts an update computed the old experts
    in the refilled slots, silently. Loading the same experts (moved or not) still updates."""
    x = tokens()
    router, gate, up, down = weights(seed=7)
    other = kt_ops.HybridMoE(router, gate, up, down, kt_ops.Routing(K), gpu_experts_mask=torch.arange(E) < 2,
                             dynamic=True, layer_idx=0)
    dyn = layer([0, 1], dynamic=True)
    dyn.load_state_dict(other.state_dict())
    assert close(dyn(x), other(x))
    with pytest.raises(RuntimeError, match="load_state_dict replaced"):
        dyn.update_gpu_experts([2, 3])
    moved = layer([0, 1], dynamic=True)
    moved.update_gpu_experts([4, 5])
    same = layer([0, 1], dynamic=True)
    same.load_state_dict(moved.state_dict())
    same.update_gpu_experts([3, 6])
    assert close(same(x), layer([3, 6])(x))

def test_compiled_layer_sees_the_update():
    x = tokens()
    dyn = layer([0, 1], dynamic=True)
    torch._dynamo.reset()
    compiled = torch.compile(dyn, fullgraph=True)
    assert close(compiled(x), dyn(x))
    dyn.update_gpu_experts([4, 5])
    assert close(compiled(x), layer([4, 5])(x))


def test_patched_model_rebalances_from_statistics():
    transformers = pytest.importorskip("transformers")
    from hf_models import tiny_model

    model = tiny_model("qwen3_moe").float()
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    kt_ops.patch_model(model, "BF16", num_gpu_experts=2, dynamic_gpu_experts=True)
    with kt_ops.ExpertStats(num_hidden_layers=2) as stats, torch.no_grad():
        model(ids)
    assert kt_ops.rebalance_gpu_experts(model, stats) == 2
    for moe in (m for m in model.modules() if isinstance(m, kt_ops.HybridMoE)):
        counts = stats.counts[moe.layer_idx]
        assert moe.gpu_experts.tolist() == sorted(torch.topk(counts.double(), 2).indices.tolist())
    with torch.no_grad():
        assert close(model(ids).logits, want, logits_bound())
    del transformers


def test_rebalance_gpu_experts_checks_its_counts():
    """A [buffer, L, E] tensor (SGLang's logical_count as dumped) rebalanced nothing and
    returned 0, silently (its one row was taken as layer 0's); a numpy array was read as a
    file path ("... is not a torch.save file"); a [E] row failed in most_activated ("got ()")."""
    moe = layer([0, 1], dynamic=True)
    moe.layer_idx = 1
    model = torch.nn.ModuleList([moe])
    counts = torch.tensor([[0] * E, [0, 0, 0, 0, 0, 0, 5, 9]])
    for bad, match in ((counts[None], r"\[num_hidden_layers, E\]"), (counts[1], r"\[num_hidden_layers, E\]"),
                       (counts.numpy(), "ndarray"), (counts.bool(), "real")):
        with pytest.raises(ValueError, match=match):
            kt_ops.rebalance_gpu_experts(model, bad)
    assert moe.gpu_experts.tolist() == [0, 1]
    assert kt_ops.rebalance_gpu_experts(model, counts) == 1 and moe.gpu_experts.tolist() == [6, 7]


def test_a_bad_row_moves_no_layer():
    """Counts whose row of a later layer is bad (a negative count, another expert count)
    raised after the layers before it had moved: half a model rebalanced."""
    first, second = layer([0, 1], dynamic=True), layer([0, 1], dynamic=True)
    first.layer_idx, second.layer_idx = 0, 1
    model = torch.nn.ModuleList([first, second])
    for row in (torch.tensor([0, 0, 0, 0, 0, -1, 0, 0]), torch.tensor([1, 2])):
        counts = torch.zeros(2, row.numel(), dtype=torch.long)
        counts[0, -2:] = 9
        counts[1] = row
        with pytest.raises(ValueError, match="counts must"):
            kt_ops.rebalance_gpu_experts(model, counts)
        assert first.gpu_experts.tolist() == [0, 1] and second.gpu_experts.tolist() == [0, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_update_under_a_captured_cuda_graph():
    x = tokens(device="cuda")
    dyn = layer([0, 1], dynamic=True, device="cuda")
    dyn.set_capture_batch_sizes([x.shape[0]], x.device)
    dyn(x)  # warm-up: allocations outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dyn(x)
    dyn.update_gpu_experts([4, 7])
    graph.replay()
    torch.cuda.synchronize()
    assert close(out.cpu(), layer([4, 7])(x.cpu()), 1e-2)


# ---- the transformers experts path (kt_ops.hf_experts) -------------------------------


def hf_model(arch: str, gpu: list[list[int]] | None = None, dynamic: bool = False) -> torch.nn.Module:
    """A tiny ``arch`` model (fp32, bf16-exact weights) patched through the experts
    interface, experts ``gpu[layer]`` kept in torch."""
    pytest.importorskip("transformers")
    from hf_models import tiny_model

    model = tiny_model(arch).float()
    mask = None
    if gpu is not None:
        mask = torch.zeros(len(gpu), E, dtype=torch.bool)
        for row, ids in enumerate(gpu):
            mask[row, ids] = True
    return kt_ops.patch_model(model, "BF16", gpu_experts_mask=mask, dynamic_gpu_experts=dynamic)


def experts_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    from kt_ops import hf_experts

    return [m for m in model.modules() if hf_experts.is_experts_module(m)]


IDS = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(3))


def hf_logits(model: torch.nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("arch", ["gpt_oss", "olmoe"])  # with and without expert biases
def test_experts_path_dynamic_layout_computes_the_fixed_one(arch: str):
    from kt_ops import hf_experts

    dyn = hf_model(arch, [[0, 1], [2, 5]], dynamic=True)
    for module in experts_of(dyn):
        assert hf_experts.is_dynamic(module)
        assert kt_ops.PackedExperts(hf_experts.packed_blob(module)).num_experts == E  # every expert packed
    assert close(hf_logits(dyn), hf_logits(hf_model(arch, [[0, 1], [2, 5]])), 1e-6)


@pytest.mark.parametrize("arch", ["gpt_oss", "olmoe"])
def test_experts_path_update_moves_experts_in_place(arch: str):
    from kt_ops import hf_experts

    dyn = hf_model(arch, [[0, 1], [2, 5]], dynamic=True)
    modules = experts_of(dyn)
    held = [[t.data_ptr() for t in hf_experts.local_experts(m) if t is not None] for m in modules]
    hf_experts.update_local_experts(modules[0], [6, 3])
    hf_experts.update_local_experts(modules[1], torch.tensor([5, 7]))  # slot 1 keeps 5, slot 0 refilled
    assert [hf_experts.local_experts(m)[0].tolist() for m in modules] == [[3, 6], [5, 7]]
    assert [[t.data_ptr() for t in hf_experts.local_experts(m) if t is not None] for m in modules] == held
    assert close(hf_logits(dyn), hf_logits(hf_model(arch, [[3, 6], [5, 7]])), 1e-6)


def test_experts_path_bad_updates_are_refused():
    from kt_ops import hf_experts

    fixed = experts_of(hf_model("gpt_oss", [[0, 1], [2, 5]]))[0]
    with pytest.raises(RuntimeError, match="dynamic=True"):
        hf_experts.update_local_experts(fixed, [2, 3])
    module = experts_of(hf_model("gpt_oss", [[0, 1], [2, 5]], dynamic=True))[0]
    for ids, match in (([2], "2 integer expert ids"), ([2, 2], "distinct"), ([2, 8], r"in \[0, 8\)")):
        with pytest.raises(ValueError, match=match):
            hf_experts.update_local_experts(module, ids)
    assert hf_experts.local_experts(module)[0].tolist() == [0, 1]
    with pytest.raises(ValueError, match="dynamic_gpu_experts needs GPU experts"):
        hf_model("olmoe", None, dynamic=True)


def test_experts_path_compiled_model_sees_the_update():
    from kt_ops import hf_experts

    dyn = hf_model("olmoe", [[0, 1], [2, 5]], dynamic=True)
    torch._dynamo.reset()
    compiled = torch.compile(dyn, fullgraph=True)
    assert close(hf_logits(compiled), hf_logits(dyn), logits_bound())
    for module in experts_of(dyn):
        hf_experts.update_local_experts(module, [4, 7])
    assert close(hf_logits(compiled), hf_logits(hf_model("olmoe", [[4, 7], [4, 7]])), logits_bound())


def test_experts_path_rebalances_from_statistics():
    from kt_ops import hf_experts

    dyn = hf_model("gpt_oss", [[0, 1], [0, 1]], dynamic=True)
    eager = hf_model("gpt_oss")  # every expert packed, none in torch
    with kt_ops.ExpertStats(num_hidden_layers=2) as stats:
        hf_logits(dyn)
    assert kt_ops.rebalance_gpu_experts(dyn, stats) == 2
    for module in experts_of(dyn):
        counts = stats.counts[hf_experts.layer_id(module)]
        assert hf_experts.local_experts(module)[0].tolist() == sorted(torch.topk(counts.double(), 2).indices.tolist())
    assert close(hf_logits(dyn), hf_logits(eager), logits_bound())


def test_experts_path_follows_the_inputs_device():
    """Experts kept in torch, packed on the CPU, compute where the activations are (here
    the meta device stands for a GPU the model was moved to after packing)."""
    from kt_ops import hf_experts

    module = experts_of(hf_model("olmoe", [[0, 1], [2, 5]], dynamic=True))[0]
    x = torch.randn(4, 64, device="meta")
    ids = torch.tensor([[0, 3], [1, 2], [5, 6], [0, 1]], device="meta")
    out = module(x, ids, torch.rand(4, 2, device="meta"))
    assert out.device.type == "meta" and out.shape == (4, 64)
    hf_experts.update_local_experts(module, [2, 3])  # reaches the device copy too
    local_on = module.__dict__["_kt_ops_local_on"][torch.device("meta")]
    assert local_on[0].device.type == "meta"


def test_quantization_config_loads_dynamic_experts(tmp_path):
    """KtOpsConfig(num_gpu_experts=2, dynamic_gpu_experts=True): packed while loading with
    every expert and host copies, then moved like patch_model's."""
    transformers = pytest.importorskip("transformers")
    from hf_models import tiny_model

    from kt_ops import hf_experts

    tiny_model("gpt_oss").float().save_pretrained(tmp_path)
    config = kt_ops.KtOpsConfig(method="BF16", num_gpu_experts=2, dynamic_gpu_experts=True, progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, quantization_config=config)
    modules = experts_of(model)
    assert all(hf_experts.is_dynamic(m) for m in modules)
    for module in modules:
        hf_experts.update_local_experts(module, [3, 6])
    assert close(hf_logits(model), hf_logits(hf_model("gpt_oss", [[3, 6], [3, 6]])), 1e-6)
    with pytest.raises(ValueError, match="dynamic_gpu_experts needs GPU experts"):
        kt_ops.KtOpsConfig(dynamic_gpu_experts=True)


def test_hidden_states_of_another_hidden_size_are_refused():
    """hidden_states [..., H'] with H' != H was reshaped to [-1, H] whenever its size divided
    by H ([4, 32] or [4, 48] for H = 64): tokens of the wrong width computed, silently."""
    moe = layer([0, 1])
    for shape in ((4, H // 2), (4, 3 * H // 4), (2, 3, 2 * H)):
        with pytest.raises(ValueError, match=f"hidden size {H}"):
            moe(torch.randn(*shape))
    assert moe(torch.randn(2, 3, H)).shape == (2, 3, H)
    assert moe(torch.zeros(0, H)).shape == (0, H)


@pytest.mark.parametrize("shape", [(1,), (1, E), (E + 1,), (E, 1)])
def test_a_correction_bias_of_another_shape_is_refused(shape):
    """e_score_correction_bias [1] or [1, E] broadcast over the experts (every expert biased
    alike, or rows of the wrong layer's bias), silently; [E + 1] was a RuntimeError from the
    first forward's addition."""
    router, gate, up, down = weights()
    with pytest.raises(ValueError, match=rf"e_score_correction_bias must be \[{E}\]"):
        kt_ops.HybridMoE(router, gate, up, down, kt_ops.Routing(K, scoring="sigmoid"),
                         e_score_correction_bias=torch.zeros(shape))


@pytest.mark.parametrize("name", ["gate_proj", "up_proj", "down_proj"])
@pytest.mark.parametrize("rank", [2, 4])
def test_expert_weights_of_another_rank_are_refused(name: str, rank: int):
    """A 2-D gate_proj (one expert's weight) was "not enough values to unpack (expected 3,
    got 2)", a 4-D one "too many values to unpack", and an up/down of the wrong rank a
    message about the other tensors' shapes: now a ValueError naming the tensor, its
    expected layout and its shape."""
    router, gate, up, down = weights()
    tensors = {"gate_proj": gate, "up_proj": up, "down_proj": down}
    tensors[name] = tensors[name][0] if rank == 2 else tensors[name][None]
    layout = "[E, H, I]" if name == "down_proj" else "[E, I, H]"
    with pytest.raises(ValueError, match=rf"{name} must be 3-D {re.escape(layout)}.*got shape"):
        kt_ops.HybridMoE(router, tensors["gate_proj"], tensors["up_proj"], tensors["down_proj"], kt_ops.Routing(K))


@pytest.mark.parametrize("top_k, on_gpu", [(E, [0, 1]), (4, [0, 1, 2, 4, 5, 7]), (2, [0, 1, 2, 3, 4, 5, 6])])
def test_top_k_above_the_cpu_experts_count(top_k: int, on_gpu: list[int]):
    """top_k (<= E) above the experts left on the CPU was a ValueError at every forward (the
    operator refused top-k > its packed experts until it took -1 slots beyond them).
    Compared with the layer computing every expert in torch (fp32; the CPU experts round
    activations to bf16: 3e-3 measured)."""
    router, gate, up, down = weights()
    x = tokens()
    in_torch = kt_ops.HybridMoE(router, gate, up, down, kt_ops.Routing(top_k), gpu_experts_mask=[True] * E)
    mixed = kt_ops.HybridMoE(router, gate, up, down, kt_ops.Routing(top_k),
                             gpu_experts_mask=torch.isin(torch.arange(E), torch.tensor(on_gpu)))
    assert close(mixed(x), in_torch(x), bound=1e-2)
