"""Hugging Face models through kt_ops with experts kept in torch on the model's device.

Each test runs on the CPU device everywhere and on ``cuda`` where a GPU is present (and
kt_ops was built with its CUDA key): the same code path, so the CPU run checks the test
itself and the GPU run checks the device placement, the CUDA key of ``kt::moe_forward``
inside a real model, and CUDA-graph capture of a whole patched model.

Tolerances: fp32 models with bf16-exact weights, BF16 method. patch_model's layers
against the unpatched model: 5e-3 (as tests/test_hf_patch.py). The experts-interface path
keeps transformers' routing, so its logits match eager transformers on the same device to
1e-5 on the CPU and 1e-4 on the GPU (torch's GPU kernels, TF32 off, round differently) where
the kernels compute in fp32, and to conftest.logits_bound() where they round activations
to bf16 (avx512_bf16, amx). On an H100 with a Xeon host (amx), 2026-11-26: 2.3e-3 on both
devices.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kt_ops  # noqa: E402
import kt_ops.cuda  # noqa: E402
from conftest import logits_bound  # noqa: E402
from hf_models import tiny_model  # noqa: E402
from kt_ops import hf_experts  # noqa: E402
from test_hf_patch import TOKENS, logits, rel_error  # noqa: E402

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not kt_ops.cuda.is_built(),
    reason="needs a GPU (torch.cuda.is_available() is False here) and kt_ops built with its CUDA key",
)
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=needs_gpu)]


def hybrid_layers(model: torch.nn.Module) -> list[kt_ops.HybridMoE]:
    return [m for m in model.modules() if isinstance(m, kt_ops.HybridMoE)]


def gpu_mask() -> torch.Tensor:
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, [1, 4, 6]] = True
    mask[1, [0, 7]] = True
    return mask


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 matmuls on the GPU in full fp32, so the bounds mean the same on both devices."""
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_patched_model_moved_to_the_device(arch: str, device: str) -> None:
    """patch_model on the CPU, then .to(device): the masked experts, router and shared
    experts go to the device, the packed experts stay in host memory, and the logits are
    the unpatched model's on that device."""
    model = tiny_model(arch, dtype=torch.bfloat16).float()
    patched = kt_ops.patch_model(copy.deepcopy(model), method="BF16", gpu_experts_mask=gpu_mask()).to(device)
    expected = logits(model.to(device), TOKENS.to(device))
    layers = hybrid_layers(patched)
    assert [m.num_gpu_experts for m in layers] == [3, 2]
    for layer in layers:
        assert layer.packed.device.type == "cpu"
        assert layer.gpu_gate_up.device.type == device and layer.router_weight.device.type == device
    got = logits(patched, TOKENS.to(device))
    assert got.device.type == device
    assert rel_error(expected, got) <= 5e-3


@needs_gpu
def test_patched_model_captured_in_a_cuda_graph() -> None:
    """A whole patched Qwen3-MoE forward (attention, routing, GPU experts, the CPU experts
    through the CUDA key's host function) captured once and replayed on new tokens."""
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16).float()
    patched = kt_ops.patch_model(copy.deepcopy(model), method="BF16", gpu_experts_mask=gpu_mask()).cuda()
    model.cuda()
    for layer in hybrid_layers(patched):
        layer.set_capture_batch_sizes([TOKENS.numel()])
    static = TOKENS.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):  # warm-up outside capture (allocations, routing tables)
            patched(static, use_cache=False)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_logits = patched(static, use_cache=False).logits
    for seed in (2, 3):
        tokens = torch.randint(0, 96, TOKENS.shape, generator=torch.Generator().manual_seed(seed))
        static.copy_(tokens.cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(logits(model, tokens.cuda()), static_logits) <= 5e-3
        # replay vs an eager call: the same CPU experts' bits; torch's GPU kernels (cuBLAS,
        # attention) may pick other algorithms on the capture stream, so not bit for bit
        eager_error = rel_error(logits(patched, tokens.cuda()), static_logits)
        assert eager_error <= 1e-5, f"replay vs eager: {eager_error:.3g}"


@pytest.fixture(scope="module")
def saved_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf_cuda") / "gpt_oss"
    tiny_model("gpt_oss", dtype=torch.bfloat16).float().save_pretrained(path)
    return path


@pytest.mark.parametrize("device", DEVICES)
def test_quantization_config_loads_gpu_experts_to_the_device(saved_gpt_oss: Path, device: str) -> None:
    """KtOpsConfig(num_gpu_experts=3) with device_map: experts [0, 3) of each layer load to
    the device in torch, the rest are packed in host memory; kt::moe_forward takes the
    device's activations (its CUDA key on a GPU); the logits are eager transformers' there."""
    eager = transformers.AutoModelForCausalLM.from_pretrained(
        saved_gpt_oss, dtype=torch.float32, device_map={"": device}, experts_implementation="eager").eval()
    ours = transformers.AutoModelForCausalLM.from_pretrained(
        saved_gpt_oss, dtype=torch.float32, device_map={"": device},
        quantization_config=kt_ops.KtOpsConfig(method="BF16", num_gpu_experts=3, progress=False)).eval()
    modules = [m for m in ours.modules() if hf_experts.is_experts_module(m)]
    assert len(modules) == 2
    for module in modules:
        assert hf_experts.local_experts(module)[0].tolist() == [0, 1, 2]
        assert hf_experts.packed_blob(module).device.type == "cpu"
    ids = TOKENS[:1, :8].to(device)
    with torch.no_grad():
        got, want = ours(ids).logits, eager(ids).logits
    assert got.device.type == device
    assert rel_error(want, got) <= logits_bound(1e-5 if device == "cpu" else 1e-4)


@needs_gpu
def test_experts_module_captured_in_a_cuda_graph(saved_gpt_oss: Path) -> None:
    """An experts module of the experts-interface path (gpt-oss, 3 experts in torch on the
    GPU) captured with reserved pinned buffers: replays equal eager calls on new routing."""
    ours = transformers.AutoModelForCausalLM.from_pretrained(
        saved_gpt_oss, dtype=torch.float32, device_map={"": "cuda"},
        quantization_config=kt_ops.KtOpsConfig(method="BF16", num_gpu_experts=3, progress=False)).eval()
    module = next(m for m in ours.modules() if hf_experts.is_experts_module(m))
    tokens, hidden, top_k = 6, 64, 2
    kt_ops.cuda.reserve_cuda_graph_buffers([tokens], hidden, top_k)

    def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, hidden, generator=g)
        ids = torch.stack([torch.randperm(8, generator=g)[:top_k] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
        return x.cuda(), ids.cuda(), weights.cuda()

    static = inputs(0)
    with torch.no_grad():
        module(*static)  # warm-up: the route table goes to the device here, not under capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_out = module(*static)
    for seed in (1, 2):
        fresh = inputs(seed)
        for slot, value in zip(static, fresh):
            slot.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            expected = module(*fresh)
        assert torch.equal(static_out, expected)


@needs_gpu
def test_model_moved_to_the_gpu_after_loading(saved_gpt_oss: Path) -> None:
    """Loaded on the CPU with experts kept in torch, then ``.cuda()``: those experts follow
    the activations to the GPU (copied on the first call), the packed ones stay in host
    memory; the logits are eager transformers' on the GPU."""
    ours = transformers.AutoModelForCausalLM.from_pretrained(
        saved_gpt_oss, dtype=torch.float32,
        quantization_config=kt_ops.KtOpsConfig(method="BF16", num_gpu_experts=3, progress=False)).eval().cuda()
    eager = transformers.AutoModelForCausalLM.from_pretrained(
        saved_gpt_oss, dtype=torch.float32, experts_implementation="eager").eval().cuda()
    ids = TOKENS[:1, :8].cuda()
    with torch.no_grad():
        got, want = ours(ids).logits, eager(ids).logits
    assert rel_error(want, got) <= logits_bound(1e-4)
    for module in (m for m in ours.modules() if hf_experts.is_experts_module(m)):
        assert hf_experts.packed_blob(module).device.type == "cpu"


@needs_gpu
def test_dynamic_experts_path_updates_under_a_captured_graph(saved_gpt_oss: Path) -> None:
    """patch_model(dynamic_gpu_experts=True) on gpt-oss (the experts-interface path): an
    experts module captured, its experts in torch moved by update_local_experts, the replay
    computes the new placement."""
    from hf_models import tiny_model

    def patched(ids: list[int], dynamic: bool) -> torch.nn.Module:
        mask = torch.zeros(2, 8, dtype=torch.bool)
        mask[:, ids] = True
        model = tiny_model("gpt_oss", dtype=torch.bfloat16).float()
        return kt_ops.patch_model(model, "BF16", gpu_experts_mask=mask, dynamic_gpu_experts=dynamic).cuda()

    module = next(m for m in patched([0, 1], True).modules() if hf_experts.is_experts_module(m))
    fixed = next(m for m in patched([4, 7], False).modules() if hf_experts.is_experts_module(m))
    tokens, hidden, top_k = 6, 64, 2
    kt_ops.cuda.reserve_cuda_graph_buffers([tokens], hidden, top_k)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(tokens, hidden, generator=g).cuda()
    ids = torch.stack([torch.randperm(8, generator=g)[:top_k] for _ in range(tokens)]).cuda()
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1).cuda()
    with torch.no_grad():
        module(x, ids, weights)  # warm-up: route table and experts on the device
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = module(x, ids, weights)
    hf_experts.update_local_experts(module, [4, 7])
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        expected = fixed(x, ids, weights)
    assert rel_error(expected, out) <= 1e-5
