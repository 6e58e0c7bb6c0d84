"""kt-kernel-compatible wrappers (KTMoEWrapper), the nn.Module MoE layer (HybridMoE) and
Hugging Face model patching (patch_model)."""

from kt_ops.dynamic_experts import rebalance_gpu_experts
from kt_ops.wrappers.hybrid_moe import HybridMoE
from kt_ops.wrappers.kt_moe_wrapper import KTMoEWrapper, generate_gpu_experts_masks
from kt_ops.wrappers.patch import HYBRID_MODEL_TYPES, PatchReport, patch_model, supported_model_types
from kt_ops.wrappers.routing import Routing

__all__ = [
    "HYBRID_MODEL_TYPES",
    "HybridMoE",
    "KTMoEWrapper",
    "PatchReport",
    "Routing",
    "SUPPORTED_MODEL_TYPES",
    "generate_gpu_experts_masks",
    "patch_model",
    "rebalance_gpu_experts",
    "supported_model_types",
]


def __getattr__(name: str) -> object:
    """``SUPPORTED_MODEL_TYPES``: :func:`supported_model_types`, read from the installed
    transformers when first asked for (``import kt_ops`` does not import transformers)."""
    if name == "SUPPORTED_MODEL_TYPES":
        return supported_model_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
