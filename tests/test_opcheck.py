"""torch.library.opcheck on every operator: schema, fake vs real, autograd registration,
dispatch to the fake under FakeTensorMode."""

from __future__ import annotations

import pytest
import torch

import kt_ops
from conftest import make_experts, random_routing


def moe_samples() -> list[tuple]:
    experts = make_experts(6, 48, 40)
    samples = []
    for tokens, dtype, ids_dtype, weights_dtype in [
        (1, torch.bfloat16, torch.int32, torch.float32),
        (9, torch.float32, torch.int64, torch.bfloat16),
        (20, torch.float16, torch.int32, torch.float16),
        (0, torch.bfloat16, torch.int64, torch.float32),
    ]:
        ids, weights = random_routing(tokens, 6, 3)
        samples.append(
            (torch.randn(tokens, 48).to(dtype), ids.to(ids_dtype), weights.to(weights_dtype), experts.packed.data)
        )
    return samples


@pytest.mark.parametrize("index", range(4))
def test_opcheck_moe_forward(index: int) -> None:
    torch.library.opcheck(torch.ops.kt.moe_forward.default, moe_samples()[index])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_opcheck_pack_experts(dtype: torch.dtype) -> None:
    experts = make_experts(3, 40, 24)
    args = (experts.gate.to(dtype), experts.up.to(dtype), experts.down.to(dtype), "bf16")
    torch.library.opcheck(torch.ops.kt.pack_experts.default, args)


def test_backward_is_refused_loudly() -> None:
    experts = make_experts(4, 32, 16)
    ids, weights = random_routing(3, 4, 2)
    x = torch.randn(3, 32, requires_grad=True)
    out = kt_ops.moe_forward(x, ids, weights, experts.packed)
    with pytest.raises(RuntimeError, match="inference kernel"):
        out.sum().backward()
