"""python scripts/hf_arch_sweep.py [MODEL_TYPE ...]

Which transformers MoE architectures run their experts through kt_ops: for every model type
whose modeling file uses transformers' experts interface (``@use_experts_implementation``;
all of them found in the installed transformers when none is named), a tiny random causal LM
(hidden 64, 2 layers, 8 experts, top-2) is built from the config class's defaults shrunk by
the fields below, saved, loaded twice with ``from_pretrained`` (``experts_implementation=
"eager"`` and ``"kt_ops"``), and one forward of 2 x 9 tokens is compared: the median
per-token relative error of the logits (fp32 weights; kt_ops' BF16 kernels round the
activations to bf16 on CPUs with AVX512_BF16/AMX, so expect ~1e-3 there).

Per model type one line: ``ok`` (experts modules, how many were packed, the error),
``refused`` (kt_ops' ValueError for experts it does not compute, e.g. ungated ones),
``kt_ops`` (any other exception from the kt_ops model: a bug; the exit status is then 1), ``eager`` (transformers' own forward failed on this shrunk
config: not a kt_ops result), ``build`` (no tiny model could be made: config class,
AutoModelForCausalLM mapping, or more than 20 M parameters). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

# Fields set where the default config has them (scalars only).
SMALL: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, moe_intermediate_size=32, expert_intermediate_size=32, num_experts=8, num_local_experts=8,
    n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2, moe_topk=2, moe_k=2, vocab_size=96,
    max_position_embeddings=128, first_k_dense_replace=0, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, shared_expert_intermediate_size=32,
    num_shared_experts=1, n_shared_experts=1, initializer_range=0.1, tie_word_embeddings=False, sliding_window=16,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
# Per model type: what the generic fields leave inconsistent.
EXTRA: dict[str, dict[str, Any]] = {
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"]),
    "bailing_hybrid": dict(layer_types=["linear_attention", "full_attention"], pad_token_id=0,
                           num_key_value_heads=4),
    "glm4_moe_lite": dict(num_key_value_heads=4),
    "glm_moe_dsa": dict(num_key_value_heads=4, mlp_layer_types=["sparse", "sparse"]),
    "deepseek_v32": dict(num_key_value_heads=4, mlp_layer_types=["sparse", "sparse"]),
    "deepseek_v2": dict(num_key_value_heads=4), "deepseek_v3": dict(num_key_value_heads=4, head_dim=8),
    "axk1": dict(num_key_value_heads=4, head_dim=8), "axk2": dict(num_key_value_heads=4),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "kimi_linear": dict(pad_token_id=0, num_key_value_heads=4, layer_types=["linear_attention", "full_attention"]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    "longcat_flash": dict(qk_head_dim=24, num_key_value_heads=4, head_dim=8),
    "flex_olmo": dict(pad_token_id=0), "hy_v4": dict(pad_token_id=0),
}
# Composite (vision-language) configs: their text model.
TEXT = {"qwen3_5_moe": "qwen3_5_moe_text", "minimax_m3_vl": "minimax_m3_vl_text", "glm5_next": "glm5_next_text",
        "qwen3_omni_moe": "qwen3_omni_moe_text"}
MAX_PARAMS = 20e6


def experts_model_types() -> list[str]:
    """Model types whose modeling file uses ``@use_experts_implementation``."""
    import transformers
    from transformers import CONFIG_MAPPING

    root = Path(transformers.__file__).parent / "models"
    dirs = sorted(p.parent.name for p in root.glob("*/modeling_*.py") if "use_experts_implementation" in p.read_text())
    return [TEXT.get(d, d) for d in dirs if TEXT.get(d, d) in CONFIG_MAPPING]


def tiny(model_type: str) -> torch.nn.Module:
    """A tiny random causal LM of ``model_type`` (``RuntimeError`` when it is too big)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    cls = CONFIG_MAPPING[model_type]
    base = cls()
    kwargs = {k: v for k, v in SMALL.items() if hasattr(base, k) and not isinstance(getattr(base, k), (list, dict))}
    kwargs.update(EXTRA.get(model_type, {}))
    config = cls(**kwargs)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if params > MAX_PARAMS:
        raise RuntimeError(f"{params / 1e6:.0f} M parameters after shrinking")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # decisive routers (random ones near-tie), non-zero expert biases
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.mul_(4.0)
            if "expert" in name and name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return model


def sweep_one(model_type: str) -> str:
    """One result line for ``model_type``."""
    from transformers import AutoModelForCausalLM

    from kt_ops import hf_experts

    try:
        path = tempfile.mkdtemp(prefix=f"kt_sweep_{model_type}_")
        tiny(model_type).save_pretrained(path)
    except Exception as e:  # noqa: BLE001 (a report, not a handler)
        return f"{model_type}: build   {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    try:
        eager = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", dtype=torch.float32).eval()
        with torch.no_grad():
            want = eager(ids).logits
    except Exception as e:  # noqa: BLE001
        return f"{model_type}: eager   {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    try:
        ours = AutoModelForCausalLM.from_pretrained(path, experts_implementation="kt_ops", dtype=torch.float32).eval()
        with torch.no_grad():
            got = ours(ids).logits
    except ValueError as e:  # kt_ops' refusal of what it does not compute, with the reason
        return f"{model_type}: refused {str(e).splitlines()[0][:160]}"
    except Exception as e:  # noqa: BLE001
        return f"{model_type}: kt_ops  {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    modules = [m for m in ours.modules() if hf_experts.is_experts_module(m)]
    if not modules:
        return f"{model_type}: build   no experts module in the tiny model (its MoE layers need other settings)"
    packed = sum(hf_experts.packed_blob(m) is not None for m in modules)
    err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).median().item()
    name = type(modules[0]).__name__ if modules else "-"
    return f"{model_type}: ok      {name}: {len(modules)} experts modules, {packed} packed, median error {err:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("model_types", nargs="*", help="transformers model types (default: every experts architecture)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import transformers

    import kt_ops  # noqa: F401  (registers experts_implementation="kt_ops")

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    types = args.model_types or experts_model_types()
    print(f"transformers {transformers.__version__}, kt_ops {kt_ops.__version__}, {len(types)} model types", flush=True)
    counts: dict[str, int] = {}
    for t in types:
        line = sweep_one(t)
        outcome = line.split()[1]
        counts[outcome] = counts.get(outcome, 0) + 1
        print(line, flush=True)
    print(", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    sys.exit(1 if counts.get("kt_ops") else 0)


if __name__ == "__main__":
    main()
