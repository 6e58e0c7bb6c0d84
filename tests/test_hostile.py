"""Hostile and unlucky inputs: the place new cases go.

Each case is what a downloaded file, a careless caller or an attacker can hand kt_ops;
the contract is a clear exception (``ValueError`` for bad values) or the right answer —
never a crash, a hang or a silent wrong result. Cases that could crash the interpreter
run in a subprocess (``python tests/test_hostile.py <case>``), so a crash fails the test
instead of killing the run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# Header fields (csrc/cpu/formats/packed_header.cpp, Field): (offset, bytes).
FIELDS = [(8, 4), (12, 4), (16, 4), (20, 4), (24, 4), (28, 4), (32, 4), (40, 8), (48, 8), (56, 8), (64, 8), (72, 8),
          (80, 4), (84, 4), (88, 4), (96, 8), (104, 8), (112, 8), (120, 8), (128, 8), (136, 8), (144, 4), (148, 4),
          (152, 4), (160, 8), (168, 4)]
EDGES = [0, 1, 2, 3, 7, 16, 31, 32, 64, 255, 256, 0x7FFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 2**32,
         2**40 + 64, 2**60, 2**63, 2**64 - 1, 2**64 - 256, 0x7FC00000, 0xFF800000]


def rechecksum(blob: torch.Tensor) -> None:
    """FNV-1a over the header's first 248 bytes into bytes 248..255 (anyone can do it:
    the checksum catches accidents, not attackers)."""
    h = 1469598103934665603
    for byte in blob[:248].tolist():
        h = ((h ^ byte) * 1099511628211) & (2**64 - 1)
    blob[248:256] = torch.tensor(list(h.to_bytes(8, "little")), dtype=torch.uint8)


def put(blob: torch.Tensor, offset: int, size: int, value: int) -> None:
    value &= (1 << (8 * size)) - 1
    blob[offset:offset + size] = torch.tensor(list(value.to_bytes(size, "little")), dtype=torch.uint8)


def sample_blobs() -> dict[str, torch.Tensor]:
    import kt_ops

    g = torch.Generator().manual_seed(0)
    E, H, I = 3, 64, 64
    gate, up, down = torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g)
    biases = (torch.randn(E, I, generator=g), None, torch.randn(E, H, generator=g))
    blobs = {
        method: kt_ops.pack_experts(gate, up, down, method=method).data
        for method in ("BF16", "AMXINT8", "FP8", "FP8_PERCHANNEL", "MXFP8")
    }
    blobs["AMXINT4"] = kt_ops.pack_experts(gate, up, down, method="AMXINT4", group_size=32).data
    blobs["AMXINT4-zp"] = kt_ops.pack_experts(gate, up, down, method="AMXINT4", group_size=32, zero_point=True).data
    blobs["Q4_K"] = kt_ops.pack_experts(torch.randn(E, I, 256), torch.randn(E, I, 256), torch.randn(E, 256, I),
                                        method="LLAMAFILE", gguf_type="Q8_0").data
    blobs["BF16-glu"] = kt_ops.pack_experts(gate, up, down, method="BF16", swiglu_limit=7.0, swiglu_alpha=1.7,
                                            biases=biases).data
    blobs["Q8_0-glu"] = kt_ops.pack_experts(gate, up, down, method="LLAMAFILE", gguf_type="Q8_0", biases=biases).data
    return blobs


def fuzz_headers() -> int:
    """Every header field of every format set to every edge value (checksum recomputed):
    constructing the blob raises ValueError or succeeds, and a blob that is accepted runs."""
    import kt_ops

    accepted = refused = 0
    for name, blob in sample_blobs().items():
        for offset, size in FIELDS:
            for value in EDGES:
                forged = blob.clone()
                put(forged, offset, size, value)
                rechecksum(forged)
                try:
                    packed = kt_ops.PackedExperts(forged)
                except ValueError:
                    refused += 1
                    continue
                accepted += 1
                T, K = 3, min(2, packed.num_experts)
                x = torch.randn(T, packed.hidden_size)
                ids = torch.randint(0, packed.num_experts, (T, K))
                out = kt_ops.moe_forward(x, ids, torch.rand(T, K), packed)
                assert out.shape == (T, packed.hidden_size), (name, offset, value)
    print(f"accepted {accepted} refused {refused}")
    return 0


def run_case(case: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(Path(__file__)), case], capture_output=True, text=True, timeout=600,
                          cwd=HERE.parent)


def test_header_fuzz_raises_only_value_errors() -> None:
    result = run_case("fuzz_headers")
    assert result.returncode == 0, f"rc {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    accepted, refused = (int(v) for v in result.stdout.split()[1::2])
    assert refused > 1000 and accepted > 0  # the mutations reached the checks


def test_sizes_that_wrap_around_are_refused(tmp_path: Path) -> None:
    """A 256-byte blob whose E * expert bytes wraps around 2^64, saved as a file and
    opened (issue 23, case 1): a ValueError, not a crash."""
    result = run_case("wrapping_sizes")
    assert result.returncode == 0, f"rc {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert "refused" in result.stdout


def wrapping_sizes() -> int:
    import tempfile

    import kt_ops

    blob = sample_blobs()["BF16"][:256].clone()
    # H = I = 2^31 - 1, E chosen so that the product wraps to a small number mod 2^64
    for E, H, I in [(0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF), (1 << 30, 0x40000000, 0x40000000), (16, 1 << 30, 1 << 30)]:
        forged = blob.clone()
        put(forged, 16, 4, E)
        put(forged, 20, 4, H)
        put(forged, 24, 4, I)
        put(forged, 72, 8, 256)  # total bytes: the blob's own size
        rechecksum(forged)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "layer.safetensors"
            from safetensors.torch import save_file

            from kt_ops.packed import _METADATA

            save_file({"packed": forged}, str(path), metadata=_METADATA)
            try:
                kt_ops.PackedExperts.load(str(path))
            except ValueError as error:
                assert "exceed" in str(error) or "disagree" in str(error), error
                print("refused", E, H, I)
                continue
            raise AssertionError(f"accepted E={E} H={H} I={I}")
    return 0



# ---- non-finite values (issue 23, case 4) ------------------------------------------------

import pytest  # noqa: E402
from format_cases import FormatCase, format_cases  # noqa: E402

CASES = format_cases(min_hidden=64, min_intermediate=48)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_non_finite_activation_poisons_its_own_row_only(case: FormatCase, variant: str) -> None:
    """NaN or inf in one token's hidden state: that token's output row is entirely
    non-finite, every other row is finite and bit-identical to a call without it."""
    import kt_ops

    g = torch.Generator().manual_seed(1)
    E, T = 4, 6
    gate = torch.randn(E, case.intermediate, case.hidden, generator=g) / case.hidden**0.5
    up = torch.randn(E, case.intermediate, case.hidden, generator=g) / case.hidden**0.5
    down = torch.randn(E, case.hidden, case.intermediate, generator=g) / case.intermediate**0.5
    packed = case.pack(gate, up, down)
    x = torch.randn(T, case.hidden, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    weights = torch.rand(T, 2, generator=g)
    clean = kt_ops.moe_forward(x, ids, weights, packed)
    bad = x.clone()
    bad[1, 5] = float("nan")
    bad[4, case.hidden - 1] = float("inf")
    out = kt_ops.moe_forward(bad, ids, weights, packed)
    for row in (1, 4):
        assert not torch.isfinite(out[row]).any(), f"row {row}: {out[row][:8]}"
    others = [0, 2, 3, 5]
    assert torch.equal(out[others], clean[others])


@pytest.mark.parametrize("method", ["BF16", "AMXINT8", "AMXINT4", "FP8", "LLAMAFILE"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_pack_experts_refuses_non_finite_weights(method: str, value: float) -> None:
    import kt_ops

    E, H, I = 3, 64, 64
    weights = [torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)]
    weights[2][1, 17, 4] = value
    extra = {"gguf_type": "Q8_0"} if method == "LLAMAFILE" else {"group_size": 32} if method == "AMXINT4" else {}
    with pytest.raises(ValueError, match=f"down_proj: expert 1, row 17 holds {value}"):
        kt_ops.pack_experts(*weights, method=method, **extra)
    weights[2][1, 17, 4] = 0.0
    kt_ops.pack_experts(*[w.bfloat16() for w in weights], method=method, **extra)  # finite: packs
    with pytest.raises(ValueError, match="up_proj is on the meta device"):  # no values to quantize
        kt_ops.pack_experts(weights[0], weights[1].to("meta"), weights[2], method=method, **extra)


@pytest.mark.parametrize("method,extra,low,high", [
    ("LLAMAFILE", {"gguf_type": "F16"}, -1.0, 7e4),  # F16 stores 65504 at most
    ("LLAMAFILE", {"gguf_type": "Q8_0"}, -1.0, 1e7),  # its fp16 block scale max/127 overflows
    ("LLAMAFILE", {"gguf_type": "Q4_1"}, -1e5, 0.5),  # its fp16 block minimum overflows
    ("LLAMAFILE", {"gguf_type": "Q4_K"}, -3e38, 3e38),
    ("BF16", {}, -1.0, 3.4e38),  # rounds to bf16 infinity
    ("AMXINT4", {"group_size": 32, "zero_point": True}, -3e38, 3e38),  # max - min overflows fp32
])
def test_pack_experts_refuses_finite_weights_its_format_cannot_hold(method: str, extra: dict, low: float,
                                                                   high: float) -> None:
    """A finite weight beyond the format's range was packed as infinity or NaN (GGUF: the
    whole block NaN), so every token routed to that expert got NaN outputs; now a
    ValueError naming the matrix and expert, as for non-finite weights. |w| <= 65504 packs
    finite in every format."""
    import kt_ops

    E, H, I = 3, 256, 256
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g)]
    weights[2][1, 17, 4], weights[2][1, 17, 5] = high, low
    with pytest.raises(ValueError, match="down_proj: expert 1 holds weights up to"):
        kt_ops.pack_experts(*weights, method=method, **extra)
    weights[2][1, 17, 4], weights[2][1, 17, 5] = 65504.0, -65504.0
    packed = kt_ops.pack_experts(*weights, method=method, **extra)
    assert all(bool(torch.isfinite(m).all()) for m in kt_ops.dequantize_experts(packed))


# ---- memory (issue 23, case 9) -----------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def scratch_given_back() -> int:
    """One call whose scratch is ~0.5 GiB, then RSS is measured again."""
    import gc

    import kt_ops

    E, H, I, K = 4, 1024, 64, 2
    packed = kt_ops.pack_experts(torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I), method="BF16")
    small = torch.randn(64, H)
    ids_small = torch.randint(0, E, (64, K))
    kt_ops.moe_forward(small, ids_small, torch.rand(64, K), packed)
    gc.collect()
    before = rss_bytes()
    T = 24000
    x, ids = torch.randn(T, H), torch.randint(0, E, (T, K))
    out = kt_ops.moe_forward(x, ids, torch.rand(T, K), packed)
    del x, ids, out
    gc.collect()
    kt_ops.moe_forward(small, ids_small, torch.rand(64, K), packed)  # an ordinary call after it
    after = rss_bytes()
    print(f"before {before} after {after}")
    return 0


def test_a_huge_call_gives_its_scratch_back() -> None:
    result = run_case("scratch_given_back")
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = (int(v) for v in result.stdout.split()[1::2])
    assert after <= before * 1.10 + (8 << 20), f"RSS {before / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after"


# ---- mapped files changed on disk (issue 23, cases 2 and 3) ------------------------------


def mapped_file_changes() -> int:
    """Each loader's blob, then its file truncated, overwritten in place or replaced by
    rename, then a call: a RuntimeError naming the file (not SIGBUS, not silently new
    weights) for the first two, the original output for a rename and for copy=True."""
    import os
    import tempfile
    import time

    import kt_ops

    g = torch.Generator().manual_seed(1)
    E, H, I, T, K = 4, 64, 64, 5, 2
    weights = torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g)
    x, ids, w = torch.randn(T, H, generator=g), torch.randint(0, E, (T, K), generator=g), torch.rand(T, K, generator=g)

    def truncate(path: Path) -> None:
        os.truncate(path, path.stat().st_size // 2)  # the header survives, weights past it do not

    def overwrite(path: Path) -> None:
        time.sleep(0.05)  # past the file system's timestamp granularity
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.seek(size // 2)
            f.write(bytes(size - size // 2))

    def replace(path: Path) -> None:
        other = path.with_suffix(".new")
        other.write_bytes(bytes(path.stat().st_size))
        os.replace(other, path)

    def loaders(tmp: Path):
        blob = kt_ops.pack_experts(*weights, method="BF16")
        path = tmp / "layer.safetensors"
        blob.save(path)
        yield "PackedExperts.load", path, lambda copy: kt_ops.PackedExperts.load(path, copy=copy)
        import numpy as np
        from gguf_helpers import random_blocks, write_model

        rng = np.random.default_rng(0)
        layer = {name: ("Q8_0", random_blocks("Q8_0", E * rows, 64, rng).reshape(E, rows, -1))
                 for name, rows in (("ffn_gate_exps", I), ("ffn_up_exps", I), ("ffn_down_exps", H))}
        gguf_path = tmp / "m.gguf"
        write_model(gguf_path, [layer], E, H, I, top_k=K)
        yield "load_gguf_experts", gguf_path, lambda copy: kt_ops.load_gguf_experts(gguf_path, 0, copy=copy)

    checked = 0
    for change in (truncate, overwrite, replace):
        for copy in (False, True):
            with tempfile.TemporaryDirectory() as name:
                for loader, path, load in loaders(Path(name)):
                    packed = load(copy)
                    expected = kt_ops.moe_forward(x, ids, w, packed)
                    change(path)
                    if copy or change is replace:
                        assert torch.equal(kt_ops.moe_forward(x, ids, w, packed), expected), (loader, change, copy)
                    else:
                        try:
                            kt_ops.moe_forward(x, ids, w, packed)
                        except RuntimeError as error:
                            assert str(path) in str(error) and "changed on disk" in str(error), error
                        else:
                            raise AssertionError(f"{loader}: {change.__name__} not detected")
                    checked += 1
    print("checked", checked)
    return 0


def test_a_mapped_file_changed_on_disk_is_detected() -> None:
    result = run_case("mapped_file_changes")
    assert result.returncode == 0, f"rc {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert result.stdout.split() == ["checked", "12"]


def test_converted_layers_are_watched_or_copied(tmp_path: Path) -> None:
    """load_converted_layer maps through the same watched mapping (or copies)."""
    import kt_ops
    from kt_ops._native import _C
    from kt_ops.mapped_files import load_uint8_tensor

    blob = kt_ops.pack_experts(torch.randn(2, 32, 64), torch.randn(2, 32, 64), torch.randn(2, 64, 32), method="BF16")
    path = tmp_path / "layer.safetensors"
    blob.save(path)
    mapped, copied = load_uint8_tensor(path, "packed"), load_uint8_tensor(path, "packed", copy=True)
    assert torch.equal(mapped, blob.data) and torch.equal(copied, blob.data)
    assert _C.changed_mapped_file(mapped) == "" and _C.changed_mapped_file(copied) == ""
    with open(path, "ab") as f:
        f.write(b"x")
    assert "size" in _C.changed_mapped_file(mapped) and _C.changed_mapped_file(copied) == ""


# ---- loaders: small cases (issue 23, case 10) --------------------------------------------


def test_packed_load_of_a_directory_or_missing_file(tmp_path: Path) -> None:
    import kt_ops

    with pytest.raises(IsADirectoryError, match="is a directory"):
        kt_ops.PackedExperts.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        kt_ops.PackedExperts.load(tmp_path / "missing.safetensors")


def _tiny_gguf(path: Path, top_k: int) -> Path:
    import numpy as np
    from gguf_helpers import random_blocks, write_model

    rng = np.random.default_rng(0)
    E, H, I = 4, 64, 64
    layer = {name: ("Q8_0", random_blocks("Q8_0", E * rows, 64, rng).reshape(E, rows, -1))
             for name, rows in (("ffn_gate_exps", I), ("ffn_up_exps", I), ("ffn_down_exps", H))}
    write_model(path, [layer], E, H, I, top_k=top_k)
    return path


def test_gguf_layer_index_must_be_an_int(tmp_path: Path) -> None:
    import kt_ops

    path = _tiny_gguf(tmp_path / "m.gguf", top_k=2)
    assert kt_ops.load_gguf_experts(path, 0).num_experts == 4
    for bad in (0.0, 1.0, True, "0"):
        with pytest.raises(TypeError, match="layer_idx must be an int"):
            kt_ops.load_gguf_experts(path, bad)  # type: ignore[arg-type]


def test_gguf_expert_used_count_above_expert_count_is_refused(tmp_path: Path) -> None:
    import kt_ops

    path = _tiny_gguf(tmp_path / "m.gguf", top_k=5)
    with pytest.raises(ValueError, match="expert_used_count = 5 must be in"):
        kt_ops.read_gguf_config(path)


@pytest.mark.parametrize("key,value,vtype", [
    ("expert_count", "4", "STRING"), ("expert_count", "abc", "STRING"), ("expert_count", 4.7, "FLOAT32"),
    ("expert_count", [4, 4], "ARRAY"), ("expert_used_count", True, "BOOL"), ("expert_count", -4, "INT32"),
    ("embedding_length", "64", "STRING"), ("expert_feed_forward_length", 64.5, "FLOAT32"),
    ("expert_feed_forward_length", 0, "UINT32"), ("block_count", 1.9, "FLOAT32"),
])
def test_gguf_metadata_of_the_wrong_type_is_refused_naming_the_key(tmp_path: Path, key: str, value: object,
                                                                   vtype: str) -> None:
    """A size key that is not a positive integer (a string, float, bool, array, 0): int() took "4"
    and 4.7 -> 4 silently, and raised for "abc" or [4, 4] without naming the key."""
    import gguf
    import numpy as np
    from gguf_helpers import T, finish, random_blocks

    import kt_ops

    E, H, I = 4, 64, 64
    sizes = {"block_count": 1, "expert_count": E, "expert_used_count": 2, "embedding_length": H,
             "expert_feed_forward_length": I}
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3moe")
    for name, size in sizes.items():
        if name == key:
            kind = gguf.GGUFValueType[vtype]
            writer.add_key_value(f"qwen3moe.{name}", value, kind,
                                 sub_type=gguf.GGUFValueType.INT32 if kind == gguf.GGUFValueType.ARRAY else None)
        else:
            writer.add_uint32(f"qwen3moe.{name}", size)
    rng = np.random.default_rng(0)
    for name, rows in (("ffn_gate_exps", I), ("ffn_up_exps", I), ("ffn_down_exps", H)):
        raw = random_blocks("Q8_0", E * rows, 64, rng).reshape(E, rows, -1)
        writer.add_tensor(f"blk.0.{name}.weight", raw, raw_dtype=T.Q8_0)
    finish(writer)
    with pytest.raises(ValueError, match=rf"qwen3moe\.{key} must be a positive integer"):
        kt_ops.load_gguf_experts(tmp_path / "m.gguf", 0)


@pytest.mark.parametrize("text", ["{}", "not json", "[]", '{"weight_map": ["a"]}'],
                         ids=["no-weight-map", "not-json", "a-list", "weight-map-a-list"])
def test_a_damaged_safetensors_index_is_a_value_error_naming_it(tmp_path: Path, text: str) -> None:
    """model.safetensors.index.json without a usable weight_map: a ValueError naming the
    file (it was a bare KeyError 'weight_map', or an AttributeError)."""
    from checkpoint_helpers import make_weights, write_checkpoint
    from kt_ops.hf_checkpoint import HfCheckpoint

    path = write_checkpoint(tmp_path / "model", make_weights([0], 4, 32, 16))
    (path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match="model.safetensors.index.json: not a safetensors index"):
        HfCheckpoint(path)


def test_a_bf16_gpt_oss_checkpoint_is_refused_with_the_reason(tmp_path: Path) -> None:
    """gpt-oss's fused experts (transposed, gate/up rows interleaved, biases): the float
    reader (converter, KTMoEWrapper) names the layout and the ways that read it, instead
    of a shape mismatch; inspect gives it no loadable row but a note with the same reason."""
    from safetensors.torch import save_file

    from kt_ops.hf_checkpoint import HfCheckpoint
    from kt_ops.inspection import inspect_weights

    E, H, I = 4, 64, 32
    base = "model.layers.0.mlp.experts."
    save_file({base + "gate_up_proj": torch.zeros(E, H, 2 * I, dtype=torch.bfloat16),
               base + "gate_up_proj_bias": torch.zeros(E, 2 * I, dtype=torch.bfloat16),
               base + "down_proj": torch.zeros(E, I, H, dtype=torch.bfloat16),
               base + "down_proj_bias": torch.zeros(E, H, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "num_hidden_layers": 1,
                                                      "hidden_size": H, "intermediate_size": I,
                                                      "num_local_experts": E, "num_experts_per_tok": 2}))
    with pytest.raises(ValueError, match="gpt-oss's experts.*--input-type mxfp4"):
        HfCheckpoint(tmp_path).load_experts(0, range(E), H, I)
    report = inspect_weights(tmp_path)
    assert report.layers == () and any("gpt-oss's experts" in note and "--input-type mxfp4" in note
                                       for note in report.notes), report.notes


@pytest.mark.parametrize("shape", [(), (8,), (2, 64, 32, 1)])
def test_a_fused_gate_up_proj_of_another_rank_is_named(tmp_path: Path, shape: tuple[int, ...]) -> None:
    """A fused ``gate_up_proj`` that is not [E, 2I, H]: a 0-dim one was an IndexError while
    the checkpoint's layers were listed (inspect, convert, KTMoEWrapper alike)."""
    from safetensors.torch import save_file

    from kt_ops.hf_checkpoint import HfCheckpoint

    base = "model.layers.0.mlp.experts."
    save_file({base + "gate_up_proj": torch.zeros(shape, dtype=torch.bfloat16),
               base + "down_proj": torch.zeros(2, 32, 16, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"gate_up_proj' has shape \[{', '.join(map(str, shape))}\]; a fused"):
        HfCheckpoint(tmp_path).moe_layers()


def test_an_expert_tensor_of_a_non_float_dtype_is_refused(tmp_path: Path) -> None:
    """One expert's weight stored as integers (the layer's first gate is bf16): a
    ValueError naming the tensor, not its integer values silently read as weights (the
    converter and KTMoEWrapper used to pack them)."""
    from checkpoint_helpers import make_weights, write_checkpoint
    from safetensors.torch import load_file, save_file

    from kt_ops.hf_checkpoint import HfCheckpoint

    path = write_checkpoint(tmp_path / "model", make_weights([0], 4, 32, 16))
    shard = path / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    key = "model.layers.0.mlp.experts.2.up_proj.weight"
    tensors[key] = (tensors[key].float() * 1000).to(torch.int32)
    save_file(tensors, shard)
    with pytest.raises(ValueError, match=f"{key}.*is I32; expert weights must be"):
        HfCheckpoint(path).load_experts(0, range(4), 32, 16)


@pytest.mark.parametrize("odd", [torch.float32, torch.float16])
def test_one_expert_tensor_of_another_float_dtype_is_refused(tmp_path: Path, odd: torch.dtype, capsys) -> None:
    """One expert's weight stored as F32 (or F16) among BF16 ones: load_experts promises
    the stored dtype, but copied it into the layer's bf16 matrix, rounding it, and the
    converter (--input-type bf16 checks the first gate only) packed it so. A ValueError
    naming both tensors and dtypes; the converter exits 2 before writing anything."""
    from checkpoint_helpers import make_weights, write_checkpoint
    from safetensors.torch import load_file, save_file

    from kt_ops import convert
    from kt_ops.hf_checkpoint import HfCheckpoint

    path = write_checkpoint(tmp_path / "model", make_weights([0], 4, 32, 16))
    shard = path / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    key = "model.layers.0.mlp.experts.2.down_proj.weight"
    tensors[key] = (tensors[key].float() + 1e-3).to(odd)
    save_file(tensors, shard)
    name = {torch.float32: "F32", torch.float16: "F16"}[odd]
    with pytest.raises(ValueError, match=f"layer 0 mixes dtypes.*gate_proj.weight' is BF16.*{key}' is {name}"):
        HfCheckpoint(path).load_experts(0, range(4), 32, 16)
    with pytest.raises(ValueError, match=f"{key}' is {name}"):
        HfCheckpoint(path).dtype(0)
    out = tmp_path / "out"
    assert convert.main(["--input-path", str(path), "--input-type", "bf16", "--output", str(out),
                         "--quant-method", "int8"]) == 2
    assert f"{key}' is {name}" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("damage", ["manifest-not-json", "manifest-a-list", "manifest-no-method",
                                    "manifest-no-parts", "index-empty",
                                    "index-missing", "shard-truncated", "index-names-another-file"])
def test_a_damaged_converted_directory_is_a_clear_error(tmp_path: Path, damage: str) -> None:
    """A converted directory with a damaged manifest, index or shard: inspect and
    load_converted_layer raise ValueError / FileNotFoundError naming the file (they were
    bare KeyError 'method', AttributeError, JSONDecodeError without the file, or
    safetensors' own error types: a traceback from 'kt-ops inspect')."""
    from kt_ops import pack_experts
    from kt_ops.converted import INDEX, MANIFEST, Manifest, layer_key, load_converted_layer
    from kt_ops.convert_merge import write_index
    from kt_ops.inspection import inspect_weights
    from safetensors.torch import save_file

    E, H, I = 2, 64, 32
    blob = pack_experts(torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I), method="BF16")
    shard = tmp_path / "model-00001-of-00001.safetensors"
    save_file({layer_key(0, 0): blob.data}, str(shard), metadata={"producer": "kt_ops"})
    write_index(tmp_path, {layer_key(0, 0): shard.name}, shard.stat().st_size)
    Manifest("bf16", "bf16", 0, 1, (0,), E, H, I, 1, True, {}).write(tmp_path)
    load_converted_layer(tmp_path, 0)  # intact
    (tmp_path / "config.json").write_text("{}")
    named = {"manifest-not-json": MANIFEST, "manifest-a-list": MANIFEST, "manifest-no-method": MANIFEST,
             "manifest-no-parts": MANIFEST,
             "index-empty": INDEX, "index-missing": INDEX, "shard-truncated": shard.name,
             "index-names-another-file": "config.json"}[damage]
    if damage.startswith("manifest"):
        text = {"manifest-not-json": "garbage", "manifest-a-list": "[1, 2]",
                "manifest-no-method": '{"format_version": 1}',  # a threadpool_count of 0 loaded no parts
                "manifest-no-parts": (tmp_path / MANIFEST).read_text().replace('"threadpool_count": 1',
                                                                               '"threadpool_count": 0')}[damage]
        (tmp_path / MANIFEST).write_text(text)
    elif damage == "index-empty":
        (tmp_path / INDEX).write_text("{}")
    elif damage == "index-missing":
        (tmp_path / INDEX).unlink()
    elif damage == "shard-truncated":
        with open(shard, "r+b") as file:
            file.truncate(100)
    else:
        write_index(tmp_path, {layer_key(0, 0): "config.json"}, 2)
    with pytest.raises((ValueError, FileNotFoundError), match=named):
        load_converted_layer(tmp_path, 0)
    if damage != "index-missing":  # inspect reports an unfinished conversion's layers without the index
        with pytest.raises(ValueError, match=named):
            inspect_weights(tmp_path)


@pytest.mark.parametrize("key,value", [("complete", "false"), ("layers", [0.7]), ("layers", "12"),
                                       ("intermediate_size", 32.9), ("method", 5), ("num_experts", True),
                                       ("source", "x")])
def test_a_manifest_value_of_the_wrong_type_is_named(tmp_path: Path, key: str, value: object) -> None:
    """Hand-edited manifest values were coerced: "complete": "false" read as complete, layer
    0.7 as 0, intermediate_size 32.9 as 32, method 5 as "5", "12" as layers 1 and 2."""
    import json

    from kt_ops.converted import MANIFEST, Manifest

    Manifest("bf16", "bf16", 0, 1, (0,), 2, 64, 32, 1, True, {}).write(tmp_path)
    data = json.loads((tmp_path / MANIFEST).read_text())
    (tmp_path / MANIFEST).write_text(json.dumps({**data, key: value}))
    with pytest.raises(ValueError, match=rf"{MANIFEST}: damaged kt_ops manifest \({key} is "):
        Manifest.read(tmp_path)


_HUGE_PARTS = """
import json, sys
from pathlib import Path
import torch
from kt_ops import pack_experts
from kt_ops.converted import INDEX, MANIFEST, Manifest, layer_key
from kt_ops.convert_merge import write_index
from kt_ops.inspection import inspect_weights
from safetensors.torch import save_file

root, edit, index = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3] == "index"
E, H, I = 2, 64, 32
blob = pack_experts(torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I), method="BF16")
shard = root / ("model-00001-of-00001.safetensors" if index else "layer-00000.safetensors")
save_file({layer_key(0, 0): blob.data}, str(shard), metadata={"producer": "kt_ops"})
if index:
    write_index(root, {layer_key(0, 0): shard.name}, shard.stat().st_size)
Manifest("bf16", "bf16", 0, 1, (0,), E, H, I, 1, True, {}).write(root)
(root / MANIFEST).write_text(json.dumps({**json.loads((root / MANIFEST).read_text()), **edit}))
try:
    print("inspected", inspect_weights(root).layers[0].nbytes)
except ValueError as error:
    print("ValueError", error)
"""


@pytest.mark.parametrize("index", ["index", "no-index"])
@pytest.mark.parametrize("edit,match", [
    ({"threadpool_count": 2**40}, r"ValueError .*threadpool_count 1099511627776 does not divide intermediate_size 32"),
    ({"threadpool_count": 3}, r"ValueError .*threadpool_count 3 does not divide intermediate_size 32"),
    ({"threadpool_count": 2**40, "intermediate_size": 2**40}, r"inspected None"),
], ids=["huge", "no-divisor", "huge-both"])
def test_a_manifest_with_a_huge_part_count_is_refused_not_looped_over(tmp_path: Path, edit: dict, match: str,
                                                                      index: str) -> None:
    """kt-ops inspect of a converted directory whose manifest says threadpool_count 2^40: it listed the key of
    every part of every layer (2^40 of them) and hung. The manifest's parts must divide intermediate_size, as
    the converter makes them; where both are huge, inspect stops at the first part missing from the files."""
    done = subprocess.run([sys.executable, "-c", _HUGE_PARTS, str(tmp_path), json.dumps(edit), index],
                          capture_output=True, text=True, timeout=120, cwd=HERE.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(match, done.stdout), done.stdout

@pytest.mark.parametrize("offsets", [None, 5, [0], [0, 4, 8], ["0", "4"]])
def test_a_converted_shard_with_malformed_data_offsets_is_a_clear_error(tmp_path: Path, offsets: object) -> None:
    """A converted shard whose header gives a tensor's ``data_offsets`` as null, a number,
    one value or three: safetensors_range unpacked it as is (TypeError 'cannot unpack
    non-iterable NoneType object', or ValueError 'not enough values to unpack' naming
    nothing). Now a ValueError naming the file and the tensor."""
    import struct

    from kt_ops.mapped_files import load_uint8_tensor, safetensors_range

    header = json.dumps({"blk.0.part0.packed": {"dtype": "U8", "shape": [4], "data_offsets": offsets}}).encode()
    shard = tmp_path / "model-00001-of-00001.safetensors"
    shard.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(ValueError, match="model-00001-of-00001.safetensors.*blk.0.part0.packed.*not a 1-D uint8"):
        safetensors_range(shard, "blk.0.part0.packed")
    with pytest.raises(ValueError, match="model-00001-of-00001.safetensors.*blk.0.part0.packed.*not a 1-D uint8"):
        load_uint8_tensor(shard, "blk.0.part0.packed", copy=True)


def test_inspect_of_a_checkpoint_with_a_truncated_shard_names_it(tmp_path: Path) -> None:
    """A Hugging Face checkpoint (with its index) whose shard was cut short: inspect raises
    ValueError naming the shard (it was safetensors' SafetensorError: a traceback)."""
    from checkpoint_helpers import make_weights, write_checkpoint

    from kt_ops.inspection import inspect_weights

    path = write_checkpoint(tmp_path / "model", make_weights([0], 4, 32, 16))
    shard = path / "model-00001-of-00001.safetensors"
    with open(shard, "r+b") as file:
        file.truncate(shard.stat().st_size // 2)
    with pytest.raises(ValueError, match="model-00001-of-00001.safetensors: cannot read (it|the safetensors header)"):
        inspect_weights(path)


def test_a_tensor_in_two_files_without_an_index_is_refused(tmp_path: Path) -> None:
    """A checkpoint directory without an index whose files both hold a tensor (a stale
    shard left beside the model): a ValueError naming both files, not the copy of
    whichever file sorts last read silently."""
    from checkpoint_helpers import make_weights, write_checkpoint
    from safetensors.torch import load_file, save_file

    from kt_ops.hf_checkpoint import HfCheckpoint

    path = write_checkpoint(tmp_path / "model", make_weights([0], 4, 32, 16), index=False)
    tensors = load_file(path / "model-00001-of-00001.safetensors")
    save_file({k: v * 0 for k, v in tensors.items() if ".experts.1." in k}, str(path / "zz-stale.safetensors"))
    with pytest.raises(ValueError, match="is in both model-00001-of-00001.safetensors and zz-stale.safetensors"):
        HfCheckpoint(path)


def test_a_missing_shard_without_an_index_is_refused(tmp_path: Path, capsys) -> None:
    """A checkpoint directory without an index, one of whose ``model-0000i-of-0000N``
    shards is missing (a download cut short): the layers in that shard were silently not
    there, and the converter converted the others and exited 0. Now a ValueError naming
    the missing shard; the converter exits 2."""
    from checkpoint_helpers import make_weights, write_checkpoint
    from safetensors.torch import load_file, save_file

    from kt_ops import convert
    from kt_ops.hf_checkpoint import HfCheckpoint

    path = write_checkpoint(tmp_path / "model", make_weights([0, 1], 4, 32, 16), index=False)
    tensors = load_file(path / "model-00001-of-00001.safetensors")
    (path / "model-00001-of-00001.safetensors").unlink()
    for i in (0, 1):  # one shard per layer, as Hugging Face shards consecutive layers
        save_file({k: v for k, v in tensors.items() if f"layers.{i}." in k or (i == 0 and "layers." not in k)},
                  str(path / f"model-0000{i + 1}-of-00002.safetensors"))
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="incomplete: missing model-00002-of-00002.safetensors"):
        HfCheckpoint(path)
    out = tmp_path / "out"
    code = convert.main(["--input-path", str(path), "--input-type", "bf16", "--output", str(out),
                         "--quant-method", "int8"])
    assert code == 2 and "model-00002-of-00002.safetensors" in capsys.readouterr().err
    assert not out.exists()


def test_the_mtp_heads_experts_do_not_clash_with_the_decoder_layers(tmp_path: Path) -> None:
    """Qwen3-Next and Qwen3.5 checkpoints hold the multi-token-prediction head's MoE as
    ``mtp.layers.0.mlp.experts.{e}.*`` beside the decoder's ``model.layers.0.mlp.experts``:
    HfCheckpoint refused the whole checkpoint ("layer 0 has experts under two names"), so
    no layer could be loaded or converted. The MTP head's experts are not a decoder layer:
    layer 0 is the decoder's."""
    from checkpoint_helpers import make_weights, write_checkpoint
    from safetensors.torch import save_file

    from kt_ops.hf_checkpoint import HfCheckpoint

    weights = make_weights([0, 1], 4, 32, 16)
    path = write_checkpoint(tmp_path / "model", weights, index=False)
    shapes = (("gate_proj", (16, 32)), ("up_proj", (16, 32)), ("down_proj", (32, 16)))
    mtp = {f"mtp.layers.0.mlp.experts.{e}.{name}.weight": torch.zeros(shape, dtype=torch.bfloat16)
           for e in range(4) for name, shape in shapes}
    save_file(mtp, str(path / "model-mtp.safetensors"))
    checkpoint = HfCheckpoint(path)
    assert sorted(checkpoint.moe_layers()) == [0, 1] and checkpoint.layer(0).base == "model.layers.0"
    gate, up, down = checkpoint.load_experts(0, range(4), 32, 16)
    for got, want in zip((gate, up, down), weights[0]):
        torch.testing.assert_close(got, want.bfloat16(), rtol=0, atol=0)


def test_packed_save_over_a_file_keeps_it_whole_on_failure_and_for_its_readers(tmp_path: Path, monkeypatch) -> None:
    """PackedExperts.save over an existing file writes a temporary file and renames it: a
    write that fails half way leaves the old file whole (it was truncated in place), and
    a blob memory-mapped from the old file keeps working (it raised 'changed on disk')."""
    import kt_ops
    from kt_ops import packed as packed_module

    E, H, I = 2, 64, 32
    make = lambda seed: kt_ops.pack_experts(*(torch.randn(E, *s, generator=torch.Generator().manual_seed(seed))  # noqa: E731
                                              for s in ((I, H), (I, H), (H, I))), method="BF16")
    path = tmp_path / "experts.safetensors"
    make(0).save(path)
    before = path.read_bytes()
    loaded = kt_ops.PackedExperts.load(path)
    x, ids, w = torch.randn(3, H), torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1)
    out = kt_ops.moe_forward(x, ids, w, loaded)

    def half_write(tensors, name, metadata=None):
        with open(name, "wb") as file:
            file.write(b"\0" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(packed_module, "save_file", half_write)
    with pytest.raises(OSError, match="No space left"):
        make(1).save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [path.name]
    make(1).save(path)  # replaced while `loaded` maps the old file
    assert torch.equal(kt_ops.moe_forward(x, ids, w, loaded), out)
    assert not torch.equal(kt_ops.moe_forward(x, ids, w, kt_ops.PackedExperts.load(path)), out)


def test_fifos_and_paths_outside_the_checkpoint_are_refused_not_waited_on(tmp_path: Path) -> None:
    """A FIFO where a shard, layer file or GGUF file should be, or an index naming a
    shard outside the checkpoint (/dev/stdin, a FIFO): a ValueError naming it. Opening a
    FIFO to read its header blocked for ever: 'kt-ops convert' / 'inspect' and
    KTMoEWrapper.load_weights hung. Run in a subprocess with a timeout, so a hang fails."""
    code = f"""
import json, os, shutil, sys
from pathlib import Path
sys.path.insert(0, {str(HERE)!r})
from checkpoint_helpers import make_weights, write_checkpoint
from kt_ops.hf_checkpoint import HfCheckpoint
from kt_ops.inspection import inspect_weights
from kt_ops.mapped_files import load_uint8_tensor
root = Path({str(tmp_path)!r})
fifo = root / "fifo"
os.mkfifo(fifo)

def refused(call, text):
    try:
        call()
    except ValueError as error:
        assert text in str(error), error
        print("refused")
    else:
        raise AssertionError("accepted")

a = write_checkpoint(root / "a", make_weights([0], 4, 32, 16))
index = a / "model.safetensors.index.json"
data = json.loads(index.read_text())
key = next(iter(k for k in data["weight_map"] if ".experts." in k))
data["weight_map"][key] = str(fifo)
index.write_text(json.dumps(data))
refused(lambda: HfCheckpoint(a), "is not a file of the checkpoint directory")
b = write_checkpoint(root / "b", make_weights([0], 4, 32, 16), index=False)
os.mkfifo(b / "zz.safetensors")
refused(lambda: HfCheckpoint(b), "not a regular file")
refused(lambda: inspect_weights(b), "not a regular file")
refused(lambda: load_uint8_tensor(fifo, "packed"), "not a regular file")
g = root / "g"
g.mkdir()
os.mkfifo(g / "model.gguf")
refused(lambda: inspect_weights(g), "not a regular file")
c = write_checkpoint(root / "c", make_weights([0], 4, 32, 16))
(c / "config.json").unlink()
os.mkfifo(c / "config.json")  # was read as no config at all
from kt_ops.hf_checkpoint import read_config_json
refused(lambda: read_config_json(c), "not a regular file")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=HERE.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["refused"] * 6


@pytest.mark.parametrize("body", [b"[" * 200_000 + b"]" * 200_000, b'{"x": ' + b"9" * 5000 + b"}"])
def test_a_safetensors_header_nested_too_deep_or_with_a_huge_number_names_the_file(tmp_path: Path,
                                                                                  body: bytes) -> None:
    """A header of 200,000 nested arrays (was a RecursionError from json) or a 5,000-digit integer (a ValueError about
    int string conversion that named nothing) is the ValueError that says the file is not safetensors'."""
    import struct

    from kt_ops.mapped_files import read_safetensors_header

    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(ValueError, match="deep.safetensors.* is not a safetensors file"):
        read_safetensors_header(path)


def refused_on_a_truncated_mapped_layer(tmp_path: Path, call: str) -> None:
    """Runs ``call`` (Python code using ``mapped``) in a subprocess on a BF16 layer memory-mapped by
    PackedExperts.load whose file was then cut to 4096 bytes, and checks it raised the RuntimeError naming the file
    (in a subprocess, so a SIGBUS fails the test only)."""
    code = f"""
import os, torch, kt_ops
E, H, I = 4, 512, 256
packed = kt_ops.pack_experts(torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I), method="BF16")
path = {str(tmp_path / "layer.safetensors")!r}
packed.save(path)
mapped = kt_ops.PackedExperts.load(path)
os.truncate(path, 4096)
try:
    {call}
except RuntimeError as error:
    assert "layer.safetensors" in str(error), error
    print("refused")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=HERE.parent)
    assert result.returncode == 0 and result.stdout.split() == ["refused"], (result.returncode, result.stderr[-2000:])


@pytest.mark.parametrize("call", ["kt_ops.set_activation(mapped, 7.0)", "kt_ops.dequantize_experts(mapped)",
                                  "torch.ops.kt.dequantize_experts(mapped.data, torch.tensor([3]), torch.float32)"],
                         ids=["set_activation", "dequantize_experts", "dequantize_experts_op"])
def test_a_mapped_layer_whose_file_was_truncated_is_named_not_sigbus(tmp_path: Path, call: str) -> None:
    """kt_ops.set_activation, kt_ops.dequantize_experts and the operator torch.ops.kt.dequantize_experts called
    directly, on a layer whose mapped file was cut short afterwards: the RuntimeError naming the file that moe_forward
    raises (all were SIGBUS: the process killed). Every operator checks the file where it reads the blob's header
    (csrc/ops/packed_blob.cpp read_packed)."""
    refused_on_a_truncated_mapped_layer(tmp_path, call)


@pytest.mark.parametrize("value", [{}, [], "x", -3, 1.5, True],
                         ids=["a-dict", "a-list", "a-word", "negative", "a-fraction", "a-bool"])
def test_inspect_of_a_config_with_a_bad_num_hidden_layers_names_it(tmp_path: Path, value: object) -> None:
    """kt-ops inspect of a checkpoint whose config.json has a num_hidden_layers that is not a layer count:
    a ValueError naming the file and the key, as the converter gives (a dict or list was a TypeError from
    ``int()``, a word a bare ``invalid literal for int()``, a negative count reported as such)."""
    from checkpoint_helpers import make_weights, write_checkpoint
    from kt_ops.inspection import inspect_weights

    path = write_checkpoint(tmp_path / "model", make_weights([0], 4, 32, 16))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": value}))
    with pytest.raises(ValueError, match=r"config\.json: num_hidden_layers .* is not a layer count"):
        inspect_weights(path)


if __name__ == "__main__":
    sys.exit(globals()[sys.argv[1]]())
