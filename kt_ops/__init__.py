"""kt_ops: PyTorch operators for Mixture-of-Experts layers on the CPU.

The routed experts of an MoE layer are packed once (:func:`pack_experts`) and run by
``torch.ops.kt.moe_forward`` (:func:`moe_forward`), which eager PyTorch and
``torch.compile(fullgraph=True)`` call directly. Kernels exist for every CPU variant
(:data:`CPU_VARIANTS`: AVX2, AVX-VNNI, AVX-512, AVX512_VNNI, AVX512_BF16, AMX); the best
one the CPU supports is chosen at import (:func:`cpu_variant`) unless
``KT_OPS_CPU_VARIANT`` forces another. The kernels run on torch's intra-op threads
(:func:`thread_source`).
"""

from kt_ops import autograd, hf_experts, reference  # noqa: F401  (autograd: kt::moe_forward's backward)
from kt_ops._optional import transformers_usable
from kt_ops.cpu import (
    CPU_VARIANTS,
    cpu_variant,
    get_num_threads,
    missing_features,
    set_cpu_variant,
    set_num_threads,
    supported_cpu_variants,
    thread_source,
)
from kt_ops.diagnostics import doctor
from kt_ops.expert_stats import ExpertStats
from kt_ops.formats import METHOD_FORMATS
from kt_ops.gpu_prefill import set_gpu_prefill_token_threshold
from kt_ops.gguf_loader import GgufModelInfo, load_gguf_expert_biases, load_gguf_experts, read_gguf_config
from kt_ops.lora import LoraExperts, moe_lora_forward
from kt_ops.ops import (
    dequantize_experts,
    moe_forward,
    moe_forward_parts,
    pack_experts,
    pack_fp8_experts,
    pack_int4_experts,
    set_activation,
)
from kt_ops.packed import PackedExperts
from kt_ops.placement import budget_from_bytes, placement_masks
from kt_ops.wrappers import (
    HybridMoE,
    KTMoEWrapper,
    PatchReport,
    Routing,
    generate_gpu_experts_masks,
    patch_model,
    rebalance_gpu_experts,
)

hf_experts.install()  # experts_implementation="kt_ops" in transformers, once transformers is imported

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``KtOpsConfig`` (and its quantizer) and ``from_gguf`` import transformers: loaded
    on first use (an ImportError naming what is missing without a transformers v5)."""
    if name == "KtOpsConfig":
        from kt_ops._optional import require_transformers

        require_transformers("kt_ops.KtOpsConfig")
        from kt_ops.hf_quantizer import KtOpsConfig

        return KtOpsConfig
    if name == "from_gguf":
        from kt_ops.hf_gguf import from_gguf

        return from_gguf
    raise AttributeError(f"module 'kt_ops' has no attribute {name!r}")

__all__ = [
    "CPU_VARIANTS",
    "ExpertStats",
    "GgufModelInfo",
    "HybridMoE",
    "KTMoEWrapper",
    "LoraExperts",
    "KtOpsConfig",
    "METHOD_FORMATS",
    "PackedExperts",
    "PatchReport",
    "Routing",
    "budget_from_bytes",
    "cpu_variant",
    "dequantize_experts",
    "doctor",
    "from_gguf",
    "generate_gpu_experts_masks",
    "get_num_threads",
    "hf_experts",
    "load_gguf_experts",
    "load_gguf_expert_biases",
    "missing_features",
    "moe_forward",
    "moe_forward_parts",
    "moe_lora_forward",
    "pack_experts",
    "pack_fp8_experts",
    "pack_int4_experts",
    "patch_model",
    "placement_masks",
    "read_gguf_config",
    "rebalance_gpu_experts",
    "reference",
    "set_activation",
    "set_cpu_variant",
    "set_gpu_prefill_token_threshold",
    "set_num_threads",
    "supported_cpu_variants",
    "thread_source",
]
if not transformers_usable():  # `from kt_ops import *` would fail on them (ImportError naming what is missing)
    __all__ = [name for name in __all__ if name not in ("KtOpsConfig", "from_gguf")]
