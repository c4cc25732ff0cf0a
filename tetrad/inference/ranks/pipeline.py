"""Pipeline-parallel serving (`--pp P`, with `--tp T` inside each stage): the planner's latency
layout for models too large for one tensor-parallel group.

Stage s holds the consecutive layers the planner assigns it (tetrad.planner.layout.
stage_layer_counts, so `tetrad plan serve` and the engine split alike), the embedding on the first
stage and the final norm and head on the last: training's PipelineStage, given the engine's paged
cache. Each stage's KV pool holds only its own layers; the block ids are rank 0's scheduler's and
the same on every stage.

A step's sequences are cut into up to P microbatches (consecutive sequences, as even as
possible). Stage 0 embeds and runs microbatch 0, sends its activations [1, tokens, hidden] to
stage 1 and goes on with microbatch 1 while stage 1 runs microbatch 0, and so on: with P
microbatches all stages compute at once for most of the step (a forward-only GPipe). The last
stage returns the logits of every microbatch, in order, which are the step's logits in plan
order. Under tensor parallelism each tp rank of a stage sends the whole activations to the same
tp rank of the next stage (after the layer's all-reduce every tp rank holds them).
"""

from __future__ import annotations

import torch
from torch import nn

from tetrad.inference.worker.runner import ModelRunner, StepPlan
from tetrad.parallel.comm import Comm
from tetrad.parallel.mesh import Group
from tetrad.parallel.pipeline.stage import PipelineStage
from tetrad.planner.layout import stage_first_layer, stage_layer_counts

STAGES_TAG = "stages"  # activations from one stage to the next


def serving_stage(model: nn.Module, stage: int, num_stages: int) -> PipelineStage:
    """Stage `stage` of `model` (already split over tp, if it is). The engine sizes the stage's
    KV pool for its `layers` alone."""
    counts = stage_layer_counts(model.config.num_layers, num_stages)
    first = stage_first_layer(counts, stage)
    return PipelineStage(model, stage, num_stages, range(first, first + counts[stage]))


def microbatches(plan: StepPlan, count: int) -> list[StepPlan]:
    """`plan`'s sequences cut into min(count, sequences) consecutive groups of as even sizes as
    possible; block moves stay with the whole step."""
    seqs = len(plan.starts)
    count = min(count, seqs)
    bounds = [seqs * i // count for i in range(count + 1)]
    token_starts = [0]
    for num in plan.num_tokens:
        token_starts.append(token_starts[-1] + num)
    return [StepPlan(plan.token_ids[token_starts[a]:token_starts[b]], plan.starts[a:b],
                     plan.num_tokens[a:b], plan.samples[a:b], plan.tables[a:b])
            for a, b in zip(bounds, bounds[1:])]


class PipelineStep:
    """One rank's stage of a step: its block moves, then every microbatch through its layers."""

    def __init__(self, runner: ModelRunner, group: Group, comm: Comm):
        self.runner, self.group, self.comm = runner, group, comm
        stage: PipelineStage = runner.model
        self.is_first, self.is_last = stage.is_first, stage.is_last
        self.index = group.index
        self.hidden_size = stage.config.hidden_size
        self.dtype = next(stage.parameters()).dtype

    def __call__(self, plans: list[StepPlan]) -> torch.Tensor | None:
        """The step's logits [samples, vocab / tp] on the last stage, None on the others."""
        plan = plans[0]
        cache = self.runner.kv_cache  # swap-outs first, as ModelRunner.execute does them
        cache.swap_out(plan.swap_out)
        cache.copy_blocks(plan.copies)
        cache.swap_in(plan.swap_in)
        logits, sent = [], []
        for micro in microbatches(plan, self.group.size):
            input_ids, positions, context = self.runner.prepare(micro)
            if self.is_first:
                x = input_ids.unsqueeze(0)
            else:
                x = torch.empty((1, len(micro.token_ids), self.hidden_size), dtype=self.dtype,
                                device=input_ids.device)
                self.comm.recv(x, self.index - 1, self.group).wait()
            out = self.runner.forward(x, positions, cache=context)
            if self.is_last:
                logits.append(out[0])
            else:  # kept until sent: the next microbatch starts while this one travels
                out = out.contiguous()
                sent.append((self.comm.send(out, self.index + 1, self.group, STAGES_TAG), out))
        for handle, _ in sent:
            handle.wait()
        return torch.cat(logits) if self.is_last else None
