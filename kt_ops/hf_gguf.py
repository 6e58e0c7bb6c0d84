"""GGUF models as transformers models whose routed experts stay in the file: :func:`from_gguf`.

transformers builds the model from the GGUF metadata and dequantizes the tensors it knows
(attention, norms, embeddings, routers, shared experts); the routed-expert tensors
(``blk.{L}.ffn_{gate,up,down}_exps``) are never read by it — kt_ops maps each layer's
blocks in place (:func:`kt_ops.load_gguf_experts`: no copy, every GGUF type kt_ops
computes, watched for changes on disk) and runs them through ``experts_implementation=
"kt_ops"`` (:mod:`kt_ops.hf_experts`). The activation is the experts class's own (probed),
gpt-oss GGUFs bring their expert biases. Architectures: those transformers' GGUF loader
reads (``qwen2moe``, ``qwen3moe``, ``gpt-oss``, ``minimax-m2``, ...), single-file GGUFs.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any, Iterator

import torch

from kt_ops import hf_experts
from kt_ops._optional import require_transformers
from kt_ops.gguf_loader import gguf_files, load_gguf_expert_biases, load_gguf_experts, open_gguf, read_gguf_config
from kt_ops.ops import set_activation

_EXPERT_TENSOR = re.compile(r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.")
_SINKS = re.compile(r"^blk\.\d+\.attn_sinks\.weight$")
# Sizes in a GGUF's metadata that transformers' mapping misses for some architectures, and
# the config attribute each sets (where the config class has it).
_UNMAPPED_KEYS = (("expert_shared_feed_forward_length", "shared_expert_intermediate_size"),
                  ("attention.key_length", "head_dim"), ("attention.sliding_window", "sliding_window"))


@contextlib.contextmanager
def _without_expert_tensors() -> Iterator[None]:
    """While active, ``gguf.GGUFReader`` lists no routed-expert tensors (transformers' GGUF
    loader then neither dequantizes nor holds them), and gpt-oss's ``blk.N.attn_sinks.weight``
    (llama.cpp's name) as the ``blk.N.attn_sinks`` transformers maps to ``self_attn.sinks``."""
    import gguf

    original = gguf.GGUFReader

    class Reader(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.tensors = [t._replace(name=t.name.removesuffix(".weight")) if _SINKS.match(t.name) else t
                            for t in self.tensors if not _EXPERT_TENSOR.match(t.name)]

    gguf.GGUFReader = Reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


@contextlib.contextmanager
def _without_rope_scaling() -> Iterator[None]:
    """While active, ``gguf.GGUFReader`` lists no ``*.rope.scaling.*`` metadata: transformers'
    GGUF config reader takes gpt-oss's from a field's first part (its key's length, an array)
    and raised ``TypeError`` on every gpt-oss GGUF llama.cpp writes (:func:`from_gguf` sets them)."""
    import gguf

    original = gguf.GGUFReader

    class Reader(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.fields = type(self.fields)((k, v) for k, v in self.fields.items() if ".rope.scaling." not in k)

    gguf.GGUFReader = Reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def from_gguf(path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A transformers causal LM from a GGUF file (or a directory holding one) whose routed
    experts run from the mapped file through ``kt::moe_forward``.

    ``dtype``: the dequantized non-expert weights' dtype. Raises ``ValueError`` for a GGUF
    transformers cannot read, a split GGUF, or a model without experts kt_ops can compute
    (naming what is wrong); ``ImportError`` (naming what to install) without transformers v5.
    """
    transformers = require_transformers("kt_ops.from_gguf")
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    files = gguf_files(path)
    if len(files) != 1:
        raise ValueError(f"{path}: from_gguf reads single-file GGUFs; this model is split into {len(files)} files")
    file = Path(files[0])
    info = read_gguf_config(file)
    fields = open_gguf(file).fields
    with _without_rope_scaling():
        config = transformers.AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    scaling = fields.get(f"{info.architecture}.rope.scaling.type")
    rope = getattr(config, "rope_parameters", None)
    if scaling is not None and scaling.contents() != "none" and isinstance(rope, dict):
        rope["rope_type"] = scaling.contents()  # the class's other YaRN defaults (gpt-oss: truncate False) stay
        for key, name, kind in (("factor", "factor", float),
                                ("original_context_length", "original_max_position_embeddings", int)):
            if f"{info.architecture}.rope.scaling.{key}" in fields:
                rope[name] = kind(fields[f"{info.architecture}.rope.scaling.{key}"].contents())
    if info.moe_intermediate_size is not None and hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = info.moe_intermediate_size  # transformers' mapping misses it for some archs
    for key, attribute in _UNMAPPED_KEYS:  # else the config class's defaults (qwen2moe's shared expert: 5632)
        field = fields.get(f"{info.architecture}.{key}")
        if field is not None and hasattr(config, attribute):
            setattr(config, attribute, int(field.contents()))
    with no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    experts: dict[int, tuple[str, torch.nn.Module]] = {}
    hf_experts.set_layer_ids(model)
    for name, module in model.named_modules():
        if hf_experts.is_experts_module(module):
            layer = hf_experts.layer_index(name)
            if layer is None:
                raise ValueError(f"{name}: cannot tell which GGUF block (blk.N) this experts module is")
            hf_experts.check_supported(module)
            experts[layer] = (name, module)
            hf_experts.release_weights(module)  # never touched: released before the weights load
    if not experts:
        raise ValueError(f"{type(model).__name__} has no experts class using transformers' experts interface")
    with _without_rope_scaling(), _without_expert_tensors():
        tensors = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=model, torch_dtype=dtype)["tensors"]
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except RuntimeError as error:  # a tensor of another shape than the config gives (torch: RuntimeError)
        raise ValueError(f"{file.name}: the GGUF does not match the {config.model_type} model transformers built: "
                         f"{error}") from None
    expert_params = {f"{name}.{t}" for name, _ in experts.values()
                     for t in hf_experts.EXPERT_TENSORS}
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    other = sorted(set(missing) - expert_params - tied)
    if other or unexpected:
        raise ValueError(f"{file.name}: the GGUF does not match the {config.model_type} model transformers built: "
                         f"missing {other[:6]}, unexpected {sorted(unexpected)[:6]}")
    if tied:
        model.tie_weights()
    gpt_oss = info.architecture == "gpt-oss"
    for layer, (_, module) in sorted(experts.items()):
        packed = load_gguf_experts(file, layer)
        limit, alpha = hf_experts.activation_of(module, packed.intermediate_size)
        biases = load_gguf_expert_biases(file, layer) if gpt_oss else None
        if limit or alpha or (biases is not None and any(b is not None for b in biases)):
            packed = set_activation(packed, limit, alpha, biases)  # a resident copy with the activation
        hf_experts.install_blob(module, packed.data)
    model.set_experts_implementation(hf_experts.IMPLEMENTATION)
    return model.eval()
