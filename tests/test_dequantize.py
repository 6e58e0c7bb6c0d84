"""kt::dequantize_experts (kt_ops.dequantize_experts): chosen experts of a packed blob of
every format back as Hugging Face weights, bit for bit kt_ops.reference.dequantize's
values (NaN where it has NaN), in fp32 and rounded to bf16, for every case of
tests/format_cases.py (every format, group size and ggml type) under every CPU variant
this machine runs; and blobs whose weight bytes are random, so every bit pattern of
levels, scales and exponents (NaN, infinities, subnormals) is decoded as the oracle
decodes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kt_ops
from conftest import make_experts
from format_cases import FormatCase, format_cases
from gguf_helpers import random_blocks, write_model
from kt_ops import reference
from kt_ops._native import _C

E = 4
# Subsets, repeats and order: slot i is expert IDS[i].
IDS = [3, 0, 3, 1]


def assert_bits_equal(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Same shape, dtype and bits, except that any NaN matches any NaN (the oracle's
    NaNs are torch's, whose payloads and signs are not what is being tested)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, \
        f"{what}: {out.dtype} {out.shape} vs {ref.dtype} {ref.shape}"
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan), f"{what}: NaN positions differ"
    bits = torch.int32 if out.dtype == torch.float32 else torch.int16
    got, want = out.view(bits)[~nan], ref.view(bits)[~nan]
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[0].item()
        raise AssertionError(f"{what}: {int((got != want).sum())} values differ, first "
                             f"{out[~nan][bad].item()!r} vs {ref[~nan][bad].item()!r}")


def assert_matches_oracle(packed: torch.Tensor, ids: list[int], ids_dtype: torch.dtype = torch.int64) -> None:
    """fp32 output bit for bit the oracle's rows ``ids``; bf16 output those rounded."""
    ref = reference.dequantize(packed)
    index = torch.tensor(ids, dtype=torch.int64)
    out = torch.ops.kt.dequantize_experts(packed, torch.tensor(ids, dtype=ids_dtype))
    bf16 = torch.ops.kt.dequantize_experts(packed, torch.tensor(ids, dtype=ids_dtype), torch.bfloat16)
    for name, o, b, r in zip(("gate", "up", "down"), out, bf16, ref):
        want = r[index]
        assert_bits_equal(o, want, name)
        assert_bits_equal(b, want.to(torch.bfloat16), f"{name} (bf16)")


def random_weight_bytes(packed: torch.Tensor, seed: int) -> torch.Tensor:
    """A copy of ``packed`` whose bytes after the header (biases excepted) are random: its
    levels, codes, scales, minimums, exponents and ggml block fields take every bit pattern."""
    info = _C.packed_info(packed)
    out = packed.clone()
    end = info["bias_offset"] or info["nbytes"]
    g = torch.Generator().manual_seed(seed)
    out[256:end] = torch.randint(0, 256, (end - 256,), generator=g, dtype=torch.uint8)
    return out


def case_layer(case: FormatCase, seed: int = 0) -> torch.Tensor:
    experts = make_experts(E, case.hidden, case.intermediate, seed=seed)
    return case.pack(experts.gate, experts.up, experts.down).data


CASES = format_cases(min_hidden=300, min_intermediate=260)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_format_matches_the_oracle(case: FormatCase, variant: str) -> None:
    """Packed weights (odd multiples of each case's block: H, I off 16 and 32 where the
    format allows), experts chosen with repeats, int32 and int64 ids."""
    packed = case_layer(case)
    assert_matches_oracle(packed, IDS, torch.int32)
    assert_matches_oracle(packed, [2], torch.int64)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf.quants on NaN and infinite fp16 scales
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_random_bytes_match_the_oracle(case: FormatCase, variant: str) -> None:
    """Every byte after the header random: NaN and infinite scales, NaN codes and
    exponents, subnormals, the sign of zero products."""
    packed = random_weight_bytes(case_layer(case), seed=1)
    assert_matches_oracle(packed, list(range(E)))


@pytest.mark.parametrize("fmt,H,I", [("BF16", 7, 5), ("BF16", 33, 17), ("AMXINT8", 7, 5), ("AMXINT8", 45, 37),
                                     ("FP8", 7, 5), ("FP8", 300, 150), ("FP8_PERCHANNEL", 9, 3), ("MXFP8", 35, 33)])
def test_small_and_odd_shapes(fmt: str, H: int, I: int, variant: str) -> None:
    """Rows fewer than a 16-row block, K shorter than one line, odd K, partial groups."""
    case = FormatCase(fmt, fmt, kt_ops.formats.format_for_method(fmt), H, I)
    packed = random_weight_bytes(case_layer(case), seed=2)
    assert_matches_oracle(packed, [1, 1, 0])


def test_random_gguf_blocks(tmp_path, variant: str) -> None:
    """Every quantized ggml type from random block bytes (valid fp16 scales), read
    memory-mapped from a GGUF file (matrices at the file's offsets)."""
    rng = np.random.default_rng(5)
    H, I = 512, 256
    for types in [("Q4_0", "Q4_1", "Q5_0"), ("Q5_1", "Q8_0", "Q2_K"), ("Q3_K", "Q4_K", "Q5_K"),
                  ("Q6_K", "F16", "BF16"), ("F32", "Q6_K", "Q4_K")]:
        layer = {name: (t, random_blocks(t, E * rows, k, rng).reshape(E, rows, -1))
                 for name, t, rows, k in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), types, (I, I, H),
                                             (H, H, I))}
        path = tmp_path / f"{'_'.join(types)}.gguf"
        write_model(path, [layer], E, H, I)
        packed = kt_ops.load_gguf_experts(path, 0)
        assert _C.packed_info(packed.data)["gguf_types"] == list(types)
        assert_matches_oracle(packed.data, IDS)


@pytest.mark.parametrize("packing", ["gguf", "mxfp4"])
def test_mxfp4_nan_and_subnormal_exponents(variant: str, packing: str) -> None:
    """MXFP4 exponent 255 is NaN (the oracle's reading, not ggml's 2^127); 0 and 1 give
    subnormal scales; every code in random blocks; in GGUF's blocks and in format mxfp4."""
    experts = make_experts(E, 64, 96)
    packed = kt_ops.pack_experts(experts.gate, experts.up, experts.down, method="LLAMAFILE",
                                 gguf_type="MXFP4").data.clone()
    offsets = _C.packed_info(packed)["matrix_offsets"]
    g = torch.Generator().manual_seed(6)
    matrices = []
    for offset, rows, k in zip(offsets, (96, 96, 64), (64, 64, 96)):
        blocks = packed[offset : offset + E * rows * k // 32 * 17].view(-1, 17)
        blocks[:] = torch.randint(0, 256, blocks.shape, generator=g, dtype=torch.uint8)
        blocks[::7, 0] = 255
        blocks[1::7, 0] = 0
        blocks[2::7, 0] = 1
        matrices.append(blocks.reshape(-1))
    if packing == "mxfp4":
        packed = _C.mxfp4_experts_from_blocks(*matrices, E, 64, 96)
    assert _C.packed_info(packed)["format"] == packing
    assert_matches_oracle(packed, IDS)


def test_activation_and_biases_leave_the_weights(variant: str) -> None:
    """A blob with another activation and expert biases (header version 2, a bias region)
    dequantizes to the same weights."""
    H, I = 96, 64
    experts = make_experts(E, H, I)
    for method, kwargs in (("BF16", {}), ("AMXINT4", {"group_size": 32}), ("LLAMAFILE", {"gguf_type": "Q8_0"})):
        plain = kt_ops.pack_experts(experts.gate, experts.up, experts.down, method=method, **kwargs)
        biased = kt_ops.set_activation(plain, 7.0, 1.702, (torch.randn(E, I), None, torch.randn(E, H)))
        for a, b in zip(kt_ops.dequantize_experts(plain), kt_ops.dequantize_experts(biased)):
            assert torch.equal(a, b)
        assert_matches_oracle(biased.data, IDS)


def test_python_wrapper() -> None:
    experts = make_experts(E, 40, 24)
    gate, up, down = kt_ops.dequantize_experts(experts.packed)  # every expert
    assert torch.equal(gate, experts.gate.float()) and torch.equal(up, experts.up.float())
    assert torch.equal(down, experts.down.float())
    g16, _, d16 = kt_ops.dequantize_experts(experts.packed.data, torch.tensor([2, 0], dtype=torch.int32),
                                            dtype=torch.bfloat16)
    assert torch.equal(g16, experts.gate[[2, 0]]) and torch.equal(d16, experts.down[[2, 0]])
    strided = kt_ops.dequantize_experts(experts.packed, torch.tensor([3, 9, 1, 9])[::2])  # non-contiguous ids
    assert torch.equal(strided[0], experts.gate[[3, 1]].float())
    empty = kt_ops.dequantize_experts(experts.packed, torch.zeros(0, dtype=torch.int64))
    assert [tuple(t.shape) for t in empty] == [(0, 24, 40), (0, 24, 40), (0, 40, 24)]


def test_the_oracle_reads_a_blob_at_any_storage_offset() -> None:
    """A blob that is a view at an odd byte offset (a slice of a larger buffer) is a valid
    blob to the kernels; reference.dequantize (bf16 layers) and reference.activation_of (the
    bias region) failed on it with torch's "storage_offset() must be divisible by 2 to view
    Byte as BFloat16"."""
    experts = make_experts(E, 40, 24)
    blob = kt_ops.set_activation(experts.packed, 7.0, 1.702, (torch.randn(E, 24), None, torch.randn(E, 40))).data
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), blob])[1:]
    for a, b in zip(reference.dequantize(shifted), reference.dequantize(blob)):
        assert torch.equal(a, b)
    assert torch.equal(reference.dequantize(shifted)[0], experts.gate.float())
    biases, expected = reference.activation_of(shifted)["biases"], reference.activation_of(blob)["biases"]
    assert all(torch.equal(a, b) for a, b in zip(biases, expected))


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("bad", [-1, E, 2**31 - 1])
def test_expert_id_out_of_range(ids_dtype: torch.dtype, bad: int) -> None:
    experts = make_experts(E, 40, 24)
    with pytest.raises(ValueError, match=rf"expert_ids\[1\] = {bad} is out of range: the packed layer has {E} experts"):
        torch.ops.kt.dequantize_experts(experts.packed.data, torch.tensor([0, bad], dtype=ids_dtype))


def test_bad_arguments() -> None:
    experts = make_experts(E, 40, 24)
    data, ids = experts.packed.data, torch.tensor([0, 1])
    with pytest.raises(TypeError, match="dtype must be float32 or bfloat16"):
        torch.ops.kt.dequantize_experts(data, ids, torch.float16)
    with pytest.raises(TypeError, match="expert_ids must have dtype Int, Long"):
        torch.ops.kt.dequantize_experts(data, ids.float())
    with pytest.raises(ValueError, match="expert_ids must be 1-D"):
        torch.ops.kt.dequantize_experts(data, ids.view(1, 2))
    with pytest.raises(TypeError, match="packed must have dtype Byte"):
        torch.ops.kt.dequantize_experts(data.view(torch.int8), ids)
    with pytest.raises(ValueError, match="truncated or padded"):
        torch.ops.kt.dequantize_experts(data[:-1], ids)
    with pytest.raises(ValueError, match="packed is on the meta device"):  # was "data-dependent output"
        kt_ops.dequantize_experts(data.to("meta"), ids)


def test_every_format_row_names_its_dequantizer() -> None:
    for row in _C.format_table():
        assert row["dequantizer"].startswith("dequantize_") and row["dequantizer"].endswith("_rows"), row
    assert {c.format for c in CASES} == {row["name"] for row in _C.format_table()}


def test_fake_sizes_are_data_dependent() -> None:
    """Under FakeTensorMode the sizes I and H (from the header) are new symbols; n is
    expert_ids' length."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    experts = make_experts(E, 40, 24)
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        data = mode.from_tensor(experts.packed.data)
        gate, up, down = torch.ops.kt.dequantize_experts(data, torch.zeros(3, dtype=torch.int64), torch.bfloat16)
    assert gate.shape[0] == 3 and gate.dtype == torch.bfloat16
    assert gate.shape == up.shape and down.shape[1] == gate.shape[2] and down.shape[2] == gate.shape[1]
    assert not isinstance(gate.shape[1], int)
