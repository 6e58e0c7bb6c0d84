"""KTMoEWrapper: kt-kernel's Python API over the ``torch.ops.kt`` operators.

A kt-kernel user switches with ``from kt_ops import KTMoEWrapper``. One wrapper is one
MoE layer's CPU experts. Routing ids are *physical* expert slots: slot ``p`` holds the
logical (checkpoint) expert ``physical_to_logical_map[p]``; slots set in
``gpu_experts_mask`` belong to the GPU and are skipped here. With
``max_deferred_experts_per_token = d > 0`` the experts :meth:`select_deferred_experts`
defers run after this layer's result is returned, and their output is added to the
output of the layer with ``layer_idx + 1`` whose next forward is submitted on the same
thread (construct the last layer with ``d = 0``).
"""

from __future__ import annotations

import math
import operator
import os
import re
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures._base import FINISHED as _FINISHED
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, ClassVar, Iterator, NoReturn, Sequence

import torch

import kt_ops.cuda
from kt_ops import _futures, expert_stats, gpu_prefill
from kt_ops._validate import is_int, is_real, plain_int, require_bools, require_tensors
from kt_ops.converted import is_converted, load_converted_layer
from kt_ops.cpu import get_num_threads, max_threads, set_num_threads
from kt_ops.dynamic_experts import host_copy
from kt_ops.formats import CHECKPOINT_METHODS, default_group_size, format_for_method
from kt_ops.gguf_loader import (
    GPT_OSS_SWIGLU_ALPHA,
    GPT_OSS_SWIGLU_LIMIT,
    gguf_files,
    load_gguf_expert_biases,
    load_gguf_experts,
    read_gguf_config,
)
from kt_ops.hf_checkpoint import HfCheckpoint
from kt_ops.hf_int4 import int4_method, load_int4_experts
from kt_ops.hf_int8 import is_int8_layer, load_int8_experts
from kt_ops.hf_mxfp4 import find_mxfp4_layer, gguf_mxfp4_experts, load_mxfp4_experts, pack_mxfp4_parts
from kt_ops.hf_native import native_method
from kt_ops.kt_kernel_weights import KtKernelDir, is_kt_kernel_dir
from kt_ops.kt_kernel_weights import load_layer as load_kt_kernel_layer
from kt_ops.numa import place_parts, resolve_nodes
from kt_ops.packed import PackedExperts
from kt_ops.ops import Biases, moe_forward
from kt_ops.parts import (FP8_KIND_METHODS, activate_parts, holds_activation, pack_fp8_parts, pack_int4_parts,
                          pack_int8_parts, pack_parts, part_bounds)
from kt_ops.placement import generate_gpu_experts_masks  # noqa: F401 (its former home; kt_ops.wrappers re-exports it)
from kt_ops.staging import Destination, write_weight_scale_to_buffer
from kt_ops.wrappers.wrapper_cuda import (capture_call_sizes, experts_on_device, packed_ids, resolve_stream,
                                          route_table)


@dataclass
class _Inflight:
    """A submitted forward: a Future (CPU path) or a tensor queued on ``stream`` (CUDA)."""

    result: Future | torch.Tensor
    previous: tuple[Future | torch.Tensor, int, torch.cuda.Stream | None] | None  # the previous layer's deferred
    device: torch.device
    dtype: torch.dtype
    stream: torch.cuda.Stream | None = None


class _PendingMap(dict):
    """One thread's deferred outputs, (deferral group, layer) -> (output, tokens, stream):
    a dict that a WeakSet can hold (:meth:`KTMoEWrapper._thread_pending`): hashed and
    compared by identity (two threads' empty maps are two maps)."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__  # type: ignore[assignment]


def _as_caller(threads: int, grad: bool, inference: bool, fn: Callable[..., object], *args: object) -> object:
    """``fn(*args)`` with the kernels' thread count of this thread set to ``threads``,
    under the caller's autograd mode (grad enabled, inference mode): both are per thread.
    Set without context managers where they can be (``torch.inference_mode`` and
    ``set_grad_enabled`` as contexts made a submit + sync under ``no_grad`` 109 us against
    100; this way 100-103, tiny layer, Zen 4, 2026-12-05)."""
    if get_num_threads() != threads:
        set_num_threads(threads)
    torch._C._set_grad_enabled(grad)  # the worker's own thread: its mode stays until the next task's
    if torch.is_inference_mode_enabled() == inference:
        return fn(*args)
    with torch._C._InferenceMode(inference):
        return fn(*args)


def _env_flag(name: str) -> bool:
    """An environment switch: unset, "" or "0" off, "1" on; anything else a ValueError."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


_UNSET: object = object()


def _kt_kernel_map(physical_to_logical_map: object, physical_to_logical_map_cpu: object) -> object:
    """The map given positionally / as ``physical_to_logical_map`` or by kt-kernel's keyword
    ``physical_to_logical_map_cpu`` (SGLang and kt-kernel's own callers pass it by name)."""
    if physical_to_logical_map_cpu is _UNSET:
        return physical_to_logical_map
    if physical_to_logical_map is not None:
        raise TypeError("give physical_to_logical_map or physical_to_logical_map_cpu (kt-kernel's name), not both")
    return physical_to_logical_map_cpu


_EXPERT_NAMED = re.compile(r"\b(gate_proj|up_proj|down_proj): expert (\d+)\b")  # kt_ops.ops.check_finite's, ...


def _named_by_id(error: ValueError, ids: Sequence[int]) -> ValueError:
    """``error`` of packing the experts ``ids`` (their ids in the weights given, in packed
    order), naming the expert by its id there instead of its position among them."""
    text = str(error)
    match = _EXPERT_NAMED.search(text)
    if match is None or int(match.group(2)) >= len(ids):
        return error
    named = f"{match.group(1)}: expert {int(ids[int(match.group(2))])}"
    return ValueError(text[:match.start()] + named + text[match.end():])


class KTMoEWrapper:
    """One MoE layer's routed experts on the CPU, with kt-kernel's constructor and methods.

    Args (as kt-kernel's):
        layer_idx: the layer's index in the model (deferred experts go to ``layer_idx + 1``).
        num_experts: physical expert slots E; num_experts_per_tok: top-k K.
        hidden_size: H; moe_intermediate_size: I.
        gpu_experts_mask: bool ``[E]`` (True: the slot runs on the GPU, not here), or None.
        cpuinfer_threads: the kernels' threads (:func:`kt_ops.set_num_threads`, which is torch's
            intra-op thread count: kt_ops runs on torch's threads); None keeps them.
        threadpool_count: parts each expert's intermediate dimension is split into, as
            kt-kernel's one part per NUMA node (:mod:`kt_ops.parts`). Must divide I. Two or
            more parts run at once, part ``i`` on the threads of node ``numa_nodes[i]``
            (kt_ops' own pinned pool of that node), and their fp32 outputs are summed once,
            in part order: the result does not depend on which part finishes first. Parts
            sharing a node run one after another on its threads (on a one-node machine:
            on all threads). GGUF blobs are mapped from the file whole: one part, on
            ``numa_nodes[0]`` when numa_nodes is given, else on all threads.
        weight_path: a Hugging Face safetensors directory (online quantization into
            ``method``; an FP8 checkpoint under its own FP8 method, an INT4 checkpoint
            under its own INT4 method, an INT8 (W8A8 / W8A16) checkpoint under ``AMXINT8``
            and an MXFP4 checkpoint (gpt-oss, DeepSeek-V4-Flash) under ``MXFP4`` are read in
            place, their bytes kept: :mod:`kt_ops.hf_int4`, :mod:`kt_ops.hf_int8`,
            :mod:`kt_ops.hf_mxfp4`), a directory written by ``python -m kt_ops.convert``,
            or a GGUF file or directory (``LLAMAFILE``: the file's blocks, memory-mapped, one
            part; ``MXFP4`` for a GGUF whose experts are MXFP4: laid out as format mxfp4, a
            copy in RAM split into ``threadpool_count`` parts). gpt-oss weights (a GGUF
            of architecture ``gpt-oss``, or the Hugging Face gpt-oss layout) bring their
            expert biases and alpha-SwiGLU: ``swiglu_alpha`` 1.702 and ``swiglu_limit`` 7
            (Hugging Face: config.json's values), each applied only where the constructor's
            value is the default 0.
        chunked_prefill_size: at most this many tokens per kernel call (None: no limit).
        cpu_save: keep the source tensors (``source_weights``: gate, up and down of the packed
            slots as read, before packing) after packing; each load replaces them, and a load
            of weights that come packed (a converted directory, GGUF) or of no slot leaves None.
        max_deferred_experts_per_token: d, see the module docstring (None: 0, as kt-kernel's).
        method: ``BF16``, ``AMXINT8``/``MOE_INT8``, ``AMXINT4``/``MOE_INT4``, ``LLAMAFILE``,
            ``FP8`` (128 x 128 block scales), ``FP8_PERCHANNEL``, ``MXFP8``, ``MXFP4`` (format
            mxfp4: e2m1 with an E8M0 exponent per 32 weights, docs/formats.md; a bf16
            checkpoint or ``load_weights_from_tensors`` is quantized online), and the INT4
            checkpoint methods ``RAWINT4``, ``GPTQ_INT4``, ``AWQ_INT4`` (:mod:`kt_ops.hf_int4`).
            None: detected from ``weight_path`` (an INT4, MXFP4 or FP8 checkpoint's own
            method, ``AMXINT8`` for an INT8 checkpoint, ``LLAMAFILE`` for GGUF, ``BF16`` for
            a float checkpoint). A checkpoint
            whose quantized experts another method cannot read is a ``ValueError`` naming
            its method.
        numa_nodes: the NUMA node *id* of each part (as ``/sys/devices/system/node``
            numbers them; ``KT_OPS_NUMA_SIMULATE=N`` makes ids ``0 .. N-1``), one per part:
            ``[1]`` with one part runs it on node 1. None: the nodes in turn (part ``i`` on
            the ``i % N``-th node), and a single part on all threads. Where the machine has
            several nodes, each part's packed blob is copied into memory of its node when
            loaded. A length other than threadpool_count, or an id the machine does not
            have, is a ``ValueError`` here. docs/numa.md.
        num_gpu_experts: instead of a mask: slots ``[0, n)`` run on the GPU.
        group_size: INT4 k-group for online quantization (None: 128; RAWINT4: 32).
        deferral_group: the model this layer belongs to, for deferred experts: layer L's
            deferred output is added to layer L + 1 of the same group only. Default: the
            previous wrapper's group (the previous one constructed on this thread) while
            layer indices increase, a new group otherwise (so two models built one after
            the other, or on two threads at once, never exchange results); pass one
            object to every layer of a model to group them explicitly. Deferred output
            passes between forwards of one thread only: layer L's goes to the next
            forward of layer L + 1 submitted on the thread that submitted layer L's, so
            two threads running layers of one group never take each other's.
        mode: ``"inference"``, kt-kernel's default (its ``"sft"`` is a ``ValueError`` here:
            LoRA training is :class:`kt_ops.LoraExperts`).
        swiglu_limit, swiglu_alpha: the layer's activation, as kt-kernel's keywords
            (:func:`kt_ops.set_activation`): ``silu(g) * u`` by default, clamped at
            ``swiglu_limit`` (DeepSeek-V4: 10), alpha-SwiGLU with ``swiglu_alpha``
            (gpt-oss: 1.702, limit 7). Every method takes them (kt-kernel: MXFP4/MXFP8 only).
            Expert biases come with ``load_weights_from_tensors(..., biases=)``.
        dynamic_gpu_experts: every slot is packed, GPU slots too, and each forward reads
            ``gpu_experts_mask`` as it is then, so a serving engine may move experts
            between GPU and CPU with an in-place ``wrapper.gpu_experts_mask.copy_(mask)``
            (kt-kernel's semantics; SGLang's dynamic expert update), captured CUDA graphs
            included (the mask is pinned and copied to the device inside the graph).
            Costs the GPU slots' packed bytes in host memory. Without it only the CPU
            slots are packed, and a forward after an in-place change of the mask is a
            ``RuntimeError``. None (default): ``KT_OPS_DYNAMIC_GPU_EXPERTS=1`` turns it on
            (for wrappers a serving engine constructs), else off.
        gpu_prefill_token_threshold: a forward of at least this many tokens whose
            ``hidden_states`` are on a GPU computes this layer's CPU experts there, their
            weights copied from the packed layer (:mod:`kt_ops.gpu_prefill`; kt-kernel's
            ``--kt-gpu-prefill-token-threshold``, which SGLang runs with its own loop over
            :meth:`submit_write_weight_scale_to_buffer`): every routed expert of the call,
            none deferred, each part's output summed in fp32. Eager calls only (not
            under CUDA-graph capture); it synchronises the host (the expert counts). 0:
            never. None (default): ``KT_OPS_GPU_PREFILL_TOKEN_THRESHOLD`` (an int), else 0.
            A plain attribute: change it freely.

    A wrapper serves one caller at a time: from the start of :meth:`forward` or
    :meth:`submit_forward` to the end of :meth:`forward` or :meth:`sync_forward` (on any
    thread: a forward submitted on one thread may be collected on another) a forward,
    submit_forward or sync_forward of another thread is a ``RuntimeError`` saying so,
    raised at once (no wait, so no deadlock): the forward's state (the submitted work,
    the previous layer's deferred output it collects) is the wrapper's. Threads that run
    forwards at the same time need wrappers of their own. ``load_weights`` and
    ``load_weights_from_tensors`` refuse likewise while a forward is in flight (submitted
    and not collected, on any thread), and forwards refuse while weights load.

    Raises:
        ValueError: an invalid argument, with the reason.
    """

    _capture_batch_sizes: ClassVar[list[int]] = []
    # Per thread (_thread_state): "pending", the deferred outputs that thread's forwards left
    # for the next layer, (deferral group, layer) -> (deferred output, tokens, the CUDA
    # stream it was queued on or None); "group"/"layer", the deferral group and layer_idx
    # of the last wrapper that thread constructed (_group). One map for all threads let
    # one thread's layer L + 1 take (or overwrite) another thread's layer-L output, and
    # two models constructed on two threads at once joined each other's groups.
    _local: ClassVar[threading.local] = threading.local()
    _pending_maps: ClassVar[weakref.WeakSet[_PendingMap]] = weakref.WeakSet()  # every live thread's map
    _instances: ClassVar[weakref.WeakSet[KTMoEWrapper]] = weakref.WeakSet()
    _warned_no_cuda_key: ClassVar[bool] = False
    _executor: ClassVar[ThreadPoolExecutor | None] = None
    _executor_lock: ClassVar[threading.Lock] = threading.Lock()
    _pool_tasks: ClassVar[int] = 0  # tasks submitted to _executor and not finished
    _worker_futures: ClassVar[set[Future]] = set()  # their futures (failed in a fork()ed child)

    def __init__(
        self,
        layer_idx: int,
        num_experts: int,
        num_experts_per_tok: int,
        hidden_size: int,
        moe_intermediate_size: int,
        gpu_experts_mask: torch.Tensor | Sequence[bool] | None = None,
        cpuinfer_threads: int | None = None,
        threadpool_count: int = 1,
        weight_path: str | os.PathLike[str] | None = None,
        chunked_prefill_size: int | None = None,
        cpu_save: bool = False,
        max_deferred_experts_per_token: int | None = 0,
        method: str | None = "AMXINT4",
        numa_nodes: Sequence[int] | None = None,
        mode: str = "inference",
        *,
        num_gpu_experts: int | None = None,
        group_size: int | None = None,
        swiglu_limit: float = 0.0,
        swiglu_alpha: float = 0.0,
        deferral_group: object | None = None,
        dynamic_gpu_experts: bool | None = None,
        gpu_prefill_token_threshold: int | None = None,
    ) -> None:
        # numpy's integers (sizes read from an array or a config parsed with numpy) as ints,
        # as kt-kernel takes them; bools, floats and strings stay refused below.
        layer_idx, num_experts, num_experts_per_tok, hidden_size, moe_intermediate_size = map(
            plain_int, (layer_idx, num_experts, num_experts_per_tok, hidden_size, moe_intermediate_size))
        cpuinfer_threads, threadpool_count, chunked_prefill_size, max_deferred_experts_per_token = map(
            plain_int, (cpuinfer_threads, threadpool_count, chunked_prefill_size, max_deferred_experts_per_token))
        num_gpu_experts, group_size = plain_int(num_gpu_experts), plain_int(group_size)
        if max_deferred_experts_per_token is None:  # kt-kernel's default: no deferral
            max_deferred_experts_per_token = 0
        for name, value in (("layer_idx", layer_idx), ("num_experts", num_experts),
                            ("num_experts_per_tok", num_experts_per_tok), ("hidden_size", hidden_size),
                            ("moe_intermediate_size", moe_intermediate_size), ("threadpool_count", threadpool_count)):
            if not is_int(value) or value < (0 if name == "layer_idx" else 1):
                raise ValueError(f"{name} must be a {'non-negative' if name == 'layer_idx' else 'positive'} int, got {value!r}")
        if num_experts_per_tok > num_experts:
            raise ValueError(f"num_experts_per_tok ({num_experts_per_tok}) exceeds num_experts ({num_experts})")
        if mode != "inference":  # kt-kernel's keyword (and 16th positional argument); "sft" picks its SFT wrappers
            raise ValueError(f"mode must be 'inference' (kt-kernel's default), got {mode!r}: kt_ops' KTMoEWrapper is "
                             "the inference wrapper; train LoRA on the experts with kt_ops.LoraExperts")
        if method is None:
            if weight_path is None:
                raise ValueError("method=None detects the method from weight_path; give weight_path or a method")
            method = detect_method(Path(weight_path), layer_idx)
        self.format = format_for_method(method)  # ValueError naming the implemented methods
        if cpuinfer_threads is not None and (not is_int(cpuinfer_threads) or cpuinfer_threads < threadpool_count):
            raise ValueError(f"cpuinfer_threads ({cpuinfer_threads}) must be an int >= threadpool_count ({threadpool_count})")
        if cpuinfer_threads is not None and cpuinfer_threads > max_threads():  # before any weight is read
            raise ValueError(f"cpuinfer_threads ({cpuinfer_threads}) must be at most {max_threads()} (16 per CPU)")
        nodes = resolve_nodes(numa_nodes, threadpool_count)  # ValueError for a length or id that does not fit
        if not is_int(max_deferred_experts_per_token) or not 0 <= max_deferred_experts_per_token <= num_experts_per_tok:
            raise ValueError(f"max_deferred_experts_per_token must be an int in [0, {num_experts_per_tok}], "
                             f"got {max_deferred_experts_per_token!r}")
        if chunked_prefill_size is not None and (not is_int(chunked_prefill_size) or chunked_prefill_size < 1):
            raise ValueError(f"chunked_prefill_size must be a positive int or None, got {chunked_prefill_size!r}")
        part_bounds(moe_intermediate_size, threadpool_count)  # ValueError unless it divides I
        if group_size is not None and not is_int(group_size):  # 64.0 or True: refused only at load_weights
            raise ValueError(f"group_size must be an int (32, 64 or 128) or None, got {group_size!r}")
        for name, value in (("swiglu_limit", swiglu_limit), ("swiglu_alpha", swiglu_alpha)):
            # (the packed layer's header holds fp32: a positive value that is 0 there would be "off")
            if not is_real(value) or not math.isfinite(value) or value < 0 or (value > 0 and not float(
                    torch.tensor(float(value), dtype=torch.float32))):
                raise ValueError(f"{name} must be a finite number >= 0 (0: off) and, if positive, nonzero in "
                                 f"float32; got {value!r}")
        require_bools(cpu_save=cpu_save)  # "no" or "False" kept the source tensors
        self.layer_idx = layer_idx
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.hidden_size = hidden_size
        self.moe_intermediate_size = moe_intermediate_size
        if dynamic_gpu_experts is None:
            dynamic_gpu_experts = _env_flag("KT_OPS_DYNAMIC_GPU_EXPERTS")
        require_bools(dynamic_gpu_experts=dynamic_gpu_experts)
        self.dynamic_gpu_experts = dynamic_gpu_experts
        if gpu_prefill_token_threshold is None:
            text = os.environ.get("KT_OPS_GPU_PREFILL_TOKEN_THRESHOLD", "").strip() or "0"
            try:
                gpu_prefill_token_threshold = int(text)
            except ValueError:
                gpu_prefill_token_threshold = -1
            if gpu_prefill_token_threshold < 0:  # named as the variable, not as a keyword the caller did not pass
                raise ValueError(f"KT_OPS_GPU_PREFILL_TOKEN_THRESHOLD must be an int >= 0 (0: off), got {text!r}")
        self.gpu_prefill_token_threshold = gpu_prefill.checked_threshold(gpu_prefill_token_threshold)
        self.gpu_experts_mask = self._mask(gpu_experts_mask, num_gpu_experts)
        if dynamic_gpu_experts:
            self.gpu_experts_mask = host_copy(self.gpu_experts_mask)  # pinned: graph replays read it live
        self.num_gpu_experts = int(self.gpu_experts_mask.sum())  # kt-kernel's: the count at construction
        self._mask_at_load = self.gpu_experts_mask.clone()  # the mask the packed slots were chosen with
        self.threadpool_count = threadpool_count
        self.numa_nodes = nodes
        self._numa_nodes_given = numa_nodes is not None
        self.weight_path = None if weight_path is None else Path(weight_path)
        self.chunked_prefill_size = chunked_prefill_size
        self.cpu_save = cpu_save
        self.max_deferred_experts_per_token = max_deferred_experts_per_token
        self.method = method.upper()
        self.group_size = default_group_size(self.method) if group_size is None else group_size
        self.swiglu_limit = float(swiglu_limit)
        self.swiglu_alpha = float(swiglu_alpha)
        self._given_activation = (self.swiglu_limit, self.swiglu_alpha)  # each load starts from it (_hold_for_loading)
        self.deferral_group = self._group(deferral_group, layer_idx)
        self.source_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._parts: list[PackedExperts] = []
        self._part_nodes: list[int] | None = None  # node of each part (None: one part on all threads)
        self._route_all = torch.empty(0, dtype=torch.int32)  # physical slot -> packed expert (-1: not packed)
        # _route per device (route_table); dynamic_gpu_experts: (base, mask, -1s, table) per device
        self._tables: dict[torch.device, torch.Tensor | tuple[torch.Tensor, ...]] = {}
        self._identity_route: bool | None = None  # every slot packed here, slot i as packed expert i
        self._reserved: set[tuple[int, tuple[int, ...]]] = set()  # (device, call sizes) with pinned staging
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}  # deferred experts, eager CUDA calls
        self._inflight: _Inflight | None = None
        # Who holds the wrapper (one caller at a time, _claim): None (free), "running" (inside
        # forward, submit_forward or sync_forward on thread _busy_thread), "loading" (inside
        # load_weights or load_weights_from_tensors: _hold_for_loading) or "submitted"
        # (submit_forward returned, sync_forward not yet called); changed under _state_lock.
        self._state_lock = threading.Lock()
        self._busy: str | None = None
        self._busy_thread: int | None = None
        self._staging: Future | None = None  # submit_write_weight_scale_to_buffer's write
        if cpuinfer_threads is not None and cpuinfer_threads != get_num_threads():
            set_num_threads(cpuinfer_threads)
        KTMoEWrapper._instances.add(self)
        self._reserve_capture_buffers()

    def __repr__(self) -> str:
        return (f"KTMoEWrapper(layer_idx={self.layer_idx}, num_experts={self.num_experts}, "
                f"num_experts_per_tok={self.num_experts_per_tok}, hidden_size={self.hidden_size}, "
                f"moe_intermediate_size={self.moe_intermediate_size}, method={self.method!r}, "
                f"threadpool_count={self.threadpool_count}, cpu_parts={len(self._parts)})")

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        raise TypeError("a KTMoEWrapper cannot be pickled or copied (it holds packed weights, possibly mapped from "
                        "its files, and the deferral and staging state of a running model); construct another "
                        "with the same arguments and call load_weights()")

    def __deepcopy__(self, memo: dict) -> NoReturn:
        self.__reduce_ex__(None)

    def __copy__(self) -> NoReturn:
        self.__reduce_ex__(None)

    @classmethod
    def _thread_state(cls) -> threading.local:
        """The calling thread's deferral state (``pending``, ``group``, ``layer``: see
        ``_local``), created on first use; dropped with the thread."""
        local = cls._local
        if not hasattr(local, "pending"):
            local.pending, local.group, local.layer = _PendingMap(), None, -1
            with cls._executor_lock:
                cls._pending_maps.add(local.pending)
        return local

    @classmethod
    def _thread_pending(cls) -> _PendingMap:
        """The deferred outputs the calling thread's forwards left for their next layers:
        layer L's deferred experts are added by layer L + 1's next forward *submitted on
        the same thread* (a model's layers run in sequence on one thread, as kt-kernel's
        callers run them); another thread's forwards neither see nor replace them."""
        return cls._thread_state().pending

    @classmethod
    def _group(cls, group: object | None, layer_idx: int) -> object:
        """The deferral group: ``group`` if given; else the previous wrapper's (constructed
        on this thread) while layers are constructed in increasing order (one model), a new
        one when a layer index does not increase (the next model)."""
        state = cls._thread_state()
        if group is None:
            group = state.group if state.group is not None and layer_idx > state.layer else object()
        state.group, state.layer = group, layer_idx
        return group

    def _mask(self, mask: torch.Tensor | Sequence[bool] | None, num_gpu: int | None) -> torch.Tensor:
        E = self.num_experts
        if mask is not None and num_gpu is not None:
            raise ValueError("give gpu_experts_mask or num_gpu_experts, not both")
        if num_gpu is not None:
            if not is_int(num_gpu) or not 0 <= num_gpu <= E:
                raise ValueError(f"num_gpu_experts must be an int in [0, {E}], got {num_gpu!r}")
            return torch.arange(E) < num_gpu
        if mask is None:
            return torch.zeros(E, dtype=torch.bool)
        try:
            mask = torch.as_tensor(mask)
        except (TypeError, ValueError, RuntimeError) as error:  # a string, ragged lists: torch's own message
            raise ValueError(f"gpu_experts_mask must be a bool tensor of shape [{E}], got {type(mask).__name__} "
                             f"({error})") from None
        if mask.dtype != torch.bool or mask.shape != (E,):
            raise ValueError(f"gpu_experts_mask must be a bool tensor of shape [{E}], got {mask.dtype} {tuple(mask.shape)}")
        if mask.is_meta:  # .to("cpu") raised NotImplementedError
            raise ValueError(f"gpu_experts_mask must be a bool tensor of shape [{E}] with values, got one on the meta "
                             "device")
        return mask.to("cpu").clone()

    # ---- weights ----------------------------------------------------------------------

    def _physical_map(self, physical_to_logical_map: torch.Tensor | Sequence[int] | None, logical: int) -> torch.Tensor:
        E = self.num_experts
        if physical_to_logical_map is None:
            if logical < E:
                raise ValueError(f"the weights hold {logical} experts; num_experts is {E}")
            return torch.arange(E)
        try:
            raw = torch.as_tensor(physical_to_logical_map).to("cpu")
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"physical_to_logical_map must be integer expert indices: {error}") from None
        if raw.dim() != 1:  # [2, E / 2] was flattened: a table of another layout read as this one
            raise ValueError(f"physical_to_logical_map must be 1-D [num_experts = {self.num_experts}], got shape "
                             f"{list(raw.shape)}")
        if raw.dtype == torch.bool or raw.is_complex() or (
                raw.is_floating_point() and not bool(torch.equal(raw, raw.round()))):  # NaN and 1.5 alike
            values = ", ".join(str(v) for v in raw[:4].tolist())
            raise ValueError(f"physical_to_logical_map must be integer expert indices, got {raw.dtype} ({values}"
                             f"{', ...' if raw.numel() > 4 else ''}): a fraction or a bool would pick an expert silently")
        mapping = raw.to(torch.long)
        if mapping.numel() != E:
            raise ValueError(f"physical_to_logical_map has {mapping.numel()} entries; num_experts is {E}")
        if E and (int(mapping.min()) < 0 or int(mapping.max()) >= logical):
            raise ValueError(f"physical_to_logical_map values must be in [0, {logical}) (the experts the weights hold)")
        return mapping

    def _set_packed(self, parts: list[PackedExperts], route: torch.Tensor, biases: Biases | None = None,
                    source: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """Installs the CPU experts' parts (``route``: physical slot -> packed expert), with
        the wrapper's activation and ``biases`` (packed expert order) applied to them.
        ``source`` (the unpacked weights; None for weights read packed) becomes
        ``source_weights`` under ``cpu_save``, replacing the previous load's."""
        for packed in parts:
            if (packed.hidden_size, packed.intermediate_size * len(parts)) != (self.hidden_size, self.moe_intermediate_size):
                raise ValueError(f"layer {self.layer_idx}: weights are H={packed.hidden_size}, "
                                 f"I={packed.intermediate_size * len(parts)}; the wrapper was built for "
                                 f"H={self.hidden_size}, I={self.moe_intermediate_size}")
        parts = activate_parts(parts, self.swiglu_limit, self.swiglu_alpha, biases)
        on_nodes = len(parts) > 1 or (len(parts) == 1 and self._numa_nodes_given)
        self._part_nodes = self.numa_nodes[:len(parts)] if on_nodes else None
        self._parts = place_parts(parts, self._part_nodes) if on_nodes else parts
        self._route_all = route.to(torch.int32)
        self._mask_at_load = self.gpu_experts_mask.clone()
        self._tables = {}
        self._identity_route = None
        self.source_weights = source if self.cpu_save else None

    @property
    def _route(self) -> torch.Tensor:
        """Physical slot -> packed expert as loaded, -1 for the GPU slots (int32 ``[E]``)."""
        return torch.where(self._mask_at_load, -1, self._route_all).to(torch.int32)

    def _packed_slots(self) -> torch.Tensor:
        """bool ``[E]``: the physical slots whose experts are packed here (the CPU slots;
        every slot with ``dynamic_gpu_experts``)."""
        if self.dynamic_gpu_experts:
            return torch.ones(self.num_experts, dtype=torch.bool)
        return ~self.gpu_experts_mask

    def _cpu_route(self) -> torch.Tensor:
        """Physical slot -> packed expert for packs of :meth:`_packed_slots` (in slot
        order); -1 for the slots not packed."""
        slots = torch.nonzero(self._packed_slots()).reshape(-1)
        route = torch.full((self.num_experts,), -1, dtype=torch.long)
        route[slots] = torch.arange(slots.numel())
        return route

    def _pack_cpu_experts(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, ids: Sequence[int],
                          biases: Biases | None = None) -> None:
        """Packs the CPU slots' experts (``gate/up/down`` and ``biases`` hold those, in slot order;
        ``ids``: their ids in the weights given, which an error names)."""
        if self.format == "gguf":
            raise ValueError("method LLAMAFILE loads GGUF files (weight_path); online quantization into GGUF "
                             "is kt_ops.pack_experts(..., method='LLAMAFILE', gguf_type=...)")
        pack_args = {"group_size": self.group_size} if self.format in ("int4", "int4_asym") else {}
        route = self._cpu_route()
        try:
            parts = pack_parts(gate, up, down, self.method, self.threadpool_count, **pack_args) if gate.shape[0] else []
        except ValueError as error:  # "gate_proj: expert 1, row 100 holds nan" for the weights' expert 2
            raise _named_by_id(error, ids) from None
        self._set_packed(parts, route, biases, (gate, up, down))

    def load_weights_from_tensors(
        self,
        gate_proj: torch.Tensor,
        up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        physical_to_logical_map: torch.Tensor | Sequence[int] | None = None,
        *,
        biases: Biases | None = None,
        physical_to_logical_map_cpu: torch.Tensor | Sequence[int] | None = _UNSET,  # type: ignore[assignment]
    ) -> None:
        """Packs (quantizes, for INT8/INT4) logical-order ``gate_proj [E', I, H]``,
        ``up_proj [E', I, H]``, ``down_proj [E', H, I]`` (bf16/fp16/fp32) for the CPU slots.
        ``biases``: optional logical-order ``(gate_bias [E', I], up_bias [E', I],
        down_bias [E', H])``, entries may be None (:func:`kt_ops.set_activation`).
        ``RuntimeError`` while a forward is in flight (submitted and not collected, or
        running on another thread): the weights would change under it.
        ``physical_to_logical_map_cpu``: kt-kernel's name for the map."""
        physical_to_logical_map = _kt_kernel_map(physical_to_logical_map, physical_to_logical_map_cpu)
        with self._hold_for_loading("load_weights_from_tensors"):
            self._load_from_tensors(gate_proj, up_proj, down_proj, physical_to_logical_map, biases)

    def _load_from_tensors(self, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor,
                           physical_to_logical_map: torch.Tensor | Sequence[int] | None,
                           biases: Biases | None) -> None:
        """:meth:`load_weights_from_tensors`' work, the wrapper held."""
        expected = ((self.moe_intermediate_size, self.hidden_size),) * 2 + ((self.hidden_size, self.moe_intermediate_size),)
        require_tensors(gate_proj=gate_proj, up_proj=up_proj, down_proj=down_proj)
        for name, tensor, shape in zip(("gate_proj", "up_proj", "down_proj"), (gate_proj, up_proj, down_proj), expected):
            if tensor.dim() != 3 or tuple(tensor.shape[1:]) != shape:
                raise ValueError(f"{name} must be [E, {shape[0]}, {shape[1]}], got {tuple(tensor.shape)}")
            if tensor.is_meta:  # as kt_ops.pack_experts says it (.cpu() below would raise NotImplementedError)
                raise ValueError(f"{name} is on the meta device (a shape without values): the weights are packed "
                                 "from their values; load them first (from_pretrained, or to_empty() + load_state_dict)")
        counts = (int(gate_proj.shape[0]), int(up_proj.shape[0]), int(down_proj.shape[0]))
        if len(set(counts)) != 1:  # the shorter one was indexed by the others' slots (IndexError)
            raise ValueError(f"gate_proj, up_proj and down_proj must hold the same number of experts, got {counts}")
        mapping = self._physical_map(physical_to_logical_map, int(gate_proj.shape[0]))
        cpu = mapping[self._packed_slots()]
        if biases is not None:
            if not isinstance(biases, (tuple, list)) or len(biases) != 3:
                raise ValueError("biases must be a (gate_bias, up_bias, down_bias) tuple; any entry may be None")
            for name, bias, width in zip(("gate_bias", "up_bias", "down_bias"), biases,
                                         (self.moe_intermediate_size,) * 2 + (self.hidden_size,)):
                if bias is not None and not isinstance(bias, torch.Tensor):  # a list failed on .dim() (AttributeError)
                    raise ValueError(f"{name} must be a tensor [{gate_proj.shape[0]}, {width}] or None, "
                                     f"got {type(bias).__name__}")
                if bias is not None and (bias.dim() != 2 or tuple(bias.shape) != (gate_proj.shape[0], width)):
                    raise ValueError(f"{name} must be [{gate_proj.shape[0]}, {width}], got {tuple(bias.shape)}")
            biases = tuple(None if b is None else b[cpu].cpu() for b in biases)
        self._pack_cpu_experts(gate_proj[cpu].cpu(), up_proj[cpu].cpu(), down_proj[cpu].cpu(), cpu.tolist(), biases)

    def load_weights(
        self,
        physical_to_logical_map: torch.Tensor | Sequence[int] | None = None,
        *,
        physical_to_logical_map_cpu: torch.Tensor | Sequence[int] | None = _UNSET,  # type: ignore[assignment]
    ) -> None:
        """Loads this layer from ``weight_path``: a converted directory (memory-mapped), a
        directory written by kt-kernel's converter (``AMXINT4`` / ``AMXINT8``, its levels
        and scales copied: :mod:`kt_ops.kt_kernel_weights`), a GGUF file/directory
        (``LLAMAFILE``, memory-mapped) or a Hugging Face safetensors directory (read one
        layer at a time and packed into ``method``). ``RuntimeError``
        while a forward is in flight (submitted and not collected, or running on another
        thread): the weights would change under it. ``physical_to_logical_map_cpu``: kt-kernel's
        name for the map."""
        physical_to_logical_map = _kt_kernel_map(physical_to_logical_map, physical_to_logical_map_cpu)
        with self._hold_for_loading("load_weights"):
            return self._load_weights(physical_to_logical_map)

    def _load_weights(self, physical_to_logical_map: torch.Tensor | Sequence[int] | None) -> None:
        """:meth:`load_weights`' work, the wrapper held."""
        if self.weight_path is None:
            raise ValueError("weight_path is None; give it to the constructor or use load_weights_from_tensors")
        path = self.weight_path
        if not path.exists():
            raise FileNotFoundError(f"weight_path {path} does not exist")
        if is_converted(path):
            return self._load_converted(path, physical_to_logical_map)
        if path.suffix == ".gguf" or (path.is_dir() and any(path.glob("*.gguf"))):
            return self._load_gguf(path, physical_to_logical_map)
        if is_kt_kernel_dir(path):
            return self._load_kt_kernel(path, physical_to_logical_map)
        checkpoint = HfCheckpoint(path)
        mxfp4 = find_mxfp4_layer(checkpoint, self.layer_idx)
        if mxfp4 is not None:
            if self.method != "MXFP4":
                raise ValueError(f"{path} layer {self.layer_idx} holds MXFP4 experts ({mxfp4.kind}); "
                                 f"method {self.method} cannot read them: use method='MXFP4' (or method=None)")
            return self._load_mxfp4(checkpoint, self._physical_map(physical_to_logical_map, mxfp4.num_experts))
        logical = checkpoint.layer(self.layer_idx).num_experts
        mapping = self._physical_map(physical_to_logical_map, logical)
        cpu = mapping[self._packed_slots()].tolist()
        int4 = int4_method(checkpoint, self.layer_idx)
        if int4 is not None:
            if self.method != int4:
                raise ValueError(f"{path} layer {self.layer_idx} holds {int4} experts; method {self.method} cannot "
                                 f"read them: use method='{int4}' (or method=None to detect it)")
            return self._load_int4(checkpoint, cpu)
        if is_int8_layer(checkpoint, self.layer_idx):
            if self.format != "int8":
                raise ValueError(f"{path} layer {self.layer_idx} holds INT8 experts (int8 levels with per-row scales, "
                                 f"W8A8); method {self.method} cannot read them: use method='AMXINT8' (or "
                                 "method=None to detect it)")
            return self._load_int8(checkpoint, cpu)
        if self.format in FP8_KIND_METHODS:
            kind = checkpoint.fp8_kind(self.layer_idx)
            if kind is not None and kind != self.format:
                raise ValueError(f"{path} layer {self.layer_idx} holds {FP8_KIND_METHODS[kind]} experts ({kind}); "
                                 f"method {self.method} needs {self.format}: use method='{FP8_KIND_METHODS[kind]}'")
            if kind is not None:  # read in place: the checkpoint's e4m3 bytes and scales
                return self._load_fp8(checkpoint, cpu)
        gate, up, down = checkpoint.load_experts(self.layer_idx, cpu, self.hidden_size, self.moe_intermediate_size)
        self._pack_cpu_experts(gate, up, down, cpu)

    def _load_kt_kernel(self, path: Path, physical_to_logical_map: torch.Tensor | Sequence[int] | None) -> None:
        """The CPU slots' experts of a directory written by kt-kernel's converter (AMXINT4 /
        AMXINT8), un-tiled into the same levels and scales (:mod:`kt_ops.kt_kernel_weights`),
        one part per kt-kernel NUMA part."""
        method = {"int8": "AMXINT8", "int4": "AMXINT4"}.get(self.format)
        if method is None:
            raise ValueError(f"{path} holds kt-kernel's converted AMX weights (AMXINT4 or AMXINT8); method "
                             f"{self.method} cannot read them")
        directory = KtKernelDir(path, method, self.layer_idx)
        try:
            logical, parts = directory.layer_shape(self.layer_idx)
            rows = directory.scale_count(self.layer_idx, "gate", 0, 0)  # one per gate row of a part
            hidden = directory.scale_count(self.layer_idx, "down", 0, 0)  # one per down row: H
        finally:
            directory.close()
        if hidden != self.hidden_size:  # (its weights' sizes would have suggested the other method)
            raise ValueError(f"{path} layer {self.layer_idx} holds down projections of {hidden} rows, not "
                             f"hidden_size {self.hidden_size} (another model's conversion?)")
        if parts * rows != self.moe_intermediate_size:  # a part folder or shard missing, or another layer size
            raise ValueError(f"{path} layer {self.layer_idx} holds {parts} NUMA part(s) of {rows} rows each, "
                             f"not moe_intermediate_size {self.moe_intermediate_size} (a part missing, or "
                             "another model's conversion?)")
        if parts != self.threadpool_count:
            raise ValueError(f"{path} was converted by kt-kernel for {parts} NUMA part(s); construct the wrapper with "
                             f"threadpool_count={parts}")
        mapping = self._physical_map(physical_to_logical_map, logical)
        cpu = mapping[self._packed_slots()].tolist()
        route = self._cpu_route()
        packed = load_kt_kernel_layer(path, self.layer_idx, method, cpu, self.hidden_size, self.moe_intermediate_size)
        self._set_packed(packed, route)

    def _load_fp8(self, checkpoint: HfCheckpoint, cpu: list[int]) -> None:
        """The CPU slots' experts of an FP8 checkpoint, packed without widening."""
        route = self._cpu_route()
        parts: list[PackedExperts] = []
        source = None
        if cpu:
            experts = checkpoint.load_fp8_experts(self.layer_idx, cpu, self.hidden_size, self.moe_intermediate_size)
            parts = pack_fp8_parts(experts, self.threadpool_count, cpu)
            source = (experts.gate, experts.up, experts.down)
        self._set_packed(parts, route, source=source)

    def _load_int4(self, checkpoint: HfCheckpoint, cpu: list[int]) -> None:
        """The CPU slots' experts of an INT4 checkpoint, packed without re-quantizing."""
        route = self._cpu_route()
        parts: list[PackedExperts] = []
        source = None
        if cpu:
            experts = load_int4_experts(checkpoint, self.layer_idx, cpu, self.hidden_size, self.moe_intermediate_size,
                                        self.method)
            parts = pack_int4_parts(experts, self.threadpool_count)
            source = (experts.gate, experts.up, experts.down)
        self._set_packed(parts, route, source=source)

    def _load_int8(self, checkpoint: HfCheckpoint, cpu: list[int]) -> None:
        """The CPU slots' experts of an INT8 (W8A8) checkpoint, their levels copied."""
        route = self._cpu_route()
        parts: list[PackedExperts] = []
        source = None
        if cpu:
            experts = load_int8_experts(checkpoint, self.layer_idx, cpu, self.hidden_size, self.moe_intermediate_size)
            parts = pack_int8_parts(experts, self.threadpool_count)
            source = (experts.gate, experts.up, experts.down)
        self._set_packed(parts, route, source=source)

    def _load_mxfp4(self, checkpoint: HfCheckpoint, mapping: torch.Tensor) -> None:
        """The CPU slots' experts of an MXFP4 checkpoint (gpt-oss, DeepSeek-V4-Flash),
        laid out as format mxfp4 without widening; gpt-oss's biases and activation
        (:meth:`_use_checkpoint_activation`) come with them."""
        cpu = mapping[self._packed_slots()].tolist()
        route = self._cpu_route()
        parts: list[PackedExperts] = []
        biases = None
        source = None
        if cpu:
            experts = load_mxfp4_experts(checkpoint, self.layer_idx, cpu, self.hidden_size, self.moe_intermediate_size)
            self._use_checkpoint_activation(experts.swiglu_limit, experts.swiglu_alpha)
            parts = pack_mxfp4_parts(experts, self.threadpool_count)
            biases = experts.biases
            source = (experts.gate, experts.up, experts.down)
        self._set_packed(parts, route, biases, source)

    def _load_converted(self, path: Path, physical_to_logical_map: torch.Tensor | Sequence[int] | None) -> None:
        manifest, parts = load_converted_layer(path, self.layer_idx)
        # an INT4 checkpoint's conversion keeps its own symmetry and group size
        own_int4 = self.method in CHECKPOINT_METHODS and manifest.format in ("int4", "int4_asym")
        if not own_int4 and (manifest.format != self.format
                             or (self.format == "int4" and manifest.group_size != self.group_size)):
            raise ValueError(f"{path} holds {manifest.format} weights (group size {manifest.group_size}); this wrapper's "
                             f"method {self.method} needs {self.format}"
                             + (f" with group size {self.group_size}" if self.format == "int4" else ""))
        if manifest.threadpool_count != self.threadpool_count:
            raise ValueError(f"{path} was converted with --threadpool-count {manifest.threadpool_count}; construct the "
                             f"wrapper with threadpool_count={manifest.threadpool_count} or convert again")
        mapping = self._physical_map(physical_to_logical_map, parts[0].num_experts)
        held = (parts[0].swiglu_limit, parts[0].swiglu_alpha)
        if held != (0.0, 0.0) or any(p.has_biases for p in parts):  # converted from gpt-oss or DeepSeek-V4
            if (self.swiglu_limit, self.swiglu_alpha) != (0.0, 0.0) and not holds_activation(
                    parts[0], self.swiglu_limit, self.swiglu_alpha):
                raise ValueError(f"{path} layer {self.layer_idx} was converted with its checkpoint's activation "
                                 f"(swiglu_limit {held[0]:g}, swiglu_alpha {held[1]:g}; biases kept with it); "
                                 "construct the wrapper without swiglu_limit / swiglu_alpha (or with those values)")
            self.swiglu_limit, self.swiglu_alpha = held  # activate_parts keeps parts that hold it
        self._set_packed(parts, mapping)

    def _load_gguf(self, path: Path, physical_to_logical_map: torch.Tensor | Sequence[int] | None) -> None:
        if self.format != "gguf" and self.method != "MXFP4":
            raise ValueError(f"{path} holds GGUF files: use method='LLAMAFILE', not {self.method!r}")
        gguf_files(path)  # FileNotFoundError / ValueError for a bad directory
        packed = load_gguf_experts(path, self.layer_idx)
        biases = None
        if read_gguf_config(path).architecture == "gpt-oss":
            self._use_checkpoint_activation(GPT_OSS_SWIGLU_LIMIT, GPT_OSS_SWIGLU_ALPHA)
            biases = load_gguf_expert_biases(path, self.layer_idx)
        mapping = self._physical_map(physical_to_logical_map, packed.num_experts)
        if self.method == "MXFP4":  # the file's MXFP4 blocks laid out as format mxfp4 (a copy in RAM), in parts
            experts = gguf_mxfp4_experts(packed, biases, self.swiglu_limit, self.swiglu_alpha)
            self._set_packed(pack_mxfp4_parts(experts, self.threadpool_count), mapping, biases)
            return
        # GGUF blobs are mapped from the file as one part: threadpool_count does not split them.
        self._set_packed([packed], mapping, biases)

    def _use_checkpoint_activation(self, limit: float, alpha: float) -> None:
        """The activation the weights come with — gpt-oss: alpha-SwiGLU (GGUF: alpha 1.702
        and limit 7, which llama.cpp hard-codes; Hugging Face: config.json's values);
        DeepSeek-V4-Flash: the clamp (config.json's ``swiglu_limit``, 10) — each taken only
        where the constructor's value is the default 0 (a non-zero value the user passed is
        kept)."""
        if self.swiglu_alpha == 0:
            self.swiglu_alpha = alpha
        if self.swiglu_limit == 0:
            self.swiglu_limit = limit

    # ---- forward ----------------------------------------------------------------------

    def select_deferred_experts(
        self, expert_ids: torch.Tensor, expert_scores: torch.Tensor, protected_k: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """kt-kernel's rule: an expert among any token's ``protected_k`` highest-scored
        experts is protected for the whole batch; ``(immediate_ids, deferred_ids)`` are
        ``expert_ids`` with the unprotected (resp. protected) slots set to -1. CPU ids outside
        ``[-1, num_experts)`` are a ``ValueError`` (the CUDA path is not checked: no host sync)."""
        if expert_ids.device.type == "cpu":  # one above E failed in the scatter, one below -1 was skipped silently
            self._check_ids(expert_ids)
        topk = expert_ids.shape[-1]
        protected_k = max(0, min(int(protected_k), topk))
        if protected_k == 0:
            return torch.full_like(expert_ids, -1), expert_ids.clone()
        top = torch.topk(expert_scores.float(), protected_k, dim=-1).indices
        chosen = torch.gather(expert_ids.long(), -1, top)
        # flag[e]: expert e is protected (entry E collects the -1 slots); tensor ops only, no
        # host synchronisation, so the CUDA path stays asynchronous and capturable.
        index = torch.where(chosen >= 0, chosen, self.num_experts).reshape(-1)
        flag = torch.zeros(self.num_experts + 1, dtype=torch.bool, device=expert_ids.device)
        flag = flag.scatter(0, index, torch.ones_like(index, dtype=torch.bool))
        valid = expert_ids >= 0
        protected = torch.take(flag, torch.where(valid, expert_ids.long(), self.num_experts)) & valid
        minus = torch.full_like(expert_ids, -1)
        immediate = torch.where(protected, expert_ids, minus)
        deferred = torch.where(valid & protected.logical_not(), expert_ids, minus)  # not ~: no fake CUDA kernel
        return immediate, deferred

    def _check_mask(self) -> None:
        """Without ``dynamic_gpu_experts``, the mask must be the one the weights were loaded
        with (its GPU slots are not packed here)."""
        mask = self.gpu_experts_mask
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != (self.num_experts,):
            # a replaced mask of another dtype or length failed inside torch.where / torch.equal
            got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"layer {self.layer_idx}: gpu_experts_mask must be a bool tensor of shape "
                             f"[{self.num_experts}], got {got} (update it in place: wrapper.gpu_experts_mask.copy_(mask))")
        if not self.dynamic_gpu_experts and not torch.equal(self.gpu_experts_mask, self._mask_at_load):
            raise RuntimeError(f"layer {self.layer_idx}: gpu_experts_mask changed after the weights were loaded; only "
                               "the CPU slots of the first mask are packed here. Construct the wrapper with "
                               "dynamic_gpu_experts=True (or set KT_OPS_DYNAMIC_GPU_EXPERTS=1 where a serving engine "
                               "constructs it): every slot packed, the mask read at each forward")

    def _table(self, device: torch.device, capturing: bool = False) -> torch.Tensor:
        """The routing table (wrapper_cuda.route_table) on ``device``, cached per device.
        ``dynamic_gpu_experts``: recomputed from the live mask at every call (on a CUDA
        device into the cached table in place: a mask copy and a select, stream-ordered
        and captured with the graph)."""
        if self.dynamic_gpu_experts:
            return self._live_table(device, capturing)
        table = self._tables.get(device)
        if table is None:
            if capturing:
                raise RuntimeError(f"layer {self.layer_idx}: run one forward on {device} before CUDA graph capture "
                                   "(it copies the expert routing table to the device)")
            bad_id = self._parts[0].num_experts if self._parts else 0
            table = self._tables[device] = route_table(self._route, bad_id, device)
        return table

    def _live_table(self, device: torch.device, capturing: bool) -> torch.Tensor:
        bad_id = self._parts[0].num_experts if self._parts else 0
        if device.type == "cpu":
            return route_table(torch.where(self.gpu_experts_mask, -1, self._route_all), bad_id, device)
        state = self._tables.get(device)
        if state is None:
            if capturing:
                raise RuntimeError(f"layer {self.layer_idx}: run one forward on {device} before CUDA graph capture "
                                   "(it copies the expert routing table to the device)")
            base = route_table(self._route_all, bad_id, device)
            mask = torch.zeros(self.num_experts + 1, dtype=torch.bool, device=device)
            state = self._tables[device] = (base, mask, torch.full_like(base, -1), torch.empty_like(base))
        base, mask, minus, table = state
        pinned = self.gpu_experts_mask.is_pinned()
        if capturing and not pinned:
            raise RuntimeError(f"layer {self.layer_idx}: gpu_experts_mask is not the wrapper's pinned mask (was it "
                               "replaced?); update it in place, wrapper.gpu_experts_mask.copy_(mask), so captured "
                               "CUDA graphs read it")
        mask[: self.num_experts].copy_(self.gpu_experts_mask, non_blocking=pinned)
        torch.where(mask, minus, base, out=table)
        return table

    def _compute(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """CPU path: fp32 ``[T, H]``, the CPU experts of ``ids`` (physical) over every part,
        summed in fp32 (the kernels take fp32 rows, so parts and deferred results are not
        rounded). Unlike the CUDA path it may synchronise, so a bad id is named here."""
        self._check_ids(ids)
        # An identity route maps every checked id to itself: the ids go to the kernels as they are.
        table = None if self._has_identity_route() else self._table(x.device)
        return experts_on_device(self._parts, x, ids, weights, table, self.chunked_prefill_size, self._part_nodes)

    def _has_identity_route(self) -> bool:
        """Whether physical slot ``i`` is packed expert ``i`` for every slot (all packed
        here, no remapping; never with ``dynamic_gpu_experts``, whose route follows the
        live mask). Cached until the weights change."""
        if self.dynamic_gpu_experts:
            return False
        if self._identity_route is None:
            route = self._route
            self._identity_route = bool(torch.equal(route, torch.arange(route.numel(), dtype=route.dtype)))
        return self._identity_route

    def _direct_cpu_forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                            topk_weights: torch.Tensor) -> torch.Tensor | None:
        """:meth:`forward`'s result computed by one operator call on the calling thread, in
        ``hidden_states``' dtype, when the call needs nothing else: CPU inputs, one part on
        all threads, the identity route (the operator checks the ids; a failure is
        re-checked here for the general path's message), no deferral (none asked, none
        pending from the previous layer), one chunk, and an idle worker thread (a busy one
        runs earlier work that must finish first). None otherwise. The kernels take
        bf16/fp16 rows and round their fp32 sums once, as the general path's fp32 call and
        ``.to(dtype)`` do: same bits (tested)."""
        chunk = self.chunked_prefill_size
        if (len(self._parts) != 1 or self._part_nodes is not None or self.max_deferred_experts_per_token > 0
                or KTMoEWrapper._pool_tasks != 0 or (chunk and hidden_states.shape[0] > chunk)
                or (self.deferral_group, self.layer_idx) in KTMoEWrapper._thread_pending()
                or not self._has_identity_route() or self._parts[0].num_experts != self.num_experts):
            return None
        try:
            return moe_forward(hidden_states.contiguous(), topk_ids.contiguous(), topk_weights.contiguous(),
                               self._parts[0])
        except ValueError:
            self._check_ids(topk_ids)  # an id out of range: the general path's message (num_experts)
            raise

    def _claim(self, collect: bool = False) -> None:
        """Takes the wrapper for the calling thread (a forward or submit_forward; ``collect``:
        a sync_forward, which takes a submitted forward) or raises at once: a wrapper
        serves one caller at a time (the class docstring)."""
        me = threading.get_ident()
        with self._state_lock:
            state, owner = self._busy, self._busy_thread
            if state == ("submitted" if collect else None):
                self._busy, self._busy_thread = "running", me
                return
        if collect and state is None:
            raise RuntimeError(f"layer {self.layer_idx}: sync_forward without submit_forward")
        if state == "loading":
            raise RuntimeError(f"layer {self.layer_idx}: this KTMoEWrapper's weights are being loaded by thread "
                               f"{owner}; a wrapper serves one caller at a time: forward once load_weights returns")
        if state == "submitted" and owner == me:
            raise RuntimeError(f"layer {self.layer_idx}: this thread's submit_forward is not collected yet: call "
                               "sync_forward before the next forward or submit_forward")
        raise RuntimeError(f"layer {self.layer_idx}: this KTMoEWrapper is in use by another thread (a forward "
                           f"{'submitted' if state == 'submitted' else 'running'} on thread {owner}); a wrapper "
                           "serves one caller at a time (its forward state is per wrapper): finish that forward "
                           "first (forward, or submit_forward then sync_forward), or give each thread its own wrappers")

    @contextmanager
    def _hold_for_loading(self, action: str) -> Iterator[None]:
        """Holds the wrapper while ``action`` replaces its weights, or raises at once
        (``RuntimeError`` naming the forward in flight): a forward submitted and not yet
        collected reads the weights when the worker thread runs it, so new weights would
        be swapped under it (on any thread, this one included)."""
        me = threading.get_ident()
        with self._state_lock:
            state, owner = self._busy, self._busy_thread
            if state is None:
                self._busy, self._busy_thread = "loading", me
        if state is not None:
            what = {"submitted": "a forward submitted (collect it with sync_forward first)",
                    "loading": "a load of its weights", "running": "a forward running"}[state]
            raise RuntimeError(f"layer {self.layer_idx}: {action} while {what} on thread {owner}: the weights "
                               "would change under that forward; a wrapper serves one caller at a time")
        # A checkpoint's own activation (gpt-oss, DeepSeek-V4, converted) replaces the defaults
        # for its weights only: weights loaded next start from the constructor's values again
        # (a load that fails keeps the weights it would have replaced, and their activation).
        held, (self.swiglu_limit, self.swiglu_alpha) = (self.swiglu_limit, self.swiglu_alpha), self._given_activation
        try:
            yield
        except BaseException:
            self.swiglu_limit, self.swiglu_alpha = held
            raise
        finally:
            self._release()

    def _release(self, submitted: bool = False) -> None:
        with self._state_lock:
            self._busy = "submitted" if submitted else None

    def _check_ids(self, ids: torch.Tensor) -> None:
        """``ValueError`` naming the values when a physical slot of ``ids`` is outside
        ``[-1, num_experts)`` (synchronises the host on a GPU)."""
        if ids.numel() == 0:
            return
        low, high = (int(v) for v in torch.aminmax(ids))  # one pass (four ops and a sync before)
        if low < -1 or high >= self.num_experts:
            raise ValueError(f"topk_ids must be in [-1, num_experts = {self.num_experts}) (-1 skips a slot); got values in "
                             f"[{low}, {high}]")

    @staticmethod
    def _check_devices(device: torch.device, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        for name, tensor in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if tensor.device != device:
                raise ValueError(f"{name} is on {tensor.device}; hidden_states is on {device}")

    @classmethod
    def _pool(cls) -> ThreadPoolExecutor:
        with cls._executor_lock:
            if cls._executor is None:
                cls._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kt_ops_moe")
            return cls._executor

    @classmethod
    def _run_on_worker(cls, fn: Callable[..., object], *args: object) -> Future:
        """``fn(*args)`` on the wrapper's worker thread (one for every wrapper: tasks run in
        submission order), counted in ``_pool_tasks`` until it finishes, on the caller's
        thread count and in its autograd mode (torch keeps both per thread: the worker's
        count was read once, on its first torch call, and missed every later
        ``set_num_threads``; its grad mode ignored the caller's ``no_grad``)."""
        pool = cls._pool()
        caller = (get_num_threads(), torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        with cls._executor_lock:
            cls._pool_tasks += 1
        try:
            future = pool.submit(_as_caller, *caller, fn, *args)
        except RuntimeError:
            cls._task_done(None)
            if not _futures.shutting_down(pool):
                raise
            # The interpreter is exiting (its exit shut the worker's executor down before joining the
            # threads still running): a thread outliving the main thread computes on itself.
            return _futures.run_now(fn, *args)
        except BaseException:
            cls._task_done(None)
            raise
        with cls._executor_lock:
            cls._worker_futures.add(future)
        future.add_done_callback(cls._task_done)
        return future

    @classmethod
    def _task_done(cls, future: Future | None) -> None:
        with cls._executor_lock:
            cls._pool_tasks -= 1
            cls._worker_futures.discard(future)

    @classmethod
    def _forget_worker_after_fork(cls) -> None:
        """In a fork()ed child the parent's worker thread is gone (its executor would queue
        tasks that never run): the next task starts a new one. Work that thread had not
        finished never finishes here: its futures (forwards in flight, deferred experts,
        staging writes) are replaced by failed ones, so their syncs raise instead of
        waiting forever. A wrapper held by a forward running on another thread (gone here)
        is free again; one submitted stays submitted (its sync raises as above)."""
        lost = {f for f in cls._worker_futures if f._state != _FINISHED}  # no lock: it may be held by the gone thread
        cls._executor_lock = threading.Lock()
        cls._executor = None
        cls._pool_tasks = 0
        cls._worker_futures = set()
        for wrapper in list(cls._instances):
            wrapper._state_lock = threading.Lock()  # (the same: a gone thread may hold it)
            if wrapper._busy in ("running", "loading"):  # the forking thread is not inside a call of its own
                wrapper._busy, wrapper._inflight = None, None
        if not lost:
            return
        failed: dict[Future, Future] = {}

        def fail(future: object) -> object:
            if not isinstance(future, Future) or future not in lost:
                return future
            if future not in failed:
                failed[future] = Future()
                failed[future].set_exception(RuntimeError(
                    "this work was running on kt_ops' worker thread when the process fork()ed; the thread does "
                    "not exist in the child, so it never finishes here: submit it again"))
            return failed[future]

        def fail_pending(entry: tuple | None) -> tuple | None:
            return None if entry is None else (fail(entry[0]), *entry[1:])

        for pending in list(cls._pending_maps):
            for key, entry in list(pending.items()):
                pending[key] = fail_pending(entry)
        for wrapper in list(cls._instances):
            if wrapper._inflight is not None:
                wrapper._inflight = replace(wrapper._inflight, result=fail(wrapper._inflight.result),
                                            previous=fail_pending(wrapper._inflight.previous))
            wrapper._staging = fail(wrapper._staging)

    def submit_write_weight_scale_to_buffer(
        self,
        gpu_tp_count: int,
        expert_id: int,
        w13_weight_ptrs: Sequence[Destination],
        w13_scale_ptrs: Sequence[Destination],
        w2_weight_ptrs: Sequence[Destination],
        w2_scale_ptrs: Sequence[Destination],
    ) -> None:
        """Starts writing CPU expert slot ``expert_id`` into kt-kernel's GPU staging layouts,
        one destination per GPU TP rank for each tensor (layer-wise GPU prefill; layouts and
        destinations: :mod:`kt_ops.staging`); :meth:`sync_write_weight_scale_to_buffer` waits.
        Runs on the wrapper's worker thread, after any forward submitted before it; the
        destination lists are read at submit (refilling them before the sync is fine).

        Here: ``ValueError`` for a slot outside the layer or one whose weights are not held
        here (a GPU slot of ``gpu_experts_mask``, unless the layer holds every slot:
        ``dynamic_gpu_experts``, converted and GGUF weights), ``RuntimeError`` before
        :meth:`load_weights`. From the sync: ``ValueError`` for a format with no staging
        layout, a ``gpu_tp_count`` that does not divide I into whole scale groups, or a
        destination of the wrong size."""
        if not self._route_all.numel():  # (not _parts: empty too for a loaded layer of GPU slots only)
            raise RuntimeError(f"layer {self.layer_idx}: load_weights first; no CPU experts are packed")
        if not is_int(expert_id) or not 0 <= expert_id < self.num_experts:  # 1.5: IndexError, True: RuntimeError
            raise ValueError(f"expert_id {expert_id!r} is not a slot of this layer's {self.num_experts}")
        if not is_int(gpu_tp_count) or gpu_tp_count < 1:  # else raised only by the sync, from the worker
            raise ValueError(f"gpu_tp_count must be a positive int, got {gpu_tp_count!r}")
        packed = int(self._route_all[expert_id])
        if packed < 0:
            raise ValueError(f"expert_id {expert_id} is a GPU expert (gpu_experts_mask): the CPU holds no weights for it")
        self.sync_write_weight_scale_to_buffer()
        # the destinations as they are now (kt-kernel converts the lists at submit): a caller may refill its lists
        # for the next expert before the sync
        lists = [tuple(v) if isinstance(v, (list, tuple)) else v
                 for v in (w13_weight_ptrs, w13_scale_ptrs, w2_weight_ptrs, w2_scale_ptrs)]
        self._staging = self._run_on_worker(write_weight_scale_to_buffer, list(self._parts), packed, gpu_tp_count,
                                            *lists)

    def sync_write_weight_scale_to_buffer(self) -> None:
        """Waits for the write :meth:`submit_write_weight_scale_to_buffer` started (and raises
        its error); returns at once when none is pending."""
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.result()

    def submit_forward(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        cuda_stream: object | None = None,
    ) -> None:
        """Starts this layer's CPU experts and returns at once; :meth:`sync_forward`
        collects them. ``hidden_states [T, H]``, ``topk_ids [T, K]`` (physical slots, -1
        skips; K = ``num_experts_per_tok``), ``topk_weights [T, K]``, all on one device.

        CPU inputs: the work runs on a background thread that releases the GIL. CUDA
        inputs (builds with the CUDA key): the work is queued on ``cuda_stream`` (a
        ``torch.cuda.Stream``, a ``cudaStream_t`` int, or None for the current stream)
        through the operator's CUDA key, without blocking and CUDA-graph capturable
        (reserve the batch sizes with :meth:`set_capture_batch_sizes`; run one eager
        forward before capture); deferred experts go to a side stream in eager calls (the
        next layer's sync waits for it) and stay on the stream under capture. Without the
        CUDA key, CUDA inputs are copied to the CPU first (a warning says so once).

        ``topk_ids`` must be int32/int64 in ``[-1, num_experts)`` and ``topk_weights``
        float32/bfloat16/float16, as :func:`kt_ops.moe_forward` requires (``ValueError``
        otherwise; on the CUDA path an id out of range is reported by the next call).
        Inside a :class:`kt_ops.ExpertStats` block the ids are counted as given (before
        deferral), under row ``layer_idx``.

        ``RuntimeError`` while another thread's forward holds the wrapper (one caller at a
        time: the class docstring), or while a forward submitted here is not collected."""
        self._claim()
        try:
            self._submit(hidden_states, topk_ids, topk_weights, cuda_stream, inline=False)
        finally:
            self._release(submitted=self._inflight is not None)

    def _submit(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                cuda_stream: object | None, inline: bool) -> torch.Tensor | None:
        """:meth:`submit_forward`; ``inline`` (:meth:`forward`, which waits at once): CPU
        inputs are computed on the calling thread when the worker thread is idle and no
        expert is deferred — returned at once where one operator call is the whole layer
        (:meth:`_direct_cpu_forward`), else the result (or error) left for
        :meth:`sync_forward` as the worker's would be. None when nothing is returned."""
        if not self._route_all.numel():
            raise RuntimeError(f"layer {self.layer_idx}: no weights loaded (call load_weights first)")
        self._check_mask()  # (before ~mask below: a replaced list failed there with a TypeError)
        if not self._parts and bool((~self.gpu_experts_mask).any()):
            # (every slot on the GPU and nothing loaded: the empty routing table failed in torch.where)
            raise RuntimeError(f"layer {self.layer_idx}: no weights loaded (call load_weights first)")
        require_tensors(hidden_states=hidden_states, topk_ids=topk_ids, topk_weights=topk_weights)
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [T, {self.hidden_size}], got {tuple(hidden_states.shape)}")
        if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden_states.shape[0]:
            raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
                             f"[T={hidden_states.shape[0]}, K]")
        if topk_ids.shape[1] != self.num_experts_per_tok:  # deferral and the CUDA-graph buffers are sized by it
            raise ValueError(f"topk_ids {tuple(topk_ids.shape)} must have K = num_experts_per_tok = "
                             f"{self.num_experts_per_tok} columns (-1 marks a slot to skip)")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
        if topk_weights.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"topk_weights must be float32, bfloat16 or float16, got {topk_weights.dtype}")
        if hidden_states.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"hidden_states must be float32, bfloat16 or float16, got {hidden_states.dtype}")
        for name, tensor in (("hidden_states", hidden_states), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if tensor.is_meta:  # else NotImplementedError "Cannot copy out of meta tensor" from a copy, or .item()
                raise ValueError(f"{name} is on the meta device (a shape without values): the layer needs its values")
        device, dtype = hidden_states.device, hidden_states.dtype
        if gpu_prefill.should_run_on_device(hidden_states, self.gpu_prefill_token_threshold):
            return self._submit_prefill(hidden_states, topk_ids, topk_weights, cuda_stream)
        if device.type == "cuda" and kt_ops.cuda.is_built():
            return self._submit_cuda(hidden_states, topk_ids, topk_weights, cuda_stream)
        if device.type == "cuda" and not KTMoEWrapper._warned_no_cuda_key:
            KTMoEWrapper._warned_no_cuda_key = True
            warnings.warn("this kt_ops build has no CUDA key: KTMoEWrapper copies CUDA inputs to the CPU and waits "
                          "(not asynchronous, not capturable in a CUDA graph); see kt_ops.cuda.is_built()", stacklevel=2)
        expert_stats.record(self.layer_idx, topk_ids, self.num_experts)  # kt_ops.ExpertStats, on topk_ids' device
        if inline and device.type == "cpu":
            out = self._direct_cpu_forward(hidden_states, topk_ids, topk_weights)
            if out is not None:
                return out
        x = hidden_states.to("cpu").contiguous()
        ids = topk_ids.to("cpu")
        weights = topk_weights.to("cpu").float()
        d = self.max_deferred_experts_per_token
        deferred = None
        if d > 0:
            self._check_ids(ids)  # before the split: an id above num_experts failed in its scatter (RuntimeError)
            ids, deferred = self.select_deferred_experts(ids, weights, self.num_experts_per_tok - d)
        if inline and deferred is None and KTMoEWrapper._pool_tasks == 0:
            # The worker would add a thread hand-off (~50 us) and run the kernels' parallel
            # regions as the master of a second OpenMP team, which spins against the
            # caller's (torch's) team for the same cores.
            future: Future = Future()
            try:
                future.set_result(self._compute(x, ids, weights))
            except Exception as error:  # raised by sync_forward, as the worker's would be
                future.set_exception(error)
        else:
            future = self._run_on_worker(self._compute, x, ids, weights)
        previous = KTMoEWrapper._thread_pending().pop((self.deferral_group, self.layer_idx), None)
        if deferred is not None:
            KTMoEWrapper._thread_pending()[(self.deferral_group, self.layer_idx + 1)] = (
                self._run_on_worker(self._compute, x, deferred, weights), x.shape[0], None)
        self._inflight = _Inflight(future, previous, device, dtype)

    def _submit_cuda(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     cuda_stream: object | None) -> None:
        device = hidden_states.device
        self._check_devices(device, topk_ids, topk_weights)
        stream = resolve_stream(cuda_stream, device)
        capturing = torch.cuda.is_current_stream_capturing()
        if not capturing:
            self._reserve_capture_buffers(device.index if device.index is not None else torch.cuda.current_device())
        table = self._table(device, capturing)
        with torch.cuda.stream(stream):
            expert_stats.record(self.layer_idx, topk_ids, self.num_experts)  # kt_ops.ExpertStats, stream-ordered
            weights = topk_weights.float()
            ids, deferred = topk_ids, None
            d = self.max_deferred_experts_per_token
            if d > 0:
                ids, deferred = self.select_deferred_experts(ids, weights, self.num_experts_per_tok - d)
            chunk = self.chunked_prefill_size
            out = experts_on_device(self._parts, hidden_states, ids, weights, table, chunk, self._part_nodes)
            previous = KTMoEWrapper._thread_pending().pop((self.deferral_group, self.layer_idx), None)
        if deferred is not None:
            queue = stream if capturing else self._deferred_stream(device)
            if queue is not stream:  # eager: on a side stream, overlapping the next layer's GPU work
                queue.wait_stream(stream)
                for tensor in (hidden_states, deferred, weights):
                    tensor.record_stream(queue)
            # Under capture the deferred call stays on the capturing stream: graph staging is
            # shared per shape, so two captured calls must not run concurrently.
            with torch.cuda.stream(queue):
                later = experts_on_device(self._parts, hidden_states, deferred, weights, table, chunk,
                                          self._part_nodes)
            KTMoEWrapper._thread_pending()[(self.deferral_group, self.layer_idx + 1)] = (
                later, hidden_states.shape[0], queue)
        self._inflight = _Inflight(out, previous, device, hidden_states.dtype, stream)

    def _submit_prefill(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        cuda_stream: object | None) -> None:
        """GPU-assisted prefill: every CPU expert of the call (none deferred) computed on
        ``hidden_states``' device by :func:`kt_ops.gpu_prefill.moe_forward_on_device`,
        part by part, the parts' fp32 outputs summed in part order, on ``cuda_stream``."""
        device = hidden_states.device
        self._check_devices(device, topk_ids, topk_weights)
        self._check_ids(topk_ids)
        stream = resolve_stream(cuda_stream, device) if device.type == "cuda" else None
        with torch.cuda.stream(stream):
            expert_stats.record(self.layer_idx, topk_ids, self.num_experts)  # kt_ops.ExpertStats
            ids = packed_ids(topk_ids, self._table(device))
            weights = topk_weights.float()
            out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=device)
            for part in self._parts:
                out = out + gpu_prefill.moe_forward_on_device(hidden_states, ids, weights, part,
                                                              out_dtype=torch.float32)
            previous = KTMoEWrapper._thread_pending().pop((self.deferral_group, self.layer_idx), None)
        self._inflight = _Inflight(out, previous, device, hidden_states.dtype, stream)

    def _deferred_stream(self, device: torch.device) -> torch.cuda.Stream:
        """This wrapper's side stream on ``device`` for deferred experts (eager calls)."""
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device)
        return self._side_streams[device]

    def sync_forward(self, hidden_states: torch.Tensor | None = None, cuda_stream: object | None = None) -> torch.Tensor:
        """Collects :meth:`submit_forward`'s work: ``[T, H]`` in the input's dtype and on
        its device (a new tensor), plus the previous layer's deferred experts if any. CPU
        path: waits for the background thread. CUDA path: does not wait; the result is
        ordered on the stream the work was submitted to (a host-function failure, such as
        an expert id out of range, is raised by the next call or
        :func:`kt_ops.cuda.raise_pending_error`). Any thread may collect a submitted
        forward; ``RuntimeError`` while another thread's forward is running (one caller at
        a time: the class docstring)."""
        self._claim(collect=True)
        try:
            return self._collect()
        finally:
            self._release()

    def _collect(self) -> torch.Tensor:
        """:meth:`sync_forward`'s work, the wrapper held by the caller."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:  # (a submit that failed leaves the wrapper free, not submitted)
            raise RuntimeError(f"layer {self.layer_idx}: sync_forward without submit_forward")
        if isinstance(inflight.result, torch.Tensor):
            with torch.cuda.stream(inflight.stream):
                return self._add_deferred(inflight.result, inflight.previous).to(inflight.dtype)
        out = self._add_deferred(inflight.result.result(), inflight.previous)
        return out.to(device=inflight.device, dtype=inflight.dtype)

    def _add_deferred(
        self, out: torch.Tensor, previous: tuple[Future | torch.Tensor, int, torch.cuda.Stream | None] | None
    ) -> torch.Tensor:
        if previous is None:
            return out
        deferred, tokens, queued_on = previous
        if tokens != out.shape[0]:
            raise ValueError(f"layer {self.layer_idx}: layer {self.layer_idx - 1}'s deferred experts were computed "
                             f"for {tokens} tokens, this batch has {out.shape[0]}")
        value = deferred.result() if isinstance(deferred, Future) else deferred
        if value.device != out.device:
            raise ValueError(f"layer {self.layer_idx}: layer {self.layer_idx - 1}'s deferred experts are on "
                             f"{value.device}, this batch is on {out.device}")
        if queued_on is not None and queued_on != torch.cuda.current_stream(out.device):
            torch.cuda.current_stream(out.device).wait_stream(queued_on)  # the previous layer used another stream
            value.record_stream(torch.cuda.current_stream(out.device))
        return out + value

    def forward(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        cuda_stream: object | None = None,
    ) -> torch.Tensor:
        """:meth:`submit_forward` then :meth:`sync_forward`. CPU inputs are computed on the
        calling thread (on torch's intra-op threads, with no hand-off) unless the worker
        thread is busy or experts are deferred. ``RuntimeError`` while another thread's
        forward holds the wrapper (one caller at a time: the class docstring)."""
        self._claim()
        try:
            out = self._submit(hidden_states, topk_ids, topk_weights, cuda_stream, inline=True)
            return out if out is not None else self._collect()
        finally:
            self._release()

    # ---- kt-kernel's buffer API ----------------------------------------------------------

    @staticmethod
    def set_capture_batch_sizes(batch_sizes: Sequence[int] | None = None, *,
                                capture_bs: Sequence[int] | None = None) -> None:
        """The batch sizes (tokens per forward) CUDA graphs will be captured at: every
        wrapper, now and constructed later, reserves pinned staging for them on the
        current CUDA device (and on the device of its first CUDA forward), before
        capture, once (shared by layers of the same hidden size and top-k, never
        reallocated). With no GPU or no CUDA key the sizes are only recorded. ``capture_bs``:
        kt-kernel's name for ``batch_sizes``."""
        if (batch_sizes is None) == (capture_bs is None):
            raise TypeError("give batch_sizes or capture_bs (kt-kernel's name), one of them")
        given = list(batch_sizes if capture_bs is None else capture_bs)
        sizes: set[int] = set()
        for b in given:  # ints and integer scalars (numpy, 0-d tensors); int() took 2.5 as 2, True as 1, "4" as 4
            try:
                size = None if isinstance(b, bool) else operator.index(b)
            except TypeError:
                size = None
            if size is None or size < 1:
                raise ValueError(f"batch sizes must be positive ints, got {given}")
            sizes.add(size)
        KTMoEWrapper._capture_batch_sizes = sorted(sizes)
        for wrapper in list(KTMoEWrapper._instances):
            wrapper._reserve_capture_buffers()

    def _reserve_capture_buffers(self, device: int | None = None) -> None:
        sizes = tuple(capture_call_sizes(KTMoEWrapper._capture_batch_sizes, self.chunked_prefill_size))
        if not sizes or not kt_ops.cuda.is_built() or not torch.cuda.is_available():
            return
        index = torch.cuda.current_device() if device is None else device
        if (index, sizes) not in self._reserved:
            kt_ops.cuda.reserve_cuda_graph_buffers(sizes, self.hidden_size, self.num_experts_per_tok, index)
            self._reserved.add((index, sizes))

    @staticmethod
    def get_capture_batch_sizes() -> list[int]:
        return list(KTMoEWrapper._capture_batch_sizes)

    @staticmethod
    def clear_buffer_cache() -> None:
        """Drops deferred results not yet collected by the next layer (every thread's).
        The pinned staging of captured batch sizes is kept: captured CUDA graphs point
        into it."""
        for pending in list(KTMoEWrapper._pending_maps):
            pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=KTMoEWrapper._forget_worker_after_fork)


def detect_method(path: Path, layer_idx: int) -> str:
    """The method of the weights at ``path`` for ``method=None``: ``LLAMAFILE`` for GGUF,
    ``AMXINT4`` / ``AMXINT8`` for a directory written by kt-kernel's converter (from layer
    ``layer_idx``'s sizes), an INT4 or FP8 checkpoint's own method, ``AMXINT8`` for an INT8
    (W8A8) one, ``BF16`` for float safetensors. A directory written by ``kt_ops.convert``
    needs its method named (``ValueError``)."""
    if not path.exists():
        raise FileNotFoundError(f"weight_path {path} does not exist")
    if is_converted(path):
        raise ValueError(f"{path} was written by kt_ops.convert; pass the method it was converted with")
    if is_kt_kernel_dir(path):
        directory = KtKernelDir(path, layer_idx=layer_idx)
        try:
            directory.layer_shape(layer_idx)  # ValueError naming the layers it holds
            return directory.method(layer_idx)
        finally:
            directory.close()
    if path.suffix == ".gguf" or (path.is_dir() and any(path.glob("*.gguf"))):
        return "LLAMAFILE"
    return native_method(HfCheckpoint(path), layer_idx)
