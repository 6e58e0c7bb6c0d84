"""kt_ops.placement_masks against SGLang's placement strategies (kt_ep_wrapper.py's
generate_uniform_masks / generate_front_loading_masks / generate_random_masks and
_init_kt_gpu_experts_masks' frequency branch with kt-kernel's generate_gpu_experts_masks),
reimplemented here from their description (spec §6.2) over a whole model: L hidden layers,
the MoE ones chosen by first_k_dense_replace and moe_layer_freq, non-MoE rows all True.
kt_ops' result is compared with the MoE rows of that [L, E] mask."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kt_ops
from conftest import logits_bound
from kt_ops.placement import budget_from_bytes, parse_bytes, total_gpu_experts


# ---- SGLang's algorithms, written from the spec --------------------------------------

def sglang_moe_layers(num_layers: int, first_k_dense_replace: int, moe_layer_freq: int) -> list[int]:
    return [i for i in range(num_layers) if i >= first_k_dense_replace and i % moe_layer_freq == 0]


def sglang_total(budget: int | float, num_experts: int, num_moe_layers: int) -> int:
    if isinstance(budget, float):  # --kt-gpu-experts-ratio
        return int(num_moe_layers * num_experts * budget)
    return budget * num_moe_layers  # --kt-num-gpu-experts is per MoE layer


def sglang_masks(strategy: str, num_layers: int, num_experts: int, total: int, moe: list[int],
                 freq: torch.Tensor | None = None, seed: int = 42) -> torch.Tensor:
    masks = torch.zeros(num_layers, num_experts, dtype=torch.bool)
    if strategy == "uniform":
        for idx, layer in enumerate(moe):
            n = total // len(moe) + (1 if idx < total % len(moe) else 0)
            masks[layer, : min(n, num_experts)] = True
    elif strategy == "front-loading":
        remaining = total
        for layer in range(num_layers):
            if layer in moe and remaining > 0:
                n = min(remaining, num_experts)
                masks[layer, :n] = True
                remaining -= n
    elif strategy == "random":
        pairs = [(layer, expert) for layer in range(num_layers) if layer in moe for expert in range(num_experts)]
        if pairs:
            rng = torch.Generator(device="cpu")
            rng.manual_seed(seed)
            for i in torch.randperm(len(pairs), generator=rng, device="cpu")[: min(total, len(pairs))]:
                masks[pairs[int(i)]] = True
    elif strategy == "frequency":
        if freq is None:  # no --init-expert-location: 1.0 on the MoE layers, 0 elsewhere
            freq = torch.zeros(num_layers, num_experts)
            for layer in moe:
                freq[layer] = 1.0
        n = max(min(total, freq.numel()), 0)  # kt-kernel's generate_gpu_experts_masks
        flat = torch.zeros(freq.numel(), dtype=torch.bool)
        if n:
            flat[torch.topk(freq.float().view(-1).cpu(), k=n, largest=True, sorted=False).indices] = True
        masks = flat.view(num_layers, num_experts)
    for layer in range(num_layers):
        if layer not in moe:
            masks[layer] = True
    return masks


MODELS = [  # (num_layers, E, first_k_dense_replace, moe_layer_freq)
    (4, 8, 0, 1),
    (6, 16, 1, 1),
    (9, 8, 3, 1),   # DeepSeek-V3-like dense prefix
    (8, 6, 1, 2),   # every other layer
    (27, 64, 1, 1),
]
BUDGETS = [0, 1, 3, 5, 8, 17, 100, 0.05, 0.3, 0.5, 0.999, 1.0]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("strategy", ["uniform", "front-loading", "random", "frequency"])
def test_masks_match_sglang(model, strategy):
    num_layers, E, first_dense, freq_step = model
    moe = sglang_moe_layers(num_layers, first_dense, freq_step)
    for budget in BUDGETS:
        total = sglang_total(budget, E, len(moe))
        expected = sglang_masks(strategy, num_layers, E, total, moe)[moe]
        got = kt_ops.placement_masks(strategy, E, moe, budget, num_hidden_layers=num_layers)
        assert got.dtype == torch.bool and got.shape == (len(moe), E)
        assert torch.equal(got, expected), (strategy, model, budget)
        if strategy != "frequency":  # the layer count matters only to frequency's ties
            assert torch.equal(kt_ops.placement_masks(strategy, E, moe, budget), expected)


@pytest.mark.parametrize("seed", [0, 1, 42, 1234])
def test_random_matches_sglang_for_every_seed(seed):
    num_layers, E = 7, 12
    moe = sglang_moe_layers(num_layers, 2, 1)
    for budget in (0, 2, 12, 13, 0.25, 1.0):
        expected = sglang_masks("random", num_layers, E, sglang_total(budget, E, len(moe)), moe, seed=seed)[moe]
        assert torch.equal(kt_ops.placement_masks("random", E, moe, budget, seed=seed), expected)
    a, b = (kt_ops.placement_masks("random", E, moe, 3, seed=s) for s in (seed, seed + 1))
    assert not torch.equal(a, b)  # the seed is used


@pytest.mark.parametrize("model", MODELS)
def test_frequency_from_counts_matches_sglang(model):
    num_layers, E, first_dense, freq_step = model
    moe = sglang_moe_layers(num_layers, first_dense, freq_step)
    g = torch.Generator().manual_seed(num_layers * E)
    counts = torch.zeros(num_layers, E, dtype=torch.int64)
    counts[moe] = torch.randint(1, 50, (len(moe), E), generator=g)  # small range: many ties
    freq = counts.float()  # SGLang: logical_count.sum(0).float()
    for budget in BUDGETS:
        total = sglang_total(budget, E, len(moe))
        expected = sglang_masks("frequency", num_layers, E, total, moe, freq=freq)[moe]
        assert torch.equal(kt_ops.placement_masks("frequency", E, moe, budget, stats=counts), expected), budget
        # the chosen experts are the most activated ones
        got = kt_ops.placement_masks("frequency", E, moe, budget, stats=counts)
        n = min(total, len(moe) * E)
        assert int(got.sum()) == n
        if 0 < n < len(moe) * E:
            assert counts[moe][got].min() >= counts[moe][~got].max()
    # unactivated experts tie with the dense layers' zero rows, which SGLang's top-k sees too
    counts[moe] = torch.randint(0, 3, (len(moe), E), generator=g)
    for budget in BUDGETS:
        expected = sglang_masks("frequency", num_layers, E, sglang_total(budget, E, len(moe)), moe, freq=counts.float())
        assert torch.equal(kt_ops.placement_masks("frequency", E, moe, budget, stats=counts), expected[moe]), budget


def test_frequency_ties_and_global_budget():
    E = 4
    moe = [1, 2, 3]
    counts = torch.zeros(5, E, dtype=torch.int64)
    counts[1] = torch.tensor([9, 1, 1, 1])
    counts[2] = torch.tensor([5, 5, 5, 0])  # a tie across the budget boundary
    counts[3] = torch.tensor([0, 0, 0, 8])
    masks = kt_ops.placement_masks("frequency", E, moe, 1, stats=counts)  # total 3: 9, 8 and one of the 5s
    assert masks[0].tolist() == [True, False, False, False] and masks[2].tolist() == [False, False, False, True]
    assert int(masks[1].sum()) == 1 and not masks[1, 3]
    expected = sglang_masks("frequency", 5, E, 3, moe, freq=counts.float())[moe]
    assert torch.equal(masks, expected)
    # the budget is global (total 6: 9, 8, the three 5s and one of layer 1's 1s): layer 2 gets 3
    assert kt_ops.placement_masks("frequency", E, moe, 0.5, stats=counts).sum(dim=1).tolist() == [2, 3, 1]


def test_frequency_without_stats_mirrors_sglang():
    # every MoE expert counts 1.0: torch.topk's tie order decides, over the whole model's matrix
    for num_layers, E, moe in ((4, 8, [1, 2, 3]), (12, 16, [2, 4, 6, 8, 10]), (30, 64, list(range(1, 27)))):
        for budget in (1, 3, 0.5):
            total = sglang_total(budget, E, len(moe))
            expected = sglang_masks("frequency", num_layers, E, total, moe)[moe]
            got = kt_ops.placement_masks("frequency", E, moe, budget, num_hidden_layers=num_layers)
            assert torch.equal(got, expected) and int(got.sum()) == total


def test_ratio_and_budget_totals():
    assert total_gpu_experts(3, 8, 5) == 15
    assert total_gpu_experts(0.3, 8, 3) == int(3 * 8 * 0.3) == 7  # float rounding as SGLang's: 7.199...
    assert total_gpu_experts(1.0, 8, 3) == 24
    masks = kt_ops.placement_masks("uniform", 8, [1, 2, 3], 0.3)
    assert masks.sum(dim=1).tolist() == [3, 2, 2]
    assert kt_ops.placement_masks("uniform", 8, [1, 2, 3], 1.0).all()
    assert not kt_ops.placement_masks("uniform", 8, [1, 2, 3], 0).any()
    assert kt_ops.placement_masks("uniform", 8, [1, 2, 3], 20).all()  # budget > E: every expert


def test_front_loading_fills_layers_in_order():
    masks = kt_ops.placement_masks("front-loading", 4, [1, 2, 3], 2)  # total 6: 4 + 2 + 0
    assert masks.sum(dim=1).tolist() == [4, 2, 0]
    assert masks[1].tolist() == [True, True, False, False]


def test_rows_follow_moe_layers_order():
    E = 8
    ascending = [1, 3, 4, 6]
    order = [4, 1, 6, 3]
    counts = torch.randint(0, 100, (7, E), generator=torch.Generator().manual_seed(0))
    for strategy in ("uniform", "front-loading", "random", "frequency"):
        for budget in (3, 0.4):
            base = kt_ops.placement_masks(strategy, E, ascending, budget, stats=counts)
            got = kt_ops.placement_masks(strategy, E, order, budget, stats=counts)
            assert torch.equal(got, base[[ascending.index(layer) for layer in order]]), strategy


def test_frequency_stats_forms(tmp_path):
    E, moe = 6, [1, 2]
    counts = torch.zeros(3, E, dtype=torch.int64)
    counts[1] = torch.tensor([0, 7, 0, 3, 0, 0])
    counts[2] = torch.tensor([1, 0, 6, 0, 0, 2])
    expected = kt_ops.placement_masks("frequency", E, moe, 2, stats=counts)
    assert expected.nonzero().tolist() == [[0, 1], [0, 3], [1, 2], [1, 5]]
    stats = kt_ops.ExpertStats.from_counts(counts)
    assert torch.equal(kt_ops.placement_masks("frequency", E, moe, 2, stats=stats), expected)
    path = tmp_path / "stats.pt"
    stats.save(path)
    assert torch.equal(kt_ops.placement_masks("frequency", E, moe, 2, stats=path), expected)
    assert torch.equal(kt_ops.placement_masks("frequency", E, moe, 2, stats=str(path)), expected)
    torch.save({"logical_count": torch.stack([counts, counts * 0, counts])}, tmp_path / "sglang.pt")
    assert torch.equal(kt_ops.placement_masks("frequency", E, moe, 2, stats=tmp_path / "sglang.pt"), expected)
    assert torch.equal(kt_ops.placement_masks("frequency", E, moe, 2, stats=counts.double() / 3), expected)
    # rows of layers outside moe_layers never take the budget
    noisy = counts.clone()
    noisy[0] = 1000
    assert torch.equal(kt_ops.placement_masks("frequency", E, moe, 2, stats=noisy), expected)


def test_generate_gpu_experts_masks_is_still_importable_from_the_wrapper():
    from kt_ops.wrappers.kt_moe_wrapper import generate_gpu_experts_masks

    assert generate_gpu_experts_masks is kt_ops.generate_gpu_experts_masks
    assert generate_gpu_experts_masks is kt_ops.placement.generate_gpu_experts_masks



def test_generate_gpu_experts_masks_refuses_nan_and_takes_numpy_counts():
    """topk ranks NaN above every count: the NaN expert went to the GPU silently."""
    freq = torch.tensor([[1.0, math.nan, 3.0], [0.0, 5.0, 2.0]])
    with pytest.raises(ValueError, match="NaN"):
        kt_ops.generate_gpu_experts_masks(freq, 2)
    with pytest.raises(ValueError, match="real counts"):
        kt_ops.generate_gpu_experts_masks(freq.bool(), 2)
    with pytest.raises(TypeError, match="must be a tensor"):
        kt_ops.generate_gpu_experts_masks(freq.numpy(), 2)
    assert kt_ops.generate_gpu_experts_masks(freq.nan_to_num(), np.int64(2)).tolist() == \
        [[False, False, True], [False, True, False]]


@pytest.mark.parametrize("bad", [-1.0, math.inf, -math.inf])
def test_negative_or_infinite_activation_counts_are_refused(bad):
    """Activation counts are finite and non-negative: placement_masks' stats refused NaN and
    inf but took a negative count (its expert ranked below the idle ones, silently), and
    generate_gpu_experts_masks refused only NaN (an inf expert went to the GPU)."""
    counts = torch.zeros(4, 8)
    counts[1, 3] = bad
    with pytest.raises(ValueError, match=rf"finite and non-negative.*{bad}"):
        kt_ops.placement_masks("frequency", 8, [1, 2], 2, stats=counts)
    with pytest.raises(ValueError, match=rf"finite and non-negative.*{bad}"):
        kt_ops.generate_gpu_experts_masks(counts, 2)
    with pytest.raises(ValueError, match="finite and non-negative"):  # a row outside moe_layers too
        kt_ops.placement_masks("frequency", 8, [2, 3], 2, stats=counts)
    if bad == -1.0:
        with pytest.raises(ValueError, match="non-negative"):
            kt_ops.placement_masks("frequency", 8, [1, 2], 2, stats=counts.long())


def test_numpy_integer_arguments():
    """The arguments a config or a numpy array gives as numpy ints: seed passed the check and
    failed in Generator.manual_seed (TypeError "an integer is required"); num_experts and
    num_hidden_layers were refused although moe_layers, budget and seed take numpy ints."""
    moe = np.array([1, 3])
    for strategy in kt_ops.placement.STRATEGIES:
        expected = kt_ops.placement_masks(strategy, 8, [1, 3], 3, seed=7, num_hidden_layers=5
                                          if strategy == "frequency" else None)
        actual = kt_ops.placement_masks(strategy, np.int64(8), moe, np.int64(3), seed=np.int64(7),
                                        num_hidden_layers=np.int32(5) if strategy == "frequency" else None)
        assert torch.equal(actual, expected), strategy


def test_empty_moe_layers():
    for strategy in ("uniform", "front-loading", "random", "frequency"):
        assert kt_ops.placement_masks(strategy, 8, [], 4).shape == (0, 8)


@pytest.mark.parametrize("kwargs,match", [
    (dict(strategy="balanced"), "unknown placement strategy 'balanced'"),
    (dict(strategy="Uniform"), "unknown placement strategy"),
    (dict(budget=-1), "budget"),
    (dict(budget=0.0), "ratio"),
    (dict(budget=1.5), "ratio"),
    (dict(budget=float("nan")), "ratio"),
    (dict(budget=True), "budget"),
    (dict(budget="3"), "budget"),
    (dict(num_experts=0), "num_experts"),
    (dict(num_experts=8.0), "num_experts"),
    (dict(moe_layers=[1, 1]), "repeated"),
    (dict(moe_layers=[-1, 2]), "moe_layers"),
    (dict(moe_layers=[1.0]), "moe_layers"),
    (dict(num_hidden_layers=3), "num_hidden_layers"),
    (dict(strategy="frequency", stats=torch.zeros(5, 7)), r"E=8"),
    (dict(strategy="frequency", stats=torch.zeros(3, 8)), "moe_layers reaches layer 3"),
    (dict(strategy="frequency", stats=torch.zeros(2, 5, 8)), r"\[num_hidden_layers, E=8\]"),
    (dict(strategy="frequency", stats=torch.zeros(5, 8), num_hidden_layers=6), "num_hidden_layers is 6"),
    (dict(strategy="frequency", stats=torch.zeros(5, 8, dtype=torch.bool)), "stats"),
    (dict(strategy="frequency", stats=torch.full((5, 8), math.inf)), "finite"),
    (dict(strategy="frequency", stats=[[1] * 8] * 5), "stats must be"),
    (dict(strategy="random", seed=1.5), "seed"),  # was RuntimeError from manual_seed
])
def test_bad_arguments(kwargs, match):
    args = dict(strategy="uniform", num_experts=8, moe_layers=[1, 2, 3], budget=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        kt_ops.placement_masks(**args)


def test_frequency_stats_file_errors(tmp_path):
    (tmp_path / "text.pt").write_text("not a torch file")
    with pytest.raises(ValueError, match="not a torch.save file"):
        kt_ops.placement_masks("frequency", 8, [1], 1, stats=tmp_path / "text.pt")
    with pytest.raises(FileNotFoundError):
        kt_ops.placement_masks("frequency", 8, [1], 1, stats=tmp_path / "missing.pt")


def test_budget_from_bytes():
    mib = 2**20
    assert budget_from_bytes("24GiB", 3 * mib, 8) == 24 * 1024 // 24 == 1024
    assert budget_from_bytes("24 gib", 3 * mib, 8) == 1024
    assert budget_from_bytes(24 * 2**30, 3 * mib, 8) == 1024
    assert budget_from_bytes("500MB", 10**6, 7) == 71  # floor(500 / 7)
    assert budget_from_bytes("1.5GB", 10**8, 1) == 15
    assert budget_from_bytes("1.5KiB", 1, 1) == 1536
    assert budget_from_bytes("100", 7, 2) == 7
    assert budget_from_bytes("0", 7, 2) == 0
    assert budget_from_bytes("3MiB", 4 * mib, 1) == 0  # smaller than one expert
    assert parse_bytes("2TB") == 2 * 10**12 and parse_bytes("1tib") == 2**40 and parse_bytes("7B") == 7
    for bad in ("24GiBs", "-1GB", "GB", "1e9", "1,5GB", "", 1.5, True, None, -5):
        with pytest.raises(ValueError):
            budget_from_bytes(bad, 1, 1)
    for nbytes, layers in ((0, 1), (1, 0), (1.0, 1), (1, True)):
        with pytest.raises(ValueError):
            budget_from_bytes("1GB", nbytes, layers)


# ---- placement as an argument of patch_model and KtOpsConfig ----------------------------


def _tiny(arch: str):
    pytest.importorskip("transformers")
    from hf_models import tiny_model

    return tiny_model(arch).float()  # bf16-exact weights: BF16 packing is exact


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe"])  # HybridMoE blocks / transformers' experts interface
def test_patch_model_places_gpu_experts_by_strategy(arch):
    from kt_ops import hf_experts

    model = _tiny(arch)
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    counts = torch.arange(2 * 8, dtype=torch.int64).reshape(2, 8) % 5
    expected = kt_ops.placement_masks("frequency", 8, [0, 1], 3, stats=counts, num_hidden_layers=2)
    kt_ops.patch_model(model, "BF16", placement="frequency", gpu_budget=3, expert_stats=counts)
    if arch == "qwen3_moe":
        got = torch.stack([m.cpu_index.cpu() < 0 for m in model.modules() if isinstance(m, kt_ops.HybridMoE)])
    else:
        rows = []
        for m in model.modules():
            if hf_experts.is_experts_module(m):
                row = torch.zeros(8, dtype=torch.bool)
                row[hf_experts.local_experts(m)[0]] = True
                rows.append(row)
        got = torch.stack(rows)
    assert torch.equal(got, expected)
    with torch.no_grad():
        assert ((model(ids).logits - want).norm() / want.norm()) <= logits_bound()


def test_patch_model_placement_arguments_are_checked():
    model = _tiny("olmoe")
    with pytest.raises(ValueError, match="needs gpu_budget"):
        kt_ops.patch_model(model, placement="uniform")
    with pytest.raises(ValueError, match="not both"):
        kt_ops.patch_model(model, placement="uniform", gpu_budget=1, num_gpu_experts=2)
    with pytest.raises(ValueError, match="unknown placement strategy"):
        kt_ops.patch_model(model, placement="busiest", gpu_budget=1)
    for kwargs in ({"gpu_budget": 2}, {"expert_stats": torch.ones(2, 8)}):  # were dropped: no GPU expert
        with pytest.raises(ValueError, match="apply with placement="):
            kt_ops.patch_model(model, **kwargs)


def test_ktops_config_places_gpu_experts_by_byte_budget(tmp_path):
    """KtOpsConfig(placement=..., gpu_budget="...B"): the budget divided by one expert's bytes
    (gate + up + down in the model's dtype) and by the MoE layers gives experts per layer."""
    transformers = pytest.importorskip("transformers")
    from kt_ops import hf_experts

    _tiny("olmoe").save_pretrained(tmp_path)
    expert_bytes = 3 * 64 * 32 * 4  # H 64, I 32, fp32
    config = kt_ops.KtOpsConfig(placement="front-loading", gpu_budget=f"{5 * 2 * expert_bytes + 7}B", progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, quantization_config=config)
    local = [hf_experts.local_experts(m)[0].tolist() for m in model.modules() if hf_experts.is_experts_module(m)]
    assert local == [list(range(8)), [0, 1]]  # 5 per layer x 2 layers, front-loaded: 8, then 2
    assert kt_ops.budget_from_bytes(f"{5 * 2 * expert_bytes + 7}B", expert_bytes, 2) == 5
    with pytest.raises(ValueError, match="needs gpu_budget"):
        kt_ops.KtOpsConfig(placement="uniform")
    with pytest.raises(ValueError, match="not both"):
        kt_ops.KtOpsConfig(placement="uniform", gpu_budget=2, num_gpu_experts=1)
    # without placement both were dropped: the model loaded with no GPU expert, silently
    with pytest.raises(ValueError, match="gpu_budget apply with placement="):
        kt_ops.KtOpsConfig(gpu_budget=2)
    with pytest.raises(ValueError, match="gpu_budget and expert_stats apply with placement="):
        kt_ops.KtOpsConfig(method="AMXINT8", gpu_budget="24GiB", expert_stats=tmp_path / "experts.pt")
    with pytest.raises(ValueError, match="progress must be a bool"):  # "no" is truthy: the bars stayed on
        kt_ops.KtOpsConfig(progress="no")


def test_ktops_config_with_stats_or_numpy_budget_prints_as_json(tmp_path):
    """A KtOpsConfig given expert_stats as an ExpertStats or a tensor (as documented), or a
    numpy budget, is JSON for transformers (``repr(model.config)``, ``to_json_string``):
    json.dumps raised TypeError on the ExpertStats, the tensor and numpy's int64."""
    import json

    pytest.importorskip("transformers")
    counts = torch.arange(16).reshape(2, 8)
    path = tmp_path / "experts.pt"
    kt_ops.ExpertStats.from_counts(counts).save(path)
    for stats in (kt_ops.ExpertStats.from_counts(counts), counts, path):
        config = kt_ops.KtOpsConfig(placement="frequency", gpu_budget=np.int64(2), expert_stats=stats)
        assert "KtOpsConfig" in repr(config)
        stored = json.loads(config.to_json_string(use_diff=False))
        assert stored["gpu_budget"] == 2 and type(config.gpu_budget) is int
        assert isinstance(stored["expert_stats"], str)
        assert config.expert_stats is stats  # the object itself is kept for the placement
    assert kt_ops.KtOpsConfig(placement="uniform", gpu_budget=np.float32(0.5)).to_dict()["gpu_budget"] == 0.5
    assert json.loads(kt_ops.KtOpsConfig(placement="frequency", gpu_budget=2,
                                         expert_stats=path).to_json_string())["expert_stats"] == str(path)
