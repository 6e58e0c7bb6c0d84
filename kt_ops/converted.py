"""Converted CPU-weight directories (written by ``python -m kt_ops.convert``).

A directory holds ``kt_ops_manifest.json``, the source model's ``config.json`` and the
packed experts as safetensors: per layer ``L`` and intermediate part ``p`` (of
``threadpool_count``) one uint8 tensor ``blk.{L}.part{p}.packed`` — a
:class:`~kt_ops.PackedExperts` blob. Either one file per layer (``layer-00003.safetensors``,
``--no-merge-safetensor``) or shards ``model-0000i-of-0000N.safetensors``; in both cases
``model.safetensors.index.json`` maps each key to its file (a file of the directory: an
entry resolving outside it is refused, :func:`entry_path`). Blobs are memory-mapped when
loaded, not copied.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from kt_ops._validate import is_int, names_file_inside
from kt_ops.mapped_files import load_uint8_tensor
from kt_ops.packed import PackedExperts

MANIFEST = "kt_ops_manifest.json"
INDEX = "model.safetensors.index.json"
FORMAT_VERSION = 1


def layer_key(layer: int, part: int) -> str:
    return f"blk.{layer}.part{part}.packed"


def layer_file(layer: int) -> str:
    return f"layer-{layer:05d}.safetensors"


@dataclass(frozen=True)
class Manifest:
    """What ``kt_ops_manifest.json`` records about a conversion."""

    method: str  # "int8" or "int4"
    format: str  # packed format: "int8", "int4"
    group_size: int  # int4 k-group (0 for int8)
    num_layers: int  # layers of the source model
    layers: tuple[int, ...]  # layers converted (those with routed experts, in --layers)
    num_experts: int
    hidden_size: int
    intermediate_size: int
    threadpool_count: int  # parts the intermediate dimension is split into
    complete: bool  # False while a conversion runs or after it crashed
    source: dict

    def to_json(self) -> dict:
        return {"format_version": FORMAT_VERSION, "producer": "kt_ops", **{
            "method": self.method, "format": self.format, "group_size": self.group_size,
            "num_layers": self.num_layers, "layers": list(self.layers), "num_experts": self.num_experts,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "threadpool_count": self.threadpool_count, "complete": self.complete, "source": self.source}}

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Manifest:
        file = Path(path) / MANIFEST
        try:
            data = json.loads(file.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{file}: not a kt_ops manifest (not JSON: {error})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{file}: not a kt_ops manifest (expected a JSON object, got {type(data).__name__})")
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{file}: format_version {data.get('format_version')!r}, this kt_ops reads {FORMAT_VERSION}")
        missing = next((key for key in _MANIFEST_TYPES if key not in data), None)
        if missing is not None:
            raise ValueError(f"{file}: damaged kt_ops manifest (no {missing!r})")
        # Each value of its JSON type: str(), int() and bool() took "complete": "false" as
        # complete, layer 0.7 as 0, intermediate_size 32.9 as 32 and method 5 as "5".
        for key, kind in _MANIFEST_TYPES.items():
            value = data[key]
            good = is_int(value) if kind is int else isinstance(value, kind)
            if key == "layers" and good:
                good = all(is_int(v) for v in value)
            if not good:
                raise ValueError(f"{file}: damaged kt_ops manifest ({key} is {value!r}, not "
                                 f"{'a list of ints' if key == 'layers' else kind.__name__})")
        source = data.get("source", {})
        if not isinstance(source, dict):
            raise ValueError(f"{file}: damaged kt_ops manifest (source is {source!r}, not an object)")
        manifest = cls(data["method"], data["format"], data["group_size"], data["num_layers"], tuple(data["layers"]),
                       data["num_experts"], data["hidden_size"], data["intermediate_size"], data["threadpool_count"],
                       data["complete"], dict(source))
        counts = {"num_experts": 1, "hidden_size": 1, "intermediate_size": 1, "threadpool_count": 1, "group_size": 0,
                  "num_layers": 0}
        bad = [f"{name} {getattr(manifest, name)}" for name, low in counts.items() if getattr(manifest, name) < low]
        bad += [f"layer {L}" for L in manifest.layers if L < 0][:1]
        if bad:
            raise ValueError(f"{file}: damaged kt_ops manifest ({', '.join(bad)} out of range)")
        if manifest.intermediate_size % manifest.threadpool_count:  # the converter splits I in equal parts
            raise ValueError(f"{file}: damaged kt_ops manifest (threadpool_count {manifest.threadpool_count} does "
                             f"not divide intermediate_size {manifest.intermediate_size})")
        return manifest

    def write(self, path: str | os.PathLike[str]) -> None:
        """Writes the manifest durably (temporary file, fsync, rename, fsync of the directory):
        a power loss leaves the old manifest or the new one, never an empty file."""
        from kt_ops.convert_merge import write_text_durably  # it imports this module

        write_text_durably(Path(path) / MANIFEST, json.dumps(self.to_json(), indent=2) + "\n")


# The manifest's keys and JSON types, in the order Manifest takes them.
_MANIFEST_TYPES: dict[str, type] = {
    "method": str, "format": str, "group_size": int, "num_layers": int, "layers": list, "num_experts": int,
    "hidden_size": int, "intermediate_size": int, "threadpool_count": int, "complete": bool,
}


def is_converted(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_weight_map(path: str | os.PathLike[str]) -> dict[str, str]:
    """The ``weight_map`` (tensor key -> file name) of a converted directory's index:
    ``FileNotFoundError`` when it is missing, ``ValueError`` naming it when it is damaged."""
    from kt_ops.hf_checkpoint import _read_weight_map

    index = Path(path) / INDEX
    if not index.is_file():
        raise FileNotFoundError(f"{index} is missing: a converted directory names its files there "
                                "(an unfinished conversion? rerun the converter with --resume-layer)")
    return _read_weight_map(index)


def entry_path(root: Path, name: object) -> Path:
    """``root / name`` for a file name of the index (``weight_map``): ``ValueError`` naming
    the entry when it does not name a file inside ``root`` — an absolute path, or one whose
    ``..`` leads out of the directory (``sub/../shard`` is fine). The index names files of
    the directory; any other file would be read (and the converter's resume deleted it as a
    stale shard). A file of the directory that is a symlink is followed, as
    :class:`~kt_ops.hf_checkpoint.HfCheckpoint` follows them: a directory downloaded into the
    Hugging Face cache is symlinks to its ``blobs/`` (deleting a stale shard removes the link,
    never its target)."""
    if not names_file_inside(name):
        raise ValueError(f"{root / INDEX}: entry {name!r} points outside the converted directory {root}; "
                         "the index names files of the directory only")
    return root / name


def load_converted_layer(path: str | os.PathLike[str], layer: int,
                         copy: bool = False) -> tuple[Manifest, list[PackedExperts]]:
    """The manifest and layer ``layer``'s packed parts: memory-mapped and watched for
    changes on disk (:mod:`kt_ops.mapped_files`), or read into RAM with ``copy=True``.

    Raises ``ValueError`` for an incomplete conversion, an index entry outside the
    directory (:func:`entry_path`) or a blob that is not what the manifest says (format,
    group size, sizes: a file of another conversion), and ``KeyError`` naming the key
    of a layer that was not converted or whose tensor is missing.
    """
    root = Path(path)
    manifest = Manifest.read(root)
    if not manifest.complete:
        raise ValueError(f"{root}: the conversion did not finish (manifest says complete=false); "
                         "rerun the converter with --resume-layer")
    if layer not in manifest.layers:
        raise KeyError(f"{root}: layer {layer} was not converted ({layer_key(layer, 0)!r} missing); "
                       f"converted layers: {', '.join(map(str, manifest.layers)) or 'none'}")
    weight_map = read_weight_map(root)
    parts = []
    for part in range(manifest.threadpool_count):
        key = layer_key(layer, part)
        if key not in weight_map:
            raise KeyError(f"{root}: tensor {key!r} is missing from {INDEX}")
        file = entry_path(root, weight_map[key])  # ValueError outside the directory
        packed = PackedExperts(load_uint8_tensor(file, key, copy=copy))
        _check_part(file, key, packed, manifest)
        parts.append(packed)
    return manifest, parts


def _check_part(file: Path, key: str, packed: PackedExperts, manifest: Manifest) -> None:
    """``ValueError`` naming the file when a blob is not what the manifest says the
    conversion wrote (a layer file replaced by one of another conversion: another method,
    group size, model size or split), which the wrapper would otherwise run as it is."""
    want = {"format": manifest.format, "num_experts": manifest.num_experts, "hidden_size": manifest.hidden_size,
            "intermediate_size": manifest.intermediate_size // max(manifest.threadpool_count, 1)}
    if manifest.format in ("int4", "int4_asym"):
        want["group_size"] = manifest.group_size
    got = {name: getattr(packed, name) for name in want}
    if got != want:
        differ = ", ".join(f"{name} {got[name]} (manifest: {want[name]})" for name in want if got[name] != want[name])
        raise ValueError(f"{file}: tensor {key!r} is not what {MANIFEST} says this conversion wrote: {differ}; the "
                         "file was replaced or belongs to another conversion, convert again")
