"""The benchmark's machinery on a tiny shape (speed targets live in the benchmark)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kt_ops.bench.__main__ import format_table
from kt_ops.bench import runner
from kt_ops.bench.runner import METHODS, Shape, bytes_per_weight, make_layers, measure_row, previous_layer


@pytest.mark.parametrize("method", METHODS)
def test_measure_row_on_a_tiny_shape(method: str) -> None:
    shape = Shape("tiny", num_experts=8, top_k=2, hidden=256, intermediate=256, model="test")
    layers = make_layers(shape, method, 2)
    expected = {"BF16": 2.0, "AMXINT8": 1.0 + 4 / 256, "AMXINT4": 0.5 + 4 / 128, "Q4_K": 144 / 256, "Q4_K_M": (2 * 144 + 210) / 768, "Q6_K": 210 / 256,
                "Q8_0": 34 / 32, "Q4_0": 18 / 32}[method]
    assert bytes_per_weight(layers[0].packed, shape) == pytest.approx(expected)
    flushes = []
    row = measure_row(shape, method, 4, layers, read_gbs=10.0, gemm_gflops=100.0, repeats=3, flush=lambda: flushes.append(1))
    assert len(flushes) >= 6  # before every timed call of both implementations
    assert row.us > 0 and row.torch_us > 0 and row.weight_gbs > 0 and row.gflops > 0
    assert row.limit in ("bandwidth", "gemm")
    assert "tiny" in format_table([row])


def test_previous_layer_runs_between_flush_and_timed_call(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = Shape("tiny", num_experts=8, top_k=2, hidden=256, intermediate=256, model="test")
    layers = make_layers(shape, "Q4_K", 1)
    previous = previous_layer(shape, "Q4_K")
    assert previous.packed.format == "gguf" and previous.gate.shape == (8, 256, 256)
    events: list[str] = []
    real_ours, real_plain = runner.moe_forward, runner.torch_moe_forward

    def ours(x, ids, weights, packed):  # type: ignore[no-untyped-def]
        events.append("previous" if packed is previous.packed else "ours")
        return real_ours(x, ids, weights, packed)

    def plain(x, ids, weights, gate, up, down):  # type: ignore[no-untyped-def]
        events.append("plain previous" if gate is previous.gate else "plain")
        return real_plain(x, ids, weights, gate, up, down)

    monkeypatch.setattr(runner, "moe_forward", ours)
    monkeypatch.setattr(runner, "torch_moe_forward", plain)
    measure_row(shape, "Q4_K", 1, layers, 10.0, 100.0, 3, lambda: events.append("flush"), previous)
    for kind, warm_up in (("ours", "previous"), ("plain", "plain previous")):
        calls = [i for i, e in enumerate(events) if e == kind][1:]  # the first call is untimed
        assert len(calls) >= 3
        assert all(events[i - 2 : i] == ["flush", warm_up] for i in calls)


@pytest.mark.parametrize("method", ["BF16", "Q4_K"])
def test_model_step_on_a_tiny_shape(method: str) -> None:
    from kt_ops.bench.model_step import format_steps, measure_step

    shape = Shape("tiny", num_experts=8, top_k=2, hidden=256, intermediate=128, model="test")
    row = measure_step(shape, method, 3, rounds=3, calls=2, layers=2)
    assert row.torch_us > 0 and row.kt_us > 0 and row.step_us > 0
    assert 0.2 < row.ratio < 20
    assert "tiny" in format_steps([row]) and "step/(torch+kt)" in format_steps([row])


def test_cli_help() -> None:
    result = subprocess.run([sys.executable, "-m", "kt_ops.bench", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for option in ("--quick", "--json", "--method", "--shape", "--tokens", "--cold-code"):
        assert option in result.stdout


def test_gguf_rows_use_llama_cpp_fallback_for_down() -> None:
    from kt_ops.bench.runner import SHAPES, gguf_types_for

    assert gguf_types_for("Q4_K", SHAPES["S1"]) == ("Q4_K", "Q4_K", "Q4_K")
    assert gguf_types_for("Q4_K", SHAPES["S2"]) == ("Q4_K", "Q4_K", "Q5_0")
    assert gguf_types_for("Q6_K", SHAPES["S2"]) == ("Q6_K", "Q6_K", "Q8_0")
    assert gguf_types_for("Q8_0", SHAPES["S2"]) == ("Q8_0", "Q8_0", "Q8_0")
    assert gguf_types_for("Q4_K_M", SHAPES["S1"]) == ("Q4_K", "Q4_K", "Q6_K")
    assert gguf_types_for("Q4_K_M", SHAPES["S2"]) == ("Q4_K", "Q4_K", "Q8_0")
