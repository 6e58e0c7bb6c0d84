"""kt-kernel's converted CPU weights (``AMXINT4`` / ``AMXINT8``), read as kt_ops layers.

kt-kernel's converter (``scripts/convert_cpu_weights.py``, ``kt quant``) stores each MoE
layer's experts as its AMX kernels hold them in memory, one tensor pair per expert,
projection and NUMA part (``threadpool_count`` parts of the intermediate dimension)::

    blk.{L}.ffn_{up,gate,down}_exps.{e}.numa.{p}.weight   uint8: the AMX B buffer's bytes
    blk.{L}.ffn_{up,gate,down}_exps.{e}.numa.{p}.scale    fp32: one scale per output row

(``kt-kernel/python/utils/loader.py`` ``SafeTensorLoader.load_experts``), or, written with
``--no-merge-safetensor``, the same bytes as files
``_layer_{L}/_numa_{p}/{INT8|INT4}_{up|gate|down}_{e}_{N}Byte_{quant|scale}_.kt``. A part holds gate
and up rows ``[p I/T, (p+1) I/T)`` and the same columns of down. The B buffer
(``kt-kernel/operators/amx/la/amx_kernels.hpp`` ``GemmKernel224Int8::BufferB``,
``amx_buffers.hpp`` ``BufferBInt4Impl``) of an ``[N, K]`` matrix is blocked by ``N_BLOCK``
rows (64 for INT8, 128 for INT4), then ``K_BLOCK`` = 3584 columns, then 32 rows by
``K_STEP`` columns (64 for INT8, 128 for INT4); each 32-row step is two 16-row tiles of 16
32-bit words per row, stored transposed (word-major, VNNI). INT8 levels are
``round(w / d)`` with ``d = max|w| / 127`` per row (``w = q d``; kt-kernel 0.7.2 computes
``d`` as ``max|w| * fp32(1 / 127)``); an INT4 byte holds column ``j`` of a 128-column step in
its low nibble and column ``j + 64`` in its high nibble, signed (-7 ... 7), with
``w = q 16 d`` (``d = max|w| / 112``). Only the stored levels and scales matter here: they
are taken as they are.

:func:`load_layer` un-tiles them into kt_ops' ``int8`` and ``int4`` layouts (INT4: the row
scale ``16 d`` repeated over groups of 128) — the same levels and scales, never
re-quantized — one kt_ops part per kt-kernel part, so the layer computes what the file
holds. ``KTMoEWrapper(method="AMXINT4" | "AMXINT8", weight_path=DIR, threadpool_count=T)``
reads such a directory (T must be the directory's part count).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from kt_ops._native import _C  # noqa: F401  (registers kt::pack_int8_experts / pack_int4_experts)
from kt_ops.packed import PackedExperts

PROJECTIONS = ("gate", "up", "down")
_DTYPE_BYTES = {"I8": 1, "U8": 1, "BOOL": 1, "F16": 2, "BF16": 2, "I16": 2, "F32": 4, "I32": 4, "F64": 8, "I64": 8}
_KEY = re.compile(r"^blk\.(\d+)\.ffn_(up|gate|down)_exps\.(\d+)\.numa\.(\d+)\.(weight|scale)$")
_KT_FILE = re.compile(r"^(INT4|INT8)_(up|gate|down)_(\d+)_(\d+)Byte_(quant|scale)_\.kt$")
_LAYER_DIR = re.compile(r"^_layer_(\d+)$")
_PART_DIR = re.compile(r"^_numa_(\d+)$")


@dataclass(frozen=True)
class BufferLayout:
    """A kt-kernel AMX B buffer's blocking (``GemmKernel224Int8`` / ``GemmKernel224Int4``)."""

    bits: int
    n_block: int
    k_block: int = 3584
    n_step: int = 32
    k_step: int = 64

    def row_bytes(self, k: int) -> int:
        return k * self.bits // 8


LAYOUTS = {"AMXINT8": BufferLayout(bits=8, n_block=64), "AMXINT4": BufferLayout(bits=4, n_block=128, k_step=128)}


def _kt_files(path: Path, layer_idx: int | None = None, ordered: bool = True) -> Iterator[tuple[str, Path]]:
    """``--no-merge-safetensor``'s files, ``_layer_{L}/_numa_{p}/{INT8|INT4}_{proj}_{e}_{N}Byte_{quant|scale}_.kt``
    (each the bytes of one ``.weight`` / ``.scale`` tensor), as (the tensor's key, file); only
    layer ``layer_idx``'s folder when given (a model's folders hold ~10^5 files)."""
    files = path.glob("_layer_*/_numa_*/*.kt" if layer_idx is None else f"_layer_{layer_idx}/_numa_*/*.kt")
    for file in sorted(files) if ordered else files:
        layer, part = _LAYER_DIR.match(file.parent.parent.name), _PART_DIR.match(file.parent.name)
        match = _KT_FILE.match(file.name)
        if layer and part and match:
            kind = "weight" if match.group(5) == "quant" else "scale"
            yield (f"blk.{int(layer.group(1))}.ffn_{match.group(2)}_exps.{int(match.group(3))}.numa."
                   f"{int(part.group(1))}.{kind}"), file


def is_kt_kernel_dir(path: Path) -> bool:
    """Whether ``path`` is a directory of kt-kernel's converted AMX weights: safetensors files
    holding a ``blk.{L}.ffn_up_exps.{e}.numa.{p}.weight`` key, or ``--no-merge-safetensor``'s
    ``_layer_{L}/_numa_{p}/*.kt`` files."""
    if not path.is_dir():
        return False
    if next(_kt_files(path, ordered=False), None) is not None:
        return True
    for file in sorted(path.glob("*.safetensors")):
        if not file.is_file():  # a FIFO or device: opening it would wait for ever
            continue
        try:
            with safe_open(os.fspath(file), framework="pt") as handle:
                if any(_KEY.match(key) for key in handle.keys()):
                    return True
        except Exception:  # noqa: BLE001 - an unreadable file is no such directory's
            continue
    return False


class KtKernelDir:
    """The layers of a kt-kernel converted directory: which file holds each key. ``method``
    (``AMXINT4`` / ``AMXINT8``): of a folder holding both ``INT4_...`` and ``INT8_...`` files
    of a tensor (converted twice into one directory), the method's, as kt-kernel reads them.
    ``layer_idx``: of ``_layer_{L}`` folders, only that layer's are listed. ``ValueError`` for
    a tensor stored twice otherwise (in two safetensors files, or in one and a ``.kt`` file), and
    for a ``*.safetensors`` file whose header cannot be read."""

    def __init__(self, path: Path, method: str | None = None, layer_idx: int | None = None) -> None:
        self.path = path
        self.files: dict[str, Path] = {}
        self.experts: dict[int, set[int]] = {}
        self.parts: dict[int, set[int]] = {}
        self._handles: dict[Path, object] = {}
        self._bits: dict[int, set[str]] = {}  # per layer, the ``INT4`` / ``INT8`` of its .kt file names
        # the layer folders (not their files) for layer_shape's message
        self._folders = {int(m.group(1)) for d in path.glob("_layer_*") if (m := _LAYER_DIR.match(d.name))}
        prefix = None if method is None else method.removeprefix("AMX")
        keys: list[tuple[str, Path]] = []
        for key, file in _kt_files(path, layer_idx):
            bits = _KT_FILE.match(file.name).group(1)  # type: ignore[union-attr]
            self._bits.setdefault(int(key.split(".")[1]), set()).add(bits)
            held = self.files.get(key)
            if held is None or _KT_FILE.match(held.name).group(1) != prefix:  # type: ignore[union-attr]
                self.files[key] = file
        keys += list(self.files.items())
        for file in sorted(path.glob("*.safetensors")):
            if not file.is_file():  # a FIFO or device: opening it would wait for ever
                continue
            try:
                with safe_open(os.fspath(file), framework="pt") as handle:
                    keys += [(key, file) for key in handle.keys()]
            except Exception as error:  # noqa: BLE001 - safetensors' SafetensorError names no file
                raise ValueError(f"{file} is not a readable safetensors file ({error}): cut short or "
                                 "damaged?") from None
        for key, file in keys:
            match = _KEY.match(key)
            if match is None:
                continue
            layer = int(match.group(1))
            held = self.files.get(key)
            if held is not None and held != file:  # two shards (or a shard and a .kt file) of one tensor
                raise ValueError(f"{path}: {key} is in both {held} and {file} (two conversions in one folder?); "
                                 "keep one")
            self.files[key] = file
            self.experts.setdefault(layer, set()).add(int(match.group(3)))
            self.parts.setdefault(layer, set()).add(int(match.group(4)))

    def layer_shape(self, layer: int) -> tuple[int, int]:
        """``(num_experts, parts)`` of ``layer``; ``ValueError`` when the directory lacks it
        or its expert / part numbers have gaps."""
        if layer not in self.experts:
            held = ", ".join(map(str, sorted(set(self.experts) | self._folders))) or "none"
            raise ValueError(f"{self.path} holds no kt-kernel experts of layer {layer} (layers: {held})")
        experts, parts = sorted(self.experts[layer]), sorted(self.parts[layer])
        if experts != list(range(len(experts))) or parts != list(range(len(parts))):
            raise ValueError(f"{self.path} layer {layer}: expert ids {experts[0]}..{experts[-1]} or NUMA parts {parts} "
                             "have gaps (a partly written conversion?)")
        return len(experts), len(parts)

    def tensor(self, layer: int, projection: str, expert: int, part: int, kind: str) -> torch.Tensor:
        """One stored tensor (its file opened once, kept open until :meth:`close`)."""
        key = f"blk.{layer}.ffn_{projection}_exps.{expert}.numa.{part}.{kind}"
        file = self.files.get(key)
        if file is None:
            raise ValueError(f"{self.path}: {key} is missing")
        if file.suffix == ".kt":
            size = self._kt_size(file)
            return torch.from_file(os.fspath(file), shared=False, size=size, dtype=torch.uint8)
        if file not in self._handles:
            self._handles[file] = safe_open(os.fspath(file), framework="pt")
        return self._handles[file].get_tensor(key)

    @staticmethod
    def _kt_size(file: Path) -> int:
        """A ``.kt`` file's size, which its name states (``..._{N}Byte_...``): ``ValueError``
        for a file cut short or grown, as kt-kernel refuses it."""
        if not file.is_file():  # a FIFO or device: reading it would wait for ever
            raise ValueError(f"{file} is not a regular file")
        size = file.stat().st_size
        match = _KT_FILE.match(file.name)
        if match is None or size != int(match.group(4)):
            raise ValueError(f"{file} holds {size} bytes, its name says {match.group(4) if match else '?'} "
                             "(truncated or not kt-kernel's?)")
        return size

    def stored_bytes(self, layer: int, projection: str, expert: int, part: int, kind: str) -> int:
        """Bytes of one stored tensor, from its file's header (nothing read)."""
        key = f"blk.{layer}.ffn_{projection}_exps.{expert}.numa.{part}.{kind}"
        file = self.files.get(key)
        if file is None:
            raise ValueError(f"{self.path}: {key} is missing")
        if file.suffix == ".kt":
            return self._kt_size(file)
        if file not in self._handles:
            self._handles[file] = safe_open(os.fspath(file), framework="pt")
        view = self._handles[file].get_slice(key)
        count = 1
        for n in view.get_shape():
            count *= int(n)
        return count * _DTYPE_BYTES.get(view.get_dtype(), 1)

    def scale_count(self, layer: int, projection: str, expert: int, part: int) -> int:
        """How many scales (one per output row) a stored ``.scale`` tensor holds, from its
        header: a ``.kt`` file's fp32 bytes / 4, a safetensors tensor's elements (of any float
        dtype, as :func:`load_layer` reads them)."""
        key = f"blk.{layer}.ffn_{projection}_exps.{expert}.numa.{part}.scale"
        file = self.files.get(key)
        if file is None or file.suffix == ".kt":
            return self.stored_bytes(layer, projection, expert, part, "scale") // 4
        if file not in self._handles:
            self._handles[file] = safe_open(os.fspath(file), framework="pt")
        count = 1
        for n in self._handles[file].get_slice(key).get_shape():
            count *= int(n)
        return count

    def method(self, layer: int) -> str:
        """``AMXINT8`` or ``AMXINT4``, from the sizes of expert 0's gate and down tensors in
        part 0: gate holds ``I/T x H`` levels of 1 byte (INT8) or half a byte (INT4), one
        scale per gate row, and down one scale per row of H. ``ValueError`` for a layer folder
        holding both ``INT4_...`` and ``INT8_...`` files (two conversions): the method must be named."""
        if len(self._bits.get(layer, ())) > 1:
            raise ValueError(f"{self.path} layer {layer} holds both INT4_ and INT8_ .kt files (converted twice into "
                             "one folder?); pass method='AMXINT4' or method='AMXINT8'")
        gate = self.stored_bytes(layer, "gate", 0, 0, "weight")
        rows = self.scale_count(layer, "gate", 0, 0)
        hidden = self.scale_count(layer, "down", 0, 0)
        if gate == rows * hidden:
            return "AMXINT8"
        if 2 * gate == rows * hidden:
            return "AMXINT4"
        raise ValueError(f"{self.path} layer {layer}: gate holds {gate} bytes for {rows} x {hidden} weights, neither "
                         "AMXINT8 (1 byte each) nor AMXINT4 (half a byte)")

    def close(self) -> None:
        self._handles.clear()


def _rows(buffer: torch.Tensor, n: int, k: int, layout: BufferLayout) -> torch.Tensor:
    """kt-kernel B buffers' weight bytes ``[..., n k bits / 8]`` -> each row's bytes per k step in
    row and k order, ``uint8 [..., n, k / k_step, 64]`` (un-tiled; INT4 bytes still hold two
    columns, ``j`` low and ``j + 64`` high)."""
    batch = tuple(buffer.shape[:-1])
    data = buffer.reshape(-1, buffer.shape[-1]).view(torch.uint8)
    B, step = data.shape[0], layout.k_step
    words = data.view(torch.int32)  # 4-byte words move whole (every offset below is a multiple of 4)
    out = torch.empty(B, n, k // step, 16, dtype=torch.int32)
    for n0 in range(0, n, layout.n_block):
        nb = min(layout.n_block, n - n0)
        for k0 in range(0, k, layout.k_block):
            kb = min(layout.k_block, k - k0)
            start = layout.row_bytes(n0 * k + k0 * nb) // 4
            region = words[:, start:start + layout.row_bytes(nb * kb) // 4]
            # [row steps, k steps, 2 tiles, 16 words, 16 rows]: each tile's words stored transposed
            tiles = region.view(B, nb // layout.n_step, kb // step, 2, 16, 16).permute(0, 1, 3, 5, 2, 4)
            out[:, n0:n0 + nb, k0 // step:(k0 + kb) // step] = tiles.reshape(B, nb, kb // step, 16)
    return out.view(torch.uint8).reshape(*batch, n, k // step, 64)


def untile(buffer: torch.Tensor, n: int, k: int, layout: BufferLayout) -> torch.Tensor:
    """The levels ``int8 [..., n, k]`` of kt-kernel B buffers' weight bytes ``[..., n k bits / 8]``
    (``uint8`` or ``int8``; the layout of the module docstring): INT8 as stored, INT4
    sign-extended (-8 ... 7)."""
    rows = _rows(buffer, n, k, layout)
    if layout.bits == 8:
        return rows.reshape(*rows.shape[:-2], k).view(torch.int8)
    columns = torch.cat((rows & 0x0F, rows >> 4), dim=-1).view(torch.int8)  # [..., n, steps, 128] in k order
    return ((columns ^ 8) - 8).reshape(*rows.shape[:-2], k)


def untile_nibbles(buffer: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """kt-kernel INT4 B buffers ``[..., n k / 2]`` -> kt_ops' nibbles ``uint8 [..., n, k / 2]``:
    level ``q + 8`` (of a two's complement nibble ``v``: ``v ^ 8``), column ``2j`` in the low
    nibble of byte ``j``."""
    rows = _rows(buffer, n, k, LAYOUTS["AMXINT4"])
    # Byte pairs (2m, 2m + 1) of a step as one little-endian word w: their low nibbles are
    # columns 2m, 2m + 1 (kt_ops' byte m), their high nibbles columns 64 + 2m, 65 + 2m (byte 32 + m).
    w = rows.view(torch.int16)  # [..., n, steps, 32]
    out = torch.empty(rows.shape, dtype=torch.uint8)
    out[..., :32] = ((w & 0x000F) | ((w & 0x0F00) >> 4)).to(torch.uint8)
    out[..., 32:] = (((w & 0x00F0) >> 4) | ((w >> 8) & 0x00F0)).to(torch.uint8)
    out ^= 0x88  # both nibbles + 8
    return out.reshape(*rows.shape[:-2], k // 2)


def _checked_sizes(n: int, k: int, layout: BufferLayout, name: str) -> None:
    if n % layout.n_step or k % layout.k_step:
        raise ValueError(f"{name}: kt-kernel's AMX buffers need rows in multiples of {layout.n_step} and columns in "
                         f"multiples of {layout.k_step}; this matrix is [{n}, {k}]")


def load_layer(path: Path, layer: int, method: str, experts: list[int], hidden_size: int,
               intermediate_size: int) -> list[PackedExperts]:
    """Experts ``experts`` (logical ids, in that order) of ``layer`` of the kt-kernel
    directory ``path`` as kt_ops parts (one per kt-kernel NUMA part; ``[]`` for no
    experts): ``int8`` for ``AMXINT8``, ``int4`` (groups of 128) for ``AMXINT4``.
    ``ValueError`` naming the tensor for a size that does not fit ``hidden_size`` /
    ``intermediate_size`` or the method (an AMXINT4 directory read as AMXINT8 ...), and for a
    ``.scale`` tensor of integers (not values kt-kernel writes)."""
    layout = LAYOUTS[method]
    directory = KtKernelDir(path, method, layer)
    count, parts = directory.layer_shape(layer)
    if intermediate_size % parts:
        raise ValueError(f"{path} layer {layer} has {parts} NUMA parts, which do not divide moe_intermediate_size "
                         f"{intermediate_size}")
    if not experts:
        return []
    if max(experts) >= count:
        raise ValueError(f"{path} layer {layer} holds {count} experts; expert {max(experts)} was asked for")
    try:
        return _load_parts(directory, layer, method, experts, hidden_size, intermediate_size // parts, parts)
    finally:
        directory.close()


def _load_parts(directory: KtKernelDir, layer: int, method: str, experts: list[int], H: int, width: int,
                parts: int) -> list[PackedExperts]:
    layout = LAYOUTS[method]
    shapes = {"gate": (width, H), "up": (width, H), "down": (H, width)}
    out = []
    for part in range(parts):
        levels: dict[str, torch.Tensor] = {}
        scales: dict[str, torch.Tensor] = {}
        for name in PROJECTIONS:
            n, k = shapes[name]
            weights, row_scales = [], []
            for expert in experts:
                key = f"blk.{layer}.ffn_{name}_exps.{expert}.numa.{part}"
                _checked_sizes(n, k, layout, key)
                weight = directory.tensor(layer, name, expert, part, "weight").reshape(-1)
                scale = directory.tensor(layer, name, expert, part, "scale").reshape(-1)
                nbytes = weight.numel() * weight.element_size()
                if nbytes != layout.row_bytes(n * k):
                    other = next((m for m, lay in LAYOUTS.items() if nbytes == lay.row_bytes(n * k)), None)
                    hint = f" (the size of {other} weights: use method='{other}')" if other else ""
                    raise ValueError(f"{key}.weight holds {nbytes} bytes; {method} [{n}, {k}] needs "
                                     f"{layout.row_bytes(n * k)}{hint}")
                if scale.dtype != torch.uint8 and not scale.dtype.is_floating_point:  # integers: no scales
                    raise ValueError(f"{key}.scale is {str(scale.dtype).removeprefix('torch.')}; row scales are "
                                     "float (kt-kernel writes float32)")
                if scale.dtype == torch.uint8 and scale.numel() % 4:  # (a .kt file): fp32 bytes
                    raise ValueError(f"{key}.scale holds {scale.numel()} bytes, not fp32 scales (4 bytes each)")
                scale = scale.view(torch.float32) if scale.dtype == torch.uint8 else scale.float()
                if scale.numel() != n:
                    raise ValueError(f"{key}.scale holds {scale.numel()} values; one per row needs {n}")
                if not bool(torch.isfinite(scale).all()):
                    raise ValueError(f"{key}.scale holds a non-finite scale")
                weights.append(weight.view(torch.uint8))
                row_scales.append(scale)
            stacked = torch.stack(weights)  # [E, bytes]: every expert un-tiled at once
            del weights
            levels[name] = untile(stacked, n, k, layout) if layout.bits == 8 else untile_nibbles(stacked, n, k)
            scales[name] = torch.stack(row_scales)
        try:
            out.append(_pack(method, levels, scales))
        except ValueError as error:
            raise ValueError(f"{directory.path} layer {layer} NUMA part {part}: {error}") from None
    return out


def _pack(method: str, levels: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> PackedExperts:
    """int8: levels ``[E, N, K]``, w = d q; int4: nibbles ``[E, N, K / 2]``, w = 16 d (nibble - 8);
    ``scales`` fp32 ``[E, N]``."""
    q = [levels[name] for name in PROJECTIONS]
    d = [scales[name] for name in PROJECTIONS]
    if method == "AMXINT8":
        return PackedExperts(torch.ops.kt.pack_int8_experts(*q, *d))
    group = 128  # the row's scale over each group of 128 (K is a multiple of 128)
    group_scales = [(16 * s).unsqueeze(-1).expand(-1, -1, 2 * m.shape[-1] // group).contiguous() for s, m in zip(d, q)]
    return PackedExperts(torch.ops.kt.pack_int4_experts(*q, *group_scales, None, None, None, group))
