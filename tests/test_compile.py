"""torch.compile(fullgraph=True) of a module that calls the operator: no graph break,
eager results, one trace for all batch sizes, and the op kept exactly once."""

from __future__ import annotations

import torch
import torch._dynamo.testing

import kt_ops
from conftest import make_experts, random_routing


class RoutedExperts(torch.nn.Module):
    """Softmax top-k routing in torch, experts by kt::moe_forward (packed as a buffer)."""

    def __init__(self, experts, top_k: int) -> None:
        super().__init__()
        num_experts, _, hidden = experts.gate.shape
        self.router = torch.nn.Linear(hidden, num_experts, bias=False)
        self.top_k = top_k
        self.register_buffer("packed", experts.packed.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = torch.softmax(self.router(x).float(), dim=-1).topk(self.top_k, dim=-1)
        return kt_ops.moe_forward(x, ids, weights, self.packed) + x


def test_fullgraph_matches_eager_without_recompiling() -> None:
    torch._dynamo.reset()
    module = RoutedExperts(make_experts(8, 64, 48), top_k=2)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(module, backend=counter, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for tokens in (3, 5, 11, 17):
            x = torch.randn(tokens, 64)
            torch.testing.assert_close(compiled(x), module(x), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames for 4 batch sizes"


def test_no_graph_break() -> None:
    torch._dynamo.reset()
    module = RoutedExperts(make_experts(4, 32, 16), top_k=2)
    explanation = torch._dynamo.explain(module)(torch.randn(4, 32))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_op_appears_once_in_the_generated_graph() -> None:
    torch._dynamo.reset()
    experts = make_experts(4, 32, 16)
    ids, weights = random_routing(4, 4, 2)
    graphs = []

    def backend(gm: torch.fx.GraphModule, inputs):
        graphs.append(gm)
        return gm

    @torch.compile(backend=backend, fullgraph=True)
    def run(x, packed):
        return kt_ops.moe_forward(x, ids, weights, packed) * 2

    run(torch.randn(4, 32), experts.packed.data)
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    kt_calls = [t for t in targets if t in (torch.ops.kt.moe_forward, torch.ops.kt.moe_forward.default)]
    assert len(kt_calls) == 1, targets
