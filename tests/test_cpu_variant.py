"""CPU variant detection, selection and the KT_OPS_CPU_VARIANT override."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import kt_ops
from conftest import variant_params


def import_with_variant(value: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import kt_ops; print(kt_ops.cpu_variant())"],
        env={**os.environ, "KT_OPS_CPU_VARIANT": value},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_active_variant_is_the_best_supported() -> None:
    supported = kt_ops.supported_cpu_variants()
    assert supported, "kt_ops imported on a CPU it cannot run on"
    if "KT_OPS_CPU_VARIANT" not in os.environ:
        assert kt_ops.cpu_variant() == supported[-1]
    for name in kt_ops.CPU_VARIANTS:
        assert (name in supported) == (kt_ops.missing_features(name) == "")


@pytest.mark.slow
@pytest.mark.parametrize("name", variant_params())
def test_environment_forces_each_supported_variant(name: str) -> None:
    result = import_with_variant(name)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == name


def test_unknown_variant_is_an_error() -> None:
    result = import_with_variant("avx9")
    assert result.returncode != 0
    assert "unknown CPU variant 'avx9'" in result.stderr
    with pytest.raises(ValueError, match="unknown CPU variant"):
        kt_ops.set_cpu_variant("avx9")


def test_unsupported_variant_names_what_is_missing() -> None:
    unsupported = [name for name in kt_ops.CPU_VARIANTS if kt_ops.missing_features(name)]
    if not unsupported:
        pytest.skip("this CPU supports every variant")
    result = import_with_variant(unsupported[-1])
    assert result.returncode != 0 and "missing" in result.stderr
    with pytest.raises(RuntimeError, match="not supported here; missing"):
        kt_ops.set_cpu_variant(unsupported[-1])


def test_doctor_names_the_kernel_that_runs() -> None:
    report = kt_ops.doctor()
    assert f"active CPU variant: {kt_ops.cpu_variant()}" in report
    assert "method BF16: bf16/" in report
