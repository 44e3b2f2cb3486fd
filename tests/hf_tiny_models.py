"""Tiny random Hugging Face MoE models of every family the transformers integration runs."""

from __future__ import annotations

import warnings

import torch

VOCAB = 97


def configs(hidden: int = 64, layers: int = 2, experts: int = 8) -> dict:
    """One config per family: ``hidden`` wide, ``layers`` deep, ``experts`` experts (top-2)."""
    import transformers as t

    ffn = hidden // 2
    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return {
        "mixtral": t.MixtralConfig(**common, intermediate_size=ffn, num_local_experts=experts, num_experts_per_tok=2),
        "qwen3_moe": t.Qwen3MoeConfig(
            **common, head_dim=hidden // 4, intermediate_size=hidden, moe_intermediate_size=ffn,
            num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True,
        ),
        "qwen2_moe": t.Qwen2MoeConfig(
            **common, intermediate_size=hidden, moe_intermediate_size=ffn, shared_expert_intermediate_size=ffn,
            num_experts=experts, num_experts_per_tok=2, norm_topk_prob=False,
        ),
        "olmoe": t.OlmoeConfig(**common, intermediate_size=ffn, num_experts=experts, num_experts_per_tok=2),
        "deepseek_v3": t.DeepseekV3Config(  # MLA: a static cache holds a key per attention head
            **{**common, "num_key_value_heads": 4}, intermediate_size=hidden, moe_intermediate_size=ffn,
            n_routed_experts=experts, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0, n_shared_experts=1,
            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        ),
        "gpt_oss": t.GptOssConfig(
            **common, head_dim=hidden // 4, intermediate_size=ffn, num_local_experts=experts, num_experts_per_tok=2
        ),
        "qwen3_next": t.Qwen3NextConfig(
            **common, head_dim=hidden // 4, intermediate_size=hidden, moe_intermediate_size=ffn,
            shared_expert_intermediate_size=ffn, num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            # linear attention, then one full-attention layer (a cache needs one)
            layer_types=["linear_attention"] * (layers - 1) + ["full_attention"],
        ),
        "glm4_moe": t.Glm4MoeConfig(
            **common, intermediate_size=hidden, moe_intermediate_size=ffn, n_routed_experts=experts,
            num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=0,
        ),
        "ernie4_5_moe": t.Ernie4_5_MoeConfig(
            **common, intermediate_size=hidden, moe_intermediate_size=ffn, moe_num_experts=experts, moe_k=2,
            moe_num_shared_experts=1, moe_layer_start_index=0,
        ),
        "dots1": t.Dots1Config(
            **common, intermediate_size=hidden, moe_intermediate_size=ffn, n_routed_experts=experts,
            num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=0,
        ),
        "minimax": t.MiniMaxConfig(
            **common, head_dim=hidden // 4, intermediate_size=ffn, num_local_experts=experts, num_experts_per_tok=2
        ),
        "flex_olmo": t.FlexOlmoConfig(
            **common, pad_token_id=0, eos_token_id=None, intermediate_size=ffn, num_experts=experts, num_experts_per_tok=2),
        "hunyuan_v1_moe": t.HunYuanMoEV1Config(
            **common, head_dim=hidden // 4, intermediate_size=ffn, num_experts=experts, moe_topk=2
        ),
    }  # fmt: skip


FAMILIES = (
    "mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss", "qwen3_next", "glm4_moe",
    "ernie4_5_moe", "dots1", "minimax", "flex_olmo", "hunyuan_v1_moe",
)  # fmt: skip


def tiny_model(
    family: str, dtype: torch.dtype = torch.float64, seed: int = 0, full_attention: bool = False, **sizes
):
    """A random ``family`` causal LM in ``dtype``, its biases made non-zero; ``sizes``: see configs.

    ``full_attention``: no sliding-window layers (GPT-OSS alternates them by default).
    """
    import transformers

    config = configs(**sizes)[family]
    if full_attention and getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * len(config.layer_types)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to(dtype)
    with torch.no_grad():  # HF initialises biases to zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith("_bias") or "router.bias" in name:
                p.normal_(0, 0.1)
    return model.eval()


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules (``use_experts_implementation`` classes) of ``model``."""
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")]
