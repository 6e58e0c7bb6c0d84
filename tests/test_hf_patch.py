"""kt_ops.patch_model on real transformers model code: tiny random Qwen3-MoE, Qwen2-MoE,
Mixtral, DeepSeek-V3 and DeepSeek-V2 models, patched vs unpatched.

Tolerances (relative Frobenius error of the logits):
- fp32 model, weights rounded to bf16, method BF16: <= 5e-3 (the kernels round the
  activations to bf16 where the AMX tiles need it; measured 1.0e-3 to 3.4e-3 over 4 seeds);
- bf16 model, method BF16: <= 4e-2 (measured 0.5% to 2.1%: HF rounds every intermediate
  to bf16 — the unpatched bf16 model is itself 0.6-7% from its fp32 twin — and in bf16 a
  close router choice can flip between any two implementations);
- INT8 / GGUF Q8_0: <= 8e-2 (measured 0.6-4.9%), INT4 (group 32) / Q4_0: <= 3.5e-1
  (measured 6-27%; DeepSeek-V3's routed scaling 2.5 amplifies) against the fp32 model:
  quantization moves router decisions in the next layer, which dominates these errors.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import kt_ops
from conftest import bf16_activations
from hf_models import CONFIGS, tiny_model

ARCHS = sorted(CONFIGS)
GAP = 0.3  # see test_greedy_generation_matches


def rel_error(expected: torch.Tensor, actual: torch.Tensor) -> float:
    expected, actual = expected.float().cpu(), actual.float().cpu()
    return float((expected - actual).norm() / expected.norm())


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, use_cache=False).logits


def fp32_with_bf16_weights(model_type: str, seed: int = 0) -> torch.nn.Module:
    return tiny_model(model_type, dtype=torch.bfloat16, seed=seed).float()


TOKENS = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", ARCHS)
def test_patched_logits_match_fp32(arch: str) -> None:
    model = fp32_with_bf16_weights(arch)
    expected = logits(model, TOKENS)
    patched = kt_ops.patch_model(copy.deepcopy(model), method="BF16")
    assert rel_error(expected, logits(patched, TOKENS)) <= 5e-3
    layers = [m for m in patched.modules() if isinstance(m, kt_ops.HybridMoE)]
    assert len(layers) == 2 and not any(type(m).__name__.endswith(("Experts", "SparseMoeBlock")) for m in patched.modules())


@pytest.mark.parametrize("arch", ARCHS)
def test_patched_logits_match_bf16(arch: str) -> None:
    model = tiny_model(arch, dtype=torch.bfloat16)
    expected = logits(model, TOKENS)
    patched = kt_ops.patch_model(copy.deepcopy(model), method="BF16")
    out = logits(patched, TOKENS)
    assert out.dtype == torch.bfloat16
    assert rel_error(expected, out) <= 4e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_matches_the_hf_block(arch: str) -> None:
    """One MoE block on identical inputs: no earlier layer can move a router decision."""
    for dtype, tolerance in ((torch.float32, 4e-3), (torch.bfloat16, 1.5e-2)):
        model = tiny_model(arch, dtype=torch.bfloat16).to(dtype)
        block = copy.deepcopy(model.model.layers[1].mlp)
        patched = kt_ops.patch_model(model, method="BF16").model.layers[1].mlp
        assert isinstance(patched, kt_ops.HybridMoE)
        x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
        with torch.no_grad():
            expected, actual = block(x), patched(x)
        assert actual.shape == x.shape and actual.dtype == dtype
        assert rel_error(expected, actual) <= tolerance, (dtype, rel_error(expected, actual))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", [2, 4])
def test_greedy_generation_matches(arch: str, seed: int) -> None:
    """16 greedy tokens, bf16, agree with the unpatched model's — up to a near tie.

    A random tiny model has close calls (router and argmax) that any rounding difference
    can flip: the unpatched bf16 model flips against its own fp32 twin, and the same
    seed that agrees here diverged once on an H100 machine (torch 2.11, 16 threads). So
    where the streams first differ, the unpatched model must rate the patched model's
    token within GAP of its own choice, in standard deviations of that step's logits:
    measured gaps at such flips were 0.00-0.23. A wrong kernel (gate and up swapped)
    failed 4 of these 10 cases with gaps of 0.72-1.91 std (the logits tests above catch
    it in every case).
    """
    model = tiny_model(arch, dtype=torch.bfloat16, seed=seed)
    prompt = TOKENS[:1, :6]
    settings = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        expected = model.generate(prompt, **settings)
        patched = kt_ops.patch_model(copy.deepcopy(model), method="BF16")
        actual = patched.generate(prompt, **settings)
        assert actual.shape == expected.shape == (1, 22)
        differs = (expected != actual).nonzero()
        if differs.numel():
            step = int(differs[0, 1])
            scores = model(actual[:, :step]).logits[0, -1].float()
            gap = float((scores[expected[0, step]] - scores[actual[0, step]]) / scores.std())
            assert gap <= GAP, f"step {step - 6}: the patched token is {gap:.2f} std below the unpatched choice"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method, kwargs, tolerance", [
    ("AMXINT8", {}, 8e-2),
    ("AMXINT4", {"group_size": 32}, 3.5e-1),
    ("LLAMAFILE", {"gguf_type": "Q8_0"}, 8e-2),
    ("LLAMAFILE", {"gguf_type": ("Q4_0", "Q4_0", "Q8_0")}, 3.5e-1),
    ("MXFP4", {}, 3.5e-1),  # format mxfp4 through patch_model's default group_size (128: taken as its 32)
])
def test_quantized_methods(arch: str, method: str, kwargs: dict, tolerance: float) -> None:
    model = fp32_with_bf16_weights(arch)
    expected = logits(model, TOKENS)
    patched = kt_ops.patch_model(copy.deepcopy(model), method=method, **kwargs)
    error = rel_error(expected, logits(patched, TOKENS))
    assert 0 < error <= tolerance


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_experts_mask_gives_the_same_result(arch: str) -> None:
    model = fp32_with_bf16_weights(arch)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, [1, 4, 6]] = True
    mask[1, :] = True  # a layer with every expert in torch
    plain = kt_ops.patch_model(copy.deepcopy(model), method="BF16")
    masked = kt_ops.patch_model(copy.deepcopy(model), method="BF16", gpu_experts_mask=mask)
    layers = [m for m in masked.modules() if isinstance(m, kt_ops.HybridMoE)]
    assert [m.num_gpu_experts for m in layers] == [3, 8] and layers[1].packed.numel() == 0
    assert rel_error(logits(plain, TOKENS), logits(masked, TOKENS)) <= 5e-3
    counted = kt_ops.patch_model(copy.deepcopy(model), method="BF16", num_gpu_experts=[2, 0])
    assert [m.num_gpu_experts for m in counted.modules() if isinstance(m, kt_ops.HybridMoE)] == [2, 0]
    assert rel_error(logits(plain, TOKENS), logits(counted, TOKENS)) <= 5e-3


def test_gpu_experts_are_really_used() -> None:
    """Zeroing a GPU expert's weights changes the output iff that expert is routed."""
    model = fp32_with_bf16_weights("qwen3_moe")
    mask = torch.ones(2, 8, dtype=torch.bool)
    patched = kt_ops.patch_model(copy.deepcopy(model), method="BF16", gpu_experts_mask=mask)
    before = logits(patched, TOKENS)
    for layer in patched.modules():
        if isinstance(layer, kt_ops.HybridMoE):
            layer.gpu_down.zero_()
    assert rel_error(before, logits(patched, TOKENS)) > 0.05


def test_report_and_released_memory() -> None:
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    patched = kt_ops.patch_model(model, method="AMXINT8")
    report = patched.kt_ops_patch_report
    assert report.layers == 2 and report.method == "AMXINT8" and report.released_bytes == expert_bytes
    assert 0 < report.packed_bytes < expert_bytes and report.gpu_expert_bytes == 0
    assert not any(".experts." in n for n, _ in patched.named_parameters())
    assert "MoE layers -> AMXINT8" in str(report)


def test_state_dict_and_safetensors_round_trip(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    model = fp32_with_bf16_weights("deepseek_v3")
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[:, 0] = True
    patched = kt_ops.patch_model(copy.deepcopy(model), method="AMXINT4", gpu_experts_mask=mask, group_size=32)
    expected = logits(patched, TOKENS)
    save_file(patched.state_dict(), tmp_path / "model.safetensors")
    fresh = kt_ops.patch_model(fp32_with_bf16_weights("deepseek_v3", seed=5), method="AMXINT4",
                              gpu_experts_mask=mask, group_size=32)
    assert rel_error(expected, logits(fresh, TOKENS)) > 1e-2  # other weights, other result
    fresh.load_state_dict(load_file(tmp_path / "model.safetensors"))
    torch.testing.assert_close(logits(fresh, TOKENS), expected, rtol=0, atol=0)


def test_to_keeps_packed_experts_in_host_memory() -> None:
    layer = [m for m in kt_ops.patch_model(tiny_model("mixtral"), "BF16").modules()
             if isinstance(m, kt_ops.HybridMoE)][0]
    packed = layer.packed
    layer.to(torch.float32).to("meta")
    assert layer.packed is packed and layer.packed.device.type == "cpu"
    assert layer.router_weight.device.type == "meta" and layer.router_weight.dtype == torch.float32


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="model_type 'llama'.*supported: .*deepseek_v2.*gpt_oss.*mixtral.*qwen3_moe"):
        kt_ops.patch_model(model)


def test_bad_masks_are_rejected() -> None:
    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match=r"bool \[num_moe_layers=2, E=8\]"):
        kt_ops.patch_model(copy.deepcopy(model), gpu_experts_mask=torch.zeros(3, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="not both"):
        kt_ops.patch_model(copy.deepcopy(model), gpu_experts_mask=torch.zeros(2, 8, dtype=torch.bool), num_gpu_experts=1)
    for count in (9, 1.5, True, [1, 1.5]):  # a fraction would keep arange(E) < 1.5, i.e. 2 experts, silently
        with pytest.raises(ValueError, match="num_gpu_experts"):
            kt_ops.patch_model(copy.deepcopy(model), num_gpu_experts=count)
    kt_ops.patch_model(copy.deepcopy(model), num_gpu_experts=torch.tensor([1, 2]))  # an int tensor: one count per layer
    for count in (np.int64(1), torch.tensor(1), np.array([1, 2])):  # list() of the first two raised TypeError
        kt_ops.patch_model(copy.deepcopy(model), num_gpu_experts=count)
    with pytest.raises(ValueError, match="num_gpu_experts"):
        kt_ops.patch_model(copy.deepcopy(model), num_gpu_experts=object())


@pytest.mark.parametrize("option", ["dynamic_gpu_experts", "experts_interface"])
def test_a_switch_that_is_not_a_bool_is_refused(option) -> None:
    """dynamic_gpu_experts="no" packed every expert and kept host copies of them, and
    experts_interface="no" took the experts-interface path: a string is truthy."""
    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match=f"{option} must be a bool"):
        kt_ops.patch_model(model, num_gpu_experts=1, **{option: "no"})
    assert not any(isinstance(m, kt_ops.HybridMoE) for m in model.modules())  # refused before anything changed


@pytest.mark.parametrize("experts_interface", [False, True])
def test_a_progress_that_is_not_callable_is_refused_before_anything_changes(experts_interface: bool) -> None:
    """progress=True (or any non-callable) is a TypeError naming it, raised before any layer is patched (was
    "'bool' object is not callable" after the first MoE block had been replaced: a half-patched model)."""
    model = tiny_model("qwen3_moe")
    with pytest.raises(TypeError, match="progress must be a callable"):
        kt_ops.patch_model(model, progress=True, experts_interface=experts_interface)  # type: ignore[arg-type]
    assert not any(isinstance(m, kt_ops.HybridMoE) for m in model.modules())
    assert not any(kt_ops.hf_experts.packed_blob(m) is not None for m in model.modules()
                   if kt_ops.hf_experts.is_experts_module(m))


def test_dynamic_gpu_experts_without_gpu_experts_is_refused() -> None:
    """dynamic_gpu_experts=True with no GPU expert: the HybridMoE path packed every expert and
    kept their host copies for nothing to move (the experts-interface path and KtOpsConfig
    refused it already)."""
    model = tiny_model("qwen3_moe")
    for kwargs in ({}, {"num_gpu_experts": 0}):
        with pytest.raises(ValueError, match="dynamic_gpu_experts needs GPU experts"):
            kt_ops.patch_model(model, dynamic_gpu_experts=True, **kwargs)
    assert not any(isinstance(m, kt_ops.HybridMoE) for m in model.modules())


def test_transformers_v4_expert_lists() -> None:
    """Per-expert nn.Linear lists (transformers v4 layout, Mixtral's w1/w3/w2) are read too."""
    from kt_ops.wrappers.patch import _expert_tensors

    E, I, H = 4, 6, 8
    linears = [(torch.nn.Linear(H, I), torch.nn.Linear(H, I), torch.nn.Linear(I, H)) for _ in range(E)]
    for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        experts = torch.nn.ModuleList(torch.nn.Module() for _ in range(E))
        for expert, triple in zip(experts, linears):
            for name, linear in zip(names, triple):
                setattr(expert, name, linear)
        gate, up, down = _expert_tensors(experts, H)
        assert gate.shape == (E, I, H) and down.shape == (E, H, I)
        assert torch.equal(up[2], linears[2][1].weight) and torch.equal(down[3], linears[3][2].weight)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_router_trains_as_in_the_unpatched_model(arch: str) -> None:
    """patch_model's HybridMoE froze the router (its weight detached, requires_grad=False) while the
    unpatched model and patch_model(experts_interface=True) train it: a fine-tune of the patched model
    left every router as loaded, silently. Its gradient now matches the unpatched model's."""
    plain = tiny_model(arch).float()
    patched = kt_ops.patch_model(copy.deepcopy(plain), "BF16")
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    grads = []
    for model in (patched, plain):
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append([p.grad for n, p in model.named_parameters()
                      if n.endswith("router_weight") or n.endswith("mlp.gate.weight")])
    assert len(grads[0]) == len(grads[1]) == 2
    bound = 1e-2 if bf16_activations() else 1e-4  # amx: 1.8e-3
    for got, want in zip(*grads):
        assert got is not None and rel_error(want, got) <= bound
    frozen = tiny_model(arch).float()
    for p in frozen.parameters():
        p.requires_grad_(False)
    layer = next(m for m in kt_ops.patch_model(frozen, "BF16").modules() if isinstance(m, kt_ops.HybridMoE))
    assert not layer.router_weight.requires_grad  # a frozen router stays frozen


@pytest.mark.parametrize("experts_interface", [False, True])
def test_an_offloaded_model_is_refused_by_name(experts_interface: bool) -> None:
    """A model whose weights accelerate offloaded (cpu_offload, or from_pretrained's device_map "disk") holds meta
    tensors: patch_model is a ValueError saying so (the HybridMoE path was torch's NotImplementedError "Cannot copy out
    of meta tensor; no data!"), and the model is left as it was."""
    accelerate = pytest.importorskip("accelerate")
    model = tiny_model("qwen3_moe").float().eval()
    accelerate.cpu_offload(model, execution_device="cpu")
    with pytest.raises(ValueError, match="meta device.*offloaded"):
        kt_ops.patch_model(model, method="BF16", experts_interface=experts_interface)
    assert not any(isinstance(m, kt_ops.HybridMoE) for m in model.modules())


def test_experts_interface_model_survives_torch_save_and_load() -> None:
    """torch.save(model) + torch.load(weights_only=False) of a model patched behind the experts
    interface: the loaded model's first call raised IndexError (its released, empty expert
    tensors were taken for edited experts and packed again)."""
    import io

    patched = kt_ops.patch_model(fp32_with_bf16_weights("qwen3_moe"), method="BF16", experts_interface=True)
    expected = logits(patched, TOKENS)
    buffer = io.BytesIO()
    torch.save(patched, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(logits(loaded, TOKENS), expected, rtol=0, atol=0)


@pytest.mark.parametrize("strict", [True, False])
def test_experts_interface_state_dict_without_experts_is_refused(strict: bool) -> None:
    """The packed experts of a model patched behind the experts interface are not in its
    state_dict (only the released, empty expert tensors): loading one into another patched
    model kept that model's experts, silently (logits 7.5 off), or raised IndexError on the
    next call. Now a RuntimeError naming the module; the state_dict of the unpatched model,
    loaded before patching, is the way."""
    source = kt_ops.patch_model(fp32_with_bf16_weights("qwen3_moe"), method="BF16", experts_interface=True)
    target = kt_ops.patch_model(fp32_with_bf16_weights("qwen3_moe", seed=3), method="BF16", experts_interface=True)
    with pytest.raises(RuntimeError, match=r"layers\.0\.mlp\.experts.*released"):
        target.load_state_dict(source.state_dict(), strict=strict)
    adapter_only = {k: v for k, v in source.state_dict().items() if ".experts." not in k}
    target.load_state_dict(adapter_only, strict=False)  # the other weights still load
    torch.testing.assert_close(logits(target, TOKENS), logits(target, TOKENS))
