"""Zero bubble's split backward (tetrad/parallel/pipeline/split_backward.py): B's input gradient
and W's weight gradients equal one whole backward bit for bit, and together they dispatch each
matmul of the backward once (W does not walk the stage's graph again)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tetrad.models.transformer import Transformer
from tetrad.parallel.pipeline.split_backward import input_gradient
from tetrad.parallel.pipeline.stage import PipelineStage
from tetrad.spec.presets import preset


class MatmulCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
        return func(*args, **(kwargs or {}))


def stage_and_batch(index: int):
    torch.manual_seed(0)
    config = preset("tiny").replace(num_layers=4)
    stage = PipelineStage(Transformer(config), index, 3, range(index, index + 1 + (index == 1)))
    x = torch.randn(2, 16, config.hidden_size)
    targets = torch.randint(config.vocab_size, (2, 16))
    grad = torch.randn(2, 16, config.hidden_size)
    return stage, x, targets, grad


def roots(stage, x, targets, grad):
    out = stage(x)
    if stage.is_last:
        return [stage.loss(out, targets)], [None]
    return [out], [grad]


@pytest.mark.parametrize("index", [1, 2])  # a middle stage of two blocks; the last, with the head
def test_b_and_w_equal_one_whole_backward_and_run_each_matmul_once(index):
    stage, x, targets, grad = stage_and_batch(index)
    params = [p for p in stage.parameters() if p.requires_grad]
    whole_x = x.clone().requires_grad_()
    outputs, grads = roots(stage, whole_x, targets, grad)
    with MatmulCount() as whole:
        torch.autograd.backward(outputs, grads)
    expected = [p.grad.clone() for p in params]
    stage.zero_grad(set_to_none=True)

    split_x = x.clone().requires_grad_()
    outputs, grads = roots(stage, split_x, targets, grad)
    with MatmulCount() as b:
        dx, deferred = input_gradient(outputs, grads, split_x, params)
    assert all(p.grad is None for p in params)  # B leaves the weights to W
    with MatmulCount() as w:
        deferred.run()
    assert torch.equal(dx, whole_x.grad)
    for param, reference in zip(params, expected):
        assert torch.equal(param.grad, reference)
    assert b.count + w.count == whole.count
    assert w.count == sum(p.dim() == 2 for p in params)  # one product per weight matrix


def test_a_weight_off_the_inputs_path_gets_its_gradient_from_the_outputs():
    torch.manual_seed(0)
    x = torch.randn(4, 3, requires_grad=True)
    on_path, off_path = torch.randn(3, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    grad = torch.randn(4, 3)

    def outputs():
        return [x @ on_path, (off_path ** 2).sum()]

    torch.autograd.backward(outputs(), [grad, None])
    expected = (x.grad.clone(), on_path.grad.clone(), off_path.grad.clone())
    x.grad = on_path.grad = off_path.grad = None
    dx, deferred = input_gradient(outputs(), [grad, None], x, [on_path, off_path])
    deferred.run()
    assert deferred.unjoined == [off_path]
    assert torch.equal(dx, expected[0])
    assert torch.equal(on_path.grad, expected[1]) and torch.equal(off_path.grad, expected[2])
