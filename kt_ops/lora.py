"""LoRA on every routed expert of a packed (frozen) layer: :class:`LoraExperts`.

kt-kernel's SFT layout and math (spec §7.3): per expert, gate and up get ``A [r, H]``,
``B [I, r]``, down gets ``A [r, I]``, ``B [H, r]``; ``scaling = alpha / r``::

    g = x Wg^T + s (x Ag^T) Bg^T      u = x Wu^T + s (x Au^T) Bu^T
    d = act(g, u) Wd^T + s (act(g, u) Ad^T) Bd^T      out = sum_j w_j d_j

computed by ``kt::moe_lora_forward`` over the frozen base of any format (its activation
variant and biases included): the base runs on the inference kernel, the gate and up
branches enter it before the activation, the down branch is added to its output, and the
kernel's ``g`` and ``u`` are kept for the backward. ``kt::moe_lora_backward``
(:mod:`kt_ops.autograd`) gives the gradients for the six LoRA tensors, ``hidden_states`` and
``topk_weights`` in one pass over the routed experts, no Python loop over experts.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kt_ops import autograd  # noqa: F401  (the operators' autograd)
from kt_ops._validate import is_int, is_real, plain_int
from kt_ops.packed import PackedExperts

LORA_NAMES = ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b")


def moe_lora_forward(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     packed: PackedExperts | torch.Tensor, lora: tuple[torch.Tensor, ...], scaling: float,
                     live_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """``kt::moe_lora_forward``: ``hidden_states [T, H]``, ``topk_ids``/``topk_weights
    [T, K]``, the frozen ``packed`` layer, ``lora = (gate_a [E, r, H], gate_b [E, I, r],
    up_a [E, r, H], up_b [E, I, r], down_a [E, r, I], down_b [E, H, r])`` -> ``[T, H]`` in
    ``hidden_states``' dtype. Differentiable w.r.t. the inputs and the six LoRA tensors."""
    data = packed.data if isinstance(packed, PackedExperts) else packed
    if len(lora) != 6:
        raise ValueError(f"lora must be (gate_a, gate_b, up_a, up_b, down_a, down_b), got {len(lora)} tensors")
    # NaN made every output NaN; True passed as 1. A SymFloat (torch.compile(dynamic=True) traces a
    # float such as LoraExperts.alpha / rank symbolically) is checked with a comparison dynamo can
    # trace: math.isfinite of one was a graph break.
    symbolic = isinstance(scaling, torch.SymFloat)
    if not (symbolic or is_real(scaling)) or not abs(scaling) < math.inf:
        raise ValueError(f"scaling must be a finite number, got {scaling!r}")
    out, _gate_up = torch.ops.kt.moe_lora_forward(hidden_states, topk_ids, topk_weights, data, *lora,
                                                  scaling if symbolic else float(scaling), live_tokens)
    return out


# Parameter dtypes LoraExperts takes (their products run in fp32).
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class LoraExperts(nn.Module):
    """Trainable LoRA matrices for the ``E`` routed experts of one packed layer.

    Args:
        num_experts, hidden_size, intermediate_size: the packed layer's ``E``, ``H``, ``I``.
        rank: ``r`` (> 0); alpha: ``scaling = alpha / r``.
        dropout: probability ``p`` in [0, 1) of dropping an input feature of an expert's
            LoRA branch while training, kt-kernel's way: one mask per (expert, projection,
            input feature) per call, scaling kept features by ``1 / (1 - p)`` (the ``A``
            columns are masked; the base weights see every feature).
        dtype: of the parameters (fp32 default; bf16 halves their memory).

    Initialised as PEFT initialises LoRA: ``A`` Kaiming-uniform (``a = sqrt(5)``, as
    ``nn.Linear``), ``B`` zero — the layer starts as the frozen base.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, rank: int = 16,
                 alpha: float = 32.0, dropout: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        # numpy's integers (sizes read from a config or an array) as ints, as KTMoEWrapper takes them
        num_experts, hidden_size, intermediate_size, rank = map(plain_int, (num_experts, hidden_size,
                                                                            intermediate_size, rank))
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size), ("rank", rank)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not (is_real(alpha) and math.isfinite(alpha) and alpha > 0):  # True passed as alpha = 1
            raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
        if not is_real(dropout) or not 0.0 <= dropout < 1.0:  # "0.1": TypeError from the comparison
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if dtype not in _PARAM_DTYPES:  # int32: torch's "Only Tensors of floating point ..."; float8: no init
            raise ValueError(f"dtype must be one of {', '.join(map(str, _PARAM_DTYPES))}, got {dtype!r}")
        E, H, I, r = num_experts, hidden_size, intermediate_size, rank
        self.rank, self.alpha, self.dropout = r, float(alpha), float(dropout)
        shapes = {"gate_a": (E, r, H), "gate_b": (E, I, r), "up_a": (E, r, H), "up_b": (E, I, r),
                  "down_a": (E, r, I), "down_b": (E, H, r)}
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype)))
        self.reset_parameters()

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for name in ("gate_a", "up_a", "down_a"):
            weight = getattr(self, name)
            bound = 1.0 / math.sqrt(weight.shape[-1])  # kaiming_uniform_(a=sqrt(5)) of nn.Linear
            weight.uniform_(-bound, bound)
        for name in ("gate_b", "up_b", "down_b"):
            getattr(self, name).zero_()

    def matrices(self) -> tuple[torch.Tensor, ...]:
        """The six LoRA tensors as the operator takes them (``A`` masked by dropout while training, in
        fp32: kept features scaled by exactly ``1 / (1 - p)``; fp64 parameters as fp32, the dtype their
        products run in: the operator takes no fp64)."""
        tensors = [getattr(self, name) for name in LORA_NAMES]
        tensors = [t.float() if t.dtype == torch.float64 else t for t in tensors]  # differentiable: fp64 gradients
        if self.training and self.dropout > 0:
            keep = 1.0 - self.dropout
            for index in (0, 2, 4):  # the A of gate, up, down: one mask per (expert, input feature)
                a = tensors[index]
                # in fp32: a bf16 mask scaled kept features by bf16(1 / keep) and rounded a * mask to bf16
                mask = (torch.rand(a.shape[0], 1, a.shape[2], device=a.device) < keep).float() / keep
                tensors[index] = a.float() * mask
        return tuple(tensors)

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                packed: PackedExperts | torch.Tensor, live_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts with LoRA: ``[T, H]`` in ``hidden_states``' dtype."""
        return moe_lora_forward(hidden_states, topk_ids, topk_weights, packed, self.matrices(), self.scaling,
                                live_tokens)

    def extra_repr(self) -> str:
        E, r, H = self.gate_a.shape
        return (f"experts={E}, hidden={H}, intermediate={self.gate_b.shape[1]}, rank={r}, alpha={self.alpha}, "
                f"dropout={self.dropout}")
