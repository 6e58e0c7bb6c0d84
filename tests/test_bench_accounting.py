"""The bench's byte and FLOP counts against counts computed here from the formats' definitions
(no timing)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kt_ops.bench import runner
from kt_ops.bench.runner import Shape, pack_layer, random_weights

SMALL = Shape("small", num_experts=4, top_k=2, hidden=256, intermediate=256, model="test")


def load_script(name: str) -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def staged_expert_bytes(method: str, hidden: int, intermediate: int) -> float:
    """Bytes of one expert as the GPU path copies it (docs/placement.md's staging table): bf16
    rows; int4 codes with fp32 scales per group of 128; GGUF's own blocks (Q4_K 144 bytes and
    Q6_K 210 bytes per 256); GGUF MXFP4 re-staged as format mxfp4's rows: nibbles with bf16
    scales per 32 (not the file's 17-byte blocks)."""
    weights = 3 * hidden * intermediate
    return {
        "BF16": 2.0 * weights,
        "AMXINT4": weights / 2 + 4 * weights / 128,
        "Q4_K_M": 2 * hidden * intermediate / 256 * 144 + hidden * intermediate / 256 * 210,
        "GGUF_MXFP4": weights / 2 + 2 * weights / 32,
    }[method]


@pytest.mark.parametrize("method", ["BF16", "AMXINT4", "Q4_K_M", "GGUF_MXFP4"])
def test_gpu_prefill_bench_counts_the_bytes_its_transport_copies(method: str) -> None:
    """bench_gpu_prefill's "copied MB" took the blob's size per expert: its 256-byte header
    shared out among the experts, and GGUF MXFP4 at the file's 17 bytes per 32 weights where
    the GPU path copies mxfp4 rows with bf16 scales (18 bytes per 32): 5.9% too few bytes."""
    script = load_script("bench_gpu_prefill")
    weights = random_weights(SMALL, 1)[0]
    packed = pack_layer(weights.gate, weights.up, weights.down, method, SMALL)
    routed = 3
    expected = routed * staged_expert_bytes(method, SMALL.hidden, SMALL.intermediate)
    assert script.copied_bytes(packed, routed, torch.bfloat16) == expected


def test_ab_pair_flushes_as_much_as_the_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    """ab_pair's workers streamed a fixed 256 MiB before each timed call, the bench 4x the
    last-level cache (at least 256 MiB): on a machine whose LLC reads 480 MiB (this 2-core
    Xeon VM's sysfs) the "bench protocol" of the A/B evicted nothing."""
    from kt_ops.bench import limits

    llc = 480 * limits.MiB
    monkeypatch.setattr(limits, "last_level_cache_bytes", lambda: llc)
    monkeypatch.setattr(limits, "read_buffer", lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
    monkeypatch.setattr(limits, "available_memory_bytes", lambda: 64 * limits.GiB)
    assert load_script("ab_pair").flusher().buffer.numel() == 4 * llc
