"""kt_ops.ExpertStats: activation counts of HybridMoE and KTMoEWrapper layers (equal to a
bincount of the ids they were given, -1 ignored), nesting, growth, reset, SGLang's dump
format both ways, bad files; on CUDA (where present) counting on the device and inside a
captured CUDA graph."""

from __future__ import annotations

import warnings

import pytest
import torch

import kt_ops
from kt_ops import expert_stats
from kt_ops.wrappers.kt_moe_wrapper import KTMoEWrapper

E, K, H, I = 8, 3, 64, 32


def expected_counts(layers: int, experts: int, calls: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    out = torch.zeros(layers, experts, dtype=torch.int64)
    for layer, ids in calls:
        ids = ids.reshape(-1).cpu().long()
        out[layer] += torch.bincount(ids[ids >= 0], minlength=experts)[:experts]
    return out


def hybrid(layer_idx: int | None = 2, gpu_experts: int = 2) -> kt_ops.HybridMoE:
    g = torch.Generator().manual_seed(0)
    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.1).to(torch.bfloat16)
    return kt_ops.HybridMoE(rand(E, H) * 10, rand(E, I, H), rand(E, I, H), rand(E, H, I), kt_ops.Routing(K),
                            gpu_experts_mask=torch.arange(E) < gpu_experts, layer_idx=layer_idx)


def wrapper(layer: int, **kw) -> KTMoEWrapper:
    g = torch.Generator().manual_seed(layer)
    wr = KTMoEWrapper(layer, E, K, H, I, method="BF16", **kw)
    wr.load_weights_from_tensors(torch.randn(E, I, H, generator=g) * 0.1, torch.randn(E, I, H, generator=g) * 0.1,
                                 torch.randn(E, H, I, generator=g) * 0.1)
    return wr


def routing(tokens: int, seed: int, skip: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    if skip:
        ids[torch.rand(tokens, K, generator=g) < 0.3] = -1
    return torch.randn(tokens, H, generator=g), ids, torch.rand(tokens, K, generator=g)


@pytest.fixture(autouse=True)
def _clean():
    yield
    KTMoEWrapper.clear_buffer_cache()
    assert not expert_stats._ACTIVE  # every test leaves its contexts


def test_hybrid_moe_counts_its_routed_ids():
    layer = hybrid(layer_idx=2)
    xs = [torch.randn(t, H).bfloat16() for t in (5, 1, 9)]
    with kt_ops.ExpertStats(num_hidden_layers=4) as stats:
        for x in xs:
            layer(x.reshape(1, -1, H))  # any leading shape
    calls = [(2, layer.route(x)[1]) for x in xs]  # logical ids, GPU experts (0, 1) included
    assert stats.counts.dtype == torch.int64 and stats.counts.shape == (4, E)
    assert torch.equal(stats.counts, expected_counts(4, E, calls))
    assert int(stats.counts.sum()) == 15 * K and stats.counts[:, :2].sum() > 0


def test_kt_moe_wrapper_counts_ids_as_given():
    layers = [wrapper(1), wrapper(3, max_deferred_experts_per_token=1)]  # deferral does not change the counts
    calls = []
    with kt_ops.ExpertStats() as stats:
        for step in range(3):
            for wr in layers:
                x, ids, w = routing(6, seed=10 * step + wr.layer_idx)
                wr.forward(x, ids, w)
                calls.append((wr.layer_idx, ids))
    assert stats.num_hidden_layers == 4 and stats.num_experts == E  # grown to the largest layer id + 1
    assert torch.equal(stats.counts, expected_counts(4, E, calls))
    assert not stats.counts[[0, 2]].any()  # layers that never ran stay 0
    # submit/sync counts too, int32 ids alike
    x, ids, w = routing(4, seed=99)
    with stats:
        layers[0].submit_forward(x, ids.int(), w)
        layers[0].sync_forward(x)
    assert torch.equal(stats.counts, expected_counts(4, E, calls + [(1, ids)]))


def test_nothing_counted_outside_the_context():
    layer, wr = hybrid(layer_idx=0), wrapper(1)
    x, ids, w = routing(5, seed=1)
    layer(x.bfloat16())
    wr.forward(x, ids, w)
    stats = kt_ops.ExpertStats(num_hidden_layers=2, num_experts=E)
    layer(x.bfloat16())
    wr.forward(x, ids, w)
    assert not stats.counts.any() and not stats.active
    with stats:
        assert stats.active
        wr.forward(x, ids, w)
    wr.forward(x, ids, w)  # after the block: not counted
    assert torch.equal(stats.counts, expected_counts(2, E, [(1, ids)]))


def test_nested_collectors_all_count():
    wr = wrapper(1)
    a, b = routing(4, seed=1), routing(7, seed=2)
    with kt_ops.ExpertStats() as outer:
        wr.forward(*a)
        with kt_ops.ExpertStats() as inner:
            wr.forward(*b)
        wr.forward(*a)
    assert torch.equal(inner.counts, expected_counts(2, E, [(1, b[1])]))
    assert torch.equal(outer.counts, expected_counts(2, E, [(1, a[1]), (1, b[1]), (1, a[1])]))
    with pytest.raises(RuntimeError, match="already active"), outer:
        with outer:
            pass


def test_record_ignores_skipped_and_out_of_range_ids():
    ids = torch.tensor([[0, -1, 3], [3, 7, -1], [8, 9, -5]])  # 8, 9: beyond this layer's 8 experts
    with kt_ops.ExpertStats() as stats:
        expert_stats.record(0, ids, 8)
        expert_stats.record(0, ids.int(), 8)
        expert_stats.record(1, torch.full((3, 2), -1), 8)
    assert stats.counts.tolist()[0] == [2, 0, 0, 4, 0, 0, 0, 2] and not stats.counts[1].any()
    expert_stats.record(0, ids, 8)  # no collector: nothing happens
    assert int(stats.counts.sum()) == 8
    with stats:  # meta (shape propagation) is not counted
        expert_stats.record(0, torch.empty(3, 2, dtype=torch.long, device="meta"), 8)
    assert int(stats.counts.sum()) == 8


def test_record_refuses_ids_that_are_not_integers():
    """Float ids were truncated (1.7 counted as expert 1) and bool ids counted as experts 0
    and 1, silently; KTMoEWrapper records before its operator refuses such ids, so the failed
    call was counted."""
    with kt_ops.ExpertStats() as stats:
        for ids in (torch.tensor([[1.7, 2.0]]), torch.tensor([[True, False]])):
            with pytest.raises(ValueError, match="topk_ids must be int32 or int64"):
                expert_stats.record(0, ids, 8)
        expert_stats.record(0, torch.tensor([[1, 2]], dtype=torch.int32), 8)
    assert stats.counts.tolist() == [[0, 1, 1, 0, 0, 0, 0, 0]]


def test_sizes_grow_and_keep_their_counts():
    with kt_ops.ExpertStats() as stats:
        assert stats.counts.shape == (0, 0)
        expert_stats.record(2, torch.tensor([[0, 3]]), 4)
        expert_stats.record(0, torch.tensor([[1, 1]]), 4)
        expert_stats.record(5, torch.tensor([[7, 2]]), 8)  # more layers and more experts at once
        expert_stats.record(2, torch.tensor([[3, 6]]), 8)
    expected = torch.zeros(6, 8, dtype=torch.int64)
    expected[2, [0, 3, 6]] = torch.tensor([1, 2, 1])
    expected[0, 1] = 2
    expected[5, [2, 7]] = 1
    assert torch.equal(stats.counts, expected)


def test_calls_from_several_threads_are_all_counted():
    """Layers run by several threads at once (a thread pool serving a model): no count is
    lost, also while the rows grow (CPU index_add_ is a read-modify-write)."""
    import threading

    ids = torch.randint(0, E, (4096, K), generator=torch.Generator().manual_seed(0))
    calls = 100

    def run(layer: int) -> None:
        for _ in range(calls):
            expert_stats.record(layer, ids, E)

    with kt_ops.ExpertStats() as stats:
        threads = [threading.Thread(target=run, args=(layer,)) for layer in (0, 1, 2, 3, 0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    per_layer = torch.bincount(ids.reshape(-1), minlength=E) * calls
    assert torch.equal(stats.counts, torch.stack([2 * per_layer, 2 * per_layer, per_layer, per_layer]))
    import copy
    import pickle

    for twin in (copy.deepcopy(stats), pickle.loads(pickle.dumps(stats))):  # KtOpsConfig(expert_stats=) copies it
        assert torch.equal(twin.counts, stats.counts)
        with twin:
            expert_stats.record(0, ids, E)
        assert torch.equal(twin.counts[0], stats.counts[0] + per_layer // calls)


def test_a_collector_leaving_during_a_call_on_another_thread_skips_no_other(monkeypatch):
    """record iterated the live list of active collectors: one that left its ``with`` block
    (on another thread) while a call was counting shifted the list under the iteration, and
    the next collector missed that call's ids."""
    import threading

    ids = torch.tensor([[0, 1]])
    first, second = kt_ops.ExpertStats(), kt_ops.ExpertStats()
    counting, left = threading.Event(), threading.Event()
    add = kt_ops.ExpertStats._add

    def slow_add(self, *args):
        add(self, *args)
        if self is first:
            counting.set()
            assert left.wait(10)

    monkeypatch.setattr(kt_ops.ExpertStats, "_add", slow_add)

    def leave() -> None:
        assert counting.wait(10)
        first.__exit__(None, None, None)
        left.set()

    first.__enter__()
    with second:
        thread = threading.Thread(target=leave)
        thread.start()
        expert_stats.record(0, ids, E)
        thread.join()
    assert first.counts[0, :2].tolist() == [1, 1]
    assert second.counts.shape[0] == 1 and second.counts[0, :2].tolist() == [1, 1], "the second collector lost the call"


def test_collectors_leaving_on_two_threads_at_once_each_remove_themselves(monkeypatch):
    """__exit__ found its collector's index in the active list, then deleted by index: a
    collector leaving on another thread in between shifted the list, and the del removed the
    wrong collector (which then kept counting, and the one that left stayed active)."""
    import threading

    first, second, third = kt_ops.ExpertStats(), kt_ops.ExpertStats(), kt_ops.ExpertStats()

    class Interleaving(list):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            if item is third and not started:  # third found; first leaves before the del
                started.append(True)
                thread.start()
                thread.join(0.5)  # with the lock: first waits until third is removed
            return item

    started: list[bool] = []
    thread = threading.Thread(target=first.__exit__, args=(None, None, None))
    monkeypatch.setattr(expert_stats, "_ACTIVE", Interleaving())
    for stats in (first, second, third):
        stats.__enter__()
    third.__exit__(None, None, None)
    thread.join(10)
    assert not first.active and not third.active and second.active
    second.__exit__(None, None, None)


def test_fixed_sizes_are_enforced():
    with kt_ops.ExpertStats(num_hidden_layers=3, num_experts=8) as stats:
        expert_stats.record(2, torch.tensor([[1]]), 4)  # fewer experts is fine
        with pytest.raises(ValueError, match=r"layer id 3 is outside ExpertStats\(num_hidden_layers=3\)"):
            expert_stats.record(3, torch.tensor([[1]]), 8)
        with pytest.raises(ValueError, match="16 experts"):
            expert_stats.record(0, torch.tensor([[1]]), 16)
        with pytest.raises(ValueError, match="layer_id"):
            expert_stats.record(-1, torch.tensor([[1]]), 8)
    assert stats.counts.shape == (3, 8) and int(stats.counts.sum()) == 1
    for bad in (dict(num_hidden_layers=-1), dict(num_experts=0), dict(num_experts=2.0), dict(num_hidden_layers=True)):
        with pytest.raises(ValueError):
            kt_ops.ExpertStats(**bad)


def test_a_refused_call_grows_nothing():
    """A call refused for its expert count had already grown the rows to its layer id: the
    counts (and the file save writes for SGLang) gained rows of a layer that never counted."""
    with kt_ops.ExpertStats(num_experts=8) as stats:
        expert_stats.record(1, torch.tensor([[1]]), 8)
        with pytest.raises(ValueError, match="16 experts"):
            expert_stats.record(5, torch.tensor([[1]]), 16)
        with pytest.raises(ValueError, match="num_experts"):
            expert_stats.record(9, torch.tensor([[1]]), 0)
    assert stats.num_hidden_layers == 2 and stats.counts.shape == (2, 8) and int(stats.counts.sum()) == 1
    with kt_ops.ExpertStats(num_hidden_layers=3) as stats:
        with pytest.raises(ValueError, match="outside"):
            expert_stats.record(3, torch.tensor([[1]]), 8)
    assert stats.num_experts == 0 and stats.counts.shape == (3, 0)


def test_growing_sizes_stop_at_what_no_model_has():
    """Without sizes a collector grows to the ids it sees, but not to a layer id of 10**9
    (a [10**9, E + 1] int64 accumulator: out of memory) or a billion experts."""
    with kt_ops.ExpertStats() as stats:
        expert_stats.record(70, torch.tensor([[1]]), 8)
        with pytest.raises(ValueError, match="not a layer index"):
            expert_stats.record(10**9, torch.tensor([[1]]), 8)
        with pytest.raises(ValueError, match="num_experts 1000000000"):
            expert_stats.record(0, torch.tensor([[1]]), 10**9)
    assert stats.counts.shape == (71, 8) and int(stats.counts.sum()) == 1
    with kt_ops.ExpertStats(num_hidden_layers=10**5) as stats:  # given sizes are the caller's
        expert_stats.record(70_000, torch.tensor([[1]]), 2)
    assert int(stats.counts[70_000, 1]) == 1


def test_layer_without_index_is_not_counted(monkeypatch):
    monkeypatch.setattr(expert_stats, "_warned_no_layer_id", False)
    layer = hybrid(layer_idx=None)
    x = torch.randn(3, H).bfloat16()
    with kt_ops.ExpertStats() as stats, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(x)
        layer(x)
    assert [str(w.message) for w in caught if "without a layer index" in str(w.message)] != []
    assert len([w for w in caught if "without a layer index" in str(w.message)]) == 1  # warned once
    assert stats.counts.numel() == 0
    layer(x)  # no collector: no warning either
    with pytest.raises(ValueError, match="layer_idx"):
        hybrid(layer_idx=-1)


def test_reset_and_reserve():
    with kt_ops.ExpertStats(num_hidden_layers=2, num_experts=E) as stats:
        stats.reserve("cpu")
        expert_stats.record(1, torch.tensor([[1, 2]]), E)
        assert int(stats.counts.sum()) == 2
        stats.reset()
        assert stats.counts.shape == (2, E) and not stats.counts.any()
        expert_stats.record(1, torch.tensor([[5]]), E)
    assert stats.counts[1, 5] == 1 and int(stats.counts.sum()) == 1
    loaded = kt_ops.ExpertStats.from_counts(torch.ones(2, E, dtype=torch.int64))
    loaded.reset()
    assert not loaded.counts.any()


def test_save_writes_sglang_format_and_load_round_trips(tmp_path):
    with kt_ops.ExpertStats(num_hidden_layers=5, num_experts=E) as stats:
        for layer in (1, 3, 4):
            expert_stats.record(layer, routing(9, seed=layer)[1], E)
    stats.save(tmp_path / "stats.pt")
    data = torch.load(tmp_path / "stats.pt", weights_only=True)
    assert set(data) == {"logical_count"}
    assert data["logical_count"].shape == (1, 5, E) and data["logical_count"].dtype == torch.int64
    assert torch.equal(data["logical_count"][0], stats.counts)
    loaded = kt_ops.ExpertStats.load(tmp_path / "stats.pt")
    assert torch.equal(loaded.counts, stats.counts)
    assert (loaded.num_hidden_layers, loaded.num_experts) == (5, E)
    with loaded:  # a loaded collector keeps counting on top of the file's counts
        expert_stats.record(1, torch.tensor([[0, 0]]), E)
    assert loaded.counts[1, 0] == stats.counts[1, 0] + 2


def test_load_sglang_dumps_and_raw_tensors(tmp_path):
    g = torch.Generator().manual_seed(3)
    per_pass = torch.randint(0, 20, (4, 6, E), generator=g, dtype=torch.int32)  # buffer of 4 passes
    torch.save({"logical_count": per_pass, "rank": 0, "gpu_expert_masks": torch.zeros(4, 6, E, dtype=torch.bool)},
               tmp_path / "expert_distribution_recorder_1.pt")
    loaded = kt_ops.ExpertStats.load(tmp_path / "expert_distribution_recorder_1.pt")
    assert loaded.counts.dtype == torch.int64 and torch.equal(loaded.counts, per_pass.sum(0).long())
    torch.save(per_pass, tmp_path / "raw3.pt")
    assert torch.equal(kt_ops.ExpertStats.load(str(tmp_path / "raw3.pt")).counts, per_pass.sum(0).long())
    torch.save(per_pass[0].double(), tmp_path / "raw2.pt")  # whole-number floats are counts too
    assert torch.equal(kt_ops.ExpertStats.load(tmp_path / "raw2.pt").counts, per_pass[0].long())


@pytest.mark.parametrize("content,match", [
    ({"counts": torch.zeros(1, 2, E)}, "no 'logical_count'"),
    ({"logical_count": [[1, 2]]}, "expected a tensor"),
    (torch.zeros(E), r"got shape \(8,\)"),
    (torch.zeros(1, 1, 2, E), "got shape"),
    (torch.zeros(3, 0), "no experts"),
    (-torch.ones(2, E, dtype=torch.int64), "non-negative"),
    (torch.full((2, E), 0.5), "whole numbers"),
    (torch.full((2, E), float("nan")), "whole numbers"),
    (torch.full((2, E), 1e30), "int64"),  # cast to int64's minimum: was "must be non-negative"
    # a buffer whose sum wraps around int64: was "must be non-negative"
    ({"logical_count": torch.full((2, 1, E), 2**62 + 2**61, dtype=torch.int64)}, "summed over the buffer exceed int64"),
    (torch.zeros(2, E, dtype=torch.bool), "integers"),
    ([1, 2, 3], "expected a tensor"),
])
def test_load_rejects_bad_files(tmp_path, content, match):
    torch.save(content, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=match):
        kt_ops.ExpertStats.load(tmp_path / "bad.pt")


def test_load_rejects_non_torch_files(tmp_path):
    (tmp_path / "notes.pt").write_text("hello")
    with pytest.raises(ValueError, match="not a torch.save file"):
        kt_ops.ExpertStats.load(tmp_path / "notes.pt")
    with pytest.raises(FileNotFoundError):
        kt_ops.ExpertStats.load(tmp_path / "missing.pt")


def test_patch_model_layers_record_under_their_layer_index():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=H, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, intermediate_size=96, moe_intermediate_size=32, num_experts=E,
        num_experts_per_tok=2, head_dim=16, mlp_only_layers=[0])  # layer 0 is dense
    torch.manual_seed(0)
    model = kt_ops.patch_model(transformers.AutoModelForCausalLM.from_config(config).eval(), method="BF16")
    moe = {name: m for name, m in model.named_modules() if isinstance(m, kt_ops.HybridMoE)}
    assert {m.layer_idx for m in moe.values()} == {1, 2}
    routed: list[tuple[int, torch.Tensor]] = []
    hooks = [m.register_forward_pre_hook(lambda m, args: routed.append((m.layer_idx, m.route(args[0].reshape(-1, H))[1])))
             for m in moe.values()]
    tokens = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    with kt_ops.ExpertStats(num_hidden_layers=3) as stats, torch.no_grad():
        model(tokens, use_cache=False)
    for hook in hooks:
        hook.remove()
    assert torch.equal(stats.counts, expected_counts(3, E, routed))
    assert not stats.counts[0].any() and (stats.counts[1:].sum(dim=1) == 10 * 2).all()


# ---- CUDA ----------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_counts_on_the_cuda_device_without_sync():
    ids = routing(64, seed=5)[1].cuda()
    with kt_ops.ExpertStats() as stats:
        expert_stats.record(1, ids, E)
        assert list(stats._acc) == [ids.device]  # counted where the ids are
        expert_stats.record(1, ids.cpu(), E)     # and on the CPU: summed
    assert torch.equal(stats.counts, expected_counts(2, E, [(1, ids), (1, ids)]))


@cuda
def test_counting_inside_a_captured_cuda_graph():
    ids = routing(32, seed=6)[1].cuda()
    stats = kt_ops.ExpertStats(num_hidden_layers=2, num_experts=E)
    with stats:
        stats.reserve(ids.device)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            expert_stats.record(1, ids, E)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            expert_stats.record(1, ids, E)
        for _ in range(3):
            graph.replay()
    # one eager call, none from the capture itself, one per replay
    assert torch.equal(stats.counts, expected_counts(2, E, [(1, ids)] * 4))
    stats.reset()
    graph.replay()  # the graph keeps its accumulator, zeroed in place
    assert torch.equal(stats.counts, expected_counts(2, E, [(1, ids)]))


@cuda
def test_allocation_during_capture_is_refused():
    ids = routing(8, seed=7)[1].cuda()
    with kt_ops.ExpertStats() as stats:
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="stats.reserve"):
            with torch.cuda.graph(graph):
                expert_stats.record(0, ids, E)
    assert stats.counts.sum() == 0


def test_counting_under_torch_compile_fullgraph():
    layer = hybrid(layer_idx=1)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    x = torch.randn(6, H).bfloat16()
    compiled(x)  # no collector: compiled without counting
    with kt_ops.ExpertStats() as stats:
        compiled(x)
        compiled(x)
    assert torch.equal(stats.counts, expected_counts(2, E, [(1, layer.route(x)[1])] * 2))
    compiled(x)
    assert int(stats.counts.sum()) == 2 * 6 * K


def _router_ids(model: torch.nn.Module) -> list[tuple[int, torch.Tensor]]:
    """Records (layer, top_k_index) of every experts-module call of a transformers model."""
    from kt_ops import hf_experts

    calls: list[tuple[int, torch.Tensor]] = []
    for name, module in model.named_modules():
        if hf_experts.is_experts_module(module):
            def hook(mod, args, kwargs, layer=hf_experts.layer_index(name)):
                ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
                calls.append((layer, ids.detach().clone()))
            module.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def test_transformers_experts_are_counted_under_their_layer(tmp_path, monkeypatch):
    """experts_implementation="kt_ops": loaded with KtOpsConfig, or packed with
    pack_model_experts, every experts module counts its router's choice under its layer
    index; experts packed lazily on their first call (no name known) are not counted, with
    a warning that says what to do."""
    transformers = pytest.importorskip("transformers")
    from hf_models import tiny_model

    tiny_model("qwen3_moe").float().save_pretrained(tmp_path)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=kt_ops.KtOpsConfig(progress=False))
    packed = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                               experts_implementation="kt_ops")
    kt_ops.hf_experts.pack_model_experts(packed)
    for model in (loaded, packed):
        calls = _router_ids(model)
        with kt_ops.ExpertStats(num_hidden_layers=2) as stats, torch.no_grad():
            model(ids)
        assert sorted(layer for layer, _ in calls) == [0, 1]
        assert torch.equal(stats.counts, expected_counts(2, 8, calls))
        assert int(stats.counts.sum()) == ids.numel() * 2 * 2  # tokens x top-k x layers
    lazy = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                             experts_implementation="kt_ops")
    monkeypatch.setattr(expert_stats, "_warned_no_layer_id", False)
    with kt_ops.ExpertStats() as stats, torch.no_grad(), pytest.warns(UserWarning, match="pack_model_experts"):
        lazy(ids)
    assert stats.counts.numel() == 0
