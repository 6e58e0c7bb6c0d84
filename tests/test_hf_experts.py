"""experts_implementation="kt_ops" (kt_ops.hf_experts): every transformers MoE architecture
whose experts class uses transformers' experts interface runs its experts through
kt::moe_forward — loaded from a saved checkpoint with from_pretrained, compared with the
same checkpoint in transformers eager; activations probed from the class (never a silent
SiLU); torch.compile after packing; registration without importing transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import kt_ops  # noqa: E402  (registers kt_ops once transformers is imported)
from conftest import bf16_activations, logits_bound  # noqa: E402
from hf_models import CONFIGS, EXPERTS_CONFIGS, tiny_model  # noqa: E402
from kt_ops import hf_experts  # noqa: E402

ARCHS = ["qwen3_moe", "deepseek_v3", "deepseek_v4", "glm4_moe", "gpt_oss", "qwen3_next", "minimax_m2", "mixtral",
         "olmoe", "qwen2_moe", "deepseek_v2", "qwen3_5_moe_text", "glm_moe_dsa", "deepseek_v32", "minimax_m3_vl_text", "kimi_linear"]
assert set(ARCHS) <= set(CONFIGS) | set(EXPERTS_CONFIGS)
GAP = 0.3  # std of a step's logits: as tests/test_hf_patch.py's test_greedy_generation_matches


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each architecture saved once with save_pretrained (bf16 weights, fp32 on disk)."""
    root = tmp_path_factory.mktemp("hf_experts")
    paths = {}
    for arch in ARCHS:
        model = tiny_model(arch, dtype=torch.bfloat16).float()
        model.save_pretrained(root / arch)
        paths[arch] = root / arch
    return paths


def load(path: Path, implementation: str) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation=implementation,
                                                             dtype=torch.float32).eval()


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hf_experts.is_experts_module(m)]


def kt_calls(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Logits and how many kt::moe_forward calls one forward made."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        logits = model(ids).logits
    return logits, sum(1 for e in prof.events() if e.name == "kt::moe_forward")


@pytest.mark.parametrize("arch", ARCHS)
def test_from_pretrained_matches_eager(saved: dict[str, Path], arch: str) -> None:
    ours, eager = load(saved[arch], "kt_ops"), load(saved[arch], "eager")
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    logits, calls = kt_calls(ours, ids)
    layers = len(experts_modules(ours))
    assert layers >= 1 and calls == layers, f"{calls} kt::moe_forward calls for {layers} MoE layers"
    assert all(hf_experts.packed_blob(m) is not None for m in experts_modules(ours))
    with torch.no_grad():
        want = eager(ids).logits
    per_token = ((logits - want).norm(dim=-1) / want.norm(dim=-1)).flatten()
    assert per_token.median() <= 1e-2, f"median per-token relative error {per_token.median():.3g}"
    assert_same_greedy_tokens(ours, eager, ids[:1, :4])


def assert_same_greedy_tokens(ours: torch.nn.Module, eager: torch.nn.Module, prompt: torch.Tensor) -> None:
    """16 greedy tokens: identical where the kernels compute in fp32; where they round
    activations to bf16, the first token that differs must be a near tie of the eager model
    (within GAP std of its choice; seen on amx: DeepSeek-V3's 9th token, 2026-11-26)."""
    settings = dict(max_new_tokens=16, do_sample=False, min_new_tokens=16)
    got, want = ours.generate(prompt, **settings), eager.generate(prompt, **settings)
    if not bf16_activations():
        assert torch.equal(got, want)
        return
    differs = (got != want).nonzero()
    if differs.numel():
        step = int(differs[0, 1])
        with torch.no_grad():
            scores = eager(got[:, :step]).logits[0, -1].float()
        gap = float((scores[want[0, step]] - scores[got[0, step]]) / scores.std())
        assert gap <= GAP, f"token {step}: ours is {gap:.2f} std below the eager choice"


@pytest.mark.parametrize("method,bound", [("AMXINT8", 5e-2), ("LLAMAFILE", 5e-2)])
def test_pack_model_experts_chooses_the_format(saved: dict[str, Path], method: str, bound: float) -> None:
    ours, eager = load(saved["qwen3_moe"], "kt_ops"), load(saved["qwen3_moe"], "eager")
    extra = {"gguf_type": "Q8_0"} if method == "LLAMAFILE" else {}
    assert hf_experts.pack_model_experts(ours, method, **extra) == 2
    assert {kt_ops.PackedExperts(hf_experts.packed_blob(m)).format for m in experts_modules(ours)} == \
        {"gguf" if method == "LLAMAFILE" else "int8"}
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = ours(ids).logits, eager(ids).logits
    assert ((got - want).norm() / want.norm()) <= bound


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_gpu_experts_in_torch(saved: dict[str, Path], arch: str) -> None:
    """Experts kept in torch (a mask or num_gpu_experts; here on the CPU device) with the
    class's own gate and biases, the rest packed: the same logits, and kt::moe_forward
    still runs once per layer. With 7 of 8 in torch, top-k 2 is above the one packed expert:
    the operator refused every call ("top-k = 2 exceeds the number of experts E = 1"; it
    takes such calls now)."""
    ours, eager = load(saved[arch], "kt_ops"), load(saved[arch], "eager")
    layers = len(experts_modules(ours))
    mask = torch.zeros(layers, 8, dtype=torch.bool)
    mask[0, [1, 5]] = True
    mask[-1, [0, 2, 7]] = True
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = eager(ids).logits
    for kwargs in ({"gpu_experts_mask": mask}, {"num_gpu_experts": 3}, {"num_gpu_experts": 7}, {"num_gpu_experts": 8}):
        hf_experts.pack_model_experts(ours, "BF16", **kwargs)
        logits, calls = kt_calls(ours, ids)
        assert calls == (0 if kwargs.get("num_gpu_experts") == 8 else layers)
        assert ((logits - want).norm() / want.norm()) <= logits_bound(), kwargs
    with pytest.raises(ValueError, match="num_moe_layers"):
        hf_experts.pack_model_experts(ours, gpu_experts_mask=mask[:1])
    with pytest.raises(ValueError, match="must be bool"):  # an int mask is not a list of expert indices
        hf_experts.pack_model_experts(ours, gpu_experts_mask=mask.int())
    for count in (1.5, True, -1, 9):  # 1.5 would keep arange(8) < 1.5, two experts, silently
        with pytest.raises(ValueError, match=r"num_gpu_experts must be an int in \[0, 8\]"):
            hf_experts.pack_model_experts(ours, num_gpu_experts=count)


def test_pack_model_experts_takes_numpy_counts_and_refuses_a_dynamic_switch_that_is_not_a_bool(
        saved: dict[str, Path]) -> None:
    """``num_gpu_experts: int``: numpy's too, as patch_model's; ``dynamic: bool``: "no" is truthy (every
    expert packed and host copies kept, silently)."""
    ours = load(saved["qwen3_moe"], "kt_ops")
    assert hf_experts.pack_model_experts(ours, "BF16", num_gpu_experts=np.int64(3)) == len(experts_modules(ours))
    assert int(hf_experts.local_experts(experts_modules(ours)[0])[0].numel()) == 3
    with pytest.raises(ValueError, match="dynamic must be a bool"):
        hf_experts.pack_model_experts(ours, "BF16", num_gpu_experts=3, dynamic="no")
    with pytest.raises(ValueError, match="dynamic must be a bool"):
        hf_experts.pack_module_experts(experts_modules(ours)[0], "BF16", dynamic="no")



def test_a_skipped_slot_stays_skipped_with_experts_in_torch() -> None:
    """With experts kept in torch the ids go through a route table: torch.take read -1 (a
    skipped slot) as the last expert's entry, so the slot computed expert E - 1 silently,
    and -2 another expert instead of an error."""
    module = experts_modules(tiny_model("qwen3_moe", dtype=torch.float32))[0]
    E, H = int(module.down_proj.shape[0]), int(module.down_proj.shape[1])
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, H, generator=g), torch.rand(3, 2, generator=g)
    ids = torch.tensor([[0, -1], [2, 3], [-1, 1]])
    hf_experts.pack_module_experts(module, "BF16")
    want = hf_experts.experts_forward(module, x, ids, w)
    mask = torch.zeros(E, dtype=torch.bool)
    mask[5] = True
    hf_experts.pack_module_experts(module, "BF16", gpu_experts_mask=mask)
    torch.testing.assert_close(hf_experts.experts_forward(module, x, ids, w), want)
    for bad in (-2, E):
        with pytest.raises(ValueError, match="outside"):
            hf_experts.experts_forward(module, x, torch.tensor([[0, bad], [2, 3], [1, 0]]), w)


@pytest.mark.parametrize("error", [KeyboardInterrupt, MemoryError])
def test_packing_interrupted_keeps_the_module_as_it_was(monkeypatch, error) -> None:
    """Ctrl-C (or an error) while a packed module is packed again, here keeping expert 5 in
    torch: the new route and experts in torch were set before the packing, the old blob kept
    with them, so the module computed expert 5 twice and the others through the wrong rows,
    silently. The module changes only once its new blob is packed."""
    module = experts_modules(tiny_model("qwen3_moe", dtype=torch.float32))[0]
    E, H = int(module.down_proj.shape[0]), int(module.down_proj.shape[1])
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, H, generator=g), torch.rand(3, 2, generator=g)
    ids = torch.tensor([[0, 5], [6, 7], [5, 1]])
    hf_experts.pack_module_experts(module, "BF16")
    want = hf_experts.experts_forward(module, x, ids, w)

    def interrupted(*args, **kwargs):
        raise error

    monkeypatch.setattr(kt_ops.ops, "pack_experts", interrupted)
    mask = torch.zeros(E, dtype=torch.bool)
    mask[5] = True
    with pytest.raises(error):
        hf_experts.pack_module_experts(module, "BF16", gpu_experts_mask=mask)
    monkeypatch.undo()
    assert hf_experts.local_experts(module) is None
    torch.testing.assert_close(hf_experts.experts_forward(module, x, ids, w), want)
    hf_experts.pack_module_experts(module, "BF16", gpu_experts_mask=mask)  # expert 5 in fp32 now, not bf16
    torch.testing.assert_close(hf_experts.experts_forward(module, x, ids, w), want, atol=1e-2, rtol=0)


@pytest.mark.parametrize("pack", ["first call", "AMXINT8"])
def test_load_state_dict_after_packing_packs_the_loaded_experts(pack: str) -> None:
    """The blob is a copy of the experts: after load_state_dict the model kept computing the
    experts it had before (logits 0.48 off), silently."""
    ours, other = tiny_model("qwen3_moe", dtype=torch.float32, seed=0).eval(), tiny_model("qwen3_moe", seed=1)
    other = other.float().eval()
    ours.set_experts_implementation(hf_experts.IMPLEMENTATION)
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = other(ids).logits
        if pack == "first call":
            ours(ids)
        else:
            hf_experts.pack_model_experts(ours, pack)
        ours.load_state_dict(other.state_dict())
        got = ours(ids).logits
    assert ((got - want).norm() / want.norm()) <= (logits_bound() if pack == "first call" else 0.1)
    if pack != "first call":
        assert all(kt_ops.PackedExperts(hf_experts.packed_blob(m)).format == "int8" for m in experts_modules(ours))

@pytest.mark.parametrize("pack", ["first call", "BF16"])
def test_experts_edited_in_place_after_packing_are_packed_again(pack: str) -> None:
    """The blob is a copy: after an in-place edit of the experts (``no_grad`` then
    ``mul_`` / ``copy_``, as weight surgery or an optimizer step does) the model kept
    computing the old experts, silently. Now the next eager call packs them again; an
    expert tensor replaced by another (the same values) is recorded, not packed again."""
    # bf16 weights in fp32 (BF16 packs them exactly), as the load_state_dict test above
    ours, plain = (tiny_model("qwen3_moe", seed=0).float().eval() for _ in range(2))
    ours.set_experts_implementation(hf_experts.IMPLEMENTATION)
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if pack == "first call":
            ours(ids)
        else:
            hf_experts.pack_model_experts(ours, pack)
        for model in (ours, plain):
            experts = experts_modules(model)[0]
            experts.down_proj.mul_(-2.0)
            experts.gate_up_proj.copy_(experts.gate_up_proj.flip(0))
        want = plain(ids).logits
        got = ours(ids).logits
        assert ((got - want).norm() / want.norm()) <= logits_bound()
        first = experts_modules(ours)[0]
        blob = hf_experts.packed_blob(first)
        first.down_proj = torch.nn.Parameter(first.down_proj.detach().clone(), requires_grad=False)
        assert torch.equal(ours(ids).logits, got) and hf_experts.packed_blob(first) is blob


def test_activations_are_read_from_the_class(saved: dict[str, Path]) -> None:
    gpt_oss = experts_modules(load(saved["gpt_oss"], "kt_ops"))[0]
    assert hf_experts.activation_of(gpt_oss, 32) == (7.0, 1.702)
    v4 = experts_modules(load(saved["deepseek_v4"], "kt_ops"))[0]
    assert hf_experts.activation_of(v4, 32) == (float(v4.limit), 0.0)
    qwen = experts_modules(load(saved["qwen3_moe"], "kt_ops"))[0]
    assert hf_experts.activation_of(qwen, 32) == (0.0, 0.0)
    # gpt-oss's biases and interleaved gate/up reach the blob
    blob = hf_experts.pack_module_experts(gpt_oss)
    assert kt_ops.PackedExperts(blob).has_biases


@pytest.mark.parametrize("arch, limit, alpha", [("deepseek_v4", 12.0, 0.0), ("deepseek_v4", 20.0, 0.0),
                                                  ("gpt_oss", 30.0, 1.702)])
def test_a_limit_past_the_probe_range_is_kept(arch: str, limit: float, alpha: float) -> None:
    """A SwiGLU limit of 12 or more: the probe used to stay inside [-12, 12], so the clamp
    was never reached, the unclamped candidate matched first and the limit was dropped."""
    config = EXPERTS_CONFIGS[arch]()
    config.swiglu_limit = limit
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    experts = experts_modules(model)[0]
    assert hf_experts.activation_of(experts, 32) == (limit, alpha)
    with torch.no_grad():
        x, ids, w = torch.randn(5, 64) * 30, torch.randint(0, 8, (5, 2)), torch.rand(5, 2)
        experts.config._experts_implementation = "eager"
        expected = experts(x, ids, w)
        experts.config._experts_implementation = "kt_ops"
        actual = experts(x, ids, w)
    assert float((expected - actual).norm() / expected.norm()) <= 5e-2


def test_the_activation_is_probed_in_fp32_under_a_bf16_default_dtype() -> None:
    """torch.set_default_dtype(torch.bfloat16) (and transformers' loading, which sets the
    model's dtype as the default): a probe drawn in bf16 matched no candidate, and SiLU
    experts were refused as an activation kt_ops does not compute."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(EXPERTS_CONFIGS["olmoe"](), dtype=torch.float32).eval()
    experts = experts_modules(model)[0]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        assert hf_experts.activation_of(experts, 32) == (0.0, 0.0)
    finally:
        torch.set_default_dtype(default)


def _custom_experts(act: str = "gelu", **flags: bool) -> torch.nn.Module:
    from transformers.activations import ACT2FN
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(**flags)
    class OddExperts(torch.nn.Module):
        def __init__(self, config: object) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 64, 32))
            self.up_proj = torch.nn.Parameter(torch.randn(4, 32, 32))
            self.down_proj = torch.nn.Parameter(torch.randn(4, 32, 32))
            self.act_fn = ACT2FN[act]

        def forward(self, hidden_states, top_k_index, top_k_weights):  # pragma: no cover - not used
            raise NotImplementedError

    config = transformers.PretrainedConfig()
    config._experts_implementation = "kt_ops"
    return OddExperts(config)


@pytest.mark.parametrize("kind,match", [
    ("gelu", "OddExperts._apply_gate is an activation kt_ops does not compute"),
    ("no_gate", "OddExperts has no gate"),
    ("post_norm", "OddExperts applies a norm after each expert"),
])
def test_what_kt_ops_cannot_compute_is_refused(kind: str, match: str) -> None:
    module = {"gelu": lambda: _custom_experts("gelu"), "no_gate": lambda: _custom_experts("silu", has_gate=False),
              "post_norm": lambda: _custom_experts("silu", has_post_expert_norm=True)}[kind]()
    x, ids, w = torch.randn(3, 32), torch.randint(0, 4, (3, 2)), torch.rand(3, 2)
    with pytest.raises(ValueError, match=match):
        module(x, ids, w)
    silu = _custom_experts("silu")  # the same class with SiLU runs
    out = silu(x, ids, w)
    gate, up = silu.gate_up_proj.detach().chunk(2, dim=1)
    ref = kt_ops.reference.moe_forward(x, ids, w, gate, up, silu.down_proj.detach())
    assert ((out - ref).norm() / ref.norm()) <= 1e-2


def test_compile_after_packing(saved: dict[str, Path]) -> None:
    model = load(saved["qwen3_moe"], "kt_ops")
    experts = experts_modules(model)[0]
    x, ids, w = torch.randn(5, 64), torch.randint(0, 8, (5, 2)), torch.rand(5, 2)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="before torch.compile"):
        torch.compile(experts, fullgraph=True)(x, ids, w)
    hf_experts.pack_model_experts(model)
    torch._dynamo.reset()
    compiled = torch.compile(experts, fullgraph=True)
    assert torch.equal(compiled(x, ids, w), experts(x, ids, w))
    torch._dynamo.reset()
    whole = torch.compile(model, fullgraph=True)  # the whole model: no graph break in the experts
    tokens = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = whole(tokens).logits, model(tokens).logits
    assert ((got - want).norm() / want.norm()) <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_quantization_config_packs_while_loading(saved: dict[str, Path], arch: str) -> None:
    """from_pretrained(..., quantization_config=KtOpsConfig(...)): the experts are packed as
    they load (their parameters left empty), the experts implementation is kt_ops, and the
    model computes what the eager model computes."""
    for arch, method, bound in ((arch, "BF16", logits_bound()), (arch, "AMXINT8", 1e-1)):
        ours = transformers.AutoModelForCausalLM.from_pretrained(
            saved[arch], dtype=torch.float32, quantization_config=kt_ops.KtOpsConfig(method=method, progress=False))
        eager = load(saved[arch], "eager")
        assert ours.config._experts_implementation == "kt_ops"
        for module in experts_modules(ours):
            assert module.gate_up_proj.numel() == 0 and hf_experts.packed_blob(module) is not None
        ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            got, want = ours(ids).logits, eager(ids).logits
        if method == "BF16":
            assert ((got - want).norm() / want.norm()) <= bound, arch
        else:
            # int8 moves close router choices in the next layer, and a token whose experts
            # changed jumps (DeepSeek-V3 on amx, 2026-11-26: 0.19 over all tokens): the
            # median token's error is the kernel's
            per_token = ((got - want).norm(dim=-1) / want.norm(dim=-1)).flatten()
            assert per_token.median() <= bound, (arch, per_token)
    with pytest.raises(ValueError, match="not available"):
        kt_ops.KtOpsConfig(method="NOPE")
    with pytest.raises(ValueError, match="needs gguf_type"):
        kt_ops.KtOpsConfig(method="LLAMAFILE")
    # arguments the method does not take: at construction, not per tensor while loading
    with pytest.raises(ValueError, match="gguf_type applies to method 'LLAMAFILE', not 'AMXINT8'"):
        kt_ops.KtOpsConfig(method="AMXINT8", gguf_type="Q4_0")
    with pytest.raises(ValueError, match="'BF16' has no k-groups"):
        kt_ops.KtOpsConfig(method="BF16", group_size=64)
    with pytest.raises(ValueError, match="unknown GGUF type 'Q9_9'"):
        kt_ops.KtOpsConfig(method="LLAMAFILE", gguf_type="Q9_9")
    for group in (0, -32, 48, 256):  # 0 was read as 128 and -32 named as 4294967264, when the model loaded
        with pytest.raises(ValueError, match=f"'AMXINT4' needs group_size 32, 64 or 128 \\(or None\\), got {group}"):
            kt_ops.KtOpsConfig(method="AMXINT4", group_size=group)


def test_quantization_config_keeps_gpu_experts_in_torch(saved: dict[str, Path]) -> None:
    """KtOpsConfig(num_gpu_experts=n): experts [0, n) of every layer stay in torch (here on
    the CPU device), the rest are packed; the logits are the eager model's."""
    eager = load(saved["gpt_oss"], "eager")
    ours = transformers.AutoModelForCausalLM.from_pretrained(
        saved["gpt_oss"], dtype=torch.float32,
        quantization_config=kt_ops.KtOpsConfig(method="BF16", num_gpu_experts=3, progress=False))
    for module in experts_modules(ours):
        assert hf_experts.local_experts(module)[0].tolist() == [0, 1, 2]
        assert kt_ops.PackedExperts(hf_experts.packed_blob(module)).num_experts == 5
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got, want = ours(ids).logits, eager(ids).logits
    assert ((got - want).norm() / want.norm()) <= logits_bound()
    with pytest.raises(ValueError, match="num_gpu_experts 9 exceeds"):
        transformers.AutoModelForCausalLM.from_pretrained(
            saved["gpt_oss"], quantization_config=kt_ops.KtOpsConfig(num_gpu_experts=9))


def test_quantization_config_model_refuses_a_state_dict_with_its_experts(saved: dict[str, Path]) -> None:
    """A KtOpsConfig model's expert tensors are empty placeholders (the packed blob is not in
    its state_dict): load_state_dict of another such model's state dict kept its own
    experts, silently, and save_pretrained is refused by transformers (not serializable)."""
    ours, other = (transformers.AutoModelForCausalLM.from_pretrained(
        saved["qwen3_moe"], dtype=torch.float32, quantization_config=kt_ops.KtOpsConfig(method=method, progress=False))
        for method in ("BF16", "AMXINT8"))
    with pytest.raises(RuntimeError, match=r"layers\.0\.mlp\.experts.*released"):
        ours.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="not serializable"):
        ours.save_pretrained(saved["qwen3_moe"].parent / "kt_ops_saved")


def test_quantization_config_checks_sizes_before_loading(saved: dict[str, Path]) -> None:
    """A method that cannot hold the experts' sizes (AWQ's groups of 128 with H = 64) is a
    ValueError naming the class, before any tensor is read."""
    with pytest.raises(ValueError, match="GptOssExperts .H=64, I=32. cannot be packed as AWQ_INT4"):
        transformers.AutoModelForCausalLM.from_pretrained(
            saved["gpt_oss"], dtype=torch.float32, quantization_config=kt_ops.KtOpsConfig(method="AWQ_INT4"))
    model = transformers.AutoModelForCausalLM.from_pretrained(  # groups of 32 fit
        saved["gpt_oss"], dtype=torch.float32,
        quantization_config=kt_ops.KtOpsConfig(method="AWQ_INT4", group_size=32, progress=False))
    assert {kt_ops.PackedExperts(hf_experts.packed_blob(m)).format for m in experts_modules(model)} == {"int4_asym"}


def test_quantization_config_refuses_the_activation_before_loading(tmp_path: Path) -> None:
    """Experts whose activation kt_ops does not compute (GELU here): a ValueError naming the
    class and the activation before any tensor is read, as for sizes — not transformers'
    RuntimeError about "automatic conversion of the weights" once the checkpoint was read."""
    config = CONFIGS["qwen3_moe"]()
    config.hidden_act = "gelu"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Qwen3MoeExperts._apply_gate is an activation kt_ops does not compute"):
        transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=torch.float32, quantization_config=kt_ops.KtOpsConfig(method="BF16", progress=False))


def test_quantization_config_refuses_a_model_without_an_experts_class(tmp_path: Path) -> None:
    """JetMoE (its MoE does not use transformers' experts interface): a ValueError, not a
    model loaded whole in its float dtype with nothing packed while kt_ops was asked for."""
    config = transformers.JetMoeConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=32, num_local_experts=8,
                                       num_experts_per_tok=2, kv_channels=16)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="JetMoeForCausalLM has no experts class using transformers' experts"):
        transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=torch.float32, quantization_config=kt_ops.KtOpsConfig(method="BF16", progress=False))



def test_a_kt_ops_quantization_config_in_config_json_packs_the_float_weights(saved: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    """A float checkpoint whose config.json carries KtOpsConfig's dict (model.config saved from
    a model loaded with it): transformers calls it pre-quantized, yet kt_ops never saves
    packed experts, so its experts are packed as they load, with its GPU experts — not a
    ValueError saying the checkpoint lacks the expert tensors it has."""
    import shutil

    shutil.copytree(saved["qwen3_moe"], tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = kt_ops.KtOpsConfig(method="AMXINT8", num_gpu_experts=2, progress=False).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    for given in ({}, {"quantization_config": kt_ops.KtOpsConfig(method="AMXINT8", num_gpu_experts=2, progress=False)}):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, **given).eval()
        assert model.config.quantization_config.packed_methods == ["AMXINT8"]
        for module in experts_modules(model):
            assert hf_experts.local_experts(module)[0].tolist() == [0, 1]
            assert kt_ops.PackedExperts(hf_experts.packed_blob(module)).format == "int8"
        ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            got, want = model(ids).logits, load(saved["qwen3_moe"], "eager")(ids).logits
        per_token = ((got - want).norm(dim=-1) / want.norm(dim=-1)).flatten()
        assert per_token.median() <= 1e-1
    # a fresh process that only imported kt_ops: the quantizer registers with transformers itself
    script = ("import sys, torch, kt_ops, transformers\n"
              "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)\n"
              "print(m.config.quantization_config.packed_methods)\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "['AMXINT8']", done.stderr[-2000:]


def write_big_checkpoint(path: str, layers: str) -> int:
    """A Qwen3-MoE checkpoint of random bf16 weights, one shard per layer, ~288 MiB of
    experts per layer (64 experts, H 1024, I 768), written tensor by tensor."""
    import json

    from safetensors.torch import save_file

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=1024, num_hidden_layers=int(layers), num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, intermediate_size=1024, moe_intermediate_size=768, num_experts=64, num_experts_per_tok=4,
        norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=256)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    Path(path).mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    for key, param in model.state_dict().items():
        tensor = torch.empty(param.shape, dtype=torch.bfloat16)
        tensor.fill_(1) if "norm" in key else tensor.normal_(0, 0.02, generator=g)
        shard[key] = tensor
        if key.endswith("down_proj") or key == "lm_head.weight":
            name = f"model-{len(set(index.values())):05d}.safetensors"
            save_file(shard, f"{path}/{name}", metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard = {}
    Path(path, "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return 0


def load_and_measure(path: str, method: str) -> int:
    """Loads with KtOpsConfig and prints final RSS, peak RSS (VmHWM) and packed bytes."""
    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=kt_ops.KtOpsConfig(method=method, progress=False))
    blobs = sum(hf_experts.packed_blob(m).numel() for m in experts_modules(model))
    print("final", status("VmRSS:"), "peak", status("VmHWM:"), "blobs", blobs)
    return 0


def test_loading_peak_rss_is_bounded(tmp_path: Path) -> None:
    """Peak RSS while loading <= final RSS + 2 layers of unpacked experts + 1 GiB, on a
    checkpoint of 1.7 GiB of bf16 experts (6 layers of 288 MiB) packed into AMXINT4."""
    here = Path(__file__)
    layers, layer_bytes = 6, 3 * 64 * 1024 * 768 * 2
    assert layers * layer_bytes >= 1.5 * 2**30
    run = [sys.executable, str(here)]
    written = subprocess.run([*run, "write_big_checkpoint", str(tmp_path / "big"), str(layers)], capture_output=True,
                             text=True, timeout=600, cwd=here.parent)
    assert written.returncode == 0, written.stderr[-2000:]
    loaded = subprocess.run([*run, "load_and_measure", str(tmp_path / "big"), "AMXINT4"], capture_output=True,
                            text=True, timeout=600, cwd=here.parent)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    values = dict(zip(loaded.stdout.split()[-6::2], map(int, loaded.stdout.split()[-5::2])))
    bound = values["final"] + 2 * layer_bytes + 2**30
    assert values["peak"] <= bound, f"peak {values['peak'] / 2**20:.0f} MiB > bound {bound / 2**20:.0f} MiB ({values})"
    assert values["final"] <= values["blobs"] + 2**30  # the bf16 experts are not resident after loading


@pytest.mark.parametrize("arch", ["gpt_oss", "olmoe", "glm4_moe", "deepseek_v4"])
def test_patch_model_covers_the_experts_interface(arch: str) -> None:
    """patch_model on a model type without kt_ops' own MoE block: the experts interface,
    the expert tensors released, the logits kept."""
    from kt_ops.wrappers import HYBRID_MODEL_TYPES, supported_model_types

    assert arch not in HYBRID_MODEL_TYPES and arch in supported_model_types()
    model = tiny_model(arch, dtype=torch.bfloat16).float().eval()
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids).logits
    with pytest.raises(ValueError, match="num_gpu_experts must be"):
        kt_ops.patch_model(model, num_gpu_experts=9)
    kt_ops.patch_model(model, method="BF16", num_gpu_experts=2)  # experts 0, 1 of each layer kept in torch
    report = model.kt_ops_patch_report
    assert report.layers == len(experts_modules(model)) and report.released_bytes > 0 and report.gpu_expert_bytes > 0
    assert all(m.gate_up_proj.numel() == 0 for m in experts_modules(model))
    logits, calls = kt_calls(model, ids)
    assert calls == report.layers
    assert ((logits - want).norm() / want.norm()) <= logits_bound()
    assert "nemotron_h" not in supported_model_types()  # has_gate=False: not computed
    with pytest.raises(ValueError, match="already runs on packed kt_ops experts"):  # the float weights are gone
        kt_ops.patch_model(model, method="BF16")


def test_patch_model_twice_says_so() -> None:
    """A model whose MoE blocks patch_model already replaced (HybridMoE): a ValueError
    saying so, not only that no block was found."""
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16).float().eval()
    kt_ops.patch_model(model, method="BF16")
    with pytest.raises(ValueError, match="HybridMoE layers already .patch_model ran on it"):
        kt_ops.patch_model(model, method="BF16")


@pytest.mark.parametrize("kwargs", [{"dynamic": True}, {"num_gpu_experts": 1, "dynamic": True}])
def test_pack_model_experts_of_a_model_without_experts_packs_none(kwargs: dict) -> None:
    """A model with no experts module packs none with dynamic=True too, as without it (was an IndexError from the
    first layer's mask)."""
    assert hf_experts.pack_model_experts(torch.nn.Linear(4, 4), **kwargs) == 0


def save_tokenizer(path: Path, vocab_size: int = 96) -> None:
    """A word-level tokenizer over "w0" ... "w94" (and [UNK]) for the tiny models."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 1)} | {"[UNK]": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="w0")
    fast.save_pretrained(path)


def test_kt_ops_generate_runs_on_a_saved_model(saved: dict[str, Path]) -> None:
    """kt-ops generate MODEL --prompt ...: streams tokens (the same as transformers eager,
    greedy) and reports prefill/decode tokens/s; a bad directory is exit status 2."""
    path = saved["qwen3_moe"]
    save_tokenizer(path)
    prompt = "w5 w17 w42 w3"
    result = subprocess.run([sys.executable, "-m", "kt_ops", "generate", str(path), "--prompt", prompt,
                             "--max-new-tokens", "8", "--dtype", "float32"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "decode" in result.stderr and "tokens/s" in result.stderr and "BF16" in result.stderr
    eager = load(path, "eager")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    want = eager.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    expected = tokenizer.decode(want[0, ids.shape[1]:], skip_special_tokens=True)
    assert result.stdout.split() == expected.split()
    bad = subprocess.run([sys.executable, "-m", "kt_ops", "generate", str(path.parent / "missing"), "--prompt", "w1"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "error" in bad.stderr.splitlines()[-1]


def test_kt_ops_generate_gguf_types(saved: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                   tmp_path: Path) -> None:
    """kt-ops generate --gguf-type: one type alone means LLAMAFILE, GATE,UP,DOWN gives a type per
    matrix; a K-quant whose blocks do not fit the rows (H = 64) is exit status 2 naming
    llama.cpp's types in the command line's syntax; a type with another method is exit
    status 2 before anything loads; --chat without a chat template says so; --tokenizer
    serves a model directory without one."""
    import shutil

    from kt_ops import generate

    path = saved["qwen3_moe"]
    save_tokenizer(path)
    args = [str(path), "--prompt", "w5 w17", "--max-new-tokens", "2", "--dtype", "float32"]
    assert generate.main(args + ["--gguf-type", "Q4_K"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert "gguf_type=('Q5_0', 'Q5_0', 'Q5_0')" in last
    assert last.endswith("(on the command line: --gguf-type Q5_0,Q5_0,Q5_0)")
    assert generate.main(args + ["--gguf-type", "Q8_0, Q4_0,Q5_0", "--chat"]) == 0
    err = capsys.readouterr().err
    assert "kt_ops LLAMAFILE: loaded" in err and "no chat template" in err
    assert generate.main(args + ["--method", "AMXINT8", "--gguf-type", "Q4_0"]) == 2
    assert "gguf_type applies to method 'LLAMAFILE', not 'AMXINT8'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        generate.main(args + ["--gguf-type", "Q4_K,Q6_K"])
    assert exited.value.code == 2 and "GATE,UP,DOWN" in capsys.readouterr().err
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(path / name, bare / name)
    rest = args[1:]
    assert generate.main([str(bare), *rest]) == 2  # transformers' stand-in tokenizer encodes nothing
    assert "pass --tokenizer DIR" in capsys.readouterr().err.splitlines()[-1]
    assert generate.main([str(path), "--prompt", " ", "--max-new-tokens", "2"]) == 2
    assert "--prompt is empty" in capsys.readouterr().err.splitlines()[-1]
    assert generate.main([str(bare), *rest, "--tokenizer", str(path)]) == 0
    assert "kt_ops BF16: loaded" in capsys.readouterr().err


def test_kt_ops_generate_reads_the_native_method_in_any_case(saved: dict[str, Path],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--method Native --gguf-type Q8_0 means LLAMAFILE as --method native does (the GGUF path and KtOpsConfig read
    the method in any case; this one compared it case-sensitively: exit status 2, "gguf_type cannot apply")."""
    from kt_ops import generate

    path = saved["qwen3_moe"]
    save_tokenizer(path)
    args = [str(path), "--prompt", "w5 w17", "--max-new-tokens", "1", "--dtype", "float32", "--gguf-type", "Q8_0"]
    assert generate.main(args + ["--method", "Native"]) == 0
    assert "kt_ops LLAMAFILE: loaded" in capsys.readouterr().err


def test_kt_ops_generate_chat_wraps_the_prompt_in_the_template(saved: dict[str, Path], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--chat with a tokenizer that has a chat template: the templated prompt's tokens (transformers v5's
    apply_chat_template returns a dict: this was an AttributeError traceback from ids.shape)."""
    import shutil

    from kt_ops import generate

    path = tmp_path / "chat"
    shutil.copytree(saved["qwen3_moe"], path)
    save_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
                               "{% if add_generation_prompt %}w3{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    args = [str(path), "--prompt", "w5 w17", "--max-new-tokens", "1", "--dtype", "float32", "--chat"]
    assert generate.main(args) == 0
    assert "prompt 5 tokens" in capsys.readouterr().err  # w1 w5 w17 w2 w3


def test_kt_ops_generate_of_one_token_times_no_decode(saved: dict[str, Path],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """--max-new-tokens 1: the prefill only, said so (it printed "decode nan tokens/s")."""
    from kt_ops import generate

    path = saved["qwen3_moe"]
    save_tokenizer(path)
    assert generate.main([str(path), "--prompt", "w5 w17", "--max-new-tokens", "1", "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    assert "no decode step to time" in err and "nan" not in err


def test_import_kt_ops_does_not_import_transformers() -> None:
    code = ("import sys, kt_ops; assert 'transformers' not in sys.modules; "
            "import transformers.integrations.moe as m; assert 'kt_ops' in m.ALL_EXPERTS_FUNCTIONS; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


if __name__ == "__main__":
    sys.exit(globals()[sys.argv[1]](*sys.argv[2:]))


@pytest.mark.parametrize("key,cut", [("model.layers.0.self_attn.q_proj.weight",
                                      "model.layers.0.self_attn.q_proj.weight is [64, 62] in the checkpoint but "
                                      "[64, 64] in the model its config.json describes"),
                                     ("model.layers.0.mlp.experts.1.down_proj.weight",
                                      "model.layers.0.mlp.experts.1.down_proj.weight is [64, 30], expert 0's "
                                      "[64, 32]")])
def test_kt_ops_generate_of_tensors_that_do_not_fit_the_config_names_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, cut: str) -> None:
    """A checkpoint whose tensor sizes do not fit its config.json: kt-ops generate showed
    transformers' RuntimeError traceback. Exit 2, the last line naming the tensor and sizes."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kt_ops import generate

    source = tmp_path / "model"
    tiny_model("qwen3_moe", dtype=torch.bfloat16).float().save_pretrained(source)
    save_tokenizer(source)
    tensors = load_file(str(source / "model.safetensors"))
    tensors[key] = tensors[key][:, :-2].contiguous()
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    assert generate.main([str(source), "--prompt", "w1 w2", "--max-new-tokens", "1"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"python -m kt_ops.generate: error: {source}: cannot load the weights: ") and cut in last


@pytest.mark.parametrize("device_map", [{"model.layers.1.mlp.experts": "disk", "": "cpu"},
                                        {"model.layers.1": "disk", "": "cpu"}])
def test_experts_mapped_to_disk_are_refused_by_name(saved: dict[str, Path], tmp_path: Path,
                                                    device_map: dict[str, str]) -> None:
    """KtOpsConfig packs the experts into host memory, so a device_map putting an experts module on "disk" cannot be
    honoured: a ValueError naming the module and what to do (was accelerate's "gate_up_proj is on the meta device, we
    need a `value` to put in on cpu", naming neither kt_ops nor the map)."""
    pytest.importorskip("accelerate")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts.*disk"):
        transformers.AutoModelForCausalLM.from_pretrained(
            saved["qwen3_moe"], dtype=torch.float32, device_map=device_map, offload_folder=str(tmp_path),
            quantization_config=kt_ops.KtOpsConfig(method="BF16", progress=False))


def test_experts_that_device_map_auto_sends_to_disk_are_refused(saved: dict[str, Path], tmp_path: Path) -> None:
    """device_map="auto" with too little CPU memory infers "disk" for the experts: the same ValueError."""
    pytest.importorskip("accelerate")
    with pytest.raises(ValueError, match=r"mlp\.experts.*on 'disk'"):
        transformers.AutoModelForCausalLM.from_pretrained(
            saved["qwen3_moe"], dtype=torch.float32, device_map="auto", max_memory={"cpu": "20KB"},
            offload_folder=str(tmp_path), quantization_config=kt_ops.KtOpsConfig(method="BF16", progress=False))
