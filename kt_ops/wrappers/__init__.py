"""kt-kernel-compatible wrappers (KTMoEWrapper) and nn.Module MoE layers live here."""

from kt_ops.wrappers.kt_moe_wrapper import KTMoEWrapper, generate_gpu_experts_masks

__all__ = ["KTMoEWrapper", "generate_gpu_experts_masks"]
