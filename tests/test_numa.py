"""NUMA parts: a layer split into ``threadpool_count`` parts over its intermediate dimension
runs every part at once, part ``i`` on the pool of node ``numa_nodes[i]`` (node ids, not
positions), the fp32 partial outputs summed once in part order (``kt::moe_forward_parts``).

The engine reads ``KT_OPS_NUMA_SIMULATE`` when it starts, so the tests that need two
nodes run in a child pytest with ``KT_OPS_NUMA_SIMULATE=2`` (test_two_simulated_nodes):
the same code as on a two-socket machine, this machine's cores split into two pools. In
this process they are skipped unless the machine really has two nodes. Per part the
evidence is the engine's own record (``_C.last_parts``: the node, OS thread and CPU
that ran it) and a rendezvous (``_C._engine_node_thread_ids``: every part waits until
all have started, so parts that did not run at once time out): no timing.

Accuracy, per format: the parts operator equals the parts run one after another by
``kt::moe_forward`` and summed in order, bit for bit; two parts vs one within fp32
reduction rounding (rel 1e-5) for BF16 and for the quantized formats whose quantization
the split leaves as it is, within the format's own bound for the others (FORMATS says
which and why), and against the reference on the parts' dequantized weights within the
format's bound.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kt_ops
from conftest import make_experts, random_routing, rel_err
from kt_ops import numa, reference
from kt_ops._native import _C
from kt_ops.parts import pack_parts

TOPOLOGY = numa.topology()
TWO_NODES = len(TOPOLOGY.nodes) >= 2
N0, N1 = (TOPOLOGY.ids + TOPOLOGY.ids)[:2]  # the first two node ids (0, 1 when simulated)
needs_two_nodes = pytest.mark.skipif(
    not TWO_NODES, reason="needs two NUMA nodes: runs in test_two_simulated_nodes' child (KT_OPS_NUMA_SIMULATE=2)")
E, K, H, I = 8, 2, 256, 512
# (method, pack_experts keywords, bound vs the reference on the parts' dequantized weights
# (the format's own: tests/test_quantized.py, test_fp8.py, test_gguf.py), bound vs the layer
# packed whole). Where the split leaves the quantization as it is (fp8 and mxfp8 blocks,
# ggml blocks, split on block boundaries) two parts and one differ by fp32 reduction order
# only (measured 6e-8 .. 4e-7); int8/int4/mxfp4 quantize each intermediate row per part (one
# int8 scale per part's half row: measured 1.2-1.6e-2), fp8_perchannel's down has one
# scale per row of each part (measured 2.4-2.7e-2): different quantizations, each within
# the format's bound of its reference.
FORMATS = [
    ("AMXINT8", {}, 3e-2, 3e-2),
    ("AMXINT4", {"group_size": 32}, 3e-2, 3e-2),
    ("MOE_INT4", {"group_size": 64, "zero_point": True}, 3e-2, 3e-2),
    ("FP8", {}, 1e-2, 1e-5),
    ("FP8_PERCHANNEL", {}, 1e-2, 4e-2),
    ("MXFP8", {}, 1e-2, 1e-5),
    ("MXFP4", {}, 3e-2, 3e-2),
    ("LLAMAFILE", {"gguf_type": "Q4_K"}, 3e-2, 1e-5),
    ("LLAMAFILE", {"gguf_type": "Q8_0"}, 3e-2, 1e-5),
]


def layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    experts = make_experts(E, H, I, seed)
    return experts.gate, experts.up, experts.down


def inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, weights = random_routing(tokens, E, K, seed)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed + 7))
    return x, ids, weights


def wrapper(threadpool_count: int, weights: tuple, **kwargs) -> kt_ops.KTMoEWrapper:
    kwargs.setdefault("method", "BF16")
    wr = kt_ops.KTMoEWrapper(0, E, K, H, I, threadpool_count=threadpool_count, **kwargs)
    wr.load_weights_from_tensors(*weights)
    return wr


def dequantized_layer(parts: list[kt_ops.PackedExperts]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The parts' dequantized weights joined back along I."""
    pieces = [reference.dequantize(part.data) for part in parts]
    return (torch.cat([p[0] for p in pieces], 1), torch.cat([p[1] for p in pieces], 1),
            torch.cat([p[2] for p in pieces], 2))


# ---- in this process, any machine -------------------------------------------------------


@pytest.mark.skipif(bool(os.environ.get("KT_OPS_NUMA_SIMULATE")), reason="this is the child")
@pytest.mark.skipif(sum(len(node.physical_cpus) for node in TOPOLOGY.nodes) < 2,
                    reason="two simulated nodes need two physical cores")
def test_two_simulated_nodes() -> None:
    """This file again, in a child with KT_OPS_NUMA_SIMULATE=2: the two-node tests run
    there and must pass."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                            env={**os.environ, "KT_OPS_NUMA_SIMULATE": "2"}, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "needs two NUMA nodes" not in result.stdout, result.stdout[-3000:]


def test_simulated_node_count_is_checked() -> None:
    """More simulated nodes than physical cores, or 0, is a clear error when the engine starts."""
    for value, message in ((str((os.cpu_count() or 1) + 1), "simulated NUMA nodes, but the process may run on"),
                           ("0", "KT_OPS_NUMA_SIMULATE must be a positive integer")):
        result = subprocess.run([sys.executable, "-c", "import kt_ops"], env={**os.environ, "KT_OPS_NUMA_SIMULATE": value},
                                capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]


def test_parts_on_one_node_run_one_after_another_on_all_threads() -> None:
    """Parts that share a node run in index order (on a one-node machine: on all threads)
    and give the sum of the parts."""
    parts = pack_parts(*layer(), "BF16", 2)
    x, ids, w = inputs(9)
    node = TOPOLOGY.ids[0]
    got = kt_ops.ops.moe_forward_parts(x, ids, w, parts, [node, node])
    assert torch.equal(got, kt_ops.moe_forward(x, ids, w, parts[0]) + kt_ops.moe_forward(x, ids, w, parts[1]))
    assert [run[0] for run in _C.last_parts()] == [node, node]


@pytest.mark.parametrize("tokens,dtype", [(1, torch.bfloat16), (9, torch.float32), (20, torch.float16),
                                          (0, torch.bfloat16)])
def test_opcheck(tokens: int, dtype: torch.dtype) -> None:
    parts = pack_parts(*layer(), "BF16", 2)
    x, ids, w = inputs(tokens)
    nodes = TOPOLOGY.ids[:2] if TWO_NODES else [TOPOLOGY.ids[0]] * 2
    torch.library.opcheck(torch.ops.kt.moe_forward_parts.default,
                          (x.to(dtype), ids, w, [p.data for p in parts], nodes))


def test_bad_arguments() -> None:
    parts = pack_parts(*layer(), "BF16", 2)
    x, ids, w = inputs(3)
    missing = max(TOPOLOGY.ids) + 1
    with pytest.raises(ValueError, match=f"NUMA node {missing} does not exist"):
        kt_ops.ops.moe_forward_parts(x, ids, w, parts, [N0, missing])
    with pytest.raises(ValueError, match="one NUMA node id per part"):
        kt_ops.ops.moe_forward_parts(x, ids, w, parts, [N0])
    with pytest.raises(ValueError, match="at least one packed blob"):
        kt_ops.ops.moe_forward_parts(x, ids, w, [], [])
    other = pack_parts(*(t[:4] for t in layer()), "BF16", 2)[1]
    with pytest.raises(ValueError, match=r"parts\[1\] holds 4 experts but parts\[0\] holds 8"):
        kt_ops.ops.moe_forward_parts(x, ids, w, [parts[0], other], [N0, N0])
    bad_ids = ids.clone()
    bad_ids[1, 0] = E
    with pytest.raises(ValueError, match="outside"):
        kt_ops.ops.moe_forward_parts(x, bad_ids, w, parts, [N0, N0])
    with pytest.raises(ValueError, match=f"numa_nodes names node {missing}, which does not exist"):
        kt_ops.KTMoEWrapper(0, E, K, H, I, threadpool_count=2, method="BF16", numa_nodes=[N0, missing])
    with pytest.raises(ValueError, match="numa_nodes has 1 entries; threadpool_count is 2"):
        kt_ops.KTMoEWrapper(0, E, K, H, I, threadpool_count=2, method="BF16", numa_nodes=[N0])
    with pytest.raises(TypeError, match="int node ids"):
        kt_ops.KTMoEWrapper(0, E, K, H, I, threadpool_count=1, method="BF16", numa_nodes=["0"])


def test_a_part_the_method_cannot_pack_names_the_split() -> None:
    """An INT4 group wider than a part: the error named the part's width as the layer's I
    ("intermediate_size I = 64" for a layer of I = 512), not threadpool_count."""
    wr = kt_ops.KTMoEWrapper(0, E, K, H, I, threadpool_count=8, method="AMXINT4", group_size=128)
    with pytest.raises(ValueError, match=r"threadpool_count 8 splits moe_intermediate_size 512 into parts of 64"):
        wr.load_weights_from_tensors(*layer())


def test_a_bad_weight_or_argument_is_not_blamed_on_the_split() -> None:
    """pack_parts named a NaN by its row in the part ("row 36" for the layer's row 100) and
    blamed the split for it, and for a group size no method takes (256): both are the
    layer's, refused as pack_experts refuses them."""
    gate, up, down = layer()
    gate = gate.clone()
    gate[1, 300, 5] = float("nan")
    with pytest.raises(ValueError, match=r"^gate_proj: expert 1, row 300 holds nan"):
        pack_parts(gate, up, down, "BF16", 2)
    with pytest.raises(ValueError, match=r"^method 'AMXINT4' needs group_size 32, 64 or 128 \(or None\), got 256"):
        pack_parts(*layer(), "AMXINT4", 4, group_size=256)


@pytest.mark.parametrize("parts", [2, 4])
def test_pack_parts_splits_the_layers_biases(parts: int) -> None:
    """pack_parts(..., biases=...) gave every part the whole layer's biases: a down bias
    alone was added once per part (86 % off for two parts), gate/up biases were refused
    as if the split were wrong. Gate/up biases split with the rows, down's on part 0."""
    gate, up, down = layer()
    g = torch.Generator().manual_seed(3)
    biases = (torch.randn(E, I, generator=g), torch.randn(E, I, generator=g), torch.randn(E, H, generator=g))
    x, ids, w = inputs(5)
    for chosen in ((None, None, biases[2]), biases):
        whole = pack_parts(gate, up, down, "BF16", 1, biases=chosen, swiglu_limit=7.0)[0]
        split = pack_parts(gate, up, down, "BF16", parts, biases=chosen, swiglu_limit=7.0)
        got = kt_ops.ops.moe_forward_parts(x, ids, w, split, [N0] * parts)
        assert rel_err(got, kt_ops.moe_forward(x, ids, w, whole)) <= 1e-5
        assert rel_err(got, reference.moe_forward(x, ids, w, gate, up, down, swiglu_limit=7.0, biases=chosen)) <= 1e-2
    with pytest.raises(ValueError, match=r"gate_bias must be a tensor \[8, 512\] \(the whole layer\)"):
        pack_parts(gate, up, down, "BF16", parts, biases=(biases[0][:, : I // parts], None, None))


@pytest.mark.parametrize("node", [0.7, "0", True], ids=["float", "str", "bool"])
def test_a_node_id_that_is_not_an_int_is_refused(node) -> None:
    """kt_ops.moe_forward_parts passed int(n) of each node to the operator: 0.7 ran on node
    0, "1" on node 1 and True on node 1, where the operator's int[] refuses a float (and
    KTMoEWrapper's numa_nodes refuses all three)."""
    parts = pack_parts(*layer(), "BF16", 2)
    x, ids, w = inputs(3)
    with pytest.raises(TypeError, match="nodes must hold int node ids"):
        kt_ops.ops.moe_forward_parts(x, ids, w, parts, [N0, node])


def test_default_nodes_are_the_nodes_in_turn() -> None:
    ids = TOPOLOGY.ids
    assert numa.resolve_nodes(None, 4) == [ids[i % len(ids)] for i in range(4)]
    assert wrapper(4, layer()).numa_nodes == [ids[i % len(ids)] for i in range(4)]


def test_copy_to_node_keeps_the_bytes() -> None:
    """The copy a part gets in its node's memory (copy_to_node; on a machine with several
    real nodes place_parts makes it at load) holds the same bytes; numa_maps says where."""
    blob = pack_parts(*layer(), "AMXINT8", 2)[1].data
    node = TOPOLOGY.ids[-1]
    copy, bound = _C.copy_to_node(blob, node)
    assert torch.equal(copy, blob) and copy.data_ptr() != blob.data_ptr()
    if TOPOLOGY.simulated:
        assert not bound, "simulated nodes have no memory to bind"
    if bound:  # the kernel took the preference: the pages are on the node
        assert set(numa.memory_nodes(copy)) == {node}
    with pytest.raises(ValueError, match="does not exist"):
        _C.copy_to_node(blob, max(TOPOLOGY.ids) + 1)


def test_memory_nodes_reads_numa_maps() -> None:
    tensor = torch.empty(3 << 12, dtype=torch.uint8)
    start = tensor.data_ptr() & ~0xFFF
    text = (f"{start - 0x10000:x} default anon=2 N0=2 kernelpagesize_kB=4\n"
            f"{start:x} prefer:1 anon=4 dirty=4 N0=1 N1=3 kernelpagesize_kB=4\n"
            f"{start + (8 << 12):x} default file=/x mapped=5 N0=5 kernelpagesize_kB=4\n")
    assert numa.memory_nodes(tensor, text) == {0: 1, 1: 3}
    assert numa.memory_nodes(tensor, "") == {}


def test_place_parts_copies_only_across_real_nodes() -> None:
    """One node or simulated nodes: the parts stay where they are. Real nodes: each part
    is copied (same bytes) into its node's memory."""
    parts = pack_parts(*layer(), "BF16", 2)
    nodes = numa.resolve_nodes(None, 2)
    placed = numa.place_parts(parts, nodes)
    for before, after, node in zip(parts, placed, nodes):
        assert torch.equal(before.data, after.data)
        if TOPOLOGY.simulated or not TWO_NODES:
            assert after is before
        elif numa.memory_nodes(after.data):
            assert set(numa.memory_nodes(after.data)) == {node}


# ---- two nodes (the child of test_two_simulated_nodes, or a machine that has them) -----


@needs_two_nodes
def test_topology_and_pools() -> None:
    """Every node has CPUs of its own; each node's pool is pinned inside it; doctor says so."""
    ids = TOPOLOGY.ids
    cpus = [set(node.cpus) for node in TOPOLOGY.nodes]
    assert len(ids) == len(set(ids)) and all(cpus) and not set.intersection(*cpus)
    if TOPOLOGY.simulated:
        assert ids == list(range(len(ids)))
    plans = numa.pool_plans()
    assert [plan.node for plan in plans] == ids
    assert plans[0].caller_cpu in cpus[0]
    for plan, node_cpus in zip(plans, cpus):
        assert {cpu for cpu in plan.cpus if cpu >= 0} <= node_cpus
    report = kt_ops.doctor()
    for plan in plans:
        assert f"  pool of node{plan.node}: " in report
    if TOPOLOGY.simulated:
        assert f"simulated NUMA nodes (KT_OPS_NUMA_SIMULATE={len(ids)}" in report


@needs_two_nodes
def test_parts_run_at_once_on_distinct_threads() -> None:
    """Each part waits until every part has started: only parts running at once return
    their thread ids (a part that waited in vain reports -1)."""
    for nodes in ([N0, N1], [N1, N0], [N1]):
        threads = _C._engine_node_thread_ids(nodes)
        assert -1 not in threads and len(set(threads)) == len(nodes), (nodes, threads)
        assert [run[0] for run in _C.last_parts()] == nodes


@needs_two_nodes
@pytest.mark.parametrize("numa_nodes", [None, [N1, N0]])
def test_each_part_runs_on_its_node(numa_nodes: list[int] | None) -> None:
    """The engine's record of a forward: part i on node numa_nodes[i] (default 0, 1), by
    two different threads, the one of node 1 (a pinned leader) on one of its CPUs; the
    result does not depend on which node runs which part."""
    weights = layer()
    x, ids, w = inputs(5)
    wr = wrapper(2, weights, numa_nodes=numa_nodes)
    out = wr.forward(x, ids, w)
    runs = _C.last_parts()
    nodes = numa_nodes or [N0, N1]
    assert [run[0] for run in runs] == nodes
    assert runs[0][1] != runs[1][1]
    leader = runs[nodes.index(N1)]
    assert leader[2] in TOPOLOGY.nodes[1].cpus
    assert torch.equal(out, wrapper(2, weights).forward(x, ids, w))


@needs_two_nodes
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_bf16_two_parts_match_one(tokens: int) -> None:
    weights = layer()
    x, ids, w = inputs(tokens)
    one, two = wrapper(1, weights), wrapper(2, weights)
    assert two._part_nodes == [N0, N1] and one._part_nodes is None
    got = two.forward(x, ids, w)
    assert got.dtype == torch.float32
    assert rel_err(got, one.forward(x, ids, w)) <= 1e-5
    assert torch.equal(got, kt_ops.moe_forward(x, ids, w, two._parts[0]) + kt_ops.moe_forward(x, ids, w, two._parts[1]))
    assert [run[0] for run in _C.last_parts()] == [N0, N1]


@needs_two_nodes
@pytest.mark.parametrize("method,kwargs,bound,whole_bound", FORMATS,
                         ids=[f"{m}-{'-'.join(map(str, k.values()))}" for m, k, _, _ in FORMATS])
def test_quantized_parts(method: str, kwargs: dict, bound: float, whole_bound: float) -> None:
    """The parts operator is the parts' forwards summed in order, bit for bit; against the
    reference on the parts' dequantized weights within the format's bound; against the
    layer packed whole within FORMATS' bound."""
    gate, up, down = layer()
    parts = pack_parts(gate, up, down, method, 2, **kwargs)
    whole = pack_parts(gate, up, down, method, 1, **kwargs)[0]
    for tokens in (1, 20):
        x, ids, w = inputs(tokens, seed=tokens)
        got = kt_ops.ops.moe_forward_parts(x, ids, w, parts, [N0, N1])
        assert [run[0] for run in _C.last_parts()] == [N0, N1]
        assert torch.equal(got, kt_ops.moe_forward(x, ids, w, parts[0]) + kt_ops.moe_forward(x, ids, w, parts[1]))
        assert rel_err(got, kt_ops.moe_forward(x, ids, w, whole)) <= whole_bound
        assert rel_err(got, reference.moe_forward(x, ids, w, *dequantized_layer(parts))) <= bound


@needs_two_nodes
def test_one_part_on_node_1() -> None:
    """numa_nodes=[1] with one part (kt-kernel indexes pools by position and breaks here):
    it runs on node 1's pool, with the same bits as on all threads."""
    weights = layer()
    x, ids, w = inputs(6)
    wr = wrapper(1, weights, numa_nodes=[N1])
    assert wr._part_nodes == [N1]
    out = wr.forward(x, ids, w)
    assert [run[0] for run in _C.last_parts()] == [N1]
    assert _C.last_parts()[0][2] in TOPOLOGY.nodes[1].cpus
    assert torch.equal(out, wrapper(1, weights).forward(x, ids, w))


@needs_two_nodes
def test_deterministic() -> None:
    """Repeated calls give the same bits, whichever part finishes first; so do more parts
    than nodes (parts 0 and 2 on node 0, one after another)."""
    weights = layer()
    for parts in (2, 4):
        wr = wrapper(parts, weights)
        for tokens in (1, 33):
            x, ids, w = inputs(tokens, seed=tokens)
            first = wr.forward(x, ids, w)
            for _ in range(5):
                assert torch.equal(wr.forward(x, ids, w), first)
    assert [run[0] for run in _C.last_parts()] == [N0, N1, N0, N1]


@needs_two_nodes
def test_threads_dealt_over_the_nodes() -> None:
    """n threads give each node n / N of them (+1 for the first n % N), unpinned past the
    CPUs; with one thread node 1's pool has none and its part runs on the caller's node.
    The results stay the same. (Called from this thread: torch's thread count is per
    calling thread.)"""
    previous = kt_ops.get_num_threads()
    parts = pack_parts(*layer(), "BF16", 2)
    x, ids, w = inputs(4)
    expected = kt_ops.ops.moe_forward_parts(x, ids, w, parts, [N0, N1])
    try:
        for threads in (1, 2, 3, 5):
            kt_ops.set_num_threads(threads)
            counts = [plan.threads for plan in numa.pool_plans()]
            assert sum(counts) == threads and max(counts) - min(counts) <= 1 and counts[0] == max(counts), counts
            assert torch.equal(kt_ops.ops.moe_forward_parts(x, ids, w, parts, [N0, N1]), expected)
            assert [run[0] for run in _C.last_parts()] == ([N0, N0] if counts[1] == 0 else [N0, N1])
    finally:
        kt_ops.set_num_threads(previous)
