"""NUMA nodes as the engine sees them, and where the parts of a layer run and live.

A layer split into ``threadpool_count`` parts over its intermediate dimension
(:mod:`kt_ops.parts`) runs every part at once, part ``i`` on the threads of NUMA node
``nodes[i]`` (node *ids*, as ``/sys/devices/system/node`` numbers them, not positions),
through ``torch.ops.kt.moe_forward_parts``; the fp32 partial outputs are summed once, in
part order. On a machine with several nodes each part's packed blob is copied into
memory of its node (:func:`place_parts`). ``KT_OPS_NUMA_SIMULATE=N``, read when the engine
starts (the first kt_ops import), splits the process's cores into ``N`` simulated nodes
with ids ``0 .. N-1``, so the same code runs on a one-node machine; simulated nodes have no
memory of their own, so nothing is copied there. docs/numa.md has the whole picture.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Sequence

import torch

from kt_ops._native import _C
from kt_ops.packed import PackedExperts


@dataclass(frozen=True)
class NumaNode:
    """One node: its id and the logical CPUs the process may run on there."""

    id: int
    cpus: tuple[int, ...]
    physical_cpus: tuple[int, ...]
    """One logical CPU per physical core, in ``cpus`` order."""


@dataclass(frozen=True)
class Topology:
    """The engine's nodes (in id order): the machine's, or ``KT_OPS_NUMA_SIMULATE``'s."""

    nodes: tuple[NumaNode, ...]
    simulated: bool

    @property
    def ids(self) -> list[int]:
        return [node.id for node in self.nodes]


@dataclass(frozen=True)
class PoolPlan:
    """The engine's own threads on one node: the CPUs they are pinned to."""

    node: int
    caller_cpu: int
    """The CPU left to the calling thread, which is this node's first thread; -1: not this node."""
    cpus: tuple[int, ...]
    """One pinned thread each (-1: unpinned); the first leads the node's parts unless the caller does."""

    @property
    def threads(self) -> int:
        return (self.caller_cpu >= 0) + len(self.cpus)


def topology() -> Topology:
    """The nodes the engine runs parts on."""
    info = _C.numa_topology()
    nodes = tuple(NumaNode(n["id"], tuple(n["cpus"]), tuple(n["physical_cpus"])) for n in info["nodes"])
    return Topology(nodes, bool(info["simulated"]))


def pool_plans() -> list[PoolPlan]:
    """The engine's pools, one per node, for the current thread count (:func:`kt_ops.get_num_threads`)."""
    return [PoolPlan(p["node"], p["caller_cpu"], tuple(p["cpus"])) for p in _C.pool_plans()]


def resolve_nodes(numa_nodes: Sequence[int] | None, parts: int) -> list[int]:
    """The node id of each of ``parts`` parts: ``numa_nodes`` checked against the
    topology (``ValueError`` naming an id that does not exist, ``TypeError`` for one that
    is not an integer), or by default the nodes in turn (part ``i`` on the ``i % N``-th node)."""
    known = topology()
    if numa_nodes is None:
        return [known.ids[i % len(known.ids)] for i in range(parts)]
    try:
        given = list(numa_nodes)
    except TypeError:  # numa_nodes=0: "'int' object is not iterable"
        raise TypeError(f"numa_nodes must be a sequence of {parts} node ids (one per part), got {numa_nodes!r}") from None
    if len(given) != parts:
        raise ValueError(f"numa_nodes has {len(given)} entries; threadpool_count is {parts}")
    nodes = []
    for node in given:
        try:
            if isinstance(node, bool):
                raise TypeError
            node = operator.index(node)
        except TypeError:
            raise TypeError(f"numa_nodes must hold int node ids, got {node!r}") from None
        nodes.append(node)
        if node not in known.ids:
            kind = "simulated (KT_OPS_NUMA_SIMULATE) node ids" if known.simulated else "node ids"
            raise ValueError(f"numa_nodes names node {node}, which does not exist; this machine has {kind} "
                             f"{', '.join(map(str, known.ids))}")
    return nodes


def place_parts(parts: Sequence[PackedExperts], nodes: Sequence[int]) -> list[PackedExperts]:
    """Each part's blob copied into memory of its node (``nodes[i]``), filled by that
    node's threads, where the machine has several real nodes; elsewhere (one node, or
    simulated nodes) the parts as they are. Parts already in their node's memory are kept."""
    known = topology()
    if known.simulated or len(known.nodes) < 2:
        return list(parts)
    placed = []
    for part, node in zip(parts, nodes):
        pages = memory_nodes(part.data)
        if set(pages) == {node}:
            placed.append(part)
            continue
        copy, _ = _C.copy_to_node(part.data, node)
        placed.append(PackedExperts(copy))
    return placed


_NUMA_MAPS_PAGES = re.compile(r"\bN(\d+)=(\d+)\b")


def read_numa_maps() -> str:
    """``/proc/self/numa_maps`` (one line per mapping: its start, policy and pages per
    node); empty where the kernel has none (no NUMA support) or it is unreadable."""
    try:
        with open("/proc/self/numa_maps") as file:
            return file.read()
    except OSError:
        return ""


def memory_nodes(tensor: torch.Tensor, numa_maps: str | None = None) -> dict[int, int]:
    """Node id -> pages of the mappings that hold ``tensor``'s bytes, from
    :func:`read_numa_maps` (or its text ``numa_maps``, whose lines give where each
    mapping starts: one ends where the next starts); empty where the kernel does not say
    (no NUMA support, the pages not touched yet). Whole mappings are counted: for a blob
    of :func:`place_parts` that is the blob, for a tensor of torch's allocator the heap
    mapping it sits in."""
    if numa_maps is None:
        numa_maps = read_numa_maps()
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    starts = []
    for line in numa_maps.splitlines():
        fields = line.split(maxsplit=1)
        if fields:
            starts.append((int(fields[0], 16), fields[1] if len(fields) > 1 else ""))
    pages: dict[int, int] = {}
    for index, (start, rest) in enumerate(starts):
        stop = starts[index + 1][0] if index + 1 < len(starts) else 1 << 64
        if stop <= begin or start >= end:
            continue
        for node, count in _NUMA_MAPS_PAGES.findall(rest):
            pages[int(node)] = pages.get(int(node), 0) + int(count)
    return dict(sorted(pages.items()))
