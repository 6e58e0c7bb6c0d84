"""Shared fixtures: CPU variants, random experts, error measures."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import pytest
import torch

import kt_ops


def _default_inductor_cache() -> str:
    """Inductor's default cache directory (``/tmp/torchinductor_<user>``)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # private to torch: another release may move it
        return os.path.join(tempfile.gettempdir(), "torchinductor_kt_ops")
    return default_cache_dir()


# torch 2.13's inductor cache does not keep apart kernels compiled under different
# ATEN_CPU_CAPABILITY settings: a process with ATEN_CPU_CAPABILITY=avx2 that loads kernels
# another process compiled without it crashes (segmentation fault in the compiled graph;
# reproduced on the AMX Xeon, 2026-12-03, a manual `-m slow` pass after a default one).
# Unless the caller chose a cache, each ISA setting gets its own, next to inductor's
# default one (scripts/test_all_variants.sh gives every pass a fresh one anyway).
# Inductor reads the variable when it first compiles, so setting it here is in time.
_ISA_SETTINGS = [f"{k}-{os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA") if os.environ.get(k)]
if _ISA_SETTINGS and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _default_inductor_cache() + "_" + "_".join(_ISA_SETTINGS).lower()

# A per-variant CI pass (scripts/test_all_variants.sh) sets KT_OPS_CPU_VARIANT: the
# `variant` fixture then runs that variant only, the other passes cover the others. The value
# as kt_ops read it (stripped; blank is unset), not the raw one.
PINNED_VARIANT = kt_ops._native._requested or None


def variant_params(pinned: str | None = None) -> list:
    """Every variant kt_ops knows, skipped with the reason where this CPU lacks it, or,
    with ``pinned``, where it is not that one."""
    params = []
    for name in kt_ops.CPU_VARIANTS:
        missing = kt_ops.missing_features(name)
        if missing:
            marks = [pytest.mark.skip(reason=f"{name} unsupported here: missing {missing}")]
        elif pinned is not None and name != pinned:
            marks = [pytest.mark.skip(reason=f"this pass runs KT_OPS_CPU_VARIANT={pinned} only")]
        else:
            marks = []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.fixture(params=variant_params(PINNED_VARIANT))
def variant(request: pytest.FixtureRequest):
    """Runs the test under one CPU variant, restoring the previous one afterwards. Under
    ``KT_OPS_CPU_VARIANT`` only that variant runs (the others are skipped)."""
    previous = kt_ops.cpu_variant()
    kt_ops.set_cpu_variant(request.param)
    yield request.param
    kt_ops.set_cpu_variant(previous)


@pytest.fixture(autouse=True)
def _restore_thread_count():
    """Puts the kernels' thread count back after every test: ``KTMoEWrapper(cpuinfer_threads=)``
    and ``kt_ops.convert --cpuinfer-threads`` set it process-wide, as documented, and a later
    test comparing the in-process ``kt_ops.doctor()`` with a subprocess's read the leftover."""
    previous = kt_ops.get_num_threads()
    yield
    if kt_ops.get_num_threads() != previous:
        kt_ops.set_num_threads(previous)


# Variants whose BF16 kernels round activations and the SiLU*up intermediate to bf16
# (vdpbf16ps, AMX tiles): see tests/test_moe_forward.py's tolerances.
BF16_ACTIVATION_VARIANTS = ("avx512_bf16", "amx")


def bf16_activations() -> bool:
    """Whether the active variant rounds activations to bf16 in the BF16 kernels; there two
    kernel paths that compute the same thing (saved vs recomputed, parts vs whole, a LoRA
    step) agree to a few 1e-3, not to fp32 rounding."""
    return kt_ops.cpu_variant() in BF16_ACTIVATION_VARIANTS


def logits_bound(exact: float = 1e-5) -> float:
    """Bound on the relative error of a model's logits with BF16-packed experts against
    torch in fp32 on the same bf16 weights: ``exact`` where the active variant computes in
    fp32, 5e-3 where it rounds activations to bf16 (tests/test_hf_patch.py's fp32 bound;
    2.3e-3 measured on the amx variant, Xeon, 2026-11-26)."""
    return 5e-3 if bf16_activations() else exact


@dataclass
class Experts:
    gate: torch.Tensor  # [E, I, H] bf16
    up: torch.Tensor  # [E, I, H] bf16
    down: torch.Tensor  # [E, H, I] bf16
    packed: kt_ops.PackedExperts


def make_experts(num_experts: int, hidden: int, intermediate: int, seed: int = 0) -> Experts:
    """Random bf16 experts scaled like a trained layer (output ~ unit variance), packed.

    The weights are bf16 already, so the BF16 format stores them exactly and the
    reference on the same tensors sees only the kernels' own error.
    """
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(num_experts, intermediate, hidden, generator=g) / hidden**0.5).bfloat16()
    up = (torch.randn(num_experts, intermediate, hidden, generator=g) / hidden**0.5).bfloat16()
    down = (torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate**0.5 * 2).bfloat16()
    return Experts(gate, up, down, kt_ops.pack_experts(gate, up, down, "BF16"))


def random_routing(tokens: int, num_experts: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k experts per token (int32) and positive fp32 weights."""
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.rand(tokens, num_experts, generator=g).argsort(dim=-1)[:, :top_k].to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return ids.contiguous(), weights


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref|| (0 when both are zero)."""
    denom = ref.float().norm().item()
    diff = (out.float() - ref.float()).norm().item()
    return diff / denom if denom > 0 else diff


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest elementwise error relative to the largest reference magnitude."""
    scale = ref.float().abs().max().item()
    diff = (out.float() - ref.float()).abs().max().item()
    return diff / scale if scale > 0 else diff


def long_k_prefill(packed: kt_ops.PackedExperts, x: torch.Tensor, num_experts: int = 2,
                   tokens_alone: tuple[int, ...] = (0, 7, 19), tile_bound: float | None = None,
                   tiles_must_differ: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer on every row of ``x`` [T, H] at once, token t routed to expert t % E (one
    slot, weights in [0.5, 1.5): T / E tokens per expert, enough for the prefill tiles),
    checked row by row against the same token computed alone (the decode path) for each t
    in ``tokens_alone``: bit-equal, or with ``tile_bound`` (a variant whose prefill tiles sum
    in their own order) within that relative error, and with ``tiles_must_differ`` also not
    equal (the tiles did run). Returns the output, the ids and the weights."""
    T = x.shape[0]
    ids = (torch.arange(T) % num_experts).to(torch.int32).reshape(T, 1)
    weights = torch.rand(T, 1, generator=torch.Generator().manual_seed(3)) + 0.5
    out = kt_ops.moe_forward(x, ids, weights, packed)
    for t in tokens_alone:
        alone = kt_ops.moe_forward(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], packed)
        if tile_bound is None:
            assert torch.equal(out[t:t + 1], alone), f"token {t}: prefill and decode rows differ"
        else:
            assert rel_err(out[t:t + 1], alone) <= tile_bound, f"token {t}: {rel_err(out[t:t + 1], alone):.3g}"
            assert not (tiles_must_differ and torch.equal(out[t:t + 1], alone)), f"token {t}: did the tiles run?"
    return out, ids, weights
