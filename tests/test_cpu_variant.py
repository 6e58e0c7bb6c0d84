"""CPU variant detection, selection and the KT_OPS_CPU_VARIANT override."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    if not kt_ops._native._requested:  # KT_OPS_CPU_VARIANT unset or blank
        assert kt_ops.cpu_variant() == supported[-1]
    for name in kt_ops.CPU_VARIANTS:
        assert (name in supported) == (kt_ops.missing_features(name) == "")


@pytest.mark.slow
@pytest.mark.parametrize("name", variant_params())
def test_environment_forces_each_supported_variant(name: str) -> None:
    result = import_with_variant(name)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == name


@pytest.mark.slow
def test_test_passes_pin_the_variant_kt_ops_forced() -> None:
    """conftest's pinned variant is the one kt_ops forced: kt_ops strips KT_OPS_CPU_VARIANT (blank: unset),
    conftest read it raw, so under KT_OPS_CPU_VARIANT=" avx2" or "  " every variant test was skipped."""
    code = "import sys; sys.path.insert(0, sys.argv[1]); import conftest; print(repr(conftest.PINNED_VARIANT))"
    for value, pinned in ((" avx2 ", "'avx2'"), ("  ", "None")):
        result = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], capture_output=True,
                                env={**os.environ, "KT_OPS_CPU_VARIANT": value}, text=True, timeout=120)
        assert result.returncode == 0 and result.stdout.strip() == pinned, (value, result.stdout, result.stderr[-500:])


def test_unknown_variant_is_an_error() -> None:
    result = import_with_variant("avx9")
    assert result.returncode != 0
    assert "unknown CPU variant 'avx9'" in result.stderr
    with pytest.raises(ValueError, match="unknown CPU variant"):
        kt_ops.set_cpu_variant("avx9")


@pytest.mark.slow
@pytest.mark.parametrize("variable,value,says", [
    ("KT_OPS_CPU_VARIANT", "avx9", "KT_OPS_CPU_VARIANT='avx9': unknown CPU variant 'avx9'; expected one of: avx2"),
    ("KT_OPS_NUM_THREADS", "abc", "KT_OPS_NUM_THREADS must be a positive integer"),
], ids=["variant", "threads"])
def test_commands_say_a_bad_environment_variable_in_one_line(variable: str, value: str, says: str) -> None:
    """kt_ops' commands report a bad KT_OPS_... setting as they report a bad argument: one stderr line naming it,
    exit status 2 (it was a 19-line import traceback); imported by other code, kt_ops still raises it."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, variable: value}
    commands = [([sys.executable, "-m", "kt_ops.bench", "--help"], "python -m kt_ops.bench"),
                ([sys.executable, "-X", "utf8", "-mkt_ops.convert", "--help"], "python -m kt_ops.convert"),
                ([sys.executable, str(root / "scripts" / "convert_cpu_weights.py"), "--help"], "convert_cpu_weights.py")]
    console = Path(sys.executable).with_name("kt-ops")
    if console.exists():  # pip install -e . put it beside the interpreter
        commands.append(([str(console), "doctor"], "kt-ops"))
    for argv, prog in commands:
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and result.stdout == "", (argv, result.returncode, result.stderr[-800:])
        assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and says in lines[0], (argv, result.stderr[-800:])
    result = subprocess.run([sys.executable, "-c", "import kt_ops"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" in result.stderr and says in result.stderr, result.stderr[-800:]


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


# --- avx_vnni: AVX2 + the 256-bit vpdpbusd --------------------------------------------------


def test_avx_vnni_is_supported_exactly_when_the_cpu_has_the_flag() -> None:
    from kt_ops.host import cpu_flags

    flags = cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags")
    expected = {"avx2", "fma", "f16c", "avx_vnni"} <= flags
    assert (kt_ops.missing_features("avx_vnni") == "") == expected, kt_ops.missing_features("avx_vnni")
    if not expected and kt_ops.missing_features("avx2") == "":
        assert kt_ops.missing_features("avx_vnni") == "avx_vnni (CPUID)"
    # A side branch: the AVX-512 variants do not need AVX-VNNI (Zen 4 has AVX-512, not it).
    assert "avx_vnni" not in kt_ops.missing_features("avx512")


def test_avx_vnni_runs_vpdpbusd_for_the_integer_formats() -> None:
    from kt_ops.formats import FORMATS

    for fmt in FORMATS:
        kernel = fmt.kernels["avx_vnni"]
        if fmt.activations == "none":  # bf16, the fp8 formats: float dots, nothing to gain
            assert "the avx2 kernel" in kernel
        else:
            assert "vpdpbusd" in kernel, kernel


# --- avx512_vnni: AVX-512 + the 512-bit vpdpbusd, no AVX512_BF16 ---------------------------


def test_avx512_vnni_is_supported_exactly_when_the_cpu_has_the_flags() -> None:
    from kt_ops.host import cpu_flags

    flags = cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags")
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    expected = avx512 and "avx512_vnni" in flags
    assert (kt_ops.missing_features("avx512_vnni") == "") == expected, kt_ops.missing_features("avx512_vnni")
    if avx512 and not expected:
        assert kt_ops.missing_features("avx512_vnni") == "avx512_vnni (CPUID)"
    if expected:  # avx512_bf16 asks for AVX512_BF16 on top, and names only that
        assert kt_ops.missing_features("avx512_bf16") in ("", "avx512_bf16 (CPUID)")


def test_avx512_vnni_runs_vpdpbusd_for_the_integer_formats() -> None:
    from kt_ops.formats import FORMATS

    for fmt in FORMATS:
        kernel = fmt.kernels["avx512_vnni"]
        if fmt.activations == "none":  # bf16, the fp8 formats: no integer products
            assert "the avx512 kernel" in kernel and kernel.endswith(fmt.kernels["avx512"].split(" (", 1)[1]), kernel
        else:
            assert "vpdpbusd" in kernel and "the avx512 kernel" not in kernel, kernel


def assert_same_bits(cases: list, names: tuple[str, str]) -> None:
    """Each case packed from random bf16 experts (E = 6, top-2) and called with 1, 3, 9 and
    40 tokens (decode, and prefill tiles where a variant has them) on variant names[0] and
    names[1]: equal outputs, or an AssertionError naming the case. Skips where the CPU
    lacks a variant; the active variant is restored."""
    for name in names:
        if kt_ops.missing_features(name):
            pytest.skip(f"this CPU lacks {name}: {kt_ops.missing_features(name)}")
    previous = kt_ops.cpu_variant()
    generator = torch.Generator().manual_seed(0)
    try:
        for case in cases:
            E = 6
            gate = (torch.randn(E, case.intermediate, case.hidden, generator=generator) * 0.05).bfloat16()
            up = (torch.randn(E, case.intermediate, case.hidden, generator=generator) * 0.05).bfloat16()
            down = (torch.randn(E, case.hidden, case.intermediate, generator=generator) * 0.05).bfloat16()
            packed = case.pack(gate, up, down)
            for tokens in (1, 3, 9, 40):
                x = torch.randn(tokens, case.hidden, generator=generator).bfloat16()
                ids = torch.stack([torch.randperm(E, generator=generator)[:2] for _ in range(tokens)]).int()
                weights = torch.rand(tokens, 2, generator=generator)
                outs = []
                for name in names:
                    kt_ops.set_cpu_variant(name)
                    outs.append(kt_ops.moe_forward(x, ids, weights, packed))
                assert torch.equal(outs[0], outs[1]), f"{case.id}, {tokens} tokens: {names[1]} differs from {names[0]}"
    finally:
        kt_ops.set_cpu_variant(previous)


@pytest.mark.parametrize("names", [("avx2", "avx_vnni"), ("avx512", "avx512_vnni")], ids=lambda n: "-".join(n))
def test_vnni_variant_is_bit_identical_to_its_base(names: tuple[str, str]) -> None:
    """vpdpbusd and vpmaddubsw + vpmaddwd give the same exact int32 sums (no int16 pair
    saturates for the levels and activations the formats use), and the fp32 work around
    them adds the same values in the same order (avx_vnni and avx2 share that code;
    avx512_vnni's tiles, avx512_bf16's, accumulate every k block in the order avx512's
    do): every packing case, decode and prefill token counts, equal bits."""
    from format_cases import format_cases

    assert_same_bits(format_cases(), names)


def test_block32_gguf_types_give_the_same_bits_on_avx2_and_avx512() -> None:
    """The block-32 GGUF types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4) run the same arithmetic
    on both widths: exact int32 block sums of four rows added across rows, then one
    conversion, one product d * da and one fma per block into lane b % 4, and the AVX-512
    prefill tile the same (docs/formats.md, "GGUF"). Odd block counts (a zero-padded last
    step), decode and prefill token counts: equal bits. (The K-quants' AVX2 kernels order
    their float operations otherwise: not compared.)"""
    from format_cases import format_cases

    block32 = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")
    cases = [c for c in format_cases() if c.id in {f"gguf-{t}" for t in block32}]
    assert len(cases) == len(block32), [c.id for c in cases]
    assert_same_bits(cases, ("avx2", "avx512"))


def test_detection_requires_every_feature_the_variants_are_compiled_for() -> None:
    """Each csrc/cpu/kernels/variants/*.cpp is compiled with ``#pragma GCC target(...)``, so the compiler
    may emit any of those instructions; a variant kt_ops reports as supported must therefore have every one
    of them checked by ``missing_features`` (``bmi2``, on every pragma, was not: on a VM with AVX2, FMA and
    F16C and BMI2 masked, kt_ops picked avx2 and died with SIGILL instead of naming the missing feature)."""
    import re
    from pathlib import Path

    csrc = Path(__file__).resolve().parents[1] / "csrc" / "cpu"
    detection = (csrc / "isa" / "cpu_variant.cpp").read_text()
    body = detection[detection.index("std::string missing_features(CpuVariant variant)"):]
    checked = {name.replace("_", "") for name in re.findall(r"\bf\.(\w+)", body[:body.index("\n}\n")])}
    unchecked = {}
    for source in sorted((csrc / "kernels" / "variants").glob("*.cpp")):
        (target,) = re.findall(r'#pragma GCC target\("([^"]+)"\)', source.read_text())
        missing = [f for f in target.split(",") if f.replace("-", "").replace("_", "") not in checked]
        if missing:
            unchecked[source.stem] = missing
    assert not unchecked, f"compiled for but never detected: {unchecked}"


def test_prefetch_hint_quirk_matches_the_cpu_model() -> None:
    """PREFETCHT1 fills L1 on AMD before Zen 4 (cpu_model.h): the int decode drops its L1 prefetch there."""
    from kt_ops._native import _C
    from kt_ops.host import cpu_fields

    fields = cpu_fields() or {}
    try:
        vendor, family, number = fields["vendor_id"], int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        pytest.skip("no vendor_id / cpu family / model in /proc/cpuinfo")
    zen3 = family == 0x19 and (number <= 0x0F or 0x20 <= number <= 0x5F)
    expected = vendor in ("AuthenticAMD", "HygonGenuine") and (family in (0x17, 0x18) or zen3)
    assert _C.prefetch_l2_fills_l1() is expected, (vendor, family, number)
    assert ("PREFETCHT1 fills L1 on this CPU" in kt_ops.doctor()) is expected
