"""The training backward's two GEMM paths (issue 22, item 4): the panel kernel
(csrc/cpu/kernels/panel_gemm.h, the default on the AVX2 variants) and ATen's sgemm (the
default on the AVX-512 ones), chosen per call by ``KT_OPS_TRAIN_GEMM``.

Both must give the same gradients for every packed format (the panel path decodes the int
formats straight into its panels and packs the others' decoded rows), over token counts
that leave experts 1 to 20 rows (every row tile and its remainder) and sizes whose last
panel is partial; the panel path's rows do not depend on the other rows of the call; a bad
value of the switch is a ValueError; the AVX-512 variants' zmm tile gives the AVX2 tile's
bits. test_autograd checks the default path of this CPU
against fp64."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kt_ops
from conftest import make_experts, random_routing, rel_err
from format_cases import format_cases

CASES = format_cases(min_hidden=40, min_intermediate=24)


def backward(monkeypatch: pytest.MonkeyPatch, gemm: str, packed: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
             w: torch.Tensor, probe: torch.Tensor, gate_up: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """kt::moe_train_backward at the saved g and u `gate_up` ([T, K, 2I] fp32; default:
    kt::moe_forward_train's), with the GEMM path `gemm` -> (grad_x, grad_w, grad_gate_up)."""
    monkeypatch.setenv("KT_OPS_TRAIN_GEMM", gemm)
    if gate_up is None:
        gate_up = forward_gate_up(packed, x, ids, w)
    return torch.ops.kt.moe_train_backward(probe, x, ids, w, packed, gate_up)


def forward_gate_up(packed: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """kt::moe_forward_train's saved g and u, [T, K, 2I] fp32."""
    return torch.ops.kt.moe_forward_train(x, ids, w, packed, kt_ops.PackedExperts(packed).intermediate_size)[1]


def inputs(T: int, E: int, K: int, H: int, seed: int) -> tuple[torch.Tensor, ...]:
    ids, w = random_routing(T, E, K, seed)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g), ids, w, torch.randn(T, H, generator=g)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_panel_and_aten_gemms_give_the_same_gradients(monkeypatch: pytest.MonkeyPatch, case) -> None:
    experts = make_experts(6, case.hidden, case.intermediate, seed=21)
    packed = case.pack(experts.gate, experts.up, experts.down).data
    x, ids, w, probe = inputs(37, 4, 2, case.hidden, seed=21)  # experts 0-3: 15-20 rows each
    ids[0, 1] = 5  # one row
    ids[1:4, 1] = 4  # three rows
    panel = backward(monkeypatch, "panel", packed, x, ids, w, probe)
    aten = backward(monkeypatch, "aten", packed, x, ids, w, probe)
    for name, p, a in zip(("grad_x", "grad_w", "grad_gate_up"), panel, aten):
        assert p.shape == a.shape and p.dtype == a.dtype
        assert rel_err(p, a) <= 1e-6, (name, rel_err(p, a))


@pytest.mark.parametrize("method,H,I,kwargs", [("AMXINT8", 72, 40, {}), ("AMXINT4", 96, 64, {"group_size": 32}),
                                               ("BF16", 72, 40, {}), ("FP8", 72, 40, {})])
def test_panel_gradients_of_a_row_do_not_depend_on_the_other_rows(monkeypatch: pytest.MonkeyPatch, method: str,
                                                                  H: int, I: int, kwargs: dict) -> None:
    """The first 5 rows' gradients alone and inside a 40-row call: the same bits (the
    kernel sums each row's products in one order whatever tile the row falls in). Both
    calls take the same saved g and u: the forward that makes them is not batch-invariant
    on amx, whose BF16 prefill runs AMX tiles for experts of more than 6 rows (seen on a
    Xeon, 2026-11-26; docs/formats.md, "Batch invariance")."""
    experts = make_experts(6, H, I, seed=22)
    packed = kt_ops.pack_experts(experts.gate, experts.up, experts.down, method=method, **kwargs).data
    x, ids, w, probe = inputs(40, 6, 3, H, seed=22)
    gate_up = forward_gate_up(packed, x, ids, w)
    whole = backward(monkeypatch, "panel", packed, x, ids, w, probe, gate_up)
    part = backward(monkeypatch, "panel", packed, x[:5], ids[:5], w[:5], probe[:5], gate_up[:5].contiguous())
    for p, a in zip(part, whole):
        assert torch.equal(p, a[:5])


PANEL_BITS = """
import os, sys, torch, kt_ops
os.environ["KT_OPS_TRAIN_GEMM"] = "panel"
case = torch.load(sys.argv[1])
grads = torch.ops.kt.moe_backward(case["probe"], case["x"], case["ids"], case["w"], case["packed"])
torch.save(list(grads), sys.argv[2])
"""


def test_panel_kernel_gives_the_same_bits_on_every_variant(tmp_path: Path) -> None:
    """kt::moe_backward (g and u recomputed: every weight product on the panel kernel) in a
    process per CPU variant this machine runs: the AVX-512 variants' 12-row zmm tile and the
    AVX2 variants' 6-row ymm tile form each element with the same FMA chain, so the gradients
    are the same bits (H 601: a partial last panel; experts of 1 to ~20 rows: every tile's
    remainder)."""
    variants = kt_ops.supported_cpu_variants()
    if len(variants) < 2 or not any(v.startswith(("avx512", "amx")) for v in variants):
        pytest.skip("needs an AVX-512 CPU variant beside avx2")
    experts = make_experts(6, 601, 88, seed=5)
    x, ids, w, probe = inputs(37, 6, 3, 601, seed=5)
    torch.save({"packed": experts.packed.data, "x": x, "ids": ids, "w": w, "probe": probe}, tmp_path / "case.pt")
    results = {}
    for variant in variants:
        out = tmp_path / f"{variant}.pt"
        subprocess.run([sys.executable, "-c", PANEL_BITS, str(tmp_path / "case.pt"), str(out)], check=True,
                       env={**os.environ, "KT_OPS_CPU_VARIANT": variant}, timeout=300)
        results[variant] = torch.load(out)
    for variant, grads in results.items():
        for name, got, want in zip(("grad_x", "grad_w"), grads, results["avx2"]):
            assert torch.equal(got, want), f"{variant} {name} differs from avx2's"


def test_bad_switch_value_is_a_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    experts = make_experts(2, 32, 16)
    x, ids, w, probe = inputs(3, 2, 1, 32, seed=0)
    with pytest.raises(ValueError, match="KT_OPS_TRAIN_GEMM must be panel, aten or auto"):
        backward(monkeypatch, "fast", experts.packed.data, x, ids, w, probe)
    for value in ("auto", ""):
        backward(monkeypatch, value, experts.packed.data, x, ids, w, probe)
