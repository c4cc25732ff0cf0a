"""DeepSeek-V3 in the runtime: MLA, DeepSeek routing and YaRN load from HF folders with
transformers' logits, the absorbed MLA form equals the expanded one, the router does what
DeepSeek's does, one-process training learns, and the layouts that cannot train them refuse in
one line."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from deepseek_models import CASES, VOCAB, hf_config, hf_model  # noqa: E402

from tetrad import load_pretrained  # noqa: E402
from tetrad.spec.model import ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from tetrad.errors import ConfigError  # noqa: E402
from tetrad.spec.hf import model_config_from_hf  # noqa: E402
from tetrad.models.layers import causal_attention  # noqa: E402
from tetrad.models.moe import Router  # noqa: E402
from tetrad.models.transformer import count_parameters  # noqa: E402
from tetrad.planner import model_stats  # noqa: E402
from tetrad.planner.rules import check_deepseek_features, check_tensor_parallel  # noqa: E402
from tetrad.spec.presets import preset  # noqa: E402
from tetrad.train.trainer import train  # noqa: E402


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = hf_model(request.param)
    model.save_pretrained(folder)
    return model, folder


def tokens(seq: int = 48, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_hf_logits_match_transformers(saved):
    hf, folder = saved
    model = load_pretrained(folder)
    ids = tokens()  # 48 positions: past yarn's original 16, where its interpolation matters
    with torch.no_grad():
        expected, actual = hf(ids).logits, model(ids)
    assert expected.abs().max() > 1.0  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def test_the_planner_counts_the_runtime_parameters(saved):
    model = load_pretrained(saved[1])
    assert model_stats.count_parameters(model.config) == count_parameters(model)


def test_absorbed_attention_equals_expanded(saved):
    """The serving engine's form (attention over the latent, kv_up folded into query and output)
    gives the training form's logits: run it through plain causal attention over the call."""
    model = load_pretrained(saved[1])
    ids = tokens(seq=20, batch=1)
    with torch.no_grad():
        expanded = model(ids)
        x = model.embed(ids)
        rope = model.rotary(torch.arange(ids.shape[1]))
        for layer in model.layers:
            x = layer(x, rope, causal_attention)
        absorbed = model.output(model.norm(x))
    torch.testing.assert_close(absorbed, expanded, atol=1e-4, rtol=0)


def router(**fields) -> Router:
    config = ModelConfig(hidden_size=8, num_heads=2, num_experts=8, num_experts_per_token=2,
                         router_score="sigmoid", **fields)
    torch.manual_seed(0)
    return Router(config)


def test_group_limited_routing_picks_only_from_the_best_groups():
    gate = router(num_expert_groups=4, topk_expert_groups=1)
    x = torch.randn(64, 8)
    with torch.no_grad():
        scores = gate.gate(x).sigmoid()
        _, experts, _ = gate(x)
    best_pair = scores.view(64, 4, 2).sum(-1).argmax(-1)  # a group of two: its sum is its score
    assert torch.equal(experts.sort(-1)[0], torch.stack((2 * best_pair, 2 * best_pair + 1), -1))


def test_balancing_bias_steers_the_choice_not_the_weights():
    gate = router(routed_scaling_factor=2.0)
    x = torch.randn(32, 8)
    with torch.no_grad():
        gate.bias[5] = 10.0  # every token now chooses expert 5
        weights, experts, _ = gate(x)
        scores = gate.gate(x).sigmoid()
    assert (experts == 5).any(-1).all()
    chosen = scores.gather(1, experts)
    torch.testing.assert_close(weights, 2.0 * chosen / chosen.sum(-1, keepdim=True))


def test_bias_update_moves_against_the_load():
    gate = router(router_bias_update_rate=0.01).train()
    with torch.no_grad():
        gate.gate.weight.zero_()
        gate.gate.weight[3] = 1.0  # expert 3 scores highest for positive inputs
        gate(torch.rand(16, 8))
    load = gate.load.clone()
    gate.update_bias()
    assert load[3] == 16
    expected = 0.01 * torch.sign(load.mean() - load)
    torch.testing.assert_close(gate.bias.detach(), expected)
    assert gate.load is None


def test_training_a_deepseek_folder_in_one_process_learns(saved, corpus_file, tmp_path):
    """Loss falls, and aux-loss-free balancing moves the routing bias, which the checkpoint
    keeps (selective recompute re-runs MLA's attention core on the way)."""
    _, folder = saved
    start = load_pretrained(folder).layers[1].mlp.router.bias.clone()
    config = TrainConfig(model=str(folder), data=corpus_file, tokenizer="byte", steps=12,
                         batch_size=4, seq_len=32, lr=3e-3, warmup_steps=0, sample_tokens=0,
                         log_every=1, checkpoint_dir=str(tmp_path / "run"),
                         parallel=ParallelConfig(recompute="selective"))
    result = train(config, show_progress=False)
    losses = [step["loss"] for step in result.report["steps"]]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    moved = load_pretrained(result.checkpoint).layers[1].mlp.router.bias - start
    assert float(moved.abs().max()) == pytest.approx(12 * 0.001, abs=1e-6)  # one rate per step
    assert (moved.abs() <= 12 * 0.001 + 1e-6).all()


def test_layouts_that_cannot_train_deepseek_refuse_and_the_others_pass():
    """dp, ZeRO, tp, pp, ep and their compositions train these models
    (tests/test_train_deepseek.py); ring attention and parameter servers refuse, saying why."""
    mla = model_config_from_hf(hf_config("v3").to_dict())
    for layout in (dict(dp=2), dict(tp=2), dict(pp=2), dict(dp=2, ep=2, zero=3),
                   dict(dp=2, tp=2, pp=2)):
        check_deepseek_features(mla, ParallelConfig(**layout))
    with pytest.raises(ConfigError, match="ring attention needs keys and values of one width"):
        check_deepseek_features(mla, ParallelConfig(cp=2))
    with pytest.raises(ConfigError, match="routing bias"):
        check_deepseek_features(mla, ParallelConfig(strategy="ps", servers=1, dp=2))
    mla_softmax = mla.replace(router_score="softmax", router_bias_update_rate=0.0)
    with pytest.raises(ConfigError, match="latent attention"):
        check_deepseek_features(mla_softmax, ParallelConfig(strategy="ps", servers=1, dp=2))
    sigmoid_only = ModelConfig(num_experts=4, num_experts_per_token=2, router_score="sigmoid",
                               router_bias_update_rate=0.001)
    check_deepseek_features(sigmoid_only, ParallelConfig(dp=2, cp=2))  # ring attention is MHA's
    check_tensor_parallel(mla, 4)  # one head per rank
    with pytest.raises(ConfigError, match="shared experts' 6 hidden units"):
        check_tensor_parallel(mla.replace(moe_ffn_hidden_size=6), 4)


def test_training_cli_refuses_a_deepseek_layout_in_one_line(saved, corpus_file, capsys):
    from tetrad.cli.main import main

    code = main(["train", "--model", str(saved[1]), "--data", corpus_file, "--nproc", "2",
                 "--cp", "2", "--steps", "1"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "multi-head latent attention (MLA) does not have" in err
    assert len(err.splitlines()) == 1


def test_deepseek_v3_config_json_maps_to_the_preset():
    """The published DeepSeek-V3 config.json (its model fields, transformers 4 rope_scaling form)
    gives the planner's deepseek-v3 preset, routing and YaRN included."""
    published = {
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
        "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
        "tie_word_embeddings": False, "num_nextn_predict_layers": 1}
    assert model_config_from_hf(published, name="deepseek-v3") == preset("deepseek-v3")
    del published["rope_scaling"]["original_max_position_embeddings"]
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        model_config_from_hf(published)


def test_yarn_needs_its_lengths():
    with pytest.raises(ConfigError, match="rope_original_max_seq_len"):
        ModelConfig(rope_scaling="yarn", rope_factor=4.0)
    with pytest.raises(ConfigError, match="num_expert_groups"):
        ModelConfig(num_experts=6, num_experts_per_token=2, num_expert_groups=4)
