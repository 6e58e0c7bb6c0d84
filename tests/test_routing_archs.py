"""Routing of kt_ops.patch_model's HybridMoE layers against transformers' own routers,
architecture by architecture (tiny random models of tests/hf_models.py, fp32, weights
rounded to bf16 so packing is exact)."""

from __future__ import annotations

import copy

import pytest
import torch

import kt_ops
from hf_models import CONFIGS, tiny_model
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
