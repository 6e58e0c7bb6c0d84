"""GPU-assisted prefill: a long prompt's CPU experts computed on the GPU.

A prompt of thousands of tokens hits nearly every expert of a layer many times: there the
GPU's GEMMs win even counting the copy of the experts over PCIe, while a decode step's
few tokens are cheaper on the CPU that holds the weights. kt-kernel with SGLang switches at
``--kt-gpu-prefill-token-threshold`` (``../shared/reference/kt-kernel-upstream-specs.md``
§6.4-6.5); :class:`kt_ops.HybridMoE` and the transformers experts path do the same with
``gpu_prefill_token_threshold``, through :func:`moe_forward_on_device`.

One call, in chunks of the routed experts (about ``chunk_bytes`` of packed weights each):

1. the host writes chunk ``k``'s experts as checkpoint rows — the rows kt-kernel's
   staging layouts are cut from (:func:`kt_ops.staging.stage_rows_into`: the packed codes
   un-tiled on the engine's threads, never widened, per-row scales) — straight into pinned
   memory (INT4 scales kept in fp32 where kt-kernel truncates them to bf16; INT8 and
   asymmetric INT4, which kt-kernel does not stage, as int8 rows with fp32 row scales and
   as nibbles with fp32 (scale, minimum) pairs); GGUF layers as their own
   blocks (:mod:`kt_ops.gguf_torch` decodes them on the device); Q2_K and Q3_K as weights
   dequantized to the compute dtype (:func:`kt_ops.dequantize_experts`);
2. a copy stream moves chunk ``k`` to the GPU;
3. the current stream expands the chunk's codes to the compute dtype (:func:`expand_rows`,
   :func:`kt_ops.gguf_torch.dequantize_rows`) and runs all its experts at once: the
   chunk's rows gathered in expert order, one grouped GEMM each for gate, up and down
   (``torch._grouped_mm`` in bf16 where the rows are 16-byte aligned; else one product
   per expert), then one ``index_add_`` into the output per place a token's experts take
   in its ascending order (at most K).

A background thread stages chunk ``k + 1`` on the host (the engine's threads) while the
calling thread queues chunk ``k``'s copy and work and the GPU computes ``k - 1``; at most
two chunks are on the GPU (double buffering). Per chunk the calling thread queues a few
dozen kernels, not a dozen per expert: on an H200 with 16 Xeon cores the per-expert
launches, not the copy, set the pace before. Across layers: a call given ``next_layer``
(the model's next kt_ops MoE layer, which :func:`set_gpu_prefill_token_threshold` links
with ``prefetch_next_layer=True``) starts staging and copying that layer's first chunk —
its lowest expert ids, which a long prompt routes to — on that thread once its own
chunks are queued, so the host writes layer L + 1's first experts while the GPU
computes layer L and the attention of L + 1; that layer's call takes the chunk if it was
staged for the same dtype, device and chunk size (experts it does not route to are
skipped). The same code runs on the CPU (no streams), which is how the CPU tests check it.

Numerics: bf16 weights and activations with fp32 accumulation (fp32 where the input is
fp32), the activation in fp32, each token's K weighted expert outputs summed in fp32 in
ascending expert order (one ``[T, H]`` fp32 accumulator; no ``[T, K, H]`` buffer; no two
additions of one ``index_add_`` meet, so the order of the device's atomics changes no
bit). A chunk holds up to its routed rows' activations (``[N, H]`` bf16, ``[N, I]``
fp32 twice, ``[N, H]`` fp32; ``N`` at most ``T K``). The GPU's GEMMs choose their
kernels by the number of tokens per expert, so unlike
``torch.ops.kt.moe_forward`` a row's result may depend on the other rows of the call.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Union

import torch

from kt_ops import _futures, gguf_torch, reference
from kt_ops._validate import is_integral, require_bools
from kt_ops.ops import dequantize_experts
from kt_ops.packed import PackedExperts
from kt_ops.staging import RowLayout, stage_rows_into
from kt_ops.staging import row_layout as staged_row_layout

DEFAULT_CHUNK_BYTES = 64 << 20
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)  # the operator's activation dtypes


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype == torch.float32 else torch.bfloat16


def _groups(scale: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """Per-group scales ``[..., ceil(k / group)]`` -> per element ``[..., k]``."""
    return scale.repeat_interleave(group, dim=-1)[..., :k]


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., k / 2]`` -> uint8 ``[..., k]``: element ``2j`` in the low nibble."""
    return torch.stack((codes & 15, codes >> 4), dim=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])


def expand_rows(layout: RowLayout, codes: torch.Tensor, scale: torch.Tensor | None, k: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Rows of one matrix as :func:`kt_ops.staging.stage_rows_into` writes them (codes
    ``[..., rows, k * code_bytes]`` and scales ``[..., rows, groups]`` in the layout's
    element types, any leading dims, any device) -> the weights ``[..., rows, k]`` in
    ``dtype``: exactly the values the CPU kernels multiply, before the cast."""
    fmt = layout.format
    if fmt == "bf16":
        return codes.to(dtype)
    if fmt == "int4_asym":  # w = scale q + minimum
        q = _nibbles(codes.view(torch.uint8))[..., :k].float()
        pairs = scale.float().unflatten(-1, (-1, 2))
        return (q * _groups(pairs[..., 0], layout.group, k) + _groups(pairs[..., 1], layout.group, k)).to(dtype)
    if fmt in ("int4", "mxfp4"):
        nibbles = _nibbles(codes.view(torch.uint8))[..., :k]
        values = nibbles.float() - 8 if fmt == "int4" else gguf_torch.E2M1.to(codes.device)[nibbles.int()]
    elif fmt == "int8":
        values = codes.view(torch.int8).float()
    else:
        values = codes.view(torch.float8_e4m3fn).float()
    per = gguf_torch.ue8m0(scale.view(torch.uint8)) if fmt == "mxfp8" else scale.float()
    per = per if layout.group is None else _groups(per, layout.group, k)
    return (values * per).to(dtype)


_LAYOUTS: dict[int, tuple[weakref.ref, object]] = {}  # id(blob) -> (the blob, its transport)


def transport(packed: PackedExperts) -> RowLayout | GgufRows | None:
    """How a layer's experts travel to the device: rows (:func:`row_layout`), GGUF blocks
    (:func:`gguf_rows`) or None (dequantized weights); found once per layer (remembered
    while the blob lives)."""
    key = id(packed.data)
    hit = _LAYOUTS.get(key)
    if hit is not None and hit[0]() is packed.data:
        return hit[1]  # type: ignore[return-value]
    found = row_layout(packed)
    if found is None:
        found = gguf_rows(packed)
    _LAYOUTS[key] = (weakref.ref(packed.data, lambda _, key=key: _LAYOUTS.pop(key, None)), found)
    return found


def row_layout(packed: PackedExperts) -> RowLayout | None:
    """The :class:`kt_ops.staging.RowLayout` a layer's experts travel in (kt-kernel's
    staging rows, INT4 scales kept in fp32, and INT8 rows), or None where it has none."""
    try:
        return staged_row_layout(packed, prefill=True)
    except ValueError:
        return None


@dataclass(frozen=True)
class GgufRows:
    """A GGUF layer whose three types :mod:`kt_ops.gguf_torch` decodes: its experts travel
    as the file's own blocks (each matrix one ``[rows, row_bytes]`` slab per expert)."""

    types: tuple[int, int, int]  # ggml type ids of gate, up, down
    offsets: tuple[int, int, int]  # blob offsets of the matrices
    rows: tuple[int, int, int]  # I, I, H
    ks: tuple[int, int, int]  # H, H, I
    row_bytes: tuple[int, int, int]


def gguf_rows(packed: PackedExperts) -> GgufRows | None:
    """The :class:`GgufRows` of a GGUF layer whose types are all in
    :data:`kt_ops.gguf_torch.DEVICE_TYPES`, else None."""
    from kt_ops._native import _C
    from kt_ops.gguf_types import gguf_type_id, ggml_type_info

    info = _C.packed_info(packed.data)
    if info["format"] != "gguf" or any(t not in gguf_torch.DEVICE_TYPES for t in info["gguf_types"]):
        return None
    H, I = packed.hidden_size, packed.intermediate_size
    types = tuple(gguf_type_id(t) for t in info["gguf_types"])
    ks = (H, H, I)
    row_bytes = tuple(k // ggml_type_info(t).block_elems * ggml_type_info(t).block_bytes for t, k in zip(types, ks))
    return GgufRows(types, tuple(info["matrix_offsets"]), (I, I, H), ks, row_bytes)  # type: ignore[arg-type]


Transport = Union[RowLayout, GgufRows, None]
"""How a layer's experts travel: rows (:class:`RowLayout`), GGUF blocks, or None:
dequantized weights."""


def _host_chunk(packed: PackedExperts, experts: list[int], layout: Transport,
                dtype: torch.dtype, pin: bool) -> list[torch.Tensor]:
    """A chunk's six host tensors (gate, up, down, their scales), batched over its experts:
    rows written straight into (pinned) buffers, GGUF blocks copied, or dequantized weights
    (no scales: empty tensors)."""
    if isinstance(layout, GgufRows):
        ids = torch.tensor(experts, dtype=torch.int64)
        outs = []
        for offset, rows, row_bytes in zip(layout.offsets, layout.rows, layout.row_bytes):
            size = rows * row_bytes
            source = packed.data[offset:offset + packed.num_experts * size].view(packed.num_experts, size)
            outs.append(torch.index_select(source, 0, ids, out=torch.empty(len(experts), size, dtype=torch.uint8,
                                                                            pin_memory=pin)))
        return outs + [torch.empty(0, dtype=torch.uint8)] * 3
    if layout is not None:
        outs = layout.buffers(len(experts), pin=pin)
        for c, e in enumerate(experts):
            stage_rows_into(packed, e, [t[c] for t in outs], layout.int4_fp32_scales)
        return outs
    weights = list(dequantize_experts(packed, torch.tensor(experts, dtype=torch.int64), dtype))
    if pin:
        weights = [w.pin_memory() for w in weights]
    return weights + [torch.empty(0, dtype=torch.uint8)] * 3


def _weights(tensors: list[torch.Tensor], layout: Transport, H: int, I: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's ``gate, up [C, I, H]`` and ``down [C, H, I]`` in ``dtype`` on the tensors'
    device."""
    gate, up, down = tensors[:3]
    if isinstance(layout, GgufRows):
        return tuple(  # type: ignore[return-value]
            gguf_torch.dequantize_rows(raw.reshape(raw.shape[0], rows, row_bytes), t, k).to(dtype)
            for raw, t, rows, k, row_bytes in zip(tensors[:3], layout.types, layout.rows, layout.ks, layout.row_bytes))
    if layout is None:
        return gate.to(dtype), up.to(dtype), down.to(dtype)
    r = layout.views(tensors)
    return (expand_rows(layout, r.gate, r.gate_scale, H, dtype), expand_rows(layout, r.up, r.up_scale, H, dtype),
            expand_rows(layout, r.down, r.down_scale, I, dtype))


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # the host -> device copies, one per device


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


@dataclass
class _Staged:
    """A chunk on the device: its experts and six tensors (:func:`_host_chunk`), and the
    event its copy ends with (None on the CPU)."""

    experts: list[int]
    tensors: list[torch.Tensor]
    ready: torch.cuda.Event | None


def _stage(packed: PackedExperts, experts: list[int], layout: Transport, dtype: torch.dtype,
           device: torch.device) -> _Staged:
    """Stages a chunk on the host and queues its copy on the device's copy stream (from
    any thread)."""
    cuda = device.type == "cuda"
    host = _host_chunk(packed, experts, layout, dtype, pin=cuda)
    if not cuda:
        return _Staged(experts, host, None)
    tensors = _to_device(host, device)
    ready = torch.cuda.Event()
    ready.record(_copy_stream(device))
    return _Staged(experts, tensors, ready)


def _to_device(host: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """A chunk's (pinned) host tensors copied to ``device`` on its copy stream, from any
    thread; the copies are ordered on that stream only."""
    with torch.cuda.device(device), torch.cuda.stream(_copy_stream(device)):
        return [t.to(device, non_blocking=True) for t in host]


_PREFETCH_LOCK = threading.Lock()
_STAGING_LOCK = threading.Lock()
_STAGING_THREAD: tuple[int, ThreadPoolExecutor] | None = None  # (pid, the host's staging thread)
# id(blob) -> (the blob, (dtype, device, chunk experts), the first chunk being staged)
_PREFETCHED: dict[int, tuple[weakref.ref, tuple, Future]] = {}


def _staging_thread() -> ThreadPoolExecutor:
    """One background thread for the host's staging (``kt::stage_expert_rows`` releases
    the GIL and writes on the engine's threads): chunks ahead of a call's work and the next
    layer's first chunk. Created on first use, and again in a forked child (which has no
    copy of the parent's thread: its queue would never run)."""
    global _STAGING_THREAD
    with _STAGING_LOCK:
        if _STAGING_THREAD is None or _STAGING_THREAD[0] != os.getpid():
            _STAGING_THREAD = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="kt_ops_staging"))
        return _STAGING_THREAD[1]


def _forget_staging_after_fork() -> None:
    """A fork()ed child has none of the parent's threads: a chunk the parent's staging
    thread had not finished never finishes there (taking it waited forever), and a lock a
    parent thread held stays held. The child drops the chunks staged ahead (its calls
    stage them again) and starts its own thread and locks."""
    global _PREFETCH_LOCK, _STAGING_LOCK, _STAGING_THREAD
    _PREFETCH_LOCK, _STAGING_LOCK, _STAGING_THREAD = threading.Lock(), threading.Lock(), None
    _PREFETCHED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_staging_after_fork)


def _chunk_experts(packed: PackedExperts, chunk_bytes: int) -> int:
    """Experts per chunk: about ``chunk_bytes`` of packed weights, at least one."""
    per_expert = max(1, packed.nbytes // max(packed.num_experts, 1))
    return max(1, chunk_bytes // per_expert)


def prefetch_first_chunk(packed: PackedExperts, dtype: torch.dtype, device: torch.device,
                         chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Starts staging the first chunk of ``packed`` (experts ``0 ..`` about ``chunk_bytes``
    of them) for a call in ``dtype`` on ``device``, on a background thread (host writes,
    then the copy on the copy stream); :func:`moe_forward_on_device` on that layer with
    the same dtype, device and ``chunk_bytes`` takes it. A layer holds one such chunk at
    a time (a newer one replaces it)."""
    size = _chunk_experts(packed, chunk_bytes)
    experts = list(range(min(size, packed.num_experts)))
    if not experts:
        return
    layout = transport(packed)
    with _PREFETCH_LOCK:
        future = _futures.submit(_staging_thread(), _stage, packed, experts, layout, dtype, device)
        key = id(packed.data)
        _PREFETCHED[key] = (weakref.ref(packed.data, lambda _, key=key: _PREFETCHED.pop(key, None)),
                            (dtype, device, size), future)


def _take_prefetched(packed: PackedExperts, dtype: torch.dtype, device: torch.device, size: int) -> _Staged | None:
    """The first chunk :func:`prefetch_first_chunk` staged for this call, or None (none,
    or staged for another dtype, device or chunk size: dropped)."""
    with _PREFETCH_LOCK:
        hit = _PREFETCHED.pop(id(packed.data), None)
    if hit is None or hit[0]() is not packed.data:
        return None
    staged = hit[2].result()  # raises the staging's error, if any
    return staged if hit[1] == (dtype, device, size) else None


def _ranks(slots: torch.Tensor, K: int) -> torch.Tensor:
    """``slots [T K]`` (expert ids, ``E`` for a skipped slot) -> int64 ``[T K]``: each slot's
    place among its token's slots in ascending expert order (ties: slot order). ``K = 0``
    (no slot): empty."""
    if K == 0:  # view(-1, 0) of no element is ambiguous
        return torch.empty(0, dtype=torch.int64, device=slots.device)
    by_token = slots.view(-1, K)
    places = torch.argsort(by_token, dim=1, stable=True)
    ranks = torch.empty_like(places)
    ranks.scatter_(1, places, torch.arange(K, device=slots.device).expand_as(places))
    return ranks.reshape(-1)


def _grouped_mm_fits(h: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``h [N, k]`` and ``w [C, n, k]``: bf16, rows and
    pointers 16-byte aligned (its kernels' loads need it), contiguous weights."""
    return (hasattr(torch, "_grouped_mm") and h.dtype == w.dtype == torch.bfloat16 and h.is_contiguous()
            and w.is_contiguous() and h.shape[1] % 8 == 0 and w.shape[1] % 8 == 0
            and h.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


_NO_GROUPED_MM: set[torch.device] = set()  # devices where torch._grouped_mm refused a call


def _grouped_linear(h: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, offsets: list[int],
                    chunk: list[int]) -> torch.Tensor:
    """A chunk's rows through its experts: ``h [N, k]`` (group ``c``: the rows of expert
    ``chunk[c]``, ``offsets`` its bounds in the call's rows, ``ends`` int32 ``[C]`` the
    groups' ends within ``h`` on its device) times ``w[c] [n, k]`` transposed ->
    ``[N, n]`` in ``h``'s dtype. One grouped GEMM where it fits, else one product per
    expert."""
    if _grouped_mm_fits(h, w) and h.device not in _NO_GROUPED_MM:
        try:
            return torch._grouped_mm(h, w.transpose(1, 2), offs=ends)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, NotImplementedError):  # a device its kernels do not cover: per expert from now on
            _NO_GROUPED_MM.add(h.device)
    first = offsets[chunk[0]]
    return torch.cat([h[offsets[e] - first:offsets[e + 1] - first] @ w[c].T for c, e in enumerate(chunk)])


def _accumulate(out: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor, ranks: torch.Tensor,
                per_rank: list[int]) -> None:
    """``out[tokens[i]] += y[i]`` (fp32 ``out [T, H]``, ``y [N, H]``), each token's rows
    added in ascending ``ranks`` (its experts' ascending order), one ``index_add_`` per
    rank present (``per_rank``: rows of each rank): no token meets itself within one
    call, so the sums do not depend on the device's order of atomics."""
    present = [n for n in per_rank if n]
    if len(present) > 1:
        place = torch.argsort(ranks, stable=True)
        tokens, y = tokens.index_select(0, place), y.index_select(0, place)
    start = 0
    for n in present:
        out.index_add_(0, tokens[start:start + n], y[start:start + n])
        start += n


def moe_forward_on_device(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: PackedExperts,
    live_tokens: torch.Tensor | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    next_layer: PackedExperts | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``torch.ops.kt.moe_forward``'s result, computed on ``hidden_states``' device with
    the routed experts copied there from the packed layer (the module docstring).

    Args:
        hidden_states: ``[T, H]`` float (bf16, fp16 or fp32), on a GPU (or the CPU).
        topk_ids: ``[T, K]`` integer, expert ids of the packed layer, ``-1`` skips a slot.
        topk_weights: ``[T, K]`` float.
        packed: the layer (host memory), any format and activation (biases, clamped or
            alpha SwiGLU as its header says).
        live_tokens: int ``[1]`` or None: rows from ``live_tokens`` on give 0.
        chunk_bytes: packed bytes per chunk of experts (at least one expert a chunk).
        next_layer: the layer computed next, or None: its first chunk is staged in the
            background once this call's chunks are queued (:func:`prefetch_first_chunk`).
        out_dtype: the result's dtype (None: ``hidden_states``'); ``torch.float32`` returns
            the fp32 accumulator as it is.

    Returns:
        ``[T, H]`` in ``out_dtype`` (default ``hidden_states``' dtype). Syncs the host
        once (the expert counts); not for CUDA-graph capture or ``torch.compile``.
        ``ValueError`` for an expert id outside ``[-1, E)`` or ``live_tokens`` outside
        ``[0, T]``; ``TypeError`` for a dtype the operator refuses (float ids, fp64 or
        integer activations or weights), with its message.
    """
    x = hidden_states
    for name, t, dtypes in (("hidden_states", x, _FLOATS), ("topk_ids", topk_ids, (torch.int32, torch.int64)),
                            ("topk_weights", topk_weights, _FLOATS)):
        if t.dtype not in dtypes:  # kt::moe_forward's check_dtype: float ids were truncated to experts
            raise TypeError(f"{name} must have dtype {', '.join(map(str, dtypes))}; got {t.dtype}")
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"hidden_states [T, H], topk_ids and topk_weights [T, K] expected, got "
                         f"{tuple(x.shape)}, {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    T, H = x.shape
    K = topk_ids.shape[1]
    E, I = packed.num_experts, packed.intermediate_size
    if H != packed.hidden_size:
        raise ValueError(f"hidden_states has H = {H}, the packed layer {packed.hidden_size}")
    device, dtype = x.device, _compute_dtype(x)
    ids = topk_ids.to(device=device, dtype=torch.int64)
    if live_tokens is not None:  # kt::moe_forward's checks (moe_call.cpp), the same errors
        if not isinstance(live_tokens, torch.Tensor) or live_tokens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"live_tokens must be an int32 or int64 tensor, got "
                            f"{getattr(live_tokens, 'dtype', type(live_tokens).__name__)}")
        if live_tokens.numel() != 1:
            raise ValueError(f"live_tokens must hold one value (the live batch size); got shape "
                             f"{list(live_tokens.shape)}")
        live = int(live_tokens.reshape(()))  # one more sync on a call that syncs anyway (the counts)
        if not 0 <= live <= T:  # was clamped silently: -1 dropped every row, T + 1 kept them all
            raise ValueError(f"live_tokens = {live} is outside [0, {T}] (the batch holds {T} tokens)")
        ids = ids.masked_fill((torch.arange(T, device=device) >= live).unsqueeze(1), -1)
    flat = ids.reshape(-1)
    if flat.numel():
        low, high = (int(v) for v in torch.aminmax(flat))
        if low < -1 or high >= E:
            raise ValueError(f"topk_ids must be in [-1, {E}), got values in [{low}, {high}]")
    slots = torch.where(flat >= 0, flat, E)
    ranks = _ranks(slots, K)
    # rows of each expert and rank, one sync: [E + 1, K] (the last row: skipped slots)
    rank_counts = torch.bincount(slots * K + ranks, minlength=(E + 1) * K).view(E + 1, K).cpu()
    counts = rank_counts.sum(1)
    order = torch.argsort(slots, stable=True)
    offsets = [0] + torch.cumsum(counts, 0).tolist()
    rows = int(offsets[E])
    tokens = torch.div(order[:rows], K, rounding_mode="floor")  # [N]: token rows, grouped by expert
    rank = ranks[order[:rows]]  # [N]: each row's place among its token's experts
    row_expert = slots[order[:rows]]  # [N]
    routing = topk_weights.reshape(-1).to(device=device, dtype=torch.float32)[order[:rows]].unsqueeze(1)  # [N, 1]
    out = torch.zeros(T, H, dtype=torch.float32, device=device)
    experts = torch.nonzero(counts[:E]).reshape(-1).tolist()

    act = reference.activation_of(packed.data)
    biases = act["biases"]
    if biases is not None:
        biases = tuple(b.to(device) for b in biases)
    layout = transport(packed)
    size = _chunk_experts(packed, chunk_bytes)
    first = _take_prefetched(packed, dtype, device, size)
    if first is not None:  # the lowest ids: the rest keep the ascending order
        taken = set(first.experts)
        experts = [e for e in experts if e not in taken]
    chunks = [experts[i:i + size] for i in range(0, len(experts), size)]
    if first is not None:
        chunks.insert(0, first.experts)

    cuda = device.type == "cuda"
    copy = _copy_stream(device) if cuda else None
    compute = torch.cuda.current_stream(device) if cuda else None
    # every chunk's group ends (rows of its experts, relative to its first row), one copy
    firsts = [offsets[chunk[0]] for chunk in chunks]
    ends = torch.tensor([offsets[e + 1] - first for chunk, first in zip(chunks, firsts) for e in chunk],
                        dtype=torch.int32).to(device, non_blocking=True)
    def stage(k: int) -> Future | None:  # chunk k's host tensors, staged on the background thread
        if k >= len(chunks) or (k == 0 and first is not None):
            return None
        return _futures.submit(_staging_thread(), _host_chunk, packed, chunks[k], layout, dtype, cuda)

    done: list[torch.cuda.Event | None] = [None, None]
    at = 0  # the chunk's first entry in ends
    pending = stage(0)
    for k, chunk in enumerate(chunks):
        staged = first if k == 0 and first is not None else None
        host = pending.result() if pending is not None else None
        # the host stages chunk k + 1 while this thread queues chunk k's copy and work, and
        # the GPU computes chunk k - 1
        pending = stage(k + 1)
        slot = k % 2
        if done[slot] is not None:
            done[slot].synchronize()  # chunk k - 2's device buffers are free: two chunks on the GPU at most
        if staged is not None:
            tensors = staged.tensors
            if staged.ready is not None:
                compute.wait_event(staged.ready)
        elif cuda:
            tensors = _to_device(host, device)
            compute.wait_stream(copy)
        else:
            tensors = host
        if cuda:
            for t in tensors:
                t.record_stream(compute)
        lo, hi = firsts[k], offsets[chunk[-1] + 1]  # the chunk's rows: its experts are consecutive routed ids
        if hi > lo:
            gates, ups, downs = _weights(tensors, layout, H, I, dtype)
            group_ends = ends[at:at + len(chunk)]
            h = x.index_select(0, tokens[lo:hi]).to(dtype)
            gate = _grouped_linear(h, gates, group_ends, offsets, chunk).float()
            up = _grouped_linear(h, ups, group_ends, offsets, chunk).float()
            if biases is not None:
                row_experts = row_expert[lo:hi]
                gate = gate + biases[0].index_select(0, row_experts)
                up = up + biases[1].index_select(0, row_experts)
            inter = reference.glu(gate, up, act["swiglu_limit"], act["swiglu_alpha"]).to(dtype)
            y = _grouped_linear(inter, downs, group_ends, offsets, chunk).float()
            if biases is not None:
                y = y + biases[2].index_select(0, row_experts)
            _accumulate(out, y * routing[lo:hi], tokens[lo:hi], rank[lo:hi],
                        rank_counts[chunk].sum(0).tolist())
        at += len(chunk)
        if cuda:
            event = torch.cuda.Event()
            event.record(compute)
            done[slot] = event
    if next_layer is not None:
        prefetch_first_chunk(next_layer, dtype, device, chunk_bytes)
    return out.to(out_dtype or x.dtype)


def should_run_on_device(x: torch.Tensor, threshold: int) -> bool:
    """Whether a call with activations ``x [T, H]`` takes the GPU-prefill path: ``x`` on a
    CUDA device, at least ``threshold > 0`` tokens, eager (not compiling, not capturing a
    CUDA graph, not a fake tensor)."""
    if threshold <= 0 or x.shape[0] < threshold or x.device.type != "cuda":
        return False  # before the import: every CPU-path call asks
    from torch._subclasses.fake_tensor import FakeTensor

    return (not torch.compiler.is_compiling() and not isinstance(x, FakeTensor)
            and not torch.cuda.is_current_stream_capturing())


PREFILL_ATTRIBUTE = "_kt_ops_gpu_prefill"  # an experts module's threshold (kt_ops.hf_experts), in its __dict__
UPDATE_ATTRIBUTE = "_kt_ops_gpu_prefill_updates"  # its update_gpu_experts flag
NEXT_ATTRIBUTE = "_kt_ops_gpu_prefill_next"  # a layer's weak reference to the next (HybridMoE or experts module)


def next_layer(module: torch.nn.Module) -> PackedExperts | None:
    """The packed experts of the layer :func:`set_gpu_prefill_token_threshold` linked after
    ``module`` (a :class:`kt_ops.HybridMoE` or a transformers experts module), or None."""
    ref = module.__dict__.get(NEXT_ATTRIBUTE)
    following = ref() if ref is not None else None
    if following is None:
        return None
    from kt_ops import hf_experts

    blob = getattr(following, "packed", None) if not hf_experts.is_experts_module(following) else \
        getattr(following, hf_experts.BLOB_ATTRIBUTE, None)
    return PackedExperts(blob) if isinstance(blob, torch.Tensor) and blob.numel() else None


def checked_threshold(tokens: object) -> int:
    """``gpu_prefill_token_threshold`` validated: an int >= 0 (0: never); numpy's integers
    as ints, as KTMoEWrapper's other sizes."""
    if not is_integral(tokens) or tokens < 0:
        raise ValueError(f"gpu_prefill_token_threshold must be an int >= 0 (0: off), got {tokens!r}")
    return int(tokens)


def batch_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Activations of each expert in one call's ``topk_ids [T, K]`` (``-1`` skipped): int64
    ``[num_experts]`` on their device — SGLang's ``select_top_experts_from_batch`` counts."""
    ids = topk_ids.reshape(-1).long()
    return torch.bincount(ids[ids >= 0], minlength=num_experts)[:num_experts]


def set_gpu_prefill_token_threshold(model: torch.nn.Module, tokens: int, update_gpu_experts: bool = False,
                                    prefetch_next_layer: bool = False) -> int:
    """Calls of at least ``tokens`` tokens (0: none) whose activations are on a GPU compute
    the CPU experts of ``model``'s kt_ops MoE layers there (:func:`moe_forward_on_device`),
    as kt-kernel's ``--kt-gpu-prefill-token-threshold``. ``model``: a module holding
    :class:`kt_ops.HybridMoE` layers (``patch_model``) or transformers experts modules run
    by kt_ops (``experts_implementation="kt_ops"``), or one such layer.

    ``update_gpu_experts``: after each such call, the layers built with
    ``dynamic_gpu_experts=True`` move their GPU experts to the call's most activated ones
    (SGLang's ``--kt-enable-dynamic-expert-update``: ``select_top_experts_from_batch``,
    ascending ids), in place, after the call's own output is computed.

    ``prefetch_next_layer``: the layers are linked in ``model.modules()`` order (the
    model's layer order), and a GPU-prefill call of one starts staging the next one's
    first chunk of experts in the background (:func:`moe_forward_on_device`'s
    ``next_layer``), so the host's writes for layer L + 1 overlap the GPU's work on
    layer L and the attention of L + 1. Off by default until measured on a GPU
    (``scripts/bench_gpu_prefill.py --layers 2``): the staging thread competes for the
    cores with whatever else the host runs. False (or ``tokens = 0``) unlinks them.

    Returns the number of layers set; ``ValueError`` for a bad ``tokens``, a switch that is
    not a bool, a model with no such layer, or ``update_gpu_experts`` with no dynamic layer
    holding GPU experts."""
    from kt_ops import hf_experts
    from kt_ops.wrappers.hybrid_moe import HybridMoE

    tokens = checked_threshold(tokens)
    # "no" is truthy: it moved the GPU experts after each call (or linked the layers), silently
    require_bools(update_gpu_experts=update_gpu_experts, prefetch_next_layer=prefetch_next_layer)
    count = movable = 0
    layers: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, HybridMoE):
            dynamic = module.dynamic and module.num_gpu_experts > 0
            module.gpu_prefill_token_threshold = tokens
            module.gpu_prefill_updates_gpu_experts = bool(update_gpu_experts) and dynamic
        elif hf_experts.is_experts_module(module):
            local = hf_experts.local_experts(module)
            dynamic = hf_experts.is_dynamic(module) and local is not None and local[0].numel() > 0
            module.__dict__[PREFILL_ATTRIBUTE] = tokens
            module.__dict__[UPDATE_ATTRIBUTE] = bool(update_gpu_experts) and dynamic
        else:
            continue
        layers.append(module)
        count += 1
        movable += dynamic
    for module, following in zip(layers, layers[1:] + [None]):
        linked = tokens and prefetch_next_layer and following is not None
        module.__dict__[NEXT_ATTRIBUTE] = weakref.ref(following) if linked else None
    if not count:
        raise ValueError(f"{type(model).__name__} holds no kt_ops MoE layer (HybridMoE or a transformers experts "
                         "module)")
    if update_gpu_experts and not movable:
        raise ValueError("update_gpu_experts needs layers built with dynamic_gpu_experts=True and GPU experts")
    return count


__all__ = ["DEFAULT_CHUNK_BYTES", "GgufRows", "batch_counts", "checked_threshold", "expand_rows", "moe_forward_on_device",
           "next_layer", "prefetch_first_chunk", "row_layout", "set_gpu_prefill_token_threshold",
           "should_run_on_device", "transport"]
