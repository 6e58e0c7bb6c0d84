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


# Bytes of one packed row of k weights per bench method, from the formats' definitions
# (docs/formats.md): codes plus scales, zero points / minimums, exponents and row addends.
ROW_BYTES = {
    "BF16": lambda k: 2 * k,
    "AMXINT8": lambda k: k + 4,  # fp32 scale per row
    "AMXINT4": lambda k: k // 2 + 4 * k // 128,  # fp32 scale per 128
    "GPTQ_INT4": lambda k: k // 2 + 4 * k // 128,
    "RAWINT4": lambda k: k // 2 + 4 * k // 32,
    "AWQ_INT4": lambda k: k // 2 + 8 * k // 128,  # fp32 scale and minimum per 128
    "MXFP4": lambda k: k // 2 + 2 * k // 32,  # bf16 power of two per 32
    "FP8": lambda k: k + 4 * k // 128,  # fp32 block scale kept per row and 128-k group
    "FP8_PERCHANNEL": lambda k: k + 4,
    "MXFP8": lambda k: k + k // 32 + 4,  # ue8m0 per 32 and an fp32 row addend
}
# (block elements, block bytes) of the GGUF types the bench packs.
GGUF_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
               "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
               "MXFP4": (32, 17)}
# gate/up and down types per GGUF method where I (the down rows' length) is not a multiple of 256:
# llama.cpp's mixes and its fallback types (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0).
GGUF_TYPES_I_NOT_256 = {"Q4_K": ("Q4_K", "Q5_0"), "Q4_K_M": ("Q4_K", "Q8_0"), "Q6_K": ("Q6_K", "Q8_0"),
                        "Q5_K": ("Q5_K", "Q5_1"), "Q5_K_M": ("Q5_K", "Q8_0"), "GGUF_MXFP4": ("MXFP4", "MXFP4")}


def expert_bytes(method: str, hidden: int, intermediate: int) -> int:
    """Bytes of one packed expert: gate and up (I rows of H), down (H rows of I)."""
    if method in ROW_BYTES:
        row = ROW_BYTES[method]
        return 2 * intermediate * row(hidden) + hidden * row(intermediate)
    gate, down = GGUF_TYPES_I_NOT_256.get(method, (method, method))

    def matrix(name: str, rows: int, k: int) -> int:
        elems, size = GGUF_BLOCKS[name]
        return rows * k // elems * size

    return 2 * matrix(gate, intermediate, hidden) + matrix(down, hidden, intermediate)


S2_LIKE = Shape("S2-like", num_experts=6, top_k=3, hidden=256, intermediate=384, model="test")


@pytest.mark.parametrize("method", [m for m in runner.ALL_METHODS if m not in ("Q2_K", "Q3_K")])
def test_row_counts_the_routed_experts_packed_bytes_and_flops(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row's weight_bytes: the distinct experts of each call's topk_ids (mean over the
    calls' inputs) x one expert's packed bytes; its FLOPs 2 x 3 x tokens x top_k x H x I."""
    layers = runner.make_layers(S2_LIKE, method, 1)
    monkeypatch.setattr(runner, "time_calls", lambda *args, **kwargs: 1e-3)
    tokens = 3
    row = runner.measure_row(S2_LIKE, method, tokens, layers, 2e-3, repeats=8, flush=lambda: None)
    inputs = runner.timed_inputs(S2_LIKE, tokens, runner.input_count(8))
    distinct = sum(len(set(ids.flatten().tolist())) for _, ids, _ in inputs) / len(inputs)
    H, I = S2_LIKE.hidden, S2_LIKE.intermediate
    assert row.weight_bytes == pytest.approx(distinct * expert_bytes(method, H, I), rel=1e-12)
    assert row.flops == 2 * tokens * S2_LIKE.top_k * 3 * H * I
    assert row.weight_gbs == pytest.approx(row.weight_bytes / 1e-3 / 1e9)
    assert row.gflops == pytest.approx(row.flops / 1e-3 / 1e9)
