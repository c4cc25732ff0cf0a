"""ParallelModel on a one-rank mesh (no process group: every group is of one) against torch on the
same model: the microbatch cut, the loss, the gradient norm, clipping as
torch.nn.utils.clip_grad_norm_ does it, AdamW's step, the checkpoint pieces and a load of them.
The spawned strategy tests compare layouts of several ranks with the same reference; this pins
the one-rank arithmetic they all build on, cheaply."""

import math

import pytest
import torch
import torch.nn.functional as F
from reference import seeded_model, spread, token_batch

from tetrad.spec.model import ModelConfig, ParallelConfig
from tetrad.parallel.comm import Comm
from tetrad.parallel.mesh import build_mesh
from tetrad.parallel.parallelize import loss_scaler_state

CONFIG = ModelConfig(name="one-rank", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                     num_kv_heads=2, ffn_hidden_size=64, max_seq_len=16)
SEQ = 12


def one_rank(seed=0):
    model = seeded_model(CONFIG, seed)
    return spread(model, build_mesh(ParallelConfig(), 0, 1), Comm(), ParallelConfig(), SEQ)


def step_both(parallel, reference, optimizer, window, max_norm):
    inputs, targets, positions = parallel.split(window)
    assert torch.equal(inputs, window[:, :-1]) and torch.equal(targets, window[:, 1:])
    assert positions.tolist() == list(range(SEQ))
    loss = parallel.loss(parallel.module(inputs), targets)
    expected = F.cross_entropy(reference(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
    torch.testing.assert_close(loss, expected)
    parallel.backward(loss, is_last_microbatch=True)
    parallel.reduce_gradients()
    expected.backward()
    norm = parallel.grad_norm()
    expected_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm))
    assert norm == pytest.approx(expected_norm, rel=1e-6)
    parallel.clip(norm, max_norm)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(parallel.params[name].grad, param.grad, rtol=1e-6, atol=1e-9)
    assert parallel.step(1e-2, norm)
    optimizer.step()
    optimizer.zero_grad()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(parallel.params[name], param, rtol=1e-6, atol=1e-7)
    return norm


def test_one_rank_steps_are_torchs_with_clipping_on_both_sides_of_the_norm():
    parallel, reference = one_rank(), seeded_model(CONFIG, 0)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    first = step_both(parallel, reference, optimizer, token_batch(64, 4, SEQ, 0), max_norm=1e9)
    # A bound below the norm clips by max_norm / (norm + 1e-6); one above leaves it alone.
    second = step_both(parallel, reference, optimizer, token_batch(64, 4, SEQ, 1),
                       max_norm=first / 3)
    assert second > first / 3
    assert parallel.optimizer_step() == 2


def test_clipping_is_skipped_for_no_bound_and_a_non_finite_norm():
    parallel = one_rank()
    window = token_batch(64, 2, SEQ, 0)
    inputs, targets, _ = parallel.split(window)
    parallel.backward(parallel.loss(parallel.module(inputs), targets), True)
    parallel.reduce_gradients()
    before = {name: p.grad.clone() for name, p in parallel.params.items()}
    for norm, max_norm in ((5.0, 0.0), (math.inf, 1.0), (math.nan, 1.0)):
        parallel.clip(norm, max_norm)
    for name, param in parallel.params.items():
        assert torch.equal(param.grad, before[name]), name
    parallel.clip(2.0, 1.0)  # coefficient 1 / (2 + 1e-6)
    for name, param in parallel.params.items():
        torch.testing.assert_close(param.grad, before[name] / (2.0 + 1e-6))


def test_one_rank_writes_every_tensor_whole_and_loads_it_back():
    parallel = one_rank()
    pieces = parallel.checkpoint_pieces(("model",))
    assert sorted(p.name for p in pieces) == sorted(parallel.params)
    for piece in pieces:
        assert piece.global_shape == tuple(parallel.params[piece.name].shape)
        assert piece.dim is None and torch.equal(piece.data, parallel.params[piece.name])
    whole = parallel.whole_state()
    assert whole.keys() == parallel.params.keys()
    other = one_rank(seed=1)
    other.load({"model": whole})
    for name, param in other.params.items():
        assert torch.equal(param, parallel.params[name]), name
    numel = sum(p.numel() for p in parallel.params.values())
    assert parallel.bytes_held()["params"] == 4 * numel


def test_loss_scaler_state_reads_tetrads_and_torchs_grad_scaler():
    assert loss_scaler_state(None) is None
    assert loss_scaler_state({"scale": 8.0, "clean_steps": 3}) == {"scale": 8.0,
                                                                   "clean_steps": 3}
    torch_state = torch.amp.GradScaler("cpu", init_scale=16.0).state_dict()
    assert loss_scaler_state({**torch_state, "_growth_tracker": 5}) == {"scale": 16.0,
                                                                       "clean_steps": 5}
    assert loss_scaler_state({"scale": 4.0}) == {"scale": 4.0, "clean_steps": 0}
