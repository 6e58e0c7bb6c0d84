"""kt-kernel-compatible wrappers (KTMoEWrapper), the nn.Module MoE layer (HybridMoE) and
Hugging Face model patching (patch_model)."""

from kt_ops.wrappers.hybrid_moe import HybridMoE
from kt_ops.wrappers.kt_moe_wrapper import KTMoEWrapper, generate_gpu_experts_masks
from kt_ops.wrappers.patch import SUPPORTED_MODEL_TYPES, PatchReport, patch_model
from kt_ops.wrappers.routing import Routing

__all__ = [
    "HybridMoE",
    "KTMoEWrapper",
    "PatchReport",
    "Routing",
    "SUPPORTED_MODEL_TYPES",
    "generate_gpu_experts_masks",
    "patch_model",
]
