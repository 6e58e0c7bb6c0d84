"""Routed experts straight from GGUF files (the ``LLAMAFILE`` weight source).

A layer's experts are GGUF's stacked tensors ``blk.{L}.ffn_gate_exps.weight``,
``ffn_up_exps`` (ggml shape ``[H, I, E]``: E experts of I rows of H) and
``ffn_down_exps`` (``[I, H, E]``), in any supported type each (Q4_K_M files store down
in Q6_K). They are memory-mapped in place, copy-on-write, behind a kt_ops header page:
nothing is converted or copied, and the returned tensor keeps the mapping alive after
the reader is gone (deleting or replacing the file is safe; a file truncated or rewritten
in place while a layer is loaded makes the next call raise ``RuntimeError`` naming it,
:mod:`kt_ops.mapped_files`; only a truncation *during* a call can still end in SIGBUS).
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from glob import escape as glob_escape
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from kt_ops._native import _C
from kt_ops._validate import is_int, is_integral, regular_file_stat, require_bools
from kt_ops.gguf_types import gguf_type_id
from kt_ops.packed import PackedExperts

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
_MATRICES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class GgufModelInfo:
    """What a GGUF model's metadata says about its MoE layers."""

    architecture: str
    num_layers: int
    num_experts: int
    num_experts_per_tok: int
    hidden_size: int
    moe_intermediate_size: int | None  # None if the file does not say
    files: tuple[Path, ...]


def gguf_files(path: str | os.PathLike[str]) -> tuple[Path, ...]:
    """The GGUF files of a model: ``path`` itself, or the ``*.gguf`` of a directory (one
    model: a single file or the parts of a split model). Split models
    (``*-00001-of-0000N.gguf``) must be complete and hold no part outside ``1 .. N``
    (``ValueError`` naming the missing or stray parts) and come back in part order;
    naming one part selects the whole model (its parts alone, beside other models' files)."""
    root = Path(path)
    part = _SPLIT.match(root.name)
    if root.is_file() and part:  # one part of a split model: the whole model
        files = sorted(f for f in root.parent.glob(f"{glob_escape(part['stem'])}-*-of-{part['count']}.gguf")
                       if (m := _SPLIT.match(f.name)) and m["stem"] == part["stem"])  # not "{stem}-v2-..."
    elif root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(root.glob("*.gguf"))
        if not files:
            raise ValueError(f"no .gguf files in directory {str(root)!r}")
    else:
        if root.exists():  # a FIFO or a device: "does not exist" named the wrong problem
            regular_file_stat(root, "; GGUF models are files")
        raise FileNotFoundError(f"GGUF path {str(root)!r} does not exist")
    splits = [m for m in (_SPLIT.match(f.name) for f in files) if m]
    if not splits and len(files) > 1:
        raise ValueError(
            f"{str(root)!r} holds several GGUF files that are not the parts of one split model "
            f"({', '.join(f.name for f in files)}); pass the file to load"
        )
    if splits:
        stems = {(m["stem"], m["count"]) for m in splits}
        if len(stems) > 1 or len(splits) != len(files):
            raise ValueError(f"{str(root)!r} holds files of more than one model: {[f.name for f in files]}")
        count = int(splits[0]["count"])
        present = {int(m["index"]) for m in splits}
        stray = sorted(f.name for f, m in zip(files, splits) if not 1 <= int(m["index"]) <= count)
        if stray:  # part 0 was read as the first (its metadata), a part N + 1 as one more
            raise ValueError(f"split GGUF model in {str(root)!r} has parts outside 1 .. {count}: {', '.join(stray)}")
        missing = sorted(set(range(1, count + 1)) - present)
        if missing:
            stem = splits[0]["stem"]
            names = ", ".join(f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in missing)
            raise ValueError(f"split GGUF model in {str(root)!r} is incomplete: missing {names}")
    return tuple(files)


class _ReaderCache:
    """GGUF readers by path, at most ``size``, each kept with the file's identity (size,
    mtime, device, inode, ctime: a file replaced or rewritten keeping its size and mtime is
    read again, coarse timestamps and ``cp -p`` included). A reader maps its whole file and
    holds a descriptor of it: every file read anew first drops the readers of files
    deleted, replaced or rewritten since (a ``functools.lru_cache`` kept up to 64 of them, a
    deleted model's disk space never given back and each rewrite adding a mapping)."""

    def __init__(self, size: int = 64) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._readers: OrderedDict[str, tuple[tuple[int, ...], gguf.GGUFReader]] = OrderedDict()

    @staticmethod
    def _identity(path: str) -> tuple[int, ...] | None:
        try:
            stat = os.stat(path)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size, stat.st_dev, stat.st_ino, stat.st_ctime_ns

    def get(self, path: str, identity: tuple[int, ...]) -> gguf.GGUFReader:
        with self._lock:
            entry = self._readers.get(path)
            if entry is not None and entry[0] == identity:
                self._readers.move_to_end(path)
                return entry[1]
            for name, (held, _) in list(self._readers.items()):  # a file read anew: drop the stale ones
                if (identity if name == path else self._identity(name)) != held:
                    del self._readers[name]
        try:
            reader = gguf.GGUFReader(path)
        except Exception as error:  # numpy/struct errors on a damaged file
            raise ValueError(f"cannot read GGUF file {path!r} (truncated or not GGUF?): {error}") from error
        with self._lock:
            self._readers[path] = (identity, reader)
            while len(self._readers) > self._size:
                self._readers.popitem(last=False)
        return reader

    def cache_clear(self) -> None:
        with self._lock:
            self._readers.clear()


_reader = _ReaderCache()


def open_gguf(path: Path) -> gguf.GGUFReader:
    """A reader of one GGUF file (metadata and tensor infos; the data stays memory-mapped),
    cached per path, size, mtime, inode and ctime (a file replaced or rewritten keeping its
    size and mtime is read again; :class:`_ReaderCache`); ``ValueError`` for a damaged file."""
    stat = regular_file_stat(path, "; GGUF models are files")  # a FIFO would block the reader's open for ever
    return _reader.get(str(path), (stat.st_mtime_ns, stat.st_size, stat.st_dev, stat.st_ino, stat.st_ctime_ns))


def _field(reader: gguf.GGUFReader, key: str) -> object | None:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_gguf_config(path: str | os.PathLike[str]) -> GgufModelInfo:
    """The MoE sizes from the metadata of a GGUF model (a file or a directory, split or
    not); ``ValueError`` if it is not an MoE model."""
    files = gguf_files(path)
    reader = open_gguf(files[0])
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{str(files[0])!r} has no general.architecture")

    def count(key: str, value: object) -> int:
        # GGUF stores these as unsigned ints: a string, float, bool or array is a damaged or
        # hand-made file (int() took "4" and 4.7 -> 4 silently, and named no key for "x")
        if not is_int(value) or value < 1:
            raise ValueError(f"{str(files[0])!r} ({arch}): {arch}.{key} must be a positive integer, "
                             f"got {type(value).__name__} {value!r}")
        return value

    def need(key: str) -> int:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{str(files[0])!r} ({arch}) has no {arch}.{key}: not an MoE model?")
        return count(key, value)

    inter = _field(reader, f"{arch}.expert_feed_forward_length")
    experts, used = need("expert_count"), need("expert_used_count")
    if not 1 <= used <= experts:
        raise ValueError(f"{str(files[0])!r} ({arch}): {arch}.expert_used_count = {used} must be in "
                         f"[1, {arch}.expert_count = {experts}]")
    return GgufModelInfo(
        architecture=arch,
        num_layers=need("block_count"),
        num_experts=experts,
        num_experts_per_tok=used,
        hidden_size=need("embedding_length"),
        moe_intermediate_size=None if inter is None else count("expert_feed_forward_length", inter),
        files=files,
    )


def _layer_tensors(path: str | os.PathLike[str], layer_idx: int, suffix: str
                   ) -> tuple[GgufModelInfo, list[str], dict[str, tuple[Path, gguf.gguf_reader.ReaderTensor]]]:
    """The model's metadata, the names ``blk.{layer_idx}.ffn_{gate,up,down}_exps.{suffix}``
    and those of them the files hold (name -> (file, tensor)). ``TypeError`` for a layer
    index that is not an int, ``ValueError`` for one outside the model."""
    if not is_integral(layer_idx):  # numpy's integers too, as KTMoEWrapper's layer_idx
        raise TypeError(f"layer_idx must be an int, got {type(layer_idx).__name__} {layer_idx!r}")
    layer_idx = int(layer_idx)
    info = read_gguf_config(path)
    if not 0 <= layer_idx < info.num_layers:
        raise ValueError(f"layer_idx {layer_idx} is outside the model's {info.num_layers} layers")
    names = [f"blk.{layer_idx}.{m}.{suffix}" for m in _MATRICES]
    found: dict[str, tuple[Path, gguf.gguf_reader.ReaderTensor]] = {}
    for file in info.files:
        for tensor in open_gguf(file).tensors:
            if tensor.name in names:
                if tensor.name in found:  # llama.cpp refuses a tensor in two parts too; the last one won silently
                    raise ValueError(f"GGUF model {str(path)!r}: {tensor.name} is in both {found[tensor.name][0].name} "
                                     f"and {file.name}")
                found[tensor.name] = (file, tensor)
    return info, names, found


def expert_shapes(info: GgufModelInfo, gate_shape: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """The ggml shapes a layer's ``ffn_{gate,up,down}_exps`` must have: ``[H, I, E]`` twice and
    ``[I, H, E]``, I from the metadata or else from the stored gate's shape (``gate_shape``;
    0 for a gate of rank 1, which then fails the comparison)."""
    E, H = info.num_experts, info.hidden_size
    I = info.moe_intermediate_size or (int(gate_shape[1]) if len(gate_shape) > 1 else 0)
    return (H, I, E), (H, I, E), (I, H, E)


def check_stored_size(file: Path, name: str, tensor: gguf.gguf_reader.ReaderTensor) -> None:
    """``ValueError`` when the bytes a tensor's declared type and shape need do not end where
    the file's next tensor starts (after the alignment padding), as llama.cpp's reader
    requires: a type field that disagrees with the bytes stored (Q8_0 over Q4_K blocks read
    the next tensor's bytes; Q4_K over Q6_K blocks decoded them wrongly) loaded silently."""
    reader = open_gguf(file)
    start, end = int(tensor.data_offset), int(tensor.data_offset) + int(tensor.n_bytes)
    following = [int(t.data_offset) for t in reader.tensors if int(t.data_offset) > start]
    if not following:  # the file's last tensor: the reader checked that it ends inside the file
        return
    base, align = int(reader.data_offset), int(reader.alignment)
    expected = base + -(-(end - base) // align) * align
    if min(following) != expected:
        raise ValueError(
            f"{name} in {file.name} is declared {tensor.tensor_type.name} of ggml shape "
            f"{[int(d) for d in tensor.shape]} ({int(tensor.n_bytes)} bytes from offset {start}), but the file's next "
            f"tensor starts at {min(following)}, not {expected}: its type disagrees with the bytes stored "
            "(damaged file?)"
        )


# Architectures whose routed experts llama.cpp computes with another activation than
# SwiGLU (its build_moe_ffn's op per architecture): refused rather than computed wrongly.
OTHER_ACTIVATIONS = {"grok": "GELU-gated (GeGLU) experts"}


def load_gguf_experts(path: str | os.PathLike[str], layer_idx: int, copy: bool = False) -> PackedExperts:
    """The routed experts of layer ``layer_idx`` of a GGUF model, memory-mapped.

    Args:
        path: a ``.gguf`` file or a directory of them (split models included).
        layer_idx: the layer (``blk.{layer_idx}``).
        copy: read the blocks into RAM instead of mapping them. A mapped blob is watched:
            a call that uses it after a file changed on disk raises ``RuntimeError``
            naming the file (:mod:`kt_ops.mapped_files`).

    Returns:
        A :class:`PackedExperts` of format ``"gguf"`` whose ``data`` maps the file's
        blocks (gate, up and down keep their own GGUF types).

    Raises:
        ValueError: a ``copy`` that is not a bool, no expert tensors for the layer, an
            unsupported GGUF type (named), shapes that disagree with the metadata, a
            truncated file, an architecture whose experts are not SwiGLU
            (``OTHER_ACTIVATIONS``: grok).
        TypeError: ``layer_idx`` is not an int.
    """
    require_bools(copy=copy)  # "no" is truthy: read into RAM instead of mapped
    info, names, found = _layer_tensors(path, layer_idx, "weight")
    if info.architecture in OTHER_ACTIVATIONS:  # the kernels would compute SwiGLU on them: silently wrong
        raise ValueError(f"GGUF model {str(path)!r} ({info.architecture}): its experts use "
                         f"{OTHER_ACTIVATIONS[info.architecture]}, which kt_ops does not compute (SwiGLU, gpt-oss's "
                         "alpha-SwiGLU)")
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(
            f"GGUF model {str(path)!r} has no {', '.join(missing)}: layer {layer_idx} has no routed experts "
            "in the stacked ffn_*_exps form (a dense layer, or a layout kt_ops does not read)"
        )
    expected = expert_shapes(info, tuple(int(d) for d in found[names[0]][1].shape))
    E, H, I = info.num_experts, info.hidden_size, expected[2][0]
    files, offsets, types = [], [], []
    for name, want in zip(names, expected):
        file, tensor = found[name]
        shape = tuple(int(d) for d in tensor.shape)
        if shape != want:
            raise ValueError(
                f"{name} in {file.name} has ggml shape {list(shape)} but the metadata (E={E}, H={H}, I={I}) "
                f"needs {list(want)}"
            )
        try:
            types.append(gguf_type_id(tensor.tensor_type))
        except ValueError as error:
            raise ValueError(f"{name} in {file.name}: {error}") from None
        check_stored_size(file, name, tensor)
        files.append(str(file))
        offsets.append(int(tensor.data_offset))
    data = _C.map_gguf_experts(files, offsets, types, E, H, I)
    return PackedExperts(data.clone() if copy else data)


# gpt-oss's activation, which llama.cpp hard-codes for the architecture (no GGUF keys):
# alpha-SwiGLU with alpha 1.702, gate clamped from above and up to [-7, 7].
GPT_OSS_SWIGLU_ALPHA = 1.702
GPT_OSS_SWIGLU_LIMIT = 7.0


def load_gguf_expert_biases(
    path: str | os.PathLike[str], layer_idx: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The routed experts' biases of layer ``layer_idx`` of a GGUF model (gpt-oss has them).

    Reads ``blk.{layer_idx}.ffn_{gate,up,down}_exps.bias`` (F32, ggml shapes ``[I, E]``,
    ``[I, E]``, ``[H, E]``).

    Returns:
        ``(gate_bias [E, I], up_bias [E, I], down_bias [E, H])``, fp32 copies; an entry is
        ``None`` where the file has no such tensor (most models: all three). The tuple is
        what :func:`kt_ops.set_activation` and ``KTMoEWrapper`` take as ``biases``.

    Raises:
        ValueError: a bias of another type than F32, or of a shape the metadata disagrees
            with (naming the tensor); a layer outside the model.
        TypeError: ``layer_idx`` is not an int.
    """
    info, names, found = _layer_tensors(path, layer_idx, "bias")
    E, H = info.num_experts, info.hidden_size
    # I: the metadata's, else the experts' (their gate's ggml shape [H, I, E]), else the first
    # gate/up bias's; one width for both (a file without the key gave gate [E, 7] and up [E, 9])
    I = info.moe_intermediate_size
    if I is None:
        weight = _layer_tensors(path, layer_idx, "weight")[2].get(f"blk.{layer_idx}.ffn_gate_exps.weight")
        if weight is not None and len(weight[1].shape) == 3:
            I = int(weight[1].shape[1])
        else:
            I = next((int(found[n][1].shape[0]) for n in names[:2] if n in found and len(found[n][1].shape)), None)
    out: list[torch.Tensor | None] = []
    for name in names:
        if name not in found:
            out.append(None)
            continue
        file, tensor = found[name]
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{name} in {file.name} is {tensor.tensor_type.name}; expert biases must be F32")
        check_stored_size(file, name, tensor)
        shape = tuple(int(d) for d in tensor.shape)  # ggml order: [width, E]
        width = H if name.endswith("ffn_down_exps.bias") else I
        if shape != (width, E):
            raise ValueError(f"{name} in {file.name} has ggml shape {list(shape)} but the metadata (E={E}, "
                             f"H={H}, I={I}) needs {[width, E]}")
        out.append(torch.from_numpy(np.array(tensor.data, dtype=np.float32).reshape(E, width)))
    return out[0], out[1], out[2]
