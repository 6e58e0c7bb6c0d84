"""Memory use: what the converter and the loaders hold at their peak, measured in a
fresh process (VmHWM after resetting it), against the sizes the docs promise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kt_ops.convert_merge import save_durably, save_tensors
from kt_ops.converted import layer_file, layer_key

ROOT = str(Path(__file__).resolve().parents[1])

MERGE_PROBE = r"""
import sys, torch
from pathlib import Path
from kt_ops.convert_merge import merge_layers
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
torch.zeros(1)
base = rss("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM)
merge_layers(Path(sys.argv[1]), list(range(int(sys.argv[2]))), 2, 4 << 30)
print(rss("VmHWM:") - base)
"""


def run_probe(probe: str, *args: str) -> int:
    """Runs ``probe`` in a fresh Python with kt_ops importable; returns the last number it printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-c", probe, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.slow
def test_merging_layer_files_streams_them(tmp_path: Path) -> None:
    """The converter's merge read every layer of a shard into memory (up to the 4 GiB
    shard cap) before writing it: 6 layers of 32 MiB peaked at +192 MiB, more than any
    layer's conversion. It streams now; the shard's bytes are what save_file wrote."""
    layers, parts, nbytes = 6, 2, 16 << 20
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        blobs = {layer_key(layer, p): torch.randint(0, 256, (nbytes + 8 * layer + p,), generator=g,
                                                    dtype=torch.uint8) for p in range(parts)}
        save_durably(blobs, tmp_path / layer_file(layer))
        tensors.update(blobs)
    peak = run_probe(MERGE_PROBE, str(tmp_path), str(layers))
    assert peak < parts * nbytes, f"peak {peak / 2**20:.0f} MiB for layers of {parts * nbytes / 2**20:.0f} MiB"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-00001-of-00001.safetensors",
                                                         "model.safetensors.index.json"]
    save_tensors(tensors, tmp_path / "expected.safetensors")
    shard, expected = (tmp_path / name for name in ("model-00001-of-00001.safetensors", "expected.safetensors"))
    assert shard.read_bytes() == expected.read_bytes()


INT4_PROBE = r"""
import sys, torch
from kt_ops.hf_checkpoint import HfCheckpoint
from kt_ops.hf_int4 import load_int4_experts
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
checkpoint = HfCheckpoint(sys.argv[1])
E, H, I = map(int, sys.argv[2:5])
torch.zeros(1)
base = rss("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM)
load_int4_experts(checkpoint, 1, list(range(E)), H, I)
print(rss("VmHWM:") - base)
"""


@pytest.mark.slow
def test_reading_an_int4_layer_holds_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_int4_experts read every expert of the layer before stacking them: the layer twice
    at its peak (2.24x the checkpoint's bytes, GPTQ). Each expert's copy is dropped once
    stacked (1.25x measured)."""
    import test_int4_checkpoint as int4

    E, H, I = 16, 2048, 1024
    for name, value in (("E", E), ("H", H), ("I", I)):
        monkeypatch.setattr(int4, name, value)
    path, _ = int4.write_int4_checkpoint(tmp_path, "GPTQ_INT4")
    stored = (path / "model.safetensors").stat().st_size
    peak = run_probe(INT4_PROBE, str(path), str(E), str(H), str(I))
    assert peak < 1.6 * stored, f"peak {peak / stored:.2f}x the checkpoint's {stored / 2**20:.0f} MiB"
