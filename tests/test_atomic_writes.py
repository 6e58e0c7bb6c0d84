"""Files kt_ops writes over a user's earlier file stay whole when the new write fails.

PackedExperts.save, ExpertStats.save and the bench's ``--json`` write under a temporary
name and rename it over the target (kt_ops/_atomic.py): an error or Ctrl-C in the middle
of writing leaves the earlier file as it was and no temporary file behind.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kt_ops._atomic import write_replacing
from kt_ops.bench.__main__ import write_json
from kt_ops.expert_stats import ExpertStats


class Interrupted(BaseException):
    """Stands for a KeyboardInterrupt in the middle of a write (not an Exception)."""


def half_then_fail(tmp: str) -> None:
    Path(tmp).write_bytes(b"half a file")
    raise Interrupted


def test_failed_write_leaves_the_earlier_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"earlier")
    with pytest.raises(Interrupted):
        write_replacing(target, half_then_fail)
    assert target.read_bytes() == b"earlier"
    assert sorted(os.listdir(tmp_path)) == ["out.bin"]
    write_replacing(target, lambda tmp: Path(tmp).write_bytes(b"new"))
    assert target.read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path)) == ["out.bin"]


def test_a_symlink_has_its_target_replaced(tmp_path: Path) -> None:
    real = tmp_path / "real.bin"
    real.write_bytes(b"earlier")
    link = tmp_path / "link.bin"
    link.symlink_to(real)
    write_replacing(link, lambda tmp: Path(tmp).write_bytes(b"new"))
    assert link.is_symlink() and real.read_bytes() == b"new"


def test_bad_targets_are_named(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match="is a directory; say which file"):
        write_replacing(tmp_path, lambda tmp: None, "say which file")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_replacing(tmp_path / "missing" / "out.bin", lambda tmp: None)


def test_expert_stats_save_keeps_the_earlier_file_on_failure(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "stats.pt"
    ExpertStats.from_counts(torch.ones(2, 3, dtype=torch.int64)).save(target)
    saved = target.read_bytes()

    def failing_save(obj: object, f: str) -> None:
        Path(f).write_bytes(b"half")
        raise Interrupted

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(Interrupted):
        ExpertStats.from_counts(torch.full((2, 3), 7, dtype=torch.int64)).save(target)
    monkeypatch.undo()
    assert target.read_bytes() == saved
    assert sorted(os.listdir(tmp_path)) == ["stats.pt"]
    assert torch.equal(ExpertStats.load(target).counts, torch.ones(2, 3, dtype=torch.int64))


def test_bench_json_that_cannot_serialize_keeps_the_earlier_file(tmp_path: Path) -> None:
    target = tmp_path / "bench.json"
    write_json(str(target), {"rows": [1, 2]})
    earlier = target.read_text()
    with pytest.raises(TypeError):
        write_json(str(target), {"rows": [object()]})
    assert target.read_text() == earlier
    assert sorted(os.listdir(tmp_path)) == ["bench.json"]


def test_a_pipe_or_device_is_written_directly(tmp_path: Path) -> None:
    """``--json /dev/stdout | jq`` kept working: no temporary beside a device or a pipe."""
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    write_json(str(fifo), {"rows": [1]})
    reader.join(timeout=30)
    assert got == [b'{\n  "rows": [\n    1\n  ]\n}']
    assert sorted(os.listdir(tmp_path)) == ["pipe"] and fifo.is_fifo()
