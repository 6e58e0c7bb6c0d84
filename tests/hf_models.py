"""Tiny Hugging Face MoE models built from their config classes (random weights, no hub)."""

from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip("transformers")

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, initializer_range=0.1, tie_word_embeddings=False)


def _qwen3_moe():
    return transformers.Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                       num_experts_per_tok=2, norm_topk_prob=True, head_dim=16)


def _qwen2_moe():
    return transformers.Qwen2MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                       num_experts_per_tok=2, shared_expert_intermediate_size=48)


def _mixtral():
    return transformers.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)


def _deepseek_v3():
    return transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=0, routed_scaling_factor=2.5,
        norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16)


def _deepseek_v2():
    return transformers.DeepseekV2Config(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=4, topk_group=2, topk_method="group_limited_greedy", first_k_dense_replace=0,
        routed_scaling_factor=1.5, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16)


CONFIGS = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
    "deepseek_v2": _deepseek_v2,
}


_MLA_MOE = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=16, mlp_layer_types=["sparse", "sparse"])


# Architectures that transformers routes through its experts interface, beyond CONFIGS
# (patch_model's list): experts_implementation="kt_ops" covers them (tests/test_hf_experts.py).
EXPERTS_CONFIGS = {
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1, norm_topk_prob=True, head_dim=16),
    "gpt_oss": lambda: transformers.GptOssConfig(**COMMON, intermediate_size=32, num_local_experts=8,
                                                 num_experts_per_tok=2, head_dim=16, sliding_window=16),
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "minimax_m2": lambda: transformers.MiniMaxM2Config(**COMMON, intermediate_size=32, num_local_experts=8,
                                                       num_experts_per_tok=2, head_dim=16),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        shared_expert_intermediate_size=32, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"]),
    # newer architectures (transformers 5.23): Qwen3.5-MoE (text model), GLM-5 (MoE + DSA),
    # DeepSeek-V3.2, MiniMax-M3 (text model), Kimi-Linear
    "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(
        **COMMON, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=32,
        head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"]),
    "glm_moe_dsa": lambda: transformers.GlmMoeDsaConfig(**{**COMMON, "num_key_value_heads": 4}, **_MLA_MOE),
    "deepseek_v32": lambda: transformers.DeepseekV32Config(**{**COMMON, "num_key_value_heads": 4}, **_MLA_MOE),
    "minimax_m3_vl_text": lambda: transformers.MiniMaxM3VLTextConfig(**COMMON, intermediate_size=96, num_local_experts=8,
                                                                     num_experts_per_tok=2, head_dim=16),
    "kimi_linear": lambda: transformers.KimiLinearConfig(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, num_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, linear_num_heads=4, linear_head_dim=16,
        pad_token_id=0, layer_types=["linear_attention", "full_attention"]),
    "deepseek_v4": lambda: transformers.DeepseekV4Config(**{**COMMON, "num_key_value_heads": 1}, intermediate_size=32,
                                                         num_local_experts=8, num_experts_per_tok=2),
}


def tiny_model(model_type: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0, router_scale: float = 4.0) -> torch.nn.Module:
    """A 2-layer, 8-expert causal LM of ``model_type`` with random weights, in eval mode.

    The routers are scaled up (trained routers are decisive; random ones near-tie, and a
    near tie flips on any rounding difference), DeepSeek-V3's expert bias is randomised so
    the biased choice is exercised, and expert biases (gpt-oss) are made non-zero so a
    dropped bias shows."""
    torch.manual_seed(seed)
    config = {**CONFIGS, **EXPERTS_CONFIGS}[model_type]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                param.mul_(router_scale)
            if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):  # gpt-oss: init leaves 0
                param.normal_(0.0, 0.5)
            if name == "lm_head.weight":  # a peaked next-token distribution, as trained
                param.mul_(4.0)
    return model
