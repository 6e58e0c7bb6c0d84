"""The CUDA key of ``torch.ops.kt.moe_forward``: build status and its pinned buffers.

With CUDA inputs the operator stages them into pinned host memory on the current
stream, runs the CPU experts in a ``cudaLaunchHostFunc`` host function and copies the
result back. Eager calls allocate their staging on first use (per stream, per
power-of-two token bucket). A CUDA graph cannot allocate while capturing, so the batch
sizes to capture are reserved first with :func:`reserve_cuda_graph_buffers` (or
``HybridMoE.set_capture_batch_sizes``).
"""

from __future__ import annotations

from typing import Iterable

import torch

from kt_ops._native import _C


def is_built() -> bool:
    """True when this build of kt_ops has the CUDA key (torch with CUDA and nvcc at build time)."""
    return bool(_C.with_cuda)


def _require_built() -> None:
    if not is_built():
        raise RuntimeError("this kt_ops build has no CUDA key: rebuild against a CUDA build of torch with nvcc on "
                           "the PATH (KT_OPS_CUDA=1 pip install --no-build-isolation -e .)")


def reserve_cuda_graph_buffers(
    batch_sizes: Iterable[int], hidden_size: int, top_k: int, device: torch.device | int | str | None = None
) -> None:
    """Reserves pinned staging for graph capture at each batch size (tokens per call) of
    layers with this hidden size and top-k, on ``device`` (default: the current CUDA
    device). Reserved once, never reallocated; every captured layer of that shape shares
    them (graphs replay in stream order)."""
    _require_built()
    sizes = sorted({int(b) for b in batch_sizes})
    if any(b < 1 for b in sizes) or hidden_size < 1 or top_k < 1:
        raise ValueError(f"batch sizes, hidden_size and top_k must be positive; got {sizes}, {hidden_size}, {top_k}")
    target = torch.device("cuda") if device is None else torch.device(device)
    if target.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {target}")
    index = torch.cuda.current_device() if target.index is None else target.index
    for tokens in sizes:
        _C.reserve_graph_staging(index, tokens, int(hidden_size), int(top_k))


def pinned_staging_bytes() -> int:
    """Bytes of pinned host memory held by the CUDA key's staging buffers."""
    return int(_C.staging_bytes()) if is_built() else 0


def captured_host_calls() -> int:
    """Host-function argument structs owned by captured CUDA graphs (one per captured
    ``moe_forward`` call); each is freed when its graph and the graph's executable
    instances are destroyed, so re-capturing does not grow it without bound."""
    return int(_C.captured_host_calls()) if is_built() else 0


def raise_pending_error() -> None:
    """Raises (RuntimeError) the first failure recorded by a host function since the last
    check (an expert id out of range, say); the next CUDA ``moe_forward`` raises it too."""
    if is_built():
        message = _C.take_host_error()
        if message:
            raise RuntimeError(message)
