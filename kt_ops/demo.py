"""python -m kt_ops.demo: a tiny random Qwen3-MoE, patched, generating tokens.

Builds a Qwen3-MoE causal LM from its transformers config class (random weights, no hub
access, no tokenizer: the "text" is token ids), generates greedily with the unpatched
model and with the model patched by :func:`kt_ops.patch_model`, and prints the tokens
and the time spent inside the MoE blocks per generated token (forward hooks around each
block), the plain Hugging Face experts against ours. Needs ``transformers``.

The expert kernels run on torch's own intra-op threads (the attention and norms use the
same ones), so no environment setting is needed for the two to share the cores.
"""

from __future__ import annotations

import argparse
import copy
import time
from contextlib import contextmanager
from typing import Iterator

import torch

import kt_ops
from kt_ops._optional import require_transformers


def build_model(layers: int, hidden: int, experts: int, top_k: int, intermediate: int, seed: int) -> torch.nn.Module:
    """A bf16 Qwen3-MoE causal LM with random weights (routers scaled to be decisive)."""
    try:
        transformers = require_transformers("kt_ops.demo")
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise SystemExit(str(error)) from error
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, max_position_embeddings=512,
        initializer_range=0.05,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(4.0)
    return model


@contextmanager
def moe_timer(model: torch.nn.Module, kinds: tuple[type, ...]) -> Iterator[list[float]]:
    """Collects the seconds spent inside every module of ``kinds`` while active."""
    spent: list[float] = []
    starts: dict[int, float] = {}
    handles = []
    for module in model.modules():
        if isinstance(module, kinds):
            handles.append(module.register_forward_pre_hook(lambda m, a: starts.__setitem__(id(m), time.perf_counter())))
            handles.append(module.register_forward_hook(
                lambda m, a, o: spent.append(time.perf_counter() - starts.pop(id(m)))))
    try:
        yield spent
    finally:
        for handle in handles:
            handle.remove()


def generate(model: torch.nn.Module, prompt: torch.Tensor, tokens: int, kinds: tuple[type, ...]) -> tuple[torch.Tensor, float, float]:
    """``(token ids, seconds in MoE blocks, total seconds)`` of greedy generation."""
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        with moe_timer(model, kinds) as spent:
            start = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
            total = time.perf_counter() - start
    return out, sum(spent), total


def method_arguments(method: str, hidden: int, intermediate: int) -> tuple[str, str | None]:
    """``(method, gguf_type)`` for ``patch_model``: a GGUF type name (``Q4_K``) selects
    ``LLAMAFILE`` with that type. ``ValueError`` naming the choices for an unknown method,
    or where the method does not pack experts of these sizes (a one-expert trial pack)."""
    from kt_ops.formats import CHECKPOINT_METHODS, METHOD_FORMATS
    from kt_ops.gguf_types import SUPPORTED_TYPES

    name = method.upper()
    gguf_type = None
    if name not in METHOD_FORMATS and name not in CHECKPOINT_METHODS and name in SUPPORTED_TYPES:
        name, gguf_type = "LLAMAFILE", name
    elif name == "LLAMAFILE":
        raise ValueError(f"LLAMAFILE needs a GGUF type: pass the type as the method "
                         f"(one of {', '.join(SUPPORTED_TYPES)})")
    elif name not in METHOD_FORMATS and name not in CHECKPOINT_METHODS:
        methods = [m for m in (*METHOD_FORMATS, *CHECKPOINT_METHODS) if m != "LLAMAFILE"]
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(methods)} "
                         f"or a GGUF type ({', '.join(SUPPORTED_TYPES)})")
    gate = torch.zeros(1, intermediate, hidden, dtype=torch.bfloat16)
    down = torch.zeros(1, hidden, intermediate, dtype=torch.bfloat16)
    kt_ops.pack_experts(gate, gate.clone(), down, name, group_size=128, gguf_type=gguf_type)  # as patch_model packs
    return name, gguf_type


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, str | None]:
    """Usage errors (exit 2) for sizes the demo cannot build or run, before any model is
    built; returns :func:`method_arguments`."""
    for flag, value in (("--layers", args.layers), ("--experts", args.experts), ("--tokens", args.tokens)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if not 1 <= args.top_k <= args.experts:
        parser.error(f"--top-k must be between 1 and --experts ({args.experts}), got {args.top_k}")
    if args.hidden < 16 or args.hidden % 16:
        parser.error(f"--hidden must be a positive multiple of 16 (8 attention heads of an even size), "
                     f"got {args.hidden}")
    if args.intermediate < 8 or args.intermediate % 8:
        parser.error(f"--intermediate must be a positive multiple of 8 (bf16 rows of 16-byte multiples), "
                     f"got {args.intermediate}")
    try:
        return method_arguments(args.method, args.hidden, args.intermediate)
    except ValueError as error:
        parser.error(f"--method {args.method}: {error}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kt_ops.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="BF16",
                        help="packing method of the CPU experts (default BF16), or a GGUF type such as Q4_K "
                             "(method LLAMAFILE with that type)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size, a multiple of 16 (default 1024)")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8, help="experts per token, at most --experts (default 8)")
    parser.add_argument("--intermediate", type=int, default=512,
                        help="expert intermediate size, a multiple of 8 (default 512)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens to generate")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    method, gguf_type = check_arguments(parser, args)

    model = build_model(args.layers, args.hidden, args.experts, args.top_k, args.intermediate, args.seed)
    block = type(model.model.layers[0].mlp)
    prompt = torch.randint(0, 4096, (1, 8), generator=torch.Generator().manual_seed(args.seed))
    print(f"kt_ops {kt_ops.__version__} | torch {torch.__version__} | CPU variant {kt_ops.cpu_variant()}, "
          f"{kt_ops.get_num_threads()} threads on {kt_ops.thread_source()}")
    print(f"tiny Qwen3-MoE: {args.layers} layers, hidden {args.hidden}, {args.experts} experts top-{args.top_k}, "
          f"intermediate {args.intermediate}, bf16, random weights")
    reference, hf_moe, hf_total = generate(model, prompt, args.tokens, (block,))
    patched = kt_ops.patch_model(copy.deepcopy(model), method=method, gguf_type=gguf_type)
    print(patched.kt_ops_patch_report)
    ours, kt_moe, kt_total = generate(patched, prompt, args.tokens, (kt_ops.HybridMoE,))
    new = slice(prompt.shape[1], None)
    print(f"prompt            {prompt[0].tolist()}")
    print(f"unpatched tokens  {reference[0, new].tolist()}")
    print(f"patched tokens    {ours[0, new].tolist()}")
    same = int((reference[0, new] == ours[0, new]).cumprod(0).sum())
    print(f"identical prefix  {same} of {args.tokens} tokens (greedy; a near tie may flip later ones)")
    per = 1e3 / args.tokens
    print(f"MoE blocks        Hugging Face {hf_moe * per:8.2f} ms/token   kt_ops {kt_moe * per:8.2f} ms/token   "
          f"({hf_moe / kt_moe:.2f}x)")
    print(f"whole generate    Hugging Face {hf_total * per:8.2f} ms/token   kt_ops {kt_total * per:8.2f} ms/token")


if __name__ == "__main__":
    main()
