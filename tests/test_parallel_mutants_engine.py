"""The pieces of tetrad.parallel.engine every data-parallel engine shares, in one process, each
against an independent reference: torch's own loss-scale update and DDP bucket sizes, torch's
AdamW stepping the same parameters, and bytes counted from the tensors' shapes."""

import torch
import torch.distributed as dist
import torch.nn.parallel.distributed as torch_ddp

from tetrad.parallel.engine import (DEFAULT_BUCKET_BYTES, FIRST_BUCKET_BYTES, DataParallelOptions,
                                    LossScaler, WholeAdamW, named_state, optimizer_state_bytes,
                                    tensor_bytes)
from tetrad.parallel.mesh import Group
from tetrad.planner import eager_state


def test_bucket_sizes_are_torch_ddps_and_the_planners():
    assert DEFAULT_BUCKET_BYTES == torch_ddp._DEFAULT_BUCKET_CAP_MB * 1024 * 1024
    assert FIRST_BUCKET_BYTES == dist._DEFAULT_FIRST_BUCKET_BYTES
    assert (eager_state.BUCKET_BYTES, eager_state.FIRST_BUCKET_BYTES) == (
        DEFAULT_BUCKET_BYTES, FIRST_BUCKET_BYTES)


def test_loss_scale_follows_torchs_grad_scaler_update():
    overflows = [False, False, True, False, False, False, False, True, True, False, False, False]
    scaler = LossScaler(scale=1024.0, growth_interval=3)
    scale, growth = torch.tensor([1024.0]), torch.tensor([0], dtype=torch.int32)
    for found_inf in overflows:
        scaler.update(found_inf)
        torch._amp_update_scale_(scale, growth, torch.tensor([float(found_inf)]), 2.0, 0.5, 3)
        assert (scaler.scale, scaler.clean_steps) == (scale.item(), growth.item()), overflows
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert (restored.scale, restored.clean_steps) == (scaler.scale, scaler.clean_steps)
    assert LossScaler().scale == 2.0 ** 16


def options():
    return DataParallelOptions(lambda view: [{"params": list(view.parameters())}],
                               lambda groups: torch.optim.AdamW(groups, lr=0.1), (0.9, 0.999),
                               1e-8)


def whole(replica_index=0, seed=0):
    torch.manual_seed(seed)
    named = {"w": torch.nn.Parameter(torch.randn(3, 4)), "b": torch.nn.Parameter(torch.randn(4))}
    return WholeAdamW(named, options(), Group("dp", (0, 1), replica_index)), named


def test_whole_adamw_is_torchs_adamw_with_scaled_and_clipped_gradients():
    engine, named = whole()
    reference = {name: torch.nn.Parameter(p.detach().clone()) for name, p in named.items()}
    torch_adamw = torch.optim.AdamW(list(reference.values()), lr=0.1)
    for step in range(3):
        grads = {name: torch.randn_like(p) for name, p in named.items()}
        for name, param in named.items():
            param.grad = grads[name] * 8.0
            reference[name].grad = grads[name] * 0.25
        engine.unscale(8.0)
        engine.clip(0.25)
        square = engine.grad_square(lambda name, param, grad: grad, torch.device("cpu"))
        assert square.dtype == torch.float64
        torch.testing.assert_close(square, sum(g.double().square().sum() for g in (
            reference["w"].grad, reference["b"].grad)))
        only_bias = engine.grad_square(lambda n, p, g: g if n == "b" else None,
                                       torch.device("cpu"))
        torch.testing.assert_close(only_bias, reference["b"].grad.double().square().sum())
        engine.step(lr=0.05 * (step + 1))
        for group in torch_adamw.param_groups:
            group["lr"] = 0.05 * (step + 1)
        torch_adamw.step()
        for name in named:
            torch.testing.assert_close(named[name], reference[name], rtol=0, atol=0)
    assert engine.optimizer_step() == 3


def test_whole_adamw_checkpoint_round_trip_and_byte_counts():
    engine, named = whole()
    for param in named.values():
        param.grad = torch.ones_like(param)
    engine.step(lr=0.1)
    state = named_state(named, engine.optimizer)
    moments = {"step": engine.optimizer_step(), "exp_avg": state["exp_avg"],
               "exp_avg_sq": state["exp_avg_sq"]}
    params = {name: tensor.clone() for name, tensor in state["model"].items()}
    restored, restored_named = whole(seed=1)
    restored.load(params, moments)
    assert restored.optimizer_step() == 1
    for engine_, named_ in ((engine, named), (restored, restored_named)):
        for param in named_.values():
            param.grad = torch.full_like(param, 0.5)
        engine_.step(lr=0.1)
    for name in named:
        torch.testing.assert_close(restored_named[name], named[name], rtol=0, atol=0)

    numel = 3 * 4 + 4
    # AdamW's state: two moments shaped like the parameters and one fp32 step count each.
    assert optimizer_state_bytes(engine.optimizer) == 2 * numel * 4 + 2 * 4
    assert engine.bytes_held() == {"params": numel * 4, "grads": numel * 4,
                                   "optimizer": 2 * numel * 4 + 2 * 4}
    assert tensor_bytes([torch.zeros(5, dtype=torch.bfloat16), None]) == 10

    place = lambda name, param: (tuple(param.shape), 0, (0, param.shape[0]))  # noqa: E731
    pieces = engine.pieces(("model", "exp_avg"), place)
    assert sorted((p.kind, p.name) for p in pieces) == [
        ("exp_avg", "b"), ("exp_avg", "w"), ("model", "b"), ("model", "w")]
    for piece in pieces:
        assert torch.equal(piece.data, state[piece.kind][piece.name])
        assert piece.global_shape == tuple(named[piece.name].shape)
    assert whole(replica_index=1)[0].pieces(("model",), place) == []
