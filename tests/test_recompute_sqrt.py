"""--recompute sqrt (√N checkpointing) in one process: the segment rule, losses and parameters
bit for bit those of training without recomputation, and the bytes: what the forward keeps (the
ActivationMeter) and what backward's rerun of one segment saves (counted on the rerun) both equal
the planner's tetrad profile; the Megatron profile and the FLOPs follow the same rule. The
multi-process layouts are in tests/test_recompute_sqrt_dist.py."""

import math

import pytest
import torch
import torch.nn.functional as F

from tetrad.memory import ActivationMeter
from tetrad.models.transformer import Transformer
from tetrad.parallel.recompute import apply_recompute, recompute_peak_bytes
from tetrad.planner.eager_activations import recompute_bytes, stage_bytes
from tetrad.planner.flops import training_flops_per_sequence
from tetrad.planner.layout import TrainLayout
from tetrad.planner.memory import (ActivationOptions, activation_bytes_per_layer,
                                   stage_activation_bytes)
from tetrad.planner.precision import training_precision
from tetrad.spec.layout import sqrt_segments
from tetrad.spec.model import ModelConfig
from tetrad.spec.presets import preset

LLAMA = ModelConfig(name="sqrt-llama", vocab_size=64, hidden_size=32, num_layers=5, num_heads=4,
                    num_kv_heads=2, ffn_hidden_size=64, max_seq_len=64)
GPT2 = LLAMA.replace(norm="layernorm", bias=True, position="learned", mlp="gelu",
                     tie_embeddings=True)
MOE = preset("tiny-moe")
BATCH, SEQ, STEPS = 2, 32, 4
FP32 = training_precision("fp32")


def build(config: ModelConfig, mode: str) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(config)
    apply_recompute(model, mode)
    return model


def loss_of(model: Transformer, step: int) -> torch.Tensor:
    window = torch.randint(model.config.vocab_size, (BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(step))
    loss = F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
    aux = model.aux_loss()
    return loss if aux is None else loss + model.config.router_aux_loss_coef * aux


def test_segments_are_ceil_sqrt_n_consecutive_blocks():
    for blocks in range(0, 40):
        sizes = sqrt_segments(blocks)
        assert sum(sizes) == blocks
        if blocks:
            size = math.ceil(math.sqrt(blocks))
            assert sizes[:-1] == [size] * (len(sizes) - 1) and 0 < sizes[-1] <= size
            assert len(sizes) == math.ceil(blocks / size)


@pytest.mark.parametrize("config", [LLAMA, MOE], ids=["llama", "moe"])
def test_sqrt_leaves_losses_and_parameters_unchanged(config):
    results = []
    for mode in ("none", "sqrt"):
        model = build(config, mode)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        losses = []
        for step in range(STEPS):
            loss = loss_of(model, step)
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        results.append((losses, dict(model.named_parameters())))
    (plain_losses, plain), (losses, params) = results
    assert losses == plain_losses
    for name, value in params.items():
        assert torch.equal(value, plain[name]), name


@pytest.mark.parametrize("config", [LLAMA.replace(num_layers=n) for n in (1, 2, 4, 5, 9)]
                         + [GPT2, MOE], ids=["1", "2", "4", "5", "9", "gpt2", "moe"])
def test_kept_and_rerun_bytes_are_the_planners(config):
    model = build(config, "sqrt")
    meter = ActivationMeter(model)
    with meter.measure():
        loss = loss_of(model, 0)
    kept = meter.finish_microbatch()
    loss.backward()
    layout = TrainLayout(micro_batch=BATCH, recompute="sqrt")
    assert stage_bytes(config, layout, 0, SEQ, FP32) == kept
    assert recompute_bytes(config, layout, 0, SEQ, FP32) == recompute_peak_bytes(model) > 0
    # The forward keeps one hidden state per segment where full keeps one per block.
    full = build(config, "full")
    meter = ActivationMeter(full)
    with meter.measure():
        full_loss = loss_of(full, 0)
    hidden_state = BATCH * SEQ * config.hidden_size * 4
    dropped = config.num_layers - len(sqrt_segments(config.num_layers))
    assert meter.finish_microbatch() - kept == dropped * hidden_state
    full_loss.backward()


def test_megatron_profile_and_flops_follow_the_segments():
    config, s, b = LLAMA.replace(num_layers=10), 64, 2
    options = ActivationOptions(runtime="megatron")
    layout = TrainLayout(micro_batch=b, recompute="sqrt")
    args = (b, s, 1, 1, False)
    plain = [activation_bytes_per_layer(config, layer, *args, "none", options, 2.0)
             for layer in range(10)]
    hidden = activation_bytes_per_layer(config, 0, *args, "full", options, 2.0)
    head = stage_activation_bytes(config, TrainLayout(micro_batch=b, recompute="full"), s,
                                  options, 2.0, 0) - 10 * hidden - max(plain)
    # Three segments of 4, 4 and 2 blocks: three inputs kept, four blocks' internals rerun.
    assert stage_activation_bytes(config, layout, s, options, 2.0, 0) == pytest.approx(
        3 * hidden + sum(plain[:4]) + head)
    assert training_flops_per_sequence(config, s, "sqrt") == training_flops_per_sequence(
        config, s, "full")
