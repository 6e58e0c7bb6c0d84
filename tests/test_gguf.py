"""GGUF formats (LLAMAFILE): every supported ggml type on every CPU variant against
kt_ops.reference on weights dequantized by the ``gguf`` package itself, our quantizers
against gguf's, and GGUF files written by ``gguf.GGUFWriter`` loaded back (single and
split), memory-mapped.

Per kernel case, two comparisons that can each fail on their own:
- tight: the reference with the kernel's 8-bit activation blocks simulated
  (``quantize_activations=reference.gguf_activation_blocks(blob)``): only summation
  order differs, bound 1e-3 (measured ~1e-7 .. 1e-6); on the amx variant's tile path
  (prefill of a layer with a float-type matrix: >= TILE_MIN_PAIRS tokens per expert on
  average) the reference on weights and activations rounded to bf16 instead, same bound;
- the issue's bound: plain fp32 reference on the gguf-dequantized weights, relative
  (Frobenius) error <= 3e-2 (the 8-bit activation blocks cost 1-2%).

Batch invariance (test_batch_invariance): a token's output row is bit-identical whatever
the other tokens of the call, live_tokens and the thread count (outside the amx tile
path, which by design runs calls of layers with a float-type matrix averaging
TILE_MIN_PAIRS tokens per expert in bf16).
"""

from __future__ import annotations

import gc
import os
import shutil

import numpy as np
import pytest
import torch
from gguf_helpers import F16_FIELDS, FLOAT_TYPES, T, dequantize, finish, moe_writer, random_blocks, write_model

import gguf
import kt_ops
from conftest import random_routing, rel_err
from kt_ops import gguf_loader, reference
from kt_ops._native import _C

QUANT_32 = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
QUANT_256 = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
ALL_TYPES = FLOAT_TYPES + QUANT_32 + QUANT_256

# (E, top_k, H, I, tokens) per block size: rows off the 4-row groups and 64-row jobs,
# rows past a partial 256-weight unit (32-blocks: K = 96, 288, 160, 1120), top-k = E,
# experts with > 4 and > 64 tokens.
SHAPES = {
    1: [(4, 2, 33, 17, 3), (3, 3, 64, 70, 9)],
    32: [(4, 2, 96, 160, 1), (3, 3, 288, 96, 7), (6, 2, 1120, 64, 70)],
    256: [(4, 2, 256, 256, 1), (3, 3, 512, 256, 7), (5, 2, 256, 512, 90)],
}


def block_of(type_name: str) -> int:
    return gguf.GGML_QUANT_SIZES[T[type_name]][0]


def packed_from_blocks(types: tuple[str, str, str], E: int, H: int, I: int, seed: int):
    """Random valid blocks -> (blob, gate, up, down dequantized by gguf)."""
    rng = np.random.default_rng(seed)
    raws = [random_blocks(t, E * rows, k, rng) for t, (rows, k) in zip(types, ((I, H), (I, H), (H, I)))]
    blob = _C.gguf_experts_from_blocks(*(torch.from_numpy(r.reshape(-1).copy()) for r in raws),
                                       [int(T[t]) for t in types], E, H, I)
    weights = [dequantize(r, t, (E, rows, k)) for r, t, (rows, k) in zip(raws, types, ((I, H), (I, H), (H, I)))]
    return blob, *weights


# The GGUF driver's kGgufTileMinPairs: the amx variant multiplies bf16 tiles when a layer
# with a float-type matrix (F32 / F16 / BF16) gets a call averaging this many tokens per
# active expert (layers of quantized types only keep the integer tiles: faster there).
TILE_MIN_PAIRS = 8


def takes_tile_path(ids: torch.Tensor, blob: torch.Tensor) -> bool:
    active = torch.unique(ids[ids >= 0]).numel()
    has_float = any(t in FLOAT_TYPES for t in _C.packed_info(blob)["gguf_types"])
    return kt_ops.cpu_variant() == "amx" and has_float and int((ids >= 0).sum()) >= TILE_MIN_PAIRS * active


def check_kernel(blob: torch.Tensor, gate, up, down, E: int, k: int, H: int, T_: int, seed: int,
                 ids: torch.Tensor | None = None) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T_, H, generator=g)  # fp32 in and out: no output rounding hides a path's error
    ids, weights = random_routing(T_, E, k, seed) if ids is None else (ids, torch.rand(T_, k, generator=g) + 0.1)
    out = kt_ops.moe_forward(x, ids, weights, blob)
    if takes_tile_path(ids, blob):
        bf16 = [w.bfloat16().float() for w in (gate, up, down)]
        tight = reference.moe_forward(x, ids, weights, *bf16, quantize_activations=("bf16",) * 3)
    else:
        tight = reference.moe_forward(x, ids, weights, gate, up, down,
                                      quantize_activations=reference.gguf_activation_blocks(blob))
    plain = reference.moe_forward(x, ids, weights, gate, up, down)
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, tight) <= 1e-3
    assert rel_err(out, plain) <= 3e-2


def kernel_cases() -> list:
    out = []
    for t in ALL_TYPES:
        for E, k, H, I, T_ in SHAPES[block_of(t)]:
            out.append(pytest.param(t, E, k, H, I, T_, id=f"{t}-E{E}k{k}H{H}I{I}T{T_}"))
    return out


@pytest.mark.parametrize("type_name,E,k,H,I,tokens", kernel_cases())
def test_random_blocks(variant: str, type_name: str, E: int, k: int, H: int, I: int, tokens: int) -> None:
    blob, gate, up, down = packed_from_blocks((type_name,) * 3, E, H, I, seed=H + I)
    check_kernel(blob, gate, up, down, E, k, H, tokens, seed=tokens)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q5_0", "Q8_0"), ("Q8_0", "F16", "Q3_K"),
                                   ("BF16", "Q2_K", "Q5_1"), ("Q5_K", "Q4_1", "F32")], ids="-".join)
def test_mixed_types(variant: str, types: tuple[str, str, str]) -> None:
    """A layer whose gate, up and down use different types (as Q4_K_M files do)."""
    E, k, H, I = 5, 2, 512, 256
    blob, gate, up, down = packed_from_blocks(types, E, H, I, seed=7)
    for tokens in (1, 40):
        check_kernel(blob, gate, up, down, E, k, H, tokens, seed=tokens)


@pytest.mark.parametrize("types", [("Q4_K",) * 3, ("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q4_0", "Q5_0"),
                                   ("Q6_K", "Q5_K", "Q4_1")], ids="-".join)
def test_experts_with_few_and_many_tokens_in_one_call(variant: str, types: tuple[str, str, str]) -> None:
    """Batch decode: experts with 1, 2, 3 and 6 tokens in one call (the in-place kernels'
    token blocks of 4 and their tails, beside decoded matrices) agree with the reference."""
    E, k, H, I = 6, 2, 512, 256
    blob, gate, up, down = packed_from_blocks(types, E, H, I, seed=11)
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 4], [0, 5], [1, 2], [0, 1]], dtype=torch.int32)
    check_kernel(blob, gate, up, down, E, k, H, ids.shape[0], seed=5, ids=ids)


@pytest.mark.parametrize("type_name", QUANT_32)
def test_real_blocks_from_gguf_quantize(variant: str, type_name: str) -> None:
    """Blocks quantized by gguf.quants.quantize (real data, not random bytes)."""
    E, k, H, I = 4, 2, 96, 64
    g = torch.Generator().manual_seed(3)
    mats = [torch.randn(E, r, c, generator=g) / c**0.5 for r, c in ((I, H), (I, H), (H, I))]
    raws = [gguf.quants.quantize(m.reshape(-1, m.shape[-1]).numpy(), T[type_name]) for m in mats]
    blob = _C.gguf_experts_from_blocks(*(torch.from_numpy(r.reshape(-1).copy()) for r in raws),
                                       [int(T[type_name])] * 3, E, H, I)
    weights = [dequantize(r, type_name, tuple(m.shape)) for r, m in zip(raws, mats)]
    check_kernel(blob, *weights, E, k, H, 9, seed=1)


@pytest.mark.parametrize("type_name", QUANT_32)
def test_quantizer_matches_gguf_bit_for_bit(type_name: str) -> None:
    """Our C++ quantizer for the 32-weight types == gguf.quants.quantize (ggml's reference)."""
    E, H, I = 3, 64, 96
    g = torch.Generator().manual_seed(5)
    gate, up, down = (torch.randn(E, r, c, generator=g) for r, c in ((I, H), (I, H), (H, I)))
    packed = kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type=type_name)
    info = _C.packed_info(packed.data)
    for m, (tensor, offset) in enumerate(zip((gate, up, down), info["matrix_offsets"])):
        ours = packed.data[offset : offset + tensor.numel() // 32 * gguf.GGML_QUANT_SIZES[T[type_name]][1]].numpy()
        theirs = gguf.quants.quantize(tensor.reshape(-1, tensor.shape[-1]).numpy(), T[type_name]).reshape(-1)
        np.testing.assert_array_equal(ours, theirs, err_msg=f"{type_name} matrix {m}")


# Relative quantization error bounds for Gaussian weights (measured 0.33 / 0.155 /
# 0.078 / 0.038 / 0.019 for the round-to-nearest K-quants).
KQUANT_ERROR = {"Q2_K": 0.40, "Q3_K": 0.19, "Q4_K": 0.095, "Q5_K": 0.047, "Q6_K": 0.024}


@pytest.mark.parametrize("type_name", QUANT_256)
def test_kquant_quantizer_gives_valid_blocks(type_name: str) -> None:
    """Our K-quant blocks, decoded by gguf, are close to the input (valid GGUF), and the
    kernel runs on them within the bounds."""
    E, k, H, I = 4, 2, 256, 512
    g = torch.Generator().manual_seed(11)
    gate, up, down = (torch.randn(E, r, c, generator=g) / c**0.5 for r, c in ((I, H), (I, H), (H, I)))
    packed = kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type=T[type_name])
    deq = reference.dequantize(packed.data)
    for original, decoded in zip((gate, up, down), deq):
        assert rel_err(decoded, original) <= KQUANT_ERROR[type_name]
    check_kernel(packed.data, *deq, E, k, H, 6, seed=2)


def test_gguf_type_forms_and_dtypes() -> None:
    E, H, I = 2, 256, 256
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(E, r, c, generator=g) for r, c in ((I, H), (I, H), (H, I)))
    forms = ["Q4_K", "q4_k", T.Q4_K, int(T.Q4_K), ("Q4_K", 12, T.Q4_K)]
    blobs = [kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type=f).data for f in forms]
    for blob in blobs[1:]:
        assert torch.equal(blob, blobs[0])
    for dtype in (torch.bfloat16, torch.float16):  # read directly, = converting first
        ours = kt_ops.pack_experts(gate.to(dtype), up.to(dtype), down.to(dtype), method="LLAMAFILE", gguf_type="Q8_0")
        ref = kt_ops.pack_experts(gate.to(dtype).float(), up.to(dtype).float(), down.to(dtype).float(),
                                  method="LLAMAFILE", gguf_type="Q8_0")
        assert torch.equal(ours.data, ref.data)
    info = kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type=("Q4_K", "Q4_K", "Q6_K"))
    assert info.format == "gguf" and _C.packed_info(info.data)["gguf_types"] == ["Q4_K", "Q4_K", "Q6_K"]
    assert info.gguf_types == ("Q4_K", "Q4_K", "Q6_K")  # the public name for it
    assert kt_ops.pack_experts(gate, up, down, method="BF16").gguf_types is None


# --- files -----------------------------------------------------------------------------


def model_layers(types: tuple[str, str, str], layers: int, E: int, H: int, I: int, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        layer = {}
        for name, t, (rows, k) in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), types, ((I, H), (I, H), (H, I))):
            layer[name] = (t, random_blocks(t, E * rows, k, rng).reshape(E, rows, -1))
        out.append(layer)
    return out


def check_layer_from_file(packed: kt_ops.PackedExperts, layer: dict, E: int, H: int, I: int) -> None:
    assert packed.format == "gguf" and packed.num_experts == E
    weights = [dequantize(raw.reshape(E * rows, -1), t, (E, rows, k))
               for (t, raw), (rows, k) in zip(layer.values(), ((I, H), (I, H), (H, I)))]
    check_kernel(packed.data, *weights, E, 2, H, 5, seed=4)


@pytest.mark.slow
@pytest.mark.parametrize("split", [0, 2], ids=["single", "split"])
def test_load_gguf_model(tmp_path, split: int) -> None:
    """A tiny Q4_K_M-style MoE written by gguf.GGUFWriter (3 layers, 8 experts), single
    file or split in parts of 2 tensors, loaded layer by layer."""
    E, H, I = 8, 256, 512
    layers = model_layers(("Q4_K", "Q4_K", "Q6_K"), 3, E, H, I, seed=1)
    layers[1] = model_layers(("Q8_0", "Q4_0", "Q5_K"), 1, E, H, I, seed=2)[0]
    write_model(tmp_path / "tiny.gguf", layers, E, H, I, split_max_tensors=split)
    files = sorted(os.listdir(tmp_path))
    assert len(files) == (1 if not split else 6), files
    info = kt_ops.read_gguf_config(tmp_path)
    assert (info.num_layers, info.num_experts, info.num_experts_per_tok, info.hidden_size,
            info.moe_intermediate_size) == (3, E, 2, H, I)
    for index, layer in enumerate(layers):
        check_layer_from_file(kt_ops.load_gguf_experts(tmp_path, index), layer, E, H, I)
    # One part's path loads the whole split model.
    check_layer_from_file(kt_ops.load_gguf_experts(tmp_path / files[0], 2), layers[2], E, H, I)


def test_mapped_weights_outlive_the_file_and_reader(tmp_path) -> None:
    """The blob maps the file (not a copy) and owns the mapping: freeing the reader and
    deleting the file (kt-kernel segfaults here) leave it usable."""
    E, H, I = 8, 256, 256
    layers = model_layers(("Q4_K", "Q4_K", "Q6_K"), 1, E, H, I, seed=3)
    path = tmp_path / "m.gguf"
    write_model(path, layers, E, H, I)
    packed = kt_ops.load_gguf_experts(path, 0)
    assert packed.nbytes > os.path.getsize(path) // 2  # blob is the mapped file ranges
    gguf_loader._reader.cache_clear()
    os.remove(path)
    gc.collect()
    check_layer_from_file(packed, layers[0], E, H, I)
    saved = tmp_path / "layer.safetensors"  # the mapped blob saves and reloads like any other
    packed.save(saved)
    x, (ids, weights) = torch.randn(3, H), random_routing(3, E, 2)
    assert torch.equal(kt_ops.moe_forward(x, ids, weights, kt_ops.PackedExperts.load(saved)),
                       kt_ops.moe_forward(x, ids, weights, packed))
    packed.data[300] = 1  # copy-on-write: writable, the (deleted) file is untouched


def test_a_file_replaced_with_the_same_size_and_mtime_is_reread(tmp_path) -> None:
    """The reader cache was keyed by (path, mtime_ns, size): a GGUF replaced by another of
    the same size whose mtime matches (a coarse-clock filesystem, or a copy that keeps
    times: cp -p, rsync -t) served the old file's tensors. The inode and ctime (which no
    copy can set) are in the key too."""
    E, H, I = 8, 256, 256
    path = tmp_path / "m.gguf"
    old = model_layers(("Q4_K", "Q4_K", "Q6_K"), 1, E, H, I, seed=11)
    new = model_layers(("Q6_K", "Q4_K", "Q4_K"), 1, E, H, I, seed=12)  # same size, other offsets
    write_model(path, old, E, H, I)
    check_layer_from_file(kt_ops.load_gguf_experts(path, 0), old[0], E, H, I)
    before = os.stat(path)
    write_model(tmp_path / "new.gguf", new, E, H, I)
    os.replace(tmp_path / "new.gguf", path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    check_layer_from_file(kt_ops.load_gguf_experts(path, 0), new[0], E, H, I)


def open_in_process(directory: os.PathLike[str]) -> list[str]:
    """This process's mappings and descriptors of files under ``directory``."""
    root = os.fspath(directory)
    with open("/proc/self/maps") as maps:
        mapped = [line.split(maxsplit=5)[-1].strip() for line in maps if root in line]
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return mapped + [link for link in links if root in link]


def test_a_deleted_or_replaced_gguf_file_is_not_kept_open(tmp_path) -> None:
    """The reader cache kept every file it had read mapped and open (up to 64), after the
    experts loaded from it were freed and after the file was deleted or replaced: a
    replaced model's disk space was never given back, and each rewrite added a mapping."""
    E, H, I = 8, 256, 256
    layers = model_layers(("Q4_K", "Q4_K", "Q6_K"), 1, E, H, I, seed=13)
    path = tmp_path / "m.gguf"
    for _ in range(3):
        write_model(path, layers, E, H, I)
        packed = kt_ops.load_gguf_experts(path, 0)
        check_layer_from_file(packed, layers[0], E, H, I)
        del packed
        gc.collect()
        os.remove(path)
    other = tmp_path / "other"
    other.mkdir()
    write_model(other / "o.gguf", layers, E, H, I)
    packed = kt_ops.load_gguf_experts(other / "o.gguf", 0)  # a later load drops the readers of gone files
    gc.collect()
    assert [entry for entry in open_in_process(tmp_path) if "other" not in entry] == []


# --- bad input -------------------------------------------------------------------------


def test_bad_files(tmp_path) -> None:
    E, H, I = 8, 256, 256
    layers = model_layers(("Q4_K", "Q4_K", "Q6_K"), 2, E, H, I, seed=5)
    good = tmp_path / "good"
    good.mkdir()
    write_model(good / "m.gguf", [layers[0], None], E, H, I)
    with pytest.raises(ValueError, match=r"no blk\.1\.ffn_gate_exps\.weight.*layer 1"):
        kt_ops.load_gguf_experts(good, 1)
    with pytest.raises(ValueError, match="outside the model's 2 layers"):
        kt_ops.load_gguf_experts(good, 2)
    with pytest.raises(FileNotFoundError):
        kt_ops.load_gguf_experts(tmp_path / "missing", 0)

    unsupported = tmp_path / "iq"
    unsupported.mkdir()
    iq = dict(layers[0])
    iq["ffn_down_exps"] = ("IQ4_NL", np.zeros((E, H, I // 32 * 18), dtype=np.uint8))
    write_model(unsupported / "m.gguf", [iq], E, H, I)
    with pytest.raises(ValueError, match=r"ffn_down_exps.*IQ4_NL is not supported"):
        kt_ops.load_gguf_experts(unsupported, 0)

    shapes = tmp_path / "shapes"
    shapes.mkdir()
    write_model(shapes / "m.gguf", [layers[0]], E, H, I, metadata_experts=16)
    with pytest.raises(ValueError, match=r"ggml shape \[256, 256, 8\] but the metadata \(E=16"):
        kt_ops.load_gguf_experts(shapes, 0)

    truncated = tmp_path / "truncated"
    truncated.mkdir()
    write_model(truncated / "m.gguf", [layers[0]], E, H, I)
    file = truncated / "m.gguf"
    os.truncate(file, os.path.getsize(file) - 4096)
    with pytest.raises(ValueError, match="truncated"):
        kt_ops.load_gguf_experts(truncated, 0)

    two = tmp_path / "two"
    two.mkdir()
    write_model(two / "a.gguf", [layers[0]], E, H, I)
    write_model(two / "b.gguf", [layers[1]], E, H, I)
    with pytest.raises(ValueError, match=r"several GGUF files.*a\.gguf, b\.gguf"):
        kt_ops.load_gguf_experts(two, 0)
    kt_ops.load_gguf_experts(two / "b.gguf", 0)  # naming the file is fine

    split = tmp_path / "split"
    split.mkdir()
    write_model(split / "m.gguf", [layers[0]], E, H, I, split_max_tensors=2)
    os.remove(split / "m-00002-of-00002.gguf")
    with pytest.raises(ValueError, match=r"incomplete: missing m-00002-of-00002\.gguf"):
        kt_ops.load_gguf_experts(split, 0)
    write_model(split / "m.gguf", [layers[0]], E, H, I, split_max_tensors=2)
    for stray in ("m-00000-of-00002.gguf", "m-00003-of-00002.gguf"):  # part 0 was read first, part 3 as one more
        shutil.copy(split / "m-00002-of-00002.gguf", split / stray)
        for where in (split, split / "m-00001-of-00002.gguf"):
            with pytest.raises(ValueError, match=rf"parts outside 1 \.\. 2: {stray}"):
                kt_ops.load_gguf_experts(where, 0)
        os.remove(split / stray)
    kt_ops.load_gguf_experts(split, 0)


@pytest.mark.parametrize("matrix,declared", [("ffn_gate_exps", "Q8_0"), ("ffn_up_exps", "Q5_K"),
                                             ("ffn_down_exps", "Q4_K"), ("ffn_gate_exps", "Q2_K")])
def test_a_type_field_that_disagrees_with_the_stored_bytes_is_refused(tmp_path, matrix: str, declared: str) -> None:
    """A tensor info's type changed in place (Q4_K/Q6_K blocks declared as another type): the
    layer loaded silently, reading the next tensor's bytes or decoding the blocks as the wrong
    type; llama.cpp refuses such a file (its next tensor's offset is not where it expects it)."""
    import struct

    from kt_ops.inspection import inspect_weights

    E, H, I = 4, 256, 256
    write_model(tmp_path / "m.gguf", [model_layers(("Q4_K", "Q4_K", "Q6_K"), 1, E, H, I, seed=6)[0], None], E, H, I)
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    name = f"blk.0.{matrix}.weight".encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)  # n_dims, dims, type, offset
    struct.pack_into("<I", data, at + 4 + 8 * struct.unpack_from("<I", data, at)[0], int(T[declared]))
    (tmp_path / "bad.gguf").write_bytes(data)
    kt_ops.load_gguf_experts(tmp_path / "m.gguf", 0)  # intact
    with pytest.raises(ValueError, match=rf"blk\.0\.{matrix}\.weight in bad\.gguf is declared {declared}.*"
                                         "disagrees with the bytes stored"):
        kt_ops.load_gguf_experts(tmp_path / "bad.gguf", 0)
    result = inspect_weights(tmp_path / "bad.gguf")  # listed it as a loadable layer
    assert result.layers == ()
    assert any(n.startswith("layers 0: an ffn_*_exps tensor's type disagrees") for n in result.notes)


def test_an_expert_tensor_in_two_parts_of_a_split_model_is_refused(tmp_path) -> None:
    """Both parts held blk.0.ffn_gate_exps.weight (different blocks): the last part's copy was used silently."""
    import gguf

    from kt_ops.inspection import inspect_weights

    E, H, I = 4, 256, 256
    first, second = model_layers(("Q8_0",) * 3, 2, E, H, I, seed=7)
    write_model(tmp_path / "m-00001-of-00002.gguf", [first], E, H, I)
    writer = gguf.GGUFWriter(os.fspath(tmp_path / "m-00002-of-00002.gguf"), "qwen3moe")
    writer.add_tensor("blk.0.ffn_gate_exps.weight", second["ffn_gate_exps"][1], raw_dtype=T.Q8_0)
    finish(writer)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate_exps\.weight is in both m-00001-of-00002\.gguf and "
                                         r"m-00002-of-00002\.gguf"):
        kt_ops.load_gguf_experts(tmp_path, 0)
    result = inspect_weights(tmp_path)  # listed it as a loadable layer
    assert result.layers == ()
    assert any(n.startswith("layers 0: an ffn_*_exps tensor is in two files") for n in result.notes)


def test_one_part_names_its_split_model_beside_another_whose_stem_it_begins(tmp_path) -> None:
    """m-00001-of-00002.gguf beside m-v2-0000N-of-00002.gguf: the glob m-*-of-00002.gguf
    took m-v2's parts too, and naming the part was refused as "more than one model"."""
    E, H, I = 8, 256, 256
    layers = model_layers(("Q4_K", "Q4_K", "Q6_K"), 1, E, H, I, seed=5)
    write_model(tmp_path / "m.gguf", layers, E, H, I, split_max_tensors=2)
    write_model(tmp_path / "m-v2.gguf", layers, E, H, I, split_max_tensors=2)
    for stem in ("m", "m-v2"):
        parts = gguf_loader.gguf_files(tmp_path / f"{stem}-00002-of-00002.gguf")
        assert [p.name for p in parts] == [f"{stem}-00001-of-00002.gguf", f"{stem}-00002-of-00002.gguf"]
    check_layer_from_file(kt_ops.load_gguf_experts(tmp_path / "m-00001-of-00002.gguf", 0), layers[0], E, H, I)
    with pytest.raises(ValueError, match="more than one model"):  # the directory stays ambiguous
        kt_ops.load_gguf_experts(tmp_path, 0)


def test_a_fifo_named_as_a_gguf_file_is_not_said_to_be_missing(tmp_path) -> None:
    """load_gguf_experts of a FIFO raised FileNotFoundError 'does not exist'."""
    os.mkfifo(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="m.gguf: not a regular file"):
        kt_ops.load_gguf_experts(tmp_path / "m.gguf", 0)


def test_a_one_dimensional_gate_without_the_intermediate_size_key_is_a_value_error(tmp_path) -> None:
    """No {arch}.expert_feed_forward_length and a 1-D ffn_gate_exps: I was read from its shape[1], an IndexError."""
    import gguf

    E, H, I = 4, 256, 256
    layer = model_layers(("Q8_0",) * 3, 1, E, H, I, seed=8)[0]
    writer = moe_writer(tmp_path / "m.gguf", experts=E, hidden=H)
    for name, (type_name, raw) in layer.items():
        writer.add_tensor(f"blk.0.{name}.weight", raw.reshape(-1) if name == "ffn_gate_exps" else raw,
                          raw_dtype=T[type_name])
    finish(writer)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate_exps\.weight in m\.gguf has ggml shape \[262144\]"):
        kt_ops.load_gguf_experts(tmp_path / "m.gguf", 0)


def test_llama_cpp_types() -> None:
    """llama.cpp's types for a layer: each K-quant whose rows its 256-weight blocks do not
    fit replaced by the fallback (gate and up by H, down by I); None where that fallback is
    IQ4_NL, which kt_ops does not compute."""
    from kt_ops.gguf_types import gguf_type_ids, llama_cpp_types

    assert llama_cpp_types(gguf_type_ids("Q4_K"), 2048, 1408) == ("Q4_K", "Q4_K", "Q5_0")
    assert llama_cpp_types(gguf_type_ids(("Q5_K", "Q5_K", "Q6_K")), 2048, 1408) == ("Q5_K", "Q5_K", "Q8_0")
    assert llama_cpp_types(gguf_type_ids("Q4_K"), 64, 512) == ("Q5_0", "Q5_0", "Q4_K")
    assert llama_cpp_types(gguf_type_ids("Q4_0"), 2048, 1408) == ("Q4_0",) * 3
    assert llama_cpp_types(gguf_type_ids("Q3_K"), 2048, 1408) is None
    assert llama_cpp_types(gguf_type_ids("Q8_0"), 2048, 1400) is None  # 1400: no 32-weight block fits either


def test_bad_pack_arguments() -> None:
    E, H, I = 2, 256, 1408  # 1408 = 5.5 x 256: K-quants cannot store down
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(E, r, c, generator=g) for r, c in ((I, H), (I, H), (H, I)))
    with pytest.raises(ValueError, match=r"down_proj: GGUF type Q4_K needs a row length.*1408.*Q5_0: pass "
                                         r"gguf_type=\('Q4_K', 'Q4_K', 'Q5_0'\)"):
        kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type="Q4_K")
    kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type=("Q4_K", "Q4_K", "Q5_0"))  # the fallback
    with pytest.raises(ValueError, match="IQ4_NL, which kt_ops does not compute"):
        kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type="Q3_K")
    with pytest.raises(ValueError, match="needs gguf_type"):
        kt_ops.pack_experts(gate, up, down, method="LLAMAFILE")
    with pytest.raises(ValueError, match="unknown GGUF type 'Q9_9'"):
        kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type="Q9_9")
    with pytest.raises(ValueError, match="IQ4_XS is not supported"):
        kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type="IQ4_XS")
    with pytest.raises(ValueError, match=r"\(gate, up, down\)"):
        kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type=("Q4_K", "Q6_K"))
    with pytest.raises(ValueError, match="gguf_type applies to method 'LLAMAFILE'"):
        kt_ops.pack_experts(gate, up, down, method="AMXINT8", gguf_type="Q4_K")
    with pytest.raises(ValueError, match="neither group_size nor scale_search"):
        kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type="Q8_0", group_size=32)
    with pytest.raises(ValueError, match="pack_gguf_experts"):
        torch.ops.kt.pack_experts(gate, up, down, "gguf")
    with pytest.raises(ValueError, match="IQ4_XS is not supported"):  # op level, no Python checks
        torch.ops.kt.pack_gguf_experts(gate, up, down, [12, 12, int(T.IQ4_XS)])
    with pytest.raises(ValueError, match="blocks of 256 elements, but the row length is 1408"):
        torch.ops.kt.pack_gguf_experts(gate, up, down, [12, 12, 12])


def test_corrupt_gguf_blob_is_refused() -> None:
    E, H, I = 2, 256, 256
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(E, r, c, generator=g) for r, c in ((I, H), (I, H), (H, I)))
    blob = kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type="Q4_K").data
    x, (ids, weights) = torch.randn(1, H), random_routing(1, E, 1)
    with pytest.raises(ValueError, match="truncated"):
        kt_ops.moe_forward(x, ids, weights, blob[:-64].clone())
    bad = blob.clone()
    bad[96:104] = torch.tensor([0xFF] * 8, dtype=torch.uint8)  # gate offset field
    with pytest.raises(ValueError, match="checksum"):
        kt_ops.moe_forward(x, ids, weights, bad)


# --- batch invariance ------------------------------------------------------------------

# Layers whose matrices the AVX-512 variants read in place (the mixed one as Q4_K_M files).
IN_PLACE_LAYERS = [("Q4_K",) * 3, ("Q5_K",) * 3, ("Q6_K",) * 3, ("Q8_0",) * 3, ("Q4_0",) * 3, ("Q5_0",) * 3,
                   ("Q4_1",) * 3, ("Q5_1",) * 3, ("Q2_K",) * 3, ("Q3_K",) * 3, ("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q5_K", "Q6_K"),
                   ("Q3_K", "Q3_K", "Q5_K")]
# Tokens per expert that a token's experts get among others (4-token blocks and their tails).
SHARED_COUNTS = (1, 2, 3, 5, 9, 17)


def batch_around(token: int, first: int, second: int, E: int, seed: int) -> tuple[torch.Tensor, int]:
    """ids [T, 2] where a token routed to experts (0, 1) sits among others so that expert 0
    has `first` tokens and expert 1 `second`, every other expert at least one (no call
    averages the amx tile path's tokens per expert); returns ids and the token's row."""
    g = torch.Generator().manual_seed(seed)
    others = [[0, 2 + i % (E - 2)] for i in range(first - 1)]
    others += [[1, 2 + (i + 3) % (E - 2)] for i in range(second - 1)]
    others += [[e, 2 + (e - 1) % (E - 2)] for e in range(2, E)]  # fillers: every expert active
    order = torch.randperm(len(others), generator=g).tolist()
    rows = [others[i] for i in order]
    at = min(token, len(rows))
    rows.insert(at, [0, 1])
    return torch.tensor(rows, dtype=torch.int32), at


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("types", IN_PLACE_LAYERS, ids="-".join)
def test_batch_invariance(variant: str, types: tuple[str, str, str], dtype: torch.dtype) -> None:
    """A token's output row is bit-identical whatever else is in the call: alone, among
    tokens that give its experts 1 .. 17 tokens each, padded past live_tokens, on one
    thread or all."""
    E, H, I = 12, (1024 if block_of(types[0]) == 256 else 1056), (256 if block_of(types[2]) == 256 else 160)
    blob = packed_from_blocks(types, E, H, I, seed=17)[0]
    threads = kt_ops.get_num_threads()
    for probe in range(3):  # bf16 output rounding hides most 1-ulp fp32 differences: several tokens
        g = torch.Generator().manual_seed(probe)
        token = torch.randn(1, H, generator=g).to(dtype)
        token_weights = torch.rand(1, 2, generator=g) + 0.1
        try:
            kt_ops.set_num_threads(1)
            alone = kt_ops.moe_forward(token, torch.tensor([[0, 1]], dtype=torch.int32), token_weights, blob)[0]
        finally:
            kt_ops.set_num_threads(threads)
        for i, first in enumerate(SHARED_COUNTS):
            second = SHARED_COUNTS[(i + 2 + probe) % len(SHARED_COUNTS)]
            ids, at = batch_around(7 * i + probe, first, second, E, seed=i)
            assert not takes_tile_path(ids, blob)
            x = torch.randn(ids.shape[0], H, generator=g).to(dtype)
            weights = torch.rand(ids.shape[0], 2, generator=g) + 0.1
            x[at], weights[at] = token[0], token_weights[0]
            out = kt_ops.moe_forward(x, ids, weights, blob)
            assert torch.equal(out[at], alone), f"expert 0: {first} tokens, expert 1: {second}"
            # Padded past live_tokens with more tokens for its experts (not computed).
            pad = torch.tensor([[0, 1]] * 5, dtype=torch.int32)
            out = kt_ops.moe_forward(torch.cat([x, x[:5]]), torch.cat([ids, pad]), torch.cat([weights, weights[:5]]),
                                     blob, torch.tensor([ids.shape[0]], dtype=torch.int32))
            assert torch.equal(out[at], alone), f"live_tokens, expert 0: {first} tokens, expert 1: {second}"


# From this many tokens per expert the AVX-512 variants repack an expert's rows of an
# in-place type (K-quants: gguf_kquant_tile_avx512.h, block-32 types:
# gguf_block32_tile_avx512.h's callers, kKquantTileMinPairs) and dot them on an integer
# tile: the same integers and float operations as the in-place kernels.
KQUANT_TILE_MIN_PAIRS = 8


def assert_prefill_matches_decode(blob: torch.Tensor, gate, up, down, E: int, H: int) -> None:
    """A prefill-sized call (experts 0-3 with ~28 tokens each: the repacked tile path; expert
    4 with 3: the in-place one) matches the oracle and gives every token the bits it gets
    alone, on all threads and on one."""
    assert E == 5
    tokens = 60
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(tokens)]).to(torch.int32)
    ids[:3, 1] = 4
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
    assert counts[:4].min() >= KQUANT_TILE_MIN_PAIRS and counts[4] < KQUANT_TILE_MIN_PAIRS
    check_kernel(blob, gate, up, down, E, 2, H, tokens, seed=3, ids=ids)
    if takes_tile_path(ids, blob):
        return  # amx: bf16 tiles by design (not batch-invariant)
    x = torch.randn(tokens, H, generator=g)
    weights = torch.rand(tokens, 2, generator=g) + 0.1
    out = kt_ops.moe_forward(x, ids, weights, blob)
    threads = kt_ops.get_num_threads()
    try:
        kt_ops.set_num_threads(1)
        assert torch.equal(kt_ops.moe_forward(x, ids, weights, blob), out)
    finally:
        kt_ops.set_num_threads(threads)
    for t in range(tokens):
        alone = kt_ops.moe_forward(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], blob)[0]
        assert torch.equal(out[t], alone), f"token {t}, experts {ids[t].tolist()}"


# Block-32 cases: H = 1056 and I = 160 (33 and 5 blocks: a partial last step of 4 blocks).
@pytest.mark.parametrize("types,H,I", [(("Q4_K",) * 3, 512, 256), (("Q5_K",) * 3, 512, 256),
                                       (("Q6_K",) * 3, 512, 256), (("Q2_K",) * 3, 512, 256),
                                       (("Q3_K",) * 3, 512, 256), (("F16", "F16", "Q6_K"), 1000, 256),
                                       (("F32", "Q5_K", "Q4_K"), 1280, 256), (("Q3_K", "Q2_K", "Q3_K"), 768, 256),
                                       (("Q8_0",) * 3, 1056, 160), (("Q4_0",) * 3, 1056, 160),
                                       (("Q4_1",) * 3, 1056, 160), (("Q5_0",) * 3, 1056, 160),
                                       (("Q5_1",) * 3, 1056, 160), (("F16", "F16", "Q5_1"), 1000, 160),
                                       (("Q4_K", "Q5_0", "Q8_0"), 512, 256)],
                         ids=["Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "F16-F16-Q6_K-H1000", "F32-Q5_K-Q4_K-H1280",
                              "Q3_K-Q2_K-Q3_K-H768", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16-F16-Q5_1-H1000",
                              "Q4_K-Q5_0-Q8_0"])
def test_prefill_rows_match_decode_rows(variant: str, types: tuple[str, str, str], H: int, I: int) -> None:
    """The repacked tile path against the in-place one (rows in groups of 32, 16 and a
    partial last group: down of H = 1000 rows)."""
    E = 5
    blob, gate, up, down = packed_from_blocks(types, E, H, I, seed=29)
    assert_prefill_matches_decode(blob, gate, up, down, E, H)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0"])
def test_an_infinite_block_scale_gives_non_finite_rows_on_every_variant(type_name: str) -> None:
    """A GGUF block (read in place: nothing refuses it) whose fp16 d is +inf, some of its
    quants zero: the oracle's weights there are NaN (0 * inf), so its row is NaN; the
    integer dots scale a block's sum by d, which gives +-inf on the AVX-512 variants and NaN
    on avx2 (docs/formats.md, GGUF). Never a finite value: the damage shows."""
    E, H, I = 1, 64, 32
    g = torch.Generator().manual_seed(33)
    weights = [torch.randn(E, n, k, generator=g) / 8 for n, k in ((I, H), (I, H), (H, I))]
    blob = kt_ops.pack_experts(*weights, method="LLAMAFILE", gguf_type=type_name).data.clone()
    block_bytes = 34 if type_name == "Q8_0" else 18
    first = _C.packed_info(blob)["matrix_offsets"][2] + 3 * (I // 32) * block_bytes  # down row 3, block 0
    blob[first : first + 2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # fp16 +inf
    blob[first + 2 : first + 6] = 0 if type_name == "Q8_0" else 0x88  # some quants of value 0, the others not
    x = torch.randn(9, H, generator=g)
    ids, topk_weights = torch.zeros(9, 1, dtype=torch.int32), torch.ones(9, 1)
    ref = reference.moe_forward(x, ids, topk_weights, *reference.dequantize(blob),
                                quantize_activations=reference.gguf_activation_blocks(blob))
    assert torch.isnan(ref[:, 3]).all()
    previous = kt_ops.cpu_variant()
    try:
        for name in kt_ops.CPU_VARIANTS:
            if kt_ops.missing_features(name):
                continue
            kt_ops.set_cpu_variant(name)
            for tokens in (1, 9):
                out = kt_ops.moe_forward(x[:tokens], ids[:tokens], topk_weights[:tokens], blob)
                assert not torch.isfinite(out[:, 3]).any(), (name, tokens)
                assert torch.isfinite(out[:, torch.arange(H) != 3]).all(), (name, tokens)  # the other rows unharmed
    finally:
        kt_ops.set_cpu_variant(previous)


def extreme_scale_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator, mode: str) -> np.ndarray:
    """:func:`random_blocks` whose fp16 scale fields (d, and dmin where the type has one) are
    each negated, zeroed, made 2^10 larger or 2^12 smaller (fp16 subnormals or zero) at random
    (``mode="mixed"``), or all random fp16 subnormals in [2^-15, 2^-14) (``mode="subnormal"``)."""
    raw = random_blocks(type_name, rows, k, rng)
    block, type_bytes = gguf.GGML_QUANT_SIZES[T[type_name]]
    blocks = raw.reshape(rows, k // block, type_bytes)
    for offset in F16_FIELDS[type_name][0]:
        field = blocks[:, :, offset : offset + 2]
        values = field.copy().view(np.float16).astype(np.float32)
        if mode == "mixed":
            factors = rng.choice(np.array([-1.0, 0.0, 2.0**10, 2.0**-12, 1.0]), size=values.shape)
            field[...] = (values * factors).astype(np.float16).view(np.uint8).reshape(field.shape)
        else:  # subnormals 2^-15 .. 2^-14 (mantissa 0x200 .. 0x3FF), the stored sign kept
            bits = rng.integers(0x200, 0x400, size=values.shape, dtype=np.uint16) | (np.signbit(values) << 15)
            field[...] = bits.astype(np.uint16).view(np.uint8).reshape(field.shape)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", QUANT_32 + QUANT_256)
def test_negative_zero_huge_and_subnormal_block_scales_match_gguf(variant: str, type_name: str) -> None:
    """Block scales no quantizer writes but a GGUF file may hold (negative or zero d and dmin,
    fp16 subnormals, values 2^10 larger): the kernels agree with gguf.quants' weights."""
    E, H, I = 4, 512, 256
    for mode in ("mixed", "subnormal"):
        rng = np.random.default_rng(40)
        raws = [extreme_scale_blocks(type_name, E * rows, k, rng, mode) for rows, k in ((I, H), (I, H), (H, I))]
        blob = _C.gguf_experts_from_blocks(*(torch.from_numpy(r.reshape(-1).copy()) for r in raws),
                                           [int(T[type_name])] * 3, E, H, I)
        weights = [dequantize(r, type_name, (E, rows, k)) for r, (rows, k) in zip(raws, ((I, H), (I, H), (H, I)))]
        x = torch.randn(9, H, generator=torch.Generator().manual_seed(41))
        ids, topk_weights = random_routing(9, E, 2, seed=42)
        out = kt_ops.moe_forward(x, ids, topk_weights, blob)
        tight = reference.moe_forward(x, ids, topk_weights, *weights,
                                      quantize_activations=reference.gguf_activation_blocks(blob))
        assert tight.abs().max() > 0, mode  # the subnormal scales did not all flush to zero
        assert rel_err(out, tight) <= 1e-3, (mode, rel_err(out, tight))


def test_a_numpy_layer_index_loads_as_kt_moe_wrapper_takes_it(tmp_path) -> None:
    """``layer_idx: int``: numpy's integers too (KTMoEWrapper takes them); a bool is refused."""
    E, H, I = 4, 256, 256
    layers = model_layers(("Q8_0", "Q8_0", "Q8_0"), 2, E, H, I, seed=5)
    path = tmp_path / "m.gguf"
    write_model(path, layers, E, H, I)
    check_layer_from_file(kt_ops.load_gguf_experts(path, np.int64(1)), layers[1], E, H, I)
    assert kt_ops.load_gguf_expert_biases(path, np.int32(1)) == (None, None, None)
    with pytest.raises(TypeError, match="layer_idx must be an int"):
        kt_ops.load_gguf_experts(path, True)


def test_load_gguf_experts_refuses_a_copy_switch_that_is_not_a_bool(tmp_path) -> None:
    """``copy: bool``; "no" is truthy: the blocks were read into RAM instead of mapped, silently."""
    E, H, I = 4, 256, 256
    path = tmp_path / "m.gguf"
    write_model(path, model_layers(("Q8_0", "Q8_0", "Q8_0"), 1, E, H, I, seed=6), E, H, I)
    with pytest.raises(ValueError, match="copy must be a bool"):
        kt_ops.load_gguf_experts(path, 0, copy="no")
