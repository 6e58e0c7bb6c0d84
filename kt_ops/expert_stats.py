"""Expert activation statistics: how often each routed expert of each MoE layer is chosen.

::

    with kt_ops.ExpertStats(num_hidden_layers=config.num_hidden_layers) as stats:
        model.generate(...)
    stats.save("experts.pt")            # SGLang's dump format, read by --init-expert-location
    masks = kt_ops.placement_masks("frequency", E, moe_layers, budget=8, stats=stats)

Every kt_ops MoE layer run inside the ``with`` block (:class:`kt_ops.HybridMoE`,
:class:`kt_ops.KTMoEWrapper`, the transformers experts implementation) calls
:func:`record` with its layer id and the ``topk_ids`` it was given. Counting happens on
``topk_ids``' own device, stream-ordered, without a host synchronisation: one
``index_add_`` into a preallocated int64 accumulator per device (``[L, E + 1]``, column
``E`` collecting the ids < 0, which kt_ops uses for "skip this slot", and ids >= the
layer's expert count). With no collector active, :func:`record` is one truthiness check.

CUDA graphs: a call allocates the accumulator of a device the first time that device is
seen, and again when a layer id or expert count outgrows it; that must happen outside
capture (a ``RuntimeError`` says so otherwise). Give ``num_hidden_layers`` and
``num_experts`` and call :meth:`ExpertStats.reserve` (or run one eager forward) before
capturing. A captured graph then adds to the accumulator at every replay — also after the
``with`` block has ended, since the graph holds the accumulator, not the context; such
counts still show in :attr:`ExpertStats.counts` until :meth:`ExpertStats.reset`.

File format (SGLang's ``expert_distribution_recorder`` dump, ``--init-expert-location``):
``{"logical_count": int64 [buffer, num_hidden_layers, E]}``; :meth:`ExpertStats.save`
writes ``buffer = 1``, :meth:`ExpertStats.load` sums over ``buffer``.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from kt_ops._atomic import write_replacing
from kt_ops._validate import is_int, plain_int

# The collectors inside whose ``with`` block we are, innermost last; all of them count.
_ACTIVE: list[ExpertStats] = []
_ACTIVE_LOCK = threading.Lock()  # entering and leaving (recording reads a snapshot, unlocked)
_warned_no_layer_id = False
# How far a collector without num_hidden_layers / num_experts grows: far above any model's
# layers and experts, far below a layer id that would allocate gigabytes of counts.
_MAX_GROWN = 1 << 16


def record(layer_id: int | None, topk_ids: torch.Tensor, num_experts: int) -> None:
    """Counts one MoE call in every active :class:`ExpertStats`; a no-op when none is.

    Args:
        layer_id: the layer's index in the model (row of :attr:`ExpertStats.counts`).
            None (a layer built without one): not counted; warned about once.
        topk_ids: int32/int64 ``[..., K]`` expert ids as the caller routed them, on any
            device; ids < 0 (skipped slots) and ids >= ``num_experts`` are not counted.
        num_experts: the layer's expert count E.

    Queues an ``index_add_`` on ``topk_ids``' device (current stream), no host sync.
    ``topk_ids`` of another dtype is a ``ValueError`` (while a collector is active).
    Fake and meta tensors (shape propagation) are not counted.
    """
    if not _ACTIVE:
        return
    if layer_id is None:
        global _warned_no_layer_id
        if not _warned_no_layer_id:
            _warned_no_layer_id = True
            warnings.warn("kt_ops.ExpertStats: a MoE layer without a layer index ran inside the statistics "
                          "context and is not counted (HybridMoE(layer_idx=None), or transformers experts packed "
                          "on their first call: run kt_ops.hf_experts.pack_model_experts(model) first)", stacklevel=3)
        return
    if topk_ids.dtype not in (torch.int32, torch.int64):  # float ids were truncated, bools counted as 0 / 1
        raise ValueError(f"topk_ids must be int32 or int64 expert ids, got {topk_ids.dtype}")
    if topk_ids.device.type == "meta" or isinstance(topk_ids, FakeTensor):
        return
    for stats in tuple(_ACTIVE):  # a snapshot: a collector leaving (on another thread) shifted the live list
        stats._add(layer_id, topk_ids, num_experts)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_size(name: str, value: int | None, minimum: int) -> None:
    if value is not None and (not is_int(value) or value < minimum):
        raise ValueError(f"{name} must be an int >= {minimum} or None, got {value!r}")


class ExpertStats:
    """Counts the expert activations of the kt_ops MoE layers run inside ``with stats:``.

    Args:
        num_hidden_layers: the model's layer count L (dense layers included): the rows of
            :attr:`counts`, indexed by layer id. None: grows to the largest layer id seen
            + 1 (so trailing dense layers have no row; give it to write a file SGLang reads).
        num_experts: routed experts per layer E. None: grows to the largest seen.

    A layer id or expert count beyond a given size is a ``ValueError`` at the call.
    Collectors nest: every active one counts. A collector may be entered again later
    and keeps adding to its counts until :meth:`reset`. Calls from several threads at
    once (models served by a thread pool) are all counted: a collector's counting,
    growing and reading hold its lock.
    """

    def __init__(self, num_hidden_layers: int | None = None, num_experts: int | None = None) -> None:
        # numpy's integers (a config's, an array's) as ints, as placement_masks takes them
        num_hidden_layers, num_experts = plain_int(num_hidden_layers), plain_int(num_experts)
        _check_size("num_hidden_layers", num_hidden_layers, 0)
        _check_size("num_experts", num_experts, 1)
        self._fixed_layers = num_hidden_layers is not None
        self._fixed_experts = num_experts is not None
        self._layers = num_hidden_layers or 0
        self._experts = num_experts or 0
        self._acc: dict[torch.device, torch.Tensor] = {}  # device -> int64 [L, E + 1] (column E: not counted)
        self._ones: dict[torch.device, torch.Tensor] = {}  # device -> int64 scalar 1 (index_add_'s source)
        self._captured: set[int] = set()  # id() of accumulators a CUDA graph may write into
        self._retired: list[torch.Tensor] = []  # outgrown accumulators a captured graph may still write into
        self._base: torch.Tensor | None = None  # int64 [L, E] CPU counts set by load/from_counts
        # CPU index_add_ is a read-modify-write: concurrent calls would lose counts (and a
        # growth would drop the adds racing it); eager calls take this lock
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles (a ``KtOpsConfig(expert_stats=...)`` is deep-copied with its
        config) leave the lock out; the copy gets its own."""
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ---- context ----------------------------------------------------------------------

    def __enter__(self) -> ExpertStats:
        with _ACTIVE_LOCK:
            if any(s is self for s in _ACTIVE):
                raise RuntimeError("this ExpertStats is already active")
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        # Under the lock: a collector leaving on another thread between finding this one's
        # index and deleting it shifted the list, and the del removed that other collector.
        with _ACTIVE_LOCK:
            for i in range(len(_ACTIVE) - 1, -1, -1):
                if _ACTIVE[i] is self:
                    del _ACTIVE[i]
                    break

    @property
    def active(self) -> bool:
        """Whether this collector is counting now (inside its ``with`` block)."""
        return any(s is self for s in _ACTIVE)

    # ---- counting ---------------------------------------------------------------------

    @property
    def num_hidden_layers(self) -> int:
        """Rows of :attr:`counts` (given, or grown to the largest layer id seen + 1)."""
        return self._layers

    @property
    def num_experts(self) -> int:
        """Columns of :attr:`counts` (given, or grown to the largest expert count seen)."""
        return self._experts

    def reserve(self, device: torch.device | str | int) -> None:
        """Allocates the accumulator on ``device`` (an int: that CUDA device) for the
        current sizes, so that calls captured in a CUDA graph afterwards allocate nothing.
        Give ``num_hidden_layers`` and ``num_experts`` to the constructor first (or run one
        eager forward of every layer on that device)."""
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._accumulator(device, self._layers, self._experts)

    def _grow(self, layer_id: int, num_experts: int) -> tuple[int, int]:
        """The sizes after a call of ``layer_id`` with ``num_experts``; both checked before
        either is grown (a refused call grows nothing)."""
        if not is_int(layer_id) or layer_id < 0:
            raise ValueError(f"layer_id must be a non-negative int, got {layer_id!r}")
        if not is_int(num_experts) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        layers, experts = self._layers, self._experts
        if layer_id >= layers:
            if self._fixed_layers:
                raise ValueError(f"layer id {layer_id} is outside ExpertStats(num_hidden_layers={layers})")
            if layer_id >= _MAX_GROWN:  # 10**9 allocated a [10**9, E + 1] int64 accumulator (out of memory)
                raise ValueError(f"layer id {layer_id} is not a layer index (ExpertStats grows to {_MAX_GROWN} layers; "
                                 "give num_hidden_layers for more)")
            layers = layer_id + 1
        if num_experts > experts:
            if self._fixed_experts:
                raise ValueError(f"a layer with {num_experts} experts ran inside ExpertStats(num_experts={experts})")
            if num_experts > _MAX_GROWN:
                raise ValueError(f"num_experts {num_experts} is above the {_MAX_GROWN} ExpertStats grows to "
                                 "(give num_experts for more)")
            experts = num_experts
        self._layers, self._experts = layers, experts
        return layers, experts

    def _accumulator(self, device: torch.device, layers: int, experts: int) -> torch.Tensor:
        """int64 ``[>= layers, >= experts + 1]`` on ``device``; (re)allocated outside capture."""
        acc = self._acc.get(device)
        if acc is not None and acc.shape[0] >= layers and acc.shape[1] >= experts + 1:
            return acc
        if _capturing(device):
            raise RuntimeError(f"kt_ops.ExpertStats: the counts on {device} need a (larger) accumulator during CUDA "
                               "graph capture; give num_hidden_layers and num_experts and call stats.reserve(device), "
                               "or run one forward before capture")
        new = torch.zeros(layers, experts + 1, dtype=torch.int64, device=device)
        if acc is not None:
            if id(acc) in self._captured:  # a captured graph may still add into it: keep it, counted as is
                self._retired.append(acc)
            else:
                old_layers, old_experts = acc.shape[0], acc.shape[1] - 1
                new[:old_layers, :old_experts] = acc[:, :old_experts]
        self._acc[device] = new
        self._ones.setdefault(device, torch.ones((), dtype=torch.int64, device=device))
        return new

    def _add(self, layer_id: int, topk_ids: torch.Tensor, num_experts: int) -> None:
        if torch.compiler.is_compiling():  # traced into the graph: no lock (dynamo cannot trace one)
            self._add_unlocked(layer_id, topk_ids, num_experts)
            return
        with self._lock:
            self._add_unlocked(layer_id, topk_ids, num_experts)

    def _add_unlocked(self, layer_id: int, topk_ids: torch.Tensor, num_experts: int) -> None:
        layers, experts = self._grow(layer_id, num_experts)
        device = topk_ids.device
        acc = self._accumulator(device, layers, experts)
        if _capturing(device):
            self._captured.add(id(acc))
        width = acc.shape[1]  # >= experts + 1; column width - 1 collects what is not counted
        ids = topk_ids.reshape(-1).long()
        counted = (ids >= 0) & (ids < num_experts)
        index = torch.where(counted, ids, width - 1) + layer_id * width
        acc.view(-1).index_add_(0, index, self._ones[device].expand(index.numel()))

    # ---- results ----------------------------------------------------------------------

    @property
    def counts(self) -> torch.Tensor:
        """int64 CPU ``[num_hidden_layers, num_experts]``: activations per (layer id,
        expert), summed over devices (and over counts set by :meth:`load`). Rows of layers
        that never ran (dense layers) are 0. Reading synchronizes the CUDA devices counted on."""
        with self._lock:
            out = torch.zeros(self._layers, self._experts, dtype=torch.int64)
            if self._base is not None:
                out[: self._base.shape[0], : self._base.shape[1]] += self._base
            accumulators = [*self._acc.values(), *self._retired]
        for acc in accumulators:
            if acc.device.type == "cuda":
                torch.cuda.synchronize(acc.device)
            rows, experts = min(acc.shape[0], out.shape[0]), min(acc.shape[1] - 1, out.shape[1])
            out[:rows, :experts] += acc[:rows, :experts].cpu()
        return out

    def reset(self) -> None:
        """Sets every count to 0 (the accumulators are zeroed in place: graphs captured
        with them keep counting into them)."""
        with self._lock:
            self._base = None
            for acc in [*self._acc.values(), *self._retired]:
                acc.zero_()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes SGLang's dump format: ``torch.save({"logical_count": counts[None]})``,
        int64 ``[1, num_hidden_layers, num_experts]``, under a temporary name renamed over
        ``path`` (a file already there stays whole until the new one is complete).
        ``IsADirectoryError`` when ``path`` is a directory, ``FileNotFoundError`` when its
        directory does not exist."""
        counts = self.counts[None]
        write_replacing(path, lambda tmp: torch.save({"logical_count": counts}, tmp), "ExpertStats.save writes one file")

    @classmethod
    def from_counts(cls, counts: torch.Tensor) -> ExpertStats:
        """An :class:`ExpertStats` whose :attr:`counts` are ``counts``: ``[L, E]`` or
        ``[buffer, L, E]`` (summed over ``buffer``), non-negative whole numbers of any real
        dtype. Its sizes are fixed to ``L`` and ``E``."""
        if not isinstance(counts, torch.Tensor):
            raise ValueError(f"expert counts must be a tensor, got {type(counts).__name__}")
        if counts.dim() not in (2, 3):
            raise ValueError(f"expert counts must be [num_hidden_layers, E] or [buffer, num_hidden_layers, E], "
                             f"got shape {tuple(counts.shape)}")
        if counts.dtype == torch.bool or counts.is_complex():
            raise ValueError(f"expert counts must be integers, got {counts.dtype}")
        counts = counts.detach().to("cpu")
        if counts.is_floating_point():
            if not bool(torch.isfinite(counts).all()) or not bool((counts == counts.round()).all()):
                raise ValueError("expert counts must be whole numbers (a float tensor holds fractions, inf or nan)")
            if bool((counts.abs() >= 2.0**63).any()):  # the int64 cast gave -2**63: "must be non-negative"
                raise ValueError("expert counts must fit int64 (a float tensor holds counts of 2**63 or more)")
        counts = counts.to(torch.int64)
        if counts.shape[-1] < 1:
            raise ValueError(f"expert counts have no experts: shape {tuple(counts.shape)}")
        if bool((counts < 0).any()):
            raise ValueError("expert counts must be non-negative")
        if counts.dim() == 3:
            counts = counts.sum(dim=0)
            if bool((counts < 0).any()):  # non-negative terms: the sum wrapped around
                raise ValueError("expert counts summed over the buffer exceed int64")
        stats = cls(num_hidden_layers=int(counts.shape[0]), num_experts=int(counts.shape[1]))
        stats._base = counts.clone()
        return stats

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ExpertStats:
        """Reads a dump: SGLang's ``{"logical_count": int [buffer, L, E], ...}`` (summed
        over ``buffer``; what :meth:`save` writes) or a raw tensor ``[buffer, L, E]`` or
        ``[L, E]``. ``ValueError`` for anything else."""
        try:
            data: Any = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as error:  # unpickling errors of every kind
            raise ValueError(f"{path} is not a torch.save file of expert counts: {error}") from error
        if isinstance(data, dict):
            if "logical_count" not in data:
                raise ValueError(f"{path}: no 'logical_count' in the dict (keys: {sorted(map(str, data))})")
            data = data["logical_count"]
        if not isinstance(data, torch.Tensor):
            raise ValueError(f"{path}: expected a tensor or a dict with 'logical_count', got {type(data).__name__}")
        try:
            return cls.from_counts(data)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None

    def __repr__(self) -> str:
        return (f"ExpertStats(num_hidden_layers={self._layers}, num_experts={self._experts}, "
                f"devices={[str(d) for d in self._acc]}, active={self.active})")
