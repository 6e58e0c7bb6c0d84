"""The accuracy table (kt_ops.bench.accuracy) on a small layer: the kernel error of
every format within the issue's bound, and the quantization errors ordered as the
formats' precision says they must be."""

from __future__ import annotations

from kt_ops.bench.accuracy import accuracy_table


def test_accuracy_table() -> None:
    rows = {r.label: r for r in accuracy_table(experts=4, hidden=512, intermediate=256, tokens=24)}
    for r in rows.values():
        assert r.kernel_error <= 3e-2, r
    assert rows["BF16"].quant_error < 1e-2  # bf16 weights are stored exactly: error 0
    assert rows["BF16"].kernel_error < 1e-2
    assert rows["INT8"].quant_error < 2e-2
    assert rows["INT8"].quant_error < rows["INT4 g32"].quant_error
    assert rows["INT4 g32"].quant_error < rows["INT4 g64"].quant_error < rows["INT4 g128"].quant_error < 0.3
    assert rows["INT4 g128 + scale search"].quant_error < rows["INT4 g128"].quant_error
    assert rows["INT4 g128 zero point"].quant_error < 0.3
    # activation quantization alone: ~1-2% on Gaussian data
    assert 3e-3 < rows["INT8"].kernel_error < 3e-2
