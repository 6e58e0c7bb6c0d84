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

Float checkpoints (bf16/fp16/fp32) are quantized online into ``method``. A pre-quantized
checkpoint (FP8, GPTQ, AWQ, compressed-tensors, MXFP4: its config.json has a
``quantization_config``) loads with ``method="native"``: its experts are packed as they are
stored (:mod:`kt_ops.hf_native`), its quantized non-expert linears dequantized into the
model's dtype. transformers refuses a second quantization config for such a checkpoint;
importing this module wraps ``AutoHfQuantizer.merge_quantization_configs`` so that a
``KtOpsConfig`` given to ``from_pretrained`` takes the checkpoint's place (the checkpoint's
own is kept as ``KtOpsConfig.checkpoint_quantization``); any other pair goes to
transformers unchanged.
"""

from __future__ import annotations

import numbers
import os
from typing import Any

import torch
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AutoHfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name
from transformers.utils.quantization_config import QuantizationConfigMixin

from kt_ops import hf_experts
from kt_ops._validate import is_int, plain_int, require_bools
from kt_ops.mapped_files import release_file_pages

QUANT_METHOD = "kt_ops"
NATIVE = "native"
_PENDING = "_kt_ops_pending"


@register_quantization_config(QUANT_METHOD)
class KtOpsConfig(QuantizationConfigMixin):
    """How ``from_pretrained`` packs the routed experts.

    Packed experts live in host memory, so a ``device_map`` that puts an experts module on
    ``"disk"`` is a ``ValueError`` (experts read in place by ``"native"`` are memory-mapped
    from the checkpoint and may be mapped there).

    Args:
        method: a kt_ops method (``BF16``, ``AMXINT8``, ``AMXINT4``, ``LLAMAFILE``, ``FP8``,
            ``RAWINT4``, ...), as :func:`kt_ops.pack_experts`, or ``"native"``: the experts as
            the checkpoint stores them (FP8, INT4 and MXFP4 checkpoints read in place, float
            ones packed as ``BF16``); the only method a pre-quantized checkpoint accepts.
        group_size, gguf_type, scale_search, zero_point: as :func:`kt_ops.pack_experts` (not
            with ``"native"``: the checkpoint decides).
        num_gpu_experts: experts ``[0, n)`` of every layer are not packed but kept in torch
            on the device the layer's other weights load to (``device_map``), as
            :func:`kt_ops.hf_experts.pack_model_experts` keeps them.
        placement, gpu_budget, expert_stats: instead of ``num_gpu_experts``: the experts kept
            in torch chosen by SGLang's placement strategy (``uniform``, ``frequency``,
            ``front-loading``, ``random``; :func:`kt_ops.placement_masks`) for ``gpu_budget``
            GPU experts per MoE layer (int), a ratio of all routed experts (float in (0, 1])
            or GPU bytes (``"24GiB"``, divided by one expert's bytes in the model's dtype);
            ``expert_stats`` (counts ``[num_hidden_layers, E]``, an ExpertStats or a dump
            path) for ``frequency``.
        dynamic_gpu_experts: the experts kept in torch can move at run time
            (:func:`kt_ops.rebalance_gpu_experts`,
            :func:`kt_ops.hf_experts.update_local_experts`): every expert packed, host
            float weights kept (about one more copy of the experts in host RAM).
        gpu_prefill_token_threshold: calls of at least this many tokens on a GPU compute
            the packed experts there (:func:`kt_ops.set_gpu_prefill_token_threshold`; 0:
            never).
        progress: a tqdm bar over the MoE layers while loading.
    """

    def __init__(self, method: str = "BF16", group_size: int | None = None, gguf_type: Any = None,
                 scale_search: bool = False, zero_point: bool = False, num_gpu_experts: int = 0,
                 progress: bool = True, placement: str | None = None, gpu_budget: int | float | str | None = None,
                 expert_stats: Any = None, dynamic_gpu_experts: bool = False, gpu_prefill_token_threshold: int = 0,
                 **kwargs: Any) -> None:
        from kt_ops.gpu_prefill import checked_threshold
        from kt_ops.ops import check_pack_arguments

        if not isinstance(method, str):
            raise ValueError(f"method must be a string, got {method!r}")
        if method.lower() == NATIVE:
            given = [n for n, v in (("group_size", group_size), ("gguf_type", gguf_type), ("scale_search", scale_search),
                                    ("zero_point", zero_point)) if v]
            if given:
                raise ValueError(f"KtOpsConfig(method='native') keeps the checkpoint's own format; {', '.join(given)} "
                                 "cannot apply")
            method = NATIVE
        elif method.upper() == "LLAMAFILE" and gguf_type is None:
            raise ValueError("KtOpsConfig(method='LLAMAFILE') needs gguf_type, e.g. 'Q4_K' or ('Q4_K', 'Q4_K', 'Q6_K')")
        else:
            # ValueError naming the methods, or an argument the method does not take (before
            # any tensor loads: transformers would report it per tensor, as a RuntimeError)
            check_pack_arguments(method, group_size, zero_point, scale_search, gguf_type)
        self.quant_method = QUANT_METHOD
        self.method = method
        # numpy's integers as ints: both are saved to config.json
        self.group_size = plain_int(group_size)
        self.gguf_type = type(gguf_type)(map(plain_int, gguf_type)) if isinstance(gguf_type, (tuple, list)) \
            else plain_int(gguf_type)
        self.scale_search = scale_search
        self.zero_point = zero_point
        num_gpu_experts = plain_int(num_gpu_experts)  # numpy's too, as patch_model's (saved to config.json)
        if not is_int(num_gpu_experts) or num_gpu_experts < 0:
            raise ValueError(f"num_gpu_experts must be an int >= 0, got {num_gpu_experts!r}")
        self.num_gpu_experts = num_gpu_experts
        if placement is not None:
            from kt_ops.placement import STRATEGIES

            if placement not in STRATEGIES:
                raise ValueError(f"unknown placement strategy {placement!r}; choose one of {', '.join(STRATEGIES)}")
            if num_gpu_experts:
                raise ValueError("give placement= (with gpu_budget=) or num_gpu_experts, not both")
            if gpu_budget is None:
                raise ValueError(f"placement={placement!r} needs gpu_budget: GPU experts per MoE layer (int), a ratio "
                                 "of all routed experts (float in (0, 1]) or GPU bytes ('24GiB')")
        else:  # both were dropped silently: a model loaded with no GPU expert
            given = [n for n, v in (("gpu_budget", gpu_budget), ("expert_stats", expert_stats)) if v is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} apply with placement= (uniform, frequency, front-loading, "
                                 "random); give placement, or num_gpu_experts for the first n experts of each layer")
        require_bools(dynamic_gpu_experts=dynamic_gpu_experts, progress=progress)
        if dynamic_gpu_experts and not num_gpu_experts and placement is None:
            raise ValueError("dynamic_gpu_experts needs GPU experts to move: give num_gpu_experts or placement")
        self.dynamic_gpu_experts = dynamic_gpu_experts
        self.gpu_prefill_token_threshold = checked_threshold(gpu_prefill_token_threshold)
        self.placement = placement
        if isinstance(gpu_budget, numbers.Real) and not isinstance(gpu_budget, bool):
            # numpy's int64 / float32 as Python numbers: json.dumps (repr(model.config)) raised TypeError
            gpu_budget = int(gpu_budget) if isinstance(gpu_budget, numbers.Integral) else float(gpu_budget)
        self.gpu_budget = gpu_budget
        self.expert_stats = expert_stats
        self.progress = progress
        self.checkpoint_quantization: dict[str, Any] | None = kwargs.get("checkpoint_quantization")
        self.packed_methods: list[str] = []  # the methods the experts were packed in, once loaded

    def to_dict(self) -> dict[str, Any]:
        """transformers' dict of the config (its JSON: ``to_json_string``, ``repr(model.config)``),
        ``expert_stats`` as its path or as a short description of the :class:`kt_ops.ExpertStats`
        or counts tensor given (``json.dumps`` raised ``TypeError`` on those). The attribute
        itself keeps the object."""
        out = super().to_dict()
        out["expert_stats"] = _describe_stats(self.expert_stats)
        return out

    @property
    def native(self) -> bool:
        return self.method == NATIVE

    def pack_args(self) -> dict[str, Any]:
        """:func:`kt_ops.pack_experts`' keywords for float checkpoints (``native``: BF16)."""
        args: dict[str, Any] = {"method": "BF16" if self.native else self.method}
        for name in ("group_size", "gguf_type"):
            if getattr(self, name) is not None:
                args[name] = getattr(self, name)
        if self.scale_search:
            args["scale_search"] = True
        if self.zero_point:
            args["zero_point"] = True
        return args


def _describe_stats(stats: Any) -> str | None:
    """``expert_stats`` as JSON can hold it: None, a path as a string, else a description
    (``"ExpertStats counts [L, E]"``, ``"tensor torch.int64 [L, E]"``)."""
    from kt_ops.expert_stats import ExpertStats

    if stats is None or isinstance(stats, str):
        return stats
    if isinstance(stats, os.PathLike):
        return os.fspath(stats)
    if isinstance(stats, ExpertStats):
        return f"ExpertStats counts [{stats.num_hidden_layers}, {stats.num_experts}]"
    if isinstance(stats, torch.Tensor):
        return f"tensor {stats.dtype} {list(stats.shape)}"
    return repr(stats)


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


def _loaded_device(model: torch.nn.Module, name: str) -> torch.device:
    """The device of the first loaded (non-empty, non-meta) parameter of the modules
    enclosing ``name``, nearest first; the CPU when there is none."""
    parts = name.split(".")
    for end in range(len(parts) - 1, -1, -1):
        module = model.get_submodule(".".join(parts[:end])) if end else model
        device = next((p.device for p in module.parameters() if p.numel() and not p.is_meta), None)
        if device is not None:
            return device
    return torch.device("cpu")


@register_quantizer(QUANT_METHOD)
class KtOpsHfQuantizer(HfQuantizer):
    """Packs the routed experts of decorated experts classes while the checkpoint loads."""

    requires_calibration = False
    quantization_config: KtOpsConfig

    def __init__(self, quantization_config: KtOpsConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        # transformers calls a checkpoint pre-quantized when its config.json has any
        # quantization_config; one of kt_ops' own (a config saved from a model loaded with
        # KtOpsConfig) describes float weights to pack, as kt_ops never saves packed experts.
        # Only a foreign one (checkpoint_quantization, from the merge) is stored quantized.
        if self.pre_quantized and quantization_config.checkpoint_quantization is None:
            self.pre_quantized = False
        self._bar: Any = None
        self._dtype: torch.dtype | None = None
        self._native: tuple | None = None  # (checkpoint, {linear: kind}, device_map) while reading in place
        self._masks: dict[int, torch.Tensor] = {}  # id(experts module) -> bool [E] GPU experts (placement)
        self._packed_names: list[str] = []  # the experts modules packed as they load (not read in place)

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        config = self.quantization_config
        if self.pre_quantized and config.native:
            self._refuse_gpu_experts()
        self._refuse_disk(kwargs.get("device_map"))  # the inferred map of device_map="auto" comes here too

    def _refuse_disk(self, device_map: Any) -> None:
        """``ValueError`` when ``device_map`` (a dict) puts an experts module kt_ops packs on
        ``"disk"``: the packed experts live in host memory, and accelerate's offload would
        look for the emptied expert parameters on disk at the first forward."""
        if not isinstance(device_map, dict) or "disk" not in device_map.values():
            return

        def placed(name: str) -> Any:
            keys = [k for k in device_map if k == "" or name == k or name.startswith(f"{k}.")]
            return device_map[max(keys, key=len)] if keys else None

        on_disk = [name for name in self._packed_names if placed(name) == "disk"]
        if on_disk:
            raise ValueError(f"device_map puts {', '.join(on_disk[:4])}{' ...' if len(on_disk) > 4 else ''} on 'disk'; "
                             "KtOpsConfig packs the routed experts into host memory, so they cannot be offloaded to "
                             "disk: map them to 'cpu'")

    def _refuse_gpu_experts(self) -> None:
        config = self.quantization_config
        if config.num_gpu_experts or config.placement is not None:
            raise ValueError("KtOpsConfig(method='native') with GPU experts (num_gpu_experts / placement) is not "
                             "supported: experts kept in torch would need the checkpoint's quantized experts "
                             "dequantized; leave them out (or use kt_ops.KTMoEWrapper, whose GPU experts are the "
                             "caller's)")

    def _in_place_checkpoint(self, model: torch.nn.Module, checkpoint_files: list[str] | None) -> Any:
        """The checkpoint kt_ops reads the experts from (an ``HfCheckpoint``), or None when
        transformers' loader reads them: ``method="native"`` on a pre-quantized checkpoint, or
        on one whose experts are stored quantized although transformers did not recognise its
        quantization config. ``ValueError`` for a pre-quantized load without files."""
        if not self.quantization_config.native:
            return None
        from pathlib import Path

        from kt_ops import hf_native
        from kt_ops.hf_checkpoint import HfCheckpoint

        if self.pre_quantized:  # GPU experts were refused in validate_environment
            if not checkpoint_files:
                raise ValueError("KtOpsConfig(method='native') reads the experts from the checkpoint's safetensors "
                                 "files; from_pretrained was given none (a state_dict?)")
            return HfCheckpoint(Path(checkpoint_files[0]).parent)
        if not checkpoint_files or not str(checkpoint_files[0]).endswith(".safetensors"):
            return None
        checkpoint = HfCheckpoint(Path(checkpoint_files[0]).parent)
        names = [name for name, m in model.named_modules() if hf_experts.is_experts_module(m)]
        if not names:
            return None
        try:
            quantized = hf_native.native_method(checkpoint, hf_native.layer_of(names[0])) != "BF16"
        except (KeyError, ValueError):
            return None  # no experts under a name kt_ops reads: transformers' loader decides
        if quantized:
            self._refuse_gpu_experts()
        return checkpoint if quantized else None

    def preprocess_model(self, model: torch.nn.Module, dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        self._dtype = dtype
        super().preprocess_model(model, dtype=dtype, **kwargs)

    def param_needs_quantization(self, model: torch.nn.Module, param_name: str, **kwargs: Any) -> bool:
        module, name = get_module_from_name(model, param_name)
        return name in hf_experts.EXPERT_TENSORS and hf_experts.is_experts_module(module)

    def _process_model_before_weight_loading(self, model: torch.nn.Module, **kwargs: Any) -> None:
        hf_experts.set_layer_ids(model)
        experts = [m for m in model.modules() if hf_experts.is_experts_module(m)]
        checkpoint = self._in_place_checkpoint(model, kwargs.get("checkpoint_files"))
        if checkpoint is not None:
            with torch.device("cpu"):  # transformers builds the model under a meta-device context
                self._read_in_place(model, checkpoint, kwargs.get("device_map"))
            return
        if not experts:  # it loaded whole in its float dtype, nothing packed, silently
            model_type = getattr(getattr(model, "config", None), "model_type", None)
            raise ValueError(f"KtOpsConfig: {type(model).__name__} has no experts class using transformers' experts "
                             f"interface (model_type {model_type!r}): kt_ops would pack nothing; see "
                             "kt_ops.wrappers.supported_model_types()")
        for module in experts:  # before any tensor is read
            hf_experts.check_supported(module)
            self._check_sizes(module)
            self._check_gpu_experts(module)
        self._packed_names = [name for name, m in model.named_modules() if hf_experts.is_experts_module(m)]
        self._refuse_disk(kwargs.get("device_map"))
        with torch.device("cpu"):  # transformers builds the model under a meta-device context
            self._masks = self._placement(model)
        model.set_experts_implementation(hf_experts.IMPLEMENTATION)
        self.quantization_config.packed_methods = [self.quantization_config.pack_args()["method"]]
        if self.quantization_config.progress and experts:
            from tqdm import tqdm

            self._bar = tqdm(total=len(experts), desc=f"kt_ops: packing experts ({self.quantization_config.pack_args()['method']})",
                             unit=" layers")

    def _read_in_place(self, model: torch.nn.Module, checkpoint: Any, device_map: dict | None) -> None:
        """``method="native"`` on a pre-quantized checkpoint: every experts module packed from
        the files now (its parameters removed, so transformers neither reads nor expects the
        experts); quantized non-expert linears' weights removed too, dequantized after loading."""
        from kt_ops import hf_native

        experts = [(name, m) for name, m in model.named_modules() if hf_experts.is_experts_module(m)]
        for name, module in experts:
            hf_experts.check_supported(module)
        linears = hf_native.quantized_linears(model, checkpoint, tuple(name for name, _ in experts))
        bar = None
        if self.quantization_config.progress and experts:
            from tqdm import tqdm

            bar = tqdm(total=len(experts), desc="kt_ops: reading experts in place", unit=" layers")
        methods = set()
        try:
            for name, module in experts:
                layer = hf_native.layer_of(name)
                try:
                    methods.add(hf_native.pack_native_layer(checkpoint, layer, module))
                except (KeyError, ValueError) as error:
                    raise ValueError(f"{name} (layer {layer}): {error}") from None
                hf_native.remove_parameters(module, hf_experts.EXPERT_TENSORS)
                if bar is not None:
                    bar.update()
        finally:
            if bar is not None:
                bar.close()
        for name in linears:
            hf_native.remove_parameters(model.get_submodule(name), ("weight",))
        self._native = (checkpoint, linears, device_map)
        self.quantization_config.packed_methods = sorted(methods)
        ignore = set(model._keys_to_ignore_on_load_unexpected or ())
        model._keys_to_ignore_on_load_unexpected = ignore | hf_native.ignore_patterns(
            [name for name, _ in experts], list(linears))
        model.set_experts_implementation(hf_experts.IMPLEMENTATION)

    def _dequantize_linears(self, model: torch.nn.Module) -> None:
        """The quantized non-expert linears (:meth:`_read_in_place`), dequantized into the
        model's dtype on the device ``device_map`` gives them (a dict), else (``"auto"``,
        ``"cpu"``, a device: the map as given, before transformers expands it) where the
        nearest enclosing module's loaded weights went."""
        from transformers.integrations.accelerate import get_device

        from kt_ops import hf_native

        checkpoint, linears, device_map = self._native
        for name, kind in linears.items():
            module = model.get_submodule(name)
            weight = hf_native.dequantize_linear(checkpoint, name, kind, module.out_features, module.in_features)
            dtype = module.bias.dtype if module.bias is not None else (self._dtype or torch.get_default_dtype())
            if isinstance(device_map, dict):
                device = get_device(device_map, f"{name}.weight", valid_torch_device=True)
            else:  # a string map raised AttributeError in transformers' get_device
                device = _loaded_device(model, name)
            module.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)

    def _placement(self, model: torch.nn.Module) -> dict[int, torch.Tensor]:
        """``{id(experts module): bool [E]}`` of ``KtOpsConfig(placement=...)``, or empty."""
        config = self.quantization_config
        if config.placement is None:
            return {}
        from kt_ops.placement import model_masks

        experts = [(name, m) for name, m in model.named_modules() if hf_experts.is_experts_module(m)]
        if not experts:
            return {}
        first = experts[0][1]
        masks = model_masks(model, [name for name, _ in experts], config.placement, config.gpu_budget,
                            int(first.down_proj.shape[0]), hf_experts.expert_nbytes(first), config.expert_stats)
        return {id(module): mask for (_, module), mask in zip(experts, masks)}

    def _check_gpu_experts(self, module: torch.nn.Module) -> None:
        experts = int(module.down_proj.shape[0])
        if self.quantization_config.num_gpu_experts > experts:
            raise ValueError(f"num_gpu_experts {self.quantization_config.num_gpu_experts} exceeds "
                             f"{type(module).__name__}'s {experts} experts")

    def _check_sizes(self, module: torch.nn.Module) -> None:
        """``ValueError`` naming the class when the method cannot pack its experts' sizes (a
        group size that does not divide H or I, a GGUF block that does not fit a row)."""
        from kt_ops._native import _C
        from kt_ops.formats import GROUPED_FORMATS, default_group_size, format_for_method, format_info
        from kt_ops.gguf_types import check_row_lengths, gguf_type_ids

        config = self.quantization_config
        down = module.down_proj.shape
        hidden, intermediate = (int(down[2]), int(down[1])) if module.is_transposed else (int(down[1]), int(down[2]))
        method = config.pack_args()["method"]
        try:
            fmt = format_for_method(method, config.zero_point)
            if fmt == "gguf":
                if config.gguf_type is not None:
                    check_row_lengths(gguf_type_ids(config.gguf_type), hidden, intermediate)
            else:
                group = 0
                if fmt in GROUPED_FORMATS:  # a format of one group size (mxfp4: 32) takes only it
                    sizes = format_info(fmt).group_sizes
                    group = sizes[0] if len(sizes) == 1 else config.group_size or default_group_size(method)
                _C.packed_nbytes(fmt, 1, hidden, intermediate, group)
        except ValueError as error:
            raise ValueError(f"{type(module).__name__} (H={hidden}, I={intermediate}) cannot be packed as "
                             f"{method}: {error}") from None

    def pack(self, module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        config = self.quantization_config
        experts = int(tensors["down_proj"].shape[0])
        mask = self._masks.get(id(module))
        if mask is None and config.num_gpu_experts:
            mask = torch.arange(experts) < config.num_gpu_experts
        hf_experts.pack_module_experts(module, tensors=tensors, gpu_experts_mask=mask,
                                       dynamic=config.dynamic_gpu_experts, **config.pack_args())
        hf_experts.refuse_released_on_load(module)  # its expert tensors become empty placeholders (KtOpsPack)
        if self._bar is not None:
            self._bar.update()

    def _process_model_after_weight_loading(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        if self.quantization_config.gpu_prefill_token_threshold:
            from kt_ops.gpu_prefill import set_gpu_prefill_token_threshold

            set_gpu_prefill_token_threshold(model, self.quantization_config.gpu_prefill_token_threshold)
        if self._native is not None:
            self._dequantize_linears(model)
            self._native = None
            return model
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


_merge = AutoHfQuantizer.merge_quantization_configs.__func__


def _merge_quantization_configs(cls: type, quantization_config: Any, quantization_config_from_args: Any) -> Any:
    """transformers' merge of the checkpoint's quantization config with the one given to
    ``from_pretrained``, except for a :class:`KtOpsConfig`: ``method="native"`` takes the
    checkpoint's place (which it reads as stored), any other method is refused (kt_ops
    would re-quantize weights already quantized)."""
    if not isinstance(quantization_config_from_args, KtOpsConfig):
        return _merge(cls, quantization_config, quantization_config_from_args)
    stored = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    if isinstance(quantization_config, KtOpsConfig) or stored.get("quant_method") == QUANT_METHOD:
        return quantization_config_from_args
    if not quantization_config_from_args.native:
        raise ValueError(f"this checkpoint is already quantized (quant_method {stored.get('quant_method')!r} in its "
                         f"config.json); KtOpsConfig(method={quantization_config_from_args.method!r}) would "
                         "re-quantize it. Use KtOpsConfig(method='native') to run its experts as stored")
    quantization_config_from_args.checkpoint_quantization = stored
    return quantization_config_from_args


AutoHfQuantizer.merge_quantization_configs = classmethod(_merge_quantization_configs)
