"""Activation recomputation in one process: losses and parameters after 5 AdamW steps are those
of training without it, bit for bit; the bytes an ActivationMeter counts drop as the mode says,
checked against sizes computed here (full: one hidden state per layer; selective: the [batch,
heads, seq, seq] probabilities when the kernel keeps them, only the log-sum-exp with SDPA's fused
kernel)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tetrad.spec.model import ModelConfig
from tetrad.errors import ConfigError
from tetrad.memory import ActivationMeter
from tetrad.models.layers import causal_attention
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm
from tetrad.parallel.context_parallel import RingAttention, apply_context_parallel
from tetrad.parallel.mesh import Group
from tetrad.parallel.recompute import RecomputedAttention, apply_recompute
from tetrad.spec.presets import preset

LLAMA = ModelConfig(name="rc-llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                    num_kv_heads=2, ffn_hidden_size=64, max_seq_len=64)
MOE = preset("tiny-moe")
BATCH, SEQ, STEPS, SEED = 2, 32, 5, 0


def math_attention(q, k, v):
    """SDPA's math path: it keeps the softmax probabilities [batch, heads, seq, seq]."""
    with sdpa_kernel(SDPBackend.MATH):
        return causal_attention(q, k, v)


def build_model(config: ModelConfig, mode: str, core=None) -> Transformer:
    torch.manual_seed(SEED)
    model = Transformer(config)
    if core is not None:
        for block in model.layers:
            block.attn.core = core
    apply_recompute(model, mode)
    return model


def tokens(step: int, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(LLAMA.vocab_size, (BATCH, seq + 1),
                         generator=torch.Generator().manual_seed(1000 + step))


def loss_of(model: Transformer, window: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
    aux = model.aux_loss()
    return loss if aux is None else loss + model.config.router_aux_loss_coef * aux


def train(config: ModelConfig, mode: str, core=None) -> tuple[list[float], dict]:
    model = build_model(config, mode, core)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, tokens(step))
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def saved_bytes(config: ModelConfig, mode: str, core=None, seq: int = SEQ) -> int:
    """What one forward keeps for backward, as the trainer measures it."""
    model = build_model(config, mode, core)
    meter = ActivationMeter(model)
    with meter.measure():
        loss = loss_of(model, tokens(0, seq))
    held = meter.finish_microbatch()
    loss.backward()  # the recomputation must work, not only the forward
    return held


@pytest.mark.parametrize("config", [LLAMA, MOE], ids=["llama", "moe"])
@pytest.mark.parametrize("mode, core", [("selective", None), ("selective", math_attention),
                                        ("full", None)], ids=["selective", "selective-math",
                                                              "full"])
def test_recompute_leaves_losses_and_parameters_unchanged(config, mode, core):
    expected_losses, expected_params = train(config, "none", core)
    losses, params = train(config, mode, core)
    assert losses == expected_losses
    for name, value in params.items():
        assert torch.equal(value, expected_params[name]), name


def test_full_recompute_keeps_one_hidden_state_per_layer():
    deeper = LLAMA.replace(num_layers=4)
    hidden_state = BATCH * SEQ * LLAMA.hidden_size * 4
    full_growth = saved_bytes(deeper, "full") - saved_bytes(LLAMA, "full")
    none_growth = saved_bytes(deeper, "none") - saved_bytes(LLAMA, "none")
    assert full_growth == 2 * hidden_state
    assert none_growth > 10 * full_growth  # a block keeps far more than its input
    assert saved_bytes(MOE, "full") < saved_bytes(MOE, "none") / 3


def test_selective_recompute_drops_the_quadratic_part_only_where_the_kernel_keeps_one():
    layers, heads = LLAMA.num_layers, LLAMA.num_heads

    def dropped(core, seq):
        return (saved_bytes(LLAMA, "none", core, seq)
                - saved_bytes(LLAMA, "selective", core, seq))

    # The math path keeps the probabilities: what selective drops grows with seq^2, and the
    # quadratic part is exactly one fp32 [batch, heads, seq, seq] per layer (the other tensors
    # it drops or adds are linear in seq and cancel in d(2s) - 2 d(s)).
    quadratic = dropped(math_attention, 2 * SEQ) - 2 * dropped(math_attention, SEQ)
    assert quadratic == layers * BATCH * heads * ((2 * SEQ) ** 2 - 2 * SEQ ** 2) * 4
    # The fused kernel keeps no S x S tensor: selective drops its log-sum-exp and nothing more.
    for seq in (SEQ, 2 * SEQ):
        assert dropped(None, seq) == layers * BATCH * heads * seq * 4


def test_selective_leaves_ring_attention_alone_and_bad_modes_say_what_to_change():
    model = build_model(LLAMA, "none")
    apply_context_parallel(model, Group("cp", (0,), 0), Comm())
    apply_recompute(model, "selective")
    assert all(isinstance(block.attn.core, RingAttention) for block in model.layers)
    model = build_model(LLAMA, "selective")
    assert all(isinstance(block.attn.core, RecomputedAttention) for block in model.layers)
    with pytest.raises(ConfigError, match="--recompute must be one of none, selective, full"):
        apply_recompute(model, "partial")
