"""MoE routing in plain torch: router logits -> (top-k weights, top-k expert ids).

Covers the routers of the models :func:`kt_ops.patch_model` supports, with their dtype
behaviour, so a patched model selects the experts the original selects:

- softmax over all experts, top-k, optional renormalisation (Qwen3-MoE, Qwen2-MoE,
  Mixtral, DeepSeek-V2 ``greedy``);
- DeepSeek-V2 ``group_limited_greedy``: softmax, keep the ``topk_group`` groups with the
  highest maximum score, top-k among them;
- DeepSeek-V3 ``noaux_tc``: sigmoid scores, an expert bias used only for the choice,
  groups ranked by the sum of their two best biased scores, top-k among the kept
  groups, weights from the unbiased scores, renormalised;
- every one times ``routed_scaling_factor``.

Everything here is shape-static (no ``nonzero``, no data-dependent Python), so it
compiles with ``torch.compile(fullgraph=True)`` and captures in CUDA graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kt_ops._validate import is_int, is_real, plain_int, require_bools


@dataclass(frozen=True)
class Routing:
    """How one MoE layer picks its experts.

    Attributes:
        top_k: experts per token.
        scoring: ``"softmax"`` (probabilities over all experts) or ``"sigmoid"``
            (independent scores, DeepSeek-V3).
        norm_topk_prob: divide the chosen weights by their sum.
        num_groups: expert groups (DeepSeek); 1 means no grouping.
        topk_groups: groups kept per token when ``num_groups > 1``.
        group_score: how a group is ranked: ``"top2_sum"`` (DeepSeek-V3) or ``"max"``
            (DeepSeek-V2 ``group_limited_greedy``).
        routed_scaling_factor: multiplies the final weights.
        logits_fp32: compute the router logits in fp32 (DeepSeek) instead of the
            hidden states' dtype (Qwen, Mixtral).
        weights_in_logits_dtype: cast the weights back to the logits' dtype
            (Qwen3/Qwen2-MoE do, Mixtral and DeepSeek keep fp32).
    """

    top_k: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_score: Literal["top2_sum", "max"] = "top2_sum"
    routed_scaling_factor: float = 1.0
    logits_fp32: bool = False
    weights_in_logits_dtype: bool = False

    def __post_init__(self) -> None:
        # a bool or a fraction passed the comparisons and failed (or picked 1 expert) in topk;
        # numpy's integers (a config's) as ints, as KTMoEWrapper takes them
        for name in ("top_k", "num_groups", "topk_groups"):
            object.__setattr__(self, name, plain_int(getattr(self, name)))
            if not is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an int, got {getattr(self, name)!r}")
        # "no" is truthy: it renormalised the weights (or cast them) silently
        require_bools(norm_topk_prob=self.norm_topk_prob, logits_fp32=self.logits_fp32,
                      weights_in_logits_dtype=self.weights_in_logits_dtype)
        if not is_real(self.routed_scaling_factor) or not math.isfinite(self.routed_scaling_factor):
            raise ValueError(f"routed_scaling_factor must be a finite number, got {self.routed_scaling_factor!r}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be positive, got {self.top_k}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if self.group_score not in ("top2_sum", "max"):
            raise ValueError(f"group_score must be 'top2_sum' or 'max', got {self.group_score!r}")
        if self.num_groups < 1 or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"need 1 <= topk_groups ({self.topk_groups}) <= num_groups ({self.num_groups})")

    def check_experts(self, experts: int) -> None:
        """``ValueError`` when this routing cannot choose among ``experts`` experts: ``top_k``
        above them; groups that do not split them evenly, ``"top2_sum"`` groups of one
        expert, or a ``top_k`` above the experts of the ``topk_groups`` kept groups (the rest
        were taken from dropped groups, silently). :class:`kt_ops.HybridMoE` calls it when
        built, :meth:`select` at every call (Python on shapes: nothing traced)."""
        if self.top_k > experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds the number of experts ({experts})")
        if self.num_groups == 1:
            return
        if experts % self.num_groups:
            raise ValueError(f"{experts} experts do not split into {self.num_groups} groups")
        per_group = experts // self.num_groups
        if self.group_score == "top2_sum" and per_group < 2:  # topk(2) of one: RuntimeError
            raise ValueError(f"group_score 'top2_sum' needs at least 2 experts per group; {experts} experts in "
                             f"{self.num_groups} groups")
        if self.top_k > self.topk_groups * per_group:
            raise ValueError(f"top_k ({self.top_k}) exceeds the {self.topk_groups * per_group} experts of the "
                             f"{self.topk_groups} kept group(s) ({experts} experts in {self.num_groups} groups of "
                             f"{per_group}, topk_groups={self.topk_groups})")

    def logits(self, hidden_states: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
        """``hidden_states [T, H]``, ``router_weight [E, H]`` -> logits ``[T, E]``."""
        if self.logits_fp32:
            return F.linear(hidden_states.float(), router_weight.float())
        return F.linear(hidden_states, router_weight.to(hidden_states.dtype))

    def select(
        self, logits: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits [T, E]`` -> ``(weights [T, K], ids [T, K] int64)``.

        ``correction_bias [E]`` (DeepSeek-V3's ``e_score_correction_bias``) shifts the
        choice, not the weights. Weights are fp32, or the logits' dtype when
        ``weights_in_logits_dtype``.
        """
        self.check_experts(logits.shape[-1])
        if self.scoring == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = logits.float().sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if self.num_groups > 1:
            choice = self._mask_groups(choice, fill=0.0 if self.scoring == "softmax" and correction_bias is None
                                       else float("-inf"))
        if correction_bias is None and self.num_groups == 1:
            weights, ids = torch.topk(scores, self.top_k, dim=-1)
        else:
            ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
            # DeepSeek-V3 weighs by the unbiased scores; V2 by the group-masked ones.
            weights = (scores if correction_bias is not None else choice).gather(-1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if self.scoring == "sigmoid" else 0.0))
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        if self.weights_in_logits_dtype:
            weights = weights.to(logits.dtype)
        return weights, ids

    def _mask_groups(self, choice: torch.Tensor, fill: float) -> torch.Tensor:
        tokens, experts = choice.shape  # checked by select (check_experts)
        grouped = choice.view(tokens, self.num_groups, experts // self.num_groups)
        if self.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.topk(group_scores, self.topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), fill).view(tokens, experts)
