"""The training optimizer: torch's fused AdamW kernel (tetrad.train.optim.build_optimizer) gives
the update of torch's reference single-tensor AdamW, and fp16 loss scaling still skips a step
whose gradients overflowed."""

import torch

from tetrad.spec.model import TrainConfig
from tetrad.models.transformer import Transformer
from tetrad.spec.presets import preset
from tetrad.train.local_strategy import LocalStrategy
from tetrad.train.optim import build_optimizer, parameter_groups, set_learning_rate


def test_fused_adamw_steps_like_the_single_tensor_reference():
    torch.manual_seed(0)
    config = TrainConfig(weight_decay=0.1, beta1=0.9, beta2=0.95)
    fused_model = Transformer(preset("tiny"))
    reference_model = Transformer(preset("tiny"))
    reference_model.load_state_dict(fused_model.state_dict())
    initial = [param.detach().clone() for param in fused_model.parameters()]
    fused = build_optimizer(parameter_groups(fused_model, config.weight_decay), config)
    reference = torch.optim.AdamW(parameter_groups(reference_model, config.weight_decay),
                                  lr=config.lr, betas=(config.beta1, config.beta2), eps=1e-8,
                                  foreach=False)
    assert fused.defaults["fused"]
    # Steps of different sizes and learning rates; gradients of every scale, some tiny, so that
    # eps and the bias corrections matter.
    for step, lr in enumerate((3e-3, 1e-3, 2e-4)):
        for fused_param, reference_param in zip(fused_model.parameters(),
                                                reference_model.parameters()):
            grad = torch.randn_like(fused_param) * 10.0 ** (-step - 2)
            fused_param.grad, reference_param.grad = grad.clone(), grad.clone()
        for optimizer in (fused, reference):
            set_learning_rate(optimizer, lr)
            optimizer.step()
    for (name, fused_param), reference_param in zip(fused_model.named_parameters(),
                                                    reference_model.parameters()):
        torch.testing.assert_close(fused_param, reference_param, rtol=1e-6, atol=1e-7, msg=name)
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused.state[fused_param][moment],
                                       reference.state[reference_param][moment],
                                       rtol=1e-6, atol=1e-12, msg=f"{name} {moment}")
    assert all(not torch.equal(a, b) for a, b in zip(initial, fused_model.parameters()))


def test_fp16_step_with_an_overflowed_gradient_is_skipped():
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    strategy = LocalStrategy(model, TrainConfig(dtype="fp16"), torch.device("cpu"))
    strategy.forward_backward(torch.randint(0, 256, (2, 17)))
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    strategy.finish_gradients()
    before = [param.detach().clone() for param in model.parameters()]
    scale = strategy.scaler.get_scale()
    assert strategy.step(1e-3) is False
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert strategy.scaler.get_scale() < scale
    # The next, finite step moves every parameter.
    strategy.forward_backward(torch.randint(0, 256, (2, 17)))
    strategy.finish_gradients()
    assert strategy.step(1e-3) is True
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
