"""What a weight file or directory holds, read from its metadata only (``kt-ops inspect``).

:func:`inspect_weights` recognises the four weight sources kt_ops loads — a packed-experts
safetensors file (:meth:`kt_ops.PackedExperts.save`, or one layer file of a converted
directory), a converted directory (``python -m kt_ops.convert``), a GGUF file or
directory (split models included) and a Hugging Face safetensors checkpoint (float, FP8, or
4-bit as published: RAWINT4, GPTQ, AWQ, MXFP4) — and says
per MoE layer: E, H, I, the format or type of gate, up and down, their bytes, and the
kernel that would run them under the active CPU variant. Only headers are read
(safetensors headers, GGUF tensor infos, packed blob headers through a memory map), never
the weights. :func:`format_inspection` renders the result as text; identical
consecutive layers share one row.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence, TypeVar

import gguf
from safetensors import safe_open
from tqdm import tqdm

from kt_ops._native import _C
from kt_ops.converted import INDEX, MANIFEST, Manifest, entry_path, layer_file, layer_key, read_weight_map
from kt_ops.cpu import cpu_variant
from kt_ops.diagnostics import methods_label
from kt_ops.formats import FORMATS, FormatInfo, format_info
from kt_ops.gguf_loader import (OTHER_ACTIVATIONS, check_stored_size, expert_shapes, gguf_files, open_gguf,
                               read_gguf_config)
from kt_ops.gguf_types import GGML_TYPES
from kt_ops.hf_checkpoint import (HfCheckpoint, LayerExperts, _check_regular_file, config_layer_count,
                                  read_config_json, with_text_config)
from kt_ops.hf_int4 import int4_method, quantization_config
from kt_ops.hf_int8 import is_int8_layer
from kt_ops.hf_mxfp4 import Mxfp4Layer, find_mxfp4_layer, mxfp4_layers
from kt_ops.kt_kernel_weights import KtKernelDir, is_kt_kernel_dir
from kt_ops.mapped_files import read_safetensors_header, safetensors_range
from kt_ops.parts import FP8_KIND_METHODS

MATRICES = ("gate", "up", "down")
_GGUF_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.ffn_(?P<m>gate|up|down)_exps\.(?P<part>weight|bias)$")
_PACKED_KEY = re.compile(r"^(?:packed|blk\.(?P<layer>\d+)\.part(?P<part>\d+)\.packed)$")
# safetensors dtype of expert weights -> (name shown, bytes per element)
_DTYPES = {"BF16": ("bf16", 2), "F16": ("fp16", 2), "F32": ("fp32", 4), "F8_E4M3": ("fp8_e4m3", 1)}
_SCALE_DTYPES = {**_DTYPES, "U8": ("ue8m0", 1), "F8_E8M0": ("ue8m0", 1)}  # FP8 scales (mxfp8: exponent bytes)
# Bytes per element of the tensors of 4-bit checkpoints (packed codes, scales, zeros, biases).
_STORED_BYTES = {**{name: size for name, (_, size) in _SCALE_DTYPES.items()}, "I8": 1, "I32": 4, "I64": 8}
# The tensors beside an INT4 expert matrix's stem (compressed-tensors, GPTQ, AWQ).
_INT4_TENSORS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "qweight", "scales", "qzeros",
                 "g_idx")
NOT_RECOGNISED = "is not a packed file, converted directory, GGUF file/directory or Hugging Face checkpoint"

T = TypeVar("T")


@dataclass(frozen=True)
class MatrixInfo:
    """One of a layer's three expert matrices (all E experts of it)."""

    name: str
    """``"gate"``, ``"up"`` or ``"down"``."""
    type: str
    """Packed format (``"int4"``), ggml type (``"Q4_K"``) or stored dtype (``"bf16"``)."""
    nbytes: int | None
    """Bytes of the matrix over all experts, its scales and biases included (None where the packed layout
    interleaves them)."""
    read: str
    """GGUF: how the kernel reads this type under the variant (``"in place"``: dotted from
    the file's bytes; ``"decoded"``: decoded once per job; ``"not computed"``: kt_ops has
    no kernel for it). Empty for the other sources."""


@dataclass(frozen=True)
class LayerInfo:
    """One MoE layer's routed experts."""

    layer: int | None
    """The model's layer index (None: a packed file holding one unnamed blob)."""
    num_experts: int
    hidden_size: int
    intermediate_size: int
    matrices: tuple[MatrixInfo, ...]
    """gate, up, down."""
    nbytes: int | None
    """Bytes of the layer's routed experts (None: not on disk, e.g. an unfinished conversion)."""

    def same_shape_and_types(self, other: LayerInfo) -> bool:
        """True when only the layer index differs (one row of the formatted table)."""
        return (self.num_experts, self.hidden_size, self.intermediate_size, self.matrices, self.nbytes) == (
            other.num_experts, other.hidden_size, other.intermediate_size, other.matrices, other.nbytes)


@dataclass(frozen=True)
class Inspection:
    """What :func:`inspect_weights` found at a path."""

    path: str
    kind: str
    """``"packed-experts file"``, ``"converted directory"``, ``"kt-kernel converted directory"``,
    ``"GGUF file"``, ``"GGUF directory"`` or ``"Hugging Face checkpoint"``."""
    variant: str
    """The CPU variant the kernels are named for (:func:`kt_ops.cpu_variant`)."""
    facts: tuple[tuple[str, str], ...]
    """Source-specific (label, value) pairs: architecture, method, files, ..."""
    num_layers: int | None
    """Layers of the model, MoE or not (None: not recorded, e.g. a packed file)."""
    layers: tuple[LayerInfo, ...]
    """The layers with routed experts, in layer order."""
    kernel: str | None
    """The MoE kernel that runs these weights under :attr:`variant`; None for a Hugging
    Face checkpoint, whose weights are packed at load into the method's format
    (:attr:`notes` lists the kernel per method)."""
    notes: tuple[str, ...]
    """Further lines: kernels per method, types kt_ops does not compute, missing layers."""

    @property
    def nbytes(self) -> int:
        """Bytes of all routed experts found."""
        return sum(layer.nbytes or 0 for layer in self.layers)

    def to_json(self) -> str:
        """The result as JSON (``kt-ops inspect --json``)."""
        data = {
            "path": self.path, "kind": self.kind, "variant": self.variant, "facts": dict(self.facts),
            "num_layers": self.num_layers, "kernel": self.kernel, "nbytes": self.nbytes, "notes": list(self.notes),
            "layers": [{
                "layer": layer.layer, "num_experts": layer.num_experts, "hidden_size": layer.hidden_size,
                "intermediate_size": layer.intermediate_size, "nbytes": layer.nbytes,
                "matrices": {m.name: {"type": m.type, "nbytes": m.nbytes, **({"read": m.read} if m.read else {})}
                             for m in layer.matrices},
            } for layer in self.layers],
        }
        return json.dumps(data, indent=2)


def inspect_weights(path: str | os.PathLike[str]) -> Inspection:
    """What ``path`` holds: a packed-experts file, converted directory, GGUF file or
    directory, directory written by kt-kernel's converter, or Hugging Face checkpoint
    (tried in that order), from metadata only.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is none of the four (the message says so) or is damaged
            (a truncated GGUF, a bad manifest, a packed blob whose header fails its checks).
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{root}: no such file or directory")
    if root.is_file():
        with open(root, "rb") as file:
            magic = file.read(4)
        if magic == b"GGUF":
            return _inspect_gguf(root)
        packed = _packed_keys(root)
        if packed:
            return _inspect_packed_file(root, packed)
    elif root.is_dir():
        if (root / MANIFEST).is_file():
            return _inspect_converted(root)
        if any(root.glob("*.gguf")):
            return _inspect_gguf(root)
        if is_kt_kernel_dir(root):
            return _inspect_kt_kernel(root)
        if any(root.glob("*.safetensors")):
            return _inspect_hf(root)
    raise ValueError(f"{root} {NOT_RECOGNISED}{_directory_hint(root)}")


def _directory_hint(root: Path) -> str:
    """For a file of a converted directory or Hugging Face checkpoint (a shard, its
    config.json): which directory to inspect instead."""
    parent = root.parent
    if not root.is_file():
        return ""
    if (parent / MANIFEST).is_file():
        return f" (it belongs to the converted directory {parent}: inspect that)"
    if (parent / "config.json").is_file() and any(parent.glob("*.safetensors")):
        return f" (it belongs to the Hugging Face checkpoint {parent}: inspect that directory)"
    return ""


def _progress(items: Sequence[T], what: str) -> Iterable[T]:
    """``items`` with a stderr progress bar that shows only if the loop passes 1 s."""
    return tqdm(items, desc=what, unit="file", delay=1.0, leave=False)


def _kernel(fmt_name: str, variant: str) -> str:
    return format_info(fmt_name).kernels[variant]


def _ggml_read(type_name: str, variant: str) -> str:
    for info in GGML_TYPES:
        if info.name == type_name:
            return "in place" if variant in info.in_place_variants else "decoded"
    return "not computed"


def _ggml_nbytes(type_name: str, rows: int, k: int) -> int:
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    return rows * (k // block) * block_bytes


def layer_ranges(layers: Iterable[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _layer_count(num_layers: int | None, layers: Sequence[LayerInfo]) -> str:
    indices = [layer.layer for layer in layers if layer.layer is not None]
    with_experts = f"{len(layers)} with routed experts" + (f" ({layer_ranges(indices)})" if indices else "")
    return with_experts if num_layers is None else f"{num_layers} in the model, {with_experts}"


def _past_the_model(num_layers: int | None, layers: Sequence[LayerInfo], config: dict) -> list[str]:
    """A note for the layers with experts at or past ``num_layers`` (config.json's
    ``num_hidden_layers``): DeepSeek-V3's and GLM-4.5's multi-token-prediction layers
    (``num_nextn_predict_layers``) are stored as ``model.layers.{num_hidden_layers}``, and
    converted and loaded (as that ``layer_idx``) like any other."""
    if num_layers is None:
        return []
    beyond = [layer.layer for layer in layers if layer.layer is not None and layer.layer >= num_layers]
    if not beyond:
        return []
    nextn = config.get("num_nextn_predict_layers")
    mtp = isinstance(nextn, int) and not isinstance(nextn, bool) and beyond[-1] < num_layers + nextn
    what = (f"the multi-token-prediction layer(s) of num_nextn_predict_layers {nextn}" if mtp
            else "no decoder layer of the model")
    return [f"layers {layer_ranges(beyond)}: past num_hidden_layers {num_layers}, {what}; loaded as layer_idx "
            f"{beyond[0]}{'' if len(beyond) == 1 else ', ...'} like the others"]


# --- packed-experts files ------------------------------------------------------------------


@contextlib.contextmanager
def _read_safetensors(path: Path) -> Iterator[Any]:
    """``safe_open(path)`` whose errors (safetensors' own types: a truncated or corrupt
    file, a key the file does not hold, a missing file) are ``ValueError`` naming ``path``."""
    _check_regular_file(path)  # a FIFO would block safe_open for ever
    try:
        with safe_open(os.fspath(path), framework="pt") as handle:
            yield handle
    except (MemoryError, ValueError):  # ours name the file already
        raise
    except Exception as error:  # noqa: BLE001 - SafetensorError, OSError
        raise ValueError(f"{path}: cannot read it as safetensors (truncated or corrupt file?): {error}") from None


def _packed_keys(path: Path) -> dict[str, tuple[int | None, int]] | None:
    """key -> (layer, part) when ``path`` is a safetensors file of kt_ops packed blobs
    (``"packed"`` from PackedExperts.save, ``blk.{L}.part{p}.packed`` from the converter)."""
    try:
        with safe_open(os.fspath(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            keys = list(handle.keys())
    except Exception as error:  # not safetensors (its own error types), or a damaged file of ours
        _refuse_damaged_packed_file(path, error)
        return None
    if metadata.get("producer") != "kt_ops" or not keys:
        return None
    found: dict[str, tuple[int | None, int]] = {}
    for key in keys:
        match = _PACKED_KEY.match(key)
        if not match:
            return None
        found[key] = (None, 0) if match["layer"] is None else (int(match["layer"]), int(match["part"]))
    return found


def _refuse_damaged_packed_file(path: Path, error: Exception) -> None:
    """``ValueError`` naming the damage when ``path``, which safetensors cannot open, is a
    kt_ops packed file by its own header (a truncated one was "not a packed file")."""
    try:
        header = read_safetensors_header(path)
    except ValueError:
        return
    metadata = header[0].get("__metadata__")
    if not isinstance(metadata, dict) or metadata.get("producer") != "kt_ops":
        return
    for key in header[0]:
        if key != "__metadata__":
            safetensors_range(path, key, header)  # ValueError: truncated, or not a 1-D uint8 tensor
    raise ValueError(f"{path}: a kt_ops packed-experts file that safetensors cannot open ({error})")


def _packed_layer(layer: int | None, infos: list[dict], variant: str) -> LayerInfo:
    """A layer from the ``packed_info`` of its parts (parts split I)."""
    first = infos[0]
    E, H = first["num_experts"], first["hidden_size"]
    I = sum(info["intermediate_size"] for info in infos)
    if first["format"] == "gguf":
        types = first["gguf_types"]
        sizes = (_ggml_nbytes(types[0], E * I, H), _ggml_nbytes(types[1], E * I, H), _ggml_nbytes(types[2], E * H, I))
        matrices = tuple(MatrixInfo(name, t, size, _ggml_read(t, variant)) for name, t, size in zip(MATRICES, types, sizes))
    else:
        matrices = tuple(MatrixInfo(name, first["format"], None, "") for name in MATRICES)
    return LayerInfo(layer, E, H, I, matrices, sum(info["nbytes"] for info in infos))


def _inspect_packed_file(path: Path, keys: dict[str, tuple[int | None, int]]) -> Inspection:
    variant = cpu_variant()
    by_layer: dict[int | None, list[dict]] = defaultdict(list)
    with safe_open(os.fspath(path), framework="pt") as handle:
        for key in sorted(keys, key=lambda k: (keys[k][0] or 0, keys[k][1])):
            try:
                info = _C.packed_info(handle.get_tensor(key))  # memory-mapped; reads the header
            except (ValueError, TypeError) as error:
                raise ValueError(f"{path}: tensor {key!r} is not a valid packed blob: {error}") from None
            by_layer[keys[key][0]].append(info)
    layers = tuple(_packed_layer(layer, infos, variant) for layer, infos in by_layer.items())
    formats = sorted({infos[0]["format"] for infos in by_layer.values()})
    parts = next(iter(by_layer.values()))
    group = parts[0]["group_size"]
    facts = (("format", ", ".join(formats) + (f", group size {group}" if group else "")),
             ("parts per layer", str(len(parts))))
    return Inspection(os.fspath(path), "packed-experts file", variant, facts, None, layers,
                      _kernel(formats[0], variant) if len(formats) == 1 else None, ())


# --- converted directories -----------------------------------------------------------------


def _parts_on_disk(file: Path, layer: int, count: int) -> list[int]:
    """The part numbers below ``count`` whose key of ``layer`` ``file``'s header holds (a file holds no more
    parts than keys), or ``[0]`` for a header that cannot be read, so that the caller's reading names the file."""
    try:
        keys = read_safetensors_header(file)[0]
    except ValueError:
        return [0]
    return [p for p in range(min(count, len(keys))) if layer_key(layer, p) in keys]


def _converted_reader(manifest: Manifest) -> str:
    """The KTMoEWrapper call that loads a converted directory's layers: the converter's
    ``--quant-method`` as the wrapper's method (``int8`` -> ``AMXINT8``), its parts, and
    for AMXINT4 the group size, which the wrapper checks against its own."""
    from kt_ops.convert import METHODS  # imported here: kt_ops.convert imports this module

    method = METHODS.get(manifest.method, manifest.method.upper())
    args = f"method='{method}', threadpool_count={manifest.threadpool_count}"
    if method == "AMXINT4":
        args += f", group_size={manifest.group_size}"
    return f"KTMoEWrapper({args}) as format {manifest.format}"


def _inspect_converted(root: Path) -> Inspection:
    variant = cpu_variant()
    manifest = Manifest.read(root)
    notes: list[str] = []
    if (root / INDEX).is_file():
        weight_map: dict[str, str] = read_weight_map(root)
    else:  # an unfinished conversion: only per-layer files so far, each holding its layer's parts
        weight_map = {layer_key(L, p): layer_file(L) for L in manifest.layers if (root / layer_file(L)).is_file()
                      for p in _parts_on_disk(root / layer_file(L), L, manifest.threadpool_count)}
    by_file: dict[str, list[str]] = defaultdict(list)
    for key, name in weight_map.items():
        by_file[name].append(key)
    key_bytes: dict[str, int] = {}
    for name in _progress(sorted(by_file), "reading headers"):
        file = entry_path(root, name)  # ValueError naming an entry outside the directory
        if not file.is_file():
            continue
        with _read_safetensors(file) as handle:
            for key in by_file[name]:
                key_bytes[key] = int(handle.get_slice(key).get_shape()[0])  # 1-D uint8 blob
    E, H, I = manifest.num_experts, manifest.hidden_size, manifest.intermediate_size
    matrices = tuple(MatrixInfo(name, manifest.format, None, "") for name in MATRICES)
    layers, missing = [], []
    for L in manifest.layers:
        parts = []
        for p in range(manifest.threadpool_count):  # up to the first part missing (a count may be huge)
            parts.append(key_bytes.get(layer_key(L, p)))
            if parts[-1] is None:
                break
        if None in parts:
            missing.append(L)
        layers.append(LayerInfo(L, E, H, I, matrices, None if None in parts else sum(parts)))
    if not manifest.complete:
        notes.append("the conversion did not finish (manifest: complete=false); rerun the converter with --resume-layer")
    elif not (root / INDEX).is_file():  # the layer files above are read, but a load finds no index: it raises
        notes.append(f"{INDEX} is missing: loading any layer raises; rerun the converter with "
                     f"--resume-layer {manifest.layers[-1] + 1 if manifest.layers else 0} to write it again")
    if missing:
        notes.append(f"no packed tensors on disk for layers {layer_ranges(missing)}")
    try:
        config = with_text_config(read_config_json(root))  # the source's, copied when the conversion finished
    except ValueError:
        config = {}
    notes.extend(_past_the_model(manifest.num_layers, layers, config))
    group = f", group size {manifest.group_size}" if manifest.group_size else ""
    source = manifest.source
    facts = (
        ("method", f"{manifest.method} (format {manifest.format}{group}; read by {_converted_reader(manifest)})"),
        ("parts per layer", f"{manifest.threadpool_count} (threadpool_count)"),
        ("source", f"{source.get('path', '?')} ({source.get('model_type') or 'model type not recorded'}, "
                   f"{source.get('input_type', '?')})"),
        ("files", str(len(set(weight_map.values())))),
    )
    return Inspection(os.fspath(root), "converted directory", variant, facts, manifest.num_layers, tuple(layers),
                      _kernel(manifest.format, variant), tuple(notes))


def _inspect_kt_kernel(root: Path) -> Inspection:
    """A directory written by kt-kernel's converter (:mod:`kt_ops.kt_kernel_weights`)."""
    variant = cpu_variant()
    directory = KtKernelDir(root)
    layers = []
    methods = set()
    parts_seen = set()
    try:
        for L in _progress(sorted(directory.experts), "reading headers"):
            E, parts = directory.layer_shape(L)
            method = directory.method(L)
            methods.add(method)
            parts_seen.add(parts)
            fmt = "int8" if method == "AMXINT8" else "int4"
            sizes = {name: sum(directory.stored_bytes(L, name, e, p, kind) for e in range(E) for p in range(parts)
                               for kind in ("weight", "scale")) for name in MATRICES}
            H = directory.scale_count(L, "down", 0, 0)
            I = parts * directory.scale_count(L, "gate", 0, 0)
            matrices = tuple(MatrixInfo(name, fmt, sizes[name], "") for name in MATRICES)
            layers.append(LayerInfo(L, E, H, I, matrices, sum(sizes.values())))
    finally:
        directory.close()
    method = "/".join(sorted(methods)) or "?"
    parts_text = "/".join(map(str, sorted(parts_seen))) or "?"
    fmt = "int8" if method == "AMXINT8" else "int4"
    if len(methods) == 1 and len(parts_seen) == 1:
        read = f"read by KTMoEWrapper(method='{method}', threadpool_count={parts_text}) as format {fmt}"
    else:  # a wrapper per layer: each with that layer's method and parts
        read = ("layers differ: each read by KTMoEWrapper with its own method and threadpool_count = its parts, "
                "AMXINT8 as format int8, AMXINT4 as int4")
    facts = (
        ("method", f"{method} (kt-kernel's converted AMX weights, one scale per row; {read})"),
        ("parts per layer", f"{parts_text} (kt-kernel's NUMA parts: threadpool_count)"),
        ("files", str(len(set(directory.files.values())))),
    )
    kernel = _kernel(fmt, variant) if len(methods) == 1 else None
    return Inspection(os.fspath(root), "kt-kernel converted directory", variant, facts, None, tuple(layers), kernel,
                      ())


# --- GGUF -----------------------------------------------------------------------------------


def _inspect_gguf(path: Path) -> Inspection:
    variant = cpu_variant()
    info = read_gguf_config(path)  # ValueError: not an MoE model, damaged, several models
    files = gguf_files(path)
    found: dict[int, dict[str, tuple[str, tuple[int, ...], int]]] = defaultdict(dict)
    duplicated: set[int] = set()  # a tensor in two parts of a split model: load_gguf_experts refuses it
    mistyped: set[int] = set()  # a type that disagrees with the bytes stored: load_gguf_experts refuses it
    biases: dict[tuple[int, str], int] = {}  # (layer, matrix) -> bytes of its ffn_*_exps.bias
    for file in _progress(files, "reading GGUF tensor infos"):
        for tensor in open_gguf(file).tensors:
            match = _GGUF_TENSOR.match(tensor.name)
            if match and match["part"] == "bias":  # gpt-oss's: loaded with the layer, so counted with it
                biases[int(match["layer"]), match["m"]] = int(tensor.n_bytes)
            elif match:
                if match["m"] in found[int(match["layer"])]:
                    duplicated.add(int(match["layer"]))
                type_name = gguf.GGMLQuantizationType(int(tensor.tensor_type)).name
                shape = tuple(int(d) for d in tensor.shape)
                found[int(match["layer"])][match["m"]] = (type_name, shape, int(tensor.n_bytes))
                try:
                    check_stored_size(file, tensor.name, tensor)
                except ValueError:
                    mistyped.add(int(match["layer"]))
    layers, notes, incomplete, misshapen, beyond = [], [], [], [], []
    not_computed: dict[str, list[int]] = defaultdict(list)
    for L in sorted(found):
        matrices = found[L]
        if L >= info.num_layers:  # load_gguf_experts refuses a layer_idx outside block_count
            beyond.append(L)
            continue
        if set(matrices) != set(MATRICES):
            incomplete.append(L)
            continue
        if L in duplicated or L in mistyped:
            continue
        # the shapes load_gguf_experts requires (a gate of another rank failed here with "not enough
        # values to unpack")
        expected = expert_shapes(info, matrices["gate"][1])
        if tuple(matrices[m][1] for m in MATRICES) != expected:
            misshapen.append(L)
            continue
        E, H, I = info.num_experts, info.hidden_size, expected[2][0]
        infos = []
        for name in MATRICES:
            type_name, _, nbytes = matrices[name]
            read = _ggml_read(type_name, variant)
            if read == "not computed":
                not_computed[type_name].append(L)
            if info.architecture == "gpt-oss":  # the only architecture whose biases the wrapper loads
                nbytes += biases.get((L, name), 0)
            infos.append(MatrixInfo(name, type_name, nbytes, read))
        layers.append(LayerInfo(L, E, H, I, tuple(infos), sum(m.nbytes or 0 for m in infos)))
    for type_name, where in sorted(not_computed.items()):
        notes.append(f"kt_ops does not compute {type_name} (layers {layer_ranges(where)}): loading those layers raises")
    if incomplete:
        notes.append(f"layers {layer_ranges(incomplete)} lack one of ffn_gate_exps/ffn_up_exps/ffn_down_exps")
    if duplicated:
        notes.append(f"layers {layer_ranges(sorted(duplicated))}: an ffn_*_exps tensor is in two files of the model: "
                     "loading those layers raises")
    if mistyped - duplicated:
        notes.append(f"layers {layer_ranges(sorted(mistyped - duplicated))}: an ffn_*_exps tensor's type disagrees with "
                     "the bytes stored (damaged file?): loading those layers raises")
    if beyond:
        notes.append(f"layers {layer_ranges(beyond)}: blk.N.ffn_*_exps past the model's {info.num_layers} layers "
                     f"({info.architecture}.block_count): loading those layers raises")
    if misshapen:
        notes.append(f"layers {layer_ranges(misshapen)}: ffn_*_exps shapes disagree with the metadata "
                     f"(E={info.num_experts}, H={info.hidden_size}, I={info.moe_intermediate_size}): "
                     "loading those layers raises")
    if info.architecture in OTHER_ACTIVATIONS:
        notes.append(f"{info.architecture}'s experts use {OTHER_ACTIVATIONS[info.architecture]}, which kt_ops does not "
                     "compute: loading any layer raises")
        layers = []
    read_words = {"in place": "dotted straight from the file's bytes", "decoded": "decoded once per job"}
    used = {m.read for layer in layers for m in layer.matrices}
    notes.extend(f"{word}: {meaning}" for word, meaning in read_words.items() if word in used)
    if path.is_dir():
        kind = "GGUF directory"
    else:
        kind = "GGUF file" if len(files) == 1 else "GGUF file (one part of a split model)"
    method = "LLAMAFILE (the file's blocks, memory-mapped, one part)"
    if info.architecture in OTHER_ACTIVATIONS:
        method = "none: every method refuses its experts' activation"
    elif layers and all(m.type == "MXFP4" for layer in layers for m in layer.matrices):  # gguf_mxfp4_experts' rule
        method += "; MXFP4 (its blocks copied into format mxfp4, in threadpool_count parts)"
    facts = (
        ("architecture", info.architecture),
        ("experts per token", str(info.num_experts_per_tok)),
        ("method", method),
        ("files", ", ".join(f.name for f in files) if len(files) <= 3 else f"{len(files)} ({files[0].name}, ...)"),
    )
    return Inspection(os.fspath(path), kind, variant, facts, info.num_layers, tuple(layers),
                      _kernel("gguf", variant), tuple(notes))


# --- Hugging Face checkpoints ---------------------------------------------------------------


def _scale_keys(key: str) -> tuple[str, str]:
    """Where an FP8 tensor's scale may be: ``weight_scale_inv`` (block FP8, MXFP8) or
    ``weight_scale`` (per channel); fused tensors: ``key + "_scale_inv"`` / ``"_scale"``."""
    if key.endswith(".weight"):
        return key[: -len(".weight")] + ".weight_scale_inv", key[: -len(".weight")] + ".weight_scale"
    return key + "_scale_inv", key + "_scale"


@dataclass(frozen=True)
class _Header:
    """A safetensors tensor's header entry."""

    dtype: str  # safetensors' name, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _SCALE_DTYPES[self.dtype][1]


def _safetensors_headers(checkpoint: HfCheckpoint, keys: Iterable[str], scales: Iterable[str] = ()) -> dict[str, _Header]:
    """The header entries of the weight ``keys`` and FP8 ``scales`` the checkpoint holds,
    one header read per file."""
    scales = set(scales)
    keys = [*keys, *scales]
    by_file: dict[Path, list[str]] = defaultdict(list)
    for key in keys:
        if key in checkpoint.key_file:
            by_file[checkpoint.key_file[key]].append(key)
    headers: dict[str, _Header] = {}
    for file in _progress(sorted(by_file), "reading safetensors headers"):
        with _read_safetensors(file) as handle:
            for key in by_file[file]:
                piece = handle.get_slice(key)
                dtype, shape = piece.get_dtype(), piece.get_shape()
                if dtype not in (_SCALE_DTYPES if key in scales else _DTYPES):
                    raise ValueError(f"{file}: tensor {key!r} is {dtype}; kt_ops reads expert weights in "
                                     f"{', '.join(_DTYPES)}")
                headers[key] = _Header(dtype, tuple(shape))
    return headers


def _hf_layer(where: LayerExperts, headers: dict[str, _Header]) -> LayerInfo:
    """A layer from its tensors' headers: per-expert ``gate [I, H]`` (E from the names) or
    fused ``gate_up_proj [E, 2I, H]`` + ``down_proj [E, H, I]`` (or stored transposed, as
    gpt-oss: ``[E, H, 2I]`` + ``[E, I, H]``); FP8 scales count as bytes."""
    experts = [0] if where.convention == "fused" else range(where.num_experts)
    sizes = [sum(headers[key].nbytes + sum(headers[s].nbytes for s in _scale_keys(key) if s in headers)
                 for key in (where.key(m, e) for e in experts)) for m in range(3)]
    label = _DTYPES[headers[where.key(0)].dtype][0]
    if where.convention == "fused":
        E, H, I = headers[where.key(2)].shape
        gate_up = headers[where.key(0)].shape
        if tuple(gate_up[1:]) != (2 * I, H) and tuple(gate_up[1:]) == (I, 2 * H):  # transposed: down is [E, I, H]
            H, I = I, H
        sizes = [sizes[0] // 2, sizes[0] - sizes[0] // 2, sizes[2]]
    else:
        (I, H), E = headers[where.key(0)].shape, where.num_experts
    matrices = tuple(MatrixInfo(name, label, size, "") for name, size in zip(MATRICES, sizes))
    return LayerInfo(where.layer, E, H, I, matrices, sum(sizes))


def _stored_bytes(checkpoint: HfCheckpoint, key: str) -> int:
    """Bytes of tensor ``key`` as stored (0 when absent); ``ValueError`` for a dtype no
    4-bit layout uses."""
    if key not in checkpoint.key_file:
        return 0
    dtype, shape = checkpoint.tensor_info(key)
    if dtype not in _STORED_BYTES:
        raise ValueError(f"{checkpoint.key_file[key]}: tensor {key!r} is {dtype}, which no 4-bit expert layout uses")
    return math.prod(shape) * _STORED_BYTES[dtype]


def _int4_layer(checkpoint: HfCheckpoint, where: LayerExperts, method: str,
                symmetric: bool) -> tuple[LayerInfo, str, str, list[str]]:
    """An INT4 checkpoint's layer (RAWINT4, GPTQ_INT4, AWQ_INT4) from its headers: the
    layer, what it is stored as, the packed format the method reads it into, and the
    experts' code and scale tensors that are missing. ``symmetric``: config.json's ``sym``."""
    dtype, shape = checkpoint.tensor_info(where.key(0))  # gate of expert 0
    if method == "RAWINT4":  # weight_packed I32 [I, H/8] or U8 [I, H/2]
        I, H = shape[0], shape[1] * (8 if dtype == "I32" else 2)
        scale_key, axis = f"{where.stem(0)}.weight_scale", 1  # [I, H/gs]
    else:  # GPTQ qweight [H/8, I], AWQ [H, I/8]; scales [H/gs, I]
        H, I = (shape[0] * 8, shape[1]) if method == "GPTQ_INT4" else (shape[0], shape[1] * 8)
        scale_key, axis = f"{where.stem(0)}.scales", 0
    scale = checkpoint.tensor_info(scale_key)[1] if scale_key in checkpoint.key_file else ()
    groups = scale[axis] if len(scale) == 2 else 0  # a missing or odd scale: the loader names it
    sizes = [sum(_stored_bytes(checkpoint, f"{where.stem(m, e)}.{part}")
                 for e in range(where.num_experts) for part in _INT4_TENSORS) for m in range(3)]
    scale_part = scale_key.rsplit(".", 1)[1]
    absent = [key for m in range(3) for e in range(where.num_experts)
              for key in (where.key(m, e), f"{where.stem(m, e)}.{scale_part}") if key not in checkpoint.key_file]
    # Zero points as config.json declares them (AWQ always; GPTQ with sym: false): the
    # loader reads the values too and packs zero points that are all 8 as symmetric int4.
    zeros = method == "AWQ_INT4" or (method == "GPTQ_INT4" and not symmetric)
    label = method.lower()
    matrices = tuple(MatrixInfo(name, label, size, "") for name, size in zip(MATRICES, sizes))
    group = f"groups of {H // groups}" if groups and H % groups == 0 else "groups unknown"
    stored = f"{label} ({group}, {'zero points' if zeros else 'symmetric'}: method {method} reads it in place)"
    return LayerInfo(where.layer, where.num_experts, H, I, matrices, sum(sizes)), stored, \
        "int4_asym" if zeros else "int4", absent


def _int8_layer(checkpoint: HfCheckpoint, where: LayerExperts) -> tuple[LayerInfo, list[str]]:
    """An INT8 (W8A8) checkpoint's layer from its headers, and its missing level and scale
    tensors (:mod:`kt_ops.hf_int8` reads and checks the values)."""
    I, H = checkpoint.tensor_info(where.key(0))[1][:2]  # gate of expert 0: I8 [I, H] (packed: I32 [I, H/4])
    if where.suffix == "weight_packed":
        H = int(checkpoint.read_tensor(f"{where.stem(0)}.weight_shape").reshape(-1)[1]) \
            if f"{where.stem(0)}.weight_shape" in checkpoint.key_file else 4 * H
    keys = [[key for e in range(where.num_experts) for key in (where.key(m, e), f"{where.stem(m, e)}.weight_scale")]
            for m in range(3)]
    # W8A16's weight_shape and zero points (all 0: the loader checks) are bytes of the experts too
    extra = [[f"{where.stem(m, e)}.{part}" for e in range(where.num_experts)
              for part in ("weight_shape", "weight_zero_point")] for m in range(3)]
    sizes = [sum(_stored_bytes(checkpoint, key) for key in matrix + more) for matrix, more in zip(keys, extra)]
    matrices = tuple(MatrixInfo(name, "int8", size, "") for name, size in zip(MATRICES, sizes))
    absent = [key for matrix in keys for key in matrix if key not in checkpoint.key_file]
    return LayerInfo(where.layer, where.num_experts, H, I, matrices, sum(sizes)), absent


def _mxfp4_layer(checkpoint: HfCheckpoint, layer: int, where: Mxfp4Layer) -> tuple[LayerInfo, list[str]]:
    """An MXFP4 checkpoint's layer (gpt-oss's fused, interleaved gate/up with biases, or
    DeepSeek-V4's per-expert w1/w3/w2) from its headers, and its missing code and exponent
    tensors."""
    E = where.num_experts
    if where.kind == "gpt_oss":
        prefix = f"{where.base}.mlp.experts"
        needed = [f"{prefix}.{m}_proj_{part}" for m in ("gate_up", "down") for part in ("blocks", "scales")]
        shape = checkpoint.tensor_info(f"{prefix}.gate_up_proj_blocks")[1]  # [E, 2I, H/32, 16]
        I, H = shape[1] // 2, shape[2] * 32
        gate_up = sum(_stored_bytes(checkpoint, f"{prefix}.gate_up_proj_{part}") for part in ("blocks", "scales", "bias"))
        down = sum(_stored_bytes(checkpoint, f"{prefix}.down_proj_{part}") for part in ("blocks", "scales", "bias"))
        sizes = [gate_up // 2, gate_up - gate_up // 2, down]
    else:
        keys = [[f"{where.base}.ffn.experts.{e}.{name}.{part}" for e in range(E) for part in ("weight", "scale")]
                for name in ("w1", "w3", "w2")]
        first = next(key for key in keys[0] if key.endswith(".weight") and key in checkpoint.key_file)
        shape = checkpoint.tensor_info(first)[1]  # [I, H/2]
        I, H = shape[0], shape[1] * 2
        sizes = [sum(_stored_bytes(checkpoint, key) for key in matrix) for matrix in keys]
        needed = [key for matrix in keys for key in matrix]
    matrices = tuple(MatrixInfo(name, "mxfp4", size, "") for name, size in zip(MATRICES, sizes))
    return LayerInfo(layer, E, H, I, matrices, sum(sizes)), [key for key in needed if key not in checkpoint.key_file]


def _packing_formats(fp8_kinds: Sequence[str]) -> list[FormatInfo]:
    """The formats KTMoEWrapper packs float experts into at load: not GGUF's, not
    int4_asym (the wrapper has no ``zero_point``: only :func:`kt_ops.pack_experts` makes
    it), and for FP8 experts of ``fp8_kinds`` no other FP8 kind's (those methods refuse them)."""
    return [fmt for fmt in FORMATS if fmt.k_rule != "ggml_block" and not fmt.zero_point
            and not (fp8_kinds and fmt.name in FP8_KIND_METHODS and fmt.name not in fp8_kinds)]


def _inspect_hf(root: Path) -> Inspection:
    variant = cpu_variant()
    checkpoint = HfCheckpoint(root)
    moe = checkpoint.moe_layers()
    mxfp4 = {L: where for L in mxfp4_layers(checkpoint) for where in [find_mxfp4_layer(checkpoint, L)] if where}
    if not moe and not mxfp4:
        raise ValueError(f"{root} holds safetensors files but no routed-expert tensors (per-expert "
                         "'*.mlp.experts.{e}.gate_proj.weight', Mixtral's '*.block_sparse_moe.experts.{e}.w1.weight', "
                         "Mistral's 'layers.{L}.experts.{e}.w1.weight', fused '*.mlp.experts.gate_up_proj', INT4 "
                         "'*.qweight' / '*.weight_packed', or MXFP4 "
                         "'*.mlp.experts.gate_up_proj_blocks' / '*.ffn.experts.{e}.w1.weight')")
    int4 = {L: method for L in moe for method in [int4_method(checkpoint, L)] if method is not None}
    int8 = [L for L in moe if L not in int4 and is_int8_layer(checkpoint, L)]
    floats = {L: where for L, where in moe.items() if L not in int4 and L not in int8}
    keys = {L: [where.key(m, e) for m in range(3)
                for e in ([0] if where.convention == "fused" else range(where.num_experts))]
            for L, where in floats.items()}
    headers = _safetensors_headers(checkpoint, [k for ks in keys.values() for k in ks],
                                   [s for ks in keys.values() for k in ks for s in _scale_keys(k)])
    layers, notes, stored, in_place = [], [], [], {}
    for L, where in floats.items():
        absent = [key for key in keys[L] if key not in headers]
        if absent:
            notes.append(f"layer {L}: {len(absent)} expert tensor(s) missing, e.g. {absent[0]!r}")
            continue
        try:  # experts with biases (gpt-oss's bf16 layout, per-expert .bias), mixed dtypes: every reader refuses them
            checkpoint.dtype(L)
        except ValueError as error:
            notes.append(str(error).removeprefix(f"{checkpoint.path}: "))
            continue
        layers.append(_hf_layer(where, headers))
    four_bit: list[tuple[LayerInfo, str, str, str, list[str]]] = []  # layer, label, method, format, absent (int8 too)
    symmetric = bool(quantization_config(checkpoint.path).get("sym", True)) if int4 else True  # read once
    for L, method in int4.items():
        layer, label, fmt, absent = _int4_layer(checkpoint, moe[L], method, symmetric)
        four_bit.append((layer, label, method, fmt, absent))
    for L in int8:
        if moe[L].convention == "fused":  # as load_int8_experts refuses it: a note, no row
            notes.append(f"layer {L}: int8 experts are fused ({moe[L].key(0)!r}); kt_ops reads INT8 experts stored "
                         "per expert")
            continue
        layer, absent = _int8_layer(checkpoint, moe[L])
        scheme = "W8A16, packed" if moe[L].suffix == "weight_packed" else "W8A8"
        four_bit.append((layer, f"int8 (a scale per row, {scheme}: method AMXINT8 reads it in place)", "AMXINT8",
                         "int8", absent))
    for L, where in mxfp4.items():
        if L not in moe:  # a layer of float experts beside MXFP4 blobs keeps its float row
            layer, absent = _mxfp4_layer(checkpoint, L, where)
            four_bit.append((layer, "mxfp4 (ue8m0 exponents per 32: method MXFP4 reads it in place)", "MXFP4",
                             "mxfp4", absent))
    for layer, label, method, fmt, absent in four_bit:
        if absent:  # as a float layer with missing tensors: named, no row
            notes.append(f"layer {layer.layer}: {len(absent)} expert tensor(s) missing, e.g. {absent[0]!r}")
            continue
        layers.append(layer)
        stored.append(label)
        in_place[f"method {method} (read in place)"] = fmt
    layers.sort(key=lambda layer: layer.layer)
    config = with_text_config(read_config_json(root))  # a multimodal model's: its language model's keys
    float_layers = {layer.layer for layer in layers if layer.layer in floats}
    dtypes = sorted({m.type for layer in layers if layer.layer in floats for m in layer.matrices})
    kinds = sorted({kind for L in floats if L in float_layers
                    for kind in [checkpoint.fp8_kind(L)] if kind is not None})
    scale_names = {"fp8": "128 x 128 block scales", "fp8_perchannel": "per-channel scales",
                   "mxfp8": "MXFP8 ue8m0 exponents per 32"}
    scales = f" (with {', '.join(scale_names[k] for k in kinds)}: method {', '.join(FP8_KIND_METHODS[k] for k in kinds)}" \
             " reads it in place)" if kinds else ""
    stored_as = [", ".join(dtypes) + scales] if dtypes else []
    stored_as.extend(dict.fromkeys(stored))  # each quantized label once, in layer order
    conventions = sorted({where.convention for L, where in moe.items() if L not in int4 and L not in int8}
                         | {f"INT8 {moe[L].convention}" for L in int8}
                         | {f"{method} per_expert" for method in int4.values()}
                         | {f"MXFP4 {where.kind}" for L, where in mxfp4.items() if L not in moe})
    facts = (("model type", str(config.get("model_type", "unknown (no config.json)"))),
             ("experts per token", str(config.get("num_experts_per_tok", "unknown"))),
             ("expert tensors", ", ".join(conventions) + " naming"),
             ("stored as", "; ".join(stored_as) or "no expert layer kt_ops reads (the notes say why)"),
             ("files", str(len(set(checkpoint.key_file.values())))))
    num_layers = config_layer_count(config, root)
    notes.extend(_past_the_model(num_layers, layers, config))
    for label, fmt in in_place.items():
        # the loader reads zero points and packs a layer whose are all 8 as int4: the headers cannot tell
        symmetric_too = f" (a layer whose zero points are all 8 loads as int4: {_kernel('int4', variant)})" \
            if fmt == "int4_asym" else ""
        notes.append(f"{label}: {format_info(fmt).kernels[variant]}{symmetric_too}")
    if float_layers:  # none: every float layer lacks a tensor, and every method refuses it
        notes.append(f"packed when loaded, so the kernel is the method's (under {variant}):")
        notes.extend(f"  {methods_label(fmt)}: {fmt.kernels[variant]}" for fmt in _packing_formats(kinds))
    return Inspection(os.fspath(root), "Hugging Face checkpoint", variant, facts,
                      num_layers, tuple(layers), None, tuple(notes))


# --- text -------------------------------------------------------------------------------------


def format_bytes(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"?"``."""
    if n is None:
        return "?"
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if round(value, 1) < 1024 or unit == "TiB":  # 1023.96 KiB is 1.0 MiB, not "1024.0 KiB"
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def _rows(layers: Sequence[LayerInfo]) -> list[list[str]]:
    """One row per run of consecutive layers that differ only in their index."""
    groups: list[list[LayerInfo]] = []
    for layer in layers:
        if groups and groups[-1][0].same_shape_and_types(layer):
            groups[-1].append(layer)
        else:
            groups.append([layer])
    rows = []
    for group in groups:
        first = group[0]
        indices = [layer.layer for layer in group if layer.layer is not None]
        label = layer_ranges(indices) if indices else "-"
        cells = [f"{m.type} ({m.read})" if m.read else m.type for m in first.matrices]
        sizes = [format_bytes(m.nbytes) for m in first.matrices if m.nbytes is not None]
        if len(sizes) == 3:
            cells = [f"{cell} {size}" for cell, size in zip(cells, sizes)]
        rows.append([label, str(first.num_experts), str(first.hidden_size), str(first.intermediate_size), *cells,
                     format_bytes(first.nbytes)])
    return rows


def format_inspection(result: Inspection) -> str:
    """The text ``kt-ops inspect`` prints: what the path is, its facts, the kernel, a table
    of the MoE layers (E/H/I, gate/up/down type and bytes, bytes per layer), the total
    and notes."""
    lines = [f"{result.path}: {result.kind}"]
    facts = [("layers", _layer_count(result.num_layers, result.layers)), *result.facts]
    if result.kernel is not None:
        facts.append((f"kernel ({result.variant})", result.kernel))
    width = max(len(label) for label, _ in facts)
    lines.extend(f"  {label + ':':{width + 1}s} {value}" for label, value in facts)
    if result.layers:
        table = [["layers", "E", "H", "I", *MATRICES, "bytes/layer"], *_rows(result.layers)]
        widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
        lines.append("")
        lines.extend("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)
        on_disk = sum(layer.nbytes is not None for layer in result.layers)  # an unfinished conversion's: not all
        lines.append(f"  total: {format_bytes(result.nbytes)} ({result.nbytes:,} bytes) of routed experts "
                     f"in {on_disk} layer(s)")
    if result.notes:
        lines.append("")
        lines.extend(f"  {note}" for note in result.notes)
    return "\n".join(lines)
