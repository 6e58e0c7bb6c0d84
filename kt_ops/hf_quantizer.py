"""Loading straight into packed experts: ``from_pretrained(..., quantization_config=KtOpsConfig(...))``.

transformers (v5) reads a checkpoint tensor by tensor and hands each parameter a quantizer
claims to the quantizer's operation. :class:`KtOpsHfQuantizer` claims the routed experts
of every experts class decorated with ``@use_experts_implementation``: as each layer's
fused ``gate_up_proj`` and ``down_proj`` (and their biases) arrive, in the checkpoint's own
dtype, they are packed into ``method`` by :func:`kt_ops.pack_experts` and the module keeps
only the blob (``kt_ops.hf_experts``); the parameters become empty placeholders, so the
experts never exist unpacked beyond the layer being read. The model's experts
implementation is set to ``"kt_ops"``. Importing this module imports transformers and
registers ``kt_ops`` as a quantization method; ``kt_ops.KtOpsConfig`` does that on first
use.

Float checkpoints (bf16/fp16/fp32) only, quantized online; a pre-quantized checkpoint
(FP8, GPTQ, AWQ, compressed-tensors, MXFP4) is refused by transformers' own config merge
or loads through :class:`kt_ops.KTMoEWrapper` in place.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.quantizers_utils import get_module_from_name
from transformers.utils.quantization_config import QuantizationConfigMixin

from kt_ops import hf_experts
from kt_ops.mapped_files import release_file_pages

QUANT_METHOD = "kt_ops"
_PENDING = "_kt_ops_pending"


@register_quantization_config(QUANT_METHOD)
class KtOpsConfig(QuantizationConfigMixin):
    """How ``from_pretrained`` packs the routed experts.

    Args:
        method: a kt_ops method (``BF16``, ``AMXINT8``, ``AMXINT4``, ``LLAMAFILE``, ``FP8``,
            ``RAWINT4``, ...), as :func:`kt_ops.pack_experts`.
        group_size, gguf_type, scale_search, zero_point: as :func:`kt_ops.pack_experts`.
        num_gpu_experts: experts ``[0, n)`` of every layer are not packed but kept in torch
            on the device the layer's other weights load to (``device_map``), as
            :func:`kt_ops.hf_experts.pack_model_experts` keeps them.
        progress: a tqdm bar over the MoE layers while loading.
    """

    def __init__(self, method: str = "BF16", group_size: int | None = None, gguf_type: Any = None,
                 scale_search: bool = False, zero_point: bool = False, num_gpu_experts: int = 0,
                 progress: bool = True, **kwargs: Any) -> None:
        from kt_ops.formats import format_for_method

        format_for_method(method, zero_point)  # ValueError naming the methods
        if method.upper() == "LLAMAFILE" and gguf_type is None:
            raise ValueError("KtOpsConfig(method='LLAMAFILE') needs gguf_type, e.g. 'Q4_K' or ('Q4_K', 'Q4_K', 'Q6_K')")
        self.quant_method = QUANT_METHOD
        self.method = method
        self.group_size = group_size
        self.gguf_type = gguf_type
        self.scale_search = scale_search
        self.zero_point = zero_point
        if not isinstance(num_gpu_experts, int) or isinstance(num_gpu_experts, bool) or num_gpu_experts < 0:
            raise ValueError(f"num_gpu_experts must be an int >= 0, got {num_gpu_experts!r}")
        self.num_gpu_experts = num_gpu_experts
        self.progress = progress

    def pack_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"method": self.method}
        for name in ("group_size", "gguf_type"):
            if getattr(self, name) is not None:
                args[name] = getattr(self, name)
        if self.scale_search:
            args["scale_search"] = True
        if self.zero_point:
            args["zero_point"] = True
        return args


class KtOpsPack(ConversionOps):
    """Collects a module's expert tensors as they load; packs them once all have arrived."""

    def __init__(self, quantizer: KtOpsHfQuantizer) -> None:
        self.quantizer = quantizer

    def convert(self, input_dict: dict[str, Any], model: torch.nn.Module | None = None,
                **kwargs: Any) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in input_dict.items():
            tensor = value[0] if isinstance(value, list) else value
            module, name = get_module_from_name(model, key)
            pending = module.__dict__.setdefault(_PENDING, {})
            pending[name] = tensor.detach().to("cpu")
            needed = {"gate_up_proj", "down_proj"} | ({"gate_up_proj_bias", "down_proj_bias"}
                                                      if getattr(module, "has_bias", False) else set())
            if needed <= pending.keys():
                del module.__dict__[_PENDING]
                self.quantizer.pack(module, pending)
                for source in pending.values():  # read through the checkpoint's mapping: drop its pages
                    release_file_pages(source)
            # an empty placeholder: the weights live in the module's packed blob
            out[key] = torch.nn.Parameter(torch.empty(0, dtype=tensor.dtype), requires_grad=False)
        return out


@register_quantizer(QUANT_METHOD)
class KtOpsHfQuantizer(HfQuantizer):
    """Packs the routed experts of decorated experts classes while the checkpoint loads."""

    requires_calibration = False
    quantization_config: KtOpsConfig

    def __init__(self, quantization_config: KtOpsConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._bar: Any = None

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        if self.pre_quantized:
            raise ValueError("KtOpsConfig packs float checkpoints while they load; this checkpoint is already "
                             "quantized (its config.json has a quantization_config): load its experts with "
                             "kt_ops.KTMoEWrapper(weight_path=...), which reads FP8 and INT4 checkpoints in place")

    def param_needs_quantization(self, model: torch.nn.Module, param_name: str, **kwargs: Any) -> bool:
        module, name = get_module_from_name(model, param_name)
        return name in hf_experts.EXPERT_TENSORS and hf_experts.is_experts_module(module)

    def _process_model_before_weight_loading(self, model: torch.nn.Module, **kwargs: Any) -> None:
        experts = [m for m in model.modules() if hf_experts.is_experts_module(m)]
        for module in experts:  # before any tensor is read
            hf_experts.check_supported(module)
            self._check_sizes(module)
            self._check_gpu_experts(module)
        model.set_experts_implementation(hf_experts.IMPLEMENTATION)
        if self.quantization_config.progress and experts:
            from tqdm import tqdm

            self._bar = tqdm(total=len(experts), desc=f"kt_ops: packing experts ({self.quantization_config.method})",
                             unit=" layers")

    def _check_gpu_experts(self, module: torch.nn.Module) -> None:
        experts = int(module.down_proj.shape[0])
        if self.quantization_config.num_gpu_experts > experts:
            raise ValueError(f"num_gpu_experts {self.quantization_config.num_gpu_experts} exceeds "
                             f"{type(module).__name__}'s {experts} experts")

    def _check_sizes(self, module: torch.nn.Module) -> None:
        """``ValueError`` naming the class when the method cannot pack its experts' sizes (a
        group size that does not divide H or I, a GGUF block that does not fit a row)."""
        from kt_ops._native import _C
        from kt_ops.formats import GROUPED_FORMATS, default_group_size, format_for_method
        from kt_ops.gguf_types import check_row_lengths, gguf_type_ids

        config = self.quantization_config
        down = module.down_proj.shape
        hidden, intermediate = (int(down[2]), int(down[1])) if module.is_transposed else (int(down[1]), int(down[2]))
        try:
            fmt = format_for_method(config.method, config.zero_point)
            if fmt == "gguf":
                kind = "MXFP4" if config.method.upper() == "MXFP4" else config.gguf_type
                if kind is not None:
                    check_row_lengths(gguf_type_ids(kind), hidden, intermediate)
            else:
                group = 0
                if fmt in GROUPED_FORMATS:
                    group = config.group_size or default_group_size(config.method)
                _C.packed_nbytes(fmt, 1, hidden, intermediate, group)
        except ValueError as error:
            raise ValueError(f"{type(module).__name__} (H={hidden}, I={intermediate}) cannot be packed as "
                             f"{config.method}: {error}") from None

    def pack(self, module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        config = self.quantization_config
        experts = int(tensors["down_proj"].shape[0])
        mask = torch.arange(experts) < config.num_gpu_experts if config.num_gpu_experts else None
        hf_experts.pack_module_experts(module, tensors=tensors, gpu_experts_mask=mask, **config.pack_args())
        if self._bar is not None:
            self._bar.update()

    def _process_model_after_weight_loading(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        missing = [name for name, m in model.named_modules()
                   if hf_experts.is_experts_module(m) and hf_experts.packed_blob(m) is None]
        for name, module in model.named_modules():  # the experts kept in torch go where their layer went
            if hf_experts.is_experts_module(module) and hf_experts.local_experts(module) is not None:
                parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
                device = next((p.device for p in parent.parameters() if p.numel() and not p.is_meta), None)
                if device is not None:
                    hf_experts.move_local_experts(module, device)
        if missing:
            raise ValueError(f"the checkpoint did not provide every expert tensor of {', '.join(missing[:4])}"
                             f"{' ...' if len(missing) > 4 else ''} (gate_up_proj, down_proj and, with biases, "
                             "their biases): nothing was packed for them")
        return model

    def get_quantize_ops(self) -> KtOpsPack:
        return KtOpsPack(self)

    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return False
