"""Routing of kt_ops.patch_model's HybridMoE layers against transformers' own routers,
architecture by architecture (tiny random models of tests/hf_models.py, fp32, weights
rounded to bf16 so packing is exact)."""

from __future__ import annotations

import copy

import pytest
import torch

import kt_ops
from hf_models import CONFIGS, tiny_model, transformers
from test_hf_patch import TOKENS, rel_error

ARCHS = sorted(CONFIGS)


@pytest.mark.parametrize("arch", ARCHS)
def test_output_router_logits_match_the_unpatched_model(arch: str) -> None:
    """transformers records router_logits by hooks on its router modules, which patch_model
    replaced: the patched Qwen/Mixtral models raised IndexError computing the aux loss,
    the DeepSeek ones returned no router logits, silently."""
    model = tiny_model(arch).float()
    patched = kt_ops.patch_model(copy.deepcopy(model), method="BF16")
    with torch.no_grad():
        expected = model(TOKENS, output_router_logits=True, labels=TOKENS, use_cache=False)
        actual = patched(TOKENS, output_router_logits=True, labels=TOKENS, use_cache=False)
    assert len(actual.router_logits) == len(expected.router_logits) == 2
    for want, got in zip(expected.router_logits, actual.router_logits):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert rel_error(want, got) <= 5e-3
    assert rel_error(expected.router_logits[0], actual.router_logits[0]) <= 1e-6  # layer 0: the same inputs
    if getattr(expected, "aux_loss", None) is not None:
        assert float(actual.aux_loss) == pytest.approx(float(expected.aux_loss), rel=5e-3)
    with torch.no_grad():  # not collected when not asked for
        assert patched(TOKENS, use_cache=False).router_logits is None


def test_mixtral_router_jitter_noise_in_training() -> None:
    """Mixtral multiplies the block's input by uniform noise in [1 - j, 1 + j] in training
    (router_jitter_noise = j): the patched model ignored it, 30% off, silently."""
    config = CONFIGS["mixtral"]()
    config.router_jitter_noise = 0.5
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).float()
    model.config.router_jitter_noise = 0.0  # the built blocks keep 0.5
    patched = kt_ops.patch_model(copy.deepcopy(model), method="BF16")
    model.train()
    patched.train()
    with torch.no_grad():
        torch.manual_seed(7)
        expected = model(TOKENS, use_cache=False).logits
        torch.manual_seed(7)
        actual = patched(TOKENS, use_cache=False).logits
        assert rel_error(expected, actual) <= 5e-3
        patched.eval()  # no noise outside training
        model.eval()
        assert rel_error(model(TOKENS, use_cache=False).logits, patched(TOKENS, use_cache=False).logits) <= 5e-3


@pytest.mark.parametrize("jitter", [-0.1, float("nan"), True, "0.1"])
def test_a_bad_router_jitter_noise_is_refused(jitter: object) -> None:
    gate = torch.zeros(4, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="router_jitter_noise"):
        kt_ops.HybridMoE(torch.zeros(4, 16), gate, gate, torch.zeros(4, 16, 8, dtype=torch.bfloat16),
                         kt_ops.Routing(2), router_jitter_noise=jitter)


@pytest.mark.slow
def test_output_router_logits_under_torch_compile() -> None:
    torch._dynamo.reset()
    model = tiny_model("qwen3_moe").float()
    with torch.no_grad():
        expected = model(TOKENS, output_router_logits=True, use_cache=False).router_logits
        compiled = torch.compile(kt_ops.patch_model(model, method="BF16"), fullgraph=True)
        actual = compiled(TOKENS, output_router_logits=True, use_cache=False).router_logits
    assert len(actual) == 2 and rel_error(expected[0], actual[0]) <= 1e-6 and rel_error(expected[1], actual[1]) <= 5e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_routing_follows_the_router_modules_not_a_config_edited_after_loading(arch: str) -> None:
    """transformers' routers copy top-k (and their other settings) from the config when built:
    a config edited afterwards, or a router edited in place, is what the model computes with.
    patch_model read the config, so the patched model routed to 4 experts where the model
    routes to 2 (and to 2 where one layer's router was set to 3), silently."""
    model = tiny_model(arch).float()
    model.config.num_experts_per_tok = 4  # no effect on the built model
    model.model.layers[1].mlp.gate.top_k = 3
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    blocks = [copy.deepcopy(layer.mlp) for layer in model.model.layers]
    patched = kt_ops.patch_model(model, method="BF16")
    for block, layer, top_k in zip(blocks, patched.model.layers, (2, 3)):
        assert layer.mlp.routing.top_k == top_k
        with torch.no_grad():
            assert rel_error(block(x), layer.mlp(x)) <= 5e-3


def test_a_layer_pickled_before_the_routing_attributes_still_runs() -> None:
    """A HybridMoE saved whole (torch.save) before record_router_logits and
    router_jitter_noise existed has neither in its instance dict; forward read both."""
    import pickle

    from kt_ops.wrappers.hybrid_moe import HybridMoE
    from kt_ops.wrappers.routing import Routing

    g = torch.Generator().manual_seed(0)
    layer = HybridMoE(torch.randn(4, 32, generator=g), torch.randn(4, 16, 32, generator=g),
                      torch.randn(4, 16, 32, generator=g), torch.randn(4, 32, 16, generator=g), Routing(2))
    x = torch.randn(3, 32, generator=g)
    want = layer(x)
    for name in ("record_router_logits", "router_jitter_noise"):
        del layer.__dict__[name]
    old = pickle.loads(pickle.dumps(layer))
    old.train()
    assert torch.equal(old(x), want)
