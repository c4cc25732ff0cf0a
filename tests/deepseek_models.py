"""Tiny random HF DeepSeek-V3 models for the DeepSeek tests (tests/test_deepseek.py, the engine's):
every weight and the routing bias far from their init, so that a swapped, dropped or misordered
tensor changes the logits and the routing, and greedy argmaxes have no near-ties."""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

VOCAB = 256  # the byte tokenizer's, so the same folders train and serve
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.8, "mscale_all_dim": 0.7}
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             n_shared_experts=1, n_routed_experts=8, kv_lora_rank=12, qk_rope_head_dim=8,
             v_head_dim=10, qk_nope_head_dim=6, num_experts_per_tok=3, first_k_dense_replace=1,
             max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)
CASES = {
    # DeepSeek-V3's shape: low-rank q, groups, scaled weights, yarn, interleaved rope.
    "v3": dict(q_lora_rank=20, n_group=4, topk_group=2, routed_scaling_factor=2.5,
               rope_parameters=YARN),
    # DeepSeek-V2-Lite's: full-rank q, no groups, unnormalized weights, plain half-split rope.
    "lite": dict(q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False,
                 rope_interleave=False, rope_parameters={"rope_type": "default",
                                                         "rope_theta": 500.0}),
}


def hf_config(case: str) -> DeepseekV3Config:
    return DeepseekV3Config(**SHAPE, **CASES[case])


def hf_model(case: str, seed: int = 0) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_config(case))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.3
            param.copy_(noise + 1.0 if "norm" in name else noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.2)
    return model.eval()
