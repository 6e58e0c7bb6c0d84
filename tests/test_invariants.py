"""Batch invariance of ``kt_ops.moe_forward``: every packing case x every CPU variant.

Output row t depends only on ``x[t]``, ``ids[t]``, ``w[t]`` and the packed weights, bit
for bit: not on the other tokens of the call (so not on how many tokens each expert
got, which picks the kernel's strategy), ``live_tokens``, the engine's thread count,
the dtype of the ids, or what ran before. Every comparison here is exact (the same
bits), with inputs in bf16 and in fp32 (fp32 outputs show differences that bf16
rounding would hide).

Each probe token is computed alone (1-token call) and then placed among other tokens:

- ``pair``: one other token with the probe's experts (2 tokens per expert: GGUF
  types are still read in place on the AVX-512 variants);
- ``few5``: 5 tokens, random routing (decode: <= 4 tokens per expert);
- ``shared5``: 5 tokens all with the probe's experts (5 per expert: past decode on
  avx2/avx512, GGUF from the decoded copy);
- ``crowd37``: 37 tokens, the others choosing among the probe's experts and one more
  (~24 per expert: the k-blocked GEMM; on amx GGUF's tile path, >= 8 per expert);
- ``large300``: 300 tokens, E = 8, top-2 uniform (~75 per expert).

H and I exceed 512 (format_cases), so gate/up and down cross the k blocks of the
GEMMs (256 for bf16, 512 for int8/int4) with a partial last block where the format's
block rules allow one.

The one documented exception (docs/formats.md, "Batch invariance"): on the amx variant,
BF16 and FP8 (fp8, fp8_perchannel, mxfp8) experts with more than 6 tokens and calls of GGUF
layers with a float-type matrix (F32 / F16 / BF16) averaging 8 or more tokens per expert
run on AMX tiles, whose sums (``tdpbf16ps``, which neither ``vdpbf16ps`` nor fp32 FMAs
in either pair order reproduce) or inputs (GGUF rows and activations rounded to bf16)
differ from the vector decode path. There, in the crowd37 and large300 scenarios, a row
is compared with its solo call within AMX_TILE_BOUNDS instead of bit for bit. INT8/INT4 tiles
compute the vector path's int32 sums (MXFP4: its exact span partials, csrc/cpu/kernels/quant/mxfp4_span.h)
and stay bit-exact there, and ``live_tokens = n``
still equals a call on the first n rows bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import kt_ops
from format_cases import FormatCase, format_cases
from gguf_helpers import FLOAT_TYPES

E, TOP_K = 8, 2
# Probe tokens' routing: two plain pairs and one with a skipped slot.
PROBE_IDS = ((1, 5), (7, 2), (6, -1))
PROBE_WEIGHTS = ((0.7, 0.4), (0.55, 0.3), (0.9, 0.2))
SCENARIOS = {  # name: (tokens in the call, how the other tokens are routed)
    "pair": (2, "probe"),
    "few5": (5, "random"),
    "shared5": (5, "probe"),
    "crowd37": (37, "subset"),
    "large300": (300, "random"),
}
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
# Formats whose amx prefill runs on AMX tiles with other sums, and the bound on the relative
# error of a tile row against its solo (vector) call. Seen on a Xeon, 2026-11-26: BF16
# fp32 outputs ~1e-6 apart, bf16 outputs one ulp in up to 4 of 3005 values (at most
# ~1.5e-4 by those messages' sizes); GGUF 0.2-2.2% (K-quants the most: bf16 tile inputs
# against the vector path's 8-bit activation blocks; since 2026-11-28 only layers with a
# float-type matrix take that path, quantized ones keep the bit-exact integer tiles). FP8 as BF16 (the same bf16 products,
# flushed per scale group; Xeon, 2026-11-28: fp32 outputs <= 1.4e-6 apart, bf16 one ulp).
AMX_TILE_BOUNDS = {"bf16": 1e-3, "gguf": 3e-2, "fp8": 1e-3, "fp8_perchannel": 1e-3, "mxfp8": 1e-3}
AMX_TILE_SCENARIOS = {"crowd37", "large300"}  # enough tokens per expert for those tiles


@dataclass
class Layer:
    case: FormatCase
    packed: kt_ops.PackedExperts
    seed: int

    @property
    def hidden(self) -> int:
        return self.case.hidden


@dataclass
class Batch:
    x: torch.Tensor  # [T, H] fp32 (cast per test)
    ids: torch.Tensor  # [T, TOP_K] int32
    weights: torch.Tensor  # [T, TOP_K] fp32
    rows: dict[int, int]  # row -> the probe token placed there


CASES = format_cases()


@pytest.fixture(scope="module", params=[pytest.param(c, id=c.id) for c in CASES])
def layer(request: pytest.FixtureRequest) -> Layer:
    """One packed layer per case (module scope: packed once for every variant and test)."""
    case: FormatCase = request.param
    seed = CASES.index(case) + 1
    g = torch.Generator().manual_seed(seed)
    H, I = case.hidden, case.intermediate
    gate = (torch.randn(E, I, H, generator=g) / H**0.5).bfloat16()
    up = (torch.randn(E, I, H, generator=g) / H**0.5).bfloat16()
    down = (torch.randn(E, H, I, generator=g) / I**0.5 * 2).bfloat16()
    return Layer(case, case.pack(gate, up, down), seed)


def probes(layer: Layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(layer.seed * 7919)
    x = torch.randn(len(PROBE_IDS), layer.hidden, generator=g)
    return x, torch.tensor(PROBE_IDS, dtype=torch.int32), torch.tensor(PROBE_WEIGHTS)


def routed(tokens: int, choices: list[int], g: torch.Generator) -> torch.Tensor:
    """``tokens`` rows of TOP_K distinct experts drawn from ``choices``."""
    pick = torch.rand(tokens, len(choices), generator=g).argsort(dim=-1)[:, :TOP_K]
    return torch.tensor(choices, dtype=torch.int32)[pick]


def scenario_batches(layer: Layer, scenario: str) -> list[Batch]:
    """Calls of ``tokens`` tokens holding the probes: one call with every probe where the
    others are routed at random, one call per probe otherwise (the others routed to that
    probe's experts, or to them and one more)."""
    tokens, routing = SCENARIOS[scenario]
    px, pids, pw = probes(layer)
    groups = [list(range(len(PROBE_IDS)))] if routing == "random" else [[p] for p in range(len(PROBE_IDS))]
    out = []
    for group in groups:
        g = torch.Generator().manual_seed(layer.seed * 1000 + tokens * 10 + group[0])
        x = torch.randn(tokens, layer.hidden, generator=g)
        weights = torch.rand(tokens, TOP_K, generator=g) + 0.1
        if routing == "probe":
            ids = pids[group[0]].repeat(tokens, 1)
        elif routing == "subset":
            own = [e for e in PROBE_IDS[group[0]] if e >= 0]
            ids = routed(tokens, own + [e for e in range(E) if e not in own][: TOP_K + 1 - len(own)], g)
        else:
            ids = routed(tokens, list(range(E)), g)
        rows = {}
        for i, p in enumerate(group):  # spread over the call, the first probe in the last row
            row = tokens - 1 - (tokens * i) // len(group) if len(group) > 1 else tokens // 2 + tokens % 2
            x[row], ids[row], weights[row] = px[p], pids[p], pw[p]
            rows[row] = p
        assert len(rows) == len(group)
        out.append(Batch(x, ids.contiguous(), weights, rows))
    return out


def forward(batch: Batch, dtype: torch.dtype, layer: Layer, **kwargs) -> torch.Tensor:
    out = kt_ops.moe_forward(batch.x.to(dtype), batch.ids, batch.weights, layer.packed, **kwargs)
    assert out.dtype == dtype and torch.isfinite(out).all()
    return out


def solo_outputs(layer: Layer, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each probe computed alone: [1, H]."""
    px, pids, pw = probes(layer)
    outs = []
    for p in range(len(PROBE_IDS)):
        out = forward(Batch(px[p : p + 1], pids[p : p + 1], pw[p : p + 1], {0: p}), dtype, layer)
        assert out.abs().max() > 0, "probe output is zero: the comparison would prove nothing"
        outs.append(out)
    return outs


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Exact comparison of the bits; the message gives the size of the difference."""
    __tracebackhide__ = True
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    view = INT_VIEW[actual.dtype]
    if torch.equal(actual.contiguous().view(view), expected.contiguous().view(view)):
        return
    diff = (actual.float() - expected.float()).abs()
    differ = int((actual.contiguous().view(view) != expected.contiguous().view(view)).sum())
    raise AssertionError(
        f"{what}: not bit-identical: {differ} of {actual.numel()} values differ, "
        f"max abs diff {diff.max().item():.3g} (max |expected| {expected.float().abs().max().item():.3g})"
    )


def on_amx_tiles(layer: Layer, variant: str, scenario: str) -> bool:
    """Whether this scenario's rows run on the amx variant's AMX tiles (the documented
    exception to bit-identical rows; see the module docstring)."""
    if layer.case.format == "gguf":
        types = layer.case.kwargs["gguf_type"]
        types = (types,) if isinstance(types, str) else types
        if not any(t in FLOAT_TYPES for t in types):
            return False  # quantized GGUF layers keep the integer tiles on amx: bit-exact
    return variant == "amx" and layer.case.format in AMX_TILE_BOUNDS and scenario in AMX_TILE_SCENARIOS


def assert_tile_close(actual: torch.Tensor, expected: torch.Tensor, layer: Layer, what: str) -> None:
    """An AMX-tile row against the vector path's, within the format's AMX_TILE_BOUNDS."""
    __tracebackhide__ = True
    bound = AMX_TILE_BOUNDS[layer.case.format]
    error = float((actual.float() - expected.float()).norm() / expected.float().norm())
    assert error <= bound, f"{what}: relative error {error:.3g} > {bound} (AMX tiles vs vector path)"


def all_batches(layer: Layer) -> dict[str, list[Batch]]:
    return {name: scenario_batches(layer, name) for name in SCENARIOS}


# ---------------------------------------------------------------------------------------


def test_format_cases_cover_the_library_lists() -> None:
    """The enumeration reaches every format, group size and ggml type the library lists."""
    from kt_ops.formats import GROUPED_FORMATS, METHOD_FORMATS, format_info
    from kt_ops.gguf_types import SUPPORTED_TYPES

    formats = {c.format for c in CASES}
    assert formats == set(METHOD_FORMATS.values()) | set(GROUPED_FORMATS)
    for fmt in GROUPED_FORMATS:
        plain = [c.kwargs["group_size"] for c in CASES if c.format == fmt and not c.kwargs.get("scale_search")]
        assert sorted(plain) == sorted(format_info(fmt).group_sizes)
    # int4_asym's minimums both ways: integer zero points (round-to-nearest) and any (search)
    assert any(c.format == "int4_asym" and c.kwargs.get("scale_search") for c in CASES)
    single = {c.kwargs["gguf_type"] for c in CASES if c.format == "gguf" and isinstance(c.kwargs["gguf_type"], str)}
    assert single == set(SUPPORTED_TYPES)
    assert any(c.kwargs.get("gguf_type") == ("Q4_K", "Q4_K", "Q6_K") for c in CASES)
    for c in CASES:
        assert c.hidden > 512 and c.intermediate > 512, c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_bit_comparison_sees_one_ulp(dtype: torch.dtype) -> None:
    """assert_same_bits fails on a one-ulp change of one value (so a pass means equal bits)."""
    a = torch.randn(5, 9).to(dtype)
    b = a.clone()
    b[3, 7] = torch.nextafter(b[3, 7], torch.tensor(float("inf"), dtype=dtype))
    assert_same_bits(a, a.clone(), "same")
    with pytest.raises(AssertionError, match="1 of 45 values differ"):
        assert_same_bits(b, a, "one ulp")


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_does_not_depend_on_the_other_tokens(layer: Layer, variant: str, dtype: torch.dtype, scenario: str) -> None:
    solo = solo_outputs(layer, dtype)
    for batch in scenario_batches(layer, scenario):
        out = forward(batch, dtype, layer)
        for row, p in batch.rows.items():
            what = f"{layer.case.id} {variant} {scenario} probe {p} (row {row} of {len(batch.x)})"
            if on_amx_tiles(layer, variant, scenario):
                assert_tile_close(out[row : row + 1], solo[p], layer, what)
            else:
                assert_same_bits(out[row : row + 1], solo[p], what)


@pytest.mark.parametrize("base", ["crowd37", "large300"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_live_tokens(layer: Layer, variant: str, dtype: torch.dtype, base: str) -> None:
    """``live_tokens=n``: rows < n equal the full call's and a call with only those rows;
    the others are zero."""
    batch = scenario_batches(layer, base)[0]
    T = len(batch.x)
    full = forward(batch, dtype, layer)
    for n in (1, 5, T // 2):
        live = forward(batch, dtype, layer, live_tokens=torch.tensor(n))
        assert not live[n:].any(), f"live_tokens={n}: rows past it are not zero"
        short = forward(Batch(batch.x[:n], batch.ids[:n], batch.weights[:n], {}), dtype, layer)
        what = f"{layer.case.id} {variant} {base} live_tokens={n} of {T}"
        assert_same_bits(live[:n], short, f"{what} vs a call with only those {n} rows")
        if on_amx_tiles(layer, variant, base):  # the full call's rows ran on tiles, these maybe not
            assert_tile_close(live[:n], full[:n], layer, f"{what} vs the full call's first {n} rows")
        else:
            assert_same_bits(live[:n], full[:n], f"{what} vs the full call's first {n} rows")


@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count(layer: Layer, variant: str, dtype: torch.dtype) -> None:
    """1, 2 and the default number of engine threads give the same bits, whole outputs."""
    batches = all_batches(layer)
    default = {name: [forward(b, dtype, layer) for b in bs] for name, bs in batches.items()}
    solo = solo_outputs(layer, dtype)
    previous = kt_ops.get_num_threads()
    try:
        for threads in [n for n in (1, 2) if n != previous]:  # the default is the third count
            kt_ops.set_num_threads(threads)
            for p, out in enumerate(solo_outputs(layer, dtype)):
                assert_same_bits(out, solo[p], f"{layer.case.id} {variant} solo probe {p} threads={threads} "
                                                f"vs default {previous}")
            for name, bs in batches.items():
                for b, ref in zip(bs, default[name]):
                    assert_same_bits(forward(b, dtype, layer), ref,
                                     f"{layer.case.id} {variant} {name} threads={threads} vs default {previous}")
    finally:
        kt_ops.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
def test_repeated_calls_and_call_order(layer: Layer, variant: str, dtype: torch.dtype) -> None:
    """Every call repeated, in reverse order and with int64 ids, gives the same bits."""
    calls = [(name, b) for name, bs in all_batches(layer).items() for b in bs]
    first = [forward(b, dtype, layer) for _, b in calls]
    for (name, b), ref in reversed(list(zip(calls, first))):
        assert_same_bits(forward(b, dtype, layer), ref, f"{layer.case.id} {variant} {name} repeated, reverse order")
    for (name, b), ref in zip(calls, first):
        wide = Batch(b.x, b.ids.long(), b.weights, b.rows)
        assert_same_bits(forward(wide, dtype, layer), ref, f"{layer.case.id} {variant} {name} int64 ids vs int32")


def input_grads(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, packed: kt_ops.PackedExperts,
                probe: torch.Tensor, saved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``(moe_forward(x) * probe).sum()`` w.r.t. x and w: through the saved gate
    and up (kt::moe_train_backward) or recomputed (kt::moe_backward)."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = kt_ops.moe_forward(x, ids, w, packed) if saved else torch.ops.kt.moe_forward(x, ids, w, packed.data)
    (out * probe).sum().backward()
    return x.grad, w.grad


def test_backward_row_does_not_depend_on_the_expert_order_of_earlier_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Token 1 (experts 0, 1, 2) alone and after a token routed to 2, 0, 1: the same gradient bits
    (saved gate and up; the panel GEMM, row-independent, forced: only the order of the expert sum is left)."""
    monkeypatch.setenv("KT_OPS_TRAIN_GEMM", "panel")
    E, H, I = 3, 64, 32
    g = torch.Generator().manual_seed(1)
    gate, up, down = (torch.randn(shape, generator=g).bfloat16() for shape in ((E, I, H), (E, I, H), (E, H, I)))
    packed = kt_ops.pack_experts(gate, up, down, method="BF16")
    x, probe = torch.randn(2, H, generator=g), torch.randn(2, H, generator=g)
    ids = torch.tensor([[2, 0, 1], [0, 1, 2]], dtype=torch.int32)
    w = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.7, 0.9]])
    gx, gw = input_grads(x, ids, w, packed, probe, saved=True)
    alone, alone_w = input_grads(x[1:], ids[1:], w[1:], packed, probe[1:], saved=True)
    assert_same_bits(gw[1:], alone_w, "grad_w of token 1")
    assert_same_bits(gx[1:], alone, "grad_x of token 1")


def one_expert(H: int, I: int, method: str, g: torch.Generator) -> kt_ops.PackedExperts:
    """One random bf16 expert (``[1, I, H]`` gate and up, ``[1, H, I]`` down) packed as ``method``."""
    gate, up = ((torch.randn(1, I, H, generator=g) / H**0.5).bfloat16() for _ in range(2))
    down = (torch.randn(1, H, I, generator=g) / I**0.5).bfloat16()
    return kt_ops.pack_experts(gate, up, down, method=method)


def test_recomputed_backward_row_does_not_depend_on_the_other_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """kt::moe_backward (g and u recomputed), one expert, top-1: a token's grad_x alone and in a
    40-token call, the panel GEMM forced."""
    monkeypatch.setenv("KT_OPS_TRAIN_GEMM", "panel")
    H, I, T = 640, 640, 40
    g = torch.Generator().manual_seed(3)
    packed = one_expert(H, I, "BF16", g)
    x, probe = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    ids, w = torch.zeros(T, 1, dtype=torch.int32), torch.rand(T, 1, generator=g)
    gx, gw = input_grads(x, ids, w, packed, probe, saved=False)
    alone, alone_w = input_grads(x[:1], ids[:1], w[:1], packed, probe[:1], saved=False)
    assert_same_bits(gw[:1], alone_w, "grad_w of token 0 (recomputed)")
    assert_same_bits(gx[:1], alone, "grad_x of token 0 (recomputed)")


def test_lora_forward_row_does_not_depend_on_the_other_tokens() -> None:
    """kt::moe_lora_forward, one expert, top-1: a token's output alone and in a 40-token call."""
    from kt_ops.lora import moe_lora_forward

    E, H, I, T, rank = 1, 640, 640, 40, 8
    g = torch.Generator().manual_seed(3)
    packed = one_expert(H, I, "AMXINT8", g)
    shapes = ((E, rank, H), (E, I, rank), (E, rank, H), (E, I, rank), (E, rank, I), (E, H, rank))
    lora = tuple(torch.randn(shape, generator=g) * 0.05 for shape in shapes)
    x, w = torch.randn(T, H, generator=g), torch.rand(T, 1, generator=g)
    ids = torch.zeros(T, 1, dtype=torch.int32)
    with torch.no_grad():
        full = moe_lora_forward(x, ids, w, packed, lora, 2.0)
        alone = moe_lora_forward(x[:1], ids[:1], w[:1], packed, lora, 2.0)
    assert_same_bits(full[:1], alone, "LoRA forward, token 0 alone vs in 40 tokens")


def test_lora_backward_row_does_not_depend_on_the_other_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """kt::moe_lora_backward, one expert, top-1: a token's grad_x and grad_w alone and in a
    40-token call (its LoRA products of token rows: dd Bd, (dd Bd) Ad, dg Bg, (dg Bg) Ag ...),
    the panel GEMM forced."""
    from kt_ops.lora import moe_lora_forward

    monkeypatch.setenv("KT_OPS_TRAIN_GEMM", "panel")
    E, H, I, T, rank = 1, 640, 640, 40, 8
    g = torch.Generator().manual_seed(4)
    packed = one_expert(H, I, "AMXINT8", g)  # not BF16: on amx its 40-token forward runs on AMX tiles (see above)
    shapes = ((E, rank, H), (E, I, rank), (E, rank, H), (E, I, rank), (E, rank, I), (E, H, rank))
    lora = tuple(torch.randn(shape, generator=g) * 0.05 for shape in shapes)
    x, probe = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    ids, w = torch.zeros(T, 1, dtype=torch.int32), torch.rand(T, 1, generator=g)

    def grads(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        xr, wr = x[:rows].clone().requires_grad_(), w[:rows].clone().requires_grad_()
        (moe_lora_forward(xr, ids[:rows], wr, packed, lora, 2.0) * probe[:rows]).sum().backward()
        return xr.grad, wr.grad

    (gx, gw), (alone, alone_w) = grads(T), grads(1)
    assert_same_bits(gw[:1], alone_w, "LoRA grad_w of token 0")
    assert_same_bits(gx[:1], alone, "LoRA grad_x of token 0")


def test_recomputed_backward_does_not_depend_on_the_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """kt::moe_backward (g and u recomputed), one expert, four tokens: the same bits with 2 and 1
    threads, the panel GEMM forced."""
    monkeypatch.setenv("KT_OPS_TRAIN_GEMM", "panel")
    H, I, T = 601, 521, 4
    g = torch.Generator().manual_seed(3)
    packed = one_expert(H, I, "BF16", g)
    x, probe = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    ids, w = torch.zeros(T, 1, dtype=torch.int32), torch.rand(T, 1, generator=g)
    previous = kt_ops.get_num_threads()
    try:
        results = []
        for threads in (2, 1):
            kt_ops.set_num_threads(threads)
            results.append(torch.ops.kt.moe_backward(probe, x, ids, w, packed.data))
    finally:
        kt_ops.set_num_threads(previous)
    assert_same_bits(results[1][1], results[0][1], "recomputed grad_w, 1 vs 2 threads")
    assert_same_bits(results[1][0], results[0][0], "recomputed grad_x, 1 vs 2 threads")
