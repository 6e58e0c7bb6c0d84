"""Directories written by kt-kernel's converter (AMXINT4 / AMXINT8) read by KTMoEWrapper.

The writer here follows kt-kernel's ``BufferB::_pack_block`` loop by loop (offsets, then
the two 16 x 16 32-bit transposes of each 32-row step; INT4: low nibble column j, high
nibble j + 64 of a 128-column step), and its quantization (INT8 ``d = max|w| / 127``,
INT4 ``d = max|w| / 112`` then rounded to multiples of 16); the reader
(``kt_ops.kt_kernel_weights.untile``) is written from the layout's description instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import rel_err
from safetensors.torch import save_file

import kt_ops
from kt_ops import KTMoEWrapper, reference
from kt_ops.kt_kernel_weights import LAYOUTS, is_kt_kernel_dir, untile

N_STEP = 32


def quantize(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kt-kernel's levels ``int8 [N, K]``, stored scale ``d`` fp32 [N] and dequantized weights."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    if method == "AMXINT8":
        d = amax * torch.tensor(1 / 127, dtype=torch.float32)  # kt-kernel 0.7.2's bits (not amax / 127)
        inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = torch.round(w * inverse[:, None]).clamp(-128, 127).to(torch.int8)
        return q, d, q.float() * d[:, None]
    d = amax / 112.0
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q8 = torch.round(w * inverse[:, None]).clamp(-128, 127).to(torch.int32)
    q = (torch.sign(q8) * (((q8.abs() + 8) & 0xF0) // 16)).to(torch.int8)  # round_4bit_s8, then / 16
    return q, d, q.float() * 16 * d[:, None]


def tile(q: torch.Tensor, method: str) -> torch.Tensor:
    """``_pack_block``'s bytes of levels ``q [n, k]`` (uint8, ``n k bits / 8``)."""
    layout = LAYOUTS[method]
    n, k = q.shape
    int4 = layout.bits == 4
    step = 128 if int4 else 64
    out = torch.zeros(n * k * layout.bits // 8, dtype=torch.uint8)
    for nbb in range(0, n, layout.n_block):
        nbs = min(layout.n_block, n - nbb)
        for kbb in range(0, k, layout.k_block):
            kbs = min(layout.k_block, k - kbb)
            for n_begin in range(0, nbs, N_STEP):
                for k_begin in range(0, kbs, step):
                    at = (nbb * k + kbb * nbs + n_begin * kbs + k_begin * N_STEP) * layout.bits // 8
                    for i in range(N_STEP):
                        row = q[nbb + n_begin + i, kbb + k_begin: kbb + k_begin + step]
                        if int4:
                            u = row.to(torch.int32) & 0xF
                            data = (u[:64] | (u[64:] << 4)).to(torch.uint8)
                        else:
                            data = row.view(torch.uint8)
                        out[at + i * 64: at + (i + 1) * 64] = data
                    for half in range(2):  # transpose_16x16_32bit of each 16-row tile
                        start = at + half * 1024
                        out[start:start + 1024] = out[start:start + 1024].view(16, 16, 4).transpose(0, 1).reshape(-1)
    return out


def write_dir(path: Path, layer: int, weights: tuple[torch.Tensor, ...], method: str, parts: int) -> list:
    """kt-kernel's converted layer in ``path`` (one safetensors file); returns the dequantized
    weights per part ``[(gate, up, down) ...]`` as kt-kernel's kernels see them."""
    gate, up, down = weights
    E, I, H = gate.shape
    width = I // parts
    tensors, dequantized = {}, []
    for p in range(parts):
        cols = slice(p * width, (p + 1) * width)
        part = {"gate": gate[:, cols], "up": up[:, cols], "down": down[:, :, cols]}
        seen = {}
        for name, matrix in part.items():
            rows = []
            for e in range(E):
                q, d, w = quantize(matrix[e], method)
                key = f"blk.{layer}.ffn_{name}_exps.{e}.numa.{p}"
                tensors[f"{key}.weight"] = tile(q, method)
                tensors[f"{key}.scale"] = d
                rows.append(w)
            seen[name] = torch.stack(rows)
        dequantized.append((seen["gate"], seen["up"], seen["down"]))
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model-00001-of-00001.safetensors"))
    return dequantized


def expected(x, ids, w, parts_weights, mask=None, quantized: bool = False) -> torch.Tensor:
    """The fp32 reference on the file's weights, summed over its parts; ``mask``: slots on the GPU."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for gate, up, down in parts_weights:
        ids_cpu = ids if mask is None else torch.where(mask[ids.clamp(min=0)], -1, ids)
        out += reference.moe_forward(x, ids_cpu, w, gate, up, down, quantize_activations=quantized)
    return out


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
@pytest.mark.parametrize("n,k", [(32, 128), (160, 256), (64, 3584 + 256)])
def test_untile_reads_what_kt_kernel_tiles(method: str, n: int, k: int) -> None:
    """Several row blocks (64 / 128 rows), a partial one, and a second k block past 3584."""
    g = torch.Generator().manual_seed(n + k)
    low, high = (-127, 128) if method == "AMXINT8" else (-7, 8)
    q = torch.randint(low, high, (n, k), generator=g, dtype=torch.int8)
    assert torch.equal(untile(tile(q, method), n, k, LAYOUTS[method]), q)


def weights(E: int, H: int, I: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, I, H, generator=g) / H ** 0.5, torch.randn(E, I, H, generator=g) / H ** 0.5,
            torch.randn(E, H, I, generator=g) / I ** 0.5)


def inputs(T: int, E: int, K: int, H: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, ids, torch.rand(T, K, generator=g)


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
@pytest.mark.parametrize("parts,tokens", [(1, 7), (2, 7), (1, 40)])
def test_wrapper_reads_a_kt_kernel_directory(tmp_path: Path, method: str, parts: int, tokens: int) -> None:
    """KTMoEWrapper(method, weight_path=kt-kernel's output, threadpool_count=its parts):
    the layer computes the file's weights (the fp32 reference on them, summed over the
    parts as kt-kernel sums them), with a GPU mask and a physical-to-logical map."""
    E, K, H, I = 6, 2, 256, 256
    per_part = write_dir(tmp_path, 3, weights(E, H, I), method, parts)
    assert is_kt_kernel_dir(tmp_path)
    x, ids, w = inputs(tokens, E, K, H)
    wrapper = KTMoEWrapper(3, E, K, H, I, method=method, weight_path=tmp_path, threadpool_count=parts)
    wrapper.load_weights()
    assert [p.format for p in wrapper._parts] == [{"AMXINT8": "int8", "AMXINT4": "int4"}[method]] * parts
    for packed, file_weights in zip(wrapper._parts, per_part):  # the file's weights, bit for bit
        for got_matrix, want in zip(kt_ops.dequantize_experts(packed), file_weights):
            assert torch.equal(got_matrix.float(), want)
    got = wrapper.forward(x, ids, w)
    # The kernels' only rounding is their int8 activations (the reference's quantize_activations).
    assert rel_err(got, expected(x, ids, w, per_part, quantized=True)) <= 1e-5
    assert rel_err(got, expected(x, ids, w, per_part)) <= 3e-2
    mapping = torch.tensor([5, 4, 3, 2, 1, 0])
    mask = torch.zeros(E, dtype=torch.bool)
    mask[1] = True
    mapped = KTMoEWrapper(3, E, K, H, I, gpu_experts_mask=mask, method=method, weight_path=tmp_path,
                          threadpool_count=parts)
    mapped.load_weights(mapping)
    logical = [(g[mapping], u[mapping], d[mapping]) for g, u, d in per_part]
    assert rel_err(mapped.forward(x, ids, w), expected(x, ids, w, logical, mask, quantized=True)) <= 1e-5


def test_the_wrong_method_or_part_count_is_named(tmp_path: Path) -> None:
    E, K, H, I = 4, 2, 128, 128
    write_dir(tmp_path, 0, weights(E, H, I), "AMXINT8", 1)
    with pytest.raises(ValueError, match="use method='AMXINT8'"):
        KTMoEWrapper(0, E, K, H, I, method="AMXINT4", weight_path=tmp_path).load_weights()
    with pytest.raises(ValueError, match="threadpool_count=1"):
        KTMoEWrapper(0, E, K, H, I, method="AMXINT8", weight_path=tmp_path, threadpool_count=2).load_weights()
    with pytest.raises(ValueError, match="cannot read them"):
        KTMoEWrapper(0, E, K, H, I, method="BF16", weight_path=tmp_path).load_weights()
    with pytest.raises(ValueError, match="no kt-kernel experts of layer 5"):
        KTMoEWrapper(5, E, K, H, I, method="AMXINT8", weight_path=tmp_path).load_weights()
    assert KTMoEWrapper(0, E, K, H, I, method=None, weight_path=tmp_path).method == "AMXINT8"  # detected
    with pytest.raises(ValueError, match="1 NUMA part\\(s\\) of 128 rows each, not moe_intermediate_size 256"):
        KTMoEWrapper(0, E, K, H, 2 * I, method="AMXINT8", weight_path=tmp_path).load_weights()
    with pytest.raises(ValueError, match="down projections of 128 rows, not hidden_size 256"):
        KTMoEWrapper(0, E, K, 2 * H, I, method="AMXINT8", weight_path=tmp_path).load_weights()


DATA = Path(__file__).parent / "data" / "kt_kernel"
# Written by kt-kernel 0.7.2 (its converter's AMX path, tests/data/kt_kernel/README.md):
# layer 1, E = 2, top-2, H = 128, two NUMA parts; (method, I).
KT_KERNEL_CASES = {"int4_numa2": ("AMXINT4", 256), "int8_numa2": ("AMXINT8", 128)}


def kt_kernel_source(E: int, H: int, I: int) -> tuple[torch.Tensor, ...]:
    """The bf16 weights the fixtures were converted from, drawn again as their script drew
    them (torch.manual_seed(0); gate, up [E, I, H] / sqrt(H), down [E, H, I] / sqrt(I))."""
    torch.manual_seed(0)
    gate = (torch.randn(E, I, H) / H**0.5).bfloat16()
    up = (torch.randn(E, I, H) / H**0.5).bfloat16()
    down = (torch.randn(E, H, I) / I**0.5).bfloat16()
    return gate, up, down


@pytest.mark.parametrize("case", sorted(KT_KERNEL_CASES))
def test_files_written_by_kt_kernel(case: str) -> None:
    """kt-kernel's own output: the un-tiled levels and scales are kt-kernel's quantization of
    the source weights bit for bit (both parts, every matrix), and the wrapper's output is
    kt-kernel's forward on the same inputs within their different roundings (kt-kernel rounds
    g, u, h and each expert's output to bf16; we keep fp32 and quantize activations per row)."""
    from safetensors.torch import load_file

    method, I = KT_KERNEL_CASES[case]
    E, K, H, parts = 2, 2, 128, 2
    path = DATA / case
    stored = load_file(str(path / "model.safetensors"))
    source = kt_kernel_source(E, H, I)
    width = I // parts
    per_part = []
    for p in range(parts):
        cols = slice(p * width, (p + 1) * width)
        matrices = {"gate": source[0][:, cols], "up": source[1][:, cols], "down": source[2][:, :, cols]}
        dequantized = {}
        for name, matrix in matrices.items():
            rows = []
            for e in range(E):
                q, d, w = quantize(matrix[e], method)
                key = f"blk.1.ffn_{name}_exps.{e}.numa.{p}"
                assert torch.equal(untile(stored[f"{key}.weight"], *q.shape, LAYOUTS[method]), q), key
                assert torch.equal(stored[f"{key}.scale"], d), key
                rows.append(w)
            dequantized[name] = torch.stack(rows)
        per_part.append((dequantized["gate"], dequantized["up"], dequantized["down"]))
    io = load_file(str(path / "io.safetensors"))
    x, ids, w = io["x"], io["topk_ids"], io["topk_weights"]
    assert KTMoEWrapper(1, E, K, H, I, method=None, weight_path=path, threadpool_count=parts).method == method
    wrapper = KTMoEWrapper(1, E, K, H, I, method=method, weight_path=path, threadpool_count=parts)
    wrapper.load_weights()
    for packed, file_weights in zip(wrapper._parts, per_part):  # what the kernels multiply: the file's weights
        for got_matrix, want in zip(kt_ops.dequantize_experts(packed), file_weights):
            assert torch.equal(got_matrix.float(), want)
    # fp32 rows out: only the int8 activations round. Not 1e-5: at these inputs an intermediate
    # value of the int4 case sits near a rounding tie of its int8 level, and the reference's
    # fp32 sums (another order) round it the other way (3e-3; 1e-7 with x perturbed by 1e-6).
    exact = wrapper.forward(x.float(), ids, w)
    assert rel_err(exact, expected(x, ids, w, per_part, quantized=True)) <= 6e-3
    got = wrapper.forward(x, ids, w).float()  # bf16 in and out, as kt-kernel ran
    assert rel_err(got, io["y"].float()) <= 2e-2  # 0.8-0.9 % measured (Xeon with AMX, 2026-12-06)


def test_inspect_names_a_kt_kernel_directory() -> None:
    """kt-ops inspect said "no routed-expert tensors" for kt-kernel's converted directories."""
    from kt_ops.inspection import inspect_weights

    for case, (method, I) in KT_KERNEL_CASES.items():
        result = inspect_weights(DATA / case)
        assert result.kind == "kt-kernel converted directory"
        stated = dict(result.facts)["method"]
        assert stated.startswith(f"{method} (") and "threadpool_count=2" in stated
        (layer,) = result.layers
        assert (layer.layer, layer.num_experts, layer.hidden_size, layer.intermediate_size) == (1, 2, 128, I)
        file = (DATA / case / "model.safetensors").read_bytes()
        assert layer.nbytes == len(file) - 8 - int.from_bytes(file[:8], "little")  # every tensor's bytes


def write_kt_files(source: Path, out: Path, method: str) -> None:
    """The layer folders of kt-kernel's ``--no-merge-safetensor`` from a merged fixture:
    ``_layer_{L}/_numa_{p}/{INT4|INT8}_{proj}_{e}_{N}Byte_{quant|scale}_.kt`` holding each
    tensor's bytes (the names kt-kernel 0.7.2 wrote for these fixtures, e.g.
    ``_layer_1/_numa_1/INT8_gate_1_8192Byte_quant_.kt``)."""
    from safetensors.torch import load_file

    prefix = method.removeprefix("AMX")
    for key, tensor in load_file(str(source / "model.safetensors")).items():
        _, layer, proj, expert, _, part, kind = key.split(".")
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        folder = out / f"_layer_{layer}" / f"_numa_{part}"
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{prefix}_{proj.removeprefix('ffn_').removesuffix('_exps')}_{expert}_{len(data)}Byte_"
        (folder / f"{name}{'quant' if kind == 'weight' else 'scale'}_.kt").write_bytes(data)


@pytest.mark.parametrize("case", sorted(KT_KERNEL_CASES))
def test_unmerged_kt_files_load_as_the_merged_directory(tmp_path: Path, case: str) -> None:
    """kt-kernel's --no-merge-safetensor output (layer folders of .kt files) is read as its
    merged safetensors; a .kt file whose size is not the one its name states is refused."""
    method, I = KT_KERNEL_CASES[case]
    write_kt_files(DATA / case, tmp_path, method)
    assert is_kt_kernel_dir(tmp_path)
    x, ids, w = inputs(6, 2, 2, 128)
    outputs = []
    for path in (DATA / case, tmp_path):
        wrapper = KTMoEWrapper(1, 2, 2, 128, I, method=method, weight_path=path, threadpool_count=2)
        wrapper.load_weights()
        outputs.append(wrapper.forward(x, ids, w))
    assert torch.equal(*outputs)
    victim = next((tmp_path / "_layer_1" / "_numa_1").glob("*_down_1_*quant_.kt"))
    victim.write_bytes(victim.read_bytes()[:-64])
    with pytest.raises(ValueError, match="truncated or not kt-kernel's"):
        KTMoEWrapper(1, 2, 2, 128, I, method=method, weight_path=tmp_path, threadpool_count=2).load_weights()


def test_scale_bytes_that_are_no_fp32_values_are_named(tmp_path: Path) -> None:
    """A .kt scale file (or uint8 scale tensor) of a byte count that is no multiple of 4 raised
    torch's RuntimeError ("must be divisible by 4 to view Byte as Float")."""
    E, K, H, I = 2, 2, 128, 128
    write_dir(tmp_path, 0, weights(E, H, I), "AMXINT8", 1)
    (tmp_path / "model-00001-of-00001.safetensors").rename(tmp_path / "model.safetensors")
    write_kt_files(tmp_path, tmp_path / "kt", "AMXINT8")
    scale = next((tmp_path / "kt" / "_layer_0" / "_numa_0").glob("INT8_up_1_*scale_.kt"))
    scale.unlink()
    (scale.parent / "INT8_up_1_254Byte_scale_.kt").write_bytes(bytes(254))
    with pytest.raises(ValueError, match="ffn_up_exps.1.numa.0.scale holds 254 bytes, not fp32 scales"):
        KTMoEWrapper(0, E, K, H, I, method="AMXINT8", weight_path=tmp_path / "kt").load_weights()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_scale_tensor_of_integers_is_refused_naming_it(tmp_path: Path, dtype: torch.dtype) -> None:
    """A safetensors .scale tensor stored as integers (its header saying I32 where kt-kernel writes F32): its
    integer values were converted to float and used as the row scales, a silent wrong layer (1.0's bits read as
    1065353216). A ValueError naming the tensor and its dtype; float dtypes still load."""
    from safetensors.torch import load_file, save_file

    E, K, H, I = 2, 2, 128, 128
    write_dir(tmp_path, 0, weights(E, H, I), "AMXINT8", 1)
    shard = tmp_path / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    key = "blk.0.ffn_up_exps.1.numa.0.scale"
    tensors[key] = tensors[key].view(torch.int32).to(dtype)
    save_file(tensors, shard)
    with pytest.raises(ValueError, match=rf"{key} is {str(dtype).removeprefix('torch.')}; .*float"):
        KTMoEWrapper(0, E, K, H, I, method="AMXINT8", weight_path=tmp_path).load_weights()


def test_int4_and_int8_kt_files_in_one_folder_are_read_by_the_method(tmp_path: Path) -> None:
    """A directory converted twice (AMXINT4, then AMXINT8) holds INT4_... and INT8_... .kt files
    of each tensor; kt-kernel reads the method's. AMXINT4 read the INT8 files and was refused
    ("use method='AMXINT8'")."""
    E, K, H, I = 2, 2, 128, 256
    per_method = {}
    for method in ("AMXINT4", "AMXINT8"):
        per_method[method] = write_dir(tmp_path / method, 0, weights(E, H, I), method, 2)
        (tmp_path / method / "model-00001-of-00001.safetensors").rename(tmp_path / method / "model.safetensors")
        write_kt_files(tmp_path / method, tmp_path / "both", method)
    x, ids, w = inputs(4, E, K, H)
    for method, per_part in per_method.items():
        wrapper = KTMoEWrapper(0, E, K, H, I, method=method, weight_path=tmp_path / "both", threadpool_count=2)
        wrapper.load_weights()
        assert rel_err(wrapper.forward(x, ids, w), expected(x, ids, w, per_part, quantized=True)) <= 1e-5


def test_method_none_on_int4_and_int8_kt_files_in_one_folder_asks_for_the_method(tmp_path: Path) -> None:
    """method=None on a folder converted twice (INT4_... and INT8_... files of each tensor)
    silently read the INT8 files (the last listed); now a ValueError asks for the method, and
    kt-ops inspect says the same."""
    from kt_ops.inspection import inspect_weights

    E, K, H, I = 2, 2, 128, 256
    for method in ("AMXINT4", "AMXINT8"):
        write_dir(tmp_path / method, 0, weights(E, H, I), method, 2)
        (tmp_path / method / "model-00001-of-00001.safetensors").rename(tmp_path / method / "model.safetensors")
        write_kt_files(tmp_path / method, tmp_path / "both", method)
    message = r"both INT4_ and INT8_ \.kt files .*pass method='AMXINT4' or method='AMXINT8'"
    with pytest.raises(ValueError, match=message):
        KTMoEWrapper(0, E, K, H, I, method=None, weight_path=tmp_path / "both", threadpool_count=2)
    with pytest.raises(ValueError, match=message):
        inspect_weights(tmp_path / "both")


def test_a_wrong_hidden_size_is_named_not_taken_for_the_other_method() -> None:
    """An AMXINT8 folder read with hidden_size 2H: its gate's bytes are those of AMXINT4 [I, 2H],
    and the message said "use method='AMXINT4'"; now it names hidden_size."""
    with pytest.raises(ValueError, match="down projections of 128 rows, not hidden_size 256") as caught:
        KTMoEWrapper(1, 2, 2, 256, 128, method="AMXINT8", weight_path=DATA / "int8_numa2",
                     threadpool_count=2).load_weights()
    assert "AMXINT4" not in str(caught.value)


def test_loading_a_layer_lists_only_its_kt_folder(tmp_path: Path) -> None:
    """Each layer's load listed every layer's .kt files (three times: ~10^5 files of a model's
    folders per layer, O(layers^2) for the model); now its own folder's, other layers named in
    the message for a missing one."""
    from kt_ops.kt_kernel_weights import KtKernelDir

    write_kt_files(DATA / "int8_numa2", tmp_path, "AMXINT8")
    other = tmp_path / "_layer_7" / "_numa_0"
    other.mkdir(parents=True)
    (other / "INT8_up_0_4Byte_scale_.kt").write_bytes(bytes(4))
    directory = KtKernelDir(tmp_path, "AMXINT8", 1)
    assert directory.layer_shape(1) == (2, 2)
    assert all(key.startswith("blk.1.") for key in directory.files)
    with pytest.raises(ValueError, match=r"no kt-kernel experts of layer 3 \(layers: 1, 7\)"):
        KtKernelDir(tmp_path, "AMXINT8", 3).layer_shape(3)
    wrapper = KTMoEWrapper(1, 2, 2, 128, 128, method="AMXINT8", weight_path=tmp_path, threadpool_count=2)
    wrapper.load_weights()
    x, ids, w = inputs(3, 2, 2, 128)
    reference_wrapper = KTMoEWrapper(1, 2, 2, 128, 128, method="AMXINT8", weight_path=DATA / "int8_numa2",
                                     threadpool_count=2)
    reference_wrapper.load_weights()
    assert torch.equal(wrapper.forward(x, ids, w), reference_wrapper.forward(x, ids, w))


def test_an_int8_level_of_minus_128_is_read_as_minus_128(tmp_path: Path) -> None:
    """kt-kernel's quantizer writes -127 ... 127, but -128 is an int8 level its kernels
    multiply as such; it was refused as a corrupt file (naming no file tensor, at first)."""
    from safetensors.torch import load_file

    write_dir(tmp_path, 0, weights(3, 128, 128), "AMXINT8", 2)
    file = tmp_path / "model-00001-of-00001.safetensors"
    tensors = load_file(str(file))
    key = "blk.0.ffn_down_exps.2.numa.1.weight"
    before = KTMoEWrapper(0, 3, 2, 128, 128, method="AMXINT8", weight_path=tmp_path, threadpool_count=2)
    before.load_weights()
    tensors[key] = tensors[key].clone()
    old = int(tensors[key][100].to(torch.int8))
    tensors[key][100] = 0x80  # the level -128
    save_file(tensors, str(file))
    after = KTMoEWrapper(0, 3, 2, 128, 128, method="AMXINT8", weight_path=tmp_path, threadpool_count=2)
    after.load_weights()
    dense = [[reference.dequantize(part.data) for part in w._parts] for w in (before, after)]
    changed = [(dense[1][1][m] - dense[0][1][m]).nonzero().tolist() for m in range(3)]
    assert changed[0] == changed[1] == [] and len(changed[2]) == 1  # one down weight of part 1
    e, n, k = changed[2][0]
    assert e == 2 and old != 0
    assert torch.isclose(dense[1][1][2][e, n, k], dense[0][1][2][e, n, k] * (-128 / old), rtol=1e-6)


def test_inspect_of_layers_of_different_methods_names_no_mixed_method(tmp_path: Path) -> None:
    """Layers of AMXINT8 (one part) and AMXINT4 (two parts) were described as read by
    KTMoEWrapper(method='AMXINT4/AMXINT8', threadpool_count=1/2) "as format int4"."""
    from kt_ops.inspection import inspect_weights

    write_dir(tmp_path / "a", 0, weights(2, 128, 256), "AMXINT8", 1)
    write_dir(tmp_path / "b", 1, weights(2, 128, 256), "AMXINT4", 2)
    (tmp_path / "b" / "model-00001-of-00001.safetensors").rename(tmp_path / "a" / "model-00002-of-00002.safetensors")
    result = inspect_weights(tmp_path / "a")
    stated = dict(result.facts)["method"]
    assert "method='AMXINT4/AMXINT8'" not in stated and "as format int4)" not in stated
    assert "each read by KTMoEWrapper with its own method" in stated
    assert [m.type for layer in result.layers for m in layer.matrices] == ["int8"] * 3 + ["int4"] * 3


def test_fifos_are_not_waited_on(tmp_path: Path) -> None:
    """A FIFO named like a shard next to kt-kernel's files (and a FIFO .kt file): opening
    it to read a header waited for ever (kt-ops inspect of any directory holding one hung).
    In a subprocess with a timeout, so that a hang fails."""
    import os
    import shutil
    import subprocess
    import sys

    merged, unmerged = tmp_path / "merged", tmp_path / "unmerged"
    shutil.copytree(DATA / "int8_numa2", merged)
    os.mkfifo(merged / "zz.safetensors")
    write_kt_files(DATA / "int8_numa2", unmerged, "AMXINT8")
    victim = next((unmerged / "_layer_1" / "_numa_0").glob("INT8_up_0_*quant_.kt"))
    victim.unlink()
    os.mkfifo(victim)
    code = f"""
from kt_ops import KTMoEWrapper
from kt_ops.inspection import inspect_weights
print(inspect_weights({str(merged)!r}).kind)
KTMoEWrapper(1, 2, 2, 128, 128, method="AMXINT8", weight_path={str(merged)!r}, threadpool_count=2).load_weights()
try:
    KTMoEWrapper(1, 2, 2, 128, 128, method="AMXINT8", weight_path={str(unmerged)!r}, threadpool_count=2).load_weights()
except ValueError as error:
    print("refused" if "not a regular file" in str(error) else error)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["kt-kernel converted directory", "refused"], done.stdout


def test_a_key_in_two_shards_is_refused_naming_both(tmp_path: Path) -> None:
    """A tensor stored in two safetensors shards (two conversions' outputs copied into one
    folder) was taken silently from the later file, whichever it held; now a ValueError
    naming the key and both files, when loading, detecting the method and inspecting."""
    from kt_ops.inspection import inspect_weights
    from kt_ops.wrappers.kt_moe_wrapper import detect_method

    E, K, H, I = 2, 2, 128, 128
    write_dir(tmp_path / "int4", 0, weights(E, H, I), "AMXINT4", 1)
    write_dir(tmp_path, 0, weights(E, H, I), "AMXINT8", 1)
    (tmp_path / "int4" / "model-00001-of-00001.safetensors").rename(tmp_path / "other.safetensors")
    pattern = r"blk\.0\.ffn_\w+_exps\.\d\.numa\.0\.\w+ is in both .*model-00001-of-00001\.safetensors and .*other"
    with pytest.raises(ValueError, match=pattern):
        KTMoEWrapper(0, E, K, H, I, method="AMXINT8", weight_path=tmp_path).load_weights()
    with pytest.raises(ValueError, match=pattern):
        detect_method(tmp_path, 0)
    with pytest.raises(ValueError, match=pattern):
        inspect_weights(tmp_path)


def test_a_missing_last_part_folder_is_not_blamed_on_threadpool_count(tmp_path: Path) -> None:
    """Of a two-part --no-merge-safetensor layer whose _numa_1 folder is gone, the wrapper said
    "converted by kt-kernel for 1 NUMA part(s); construct the wrapper with threadpool_count=1",
    which then failed on the weights' sizes; now it says the parts cover half the layer."""
    import shutil

    write_kt_files(DATA / "int8_numa2", tmp_path, "AMXINT8")
    shutil.rmtree(tmp_path / "_layer_1" / "_numa_1")
    with pytest.raises(ValueError, match=r"1 NUMA part\(s\) of 64 rows.*moe_intermediate_size 128.*missing"):
        KTMoEWrapper(1, 2, 2, 128, 128, method="AMXINT8", weight_path=tmp_path, threadpool_count=2).load_weights()
    with pytest.raises(ValueError, match=r"1 NUMA part\(s\) of 64 rows.*moe_intermediate_size 128.*missing"):
        KTMoEWrapper(1, 2, 2, 128, 128, method="AMXINT8", weight_path=tmp_path, threadpool_count=1).load_weights()


def test_scales_stored_in_another_float_dtype_are_counted_as_values(tmp_path: Path) -> None:
    """Scales of a safetensors file in bf16 (not kt-kernel's fp32) are read as their values;
    the part check counted their bytes / 4 (half the rows) and refused the layer, as method=None
    detection and kt-ops inspect did (H and I halved: "neither AMXINT8 nor AMXINT4")."""
    from safetensors.torch import load_file

    from kt_ops.inspection import inspect_weights

    write_dir(tmp_path, 0, weights(2, 128, 128), "AMXINT8", 2)
    file = tmp_path / "model-00001-of-00001.safetensors"
    tensors = load_file(str(file))
    for key in [k for k in tensors if k.endswith(".scale")]:
        tensors[key] = tensors[key].bfloat16()
    save_file(tensors, str(file))
    wrapper = KTMoEWrapper(0, 2, 2, 128, 128, method="AMXINT8", weight_path=tmp_path, threadpool_count=2)
    wrapper.load_weights()
    assert wrapper.forward(*inputs(2, 2, 2, 128)).isfinite().all()
    assert KTMoEWrapper(0, 2, 2, 128, 128, method=None, weight_path=tmp_path, threadpool_count=2).method == "AMXINT8"
    (layer,) = inspect_weights(tmp_path).layers
    assert (layer.hidden_size, layer.intermediate_size) == (128, 128)


def test_a_damaged_shard_is_named(tmp_path: Path) -> None:
    """A cut-short safetensors file next to kt-kernel's shard raised safetensors' own
    SafetensorError ("invalid header length"), naming no file; kt-ops inspect printed a
    traceback. Now a ValueError naming the file."""
    import shutil
    import subprocess
    import sys

    shutil.copy(DATA / "int8_numa2" / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "zz.safetensors").write_bytes((DATA / "int8_numa2" / "model.safetensors").read_bytes()[:100])
    with pytest.raises(ValueError, match="zz.safetensors"):
        KTMoEWrapper(1, 2, 2, 128, 128, method="AMXINT8", weight_path=tmp_path, threadpool_count=2).load_weights()
    with pytest.raises(ValueError, match="zz.safetensors"):
        KTMoEWrapper(1, 2, 2, 128, 128, method=None, weight_path=tmp_path, threadpool_count=2)
    done = subprocess.run([sys.executable, "-m", "kt_ops", "inspect", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "zz.safetensors" in done.stderr
