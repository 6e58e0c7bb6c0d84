"""The CPU-weight converter (python -m kt_ops.convert / scripts/convert_cpu_weights.py):
converted directories load through KTMoEWrapper and compute exactly what online
quantization of the same checkpoint computes; FP8 input; per-layer files, resume,
--layers, the verification step, bad input."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import fp8_dequantized, make_weights, write_checkpoint
from conftest import rel_err

from kt_ops import KTMoEWrapper, convert, reference
from kt_ops.converted import MANIFEST, Manifest, layer_file

E, K, H, I = 8, 2, 64, 64
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def weights():
    return make_weights([1, 2, 3], E, H, I, seed=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, weights) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("hf") / "model", weights, shards=2, dense_layers=(0,))


def run(*args: object) -> int:
    return convert.main([str(a) for a in args])


def outputs(path: Path, layer: int, method: str, seed: int = 0, mapping=None, **kw) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(6)])
    w = torch.rand(6, K, generator=g)
    wr = KTMoEWrapper(layer, E, K, H, I, weight_path=path, method=method, **kw)
    wr.load_weights(mapping)
    return wr.forward(x, ids, w)


@pytest.mark.parametrize("quant,method,extra,merge,convention", [
    ("int8", "AMXINT8", [], True, "per_expert"),
    ("int8", "AMXINT8", [], True, "w123"),
    ("int8", "AMXINT8", [], False, "fused"),
    ("int4", "AMXINT4", ["--group-size", 32, "--threadpool-count", 2], False, "per_expert"),
    ("mxfp4", "MXFP4", ["--threadpool-count", 2], True, "per_expert"),
])
def test_converted_equals_online_quantization(tmp_path, checkpoint, weights, quant, method, extra, merge,
                                              convention):
    if convention != "per_expert":
        checkpoint = write_checkpoint(tmp_path / convention, weights, convention=convention, dense_layers=(0,))
    out = tmp_path / "out"
    args = ["--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", quant, *extra]
    assert run(*args, *([] if merge else ["--no-merge-safetensor"])) == 0
    manifest = Manifest.read(out)
    assert manifest.complete and manifest.layers == (1, 2, 3) and manifest.num_experts == E
    assert (manifest.hidden_size, manifest.intermediate_size, manifest.method) == (H, I, quant)
    assert json.loads((out / "config.json").read_text())["model_type"] in ("qwen3_moe", "mixtral")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == (["model-00001-of-00001.safetensors"] if merge else [layer_file(L) for L in (1, 2, 3)])
    kw = {"int4": {"group_size": 32, "threadpool_count": 2}, "mxfp4": {"threadpool_count": 2}}.get(quant, {})
    for layer in (1, 2, 3):
        converted = outputs(out, layer, method, **kw)
        online = outputs(checkpoint, layer, method, **kw)
        assert torch.equal(converted, online)
    # with GPU experts and a permuted expert map: the converted layer keeps every expert
    # mapped and routes slots to them; online packs only the CPU slots, in slot order
    mask = torch.tensor([0, 1, 0, 0, 1, 0, 0, 0], dtype=torch.bool)
    mapping = torch.tensor([5, 3, 0, 7, 1, 6, 2, 4])
    converted = outputs(out, 2, method, mapping=mapping, gpu_experts_mask=mask, **kw)
    assert torch.equal(converted, outputs(checkpoint, 2, method, mapping=mapping, gpu_experts_mask=mask, **kw))
    assert not torch.equal(converted, outputs(out, 2, method, **kw))


@pytest.mark.slow
def test_fp8_input(tmp_path):
    H8, I8 = 256, 192
    ws = make_weights([0, 1], E, H8, I8, seed=2)
    src = write_checkpoint(tmp_path / "fp8", ws, dtype=torch.float8_e4m3fn)
    out = tmp_path / "out"
    assert run("--input-path", src, "--input-type", "fp8", "--output", out, "--quant-method", "int8") == 0
    x = torch.randn(5, H8)
    ids = torch.randint(0, E, (5, K))
    w = torch.rand(5, K)
    wr = KTMoEWrapper(1, E, K, H8, I8, weight_path=out, method="AMXINT8")
    wr.load_weights()
    deq = [torch.stack([fp8_dequantized(m[e]) for e in range(E)]).float() for m in ws[1]]
    assert rel_err(wr.forward(x, ids, w), reference.moe_forward(x, ids, w, *deq)) <= 5e-2
    assert run("--input-path", src, "--input-type", "bf16", "--output", tmp_path / "o2", "--quant-method", "int8") == 2

    # Its own block-FP8 bytes kept: a split inside a 128-wide scale block is refused before anything is written.
    assert run("--input-path", src, "--input-type", "fp8", "--output", tmp_path / "o3", "--quant-method", "fp8",
               "--threadpool-count", 2) == 2
    assert not (tmp_path / "o3").exists()
    assert run("--input-path", src, "--input-type", "fp8", "--output", tmp_path / "o4", "--quant-method", "fp8") == 0


def test_resume_keeps_written_layers(tmp_path, checkpoint, capsys):
    out = tmp_path / "out"
    base = ["--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8",
            "--no-merge-safetensor"]
    assert run(*base) == 0
    err = capsys.readouterr().err
    assert "3/3 layers" in err and "layers/s" in err and "ETA" in err
    before = {L: ((out / layer_file(L)).read_bytes(), (out / layer_file(L)).stat().st_mtime_ns) for L in (1, 2)}
    # a crash while writing layer 3: its file is gone and the manifest is incomplete
    (out / layer_file(3)).unlink()
    manifest = Manifest.read(out)
    Manifest(**{**manifest.__dict__, "complete": False}).write(out)
    with pytest.raises(ValueError, match="did not finish"):
        outputs(out, 1, "AMXINT8")
    capsys.readouterr()
    assert run(*base) == 2  # refuses to overwrite without --resume-layer, saying where to continue
    assert "unfinished conversion (layers before 3 written: continue with --resume-layer 3)" in capsys.readouterr().err
    assert run(*base, "--resume-layer", 3) == 0
    for L, (data, mtime) in before.items():
        assert (out / layer_file(L)).read_bytes() == data and (out / layer_file(L)).stat().st_mtime_ns == mtime
    assert torch.equal(outputs(out, 3, "AMXINT8"), outputs(checkpoint, 3, "AMXINT8"))
    (out / layer_file(1)).unlink()
    assert run(*base, "--resume-layer", 2) == 2  # layer 1's file is missing
    assert run(*base[:-1], "--quant-method", "int4", "--resume-layer", 2) == 2  # different settings


def test_a_layer_file_of_another_conversion_is_refused(tmp_path, checkpoint):
    """A converted directory whose layer file was replaced by the same layer of another
    conversion (another method or group size): a ValueError naming the file, not the
    blob run as it is under a manifest (and wrapper) that say otherwise."""
    def convert_to(name, *extra):
        out = tmp_path / name
        assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--no-merge-safetensor",
                   *extra) == 0
        return out

    int8, int4, int4_32 = (convert_to("int8", "--quant-method", "int8"), convert_to("int4", "--quant-method", "int4", "--group-size", 64),
                           convert_to("int4_32", "--quant-method", "int4", "--group-size", 32))
    (int8 / layer_file(2)).write_bytes((int4 / layer_file(2)).read_bytes())
    with pytest.raises(ValueError, match=r"layer-00002.safetensors: .*format int4 \(manifest: int8\)"):
        outputs(int8, 2, "AMXINT8")
    (int4 / layer_file(2)).write_bytes((int4_32 / layer_file(2)).read_bytes())
    with pytest.raises(ValueError, match=r"group_size 32 \(manifest: 64\)"):
        outputs(int4, 2, "AMXINT4", group_size=64)
    assert torch.equal(outputs(int4, 1, "AMXINT4", group_size=64), outputs(checkpoint, 1, "AMXINT4", group_size=64))  # the other layers load


def test_resume_with_layers_leaving_out_converted_ones_is_refused(tmp_path, checkpoint, capsys):
    """--resume-layer with a --layers range that leaves out layers the earlier run
    converted: refused, not a merge that rewrites the shard without them (they were
    silently dropped from the directory and its manifest)."""
    out = tmp_path / "out"
    base = ["--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8"]
    assert run(*base, "--layers", "1-2") == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert run(*base, "--layers", "3", "--resume-layer", 3) == 2
    assert "converted layer(s) 1, 2, which --layers 3 leaves out" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert run(*base, "--layers", "1-3", "--resume-layer", 3) == 0  # a range covering them adds layer 3
    assert Manifest.read(out).layers == (1, 2, 3)
    for L in (1, 2, 3):
        assert torch.equal(outputs(out, L, "AMXINT8"), outputs(checkpoint, L, "AMXINT8"))


def test_resume_may_narrow_layers_to_those_written(tmp_path, checkpoint):
    """A run that crashed before layer 3: --layers 1-2 --resume-layer 3 finishes with the
    layers it wrote (layer 3 was only planned, nothing of it is lost)."""
    out = tmp_path / "out"
    base = ["--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8",
            "--no-merge-safetensor"]
    assert run(*base) == 0
    (out / layer_file(3)).unlink()
    manifest = Manifest.read(out)
    Manifest(**{**manifest.__dict__, "complete": False}).write(out)
    assert run(*base, "--layers", "1", "--resume-layer", 2) == 2  # layer 2 is on disk: kept only by a wider range
    assert run(*base, "--layers", "1-2", "--resume-layer", 3) == 0
    assert Manifest.read(out).layers == (1, 2)


def test_resume_from_another_checkpoint_is_refused(tmp_path, checkpoint, weights, capsys):
    """--resume-layer with another --input-path of the same sizes (another model, a
    fine-tune): refused, not a directory mixing two models' experts under one manifest."""
    other = write_checkpoint(tmp_path / "other", make_weights([1, 2, 3], E, H, I, seed=7), shards=2,
                             dense_layers=(0,))
    out = tmp_path / "out"
    base = ["--input-type", "bf16", "--output", out, "--quant-method", "int8"]
    assert run("--input-path", checkpoint, *base) == 0
    manifest = Manifest.read(out)
    Manifest(**{**manifest.__dict__, "complete": False}).write(out)  # a crash before the end
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert run("--input-path", other, *base, "--resume-layer", 3) == 2
    assert "cannot resume, the earlier run converted --input-path" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert run("--input-path", checkpoint, *base, "--resume-layer", 3) == 0  # the same model resumes
    for L in (1, 2, 3):
        assert torch.equal(outputs(out, L, "AMXINT8"), outputs(checkpoint, L, "AMXINT8"))


@pytest.mark.parametrize("crash_at", ["shard_write", "shard_rename", "index", "layer_delete"])
def test_a_crash_in_the_merge_resumes(tmp_path, checkpoint, monkeypatch, capsys, crash_at):
    """A crash at each step of the merge leaves a directory --resume-layer completes, with
    the same weights as an uninterrupted run (issue 23, case 8); the rerun without
    --resume-layer names the layer to give (it named none: every layer was written)."""
    from kt_ops import convert_merge

    out = tmp_path / "out"
    base = ["--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8"]
    calls = {"n": 0}
    marker = "layer-" if crash_at == "layer_delete" else "model-"

    def crash(real):
        def wrapped(*args, **kwargs):
            if marker in " ".join(map(str, args)):  # a merge step's file
                calls["n"] += 1
                if calls["n"] == 2:  # the second one: part of the step done
                    raise OSError("simulated crash")
            return real(*args, **kwargs)
        return wrapped

    target = {"shard_write": (convert_merge, "write_shard"), "shard_rename": (os, "replace"),
              "index": (convert_merge, "write_text_durably"), "layer_delete": (Path, "unlink")}[crash_at]
    monkeypatch.setattr(convert, "MAX_SHARD_BYTES", 1)  # one shard per layer: steps of several calls
    if crash_at == "index":
        calls["n"], marker = 1, "index"  # the index is one call: crash on it
    monkeypatch.setattr(*target, crash(getattr(*target)))
    assert run(*base) == 1
    monkeypatch.undo()
    capsys.readouterr()
    assert run(*base) == 2  # the rerun says how to finish (it gave no layer: every layer is written)
    assert "unfinished conversion (every layer written: finish it with --resume-layer 4)" in capsys.readouterr().err
    assert run(*base, "--resume-layer", 3) == 0
    for L in (1, 2, 3):
        assert torch.equal(outputs(out, L, "AMXINT8"), outputs(checkpoint, L, "AMXINT8"))
    assert not list(out.glob("layer-*")) and not list(out.glob("*.tmp"))


def test_resume_after_a_finished_merge(tmp_path, checkpoint):
    """Layers already merged into shards count as written: --resume-layer reconverts the
    rest and merges again."""
    out = tmp_path / "out"
    base = ["--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8"]
    assert run(*base) == 0
    manifest = Manifest.read(out)
    Manifest(**{**manifest.__dict__, "complete": False}).write(out)
    assert run(*base, "--resume-layer", 2) == 0
    for L in (1, 2, 3):
        assert torch.equal(outputs(out, L, "AMXINT8"), outputs(checkpoint, L, "AMXINT8"))
    assert run(*base, "--resume-layer", 3, "--no-merge-safetensor") == 0  # back to layer files
    assert sorted(p.name for p in out.glob("*.safetensors")) == [layer_file(L) for L in (1, 2, 3)]
    assert torch.equal(outputs(out, 1, "AMXINT8"), outputs(checkpoint, 1, "AMXINT8"))


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_output_overlapping_the_input_is_refused(tmp_path, weights, capsys, where):
    """The converter never writes into its input (issue 23, case 7): refused before anything is written."""
    source = write_checkpoint(tmp_path / "src" / "model", weights, shards=2, dense_layers=(0,))
    before = {p: p.read_bytes() for p in source.rglob("*") if p.is_file()}
    out = {"same": source, "inside": source / "converted", "parent": source.parent}[where]
    assert run("--input-path", source, "--input-type", "bf16", "--output", out, "--quant-method", "int8") == 2
    assert "lies inside --input-path" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in source.rglob("*") if p.is_file()} == before
    assert not (source / "converted").exists()


def test_output_holding_another_model_is_refused(tmp_path, checkpoint, weights, capsys):
    """An --output directory with another model's config.json / safetensors and no kt_ops
    manifest: refused before anything is written (the merge and the config copy used to
    overwrite them)."""
    other = write_checkpoint(tmp_path / "other", weights, shards=2)
    before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", other, "--quant-method", "int8") == 2
    assert "holds another model's files" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before
    unrelated = tmp_path / "unrelated"  # a directory with other files is still fine
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("mine")
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", unrelated, "--quant-method", "int8") == 0
    assert (unrelated / "notes.txt").read_text() == "mine"


def test_unwritable_output_is_one_error_line(tmp_path, checkpoint, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", blocker / "out",
               "--quant-method", "int8") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m kt_ops.convert: error:") and "Traceback" not in "".join(err)


def test_layer_range_and_missing_layer(tmp_path, checkpoint):
    out = tmp_path / "out"
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8",
               "--layers", "2-3") == 0
    assert Manifest.read(out).layers == (2, 3)
    with pytest.raises(KeyError, match="layer 1 was not converted"):
        outputs(out, 1, "AMXINT8")
    with pytest.raises(ValueError, match="holds int8 weights"):
        outputs(out, 2, "AMXINT4")
    with pytest.raises(ValueError, match="threadpool_count=1"):
        outputs(out, 2, "AMXINT8", threadpool_count=2)
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", tmp_path / "o", "--quant-method",
               "int8", "--layers", "7-9") == 2
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", tmp_path / "o", "--quant-method",
               "int8", "--layers", "x") == 2
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", tmp_path / "o", "--quant-method",
               "int8", "--layers", "1-2-3") == 2
    assert not (tmp_path / "o").exists()  # a bad argument writes nothing


def test_group_size_of_a_method_without_groups_is_noted(tmp_path, checkpoint, capsys):
    """--group-size with int8 (kt-kernel's converter takes it for every method and ignores
    it there): the same files as without it, and a note on stderr saying it was ignored."""
    base = ["--input-path", checkpoint, "--input-type", "bf16", "--quant-method", "int8", "--layers", "1"]
    assert run(*base, "--output", tmp_path / "a", "--group-size", 128) == 0
    assert "note: --group-size 128 does not apply to int8 (no k-groups: one scale per row); ignored" in (
        capsys.readouterr().err)
    assert run(*base, "--output", tmp_path / "b") == 0
    assert "does not apply" not in capsys.readouterr().err
    written = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert written and written == sorted(p.name for p in (tmp_path / "b").glob("*.safetensors"))
    for name in written:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize("extra,message", [
    (["--quant-method", "int4", "--group-size", 48], "--group-size 48: int4 takes 32, 64, 128"),
    (["--quant-method", "int8", "--threadpool-count", 0], "--threadpool-count must be >= 1, got 0"),
    (["--quant-method", "int8", "--cpuinfer-threads", 0], "--cpuinfer-threads must be 1 ... "),
    (["--quant-method", "int8", "--cpuinfer-threads", 10**6], "--cpuinfer-threads must be 1 ... "),
    (["--quant-method", "int8", "--resume-layer", -3], "--resume-layer must be a layer index >= 0, got -3"),
    (["--quant-method", "int8", "--input-type", "fp16"], "--input-type fp16, but layer 1's tensors are torch.bfloat16"),
    (["--quant-method", "int4", "--group-size", 128], "--group-size 128 must divide hidden_size 64 and "
                                                      "moe_intermediate_size 64"),
    (["--quant-method", "int8", "--threadpool-count", 3], "--threadpool-count 3 must divide moe_intermediate_size 64"),
    (["--quant-method", "int4", "--group-size", 64, "--threadpool-count", 2],
     "--threadpool-count 2 splits moe_intermediate_size 64 into parts of 32, which --group-size 64 does not divide"),
    (["--quant-method", "mxfp4", "--threadpool-count", 4],
     "--threadpool-count 4 splits moe_intermediate_size 64 into parts of 16; mxfp4 needs parts of a multiple of 32"),
])
def test_bad_arguments_exit_2_and_write_nothing(tmp_path, checkpoint, capsys, extra, message):
    out = tmp_path / "out"
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", out, *extra) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"python -m kt_ops.convert: error: {message}" or message.endswith(" ") and last.startswith(
        f"python -m kt_ops.convert: error: {message}"), last
    assert not out.exists()


def test_verification_catches_a_bad_write(tmp_path, checkpoint, monkeypatch, capsys):
    real_save = convert.save_durably

    def corrupting_save(tensors, path):
        broken = {k: v.clone() for k, v in tensors.items()}
        for v in broken.values():
            v[-1] ^= 0xFF
        real_save(broken, path)

    monkeypatch.setattr(convert, "save_durably", corrupting_save)
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", tmp_path / "a", "--quant-method",
               "int8") == 1
    assert "differs from the packed weights" in capsys.readouterr().err
    # Nothing finished: nothing left behind, so the rerun is not told the output "already holds a conversion".
    assert not (tmp_path / "a").exists()
    monkeypatch.setattr(convert, "save_durably", real_save)
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", tmp_path / "a", "--quant-method",
               "int8") == 0


def test_a_failure_after_a_finished_layer_keeps_it_for_resume(tmp_path, checkpoint, monkeypatch, capsys):
    real_save, saved = convert.save_durably, []

    def failing_second_save(tensors, path):
        if saved:
            raise OSError(28, "No space left on device", str(path))
        saved.append(path)
        real_save(tensors, path)

    monkeypatch.setattr(convert, "save_durably", failing_second_save)
    out = tmp_path / "a"
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8") == 1
    assert "No space left on device" in capsys.readouterr().err
    assert (out / MANIFEST).is_file() and (out / layer_file(1)).is_file() and not (out / layer_file(2)).exists()
    monkeypatch.setattr(convert, "save_durably", real_save)
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8",
               "--resume-layer", 2) == 0


@pytest.mark.parametrize("where", ["layer", "shard"])
def test_a_full_disk_is_one_error_line_naming_the_file(tmp_path, checkpoint, monkeypatch, capsys, where) -> None:
    """safetensors reports a failed write (a full disk) as its own ``SafetensorError``, which
    main did not catch: a traceback, naming no file. Now exit 1, one line naming the file
    (the shards, copied by write_shard, see the OSError itself)."""
    import errno

    from safetensors import SafetensorError

    from kt_ops import convert_merge

    real_save = convert_merge.save_file

    def full_disk(tensors, path, metadata=None):
        if "layer-" in os.fspath(path):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        real_save(tensors, path, metadata=metadata)

    class FullFile(io.BytesIO):
        def write(self, data) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_open(path, mode="r", *args, **kwargs):
        return FullFile() if "model-" in os.fspath(path) and "w" in mode else open(path, mode, *args, **kwargs)

    if where == "shard":
        monkeypatch.setattr(convert_merge, "open", full_open, raising=False)
    else:
        monkeypatch.setattr(convert_merge, "save_file", full_disk)
    out = tmp_path / "out"
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8") == 1
    err = capsys.readouterr().err
    name = "model-00001-of-00001" if where == "shard" else "layer-00001"
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith(f"python -m kt_ops.convert: error: {out / name}.safetensors.tmp: cannot write")
    assert "No space left on device" in err


def test_verification_catches_wrong_weights(tmp_path, checkpoint, monkeypatch, capsys):
    real_pack = convert.pack_parts
    monkeypatch.setattr(convert, "pack_parts", lambda g, u, d, *a, **k: real_pack(u, g, d, *a, **k))  # gate <-> up
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", tmp_path / "b", "--quant-method",
               "int8") == 1
    assert "from the reference" in capsys.readouterr().err


def test_a_layer_failing_verification_is_not_kept_for_resume(tmp_path, checkpoint, monkeypatch, capsys) -> None:
    """A layer whose verification failed after earlier layers were done stayed on disk as
    ``layer-00002.safetensors``: the rerun said "continue with --resume-layer 3" and that
    run finished the directory with layer 2's wrong weights. Now the file is deleted."""
    real_pack, calls = convert.pack_parts, []

    def second_layer_swapped(g, u, d, *a, **k):
        calls.append(1)
        return real_pack(u, g, d, *a, **k) if len(calls) == 2 else real_pack(g, u, d, *a, **k)  # gate <-> up

    monkeypatch.setattr(convert, "pack_parts", second_layer_swapped)
    out = tmp_path / "out"
    base = ["--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8"]
    assert run(*base) == 1
    assert "layer 2: expert 2 through the kernel" in capsys.readouterr().err
    assert (out / layer_file(1)).is_file() and not (out / layer_file(2)).exists()
    monkeypatch.setattr(convert, "pack_parts", real_pack)
    assert run(*base) == 2
    assert "continue with --resume-layer 2)" in capsys.readouterr().err
    assert run(*base, "--resume-layer", 3) == 2  # layer 2 is in no file: not silently kept
    assert run(*base, "--resume-layer", 2) == 0
    assert torch.equal(outputs(out, 2, "AMXINT8"), outputs(checkpoint, 2, "AMXINT8"))


@pytest.mark.slow
def test_command_line_entry_points(tmp_path, checkpoint):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-m", "kt_ops.convert", "--input-path", checkpoint, "--input-type",
                           "bf16", "--output", tmp_path / "cli", "--quant-method", "int8", "--layers", "1"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "1/1 layers" in done.stderr and "ETA" in done.stderr and (tmp_path / "cli" / MANIFEST).is_file()
    script = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_cpu_weights.py"), "--help"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert script.returncode == 0 and "--no-merge-safetensor" in script.stdout
    assert script.stdout.startswith("usage: convert_cpu_weights.py ")  # its own name, not python -m's
    bad = subprocess.run([sys.executable, "-m", "kt_ops.convert", "--input-path", tmp_path / "none", "--input-type",
                          "bf16", "--output", tmp_path / "x", "--quant-method", "int8"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.splitlines()[-1].startswith("python -m kt_ops.convert: error: ")


@pytest.mark.parametrize("text,message", [
    ("garbage", "config.json: not valid JSON"),
    ("[1]", "config.json: not a model config \\(expected a JSON object, got list\\)"),
    ('{"hidden_size": "abc", "moe_intermediate_size": 64}', "config.json: hidden_size 'abc' is not a positive"),
])
def test_a_damaged_config_json_exits_2_naming_it(tmp_path, weights, capsys, text, message):
    """A config.json that is not JSON, not an object, or gives a size that is not a
    number: exit 2, the file named, nothing written (it was exit 1 with a bare
    'Expecting value: ...', or an AttributeError traceback for a JSON list)."""
    source = write_checkpoint(tmp_path / "model", weights, shards=2, dense_layers=(0,))
    (source / "config.json").write_text(text)
    out = tmp_path / "out"
    assert run("--input-path", source, "--input-type", "bf16", "--output", out, "--quant-method", "int8") == 2
    assert re.search(message, capsys.readouterr().err.strip().splitlines()[-1])
    assert not out.exists()


@pytest.mark.parametrize("value", [None, "x", -1, 1.5, True])
def test_num_hidden_layers_of_config_json(tmp_path: Path, weights, capsys, value: object) -> None:
    """config.json's num_hidden_layers null, not a number or negative: a TypeError
    traceback (null), exit 1 with a bare "invalid literal for int()" naming no file
    ("x"), or a finished conversion whose manifest reads back as damaged (-1). Now null
    counts as absent, as the sizes' nulls do (the layers seen: 4), and the others exit 2
    naming config.json, with nothing written (1.5 and true were read as 1 layer)."""
    source = write_checkpoint(tmp_path / "model", weights, shards=2, dense_layers=(0,))
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_hidden_layers": value}))
    out = tmp_path / "out"
    code = run("--input-path", source, "--input-type", "bf16", "--output", out, "--quant-method", "int8")
    if value is None:
        assert code == 0 and Manifest.read(out).num_layers == 4
        return
    assert code == 2
    assert re.search("config.json: .*num_hidden_layers", capsys.readouterr().err.strip().splitlines()[-1])
    assert not out.exists()


@pytest.mark.parametrize("key,value", [("num_experts", -1), ("num_experts", 2.5), ("num_experts", True),
                                       ("hidden_size", -64), ("moe_intermediate_size", 64.5)])
def test_a_size_of_config_json_that_is_no_count_exits_2_naming_it(tmp_path: Path, weights, capsys, key: str,
                                                                   value: object) -> None:
    """config.json's expert count or sizes negative, fractional or a bool: int() truncated
    2.5 to 2 (two experts of four converted), True to 1, and -1 failed after the manifest
    was written with "expert weights need E, I, H in [1, 2^31)" (exit 1), naming no key.
    Now exit 2 naming config.json and the key, with nothing written."""
    source = write_checkpoint(tmp_path / "model", weights, shards=2, dense_layers=(0,))
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, key: value}))
    out = tmp_path / "out"
    assert run("--input-path", source, "--input-type", "bf16", "--output", out, "--quant-method", "int8") == 2
    assert re.search(f"config.json: {key} {value!r} is not a positive whole number",
                     capsys.readouterr().err.strip().splitlines()[-1])
    assert not out.exists()


def test_fewer_experts_in_config_json_than_in_the_checkpoint_are_noted(tmp_path: Path, weights, capsys) -> None:
    """config.json's expert count (the model's router) below the layers' tensors: the
    converter follows config.json, as before, but says so on stderr (it was silent)."""
    source = write_checkpoint(tmp_path / "model", weights, shards=2, dense_layers=(0,))
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_experts": E - 2}))
    out = tmp_path / "out"
    assert run("--input-path", source, "--input-type", "bf16", "--output", out, "--quant-method", "int8") == 0
    err = capsys.readouterr().err
    assert f"config.json gives {E - 2} routed experts but layer 1 of the checkpoint holds {E}" in err
    assert Manifest.read(out).num_experts == E - 2


def test_sizes_from_a_missing_down_tensor_name_it(tmp_path: Path, weights, capsys) -> None:
    """A config.json without hidden_size, the first layer's expert-0 down tensor missing:
    the sizes read from it were a bare KeyError, printed as the key alone (exit 1). Now
    exit 2, the tensor named as missing, nothing written."""
    key = "model.layers.1.mlp.experts.0.down_proj.weight"
    source = write_checkpoint(tmp_path / "model", weights, skip=(key,))
    config = json.loads((source / "config.json").read_text())
    del config["hidden_size"]
    (source / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert run("--input-path", source, "--input-type", "bf16", "--output", out, "--quant-method", "int8") == 2
    assert re.search(f"{re.escape(key)}.* is missing", capsys.readouterr().err.strip().splitlines()[-1])
    assert not out.exists()


def test_a_fifo_named_by_the_index_is_not_waited_on(tmp_path, checkpoint):
    """A FIFO where the index names a shard: --resume-layer's probe of the layers kept
    opened it to read its header and blocked for ever. It holds nothing: the layer is
    missing (exit 2). Run in a subprocess with a timeout, so that a hang fails."""
    out = tmp_path / "out"
    base = ["--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8",
            "--layers", "1-2"]
    assert run(*base) == 0
    shard = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["blk.1.part0.packed"]
    (out / shard).unlink()
    os.mkfifo(out / shard)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-m", "kt_ops.convert", *map(str, base), "--resume-layer", "2"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "layers 1 are in no layer file or shard" in done.stderr.splitlines()[-1]


def test_resuming_over_a_truncated_shard_names_it(tmp_path, checkpoint, capsys):
    """A merged shard cut short, then --resume-layer past its layers: the message said only
    that the layers were "in no layer file or shard" although the index names a shard for
    them. Now it names that shard as unreadable and the --resume-layer that converts them
    again (exit 2, nothing written)."""
    out = tmp_path / "out"
    base = ["--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8",
            "--layers", "1-2"]
    assert run(*base) == 0
    shard = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["blk.1.part0.packed"]
    size = (out / shard).stat().st_size
    with open(out / shard, "r+b") as handle:
        handle.truncate(size - 1000)
    capsys.readouterr()
    assert run(*base, "--resume-layer", "2") == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"the index names {shard} for them: unreadable" in last and "--resume-layer 1" in last, last
    assert (out / shard).stat().st_size == size - 1000


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_index_entries_outside_the_directory_are_refused(tmp_path, checkpoint, capsys, where):
    """An index entry naming a file outside the converted directory ("../x" or an absolute
    path) was followed: the wrapper loaded that file, --resume-layer read it (layer_sources)
    and then deleted it as a stale shard. Now a ValueError naming the entry, the file
    untouched; entries inside the directory (also through "..", and files of the directory
    that are symlinks to files elsewhere, as in the Hugging Face cache) keep working."""
    from kt_ops.convert_merge import layer_sources

    out = tmp_path / "out"
    base = ["--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8",
            "--layers", "1-2"]
    assert run(*base) == 0
    expected = outputs(out, 1, "AMXINT8")
    index_file = out / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = index["weight_map"]["blk.1.part0.packed"]
    outside = tmp_path / "elsewhere" / shard
    outside.parent.mkdir()
    outside.write_bytes((out / shard).read_bytes())
    entry = {"relative": f"../elsewhere/{shard}", "absolute": str(outside)}[where]
    index["weight_map"] = {k: (entry if v == shard else v) for k, v in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=re.escape(repr(entry))):
        outputs(out, 1, "AMXINT8")
    with pytest.raises(ValueError, match=re.escape(repr(entry))):
        layer_sources(out, [1], 1)
    capsys.readouterr()
    assert run(*base, "--resume-layer", 2) == 1
    assert repr(entry) in capsys.readouterr().err
    assert outside.is_file()
    index["weight_map"] = {k: (f"sub/../{shard}" if v == entry else v) for k, v in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    (out / "sub").mkdir()
    assert torch.equal(outputs(out, 1, "AMXINT8"), expected) and 1 in layer_sources(out, [1], 1)
    (out / "link.safetensors").symlink_to(outside)  # the Hugging Face cache's layout
    index["weight_map"] = {k: ("link.safetensors" if v == f"sub/../{shard}" else v) for k, v in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    assert torch.equal(outputs(out, 1, "AMXINT8"), expected) and 1 in layer_sources(out, [1], 1)


def test_a_second_run_on_the_same_output_is_refused_while_the_first_runs(tmp_path, checkpoint, capsys):
    """Two runs writing one --output at once interleaved their writes to one manifest and
    one set of layer files and shards. A run holds an exclusive flock on the directory:
    another run meanwhile exits 2, naming it, and writes nothing; a killed run's lock is
    released by the OS."""
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    base = ["--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8",
            "--layers", "1"]
    other = os.open(out, os.O_RDONLY)  # the first run, in the middle of its conversion
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert run(*base) == 2
    finally:
        os.close(other)
    assert f"--output {out} is being written by another conversion run" in capsys.readouterr().err
    assert not any(out.iterdir())
    holder = subprocess.Popen([sys.executable, "-c", f"import fcntl, os, time; fd = os.open({str(out)!r}, os.O_RDONLY); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert run(*base) == 2
    finally:
        holder.kill()
        holder.wait()
    assert run(*base) == 0  # the killed run's lock went with it
    assert Manifest.read(out).complete


@pytest.mark.parametrize("index", ["[]", '"x"', "3", '{"weight_map": []}', '{"weight_map": "shard"}', "{"])
def test_layer_sources_treats_a_malformed_index_as_none(tmp_path, index):
    """An index that is JSON but not an object (or whose weight_map is not one) raised a
    TypeError out of layer_sources (--resume-layer); like an index that is not JSON at
    all, it names no shard: the layers are looked for in their own files only."""
    from kt_ops.convert_merge import INDEX, layer_sources

    (tmp_path / INDEX).write_text(index)
    assert layer_sources(tmp_path, [0, 1], 2) == {}
