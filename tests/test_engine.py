"""The engine end to end on a tiny random model: greedy outputs equal a full-recompute loop and HF
generate(), with and without prefix caching, chunked, and under forced preemption; paged
attention (tiled and SDPA) equals naive attention."""

import pytest
import torch
from torch import nn

from tetrad.errors import ConfigError
from tetrad.inference.worker.attention import sdpa_paged_attention, tiled_paged_attention
from tetrad.inference.engine import LLM
from tetrad.inference.worker.kv_cache import parse_bytes, plan_kv_pool
from tetrad.inference.core.params import RequestRejected, SamplingParams
from tetrad.models.transformer import Transformer
from tetrad.planner.memory import kv_bytes_per_token
from tetrad.spec.presets import resolve_model
from tetrad.tokenizer import ByteTokenizer

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250, 11, 12, 13, 14],  # different lengths, a shared start
           [5, 17, 99, 3, 42, 7, 8, 250, 66],
           [200],
           list(range(30, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def random_model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = Transformer(resolve_model("tiny", overrides or None))
    with torch.no_grad():  # larger weights than init: logits far apart, so no argmax near-ties
        for param in model.parameters():
            param.normal_(0, 0.15)
    return model.eval()


def reference_greedy(model, prompt, max_tokens):
    ids, device = list(prompt), next(model.parameters()).device
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids], device=device))[0, -1].argmax()))
    return ids[len(prompt):]


def naive_paged_attention(q, k_cache, v_cache, block_tables, query_positions):
    """The full score matrix, materialized: the reference both paged kernels must equal."""
    k = k_cache[block_tables].flatten(1, 2)  # [batch, keys, kv_heads, head_dim]
    v = v_cache[block_tables].flatten(1, 2)
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    visible = torch.arange(k.shape[1]) <= query_positions.unsqueeze(-1)  # [batch, q, keys]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


@pytest.mark.parametrize("num_queries,tile_tokens", [(1, 4), (1, 12), (5, 8), (7, 32)])
def test_paged_attention_kernels_equal_naive_attention(num_queries, tile_tokens):
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, heads, head_dim = 20, 4, 2, 6, 8
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    tables = torch.stack([torch.randperm(num_blocks)[:6] for _ in range(3)])  # [3, 6]
    context = torch.tensor([23, 9, 14])  # tokens in each sequence's context, new ones included
    positions = context[:, None] - num_queries + torch.arange(num_queries)  # the last queries
    q = torch.randn(3, num_queries, heads, head_dim)
    expected = naive_paged_attention(q, k_cache, v_cache, tables, positions)
    torch.testing.assert_close(tiled_paged_attention(q, k_cache, v_cache, tables, positions,
                                                     tile_tokens), expected)
    torch.testing.assert_close(sdpa_paged_attention(q, k_cache, v_cache, tables, positions),
                               expected)


def engine(model, **config):
    return LLM(model, ByteTokenizer(), log=None, **{"block_size": 4, **config})


@pytest.mark.parametrize("config", [
    dict(),  # prefix caching on, whole prompts in one step
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=7),  # chunked prefill
    dict(num_blocks=12, max_num_batched_tokens=16),  # 48 slots for ~100 tokens: preemption
    dict(num_blocks=12, preemption="swap", attention="tiled"),
])
def test_greedy_equals_full_recompute(config):
    model = random_model()
    expected = [reference_greedy(model, prompt, 12) for prompt in PROMPTS]
    llm = engine(model, **config)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [out.token_ids for out in outputs] == expected
    if "num_blocks" in config:
        assert llm.scheduler.num_preemptions > 0
    # Again, now that the prefix cache holds the prompts (when it is on).
    assert [out.token_ids for out in llm.generate(PROMPTS, GREEDY)] == expected
    if llm.config.enable_prefix_caching and "num_blocks" not in config:
        assert llm.block_manager.num_prefix_hits > 0
    assert llm.block_manager.num_used_blocks == 0 and not llm.has_unfinished()


def test_learned_positions_and_moe_models_decode_like_full_recompute():
    for overrides in (dict(position="learned", norm="layernorm", mlp="gelu", bias=True,
                           tie_embeddings=True),
                      dict(num_experts=4, num_experts_per_token=2, num_shared_experts=1)):
        model = random_model(**overrides)
        outputs = engine(model, max_num_batched_tokens=9).generate(PROMPTS[:2], GREEDY)
        assert [o.token_ids for o in outputs] == [reference_greedy(model, p, 12)
                                                  for p in PROMPTS[:2]]


def test_seeded_sampling_is_reproducible_and_n_samples_fork():
    model = random_model()
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=7, n=3,
                            ignore_eos=True)
    first = engine(model).generate([PROMPTS[0]], params)[0]
    # Same seed, other requests in the batch and a tiny pool: the same samples.
    llm = engine(model, num_blocks=14)
    again = llm.generate([PROMPTS[3], PROMPTS[0]], [GREEDY, params])[1]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) == 3
    assert llm.block_manager.num_used_blocks == 0
    # Greedy samples are all the greedy answer: the forks copied the shared last block right.
    greedy = llm.generate([PROMPTS[1]], GREEDY.replace(n=2))[0]
    expected = reference_greedy(model, PROMPTS[1], 12)
    assert [o.token_ids for o in greedy.outputs] == [expected, expected]
    # Siblings outgrow a pool that holds one: the newer is swapped out (its shared blocks too)
    # while the older decodes, and comes back.
    swapping = engine(model, num_blocks=7, preemption="swap")
    greedy = swapping.generate([PROMPTS[1]], GREEDY.replace(n=2))[0]
    assert [o.token_ids for o in greedy.outputs] == [expected, expected]
    assert swapping.scheduler.num_preemptions > 0 and swapping.block_manager.num_used_blocks == 0


def test_text_streaming_stop_strings_and_abort():
    model = random_model()
    llm = engine(model)
    full = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    deltas = [out.outputs[0].delta_text for out in llm.stream(
        "Hello", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))]
    assert "".join(deltas) == full.text == ByteTokenizer().decode(full.token_ids)
    stop = full.text[5:7]
    cut = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=20, stop=stop))[0]
    assert cut.text == full.text[:full.text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop"
    stream = llm.stream("Hello", SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    assert llm.block_manager.num_used_blocks > 0
    stream.close()  # the consumer went away: the request is aborted, its blocks freed
    assert llm.block_manager.num_used_blocks == 0 and not llm.has_unfinished()


def test_requests_that_cannot_run_are_rejected():
    llm = engine(random_model(), num_blocks=8)  # 32 slots
    with pytest.raises(RequestRejected, match="KV blocks"):
        llm.add_request([1] * 20, SamplingParams(max_tokens=20))
    with pytest.raises(RequestRejected, match="context length 128"):
        llm.add_request([1] * 100, SamplingParams(max_tokens=29))
    vocab = llm.model_config.vocab_size
    for ids in ([5, -1, 7], [vocab, 3]):
        with pytest.raises(ConfigError, match=f"0..{vocab - 1}"):
            llm.add_request(ids, SamplingParams(max_tokens=2))
    assert not llm.has_unfinished()
    ids = llm.generate([torch.tensor([vocab - 1, 0])], SamplingParams(max_tokens=2))[0] \
        .prompt_token_ids  # ids of any integer type become Python ints
    assert ids == [vocab - 1, 0] and all(type(token) is int for token in ids)


def save_random_hf_model(folder, model_type):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_class, model_class = classes[model_type]
    config = config_class(vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128, tie_word_embeddings=False,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                nn.init.normal_(param, 0, 0.15)
            else:  # norm weights (and qwen2's qkv biases): random around their init
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    return model.eval()


def hf_greedy(hf_model, prompts, max_tokens=12):
    """HF generate()'s greedy continuation of each prompt."""
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                    do_sample=False,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        expected.append(out[0, len(prompt):].tolist())
    return expected


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_greedy_equals_hf_generate(tmp_path, model_type):
    hf_model = save_random_hf_model(tmp_path, model_type)
    expected = hf_greedy(hf_model, PROMPTS)
    for config in (dict(), dict(enable_prefix_caching=False), dict(num_blocks=12)):
        llm = LLM(tmp_path, log=None, block_size=4, **config)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected, config


def test_kv_pool_is_sized_from_the_memory_budget():
    config = resolve_model("tiny")  # 2 layers x K and V x 2 KV heads x head_dim 16 x 4 bytes
    assert kv_bytes_per_token(config, 4) == 2 * 2 * 2 * 16 * 4 == 512
    plan = plan_kv_pool(config, "fp32", torch.device("cpu"), block_size=16,
                        kv_memory=parse_bytes("1MiB"), swap_memory=parse_bytes("64KiB"),
                        max_model_len=128)
    assert (plan.num_blocks, plan.num_cpu_blocks, plan.num_tokens) == (128, 8, 2048)
    assert "128 blocks of 16 tokens = 2048 tokens" in plan.describe()
    assert "max concurrent sequences: 16 at the full context of 128" in plan.describe()
    with pytest.raises(ConfigError, match="raise --kv-memory"):
        plan_kv_pool(config, "fp32", torch.device("cpu"), 16, 100, 0, 128)
    with pytest.raises(ConfigError, match="memory size"):
        parse_bytes("lots")


def test_a_step_takes_in_requests_and_hashes_waiting_prompts_before_reading_its_ids(monkeypatch):
    """The host work that no sampled token changes happens in the window where the device
    computes the step, before the one device-to-host copy (the sampled ids)."""
    llm = engine(random_model(), max_num_seqs=1)
    llm.add_request(PROMPTS[3], GREEDY.replace(max_tokens=2))
    step_reads, tolist = [], torch.Tensor.tolist

    def read(tensor):
        step_reads.append([(seq.request_id, len(seq.block_hashes))
                           for seq in llm.scheduler.waiting])
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", read)
    original_execute = llm._execute

    def execute_while_a_request_arrives(plan):
        llm.add_request(PROMPTS[0], GREEDY.replace(max_tokens=2), request_id="late")
        return original_execute(plan)

    llm._execute = execute_while_a_request_arrives
    llm.step()
    # The request that arrived during the step waits (one sequence at a time), hashed already:
    # its 12 tokens fill 2 blocks of 4 before the last token's block.
    assert step_reads == [[("late", (len(PROMPTS[0]) - 1) // 4)]]
