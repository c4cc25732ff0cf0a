"""`--quantization int8|int4` and `--kv-cache-dtype` in one process: the bytes a quantized model
holds equal the planner's serving prediction on every model family (counted on the tensors,
not derived), the engine's greedy tokens are the argmaxes of a full forward of the same
quantized model (up to bf16 rounding), an fp8 KV pool holds the bf16 pool's values rounded to
E4M3 in the planner's bytes per token, and what cannot run is refused in one line. tp=2 against
tp=1: test_quantization_tp.py."""

import copy

import pytest
import torch

from tetrad.errors import ConfigError
from tetrad.inference.core.params import SamplingParams
from tetrad.inference.engine import LLM
from tetrad.inference.ranks.rank_share import held_bytes
from tetrad.models.fp8_weights import weight_bytes
from tetrad.models.quant import Int4Linear, Int8Linear
from tetrad.models.quant_model import quantize_model
from tetrad.models.transformer import Transformer
from tetrad.planner.memory import kv_bytes_per_token
from tetrad.planner.precision import element_bytes
from tetrad.planner.quantized import check_quantizable
from tetrad.planner.serving import weight_bytes_per_gpu
from tetrad.spec.model import ModelConfig
from tetrad.spec.serving import ServeConfig, ServeLayout
from tetrad.tokenizer import ByteTokenizer

# Widths that int4's groups of 128 tile: every family the engine loads.
BASE = dict(vocab_size=256, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=64, ffn_hidden_size=512, max_seq_len=128)
FAMILIES = {
    "llama": ModelConfig(name="llama", **BASE),
    "gpt2": ModelConfig(name="gpt2", **{**BASE, "num_kv_heads": 4}, norm="layernorm", bias=True,
                        position="learned", mlp="gelu", tie_embeddings=True),
    "qwen": ModelConfig(name="qwen", **BASE, qkv_bias=True, tie_embeddings=False),
    "moe": ModelConfig(name="moe", **BASE, num_experts=4, num_experts_per_token=2,
                       num_shared_experts=1, moe_ffn_hidden_size=128, num_dense_layers=1),
    "mla": ModelConfig(name="mla", **{**BASE, "num_kv_heads": 0, "head_dim": 0},
                       attention="mla", q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
                       qk_rope_head_dim=16, v_head_dim=64, num_experts=4,
                       num_experts_per_token=2, num_shared_experts=1, moe_ffn_hidden_size=128,
                       num_dense_layers=1, router_score="sigmoid"),
}
BF16_LOGIT_SLACK = 2.0 ** -5  # four bf16 roundings of a logit, relative
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250, 11], [200, 3], list(range(30, 60))]


def random_model(config: ModelConfig, seed: int = 0) -> Transformer:
    """bf16 weights well away from init (logits far apart: few argmax near-ties)."""
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape) * (0.3 if param.dim() == 1 else 0.08)
                        + (1.0 if "norm" in name else 0.0))
    return model.eval().to(torch.bfloat16)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_held_bytes_equal_the_planners_prediction(family, method):
    config = FAMILIES[family]
    model = quantize_model(random_model(config), method)
    swapped = [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    expected_type = Int8Linear if method == "int8" else Int4Linear
    assert swapped and all(type(m) is expected_type for m in swapped)
    # Every projection went; the router's gate and the head stay 16-bit linears.
    linears = [name for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert all(name.endswith("router.gate") or name == "lm_head" for name in linears), linears
    assert weight_bytes(model) == weight_bytes_per_gpu(config, ServeLayout(), method, 0)


def test_int4_on_widths_its_groups_do_not_tile_is_refused_by_planner_and_engine():
    config = ModelConfig(name="narrow", **{**BASE, "head_dim": 16})  # attn.out reads 64
    with pytest.raises(ConfigError, match="layer 0's attn.out has 64 inputs"):
        check_quantizable(config, ServeLayout(), "int4")
    with pytest.raises(ConfigError, match="layer 0's attn.out has 64 inputs"):
        LLM(random_model(config), ByteTokenizer(), quantization="int4", device="cpu", log=None)
    LLM(random_model(config), ByteTokenizer(), quantization="int8", device="cpu",
        log=None).close()


@pytest.mark.parametrize("family", ["llama", "gpt2", "mla"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_greedy_tokens_are_the_quantized_models_argmaxes(family, method):
    model = random_model(FAMILIES[family])
    llm = LLM(model, ByteTokenizer(), quantization=method, device="cpu", attention="sdpa",
              block_size=4, log=None)
    try:
        outputs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert weight_bytes(llm.model) == held_bytes(llm.runner)["weights"]
    finally:
        llm.close()
    assert all(type(m) is torch.nn.Linear for m in model.modules()
               if type(m).__name__.endswith("Linear")), "the caller's model was quantized"
    reference = quantize_model(copy.deepcopy(model), method)
    for prompt, tokens in zip(PROMPTS, outputs):
        assert_greedy(reference, prompt, tokens)


def assert_greedy(model: Transformer, prompt: list[int], tokens: list[int]) -> None:
    """Each token is the argmax of `model`'s logits after the prompt and the tokens before it,
    computed again in one full forward (no cache), up to bf16's rounding of the logits: the
    paged engine and the full forward round differently, and a tie in bf16 may go either way."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1:-1].float()
    best = logits.max(dim=-1).values
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (chosen >= best - BF16_LOGIT_SLACK * best.abs()).all(), (chosen, best)


def test_an_fp32_model_is_quantized_in_bf16_and_fp32_with_quantization_is_refused():
    model = random_model(FAMILIES["llama"]).float()
    llm = LLM(model, ByteTokenizer(), quantization="int8", device="cpu", log=None)
    try:
        assert llm.config.dtype == "bf16" and llm.runner.kv_cache.pool.dtype == torch.bfloat16
    finally:
        llm.close()
    with pytest.raises(ConfigError, match="--quantization int4 computes in 16 bits"):
        ServeConfig(quantization="int4", dtype="fp32")
    with pytest.raises(ConfigError, match="quantization"):
        ServeConfig(quantization="int3")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        ServeConfig(kv_cache_dtype="int8")


@pytest.mark.parametrize("family", ["llama", "mla"])
def test_an_fp8_kv_pool_holds_the_bf16_values_rounded_in_the_planners_bytes(family):
    assert_fp8_pool_is_the_bf16_pool_rounded(FAMILIES[family], device="cpu", block_size=4)


def assert_fp8_pool_is_the_bf16_pool_rounded(config: ModelConfig, **engine) -> None:
    """A prompt's K/V in a bf16 pool and in an fp8 one, the same engine settings otherwise: the
    fp8 pool holds the bf16 values rounded to E4M3, each pool in the planner's bytes per token
    (tests/gpu/test_gpu_quantization.py runs it on a GPU)."""
    model = random_model(config)
    prompt = list(range(40, 70))
    pools = {}
    for kv in ("auto", "fp8"):
        llm = LLM(model, ByteTokenizer(), kv_cache_dtype=kv, num_blocks=16,
                  enable_prefix_caching=False, log=None, **engine)
        try:
            llm.generate([prompt], GREEDY.replace(max_tokens=1))  # the prompt's K/V only
            pools[kv] = llm.runner.kv_cache.pool.clone()
            element = "bf16" if kv == "auto" else "fp8"
            assert held_bytes(llm.runner)["kv_per_token"] == kv_bytes_per_token(
                config, element_bytes(element))
        finally:
            llm.close()
    assert pools["fp8"].dtype == torch.float8_e4m3fn
    assert pools["fp8"].device.type == engine["device"]
    assert pools["auto"].count_nonzero() > 0
    assert torch.equal(pools["fp8"].float(), pools["auto"].to(torch.float8_e4m3fn).float())


def test_an_fp8_kv_pool_is_refused_by_the_backends_that_read_it_in_place():
    with pytest.raises(ConfigError, match="--attention cpu reads no fp8 KV cache"):
        LLM(random_model(FAMILIES["llama"]), ByteTokenizer(), kv_cache_dtype="fp8",
            attention="cpu", device="cpu", log=None)
