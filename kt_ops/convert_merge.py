"""The converter's output files, written so that a crash at any point can be resumed.

A converted directory holds each layer either in its own ``layer-{L:05d}.safetensors``
(while converting, or with ``--no-merge-safetensor``) or in a merged shard named by
``model.safetensors.index.json``. Every file is written under a temporary name, flushed
to disk (``fsync``) and renamed, and a layer file is deleted only after the shards and
the index that hold its tensors are in place:

1. layers held only by an earlier run's shards are copied back into layer files;
2. the new shards are written (temporary names, fsync), then renamed;
3. the index is written (temporary name, fsync), then renamed;
4. the layer files and the shards no longer named by the index are deleted.

A crash before 3 leaves every layer in a layer file; after it, every layer is in a shard
the index names: :func:`layer_sources` finds each layer wherever it is, so
``--resume-layer`` always has what it needs.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kt_ops._validate import regular_file_stat
from kt_ops.converted import INDEX, entry_path, layer_file, layer_key
from kt_ops.mapped_files import read_safetensors_header, safetensors_range

METADATA = {"producer": "kt_ops"}
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # the names merge_layers gives its shards
_COPY_CHUNK = 16 << 20  # write_shard's buffer


def fsync_path(path: Path) -> None:
    """Flushes a file (or a directory's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``save_file`` with kt_ops' metadata; a failed write (a full disk) is an ``OSError``
    naming ``path``, not safetensors' own exception (which names no file). A write that
    fails or is interrupted (Ctrl-C) midway deletes the part of ``path`` it wrote (the
    space a full disk needs back; a leftover kept a failed first layer's directory)."""
    try:
        save_file(tensors, os.fspath(path), metadata=METADATA)
    except BaseException as error:
        path.unlink(missing_ok=True)
        if isinstance(error, SafetensorError):
            raise OSError(f"{path}: cannot write it: {error}") from None
        raise


def write_shard(path: Path, sources: dict[str, Path]) -> None:
    """A safetensors file of the 1-D uint8 tensors ``sources`` names (key -> the safetensors
    file holding it under that key), byte for byte what :func:`save_tensors` writes for
    them, their bytes copied through one 16 MiB buffer: a merge holds no shard in memory
    (it held a whole one, up to the 4 GiB cap). Failures as :func:`save_tensors`."""
    headers: dict[Path, tuple[dict, int]] = {}
    ranges: dict[str, tuple[int, int]] = {}
    for key in sorted(sources):  # save_file's order: by name (one dtype)
        file = sources[key]
        if file not in headers:
            headers[file] = read_safetensors_header(file)
        ranges[key] = safetensors_range(file, key, headers[file])
    entries: dict[str, object] = {"__metadata__": METADATA}
    begin = 0
    for key, (_, nbytes) in ranges.items():
        entries[key] = {"dtype": "U8", "shape": [nbytes], "data_offsets": [begin, begin + nbytes]}
        begin += nbytes
    header = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    header += b" " * (-len(header) % 8)  # the data 8-byte aligned, as safetensors pads it
    buffer = memoryview(bytearray(min(_COPY_CHUNK, max(begin, 1))))
    try:
        with open(path, "wb") as target:
            target.write(struct.pack("<Q", len(header)) + header)
            for key, (offset, nbytes) in ranges.items():
                with open(sources[key], "rb") as source:
                    source.seek(offset)
                    while nbytes:
                        read = source.readinto(buffer[:min(nbytes, len(buffer))])
                        if not read:
                            raise OSError(f"{sources[key]} is truncated: tensor {key!r} ends early")
                        target.write(buffer[:read])
                        nbytes -= read
    except BaseException as error:
        path.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise OSError(f"{path}: cannot write it: {error}") from None
        raise


def save_durably(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``save_file`` under ``path.tmp``, fsync, rename to ``path``, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    save_tensors(tensors, tmp)
    _rename_durably(tmp, path)


def write_text_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _rename_durably(tmp, path)


def _rename_durably(tmp: Path, path: Path) -> None:
    """fsync ``tmp``, rename it to ``path``, fsync the directory. A flush that fails or is
    interrupted (Ctrl-C during the seconds a GB-sized file takes) deletes ``tmp``: a whole
    layer's bytes, and a fresh run's output directory no longer empty, were left behind."""
    try:
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_index(out: Path, files: dict[str, str], nbytes: int) -> None:
    """``model.safetensors.index.json``: tensor key -> file, and the total size."""
    index = {"metadata": {"total_size": nbytes}, "weight_map": files}
    write_text_durably(out / INDEX, json.dumps(index, indent=2) + "\n")


def _has_keys(path: Path, keys: list[str]) -> bool:
    """Whether ``path`` is a safetensors file holding ``keys``; a FIFO or device there
    (which opening would wait on for ever) holds nothing."""
    try:
        regular_file_stat(path)
        with safe_open(os.fspath(path), framework="pt") as handle:
            return set(keys) <= set(handle.keys())
    except Exception:  # noqa: BLE001 - an unreadable or partial file holds nothing
        return False


def _weight_map(out: Path) -> dict[str, str]:
    """``out``'s index: tensor key -> file name (empty where there is no readable index)."""
    weight_map: object = {}
    if (out / INDEX).is_file():
        try:
            weight_map = json.loads((out / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):  # not JSON, no weight_map, not an object
            weight_map = {}
    return weight_map if isinstance(weight_map, dict) else {}


def layer_sources(out: Path, layers: list[int], parts: int) -> dict[int, Path]:
    """Where each of ``layers`` is stored in ``out``: its layer file, else the shard the
    index names for it (each only if it holds all of the layer's parts). Layers found
    nowhere are left out. ``ValueError`` naming the entry where the index names a file
    outside ``out`` for one of them (:func:`kt_ops.converted.entry_path`): it was read,
    and then deleted as a stale shard."""
    weight_map = _weight_map(out)
    sources: dict[int, Path] = {}
    for layer in layers:
        keys = [layer_key(layer, p) for p in range(parts)]
        own = out / layer_file(layer)
        if own.is_file() and _has_keys(own, keys):
            sources[layer] = own
        elif keys[0] in weight_map and _has_keys(shard := entry_path(out, weight_map[keys[0]]), keys):
            sources[layer] = shard
    return sources


def missing_layers(out: Path, missing: list[int]) -> str:
    """Says that ``missing`` (sorted) are in no layer file or shard of ``out``: which shard
    the index names for them where it names one (it could not be read, or lacks them), and
    the ``--resume-layer`` that converts them again."""
    named = _weight_map(out)
    shards = sorted({str(named[key]) for key in (layer_key(layer, 0) for layer in missing) if key in named})
    damaged = (f" (the index names {', '.join(shards)} for them: unreadable, truncated or without them)"
               if shards else "")
    return (f"layers {', '.join(map(str, missing))} are in no layer file or shard of {out}{damaged}; convert them "
            f"again: --resume-layer {missing[0]}")


def layer_file_name(path: Path) -> str:
    """``path``'s name if it is a layer file (``layer-00003.safetensors``), else ``""``."""
    stem = path.name.removesuffix(".safetensors")
    return path.name if stem.startswith("layer-") and stem[6:].isdigit() else ""


def _tensors(path: Path, layer: int, parts: int) -> dict[str, torch.Tensor]:
    with safe_open(os.fspath(path), framework="pt") as handle:
        return {layer_key(layer, p): handle.get_tensor(layer_key(layer, p)) for p in range(parts)}


def merge_layers(out: Path, layers: list[int], parts: int, max_shard_bytes: int) -> dict[str, str]:
    """The layers' files -> shards of up to ``max_shard_bytes``, then the index; returns
    tensor key -> shard name. Crash-safe in the order of the module docstring."""
    old_shards = _unmerge(out, layers, parts)  # 1.
    groups: list[list[int]] = [[]]
    size = 0
    for layer in layers:
        nbytes = (out / layer_file(layer)).stat().st_size
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(layer)
        size += nbytes
    weight_map: dict[str, str] = {}
    names = []
    try:
        for i, group in enumerate(groups):  # 2. shards under temporary names, then renamed
            name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            names.append(name)
            sources = {layer_key(layer, p): out / layer_file(layer) for layer in group for p in range(parts)}
            write_shard(out / (name + ".tmp"), sources)
            fsync_path(out / (name + ".tmp"))
            weight_map.update({key: name for key in sources})
        for name in names:
            os.replace(out / (name + ".tmp"), out / name)
    except BaseException:  # a failed or interrupted merge (Ctrl-C) leaves no shard-sized temporaries
        for name in names:
            (out / (name + ".tmp")).unlink(missing_ok=True)
        raise
    fsync_path(out)
    nbytes = sum((out / name).stat().st_size for name in names)
    write_index(out, weight_map, nbytes)  # 3.
    for layer in layers:  # 4.
        (out / layer_file(layer)).unlink()
    _clean(out, old_shards - {out / name for name in names})
    return weight_map


def index_layer_files(out: Path, layers: list[int], parts: int) -> dict[str, str]:
    """``--no-merge-safetensor``: every layer in its layer file, the index naming them;
    returns tensor key -> file name. Crash-safe as :func:`merge_layers`."""
    old_shards = _unmerge(out, layers, parts)
    weight_map = {layer_key(layer, p): layer_file(layer) for layer in layers for p in range(parts)}
    write_index(out, weight_map, sum((out / layer_file(layer)).stat().st_size for layer in layers))
    _clean(out, old_shards)
    return weight_map


def _unmerge(out: Path, layers: list[int], parts: int) -> set[Path]:
    """Gives every layer its layer file back (copied from an earlier run's shard where it
    has none); returns the earlier run's shards: those read here and every other shard
    this module writes that its index names (each layer converted again, none is read, yet
    they are stale once the new index is in place)."""
    sources = layer_sources(out, layers, parts)
    missing = [layer for layer in layers if layer not in sources]
    if missing:
        raise FileNotFoundError(missing_layers(out, missing))
    for layer in layers:
        if sources[layer].name != layer_file(layer):
            save_durably(_tensors(sources[layer], layer, parts), out / layer_file(layer))
    named = {out / name for name in _weight_map(out).values() if isinstance(name, str) and SHARD.fullmatch(name)}
    return {path for path in {*sources.values(), *named} if path.name != layer_file_name(path)}


def _clean(out: Path, stale: set[Path]) -> None:
    """Deletes shards the index no longer names and interrupted runs' temporaries."""
    for path in stale:
        path.unlink(missing_ok=True)
    for tmp in out.glob("*.tmp"):
        if tmp.name.startswith(("model-", "layer-", INDEX)):
            tmp.unlink(missing_ok=True)
    fsync_path(out)
