"""Fake (meta) implementations of every ``torch.ops.kt`` operator, one per schema.

``TORCH_LIBRARY(kt, m)`` names this module with ``set_python_module``; a test checks
that the schemas and the fakes match one to one. Fakes compute output shapes and dtypes
only, so ``torch.compile`` and FakeTensor tracing never touch the data.
"""

import torch

from kt_ops._native import _C
from kt_ops.formats import GROUP_SIZES, format_info

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_IDS = (torch.int32, torch.int64)
_MAX_DIM = 1 << 31  # the kernels' bound on E, I and H


def _check_tensor(t: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple | int | None,
                  dtype_error: type[Exception] = TypeError) -> None:
    """The kernels' dtype and shape checks (``csrc/ops/checks.cpp``): ``dtype_error``
    (the kernel's: ``TypeError`` from check_dtype) naming ``name`` for a dtype outside
    ``dtypes``, ``ValueError`` for a shape other than ``shape`` (an int: a rank; None:
    any shape)."""
    if t.dtype not in dtypes:
        raise dtype_error(f"{name} must have dtype {', '.join(map(str, dtypes))}; got {t.dtype}")
    if isinstance(shape, int) and t.dim() != shape:
        raise ValueError(f"{name} must be {shape}-D; got shape {list(t.shape)}")
    if isinstance(shape, tuple) and tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)}; got {list(t.shape)}")


def _check_sizes(gate_proj: torch.Tensor, E: int, I: int, H: int) -> None:
    if not all(0 < n < _MAX_DIM for n in (E, I, H)):
        raise ValueError(f"expert weights need E, I, H in [1, 2^31); got gate_proj {list(gate_proj.shape)}")


def _check_expert_weights(gate_proj: torch.Tensor, up_proj: torch.Tensor,
                          down_proj: torch.Tensor) -> tuple[int, int, int]:
    """(E, I, H) of float gate_proj, up_proj [E, I, H] and down_proj [E, H, I]: the
    kernel's check_expert_weights (pack_experts_cpu.cpp), the same errors."""
    for name, t in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
        _check_tensor(t, name, _FLOATS, 3)
    E, I, H = (int(n) for n in gate_proj.shape)
    _check_tensor(up_proj, "up_proj", _FLOATS, (E, I, H))
    _check_tensor(down_proj, "down_proj", _FLOATS, (E, H, I))
    _check_sizes(gate_proj, E, I, H)
    return E, I, H


def _check_meta(source_name: str, source: torch.Tensor, **others: torch.Tensor | list[torch.Tensor] | None) -> None:
    """``ValueError`` when one of ``others`` is on the meta device but ``source`` (the
    tensor the outputs are made like) is not. Such a call dispatches to these fakes (the
    Meta key wins over CPU and CUDA), which would return uninitialized memory on
    ``source``'s device as if it were the result; all-meta calls and FakeTensors (never
    ``is_meta``) pass."""
    if source.is_meta:
        return
    for name, value in others.items():
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                raise ValueError(f"{name} is on the meta device (a shape without values) but {source_name} is on "
                                 f"{source.device}: load its values first (from_pretrained, or to_empty() + "
                                 "load_state_dict)")


def _check_slot_rows(t: torch.Tensor, name: str, topk_ids: torch.Tensor, dtypes: tuple[torch.dtype, ...],
                     intermediate_size: int | torch.SymInt | None = None) -> None:
    """The kernel's check_slot_rows (moe_call.cpp): ``t`` of ``dtypes`` (``TypeError``)
    and ``[T, K, 2 * I]`` (``ValueError``), both naming ``name``. I is
    ``intermediate_size`` where the caller knows it (an argument, a LoRA matrix's size);
    else it is in the blob's header, which a fake cannot read: the last size must be even
    and positive."""
    _check_tensor(t, name, dtypes, 3)
    T, K, two_i = topk_ids.shape[0], topk_ids.shape[1], t.shape[2]
    want = "2 * I" if intermediate_size is None else 2 * intermediate_size
    checks = [t.shape[0] == T, t.shape[1] == K, two_i % 2 == 0, two_i > 0]
    if intermediate_size is not None:
        checks.append(two_i == 2 * intermediate_size)
    for ok in checks:
        torch._check_value(ok, lambda: f"{name} must be [T, K, 2 * I] = [{T}, {K}, {want}]; got {list(t.shape)}")


def _check_same_shape(t: torch.Tensor, name: str, like: torch.Tensor, like_name: str) -> None:
    """``ValueError`` naming ``name`` unless ``t`` has ``like``'s shape, one size at a time
    (each a symbolic-friendly ``torch._check_value``)."""
    message = lambda: f"{name} must have the shape of {like_name} {list(like.shape)}; got {list(t.shape)}"  # noqa: E731
    torch._check_value(t.dim() == like.dim(), message)
    for a, b in zip(t.shape, like.shape):
        torch._check_value(a == b, message)


def _check_moe_call(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    packed: torch.Tensor, packed_name: str = "packed") -> None:
    """The kernel's check_moe_call (moe_call.cpp) as far as shapes and dtypes go, in its
    order: the dtypes (``TypeError``), the ranks, topk_weights' shape and the token count
    (``ValueError``), then read_packed's uint8 (``TypeError``), 1-D and contiguous
    (``ValueError``) ``packed_name``. H, E and the ids' values are in the blob, which a fake
    cannot read."""
    _check_tensor(hidden_states, "hidden_states", _FLOATS, None)
    _check_tensor(topk_ids, "topk_ids", _IDS, None)
    _check_tensor(topk_weights, "topk_weights", _FLOATS, None)
    _check_tensor(hidden_states, "hidden_states", _FLOATS, 2)
    _check_tensor(topk_ids, "topk_ids", _IDS, 2)
    _check_same_shape(topk_weights, "topk_weights", topk_ids, "topk_ids")
    torch._check_value(
        topk_ids.shape[0] == hidden_states.shape[0],
        lambda: f"topk_ids has {topk_ids.shape[0]} rows but hidden_states has {hidden_states.shape[0]} tokens",
    )
    _check_tensor(packed, packed_name, (torch.uint8,), 1)
    _check_contiguous(**{packed_name: packed})


def _check_contiguous(**tensors: torch.Tensor) -> None:
    """The kernels' check_cpu_contiguous (checks.cpp; the CUDA kernel's check too):
    ``ValueError`` naming the first of ``tensors`` that is not contiguous, so a traced call
    fails where the eager one does rather than when the compiled graph first runs."""
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous; got strides {list(t.stride())} for shape {list(t.shape)} "
                             "(call .contiguous())")


def _check_live_tokens(live_tokens: torch.Tensor | None) -> None:
    """The kernel's check_live_tokens (moe_call.cpp): int32 or int64 (``TypeError``), one
    value (``ValueError``). Its value is data, checked by the kernel only."""
    if live_tokens is None:
        return
    _check_tensor(live_tokens, "live_tokens", _IDS, None)
    torch._check_value(
        live_tokens.numel() == 1,
        lambda: f"live_tokens must hold one value (the live batch size); got shape {list(live_tokens.shape)}",
    )


def _moe_call_fake(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   packed: torch.Tensor, live_tokens: torch.Tensor | None, contiguous: bool) -> torch.Tensor:
    """The checks every MoE operator makes of its call, and its contiguous ``[T, H]``
    output. ``contiguous``: ``hidden_states``, ``topk_ids`` and ``topk_weights`` must be
    contiguous (the inference kernels' check: moe_forward, moe_forward_train); the backward
    and LoRA kernels (moe_train_cpu.cpp) make them contiguous themselves and take any
    strides."""
    _check_meta("hidden_states", hidden_states, topk_ids=topk_ids, topk_weights=topk_weights, packed=packed,
                live_tokens=live_tokens)
    _check_moe_call(hidden_states, topk_ids, topk_weights, packed)
    _check_live_tokens(live_tokens)
    if contiguous:
        _check_contiguous(hidden_states=hidden_states, topk_ids=topk_ids, topk_weights=topk_weights)
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


@torch.library.register_fake("kt::moe_forward")
def _moe_forward_fake(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: torch.Tensor,
    live_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    return _moe_call_fake(hidden_states, topk_ids, topk_weights, packed, live_tokens, contiguous=True)


@torch.library.register_fake("kt::moe_forward_parts")
def _moe_forward_parts_fake(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    parts: list[torch.Tensor],
    nodes: list[int],
) -> torch.Tensor:
    _check_meta("hidden_states", hidden_states, topk_ids=topk_ids, topk_weights=topk_weights, parts=list(parts))
    # The kernel's check_moe_parts (moe_call.cpp), the same ValueErrors and TypeErrors.
    if len(parts) < 1:
        raise ValueError("parts must hold at least one packed blob")
    if len(nodes) != len(parts):
        raise ValueError(f"nodes has {len(nodes)} entries but parts has {len(parts)} (one NUMA node id per part)")
    for p, (part, node) in enumerate(zip(parts, nodes)):
        _check_moe_call(hidden_states, topk_ids, topk_weights, part, f"parts[{p}]")
        if not 0 <= node < (1 << 30):
            raise ValueError(f"nodes[{p}] = {node} is not a NUMA node id")
    _check_contiguous(hidden_states=hidden_states, topk_ids=topk_ids, topk_weights=topk_weights)
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


@torch.library.register_fake("kt::pack_experts")
def _pack_experts_fake(
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    format: str,
    group_size: int = 0,
    scale_search: bool = False,
) -> torch.Tensor:
    _check_meta("gate_proj", gate_proj, up_proj=up_proj, down_proj=down_proj)
    info = format_info(format)
    if info.k_rule == "ggml_block":
        raise ValueError(f"format {format} needs a ggml type per matrix: use kt::pack_gguf_experts")
    experts, intermediate, hidden = _check_expert_weights(gate_proj, up_proj, down_proj)
    if group_size not in (0, *GROUP_SIZES):
        raise ValueError(f"group_size must be 0 (none) or one of {GROUP_SIZES}; got {group_size}")
    if scale_search and not info.scale_search:
        raise ValueError(f"scale_search applies to quantized formats, not {format}")
    nbytes = _C.packed_nbytes(format, experts, hidden, intermediate, int(group_size))
    return gate_proj.new_empty((nbytes,), dtype=torch.uint8)


@torch.library.register_fake("kt::pack_gguf_experts")
def _pack_gguf_experts_fake(
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gguf_types: list[int],
) -> torch.Tensor:
    _check_meta("gate_proj", gate_proj, up_proj=up_proj, down_proj=down_proj)
    experts, intermediate, hidden = _check_expert_weights(gate_proj, up_proj, down_proj)
    nbytes = _C.gguf_packed_nbytes(list(gguf_types), experts, hidden, intermediate)
    return gate_proj.new_empty((nbytes,), dtype=torch.uint8)


@torch.library.register_fake("kt::pack_fp8_experts")
def _pack_fp8_experts_fake(
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_scale: torch.Tensor,
    up_scale: torch.Tensor,
    down_scale: torch.Tensor,
    format: str,
) -> torch.Tensor:
    _check_meta("gate_proj", gate_proj, up_proj=up_proj, down_proj=down_proj, gate_scale=gate_scale,
                up_scale=up_scale, down_scale=down_scale)
    info = format_info(format)
    if info.packer != "pack_fp8_experts":
        raise ValueError(f"kt::pack_fp8_experts packs the FP8 formats (fp8, fp8_perchannel, mxfp8), not {format}: "
                         "use kt::pack_experts")
    if gate_proj.dim() != 3:
        raise ValueError(f"gate_proj must be [E, I, H]; got {list(gate_proj.shape)}")
    E, I, H = (int(n) for n in gate_proj.shape)
    _check_sizes(gate_proj, E, I, H)
    for m, (N, K) in enumerate(((I, H), (I, H), (H, I))):
        name, scale_name = ("gate_proj", "up_proj", "down_proj")[m], ("gate_scale", "up_scale", "down_scale")[m]
        weight, scale = (gate_proj, up_proj, down_proj)[m], (gate_scale, up_scale, down_scale)[m]
        _check_tensor(weight, name, (torch.float8_e4m3fn, torch.uint8), (E, N, K), ValueError)
        groups = -(-K // info.scale_group_k) if info.scale_group_k else 1
        if format == "mxfp8":
            _check_tensor(scale, scale_name, (torch.uint8, torch.float8_e8m0fnu), (E, N, groups), ValueError)
            continue
        if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"{scale_name} of format {format} must be a float tensor (float32, bfloat16, float16 "
                             f"or float64); got {scale.dtype}")
        # fp8: [E, ceil(N / 128), G] blocks or [E, N, G] rows; fp8_perchannel: [E, N] or [E, N, 1].
        shapes = [(E, -(-N // info.scale_group_k), groups), (E, N, groups)] if format == "fp8" else [(E, N), (E, N, 1)]
        if tuple(scale.shape) not in shapes:
            raise ValueError(f"{scale_name} of format {format} must be one of {' or '.join(map(str, shapes))} for "
                             f"{name} [{E}, {N}, {K}]; got {list(scale.shape)}")
    nbytes = _C.packed_nbytes(format, E, H, I, 0)
    return gate_proj.new_empty((nbytes,), dtype=torch.uint8)


@torch.library.register_fake("kt::pack_int4_experts")
def _pack_int4_experts_fake(
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_scale: torch.Tensor,
    up_scale: torch.Tensor,
    down_scale: torch.Tensor,
    gate_min: torch.Tensor | None,
    up_min: torch.Tensor | None,
    down_min: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    _check_meta("gate_proj", gate_proj, up_proj=up_proj, down_proj=down_proj, gate_scale=gate_scale,
                up_scale=up_scale, down_scale=down_scale, gate_min=gate_min, up_min=up_min, down_min=down_min)
    minimums = (gate_min, up_min, down_min)
    given = sum(m is not None for m in minimums)
    if given not in (0, 3):
        raise ValueError(f"give all three of gate_min, up_min, down_min (int4_asym) or none (int4); got {given}")
    for name, t in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
        _check_tensor(t, name, (torch.uint8,), 3)
    E, I, H = int(gate_proj.shape[0]), int(gate_proj.shape[1]), 2 * int(gate_proj.shape[2])
    _check_sizes(gate_proj, E, I, H)
    if tuple(down_proj.shape[:2]) != (E, H) or 2 * int(down_proj.shape[2]) != I:
        raise ValueError(f"down_proj must be [E, H, I / 2] = [{E}, {H}, {I / 2:g}] to match gate_proj "
                         f"{list(gate_proj.shape)}; got {list(down_proj.shape)}")
    _check_tensor(up_proj, "up_proj", (torch.uint8,), tuple(gate_proj.shape))
    if not 0 < group_size < _MAX_DIM:
        raise ValueError(f"group_size must be positive; got {group_size}")
    nbytes = _C.packed_nbytes("int4_asym" if given else "int4", E, H, I, int(group_size))
    for m, (N, K) in enumerate(((I, H), (I, H), (H, I))):
        for names, tensor in ((("gate_scale", "up_scale", "down_scale"), (gate_scale, up_scale, down_scale)[m]),
                              (("gate_min", "up_min", "down_min"), minimums[m])):
            if tensor is not None:
                _check_tensor(tensor, names[m], _FLOATS, (E, N, K // group_size))
    return gate_proj.new_empty((nbytes,), dtype=torch.uint8)


@torch.library.register_fake("kt::pack_int8_experts")
def _pack_int8_experts_fake(
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_scale: torch.Tensor,
    up_scale: torch.Tensor,
    down_scale: torch.Tensor,
) -> torch.Tensor:
    _check_meta("gate_proj", gate_proj, up_proj=up_proj, down_proj=down_proj, gate_scale=gate_scale,
                up_scale=up_scale, down_scale=down_scale)
    for name, t in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
        _check_tensor(t, name, (torch.int8,), 3)
    E, I, H = (int(n) for n in gate_proj.shape)
    _check_sizes(gate_proj, E, I, H)
    _check_tensor(up_proj, "up_proj", (torch.int8,), tuple(gate_proj.shape))
    if tuple(down_proj.shape) != (E, H, I):
        raise ValueError(f"down_proj must be [E, H, I] = [{E}, {H}, {I}] to match gate_proj {list(gate_proj.shape)}; "
                         f"got {list(down_proj.shape)}")
    for name, scale, rows in (("gate_scale", gate_scale, I), ("up_scale", up_scale, I), ("down_scale", down_scale, H)):
        _check_tensor(scale, name, _FLOATS, (E, rows))
    return gate_proj.new_empty((_C.packed_nbytes("int8", E, H, I, 0),), dtype=torch.uint8)


@torch.library.register_fake("kt::moe_backward")
def _moe_backward_fake(
    grad_output: torch.Tensor,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: torch.Tensor,
    live_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_meta("hidden_states", hidden_states, grad_output=grad_output)
    _moe_call_fake(hidden_states, topk_ids, topk_weights, packed, live_tokens, contiguous=False)
    # The kernel's backward() (moe_train_cpu.cpp): a ValueError for both.
    _check_same_shape(grad_output, "grad_output", hidden_states, "hidden_states")
    _check_tensor(grad_output, "grad_output", _FLOATS, None, ValueError)
    return (torch.empty_like(hidden_states, memory_format=torch.contiguous_format),
            torch.empty_like(topk_weights, memory_format=torch.contiguous_format))


@torch.library.register_fake("kt::moe_forward_train")
def _moe_forward_train_fake(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: torch.Tensor,
    intermediate_size: int,
    gate_up_delta: torch.Tensor | None = None,
    live_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_meta("hidden_states", hidden_states, gate_up_delta=gate_up_delta)
    out = _moe_forward_fake(hidden_states, topk_ids, topk_weights, packed, live_tokens)
    # The kernel compares intermediate_size with the blob's I (a ValueError); a fake has no I.
    torch._check_value(intermediate_size >= 1, lambda: f"intermediate_size must be >= 1, got {intermediate_size}")
    shape = (hidden_states.shape[0], topk_ids.shape[1], 2 * intermediate_size)
    if gate_up_delta is not None:
        _check_slot_rows(gate_up_delta, "gate_up_delta", topk_ids, _FLOATS, intermediate_size)
    return out, hidden_states.new_empty(shape, dtype=torch.float32)


@torch.library.register_fake("kt::moe_train_backward")
def _moe_train_backward_fake(
    grad_output: torch.Tensor,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: torch.Tensor,
    gate_up: torch.Tensor,
    live_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_meta("hidden_states", hidden_states, gate_up=gate_up)
    grad_x, grad_w = _moe_backward_fake(grad_output, hidden_states, topk_ids, topk_weights, packed, live_tokens)
    _check_slot_rows(gate_up, "gate_up", topk_ids, (torch.float32,))
    return grad_x, grad_w, torch.empty_like(gate_up, memory_format=torch.contiguous_format)


def _check_lora_fake(hidden_states: torch.Tensor, gate_a: torch.Tensor, gate_b: torch.Tensor, up_a: torch.Tensor,
                     up_b: torch.Tensor, down_a: torch.Tensor, down_b: torch.Tensor) -> None:
    """The kernel's lora_of and check_lora (moe_train_cpu.cpp): six 3-D (``ValueError``)
    matrices of a float dtype (``TypeError``), then gate_a, up_a [E, r, H], gate_b, up_b
    [E, I, r], down_a [E, r, I], down_b [E, H, r], a ``ValueError`` naming the matrix. E
    and I are the blob's, which a fake cannot read: E, r and I are taken from gate_a and
    gate_b, H from hidden_states (which the kernel checks against the blob first)."""
    named = (("gate_a", gate_a), ("gate_b", gate_b), ("up_a", up_a), ("up_b", up_b), ("down_a", down_a),
             ("down_b", down_b))
    for name, t in named:
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D; got shape {list(t.shape)}")
        _check_tensor(t, name, _FLOATS, None)
    E, r, H, I = gate_a.shape[0], gate_a.shape[1], hidden_states.shape[1], gate_b.shape[1]
    want = {"gate_a": (E, r, H), "gate_b": (E, I, r), "up_a": (E, r, H), "up_b": (E, I, r), "down_a": (E, r, I),
            "down_b": (E, H, r)}
    for name, t in named:
        for a, b in zip(t.shape, want[name]):
            torch._check_value(a == b, lambda name=name, t=t: f"{name} must be {list(want[name])} (E, H, I of the "
                               f"packed layer, rank {r}); got {list(t.shape)}")


@torch.library.register_fake("kt::moe_lora_forward")
def _moe_lora_forward_fake(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: torch.Tensor,
    gate_a: torch.Tensor,
    gate_b: torch.Tensor,
    up_a: torch.Tensor,
    up_b: torch.Tensor,
    down_a: torch.Tensor,
    down_b: torch.Tensor,
    scaling: float,
    live_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_meta("hidden_states", hidden_states, gate_a=gate_a, gate_b=gate_b, up_a=up_a,
                up_b=up_b, down_a=down_a, down_b=down_b)
    out = _moe_call_fake(hidden_states, topk_ids, topk_weights, packed, live_tokens, contiguous=False)
    _check_lora_fake(hidden_states, gate_a, gate_b, up_a, up_b, down_a, down_b)
    shape = (hidden_states.shape[0], topk_ids.shape[1], 2 * gate_b.shape[1])
    return out, hidden_states.new_empty(shape, dtype=torch.float32)


@torch.library.register_fake("kt::moe_lora_backward")
def _moe_lora_backward_fake(
    grad_output: torch.Tensor,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: torch.Tensor,
    gate_a: torch.Tensor,
    gate_b: torch.Tensor,
    up_a: torch.Tensor,
    up_b: torch.Tensor,
    down_a: torch.Tensor,
    down_b: torch.Tensor,
    scaling: float,
    live_tokens: torch.Tensor | None = None,
    gate_up: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    _check_meta("hidden_states", hidden_states, gate_a=gate_a, gate_b=gate_b, up_a=up_a,
                up_b=up_b, down_a=down_a, down_b=down_b, gate_up=gate_up)
    _moe_call_fake(hidden_states, topk_ids, topk_weights, packed, live_tokens, contiguous=False)
    _check_lora_fake(hidden_states, gate_a, gate_b, up_a, up_b, down_a, down_b)
    if gate_up is not None:
        _check_slot_rows(gate_up, "gate_up", topk_ids, (torch.float32,), gate_b.shape[1])
    grads = _moe_backward_fake(grad_output, hidden_states, topk_ids, topk_weights, packed, live_tokens)
    # The kernel's LoRA gradients are zeros_like(m.to(float32)).to(m.dtype): they take each
    # matrix's strides (a transposed adapter's are not contiguous). The same chain here, so
    # the fake's strides are the kernel's for every layout.
    return (*grads, *(torch.empty_like(t.to(torch.float32)).to(t.dtype)
                      for t in (gate_a, gate_b, up_a, up_b, down_a, down_b)))


def refuse_meta_blob(packed: torch.Tensor) -> None:
    """``ValueError`` for a blob on the meta device: dequantize_experts' I and H are in its
    bytes (FakeTensors, never ``is_meta``, get new sizes instead)."""
    if isinstance(packed, torch.Tensor) and packed.is_meta:
        raise ValueError("packed is on the meta device (a shape without values): dequantize_experts reads the blob's "
                         "bytes; load the packed layer first")


@torch.library.register_fake("kt::dequantize_experts")
def _dequantize_experts_fake(
    packed: torch.Tensor,
    expert_ids: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # I and H live in the blob's header, which a FakeTensor does not hold: they are new
    # data-dependent sizes (as nonzero's length), one each, shared by the three outputs.
    # kt_ops.dequantize_experts pins them with torch._check when it is given a
    # PackedExperts (whose header was read eagerly), so compiled code sees them as constants.
    _check_meta("packed", packed, expert_ids=expert_ids)
    refuse_meta_blob(packed)  # else the meta kernel's get_ctx() says "data-dependent output"
    # The kernel's checks (dequantize_experts_cpu.cpp), the same TypeErrors and ValueErrors.
    _check_tensor(packed, "packed", (torch.uint8,), 1)
    _check_contiguous(packed=packed)
    _check_tensor(expert_ids, "expert_ids", _IDS, 1)
    out = torch.float32 if dtype is None else dtype
    torch._check_type(out in (torch.float32, torch.bfloat16),
                      lambda: f"dtype must be float32 or bfloat16 (or None: float32); got {out}")
    ctx = torch.library.get_ctx()
    intermediate, hidden = ctx.new_dynamic_size(min=1), ctx.new_dynamic_size(min=1)
    n = expert_ids.shape[0]
    gate = packed.new_empty((n, intermediate, hidden), dtype=out)
    return gate, torch.empty_like(gate), packed.new_empty((n, hidden, intermediate), dtype=out)
