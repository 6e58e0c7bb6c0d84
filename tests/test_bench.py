"""The benchmark's machinery on a tiny shape (speed targets live in the benchmark)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kt_ops.bench.__main__ import format_table
from kt_ops.bench.runner import METHODS, Shape, bytes_per_weight, make_layers, measure_row


@pytest.mark.parametrize("method", METHODS)
def test_measure_row_on_a_tiny_shape(method: str) -> None:
    shape = Shape("tiny", num_experts=8, top_k=2, hidden=128, intermediate=128, model="test")
    layers = make_layers(shape, method, 2)
    expected = {"BF16": 2.0, "AMXINT8": 1.0 + 4 / 128, "AMXINT4": 0.5 + 4 / 128}[method]
    assert bytes_per_weight(layers[0].packed, shape) == pytest.approx(expected)
    flushes = []
    row = measure_row(shape, method, 4, layers, read_gbs=10.0, gemm_gflops=100.0, repeats=3, flush=lambda: flushes.append(1))
    assert len(flushes) >= 6  # before every timed call of both implementations
    assert row.us > 0 and row.torch_us > 0 and row.weight_gbs > 0 and row.gflops > 0
    assert row.limit in ("bandwidth", "gemm")
    assert "tiny" in format_table([row])


def test_cli_help() -> None:
    result = subprocess.run([sys.executable, "-m", "kt_ops.bench", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for option in ("--quick", "--json", "--method", "--shape", "--tokens"):
        assert option in result.stdout
