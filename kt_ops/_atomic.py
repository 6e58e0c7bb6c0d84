"""Files written whole or not at all: under a temporary name beside the target, then renamed over it."""

from __future__ import annotations

import os
from typing import Callable


def write_replacing(path: str | os.PathLike[str], write: Callable[[str], None], what: str = "this writes one file") -> None:
    """Calls ``write(tmp)`` to write a temporary file in ``path``'s directory, then renames it
    over ``path`` (a symlink's target is replaced): a file already there stays whole until
    the new one is complete, and an error or Ctrl-C inside ``write`` (a full disk, an object
    that does not serialize) deletes the temporary file and leaves ``path`` as it was. A
    process that has the old file memory-mapped keeps its inode. A path that exists but is
    not a regular file (a pipe, ``/dev/stdout``) is written directly.

    Raises ``IsADirectoryError`` when ``path`` is a directory (``what`` completes the
    message) and ``FileNotFoundError`` when its directory does not exist.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path!r} is a directory; {what}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"{path!r}: its directory {parent!r} does not exist")
    target = os.path.realpath(path)
    if os.path.exists(target) and not os.path.isfile(target):  # a pipe or a device (--json /dev/stdout)
        write(target)
        return
    tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
