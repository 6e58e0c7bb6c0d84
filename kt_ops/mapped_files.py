"""Packed blobs memory-mapped from safetensors files, watched for changes on disk.

A blob mapped from a file reads the file's pages at every call. Every ``torch.ops.kt``
operator that reads a packed blob (where it reads the header: ``csrc/ops/packed_blob.cpp``;
``kt_ops.PackedExperts``, :mod:`kt_ops.staging` and the Python helpers read it through
``packed_info``) checks, before it reads a mapped blob, that each file it came from still has the size,
inode and modification time it had when it was mapped (one ``fstat`` on a descriptor held
since then) and raises ``RuntimeError`` naming the file otherwise — a file truncated after
loading would otherwise kill the process with SIGBUS, and one overwritten in place would
silently change the weights. A file truncated *during* a call is not caught (every mmap
reader shares that race); replacing a file by rename is harmless (the mapped inode stays
intact), and an in-place rewrite that keeps the size within the file system's timestamp
granularity (a few milliseconds) of the load is not seen. ``copy=True`` on the loaders reads
the bytes into RAM instead.
"""

from __future__ import annotations

import json
import os
import struct

import torch

from kt_ops._native import _C
from kt_ops._validate import regular_file_stat

_MAX_HEADER = 100 << 20  # as safetensors itself


def read_safetensors_header(path: str | os.PathLike[str]) -> tuple[dict, int]:
    """(the JSON header of a safetensors file, the offset its data starts at).

    Raises ``ValueError`` for a file that is not safetensors' (too short, a header length
    past the file or above 100 MiB, a header that is not a JSON object)."""
    name = os.fspath(path)
    regular_file_stat(name)  # a FIFO would block the open below for ever
    size = os.path.getsize(name)
    with open(name, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            raise ValueError(f"{name!r} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{name!r} is not a safetensors file (header length {length})")
        try:
            header = json.loads(file.read(length))
        except (ValueError, RecursionError) as error:  # bad UTF-8 or JSON, a huge integer, too deep a nesting
            raise ValueError(f"{name!r} is not a safetensors file ({error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name!r} is not a safetensors file (its header is not a JSON object)")
    return header, 8 + length


def safetensors_range(path: str | os.PathLike[str], key: str,
                      header: tuple[dict, int] | None = None) -> tuple[int, int]:
    """``(offset, nbytes)`` of tensor ``key``'s bytes in a safetensors file (``header``: what
    :func:`read_safetensors_header` returned for it, to skip reading it again).

    Raises ``ValueError`` for a header that is not safetensors', a key that is not a 1-D
    ``U8`` tensor, or a range past the end of the file; ``KeyError`` for a missing key.
    """
    name = os.fspath(path)
    entries, data_start = read_safetensors_header(name) if header is None else header
    if key not in entries:
        raise KeyError(f"{name!r} has no tensor {key!r}")
    entry = entries[key]
    if not isinstance(entry, dict):
        raise ValueError(f"{name!r}: tensor {key!r} has no valid entry ({entry!r})")
    offsets = entry.get("data_offsets")
    begin, end = offsets if isinstance(offsets, list) and len(offsets) == 2 else (None, None)
    shape = entry.get("shape")
    if (entry.get("dtype") != "U8" or not isinstance(shape, list) or len(shape) != 1
            or not isinstance(begin, int) or not isinstance(end, int) or not 0 <= begin <= end
            or end - begin != shape[0]):
        raise ValueError(f"{name!r}: tensor {key!r} is not a 1-D uint8 tensor ({entry!r})")
    offset, size = data_start + begin, os.path.getsize(name)
    if offset + (end - begin) > size:
        raise ValueError(f"{name!r} is truncated: tensor {key!r} needs bytes [{offset}, {offset + end - begin}) "
                         f"but the file has {size} bytes")
    return offset, end - begin


def load_uint8_tensor(path: str | os.PathLike[str], key: str, copy: bool = False,
                      header: tuple[dict, int] | None = None) -> torch.Tensor:
    """Tensor ``key`` (1-D uint8) of a safetensors file: memory-mapped copy-on-write and
    watched for changes (see the module docstring), or read into RAM with ``copy=True``
    (``header`` as :func:`safetensors_range`)."""
    offset, nbytes = safetensors_range(path, key, header)
    if not copy:
        return _C.map_file(os.fspath(path), offset, nbytes)
    data = torch.empty(nbytes, dtype=torch.uint8)
    with open(os.fspath(path), "rb") as file:
        file.seek(offset)
        read = file.readinto(memoryview(data.numpy()))
    if read != nbytes:
        raise ValueError(f"{os.fspath(path)!r} is truncated: tensor {key!r} needs {nbytes} bytes, read {read}")
    return data


_MADV_DONTNEED = 4


def _file_backed(address: int) -> bool:
    """Whether ``address`` lies in a mapping of a file (``/proc/self/maps`` names a path)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                begin, end = (int(v, 16) for v in fields[0].split("-"))
                if begin <= address < end:
                    return len(fields) == 6 and fields[5].strip().startswith("/")
    except OSError:
        return False
    return False


def release_file_pages(tensor: torch.Tensor) -> int:
    """Drops the pages of a tensor read from a memory-mapped file from this process's
    resident set (``madvise(MADV_DONTNEED)`` on the whole pages inside its bytes; they
    re-read from the file if touched again, and pages shared with neighbouring tensors are
    left alone). For a file-backed tensor whose contents were consumed (packed) but whose
    file stays mapped for other tensors. Anonymous memory is never touched. Returns the
    bytes released (0 where nothing applied)."""
    import ctypes
    import mmap

    if tensor.device.type != "cpu" or tensor.numel() == 0 or not tensor.is_contiguous():
        return 0
    start = tensor.data_ptr()
    if not _file_backed(start):
        return 0
    page = mmap.PAGESIZE
    begin = (start + page - 1) // page * page
    end = (start + tensor.numel() * tensor.element_size()) // page * page
    if end <= begin:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return end - begin if libc.madvise(begin, end - begin, _MADV_DONTNEED) == 0 else 0
