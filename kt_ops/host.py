"""What the operating system says about this machine: CPU flags, NUMA nodes, huge pages.

Read from Linux's ``/proc`` and ``/sys`` under ``root`` (``/``; tests pass a fake tree).
Where a file is missing (another OS, a container hiding ``/sys``) the functions return
empty results or ``None``: the caller says "unknown" rather than guessing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/")


def _read(root: Path, relative: str) -> str | None:
    try:
        return (root / relative).read_text()
    except OSError:
        return None


def cpu_fields(root: Path = ROOT) -> dict[str, str] | None:
    """The first CPU's ``key: value`` lines from ``/proc/cpuinfo`` (``"vendor_id"``,
    ``"cpu family"``, ``"model"``, ``"flags"`` ...), stripped; None if unreadable."""
    text = _read(root, "proc/cpuinfo")
    if text is None:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():  # the blank line after the first CPU's block
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags(root: Path = ROOT) -> frozenset[str] | None:
    """The first CPU's ``flags`` from ``/proc/cpuinfo`` (e.g. ``"amx_tile"``); None if unreadable."""
    fields = cpu_fields(root)
    return None if fields is None else frozenset(fields.get("flags", "").split())


def numa_nodes(root: Path = ROOT) -> dict[int, str]:
    """NUMA node id -> its CPU list as the kernel writes it (``"0-15,32-47"``), from
    ``/sys/devices/system/node/node*/cpulist``; empty if the kernel does not say."""
    nodes: dict[int, str] = {}
    for path in (root / "sys/devices/system/node").glob("node*"):
        match = re.fullmatch(r"node(\d+)", path.name)
        cpus = _read(root, f"sys/devices/system/node/{path.name}/cpulist")
        if match and cpus is not None:
            nodes[int(match[1])] = cpus.strip()
    return dict(sorted(nodes.items()))


def transparent_hugepages(root: Path = ROOT) -> str | None:
    """The transparent huge page mode (``always``, ``madvise`` or ``never``: the bracketed
    word of ``/sys/kernel/mm/transparent_hugepage/enabled``); None if unreadable."""
    text = _read(root, "sys/kernel/mm/transparent_hugepage/enabled")
    match = re.search(r"\[(\w+)\]", text or "")
    return match[1] if match else None


@dataclass(frozen=True)
class HugePages:
    """Reserved (hugetlbfs) huge pages from ``/proc/meminfo``."""

    total: int
    """``HugePages_Total``: pages reserved."""
    free: int
    """``HugePages_Free``: reserved pages not in use."""
    size_kib: int
    """``Hugepagesize``: KiB per page."""


def hugepages(root: Path = ROOT) -> HugePages | None:
    """The reserved huge pages; None if ``/proc/meminfo`` is unreadable or does not say."""
    text = _read(root, "proc/meminfo")
    if text is None:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        number = value.split()
        if number and number[0].isdigit():
            values[key.strip()] = int(number[0])
    if "HugePages_Total" not in values:
        return None
    return HugePages(values["HugePages_Total"], values.get("HugePages_Free", 0), values.get("Hugepagesize", 0))
