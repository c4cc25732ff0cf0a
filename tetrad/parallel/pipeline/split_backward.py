"""The split backward of the zero-bubble schedules without walking the stage's graph twice.

B computes only the stage input's gradient: autograd.grad with respect to the input prunes every
weight-gradient product (a matmul's dW half) and keeps the graph. On the way it captures the
gradient arriving at each node where a weight's branch joins the input's path (the node's
pre-hook), so W starts there: one backward per group of weights from those captured gradients
down to the weights only, the weight halves of the same nodes and no activation gradient again.
This is torch.distributed.pipelining's stage_backward_input / stage_backward_weight, with its
graph analysis reused, except that W accumulates through autograd's AccumulateGrad nodes
(torch.autograd.backward with `inputs`), so a data-parallel engine's post-accumulate-grad hooks
see the gradients as after a whole backward.

A weight whose branch never meets the input's path (nothing of that kind in a Transformer stage,
but possible) has nothing captured to start from: W reaches it by a backward from the outputs,
restricted to such weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import (_get_grad_fn_or_grad_acc,
                                                    construct_reverse_graph, get_param_groups)


@dataclass
class DeferredWeights:
    """What B leaves for W: per weight group, its nodes on the input path with their captured
    incoming gradients; the outputs with their gradients, kept until W whatever it needs (a
    microbatch's saved activations are then freed together, at W, as the activation meter and the
    planner count them); and the weights off the input path, reached from the outputs."""

    groups: list[dict[str, Any]]
    outputs: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    params: list[torch.Tensor]
    unjoined: list[torch.Tensor] = field(default_factory=list)

    def run(self) -> None:
        """The weight gradients, accumulated into .grad."""
        if any(param.untyped_storage().nbytes() == 0 for param in self.params):
            # ZeRO-3 keeps the weights sharded between uses and gathers a unit from a hook on its
            # output's gradient, which a backward starting at the captured nodes never passes;
            # a recomputed block reads its weights again. Walk down from the outputs instead.
            torch.autograd.backward(self.outputs, self.grads, inputs=self.params)
            return
        for group in self.groups:
            captured = group.get("grads") or [None] * len(group["intermediates"])
            edges, grads = [], []
            for node, incoming in zip(group["intermediates"], captured):
                for index, grad in enumerate(incoming or ()):
                    if grad is not None:
                        edges.append(GradientEdge(node, index))
                        grads.append(grad)
            if not edges:
                continue
            # One node of the group may lie below another on the input path: the backward
            # from the upper one reaches it, and its own captured gradient already holds that
            # share, so its input is pinned to what B saw (as stage_backward_weight does).
            handles = ([node.register_prehook(lambda _, seen=incoming: seen)
                        for node, incoming in zip(group["intermediates"], captured)]
                       if len(group["intermediates"]) > 1 else [])
            try:
                # Kept for the backward from the outputs when weights off the path need it.
                torch.autograd.backward(edges, grads, retain_graph=bool(self.unjoined),
                                        inputs=[accumulator.variable
                                                for accumulator in group["params"]])
            finally:
                for handle in handles:
                    handle.remove()
        if self.unjoined:
            torch.autograd.backward(self.outputs, self.grads, inputs=self.unjoined)


def input_gradient(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   x: torch.Tensor, params: Sequence[torch.Tensor]
                   ) -> tuple[torch.Tensor, DeferredWeights]:
    """B: d outputs / d x (the leaf `x`, the stage input) with `grads` the outputs' incoming
    gradients (None for a scalar objective), and what W needs for `params`."""
    reverse = construct_reverse_graph([output.grad_fn for output in outputs])
    accumulators = {_get_grad_fn_or_grad_acc(param): param for param in params}
    # Only the weights this microbatch's graph reaches (an expert no token chose is left alone).
    reached = [node for node in accumulators if node in reverse]
    groups = get_param_groups([_get_grad_fn_or_grad_acc(x)], reached, reverse)
    handles = []
    for group in groups:
        group["intermediates"] = list(group["intermediates"])
        for index, node in enumerate(group["intermediates"]):
            handles.append(node.register_prehook(_capture(group, index)))
    try:
        (grad,) = torch.autograd.grad(outputs, [x], grads, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    joined = set().union(*(group["params"] for group in groups))
    unjoined = [accumulators[node] for node in reached if node not in joined]
    return grad, DeferredWeights(groups, list(outputs), list(grads), list(params), unjoined)


def _capture(group: dict[str, Any], index: int):
    def hook(incoming: tuple[torch.Tensor | None, ...]) -> None:
        group.setdefault("grads", [None] * len(group["intermediates"]))[index] = incoming
    return hook

