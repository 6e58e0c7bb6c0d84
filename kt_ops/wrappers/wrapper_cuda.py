"""KTMoEWrapper's expert computation, one code for both paths: physical slots mapped to
packed experts by a device-side table, parts and chunks summed in fp32.

CPU inputs run it on a background thread. With a build that has the CUDA key (:func:`kt_ops.cuda.is_built`), ``submit_forward``
with CUDA ``hidden_states`` queues ``torch.ops.kt.moe_forward`` (``moe_forward_parts``
for a layer in NUMA parts) on the stream (``cuda_stream`` or the current one): the inputs are staged into pinned memory, the
experts run in a host function and the result is copied back, in stream order, with
no host synchronisation in Python (ids are mapped to packed experts on the device), so
``forward`` can be captured in a CUDA graph once the batch sizes were given to
``KTMoEWrapper.set_capture_batch_sizes``. These helpers are plain tensor code and
trace with fake CUDA tensors (tests/test_wrapper_cuda.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kt_ops._validate import is_int
from kt_ops.numa import resolve_nodes
from kt_ops.ops import moe_forward, moe_forward_parts
from kt_ops.packed import PackedExperts


def capture_call_sizes(batch_sizes: Sequence[int], chunk: int | None) -> list[int]:
    """Token counts of the ``moe_forward`` calls a batch of each size makes when
    ``chunked_prefill_size = chunk`` splits it (full chunks and the remainder)."""
    sizes: set[int] = set()
    for batch in batch_sizes:
        step = chunk or batch
        sizes.add(min(batch, step))
        if batch > step and batch % step:
            sizes.add(batch % step)
    return sorted(sizes)


def route_table(route: torch.Tensor, bad_id: int, device: torch.device) -> torch.Tensor:
    """``route`` (int32 ``[E]``: physical slot -> packed expert, -1 for GPU slots) with one
    more entry, ``bad_id``, that out-of-range slots map to, on ``device``."""
    return torch.cat([route.to(torch.int32), torch.tensor([bad_id], dtype=torch.int32)]).to(device)


def packed_ids(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Physical slots ``ids [T, K]`` (-1 skips) -> packed expert ids (int32) on ids' device,
    without a host synchronisation: an id >= E maps to ``table[-1]``, an id the packed
    experts do not have, so the operator's host function reports it (on CUDA, raised by
    the next call or :func:`kt_ops.cuda.raise_pending_error`). So does an id below -1."""
    slots = table.shape[0] - 1
    ids = ids.long()
    inside = (ids >= 0) & (ids < slots)
    mapped = torch.take(table, torch.where(inside, ids, slots))  # take: traceable with fake CUDA tensors
    return torch.where(ids == -1, torch.full_like(mapped, -1), mapped)  # ids < -1: table[-1], reported


def experts_on_device(
    parts: Sequence[PackedExperts],
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    table: torch.Tensor | None,
    chunk: int | None,
    nodes: Sequence[int] | None = None,
) -> torch.Tensor:
    """fp32 ``[T, H]`` on x's device: the CPU experts of physical ``ids [T, K]`` summed
    over ``parts`` (fp32 rows in and out, as on the CPU path), ``chunk`` tokens per call.

    CPU or CUDA tensors alike: several parts (or ``nodes`` given) run in one
    ``kt::moe_forward_parts`` call, part ``i`` on the threads of NUMA node ``nodes[i]``
    (None: the nodes in turn, :func:`kt_ops.numa.resolve_nodes`), all parts at once; one
    part without ``nodes`` is one ``kt::moe_forward`` on all threads. ``table``: the route
    (:func:`route_table`), or None when ``ids`` are the packed experts' ids already."""
    on_nodes = nodes is not None or len(parts) > 1
    if on_nodes and nodes is None:
        nodes = resolve_nodes(None, len(parts))
    x = x.float().contiguous()
    weights = weights.float().contiguous()
    routed = (ids if table is None else packed_ids(ids, table)).contiguous()
    tokens = x.shape[0]
    if tokens == 0:
        return torch.zeros_like(x)
    step = chunk or tokens
    pieces = []
    for t0 in range(0, tokens, step):
        n = min(step, tokens - t0)  # narrow, not x[a:b]: indexing does not trace with fake CUDA tensors
        rows = (x, routed, weights) if n == tokens else [t.narrow(0, t0, n) for t in (x, routed, weights)]
        if on_nodes:
            pieces.append(moe_forward_parts(*rows, parts, nodes))
        else:  # one part, or none
            pieces.append(moe_forward(*rows, parts[0]) if parts else torch.zeros_like(rows[0]))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def resolve_stream(cuda_stream: object | None, device: torch.device) -> torch.cuda.Stream:
    """kt-kernel's ``cuda_stream`` argument: None (the current stream of ``device``), a
    ``torch.cuda.Stream``, or a raw ``cudaStream_t`` handle as an int
    (``torch.cuda.current_stream().cuda_stream``)."""
    if cuda_stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(cuda_stream, torch.cuda.Stream):
        return cuda_stream
    if is_int(cuda_stream):
        return torch.cuda.ExternalStream(cuda_stream, device=device)
    raise TypeError(f"cuda_stream must be None, a torch.cuda.Stream or a cudaStream_t int; got {type(cuda_stream)}")
