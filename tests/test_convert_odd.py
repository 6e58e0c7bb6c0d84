"""The converter on odd inputs and interrupted runs: what a failed or interrupted write
leaves behind, checkpoints with a multi-token-prediction layer, outputs read back."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_helpers import make_weights, write_checkpoint
from safetensors import SafetensorError

from kt_ops import convert, convert_merge

E, H, I = 4, 64, 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("hf") / "model", make_weights([0, 1, 2], E, H, I, seed=5))


def run(*args: object) -> int:
    return convert.main([str(a) for a in args])


@pytest.mark.parametrize("error", [SafetensorError("I/O error: No space left on device (os error 28)"),
                                   KeyboardInterrupt()])
@pytest.mark.parametrize("where", ["layer-00000", "layer-00001", "model-"])
def test_a_write_that_fails_midway_leaves_no_partial_file(tmp_path, checkpoint, monkeypatch, error, where) -> None:
    """A full disk or Ctrl-C while safetensors writes a file leaves the part written under
    its temporary name: it took the disk space a rerun needs, and a new conversion failing
    on its first layer kept the output directory it had made (not empty) although the
    docs say it removes it. The partial temporary is deleted (a shard, copied by
    write_shard, fails as its file's write: an OSError for a full disk)."""
    real_save = convert_merge.save_file

    def partial_write(tensors, path, metadata=None) -> None:
        if os.path.basename(path).startswith(where):
            Path(path).write_bytes(b"\0" * 100)  # what reached the disk
            raise error
        real_save(tensors, path, metadata=metadata)

    class PartialFile(io.FileIO):
        def write(self, data) -> int:
            super().write(b"\0" * 100)  # what reached the disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if isinstance(error, SafetensorError) else error

    def partial_open(path, mode="r", *args, **kwargs):
        if os.path.basename(path).startswith(where) and "w" in mode:
            return PartialFile(path, "wb")
        return open(path, mode, *args, **kwargs)

    if where == "model-":
        monkeypatch.setattr(convert_merge, "open", partial_open, raising=False)
    else:
        monkeypatch.setattr(convert_merge, "save_file", partial_write)
    out = tmp_path / "out"
    args = ("--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8")
    if isinstance(error, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            run(*args)
    else:
        assert run(*args) == 1
    if where == "layer-00000":  # nothing converted: the directory this run made is gone
        assert not out.exists()
        return
    assert not list(out.glob("*.tmp"))
    monkeypatch.undo()
    resume = 3 if where == "model-" else 1
    assert run(*args, "--resume-layer", resume) == 0


@pytest.mark.parametrize("text", ["garbage", '{"format_version": 2}'])
@pytest.mark.parametrize("resume", [[], ["--resume-layer", 1]])
def test_an_output_with_an_unreadable_manifest_exits_2(tmp_path, checkpoint, capsys, text, resume) -> None:
    """An output whose kt_ops_manifest.json is damaged or of another format version is a bad
    path found before anything is written: exit 2 with the usage line, as the docs say for an
    output holding another conversion, not 1 (a failed conversion step)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "kt_ops_manifest.json").write_text(text)
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8",
               *resume) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and "kt_ops_manifest.json" in err.splitlines()[-1]
    assert sorted(p.name for p in out.iterdir()) == ["kt_ops_manifest.json"]
    assert (out / "kt_ops_manifest.json").read_text() == text


@pytest.mark.parametrize("second", ["no_merge", "more_shards"])
def test_reconverting_every_layer_leaves_no_stale_shard(tmp_path, checkpoint, monkeypatch, second) -> None:
    """A rerun over a finished merged conversion that converts every layer again
    (``--resume-layer 0``) took the old shards for stale only where a layer was still read
    from one: none was, so shards the new index no longer names stayed on disk (a second
    copy of the model's experts), with ``--no-merge-safetensor`` or a new shard count."""
    from kt_ops.converted import INDEX

    out = tmp_path / "out"
    args = ("--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8")
    assert run(*args) == 0
    assert [p.name for p in out.glob("model-*")] == ["model-00001-of-00001.safetensors"]
    extra: tuple[str, ...] = ("--no-merge-safetensor",)
    if second == "more_shards":
        monkeypatch.setattr(convert, "MAX_SHARD_BYTES", 1)  # a shard per layer
        extra = ()
    assert run(*args, "--resume-layer", 0, *extra) == 0
    named = set(json.loads((out / INDEX).read_text())["weight_map"].values())
    on_disk = {p.name for p in out.glob("*.safetensors")}
    assert on_disk == named


def test_inspect_says_a_finished_conversion_without_its_index_cannot_load(tmp_path, checkpoint) -> None:
    """A finished conversion whose model.safetensors.index.json is gone: every
    KTMoEWrapper load raises (FileNotFoundError naming the index), but kt-ops inspect read the
    layer files as an unfinished conversion's and reported nothing amiss."""
    from kt_ops import KTMoEWrapper
    from kt_ops.converted import INDEX
    from kt_ops.inspection import inspect_weights

    out = tmp_path / "out"
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8",
               "--no-merge-safetensor") == 0
    (out / INDEX).unlink()
    with pytest.raises(FileNotFoundError, match=INDEX):
        KTMoEWrapper(1, E, 2, H, I, weight_path=out, method="AMXINT8").load_weights()
    notes = " ".join(inspect_weights(out).notes)
    assert INDEX in notes and "loading" in notes and "--resume-layer 3" in notes
    assert run("--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8",
               "--no-merge-safetensor", "--resume-layer", 3) == 0  # what the note says to run
    KTMoEWrapper(1, E, 2, H, I, weight_path=out, method="AMXINT8").load_weights()
    assert not inspect_weights(out).notes


def test_a_multi_token_prediction_layer_is_converted_and_named_by_inspect(tmp_path) -> None:
    """DeepSeek-V3 / GLM-4.5 store their multi-token-prediction layer's experts as
    ``model.layers.{num_hidden_layers}`` (config.json ``num_nextn_predict_layers``): the
    converter converts it like any layer (SGLang's draft layer runs it as that layer_idx),
    reading back as the checkpoint computes; kt-ops inspect printed "3 in the model, 3 with
    routed experts (1-3)" saying nothing of layer 3 lying past the model's layers."""
    import torch

    from kt_ops import KTMoEWrapper
    from kt_ops.inspection import inspect_weights

    src = write_checkpoint(tmp_path / "m", make_weights([1, 2, 3], E, H, I, seed=6), dense_layers=(0,))
    config = json.loads((src / "config.json").read_text())
    config.update(num_hidden_layers=3, num_nextn_predict_layers=1, first_k_dense_replace=1)
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert run("--input-path", src, "--input-type", "bf16", "--output", out, "--quant-method", "int8") == 0
    x, ids, w = torch.randn(3, H), torch.tensor([[0, 3], [1, 2], [3, 0]]), torch.rand(3, 2)
    got = [KTMoEWrapper(3, E, 2, H, I, weight_path=p, method="AMXINT8") for p in (out, src)]
    for wrapper in got:
        wrapper.load_weights()
    assert torch.equal(got[0].forward(x, ids, w), got[1].forward(x, ids, w))
    for path in (src, out):
        notes = " ".join(inspect_weights(path).notes)
        assert "layers 3: past num_hidden_layers 3" in notes and "num_nextn_predict_layers 1" in notes


def test_an_unfinished_conversion_of_another_method_is_not_offered_for_resuming(tmp_path, checkpoint,
                                                                               capsys) -> None:
    """An output holding an interrupted int8 conversion, a run of another method there: the
    refusal said "continue with --resume-layer 1", and that run was then refused too (the
    earlier run used a different format). It now names the earlier run's settings instead."""
    from kt_ops.converted import Manifest, layer_file

    out = tmp_path / "out"
    base = ("--input-path", checkpoint, "--input-type", "bf16", "--output", out)
    assert run(*base, "--quant-method", "int8", "--no-merge-safetensor") == 0
    (out / layer_file(1)).unlink()  # interrupted while writing layer 1
    Manifest(**{**Manifest.read(out).__dict__, "complete": False}).write(out)
    capsys.readouterr()
    assert run(*base, "--quant-method", "int8") == 2
    assert "continue with --resume-layer 1" in capsys.readouterr().err
    for other in (("--quant-method", "int4", "--group-size", 32), ("--quant-method", "int8", "--threadpool-count", 2)):
        assert run(*base, *other) == 2
        last = capsys.readouterr().err.splitlines()[-1]
        assert "--resume-layer 1" not in last and "different" in last, last


def test_layers_matching_no_moe_layer_lists_the_moe_layers_as_they_are(tmp_path, capsys) -> None:
    """MoE layers 1 and 3 with dense layers between (decoder_sparse_step 2, mlp_only_layers):
    --layers 2 was refused with "layers with experts: 1-3", as if layer 2 had some."""
    src = write_checkpoint(tmp_path / "m", make_weights([1, 3], E, H, I, seed=7), dense_layers=(0, 2))
    assert run("--input-path", src, "--input-type", "bf16", "--output", tmp_path / "o", "--quant-method", "int8",
               "--layers", 2) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("(layers with experts: 1, 3)")


def test_config_json_is_written_durably_and_stale_temporaries_go(tmp_path, checkpoint, monkeypatch) -> None:
    """config.json was copied straight to its name (a crash mid-copy left a truncated one,
    though the module says every file goes to disk under a temporary name). The ``.tmp`` an
    interrupted manifest or config.json write leaves is written over and renamed by the next
    run's own durable writes."""
    out = tmp_path / "out"
    args = ("--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8")
    written: list[str] = []
    real_replace = os.replace
    monkeypatch.setattr(convert_merge.os, "replace", lambda a, b: written.append(Path(b).name) or real_replace(a, b))
    assert run(*args) == 0
    assert "config.json" in written
    assert (out / "config.json").read_bytes() == (checkpoint / "config.json").read_bytes()
    for name in ("kt_ops_manifest.json.tmp", "config.json.tmp"):
        (out / name).write_text("{")  # what an interrupted write left
    assert run(*args, "--resume-layer", 3) == 0  # finishes it again (every layer written)
    assert not list(out.glob("*.tmp"))


# Runs a converter entry point as its own program (as __main__), with Ctrl-C pressed while
# the second layer is written: layer 0 stays done, layer 1 is never written.
_INTERRUPTED = """
import runpy, sys
from pathlib import Path
from kt_ops import convert_merge
real = convert_merge.save_durably
def save_durably(tensors, path):
    if Path(path).name == "layer-00001.safetensors":
        raise KeyboardInterrupt
    real(tensors, path)
convert_merge.save_durably = save_durably
entry, sys.argv = sys.argv[1], sys.argv[1:]
if entry.endswith(".py"):
    runpy.run_path(entry, run_name="__main__")
else:
    runpy.run_module(entry, run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("entry,args,prog", [
    ("kt_ops.convert", [], "python -m kt_ops.convert"),
    ("scripts/convert_cpu_weights.py", [], "convert_cpu_weights.py"),
    ("kt_ops", ["convert"], "kt-ops"),
])
def test_ctrl_c_exits_130_with_one_line_and_stays_resumable(tmp_path, checkpoint, entry, args, prog) -> None:
    """Ctrl-C in a conversion run as a program exits 130 with one line on stderr, no
    traceback (python -m kt_ops.convert and scripts/convert_cpu_weights.py printed
    KeyboardInterrupt's), leaves no temporary file, and the run resumes from the layer it
    was converting."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
    out = tmp_path / "out"
    convert_args = ["--input-path", str(checkpoint), "--input-type", "bf16", "--output", str(out),
                    "--quant-method", "int8"]
    entry = str(root / entry) if entry.endswith(".py") else entry
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED, entry, *args, *convert_args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr
    assert done.stderr.rstrip("\n").splitlines()[-1] == f"{prog}: interrupted"
    assert sorted(p.name for p in out.iterdir()) == ["kt_ops_manifest.json", "layer-00000.safetensors"]
    assert run(*convert_args, "--resume-layer", 1) == 0


@pytest.mark.parametrize("where", ["layer-00000", "layer-00001", "model-00001", "config.json", "model.safetensors"])
def test_ctrl_c_while_a_file_is_flushed_leaves_no_temporary(tmp_path, checkpoint, monkeypatch, where) -> None:
    """Ctrl-C after a file is written under its temporary name, while it is flushed to disk
    (fsync of a GB-sized layer or shard takes seconds), left that temporary behind: a whole
    layer's or shard's bytes, and a fresh run's output directory (no longer empty) although
    the docs say a conversion failing on its first layer removes it. Each durable write now
    deletes its temporary when it does not complete."""
    real_fsync = convert_merge.fsync_path

    def interrupted_fsync(path) -> None:
        if Path(path).name.startswith(where) and Path(path).name.endswith(".tmp"):
            raise KeyboardInterrupt
        real_fsync(path)

    monkeypatch.setattr(convert_merge, "fsync_path", interrupted_fsync)
    out = tmp_path / "out"
    args = ("--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8")
    with pytest.raises(KeyboardInterrupt):
        run(*args)
    if where == "layer-00000":  # nothing converted: the directory this run made is gone
        assert not out.exists()
        return
    assert not list(out.glob("*.tmp"))
    monkeypatch.undo()
    assert run(*args, "--resume-layer", 1 if where == "layer-00001" else 3) == 0


# A converter run whose first layer's write stops midway (its part on disk) until a signal comes.
_STOPPED_WRITE = """
import runpy, sys, time
from pathlib import Path
from kt_ops import convert_merge
def save_file(tensors, path, metadata=None):
    Path(path).write_bytes(bytes(100))
    print("writing", file=sys.stderr, flush=True)
    time.sleep(120)
convert_merge.save_file = save_file
sys.argv = ["kt_ops.convert", *sys.argv[1:]]
runpy.run_module("kt_ops.convert", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_sigterm_cleans_up_as_ctrl_c_does(tmp_path, checkpoint) -> None:
    """SIGTERM (kill, timeout, a job scheduler, docker stop) ended the converter at once:
    the part of the layer being written stayed under its temporary name, and a fresh run's
    output directory kept its manifest, so the rerun was refused ("already holds an
    unfinished conversion"). It now unwinds as Ctrl-C does: exit status 143, one line."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-c", _STOPPED_WRITE, "--input-path", str(checkpoint),
                                "--input-type", "bf16", "--output", str(out), "--quant-method", "int8"],
                               env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while "writing" not in (line := process.stderr.readline()):
            assert line, "".join(lines)
            lines.append(line)
        process.send_signal(signal.SIGTERM)
        err = process.communicate(timeout=60)[1]
    finally:
        process.kill()
    assert process.returncode == 143 and "Traceback" not in err, err
    assert err.rstrip("\n").splitlines()[-1] == "python -m kt_ops.convert: terminated"
    assert not out.exists()


@pytest.mark.parametrize("merge", [[], ["--no-merge-safetensor"]])
def test_a_finished_conversion_resumed_and_interrupted_still_loads(tmp_path, checkpoint, monkeypatch, merge) -> None:
    """--resume-layer on a finished conversion (layers converted again) rewrote its manifest
    as unfinished before its first layer: Ctrl-C then left a directory whose every file was
    intact but which no longer loaded ("the conversion did not finish"). The manifest stays
    as it was until the new run's files are in place."""
    import torch

    from kt_ops import KTMoEWrapper

    out = tmp_path / "out"
    args = ("--input-path", checkpoint, "--input-type", "bf16", "--output", out, "--quant-method", "int8", *merge)
    assert run(*args) == 0

    def outputs(layer: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(layer)
        wrapper = KTMoEWrapper(layer, E, 2, H, I, weight_path=out, method="AMXINT8")
        wrapper.load_weights()
        return wrapper.forward(torch.randn(3, H, generator=g), torch.tensor([[0, 1], [2, 3], [1, 2]]),
                               torch.rand(3, 2, generator=g))

    before = [outputs(layer) for layer in (0, 1, 2)]
    real_save = convert_merge.save_durably

    def interrupted_save(tensors, path) -> None:
        if path.name == "layer-00002.safetensors":
            raise KeyboardInterrupt
        real_save(tensors, path)

    monkeypatch.setattr(convert, "save_durably", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        run(*args, "--resume-layer", 1)
    assert all(torch.equal(outputs(layer), want) for layer, want in zip((0, 1, 2), before))
    monkeypatch.undo()
    assert run(*args, "--resume-layer", 1) == 0
    assert all(torch.equal(outputs(layer), want) for layer, want in zip((0, 1, 2), before))
