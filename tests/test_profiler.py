"""The PyTorch profiler names our operators."""

import torch

import kt_ops
from conftest import make_experts, random_routing


def test_profiler_shows_moe_forward() -> None:
    experts = make_experts(4, 32, 16)
    ids, weights = random_routing(3, 4, 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        kt_ops.moe_forward(torch.randn(3, 32), ids, weights, experts.packed)
    names = {event.name for event in prof.events()}
    assert "kt::moe_forward" in names
