"""Regional compilation (`--compile`): torch.compile of each transformer block's forward, as
torchtitan does, instead of the whole model. Every block of a model has the same code, so Dynamo
traces it once and the other blocks reuse the graph (their parameters are graph inputs); the
compile time is one block's, whatever the depth.

Where it sits in parallelize's order: after expert, context and tensor parallelism have swapped
the parts inside a block (the compiler sees the block as it will run) and before recomputation,
which wraps the compiled forward in its checkpoint (full recomputation runs the compiled forward
again in backward). Only the forward is compiled, not the module call: hooks on the block (ZeRO-3
gathering its parameters before the forward and releasing them after) stay eager, and pipeline
stages, which call their blocks, get compiled blocks for free.

Graph breaks (the block is then compiled in pieces, and what lies between runs eagerly):
- at every collective: tetrad.parallel.comm runs them outside any graph (`eager_collective`),
  so a tensor-parallel block breaks at each f/g operator and ring attention at its core;
- around an MoE layer (its routing has data-dependent token counts, under EP an all-to-all) runs
  eagerly as a whole: the block breaks around it.

One process compiles its loss on the logits too (a CompiledForward in LocalStrategy).

Only forwards that record a graph for backward run compiled: evaluation and sampling run without
gradients over changing shapes, each of which would compile anew, so they stay eager.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from tetrad.models.transformer import Transformer


def inductor_for_repeated_backward(graph: torch.fx.GraphModule, example_inputs: list):
    """Inductor, with a backward that may run twice over one retained graph: zero bubble's split
    backward runs a block's backward for the input gradient (B), then again for the weight
    gradients (W). Inductor's default lets a backward reuse ("donate") the memory of the tensors
    saved for it, which a second run would read after they were overwritten. Being a backend of
    its own, its graphs are cached apart from the plain inductor ones in memory; on disk, torch
    2.13's AOTAutograd cache was seen handing back a graph compiled with donation, so these
    graphs bypass it."""
    from torch._inductor.compile_fx import compile_fx

    with torch._functorch.config.patch(donated_buffer=False, enable_autograd_cache=False):
        return compile_fx(graph, example_inputs)


class CompiledForward:
    """A block's forward, compiled for the training step and eager without gradients."""

    def __init__(self, forward: Callable, repeated_backward: bool = False):
        self.eager = forward
        # Static shapes: a training run's microbatches all have one shape.
        self.compiled = torch.compile(
            forward, dynamic=False,
            backend=inductor_for_repeated_backward if repeated_backward else "inductor")

    def __call__(self, *args, **kwargs):
        if torch.is_grad_enabled():
            return self.compiled(*args, **kwargs)
        return self.eager(*args, **kwargs)


def apply_compile(model: Transformer, repeated_backward: bool = False) -> None:
    """Compile each block of `model` (regional compilation; see the module docstring). Apply
    after the layouts that swap parts inside a block and before recomputation.
    `repeated_backward`: a pipeline schedule that splits the backward (zero bubble)."""
    for block in model.layers:
        if block.is_moe:
            moe = block.mlp  # MoE or expert parallelism's ExpertParallelMoE
            moe.forward = torch.compiler.disable(moe.forward, recursive=True)
        block.forward = CompiledForward(block.forward, repeated_backward)


class CompileClock:
    """Seconds spent compiling in this process since it was made: Dynamo's tracing and the
    backend's code generation, for the forward and (compiled lazily, at the first backward) the
    backward. The trainer subtracts it from the step that paid for it."""

    def __init__(self) -> None:
        from torch._dynamo.callback import callback_handler

        self.seconds = 0.0
        self._started: float | None = None
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        self._handler = callback_handler

    def _start(self, _args) -> None:
        self._started = time.perf_counter()

    def _end(self, _args) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def close(self) -> None:
        self._handler.remove_start_callback(self._start)
        self._handler.remove_end_callback(self._end)
