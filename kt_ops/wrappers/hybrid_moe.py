"""HybridMoE: an ``nn.Module`` MoE layer whose routed experts run on the CPU.

router logits -> :class:`Routing` -> the CPU experts by ``torch.ops.kt.moe_forward``
(packed weights in host memory), the experts marked GPU-resident in torch on the input's
device, optional shared experts -> sum. With CUDA inputs the CPU experts run through the
operator's CUDA key (stream-ordered, CUDA-graph capturable) on a side stream, overlapped
with the GPU experts and the shared experts.
"""

from __future__ import annotations

import math
import sys
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from kt_ops import autograd, expert_stats, gpu_prefill
from kt_ops._validate import is_int, is_integral, is_real, plain_int, require_bools
from kt_ops.dynamic_experts import checked_expert_ids, cpu_route, host_copy, most_activated
from kt_ops.formats import GROUPED_FORMATS, format_for_method
from kt_ops.gguf_types import GgufTypeLike
from kt_ops.ops import pack_experts
from kt_ops.packed import PackedExperts
from kt_ops.wrappers.routing import Routing

_HOST_BUFFERS = ("packed",)  # stay in host memory whatever .to()/.cuda() asks


def _record_router_logits(logits: torch.Tensor) -> None:
    """Appends ``logits [T, E]`` to the ``router_logits`` transformers v5 is collecting
    (``output_router_logits=True``): it records them by hooks on its router modules, which
    :func:`kt_ops.patch_model` replaced. Nothing while no collection is active."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    collected = None if collector is None else collector.get()
    if isinstance(collected, dict) and isinstance(collected.get("router_logits"), list):
        collected["router_logits"].append(logits)


class HybridMoE(nn.Module):
    """One MoE layer: routing, CPU experts (packed), GPU experts (torch), shared experts.

    Args:
        router_weight: ``[E, H]`` router (``gate``) weight.
        gate_proj: ``[E, I, H]``; up_proj: ``[E, I, H]``; down_proj: ``[E, H, I]`` — the
            routed experts in Hugging Face layout, bf16, fp16 or fp32 (as :func:`kt_ops.pack_experts`
            takes them: another dtype is a ``TypeError``), any device (another rank or shape is
            a ``ValueError`` naming the tensor).
        routing: how experts are chosen (:class:`Routing`); one that cannot choose among E
            experts (:meth:`Routing.check_experts`) is a ``ValueError``.
        method: packing method of the CPU experts (``BF16``, ``AMXINT8``, ``AMXINT4``,
            ``LLAMAFILE`` … as :func:`kt_ops.pack_experts`).
        gpu_experts_mask: bool ``[E]``; True: the expert runs in torch on the input's
            device (its weights kept as buffers in ``gpu_dtype``), not on the CPU.
        e_score_correction_bias: ``[E]`` DeepSeek-V3 choice bias, or None.
        shared_experts: a module ``[.., H] -> [.., H]`` added to every token, or None.
        shared_expert_gate: ``nn.Linear(H, 1)``: the shared output is scaled by
            ``sigmoid(gate(x))`` (Qwen2-MoE), or None.
        group_size / gguf_type: forwarded to :func:`kt_ops.pack_experts`.
        gpu_dtype: dtype of the GPU experts' weights (default: ``gate_proj``'s).
        layer_idx: the layer's index in the model: its row in :class:`kt_ops.ExpertStats`
            (:func:`kt_ops.patch_model` sets it). None: the layer is not counted (warned
            once when statistics are being collected).
        dynamic: the GPU experts may change at run time (:meth:`update_gpu_experts`,
            :meth:`rebalance`): every expert is packed for the CPU (the GPU ones skipped
            there) and the float weights stay in host memory (pinned where CUDA is
            available) to fill GPU slots from — about one more copy of the experts in
            host RAM. Their number stays ``gpu_experts_mask.sum()``.
        gpu_prefill_token_threshold: calls of at least this many tokens (0: none) whose
            input is on a GPU compute the CPU experts there, their weights copied from the
            packed layer (:func:`kt_ops.gpu_prefill.moe_forward_on_device`; kt-kernel's
            ``--kt-gpu-prefill-token-threshold``). Eager calls only (not under
            ``torch.compile`` or CUDA-graph capture). A plain attribute: change it freely.
            :func:`kt_ops.set_gpu_prefill_token_threshold` with ``update_gpu_experts=True``
            also moves a dynamic layer's GPU experts to each such call's most activated.
        router_jitter_noise: in training, the input (router and experts alike) is
            multiplied by noise uniform in ``[1 - j, 1 + j]`` drawn as Mixtral draws it
            (``router_jitter_noise``; 0: none); a finite ``j >= 0``.

    ``forward(hidden_states [..., H])`` (bf16, fp16 or fp32) returns ``[..., H]`` in the input's dtype. The
    GPU experts are computed densely over the batch (every GPU expert sees every token,
    weighted by 0 where not routed): shape-static for ``torch.compile`` and CUDA graphs,
    meant for the few hot experts a mask selects.
    """

    # Defaults for layers pickled (torch.save of a whole model) before these attributes
    # existed: unpickling restores the instance dict only, and forward reads both.
    record_router_logits: bool = False
    router_jitter_noise: float = 0.0

    def __init__(
        self,
        router_weight: torch.Tensor,
        gate_proj: torch.Tensor,
        up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        routing: Routing,
        *,
        method: str = "BF16",
        gpu_experts_mask: torch.Tensor | Sequence[bool] | None = None,
        e_score_correction_bias: torch.Tensor | None = None,
        shared_experts: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
        group_size: int = 128,
        gguf_type: GgufTypeLike | tuple[GgufTypeLike, GgufTypeLike, GgufTypeLike] | None = None,
        gpu_dtype: torch.dtype | None = None,
        layer_idx: int | None = None,
        dynamic: bool = False,
        gpu_prefill_token_threshold: int = 0,
        router_jitter_noise: float = 0.0,
    ) -> None:
        super().__init__()
        for name, weight, layout in (("gate_proj", gate_proj, "[E, I, H]"), ("up_proj", up_proj, "[E, I, H]"),
                                     ("down_proj", down_proj, "[E, H, I]")):
            # a 2-D gate_proj was "not enough values to unpack (expected 3, got 2)"
            if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
                got = f"shape {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
                raise ValueError(f"{name} must be 3-D {layout} (E experts, I intermediate, H hidden), got {got}")
        experts, intermediate, hidden = gate_proj.shape
        if router_weight.shape != (experts, hidden):
            raise ValueError(f"router_weight must be [E={experts}, H={hidden}], got {tuple(router_weight.shape)}")
        if up_proj.shape != gate_proj.shape:
            raise ValueError(f"up_proj must be [E, I, H] = [{experts}, {intermediate}, {hidden}] as gate_proj, got "
                             f"shape {tuple(up_proj.shape)}")
        if down_proj.shape != (experts, hidden, intermediate):
            raise ValueError(f"down_proj must be [E, H, I] = [{experts}, {hidden}, {intermediate}], got shape "
                             f"{tuple(down_proj.shape)}")
        routing.check_experts(int(experts))  # top_k, groups: refused here, not at the first forward
        mask = torch.zeros(experts, dtype=torch.bool) if gpu_experts_mask is None else \
            torch.as_tensor(gpu_experts_mask).to("cpu")
        if mask.dtype != torch.bool or mask.shape != (experts,):
            raise ValueError(f"gpu_experts_mask must be a bool tensor of shape [{experts}], got {mask.dtype} "
                             f"{tuple(mask.shape)}")
        if e_score_correction_bias is not None and tuple(e_score_correction_bias.shape) != (experts,):
            # [1] or [1, E] broadcast in Routing.select (one bias for all, silently); [E + 1] failed there
            raise ValueError(f"e_score_correction_bias must be [{experts}] (one per expert), got "
                             f"{tuple(e_score_correction_bias.shape)}")
        layer_idx = plain_int(layer_idx)  # numpy's integers too, as KTMoEWrapper's
        if layer_idx is not None and (not is_int(layer_idx) or layer_idx < 0):
            raise ValueError(f"layer_idx must be a non-negative int or None, got {layer_idx!r}")
        self.layer_idx = layer_idx
        if not is_real(router_jitter_noise) or not math.isfinite(router_jitter_noise) or router_jitter_noise < 0:
            raise ValueError(f"router_jitter_noise must be a finite number >= 0, got {router_jitter_noise!r}")
        self.router_jitter_noise = float(router_jitter_noise)
        self.gpu_prefill_token_threshold = gpu_prefill.checked_threshold(gpu_prefill_token_threshold)
        self.gpu_prefill_updates_gpu_experts = False  # kt_ops.set_gpu_prefill_token_threshold(update_gpu_experts=)
        self.num_experts, self.hidden_size, self.intermediate_size = int(experts), int(hidden), int(intermediate)
        self.routing = routing
        self.method = method
        self.overlap = True  # CUDA inputs: CPU experts on a side stream (eager only)
        # router logits into transformers' output_router_logits (patch_model sets it)
        self.record_router_logits = False
        self.router_weight = nn.Parameter(router_weight.detach().clone(), requires_grad=False)
        self.register_buffer("e_score_correction_bias",
                             None if e_score_correction_bias is None else e_score_correction_bias.detach().clone())
        self.shared_experts = shared_experts
        self.shared_expert_gate = shared_expert_gate

        require_bools(dynamic=dynamic)  # "no" is truthy: every expert packed, host copies kept
        self.dynamic = dynamic
        cpu_experts = torch.arange(experts) if self.dynamic else torch.nonzero(~mask).reshape(-1)
        gpu_experts = torch.nonzero(mask).reshape(-1)
        cpu_index = torch.full((experts,), -1, dtype=torch.int32)
        cpu_index[cpu_experts] = torch.arange(cpu_experts.numel(), dtype=torch.int32)
        cpu_index[gpu_experts] = -1  # dynamic: packed too, skipped on the CPU while on the GPU
        self._source: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if self.dynamic:
            self._source = tuple(host_copy(w) for w in (gate_proj, up_proj, down_proj))  # type: ignore[assignment]
        self.register_buffer("cpu_index", cpu_index)  # expert -> packed slot, -1: a GPU expert
        self.register_buffer("gpu_experts", gpu_experts)  # [G] expert ids computed in torch
        packed = torch.empty(0, dtype=torch.uint8)
        if cpu_experts.numel():
            sel = cpu_experts.to(gate_proj.device)
            pack_args: dict[str, object] = {"gguf_type": gguf_type} if gguf_type is not None else {}
            if format_for_method(method) in GROUPED_FORMATS:
                pack_args["group_size"] = group_size
            packed = pack_experts(gate_proj[sel].cpu(), up_proj[sel].cpu(), down_proj[sel].cpu(),
                                  method=method, **pack_args).data
        self.register_buffer("packed", packed)
        dtype = gpu_dtype or gate_proj.dtype
        sel = gpu_experts.to(gate_proj.device)
        self.register_buffer("gpu_gate_up", torch.cat([gate_proj[sel], up_proj[sel]], dim=1).to(dtype))
        self.register_buffer("gpu_down", down_proj[sel].to(dtype))

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object, **kwargs: object) -> None:
        """A dynamic layer fills GPU slots from the host copies of the constructor's weights
        (not in the state dict): loading other experts makes them stale, and a later
        :meth:`update_gpu_experts` computed the old experts in the refilled slots, silently."""
        if self.dynamic and self._source is not None and not self._matches_source(state_dict, prefix):
            self._source_stale = True
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _matches_source(self, state_dict: dict, prefix: str) -> bool:
        """Whether the experts in ``state_dict`` are the ones the host copies hold: the same
        packed blob (every expert is packed in a dynamic layer) and GPU slots equal to the
        host copies of the experts they name."""
        packed = state_dict.get(prefix + "packed")
        if isinstance(packed, torch.Tensor) and packed is not self.packed and not (
                packed.shape == self.packed.shape and torch.equal(packed.cpu(), self.packed)):
            return False
        ids, gate_up, down = (state_dict.get(prefix + name) for name in ("gpu_experts", "gpu_gate_up", "gpu_down"))
        if not all(isinstance(t, torch.Tensor) for t in (ids, gate_up, down)):
            return True
        gate, up, down_all = self._source
        ids = ids.cpu().long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_experts):
            return False
        want_gate_up = torch.cat([gate[ids], up[ids]], dim=1).to(gate_up.dtype)
        return (want_gate_up.shape == gate_up.shape and torch.equal(want_gate_up, gate_up.cpu())
                and torch.equal(down_all[ids].to(down.dtype), down.cpu()))

    # Host-resident buffers: the packed experts are the model's bulk and live in RAM.
    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "HybridMoE":
        kept = {name: self._buffers.pop(name) for name in _HOST_BUFFERS if name in self._buffers}
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers.update(kept)
        return self

    @property
    def num_gpu_experts(self) -> int:
        return int(self.gpu_experts.numel())

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"top_k={self.routing.top_k}, method={self.method}, gpu_experts={self.num_gpu_experts}, "
                f"packed={self.packed.numel() / 2**20:.1f} MiB")

    def set_capture_batch_sizes(self, batch_sizes: Sequence[int], device: torch.device | int | str | None = None) -> None:
        """Reserves the CUDA key's pinned staging for capturing this layer in CUDA graphs
        at these batch sizes (tokens per forward), on ``device``; layers of the same
        hidden size and top-k share it. Call before ``torch.cuda.graph`` capture."""
        from kt_ops.cuda import reserve_cuda_graph_buffers

        reserve_cuda_graph_buffers(batch_sizes, self.hidden_size, self.routing.top_k, device)

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden_states [T, H]`` -> ``(weights [T, K], ids [T, K] int64)``."""
        logits = self.routing.logits(hidden_states, self.router_weight)
        if self.record_router_logits:
            _record_router_logits(logits)
        return self.routing.select(logits, self.e_score_correction_bias)

    def forward(self, hidden_states: torch.Tensor, live_tokens: torch.Tensor | int | None = None) -> torch.Tensor:
        """``hidden_states [..., H]`` -> ``[..., H]``. ``live_tokens`` (int32/int64 ``[1]`` on
        the same device, optional): only the first ``live_tokens`` tokens are real, the CPU
        experts skip the padding rows (a CUDA graph captured at T replays for fewer
        tokens); padding rows hold only the GPU and shared experts' output. An int (numpy's
        too) is taken as an int64 ``[1]`` on the input's device, for eager calls (a CUDA
        graph replays the tensor it captured: pass one and refill it); anything else that is
        not a tensor is a ``TypeError``; an int outside ``[0, T]`` and a last dimension other
        than the layer's hidden size are ``ValueError``s."""
        if not isinstance(hidden_states, torch.Tensor):  # a list or numpy array: AttributeError from .shape
            raise TypeError(f"hidden_states must be a torch.Tensor [..., {self.hidden_size}], got "
                            f"{type(hidden_states).__name__}")
        shape = hidden_states.shape
        if hidden_states.dim() == 0 or shape[-1] != self.hidden_size:
            # reshape(-1, H) took [4, H/2] as [2, H]: rows of the wrong width computed, silently
            raise ValueError(f"hidden_states must be [..., {self.hidden_size}] (the layer's hidden size "
                             f"{self.hidden_size}), got {tuple(shape)}")
        x = hidden_states.reshape(-1, self.hidden_size)
        if self.training and self.router_jitter_noise > 0:  # Mixtral's, drawn as it draws it (not in place)
            jitter = self.router_jitter_noise
            x = x * torch.empty_like(x).uniform_(1.0 - jitter, 1.0 + jitter)
        if live_tokens is not None and not isinstance(live_tokens, torch.Tensor):
            # an int reached the operator's schema: RuntimeError "Expected a value of type 'Optional[Tensor]'"
            if not is_integral(live_tokens):
                raise TypeError(f"live_tokens must be an int or an int32/int64 tensor [1], got {live_tokens!r}")
            if not 0 <= int(live_tokens) <= x.shape[0]:  # checked here too: no operator runs without CPU experts
                raise ValueError(f"live_tokens = {int(live_tokens)} is outside [0, {x.shape[0]}] (the batch holds "
                                 f"{x.shape[0]} tokens)")
            live_tokens = torch.tensor([int(live_tokens)], dtype=torch.int64, device=x.device)
        weights, ids = self.route(x)
        expert_stats.record(self.layer_idx, ids, self.num_experts)  # kt_ops.ExpertStats: logical ids, x's device
        side = self._side_stream(x)
        if side is None:
            routed = self._cpu_experts(x, ids, weights, live_tokens)
            local = self._local_experts(x, ids, weights)
        else:  # CPU experts on a side stream, GPU and shared experts meanwhile
            current = torch.cuda.current_stream(x.device)
            side.wait_stream(current)
            try:
                with torch.cuda.stream(side):
                    routed = self._cpu_experts(x, ids, weights, live_tokens)
                local = self._local_experts(x, ids, weights)
            finally:  # joined even on an error: a graph capture must not end with the side stream forked
                current.wait_stream(side)
            routed.record_stream(current)
        out = routed if local is None else routed + local  # one summation order on both paths
        if self.gpu_prefill_updates_gpu_experts and gpu_prefill.should_run_on_device(x, self.gpu_prefill_token_threshold):
            self.rebalance(gpu_prefill.batch_counts(ids, self.num_experts))  # queued after this call's compute
        return out.reshape(shape)

    def _side_stream(self, x: torch.Tensor) -> torch.cuda.Stream | None:
        if (x.device.type != "cuda" or not self.overlap or not self.packed.numel() or torch.compiler.is_compiling()
                or isinstance(x, FakeTensor) or not torch.cuda.is_available()):
            return None
        stream = getattr(self, "_stream", None)
        if stream is None or stream.device != x.device:
            stream = torch.cuda.Stream(x.device)
            self._stream = stream
        return stream

    def _cpu_experts(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, live_tokens: torch.Tensor | None
    ) -> torch.Tensor:
        if not self.packed.numel():
            return torch.zeros_like(x)
        # take, not indexing: fake CUDA tensors index only where torch has CUDA
        cpu_ids = torch.take(self.cpu_index.to(x.device), ids)
        if gpu_prefill.should_run_on_device(x, self.gpu_prefill_token_threshold):
            return gpu_prefill.moe_forward_on_device(x, cpu_ids, weights, PackedExperts(self.packed), live_tokens,
                                                     next_layer=gpu_prefill.next_layer(self))
        return autograd.moe_forward(x.contiguous(), cpu_ids, weights.contiguous(), self.packed, self.intermediate_size,
                                    live_tokens)

    def _local_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """The GPU experts plus the shared experts (in torch on x's device), or None."""
        out = self._gpu_experts(x, ids, weights) if self.num_gpu_experts else None
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = shared if out is None else out + shared
        return out

    @torch.no_grad()
    def update_gpu_experts(self, expert_ids: torch.Tensor | Sequence[int]) -> None:
        """Makes ``expert_ids`` (``num_gpu_experts`` distinct ids in ``[0, E)``) the GPU
        experts, in ascending order (slot ``i`` holds the ``i``-th smallest id, as SGLang),
        without reloading: the slots whose expert changed are copied from the host weights,
        and the expert lists and CPU slot map are updated in place, so CUDA graphs captured
        before keep working (replay after this returns; the copies are queued on the
        current stream). Needs ``dynamic=True``."""
        if not self.dynamic or self._source is None:
            raise RuntimeError("update_gpu_experts needs HybridMoE(dynamic=True) (all experts packed for the CPU, "
                               "host weights kept to fill GPU slots from)")
        if getattr(self, "_source_stale", False):
            raise RuntimeError("update_gpu_experts: load_state_dict replaced this layer's experts, but the host copies "
                               "GPU slots are filled from are the constructor's weights; construct the HybridMoE from "
                               "the loaded weights instead")
        ids = checked_expert_ids(expert_ids, self.num_gpu_experts, self.num_experts)
        old = self.gpu_experts.to("cpu")
        gate, up, down = self._source
        for slot in torch.nonzero(old != ids).reshape(-1).tolist():
            e = int(ids[slot])
            self.gpu_gate_up[slot].copy_(torch.cat([gate[e], up[e]], dim=0), non_blocking=True)
            self.gpu_down[slot].copy_(down[e], non_blocking=True)
        self.cpu_index.copy_(cpu_route(ids, self.num_experts, torch.int32), non_blocking=True)
        self.gpu_experts.copy_(ids, non_blocking=True)

    def rebalance(self, counts: torch.Tensor) -> torch.Tensor:
        """Moves the layer's ``num_gpu_experts`` most activated experts (``counts [E]``, e.g.
        a row of :attr:`kt_ops.ExpertStats.counts`) to the GPU, as SGLang picks them
        (``topk`` of the counts, then ascending ids); returns the new GPU expert ids."""
        chosen = self.most_activated(counts)
        self.update_gpu_experts(chosen)
        return chosen

    def most_activated(self, counts: torch.Tensor) -> torch.Tensor:
        """The ids :meth:`rebalance` moves to the GPU for ``counts [E]`` (checked; nothing moved)."""
        return most_activated(counts, self.num_gpu_experts, self.num_experts)

    def _gpu_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The GPU experts, dense over the tokens: ``[T, H]`` in x's dtype."""
        routed = ids.unsqueeze(-1) == self.gpu_experts  # [T, K, G]
        per_expert = (routed * weights.unsqueeze(-1).float()).sum(dim=1)  # [T, G] fp32
        gate_up = torch.einsum("th,gjh->gtj", x, self.gpu_gate_up.to(x.dtype))
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch.einsum("gti,ghi->gth", F.silu(gate) * up, self.gpu_down.to(x.dtype))  # [G, T, H]
        return (y.float() * per_expert.t().unsqueeze(-1)).sum(dim=0).to(x.dtype)
