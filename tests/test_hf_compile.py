"""torch.compile(fullgraph=True) of patched Hugging Face models on the CPU: no graph
break, eager's logits, no recompilation per batch size, kt::moe_forward kept once per
MoE layer in the generated code."""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo.testing
from torch._inductor.utils import run_and_get_code

import kt_ops
from hf_models import CONFIGS, tiny_model


def patched(arch: str) -> torch.nn.Module:
    return kt_ops.patch_model(tiny_model(arch, dtype=torch.bfloat16).float(), method="BF16")


def tokens(batch: int, length: int = 11) -> torch.Tensor:
    return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(batch))


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_fullgraph_matches_eager_and_does_not_recompile_per_batch_size(arch: str) -> None:
    torch._dynamo.reset()
    model = patched(arch)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    frames = None
    with torch.no_grad():
        for batch in (2, 3, 5, 4):
            x = tokens(batch)
            expected = model(x, use_cache=False).logits
            actual = compiled(x, use_cache=False).logits
            # inductor's fused RMSNorm rounds differently; the kernels then round their
            # bf16 activations differently: close, not bit-equal
            error = float((actual - expected).norm() / expected.norm())
            assert error <= 5e-3, (batch, error)
            frames = counter.frame_count if frames is None else frames
    # the first call may trace twice (dynamo restarts its analysis once); no new frame
    # is compiled for a new batch size
    assert counter.frame_count == frames, f"recompiled: {counter.frame_count} frames after the first call's {frames}"


@pytest.mark.slow
def test_no_graph_break_in_a_patched_model() -> None:
    torch._dynamo.reset()
    model = patched("deepseek_v3")
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(tokens(2), use_cache=False)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.slow
def test_generated_code_calls_the_operator_once_per_layer() -> None:
    torch._dynamo.reset()
    model = patched("qwen2_moe")
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        _, code = run_and_get_code(lambda: compiled(tokens(2), use_cache=False).logits)
    calls = sum(len(re.findall(r"torch\.ops\.kt\.moe_forward\.default\(", c)) for c in code)
    assert calls == 2, f"kt.moe_forward appears {calls} times for 2 MoE layers"
