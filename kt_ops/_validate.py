"""Argument checks shared by the public entry points."""

from __future__ import annotations

import numbers
import os
import stat

import torch


def is_int(value: object) -> bool:
    """True for a Python ``int`` that is not a ``bool`` (``True`` is an ``int`` to
    ``isinstance``, but a count of ``True`` is a caller's mistake)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_integral(value: object) -> bool:
    """True for an integer, numpy's included (``numpy.int64``), that is not a ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def plain_int(value: object) -> object:
    """``value`` as a Python ``int`` when it is another integer type (numpy's), else as given."""
    return int(value) if is_integral(value) and not isinstance(value, int) else value


def names_file_inside(name: object) -> bool:
    """Whether ``name``, a file name from an index (``weight_map``), stays inside the
    directory it is relative to: a non-empty string, not absolute, whose ``..`` (after
    normalising, so ``sub/../shard`` is fine) does not lead out. Symlinks are not
    resolved: the Hugging Face cache's snapshots are symlinks to ``../../blobs``."""
    if not isinstance(name, str) or not name:
        return False
    relative = os.path.normpath(name)
    return not os.path.isabs(relative) and relative != "." and relative.split(os.sep)[0] != ".."


def require_bools(**values: object) -> None:
    """``ValueError`` naming the first of ``values`` that is not a ``bool``: a switch given
    "no", "False" or None (a non-empty string is truthy) turned on silently."""
    for name, value in values.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")


def require_tensors(**values: object) -> None:
    """``TypeError`` naming the first of ``values`` that is not a ``torch.Tensor``: a list or
    numpy array failed later on ``.dim()`` / ``.shape`` with an ``AttributeError``."""
    for name, value in values.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def is_real(value: object) -> bool:
    """True for a real number (``int``, ``float``, numpy scalars) that is neither a
    ``bool`` nor a string: ``True`` as a clamp limit, or ``"7"``, is a caller's mistake."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def regular_file_stat(path: str | os.PathLike[str], hint: str = "") -> os.stat_result:
    """``os.stat(path)`` (after symlinks) of a regular file; ``ValueError`` naming ``path``
    otherwise: opening a FIFO or a device to read a file's header blocks for ever.
    ``OSError`` (a missing file) propagates."""
    result = os.stat(path)
    if not stat.S_ISREG(result.st_mode):
        raise ValueError(f"{os.fspath(path)}: not a regular file (a FIFO, device or directory){hint}")
    return result


def bad_count(counts: torch.Tensor) -> str | None:
    """Where the real tensor ``counts`` first holds something that is not an activation count
    (finite and non-negative), as ``"-1.0 at [1, 3]"`` or ``"NaN at [0]"``; None when every
    value is one (``topk`` ranks NaN and inf above every count, a negative one below the idle
    experts)."""
    values = counts.double()
    bad = torch.nonzero(~torch.isfinite(values) | (values < 0))
    if not bad.shape[0]:
        return None
    at = bad[0].tolist()
    value = values[tuple(at)].item()
    return f"{'NaN' if value != value else counts[tuple(at)].item()} at {at}"
